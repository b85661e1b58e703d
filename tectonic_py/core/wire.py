"""The wire protocol every tectonic-py process speaks: framed, multiplexed, authenticated RPC.

Frame format (version field first; integers big-endian)::

    offset  size  field
    0       1     version      (1)
    1       1     flags        (0; reserved)
    2       2     reserved     (0)
    4       4     header_len   H, 1 <= H <= Limits.max_header
    8       4     payload_len  P, 0 <= P <= Limits.max_payload
    12      H     header       msgpack map
    12+H    P     payload      raw bytes, never passed through msgpack

Headers:

* request:  ``{"op": str, "rid": int, "f": {fields}}``
* response: ``{"rid": int, "f": {fields}}``
* error:    ``{"rid": int, "err": code, "msg": str}`` (``rid`` 0 for connection-level errors)

A chunk payload travels after its header and is received (``os.readv`` on the socket's fd,
``_recv_exactly``) straight into a buffer the receiver owns, so a 4 MiB chunk is never
copied through msgpack and never assembled from many small ``bytes`` objects (nearly 2x on
loopback, see CEILINGS.md).

Handshake (mutual, over the cluster secret; before any request):

1. server -> client ``{"op": "hello", "proto": 1, "nonce": 32 random bytes}``
2. client -> server ``{"op": "auth", "nonce": cn, "mac": HMAC(secret, "client" | sn | cn)}``
3. server -> client ``{"op": "welcome", "mac": HMAC(secret, "server" | cn | sn)}``,
   or an ``auth`` error frame and the connection is closed (and logged).

The client checks the server's MAC too, so neither side talks to an impostor.

Error handling: a frame whose prefix or header cannot be trusted (bad version, oversized
lengths, undecodable or misshapen header) gets an error frame with rid 0 and the connection
is closed: after that point framing itself is in doubt. An unknown op or a bad field gets an
error frame for that request and the connection keeps serving. Domain errors raised by a
handler are encoded to their code here, in ``error_to_header``, the only place that does so.

Admission control: each connection has at most ``max_inflight`` requests being handled (the
reader stops reading, so TCP pushes back on the client); the memory of payloads held across
all connections (each charged the size of the buffer it lies in) is bounded by
``payload_budget``; when more than ``max_payload_waiters`` requests wait for budget, new ones
are refused with the retryable ``Busy`` (their payload is drained off the socket first, so
the connection stays usable).

TLS: the frame layer needs only a byte stream it can read and write by file descriptor; an
untrusted network would wrap the socket in TLS below this layer (kTLS keeps plain reads and
writes on the fd).
"""

from __future__ import annotations

import builtins
import hashlib
import hmac
import ipaddress
import itertools
import logging
import math
import mmap
import os
import secrets
import socket as _stdlib_socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from tectonic_py.core.aio import acquire_soon, open_service_nursery
from tectonic_py.core.buffers import (  # noqa: F401 (callers' names until they import buffers)
    HUGE_PAGE,
    Piped,
    SpareBuffers,
    huge_page_buffer,
    whole_huge_pages,
)
from tectonic_py.core.buffers import send_piped as _send_piped
from tectonic_py.core.errors import (
    AuthError,
    Busy,
    InvalidArgument,
    ProtocolError,
    TectonicError,
    Unavailable,
    UnknownOp,
    error_from_code,
)
from tectonic_py.core.framing import (
    DEFAULT_LIMITS,
    IOV_MAX,
    PREFIX,
    Buffer,
    Limits,
    MiB,
)
from tectonic_py.core.framing import PeerClosed as _Closed
from tectonic_py.core.framing import drain as _drain
from tectonic_py.core.framing import pack_frame as _pack_frame
from tectonic_py.core.framing import read_prefix_and_header as _read_prefix_and_header
from tectonic_py.core.framing import recv_exactly as _recv_exactly
from tectonic_py.core.framing import send_all as _send_all
from tectonic_py.core.framing import send_frame as _send_frame
from tectonic_py.core.framing import send_pieces as _send_pieces

log = logging.getLogger(__name__)

