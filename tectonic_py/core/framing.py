"""Frames of the wire protocol, and how they go onto and off a socket.

Frame format (version field first; integers big-endian)::

    offset  size  field
    0       1     version      (1)
    1       1     flags        bit 0 FLAG_TAG: a tag follows the payload; others 0
    2       2     reserved     (0)
    4       4     header_len   H, 1 <= H <= Limits.max_header
    8       4     payload_len  P, 0 <= P <= Limits.max_payload
    12      H     header       msgpack map
    12+H    P     payload      raw bytes, never passed through msgpack
    12+H+P  16    tag          with FLAG_TAG: the frame's MAC (``tectonic_py.core.auth``)

The handshake's frames have no tag; every frame after it has one.

Headers:

* request:  ``{"op": str, "rid": int, "f": {fields}}``
* response: ``{"rid": int, "f": {fields}}``
* error:    ``{"rid": int, "err": code, "msg": str}`` (``rid`` 0 for connection-level errors;
  ``code`` is a ``TectonicError.code``, encoded by the RPC server alone)

A payload travels after its header and is received (``os.readv`` on the socket's fd,
``recv_exactly``) straight into a buffer the receiver owns, so a 4 MiB chunk is never copied
through msgpack and never assembled from many small ``bytes`` objects.

Error handling: a prefix or header that cannot be trusted (bad version, oversized lengths,
undecodable or misshapen header) raises ``ProtocolError``; the peer closing the stream where
a frame was expected raises ``PeerClosed``. Either way framing itself is in doubt and the
connection ends.

The socket I/O here reads and writes the non-blocking fd directly and yields to trio only
when the kernel has no bytes or no room (``recv_exactly``, ``send_pieces`` say why).
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import trio

from tectonic_py.core.errors import ProtocolError

VERSION = 1
PREFIX = struct.Struct("!BBHII")
FLAG_TAG = 0x01
TAG_BYTES = 16
MiB = 1024 * 1024
IOV_MAX = 1024  # pieces one writev takes (Linux's UIO_MAXIOV)

Buffer = bytes | bytearray | memoryview | mmap.mmap


@dataclass(frozen=True)
class Limits:
    """Hard limits of one server (and, for sizes, of a client reading replies)."""

    max_header: int = 1 * MiB
    max_payload: int = 64 * MiB
    max_inflight: int = 64
    payload_budget: int = 512 * MiB
    max_payload_waiters: int = 2048
    auth_timeout: float = 10.0
    # Connections still in the handshake; past this many the oldest is dropped, so peers
    # that never authenticate hold a bounded amount of memory however many they open.
    max_unauthenticated: int = 1024


DEFAULT_LIMITS = Limits()


class PeerClosed(Exception):
    """The peer closed the connection (EOF) where a frame was expected.

    Not a ``TectonicError``: it never leaves the wire layer, which turns it into
    ``Unavailable`` (client) or the end of one connection (server)."""


def pack_frame(header: Mapping[str, Any], payload_len: int, flags: int = 0) -> bytes:
    """A frame's prefix and header; its payload (``payload_len`` bytes) is sent after it."""
    head = msgpack.packb(header, use_bin_type=True)
    return PREFIX.pack(VERSION, flags, 0, len(head), payload_len) + head


@dataclass(frozen=True)
class Head:
    """A received frame's decoded header, payload length and flags; ``raw`` is its prefix
    and header as they came off the wire (what the frame's tag covers)."""

    header: dict[str, Any]
    payload_len: int
    flags: int
    raw: bytearray


