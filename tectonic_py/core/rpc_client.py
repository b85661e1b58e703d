"""The client side of the wire protocol: one authenticated, multiplexed connection.

``Connection.call`` sends a request and waits for its reply; many calls may be in flight on
one connection at once, from many tasks, matched by request id. A server's error frame is
raised again as the same ``TectonicError`` class (``error_from_code``); anything that breaks
the connection (EOF, reset, a frame that cannot be trusted) fails every pending call with
the retryable ``Unavailable``, which is what ``tectonic_py.core.retry`` retries.

Every frame after the handshake is sealed and checked with the connection's
``auth.FrameSession``: a reply is handed to its caller only once its tag is verified, and a
frame that fails the check (injected, altered, replayed) breaks the connection.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from tectonic_py.core.aio import acquire_soon, open_service_nursery
from tectonic_py.core.auth import (
    Credential,
    FrameSession,
    offer_handshake,
    require_tag,
    send_sealed,
)
from tectonic_py.core.errors import ProtocolError, TectonicError, Unavailable, error_from_code
from tectonic_py.core.framing import (
    DEFAULT_LIMITS,
    FLAG_TAG,
    Buffer,
    Limits,
    PeerClosed,
    pack_frame,
    read_head,
    recv_exactly,
)
from tectonic_py.core.sockets import connect_tcp


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

    def __init__(
        self, sock: trio.socket.SocketType, address: str, limits: Limits, session: FrameSession
    ) -> None:
        self._sock = sock
        self._session = session
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
        secret: bytes | Credential,
        *,
        nursery: trio.Nursery,
        limits: Limits = DEFAULT_LIMITS,
    ) -> Connection:
        """Connect and authenticate; the receiver task is started in ``nursery``. Raises
        ``Unavailable`` when the server cannot be reached or the connection is lost during
        the handshake, ``AuthError``/``ProtocolError`` when the server is not one of ours."""
        address = f"{host}:{port}"
        try:
            sock = await connect_tcp(host, port)
        except OSError as e:
            raise Unavailable(f"cannot connect to {address}: {e.strerror or e}") from None
        try:
            with trio.fail_after(limits.auth_timeout):
                session = await offer_handshake(sock, secret, address)
        except trio.TooSlowError:
            sock.close()
            raise Unavailable(f"{address}: handshake timed out") from None
        except (PeerClosed, OSError) as e:
            sock.close()
            raise Unavailable(f"{address}: connection lost during handshake ({e!r})") from None
        except BaseException:
            sock.close()
            raise
        conn = cls(sock, address, limits, session)
        nursery.start_soon(conn._receive_loop)
        return conn

    async def _receive_loop(self) -> None:
        try:
            while True:
                head = await read_head(self._sock, self.limits)
                require_tag(head)
                check = self._session.check(head)
                header, plen = head.header, head.payload_len
                rid = header.get("rid")
                pending = self._pending.pop(rid, None) if isinstance(rid, int) else None
                if pending is None:
                    # The caller gave up (cancelled); keep framing intact.
                    await check.drain(self._sock, plen)
                    if rid == 0 and "err" in header:
                        raise error_from_code(str(header["err"]), str(header.get("msg", "")))
                    continue
                payload: memoryview | None = None
                try:
                    if plen:
                        if pending.into is not None and len(pending.into) >= plen:
                            payload = pending.into[:plen]
                        else:
                            payload = memoryview(bytearray(plen))
                        await recv_exactly(self._sock, payload)
                        check.feed(payload)
                    await check.verify(self._sock)
                except BaseException:
                    self._pending[header["rid"]] = pending  # (failed with the others)
                    raise
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
                await trio.lowlevel.checkpoint()  # one per frame (``recv_exactly`` has none)
        except PeerClosed:
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
        frame = pack_frame({"op": op, "rid": rid, "f": dict(fields or {})}, size, FLAG_TAG)
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
                    await send_sealed(
                        self._sock, self._session, frame, payload if size else None, sent
                    )
                except trio.Cancelled:
                    # A half-sent frame poisons the stream: drop the connection. A frame
                    # not started (a send cancelled while it waits sent nothing) leaves it
                    # intact: dropping it would fail every other request on it, and turn
                    # one cancelled hedge or slow get into many failed chunks under a burst.
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
    host: str, port: int, secret: bytes | Credential, *, limits: Limits = DEFAULT_LIMITS
) -> AsyncIterator[Connection]:
    """A connection that owns its receiver task; closed on exit."""
    async with open_service_nursery() as nursery:
        conn = await Connection.connect(host, port, secret, nursery=nursery, limits=limits)
        try:
            yield conn
        finally:
            with trio.CancelScope(shield=True):
                await conn.aclose()