PROTO = 1


def load_secret(path: str | os.PathLike[str]) -> bytes:
    """Read a cluster secret file; refuse one too short to be a secret."""
    from tectonic_py.core.errors import ConfigError

    try:
        with open(path, "rb") as f:
            data = f.read().strip()
    except OSError as e:
        raise ConfigError(f"cannot read secret file {os.fspath(path)!r}: {e.strerror}") from None
    if len(data) < 16:
        raise ConfigError(f"secret file {os.fspath(path)!r} holds under 16 bytes")
    return data


def _mac(secret: bytes, role: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, role + b"|" + a + b"|" + b, hashlib.sha256).digest()


def error_to_header(rid: int, exc: BaseException) -> dict[str, Any]:
    """Encode an exception as an error header: the server's one place for this mapping."""
    if isinstance(exc, TectonicError):
        return {"rid": rid, "err": exc.code, "msg": exc.message}
    log.exception("internal error handling request %d", rid, exc_info=exc)
    return {"rid": rid, "err": "internal", "msg": f"internal error: {type(exc).__name__}"}


# Congestion control for connections that never leave the host, in order of preference
# (reno is one every process may choose).
LOOPBACK_CONGESTION = ("cubic", "reno")


def _unpaced_on_loopback(sock: trio.socket.SocketType) -> None:
    """Give a loopback TCP connection a congestion control that does not pace its sends.

    Why: with BBR as the system's default and no fq qdisc (loopback has no qdisc at all),
    the kernel paces every send with its own timers ("TCP internal pacing"). On the project
    machine that was about three timer softirqs per 1 MiB put: the sender used 27% more CPU
    and 1 MiB puts to a chunk store over loopback ran 9% slower than with cubic (16 A/B
    rounds each). Pacing spares a network's queues; loopback has none. Connections to
    other hosts keep the system's choice, and a failure here changes nothing.
    """
    try:
        addr = ipaddress.ip_address(str(sock.getpeername()[0]).split("%")[0])
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        if not addr.is_loopback:
            return
        tcp = _stdlib_socket.IPPROTO_TCP
        current = sock.getsockopt(tcp, _stdlib_socket.TCP_CONGESTION, 16)
        if current.split(b"\0")[0].decode() in LOOPBACK_CONGESTION:
            return
    except (OSError, ValueError, AttributeError):  # (AttributeError: no TCP_CONGESTION)
        return
    for name in LOOPBACK_CONGESTION:
        try:
            sock.setsockopt(tcp, _stdlib_socket.TCP_CONGESTION, name.encode())
            return
        except OSError:  # not built in, or not allowed to this process
            continue


MAX_QUEUED_REPLIES = 64  # small replies a connection's outbox holds before senders wait


class _Outbox:
    """A connection's small reply frames (those without a payload), sent together.

    Why: on loopback every ``writev`` of a reply also runs the peer's TCP input and wakes
    the peer, about 60 microseconds of the chunk store's event loop per 20-byte put reply
    (cProfile, 1 MiB puts). Replies that become ready in one pass of the scheduler (the
    writer process's answers are read all at once) leave in one ``writev``: the first sender
    yields once, so that the others can add theirs, then sends everything queued; 1.7 put
    replies per ``writev`` on average, measured. A sender returns before its frame is on the
    wire; a failed send fails the connection, which the peer sees as it would any other
    lost reply.

    A peer that sends requests but does not read its replies must not grow the queue
    without bound (its handlers return, so its in-flight limit would no longer hold it
    back): past ``MAX_QUEUED_REPLIES`` frames, a sender waits, holding its request's
    in-flight slot, until the flushing task has taken the queue.
    """

    def __init__(self, sock: trio.socket.SocketType, lock: trio.Lock, stats: ServerStats) -> None:
        self.sock = sock
        self.lock = lock  # held by whoever writes to the socket
        self._stats = stats
        self._frames: list[memoryview] = []
        self._flushing = False
        self._taken = trio.Event()  # set (and replaced) whenever the flusher takes frames

    @property
    def queued(self) -> int:
        return len(self._frames)

    async def send(self, frame: bytes) -> None:
        self._frames.append(memoryview(frame))
        if self._flushing:  # (the task flushing sends it)
            while self._flushing and len(self._frames) > MAX_QUEUED_REPLIES:
                await self._taken.wait()
            return
        self._flushing = True
        try:
            await trio.lowlevel.cancel_shielded_checkpoint()
            await acquire_soon(self.lock)
            try:
                while self._frames:
                    frames, self._frames = self._frames[:IOV_MAX], self._frames[IOV_MAX:]
                    self._release_waiters()
                    self._stats.reply_writes += 1
                    await _send_pieces(self.sock, frames, None)
            finally:
                self.lock.release()
        finally:
            self._flushing = False
            self._release_waiters()  # (they go; the next sender flushes what is left)

    def _release_waiters(self) -> None:
        self._taken.set()
        self._taken = trio.Event()


