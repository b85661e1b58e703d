"""Mutual challenge-response over the cluster secret, before any request on a connection.

Handshake (frames of ``tectonic_py.core.framing``, no payloads)::

1. server -> client ``{"op": "hello", "proto": 1, "nonce": 32 random bytes}``
2. client -> server ``{"op": "auth", "nonce": cn, "mac": HMAC(secret, "client" | sn | cn)}``
3. server -> client ``{"op": "welcome", "mac": HMAC(secret, "server" | cn | sn)}``,
   or an ``auth`` error frame and the connection is closed (and logged).

The client checks the server's MAC too, so neither side talks to an impostor. Each side
draws its own nonce, so a recorded exchange cannot be replayed.

TLS: the frame layer needs only a byte stream it can read and write by file descriptor; an
untrusted network would wrap the socket in TLS below this layer (kTLS keeps plain reads and
writes on the fd).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

import trio

from tectonic_py.core.errors import AuthError, ConfigError, ProtocolError, error_from_code
from tectonic_py.core.framing import Limits, pack_frame, read_prefix_and_header, send_all

PROTO = 1
NONCE_BYTES = 32
MIN_SECRET_BYTES = 16


def load_secret(path: str | os.PathLike[str]) -> bytes:
    """Read a cluster secret file; refuse one too short to be a secret, or one that users
    other than its owner may read or write (as ssh refuses such a key): a secret others
    can read is no longer a secret, and the operator should hear so, not find out later."""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if mode & 0o077:
                raise ConfigError(
                    f"secret file {os.fspath(path)!r} is accessible by others "
                    f"(mode {mode & 0o777:04o}); run: chmod 600 {os.fspath(path)}"
                )
            data = f.read().strip()
    except OSError as e:
        raise ConfigError(f"cannot read secret file {os.fspath(path)!r}: {e.strerror}") from None
    if len(data) < MIN_SECRET_BYTES:
        raise ConfigError(f"secret file {os.fspath(path)!r} holds under 16 bytes")
    return data


def mac(secret: bytes, role: bytes, a: bytes, b: bytes) -> bytes:
    """The MAC one side sends: ``role`` (b"client" or b"server") binds it to its direction."""
    return hmac.new(secret, role + b"|" + a + b"|" + b, hashlib.sha256).digest()


async def answer_handshake(sock: trio.socket.SocketType, secret: bytes, limits: Limits) -> None:
    """The server's half. Raises ``ProtocolError`` for a frame that is not a well-formed auth
    frame and ``AuthError`` for a wrong MAC; the caller sends the error and closes."""
    sn = secrets.token_bytes(NONCE_BYTES)
    await send_all(sock, pack_frame({"op": "hello", "proto": PROTO, "nonce": sn}, 0))
    header, plen = await read_prefix_and_header(sock, limits)
    if plen or header.get("op") != "auth":
        raise ProtocolError("expected an auth frame")
    cn, their_mac = header.get("nonce"), header.get("mac")
    if not (isinstance(cn, bytes) and isinstance(their_mac, bytes) and len(cn) == NONCE_BYTES):
        raise ProtocolError("malformed auth frame")
    if not hmac.compare_digest(their_mac, mac(secret, b"client", sn, cn)):
        raise AuthError("authentication failed")
    await send_all(sock, pack_frame({"op": "welcome", "mac": mac(secret, b"server", cn, sn)}, 0))


async def offer_handshake(
    sock: trio.socket.SocketType, secret: bytes, limits: Limits, address: str
) -> None:
    """The client's half. Raises ``ProtocolError`` for an unexpected frame, ``AuthError``
    when the server refuses us or fails its own MAC (``address`` names it in the error)."""
    header, plen = await read_prefix_and_header(sock, limits)
    sn = header.get("nonce")
    if header.get("op") != "hello" or plen or not isinstance(sn, bytes) or len(sn) != NONCE_BYTES:
        raise ProtocolError(f"{address}: bad hello")
    if header.get("proto") != PROTO:
        raise ProtocolError(f"{address}: protocol {header.get('proto')} unsupported")
    cn = secrets.token_bytes(NONCE_BYTES)
    await send_all(
        sock, pack_frame({"op": "auth", "nonce": cn, "mac": mac(secret, b"client", sn, cn)}, 0)
    )
    header, plen = await read_prefix_and_header(sock, limits)
    if "err" in header:
        raise error_from_code(str(header["err"]), f"{address}: {header.get('msg', '')}")
    their_mac = header.get("mac")
    if header.get("op") != "welcome" or not isinstance(their_mac, bytes):
        raise ProtocolError(f"{address}: bad welcome")
    if not hmac.compare_digest(their_mac, mac(secret, b"server", cn, sn)):
        raise AuthError(f"{address}: server failed authentication")
