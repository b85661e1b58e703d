"""Helpers for tests that speak the wire protocol by hand (test_wire, test_chunkstore), and
that look at the memory behind payload buffers (test_wire).

Why by hand: a test of what a server does with a malformed or stalled frame needs a socket
that has passed the handshake but sends bytes no ``rpc_client.Connection`` would send.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import trio

from tectonic_py.core import auth, framing


async def raw_session(
    port: int, secret: bytes, role: str = auth.ROLE_ADMIN
) -> tuple[trio.socket.SocketType, auth.FrameSession]:
    """A plain socket to ``127.0.0.1:port`` that has completed the HMAC handshake as
    ``role`` (its key derived from the cluster secret), and the session that seals and
    checks its frames (``send_sealed``, ``read_sealed``)."""
    key = auth.role_key(secret, role)
    sock = trio.socket.socket()
    await sock.connect(("127.0.0.1", port))
    hello, _ = await framing.read_prefix_and_header(sock, framing.DEFAULT_LIMITS)
    cn = b"c" * 32
    mac = auth.mac(key, b"client|" + role.encode(), hello["nonce"], cn)
    frame = framing.pack_frame({"op": "auth", "role": role, "nonce": cn, "mac": mac}, 0)
    await framing.send_all(sock, frame)
    welcome, _ = await framing.read_prefix_and_header(sock, framing.DEFAULT_LIMITS)
    assert welcome["op"] == "welcome"
    return sock, auth.FrameSession.derive(key, hello["nonce"], cn, server=False, role=role)


async def raw_authenticated(port: int, secret: bytes) -> trio.socket.SocketType:
    """``raw_session``'s socket alone: for tests that send frames no client would, which
    the server must refuse before it looks at their tags."""
    sock, _session = await raw_session(port, secret)
    return sock


def sealed_frames(session: auth.FrameSession, headers: list[dict]) -> bytes:
    """Payload-free request frames, sealed in order, as one byte string to send at once."""
    out = bytearray()
    for header in headers:
        head = framing.pack_frame(header, 0, framing.FLAG_TAG)
        out += head + session.seal(head, None)
    return bytes(out)


async def read_any_frame(
    sock: trio.socket.SocketType,
) -> tuple[dict, int] | None:
    """The next frame's header and payload length, its tag (if any) skipped unchecked;
    None once the peer has closed the connection."""
    try:
        head = await framing.read_head(sock, framing.DEFAULT_LIMITS)
        await framing.drain(sock, head.payload_len)
        if head.flags & framing.FLAG_TAG:
            await framing.drain(sock, framing.TAG_BYTES)
    except (framing.PeerClosed, ConnectionResetError):
        return None
    return head.header, head.payload_len


class Mapping(NamedTuple):
    start: int
    end: int
    name: str  # the file's path, ``[heap]``..., or "" for anonymous memory
    fields: dict[str, str]  # ``KernelPageSize``, ``THPeligible``, ``ShmemPmdMapped``...


def mappings(pid: int | str = "self") -> list[Mapping]:
    """The mappings of /proc/PID/smaps, with their fields."""
    found: list[Mapping] = []
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                parts = line.split(maxsplit=5)
                found.append(Mapping(lo, hi, parts[5].strip() if len(parts) > 5 else "", {}))
            elif found:
                key, _, value = line.partition(":")
                found[-1].fields[key] = value.strip()
    return found


def mapping_at(address: int, pid: int | str = "self") -> Mapping | None:
    """The mapping that holds ``address``, None if none does."""
    return next((m for m in mappings(pid) if m.start <= address < m.end), None)


def vma_fields(address: int, pid: int | str = "self") -> dict[str, str]:
    """The smaps fields of the mapping that holds ``address``; empty if none does."""
    found = mapping_at(address, pid)
    return {} if found is None else found.fields


def address_of(buf: object) -> int:
    """Where a writable buffer (an mmap, a bytearray) starts in this process's memory."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))  # type: ignore[arg-type]