# --- server side ---------------------------------------------------------------------------


class Request:
    """One decoded request as a handler sees it: validated typed access to its fields."""

    __slots__ = ("buffer", "fields", "op", "payload", "peer")

    def __init__(
        self,
        op: str,
        fields: dict[str, Any],
        payload: memoryview | None,
        peer: str,
        buffer: memoryview | None = None,
    ) -> None:
        self.op = op
        self.fields = fields
        self.payload = payload
        self.peer = peer
        # For ops with a ``payload_room``: the whole page-aligned buffer the payload was
        # received into, at the offset the room asked for (the handler may write around it).
        self.buffer = buffer

    _MISSING: Any = object()

    def _get(self, name: str, kinds: type | tuple[type, ...], default: Any) -> Any:
        value = self.fields.get(name, self._MISSING)
        if value is self._MISSING or value is None:
            if default is self._MISSING:
                raise InvalidArgument(f"{self.op}: missing field {name!r}")
            return default
        if not isinstance(value, kinds) or (isinstance(value, bool) and kinds is int):
            raise InvalidArgument(f"{self.op}: field {name!r} has the wrong type")
        return value

    def str(self, name: str, default: Any = _MISSING, *, max_len: int = 4096) -> Any:
        value = self._get(name, str, default)
        if isinstance(value, str) and len(value) > max_len:
            raise InvalidArgument(f"{self.op}: field {name!r} longer than {max_len}")
        return value

    def int(
        self,
        name: builtins.str,
        default: Any = _MISSING,
        *,
        lo: builtins.int = 0,
        hi: builtins.int = 2**64 - 1,
    ) -> Any:
        value = self._get(name, int, default)
        if isinstance(value, int) and not lo <= value <= hi:
            raise InvalidArgument(f"{self.op}: field {name!r} outside {lo}..{hi}")
        return value

    def float(self, name: builtins.str, default: Any = _MISSING) -> Any:
        value = self._get(name, (int, float), default)
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidArgument(f"{self.op}: field {name!r} is not finite")
        return value

    def bytes(
        self, name: builtins.str, default: Any = _MISSING, *, max_len: builtins.int = 65536
    ) -> Any:
        value = self._get(name, bytes, default)
        if isinstance(value, bytes) and len(value) > max_len:
            raise InvalidArgument(f"{self.op}: field {name!r} longer than {max_len}")
        return value

    def bool(self, name: builtins.str, default: Any = _MISSING) -> Any:
        return self._get(name, bool, default)

    def list(
        self, name: builtins.str, default: Any = _MISSING, *, max_len: builtins.int = 100_000
    ) -> Any:
        value = self._get(name, list, default)
        if isinstance(value, list) and len(value) > max_len:
            raise InvalidArgument(f"{self.op}: field {name!r} has over {max_len} items")
        return value

    def map(self, name: builtins.str, default: Any = _MISSING) -> Any:
        return self._get(name, dict, default)

    def require_payload(self) -> memoryview:
        if self.payload is None:
            raise InvalidArgument(f"{self.op}: payload required")
        return self.payload


