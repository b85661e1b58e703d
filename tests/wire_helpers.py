"""Helpers for tests that speak the wire protocol by hand (test_wire, test_chunkstore).

Why by hand: a test of what a server does with a malformed or stalled frame needs a socket
that has passed the handshake but sends bytes no ``wire.Connection`` would send.
"""

from __future__ import annotations

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
