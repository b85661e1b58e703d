"""Helpers for tests that speak the wire protocol by hand (test_wire, test_chunkstore), and
that look at the memory behind payload buffers (test_wire, test_writer_process).

Why by hand: a test of what a server does with a malformed or stalled frame needs a socket
that has passed the handshake but sends bytes no ``wire.Connection`` would send.
"""

from __future__ import annotations

import ctypes

import trio

from tectonic_py import wire


async def raw_authenticated(port: int, secret: bytes) -> trio.socket.SocketType:
    """A plain socket to ``127.0.0.1:port`` that has completed the HMAC handshake."""
    sock = trio.socket.socket()
    await sock.connect(("127.0.0.1", port))
    hello, _ = await wire._read_prefix_and_header(sock, wire.DEFAULT_LIMITS)
    cn = b"c" * 32
    mac = wire._mac(secret, b"client", hello["nonce"], cn)
    await wire._send_all(sock, wire._pack_frame({"op": "auth", "nonce": cn, "mac": mac}, 0))
    welcome, _ = await wire._read_prefix_and_header(sock, wire.DEFAULT_LIMITS)
    assert welcome["op"] == "welcome"
    return sock


def vma_fields(address: int, pid: int | str = "self") -> dict[str, str]:
    """The /proc/PID/smaps fields (``KernelPageSize``, ``THPeligible``...) of the mapping
    that holds ``address``; empty if none does."""
    fields: dict[str, str] = {}
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


def address_of(buf: object) -> int:
    """Where a writable buffer (an mmap, a bytearray) starts in this process's memory."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))  # type: ignore[arg-type]