# A handler's reply: fields, fields and a payload, or fields, a payload and a callback the
# server calls once the payload is sent or dropped (so the handler can reuse its buffer or
# close its pipes).
Reply = (
    dict[str, Any]
    | tuple[dict[str, Any], Buffer | Piped]
    | tuple[dict[str, Any], Buffer | Piped, Callable[[], None]]
    | None
)
Handler = Callable[[Request], Awaitable[Reply]]


@dataclass
class ServerStats:
    connections: int = 0
    requests_in_flight: int = 0
    payload_bytes_held: int = 0
    payload_waiters: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    requests: int = 0
    auth_failures: int = 0
    protocol_errors: int = 0
    busy_refusals: int = 0
    reply_writes: int = 0  # reply writes (small replies ready together share one)


class _PayloadBudget:
    """Bounded bytes of request payloads held in memory across all connections.

    Taking free budget does not yield (the request loop checkpoints once per request
    anyway): every pass through trio's scheduler costs the chunk store's event loop thread
    CPU and an epoll_wait that hands the GIL to its worker threads.
    """

    def __init__(self, capacity: int, max_waiters: int, stats: ServerStats) -> None:
        self.capacity = capacity
        self.max_waiters = max_waiters
        self.stats = stats
        self._free = capacity
        self._lot = trio.lowlevel.ParkingLot()

    def can_queue(self) -> bool:
        return self.stats.payload_waiters < self.max_waiters

    async def acquire(self, n: int) -> None:
        n = min(n, self.capacity)
        if self._free < n:
            self.stats.payload_waiters += 1
            try:
                while self._free < n:
                    await self._lot.park()
            finally:
                self.stats.payload_waiters -= 1
        self._free -= n
        self.stats.payload_bytes_held += n

    def release(self, n: int) -> None:
        n = min(n, self.capacity)
        self._free += n
        self.stats.payload_bytes_held -= n
        self._lot.unpark_all()