async def read_head(sock: trio.socket.SocketType, limits: Limits) -> Head:
    """Read one frame's prefix and header, the payload (and tag) still on the socket.
    Raises ProtocolError when framing can't be trusted: lengths are checked against
    ``limits`` before anything the prefix announces is allocated."""
    prefix = bytearray(PREFIX.size)
    await recv_exactly(sock, memoryview(prefix))
    version, flags, _reserved, hlen, plen = PREFIX.unpack(prefix)
    if version != VERSION:
        raise ProtocolError(f"unsupported frame version {version}")
    if flags & ~FLAG_TAG:
        raise ProtocolError(f"unknown frame flags {flags:#x}")
    if hlen < 1 or hlen > limits.max_header:
        raise ProtocolError(f"header length {hlen} outside 1..{limits.max_header}")
    if plen > limits.max_payload:
        raise ProtocolError(f"payload length {plen} over limit {limits.max_payload}")
    raw = bytearray(PREFIX.size + hlen)
    raw[: PREFIX.size] = prefix
    try:
        await recv_exactly(sock, memoryview(raw)[PREFIX.size :])
    except PeerClosed:
        raise ProtocolError("connection closed inside a frame header") from None
    try:
        header = msgpack.unpackb(memoryview(raw)[PREFIX.size :], raw=False, strict_map_key=True)
    except Exception as e:  # noqa: BLE001 (msgpack raises a zoo of types for garbage)
        raise ProtocolError(f"undecodable header: {type(e).__name__}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a map")
    return Head(header, plen, flags, raw)


async def read_prefix_and_header(
    sock: trio.socket.SocketType, limits: Limits
) -> tuple[dict[str, Any], int]:
    """``read_head`` for a frame without a tag (the handshake's): ``(header, payload_len)``."""
    head = await read_head(sock, limits)
    if head.flags & FLAG_TAG:
        raise ProtocolError("unexpected tagged frame")
    return head.header, head.payload_len


async def recv_exactly(sock: trio.socket.SocketType, view: memoryview) -> None:
    """Fill ``view`` from ``sock``, yielding to other tasks only when no byte is ready.

    Why not ``sock.recv_into`` in a loop: trio makes each successful call a checkpoint,
    so a connection's reader went to the back of the run queue after every 64 KiB piece
    of a payload, behind every other task, and a 1 MiB payload took four or five passes of
    the scheduler (each with an epoll_wait). On a busy chunk store that made the single
    reader of a connection the bottleneck of its puts. ``os.readv`` on the non-blocking
    socket reads what the kernel holds without a checkpoint; ``wait_readable`` (which is
    one) waits for more. A frame's header read still passes through ``wait_readable`` or
    an explicit checkpoint in the callers' loops, so a reader cannot starve the others.
    """
    fd = sock.fileno()
    while view:
        try:
            n = os.readv(fd, [view])
        except BlockingIOError:
            await trio.lowlevel.wait_readable(sock)
            continue
        if n == 0:
            raise PeerClosed()
        view = view[n:]


# A drain's scratch buffer is small: every connection draining a refused payload at once
# holds one (a burst refused Busy is a thousand of them), and a drain's speed does not matter.
DRAIN_PIECE = 16 * 1024


async def drain(
    sock: trio.socket.SocketType, n: int, feed: Callable[[memoryview], None] | None = None
) -> None:
    """Read and discard ``n`` bytes (a payload nobody will use), keeping framing intact;
    ``feed`` sees each piece before it is thrown away (the frame's tag covers it).

    The scratch buffer is this call's own: a receive reaches a schedule point after its bytes
    land, and a buffer shared by connections would let another drain overwrite them before
    ``feed`` sees them, failing an honest frame's tag.
    """
    scratch = memoryview(bytearray(min(n, DRAIN_PIECE)))
    while n > 0:
        k = min(n, len(scratch))
        await recv_exactly(sock, scratch[:k])
        if feed is not None:
            feed(scratch[:k])
        n -= k


async def send_all(
    sock: trio.socket.SocketType, data: Buffer, sent: list[int] | None = None
) -> None:
    await send_pieces(sock, [memoryview(data).cast("B")], sent)


async def send_pieces(
    sock: trio.socket.SocketType, pieces: list[memoryview], sent: list[int] | None
) -> None:
    """Write ``pieces`` to the socket, waiting (``wait_writable``) only when it is full.

    Why not ``sock.sendmsg``: trio makes every successful send a checkpoint, one more pass
    through the scheduler per reply on a busy chunk store (see ``recv_exactly``). A send
    cancelled while it waits has sent nothing in that wait; ``sent`` says what went before.
    """
    fd = sock.fileno()
    while pieces:
        try:
            n = os.writev(fd, pieces)
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)
            continue
        if sent is not None:
            sent[0] += n
        while pieces and n >= pieces[0].nbytes:
            n -= pieces[0].nbytes
            pieces.pop(0)
        if pieces and n:
            pieces[0] = pieces[0][n:]
