"""The RPC server of the wire protocol: authenticated connections, handlers, admission.

``RpcServer`` serves a table of handlers; a handler takes a ``Request`` (typed, validated
access to its fields) and returns a ``Reply``. Frames are those of
``tectonic_py.core.framing``, the handshake and the frames' tags those of
``tectonic_py.core.auth``: no handler runs, and no reply is sent, for a frame whose tag has
not been checked.

Before authentication: a connection may send only the handshake's small frames, and at most
``max_unauthenticated`` connections may be in the handshake at once (a new one beyond that
drops the oldest, so a flood of idle peers holds bounded memory and cannot lock out honest
clients, whose handshake takes one round trip).

Error handling: a frame whose prefix or header cannot be trusted gets an error frame with
rid 0 and the connection is closed: after that point framing itself is in doubt. An unknown
op or a bad field gets an error frame for that request and the connection keeps serving.
Domain errors raised by a handler are encoded to their code here, in ``error_to_header``,
the only place that does so; the client raises the same class again from the code.

Admission control: each connection has at most ``max_inflight`` requests being handled (the
reader stops reading, so TCP pushes back on the client); the memory of payloads held across
all connections (each charged the size of the buffer it lies in) is bounded by
``payload_budget``; when more than ``max_payload_waiters`` requests wait for budget, new ones
are refused with the retryable ``Busy`` (their payload is drained off the socket first, so
the connection stays usable).
"""

from __future__ import annotations

import builtins
import logging
import math
import mmap
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import trio

from tectonic_py.core.aio import acquire_soon
from tectonic_py.core.auth import (
    FrameCheck,
    FrameSession,
    Keyring,
    answer_handshake,
    as_keyring,
    require_tag,
    sealed_pieces,
    send_sealed,
)
from tectonic_py.core.buffers import SpareBuffers
from tectonic_py.core.errors import (
    AuthError,
    Busy,
    InvalidArgument,
    PermissionDenied,
    ProtocolError,
    TectonicError,
    UnknownOp,
)
from tectonic_py.core.framing import (
    DEFAULT_LIMITS,
    FLAG_TAG,
    IOV_MAX,
    PREFIX,
    Buffer,
    Limits,
    MiB,
    PeerClosed,
    pack_frame,
    read_head,
    recv_exactly,
    send_all,
    send_pieces,
)
from tectonic_py.core.rpc_metrics import RpcMetrics
from tectonic_py.core.sockets import unpaced_on_loopback

log = logging.getLogger(__name__)


def error_to_header(rid: int, exc: BaseException) -> dict[str, Any]:
    """Encode an exception as an error header: the server's one place for this mapping."""
    if isinstance(exc, TectonicError):
        return {"rid": rid, "err": exc.code, "msg": exc.message}
    log.exception("internal error handling request %d", rid, exc_info=exc)
    return {"rid": rid, "err": "internal", "msg": f"internal error: {type(exc).__name__}"}


MAX_QUEUED_REPLIES = 64  # small replies a connection's outbox holds before senders wait


class Request:
    """One decoded request as a handler sees it: validated typed access to its fields."""

    __slots__ = ("buffer", "fields", "job", "op", "payload", "peer", "role", "weight")

    def __init__(
        self,
        op: str,
        fields: dict[str, Any],
        payload: memoryview | None,
        peer: str,
        buffer: memoryview | None = None,
        role: str = "admin",
        job: str = "",
        weight: int = 0,
    ) -> None:
        self.op = op
        self.fields = fields
        self.payload = payload
        self.peer = peer
        self.role = role  # what the connection proved in its handshake (core/auth.py)
        self.job, self.weight = job, weight  # the job it named there, if any
        # For ops with a ``payload_room``: the whole page-aligned buffer the payload was
        # received into, at the offset the room asked for (the handler may write around it).
        self.buffer = buffer

    def __getitem__(self, name: str) -> Any:
        """A field as the op's declaration checked it (metadata/api): for handlers whose
        dispatch validated ``fields`` already."""
        return self.fields[name]

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
    | tuple[dict[str, Any], Buffer]
    | tuple[dict[str, Any], Buffer, Callable[[], None]]
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
    unauthenticated: int = 0  # connections in the handshake now
    unauthenticated_dropped: int = 0  # dropped for newer ones past max_unauthenticated
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

    def refuses(self, n: int) -> bool:
        """True when ``n`` bytes are not free now and too many requests wait already."""
        return self._free < n and not self.can_queue()

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