class RpcServer:
    """Serves a table of handlers over the wire protocol.

    ``serve`` follows trio's convention: ``await nursery.start(server.serve, host, 0)``
    returns the bound ``(host, port)``.
    """

    def __init__(
        self,
        name: str,
        secret: bytes,
        handlers: Mapping[str, Handler],
        limits: Limits = DEFAULT_LIMITS,
        payload_room: Mapping[str, Callable[[int], tuple[int, int]]] | None = None,
        make_buffer: Callable[[int], mmap.mmap] | None = None,
        huge_buffers: bool = False,
    ) -> None:
        """``payload_room[op](plen) -> (offset, size)``: receive that op's payload at
        ``offset`` of a page-aligned buffer of ``size`` bytes, given to the handler as
        ``Request.buffer`` (the chunk store receives a put where its file image needs it).
        ``make_buffer``: how large payload buffers are made, ``huge_buffers``: in whole huge
        pages (``SpareBuffers``)."""
        self.name = name
        self.payload_room = dict(payload_room or {})
        self._secret = secret
        self.handlers = dict(handlers)
        self.limits = limits
        self.stats = ServerStats()
        self._budget = _PayloadBudget(limits.payload_budget, limits.max_payload_waiters, self.stats)
        self._spares = SpareBuffers(
            min(limits.payload_budget // 4, 80 * MiB), make_buffer, huge=huge_buffers
        )

    @property
    def buffers(self) -> SpareBuffers:
        """The pool large request payloads are received into (a handler may share it)."""
        return self._spares

    async def serve(
        self,
        host: str,
        port: int,
        *,
        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host, backlog=4096)
        addr = listeners[0].socket.getsockname()
        log.info("%s listening on %s:%d", self.name, addr[0], addr[1])
        task_status.started((addr[0], addr[1]))
        await trio.serve_listeners(self._handle_connection, listeners)

    async def _handle_connection(self, stream: trio.SocketStream) -> None:
        sock = stream.socket
        _unpaced_on_loopback(sock)
        try:
            peer_addr = sock.getpeername()
            peer = f"{peer_addr[0]}:{peer_addr[1]}"
        except OSError:
            peer = "?"
        self.stats.connections += 1
        try:
            with trio.move_on_after(self.limits.auth_timeout) as scope:
                ok = await self._handshake(sock, peer)
            if scope.cancelled_caught:
                log.warning("%s: %s did not authenticate in time; closed", self.name, peer)
                self.stats.auth_failures += 1
                return
            if not ok:
                return
            await self._serve_requests(sock, peer)
        except (_Closed, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            self.stats.connections -= 1
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _handshake(self, sock: trio.socket.SocketType, peer: str) -> bool:
        sn = secrets.token_bytes(32)
        await _send_all(sock, _pack_frame({"op": "hello", "proto": PROTO, "nonce": sn}, 0))
        try:
            header, plen = await _read_prefix_and_header(sock, self.limits)
            if plen or header.get("op") != "auth":
                raise ProtocolError("expected an auth frame")
            cn, mac = header.get("nonce"), header.get("mac")
            if not (isinstance(cn, bytes) and isinstance(mac, bytes) and len(cn) == 32):
                raise ProtocolError("malformed auth frame")
        except ProtocolError as e:
            self.stats.auth_failures += 1
            log.warning("%s: handshake with %s failed: %s; closed", self.name, peer, e)
            await self._send_error_quietly(sock, 0, e)
            return False
        if not hmac.compare_digest(mac, _mac(self._secret, b"client", sn, cn)):
            self.stats.auth_failures += 1
            log.warning("%s: %s failed authentication; closed", self.name, peer)
            await self._send_error_quietly(sock, 0, AuthError("authentication failed"))
            return False
        await _send_all(
            sock, _pack_frame({"op": "welcome", "mac": _mac(self._secret, b"server", cn, sn)}, 0)
        )
        return True

    async def _send_error_quietly(
        self, sock: trio.socket.SocketType, rid: int, exc: BaseException
    ) -> None:
        with trio.move_on_after(1):
            try:
                await _send_all(sock, _pack_frame(error_to_header(rid, exc), 0))
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    async def _serve_requests(self, sock: trio.socket.SocketType, peer: str) -> None:
        send_lock = trio.Lock()
        outbox = _Outbox(sock, send_lock, self.stats)
        inflight = trio.Semaphore(self.limits.max_inflight)
        async with trio.open_nursery() as nursery:
            # A peer that vanishes mid-frame (EOF or reset inside a payload) must end only
            # its own connection: raised here, inside the nursery, it would arrive as an
            # exception group that _handle_connection cannot catch and stop the server.
            try:
                while True:
                    try:
                        header, plen = await _read_prefix_and_header(sock, self.limits)
                    except _Closed:
                        break
                    except ProtocolError as e:
                        self.stats.protocol_errors += 1
                        log.warning("%s: protocol error from %s: %s; closed", self.name, peer, e)
                        await self._send_error_quietly(sock, 0, e)
                        break
                    op, rid, fields = header.get("op"), header.get("rid"), header.get("f", {})
                    if (
                        not isinstance(op, str)
                        or not isinstance(rid, int)
                        or isinstance(rid, bool)
                        or not 0 < rid < 2**63
                        or not isinstance(fields, dict)
                    ):
                        self.stats.protocol_errors += 1
                        log.warning("%s: malformed request header from %s; closed", self.name, peer)
                        await self._send_error_quietly(
                            sock, 0, ProtocolError("malformed request header")
                        )
                        break
                    self.stats.bytes_in += PREFIX.size + plen
                    handler = self.handlers.get(op)
                    if handler is None:
                        await _drain(sock, plen)
                        async with send_lock:
                            await _send_all(
                                sock,
                                _pack_frame(
                                    error_to_header(rid, UnknownOp(f"unknown op {op!r}")), 0
                                ),
                            )
                        continue
                    payload: memoryview | None = None
                    whole: memoryview | None = None
                    buf: bytearray | mmap.mmap | None = None
                    charge = 0  # payload budget taken: the size of the buffer it lies in
                    if plen:
                        room = self.payload_room.get(op)
                        start, size = room(plen) if room is not None else (0, plen)
                        # (a buffer of whole huge pages can be twice the payload: the budget
                        # bounds memory, as the chunk store's reply budget does)
                        charge = self._spares.size_class(size)
                        if self._budget._free < charge and not self._budget.can_queue():
                            await _drain(sock, plen)
                            self.stats.busy_refusals += 1
                            async with send_lock:
                                await _send_all(
                                    sock,
                                    _pack_frame(
                                        error_to_header(
                                            rid, Busy(f"{self.name}: payload queue full")
                                        ),
                                        0,
                                    ),
                                )
                            continue
                        await self._budget.acquire(charge)
                        try:
                            buf = self._spares.take(size)
                            whole = memoryview(buf)[:size]
                            payload = whole[start : start + plen]
                            if room is None or not isinstance(buf, mmap.mmap):
                                whole = None
                            await _recv_exactly(sock, payload)
                        except BaseException:
                            self._budget.release(charge)
                            raise
                    await inflight.acquire()
                    nursery.start_soon(
                        self._run_handler,
                        outbox,
                        inflight,
                        handler,
                        Request(op, fields, payload, peer, whole),
                        rid,
                        charge,
                        buf,
                    )
                    # Only the handler may refer to the buffer now, so that it can be reused.
                    payload = whole = buf = None
            except (_Closed, OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            nursery.cancel_scope.cancel()

    async def _run_handler(
        self,
        outbox: _Outbox,
        inflight: trio.Semaphore,
        handler: Handler,
        request: Request,
        rid: int,
        charged: int,
        buf: bytearray | mmap.mmap | None = None,
    ) -> None:
        """Answer one request; then offer its payload buffer for reuse. The answering is a
        call of its own so that every view it made of the payload (the reply, a view the
        handler returned) is gone when the buffer is checked for live views. ``charged``:
        the payload budget the request holds, given back once its handler returns."""
        sent: list[Callable[[], None]] = []
        try:
            await self._answer(outbox, handler, request, rid, charged, sent)
        finally:
            inflight.release()
            for callback in sent:
                callback()
            if buf is not None:
                self._spares.give_back(buf)

    async def _answer(
        self,
        outbox: _Outbox,
        handler: Handler,
        request: Request,
        rid: int,
        charged: int,
        sent: list[Callable[[], None]],
    ) -> None:
        self.stats.requests += 1
        self.stats.requests_in_flight += 1
        try:
            try:
                reply = await handler(request)
                out_payload: Buffer | Piped | None = None
                if reply is None:
                    out_fields: dict[str, Any] = {}
                elif isinstance(reply, tuple):
                    out_fields, out_payload = reply[0], reply[1]
                    if len(reply) > 2:
                        sent.append(reply[2])  # type: ignore[misc]
                else:
                    out_fields = reply
                header: dict[str, Any] = {"rid": rid, "f": out_fields}
            except trio.Cancelled:
                raise
            except Exception as e:  # noqa: BLE001 (every handler error becomes a wire error)
                header, out_payload = error_to_header(rid, e), None
            finally:
                request.payload = request.buffer = None
                if charged:
                    self._budget.release(charged)
            if out_payload is None:
                size = 0
            elif isinstance(out_payload, Piped):
                size = out_payload.nbytes
            else:
                size = memoryview(out_payload).nbytes
            frame = _pack_frame(header, size)
            if not size:
                await outbox.send(frame)
            else:
                await acquire_soon(outbox.lock)  # no pass through the scheduler
                self.stats.reply_writes += 1
                try:
                    if isinstance(out_payload, Piped):
                        await _send_piped(outbox.sock, frame, out_payload)
                    else:
                        await _send_frame(outbox.sock, frame, out_payload)
                finally:
                    outbox.lock.release()
            self.stats.bytes_out += len(frame) + size
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self.stats.requests_in_flight -= 1


# --- client side ---------------------------------------------------------------------------


@dataclass
class Response:
    """A reply: its fields and, if the server sent one, its payload."""

    fields: dict[str, Any]
    payload: memoryview | None = None


@dataclass
class _Pending:
    done: trio.Event = field(default_factory=trio.Event)
    into: memoryview | None = None
    response: Response | None = None
    error: TectonicError | None = None


class Connection:
    """One authenticated, multiplexed client connection.

    Many ``call``s may be in flight at once from many tasks; replies are matched by request
    id. The receiver task lives in the nursery given to ``connect``; it never raises into that
    nursery: a broken connection fails every pending call with ``Unavailable`` and marks the
    connection ``broken`` so a pool can replace it.
    """

    def __init__(self, sock: trio.socket.SocketType, address: str, limits: Limits) -> None:
        self._sock = sock
        self.address = address
        self.limits = limits
        self._send_lock = trio.Lock()
        self._pending: dict[int, _Pending] = {}
        self._rids = itertools.count(1)
        self.broken: TectonicError | None = None
        self._closed = trio.Event()

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        secret: bytes,
        *,
        nursery: trio.Nursery,
        limits: Limits = DEFAULT_LIMITS,
    ) -> Connection:
        address = f"{host}:{port}"
        try:
            sock = trio.socket.socket(
                _stdlib_socket.AF_INET6 if ":" in host else _stdlib_socket.AF_INET,
                _stdlib_socket.SOCK_STREAM,
            )
            sock.setsockopt(_stdlib_socket.IPPROTO_TCP, _stdlib_socket.TCP_NODELAY, 1)
            await sock.connect((host, port))
            _unpaced_on_loopback(sock)
        except OSError as e:
            sock.close()
            raise Unavailable(f"cannot connect to {address}: {e.strerror or e}") from None
        except BaseException:
            sock.close()  # cancelled mid-connect (a caller's connect timeout): no leaked socket
            raise
        conn = cls(sock, address, limits)
        try:
            with trio.fail_after(limits.auth_timeout):
                await conn._handshake(secret)
        except trio.TooSlowError:
            sock.close()
            raise Unavailable(f"{address}: handshake timed out") from None
        except (_Closed, OSError) as e:
            sock.close()
            raise Unavailable(f"{address}: connection lost during handshake ({e!r})") from None
        except BaseException:
            sock.close()
            raise
        nursery.start_soon(conn._receive_loop)
        return conn

    async def _handshake(self, secret: bytes) -> None:
        header, plen = await _read_prefix_and_header(self._sock, self.limits)
        sn = header.get("nonce")
        if header.get("op") != "hello" or plen or not isinstance(sn, bytes) or len(sn) != 32:
            raise ProtocolError(f"{self.address}: bad hello")
        if header.get("proto") != PROTO:
            raise ProtocolError(f"{self.address}: protocol {header.get('proto')} unsupported")
        cn = secrets.token_bytes(32)
        await _send_all(
            self._sock,
            _pack_frame({"op": "auth", "nonce": cn, "mac": _mac(secret, b"client", sn, cn)}, 0),
        )
        header, plen = await _read_prefix_and_header(self._sock, self.limits)
        if "err" in header:
            raise error_from_code(str(header["err"]), f"{self.address}: {header.get('msg', '')}")
        mac = header.get("mac")
        if header.get("op") != "welcome" or not isinstance(mac, bytes):
            raise ProtocolError(f"{self.address}: bad welcome")
        if not hmac.compare_digest(mac, _mac(secret, b"server", cn, sn)):
            raise AuthError(f"{self.address}: server failed authentication")

    async def _receive_loop(self) -> None:
        try:
            while True:
                header, plen = await _read_prefix_and_header(self._sock, self.limits)
                rid = header.get("rid")
                pending = self._pending.pop(rid, None) if isinstance(rid, int) else None
                if pending is None:
                    # The caller gave up (cancelled); keep framing intact.
                    await _drain(self._sock, plen)
                    if rid == 0 and "err" in header:
                        raise error_from_code(str(header["err"]), str(header.get("msg", "")))
                    continue
                payload: memoryview | None = None
                if plen:
                    if pending.into is not None and len(pending.into) >= plen:
                        payload = pending.into[:plen]
                    else:
                        payload = memoryview(bytearray(plen))
                    await _recv_exactly(self._sock, payload)
                if "err" in header:
                    pending.error = error_from_code(
                        str(header["err"]), f"{header.get('msg', '')} [{self.address}]"
                    )
                else:
                    fields = header.get("f", {})
                    if not isinstance(fields, dict):
                        raise ProtocolError("malformed response header")
                    pending.response = Response(fields, payload)
                pending.done.set()
                await trio.lowlevel.checkpoint()  # one per frame (``_recv_exactly`` has none)
        except _Closed:
            self._fail(Unavailable(f"{self.address} closed the connection"))
        except TectonicError as e:
            self._fail(e if isinstance(e, Unavailable) else Unavailable(f"{self.address}: {e}"))
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
            self._fail(Unavailable(f"{self.address}: connection lost ({e!r})"))
        finally:
            self._sock.close()
            self._closed.set()

    def _fail(self, error: TectonicError) -> None:
        if self.broken is None:
            self.broken = error
        pending, self._pending = self._pending, {}
        for p in pending.values():
            p.error = error
            p.done.set()

    async def call(
        self,
        op: str,
        fields: Mapping[str, Any] | None = None,
        payload: Buffer | None = None,
        *,
        into: memoryview | bytearray | None = None,
    ) -> Response:
        """Send one request and wait for its reply; raises the server's domain error.

        ``into``: a buffer the reply's payload is received into directly (no allocation);
        the returned ``Response.payload`` is then a view of it.
        """
        if self.broken is not None:
            raise self.broken
        rid = next(self._rids)
        pending = _Pending(into=memoryview(into).cast("B") if into is not None else None)
        self._pending[rid] = pending
        size = 0 if payload is None else memoryview(payload).nbytes
        frame = _pack_frame({"op": op, "rid": rid, "f": dict(fields or {})}, size)
        try:
            # A free lock is taken without a pass through the scheduler (one fewer per call;
            # waiting for the reply is the call's checkpoint), but a call already cancelled
            # still sends nothing.
            await trio.lowlevel.checkpoint_if_cancelled()
            await acquire_soon(self._send_lock)
            try:
                if self.broken is not None:
                    raise self.broken
                sent = [0]
                try:
                    await _send_frame(self._sock, frame, payload if size else None, sent)
                except trio.Cancelled:
                    # A half-sent frame poisons the stream: drop the connection. A frame
                    # not started (a trio socket call that is cancelled sent nothing) leaves
                    # it intact: dropping it then failed every other request on it, so one
                    # cancelled hedge or slow get became many failed chunks under a burst.
                    if sent[0]:
                        self._fail(Unavailable(f"{self.address}: send cancelled mid-frame"))
                        self._sock.close()
                    raise
                except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
                    # ClosedResourceError: the receiver (connection lost) or ``aclose`` closed
                    # the socket while this send waited for room in it.
                    self._fail(Unavailable(f"{self.address}: send failed ({e!r})"))
                    self._sock.close()
                    raise self.broken or Unavailable(self.address) from None
            finally:
                self._send_lock.release()
            await pending.done.wait()
        finally:
            self._pending.pop(rid, None)
        if pending.error is not None:
            raise pending.error
        assert pending.response is not None
        return pending.response

    async def aclose(self) -> None:
        self._fail(Unavailable(f"{self.address}: connection closed"))
        self._sock.close()
        await self._closed.wait()


@asynccontextmanager
async def open_connection(
    host: str, port: int, secret: bytes, *, limits: Limits = DEFAULT_LIMITS
) -> AsyncIterator[Connection]:
    """A connection that owns its receiver task; closed on exit."""
    async with open_service_nursery() as nursery:
        conn = await Connection.connect(host, port, secret, nursery=nursery, limits=limits)
        try:
            yield conn
        finally:
            with trio.CancelScope(shield=True):
                await conn.aclose()


def parse_address(text: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port), with a clear error."""
    from tectonic_py.core.errors import ConfigError

    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ConfigError(f"bad address {text!r}: expected HOST:PORT")
    host = host.strip("[]")
    p = int(port)
    if not 0 <= p <= 65535:
        raise ConfigError(f"bad port in {text!r}")
    return host, p