class _Outbox:
    """A connection's small reply frames (those without a payload), sent together.

    Why: on loopback every ``writev`` of a reply also runs the peer's TCP input and wakes
    the peer, on the chunk store's event loop thread. Replies that become ready in one pass
    of the scheduler (puts released together by one directory fsync) leave in one
    ``writev``: the first sender yields once, so that the others can add theirs, then sends
    everything queued. A sender returns before its frame is on the wire; a failed send
    fails the connection, which the peer sees as it would any other lost reply.

    A peer that sends requests but does not read its replies must not grow the queue
    without bound (its handlers return, so its in-flight limit would no longer hold it
    back): past ``MAX_QUEUED_REPLIES`` frames, a sender waits, holding its request's
    in-flight slot, until the flushing task has taken the queue.
    """

    def __init__(
        self,
        sock: trio.socket.SocketType,
        lock: trio.Lock,
        stats: ServerStats,
        session: FrameSession,
    ) -> None:
        self.sock = sock
        self.lock = lock  # held by whoever writes to the socket (and seals frames)
        self.session = session
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
                    n = IOV_MAX // 2  # (a frame and its tag each)
                    frames, self._frames = self._frames[:n], self._frames[n:]
                    self._release_waiters()
                    self._stats.reply_writes += 1
                    await send_pieces(self.sock, sealed_pieces(self.session, frames), None)
            finally:
                self.lock.release()
        finally:
            self._flushing = False
            self._release_waiters()  # (they go; the next sender flushes what is left)

    def _release_waiters(self) -> None:
        self._taken.set()
        self._taken = trio.Event()


class RpcServer:
    """Serves a table of handlers over the wire protocol.

    ``serve`` follows trio's convention: ``await nursery.start(server.serve, host, 0)``
    returns the bound ``(host, port)``.
    """

    def __init__(
        self,
        name: str,
        keys: bytes | Keyring,
        handlers: Mapping[str, Handler],
        limits: Limits = DEFAULT_LIMITS,
        payload_room: Mapping[str, Callable[[int], tuple[int, int]]] | None = None,
        roles: Mapping[str, frozenset[str]] | None = None,
        metrics: RpcMetrics | None = None,
    ) -> None:
        """``keys``: the roles accepted and their keys (the cluster secret: every role).
        ``payload_room[op](plen) -> (offset, size)``: receive that op's payload at
        ``offset`` of a page-aligned buffer of ``size`` bytes, given to the handler as
        ``Request.buffer`` (the chunk store receives a put where its file image needs it).
        ``roles[op]``: the roles that may call ``op``; any other role's call is refused
        with ``PermissionDenied`` (logged, its handler never runs), and so is an op that has
        a handler but no entry. None: every role may call every op (tests' servers).
        ``metrics``: every handler counted and timed (core/rpc_metrics.py), and ``stats``
        exposed."""
        self.name = name
        self.payload_room = dict(payload_room or {})
        self._keys = as_keyring(keys)
        self.roles = None if roles is None else dict(roles)
        self.limits = limits
        self.stats = ServerStats()
        self.handlers = dict(handlers) if metrics is None else metrics.wrap_all(handlers)
        if metrics is not None:
            metrics.watch(self.stats)
        self._budget = _PayloadBudget(limits.payload_budget, limits.max_payload_waiters, self.stats)
        self._spares = SpareBuffers(min(limits.payload_budget // 4, 80 * MiB))
        # Connections in the handshake, oldest first: their cancel scopes, to drop them.
        self._unauthenticated: dict[int, trio.CancelScope] = {}

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
        unpaced_on_loopback(sock)
        try:
            peer_addr = sock.getpeername()
            peer = f"{peer_addr[0]}:{peer_addr[1]}"
        except OSError:
            peer = "?"
        self.stats.connections += 1
        try:
            session = await self._authenticate(sock, peer)
            if session is not None:
                await self._serve_requests(sock, peer, session)
        except (PeerClosed, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            self.stats.connections -= 1
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _authenticate(self, sock: trio.socket.SocketType, peer: str) -> FrameSession | None:
        """The handshake, within ``auth_timeout`` and as one of at most
        ``max_unauthenticated`` (the oldest is dropped for a new one). None when the peer
        did not authenticate (it has been told why where it could be, and logged)."""
        while len(self._unauthenticated) >= max(1, self.limits.max_unauthenticated):
            oldest = next(iter(self._unauthenticated))
            self._unauthenticated.pop(oldest).cancel()
            self.stats.unauthenticated_dropped += 1
        scope = trio.CancelScope(deadline=trio.current_time() + self.limits.auth_timeout)
        key = id(scope)
        self._unauthenticated[key] = scope
        self.stats.unauthenticated = len(self._unauthenticated)
        try:
            with scope:
                return await self._handshake(sock, peer)
        finally:
            dropped = self._unauthenticated.pop(key, None) is None
            self.stats.unauthenticated = len(self._unauthenticated)
            if scope.cancelled_caught:
                self.stats.auth_failures += 1
                why = "dropped for newer connections" if dropped else "timed out"
                log.warning("%s: %s did not authenticate (%s); closed", self.name, peer, why)
        return None

    async def _handshake(self, sock: trio.socket.SocketType, peer: str) -> FrameSession | None:
        """The server's half of ``auth``; a peer that fails it is told why, logged, closed."""
        try:
            return await answer_handshake(sock, self._keys)
        except (ProtocolError, AuthError) as e:
            self.stats.auth_failures += 1
            if isinstance(e, AuthError):
                log.warning("%s: %s failed authentication; closed", self.name, peer)
            else:
                log.warning("%s: handshake with %s failed: %s; closed", self.name, peer, e)
            await self._send_error_quietly(sock, None, 0, e)
            return None

    async def _send_error_quietly(
        self,
        sock: trio.socket.SocketType,
        session: FrameSession | None,
        rid: int,
        exc: BaseException,
    ) -> None:
        """An error frame to a connection that is about to be closed (sealed once the
        handshake is done); a failure to send it is of no consequence."""
        with trio.move_on_after(1):
            try:
                if session is None:
                    await send_all(sock, pack_frame(error_to_header(rid, exc), 0))
                else:
                    frame = pack_frame(error_to_header(rid, exc), 0, FLAG_TAG)
                    await send_sealed(sock, session, frame, None)
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    async def _serve_requests(
        self, sock: trio.socket.SocketType, peer: str, session: FrameSession
    ) -> None:
        send_lock = trio.Lock()
        outbox = _Outbox(sock, send_lock, self.stats, session)
        inflight = trio.Semaphore(self.limits.max_inflight)
        async with trio.open_nursery() as nursery:
            # A peer that vanishes mid-frame (EOF or reset inside a payload) must end only
            # its own connection: raised here, inside the nursery, it would arrive as an
            # exception group that _handle_connection cannot catch and stop the server.
            try:
                while True:
                    head = await self._read_request(sock, peer, session)
                    if head is None:
                        break
                    op, rid, fields, plen, check = head
                    handler = self.handlers.get(op)
                    try:
                        refusal = self.refusal(op, session.role, peer)
                        if handler is None or refusal is not None:
                            await check.drain(sock, plen)
                            await self._send_error(
                                outbox, rid, refusal or UnknownOp(f"unknown op {op!r}")
                            )
                            continue
                        received = await self._receive_payload(outbox, check, op, rid, plen)
                    except ProtocolError as e:
                        await self._refuse_frame(sock, peer, session, e)
                        break
                    if received is None:
                        continue
                    payload, whole, buf, charge = received
                    del received
                    await inflight.acquire()
                    nursery.start_soon(
                        self._run_handler,
                        outbox,
                        inflight,
                        handler,
                        Request(
                            op,
                            fields,
                            payload,
                            peer,
                            whole,
                            session.role,
                            session.job,
                            session.weight,
                        ),
                        rid,
                        charge,
                        buf,
                    )
                    # Only the handler may refer to the buffer now, so that it can be reused.
                    payload = whole = buf = None
            except (PeerClosed, OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            nursery.cancel_scope.cancel()

    def refusal(self, op: str, role: str, peer: str) -> PermissionDenied | None:
        """The error of a call ``role`` may not make (logged), or None: the servers' one
        check of who may call what; a refused call changes nothing."""
        if self.roles is None or op not in self.handlers:
            return None
        allowed = self.roles.get(op, frozenset())
        if role in allowed:
            return None
        needs = " or ".join(sorted(allowed - {"admin"})) or (
            "admin" if allowed else "a declaration"
        )
        log.warning("%s: %s as role %s called %s: refused", self.name, peer, role, op)
        return PermissionDenied(f"permission denied: {op} needs role {needs}")

    async def _refuse_frame(
        self,
        sock: trio.socket.SocketType,
        peer: str,
        session: FrameSession,
        exc: ProtocolError,
    ) -> None:
        """A frame that cannot be trusted: tell the peer (rid 0) and end the connection."""
        self.stats.protocol_errors += 1
        log.warning("%s: protocol error from %s: %s; closed", self.name, peer, exc)
        await self._send_error_quietly(sock, session, 0, exc)

    async def _read_request(
        self, sock: trio.socket.SocketType, peer: str, session: FrameSession
    ) -> tuple[str, int, dict[str, Any], int, FrameCheck] | None:
        """The next request's op, rid, fields, payload length and tag check, its payload and
        tag still on the socket. None when the connection ends: EOF, or a frame that cannot
        be trusted (told to the peer with rid 0)."""
        try:
            head = await read_head(sock, self.limits)
            require_tag(head)
        except PeerClosed:
            return None
        except ProtocolError as e:
            await self._refuse_frame(sock, peer, session, e)
            return None
        check = session.check(head)
        header, plen = head.header, head.payload_len
        op, rid, fields = header.get("op"), header.get("rid"), header.get("f", {})
        if (
            not isinstance(op, str)
            or not isinstance(rid, int)
            or isinstance(rid, bool)
            or not 0 < rid < 2**63
            or not isinstance(fields, dict)
        ):
            await self._refuse_frame(sock, peer, session, ProtocolError("malformed request header"))
            return None
        self.stats.bytes_in += PREFIX.size + plen
        return op, rid, fields, plen, check

    async def _receive_payload(
        self, outbox: _Outbox, check: FrameCheck, op: str, rid: int, plen: int
    ) -> tuple[memoryview | None, memoryview | None, bytearray | mmap.mmap | None, int] | None:
        """Receive a request's payload into a spare buffer, under the payload budget, and
        check the frame's tag: ``(payload, whole, buffer, charge)``; ``whole`` is the
        page-aligned buffer around it for an op with a ``payload_room``, ``charge`` the
        budget taken (the size of the buffer it lies in). None when the request was refused
        ``Busy`` (its payload drained). ``ProtocolError`` when the tag is wrong."""
        sock = outbox.sock
        if not plen:
            await check.verify(sock)
            return None, None, None, 0
        room = self.payload_room.get(op)
        start, size = room(plen) if room is not None else (0, plen)
        # (a buffer of whole huge pages can be twice the payload: the budget bounds memory,
        # as the chunk store's reply budget does)
        charge = self._spares.size_class(size)
        if self._budget.refuses(charge):
            await check.drain(sock, plen)
            self.stats.busy_refusals += 1
            await self._send_error(outbox, rid, Busy(f"{self.name}: payload queue full"))
            return None
        await self._budget.acquire(charge)
        buf: bytearray | mmap.mmap | None = None
        try:
            buf = self._spares.take(size)
            view = memoryview(buf)[:size]
            payload = view[start : start + plen]
            whole = view if room is not None and isinstance(buf, mmap.mmap) else None
            await recv_exactly(sock, payload)
            check.feed(payload)
            await check.verify(sock)
        except BaseException:
            self._budget.release(charge)
            raise
        return payload, whole, buf, charge

    async def _send_error(self, outbox: _Outbox, rid: int, exc: TectonicError) -> None:
        """An error reply to one request; the connection keeps serving."""
        await outbox.send(pack_frame(error_to_header(rid, exc), 0, FLAG_TAG))

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
                out_payload: Buffer | None = None
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
            size = 0 if out_payload is None else memoryview(out_payload).nbytes
            frame = pack_frame(header, size, FLAG_TAG)
            if not size:
                await outbox.send(frame)
            else:
                await acquire_soon(outbox.lock)  # no pass through the scheduler
                self.stats.reply_writes += 1
                try:
                    await send_sealed(outbox.sock, outbox.session, frame, out_payload)
                finally:
                    outbox.lock.release()
            self.stats.bytes_out += len(frame) + size
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self.stats.requests_in_flight -= 1
