"""Mutual challenge-response over a role's key, then a MAC on every frame.

Roles: every connection speaks as one role, proved by the key it holds, and the servers let
each role call only what it is declared to (metadata/api for the metadata service, the chunk
store's table for its ops):

=============  ==============================================================================
role           who holds its key
=============  ==============================================================================
client         GPU nodes: the mount, put/get/ls/rm, the load test, DCP, fsspec
maintenance    the maintenance daemon: repair, GC, inventory, rebalance, lease recovery
admin          the operator's CLI: everything, backup and restore, forced lease recovery
node           the servers among themselves: heartbeats, a rename's cross-shard lookup
=============  ==============================================================================

A role's key is ``role_key(cluster secret, role)``: HMAC-SHA256 of the role's name under the
cluster secret, written as hex. Servers hold the cluster secret and derive every role's key
(``Keyring``); ``tectonic cluster up`` writes each role's key to a file of its own, and a GPU
node gets only the client's. The derivation is one-way, so a client key yields neither the
secret nor another role's key. A cluster directory made before roles (one secret, no key
files) keeps working: a process given the secret itself derives the key of its role.

Handshake (frames of ``tectonic_py.core.framing``, no payloads, headers of at most
``HANDSHAKE_LIMITS.max_header`` bytes)::

1. server -> client ``{"op": "hello", "proto": 3, "nonce": 32 random bytes}``
2. client -> server ``{"op": "auth", "role": r, "nonce": cn,
   "mac": HMAC(key_r, "client" | t | sn | cn)}``
3. server -> client ``{"op": "welcome", "mac": HMAC(key_r, "server" | t | cn | sn)}``,
   or an ``auth`` error frame and the connection is closed (and logged).

``t`` is the role, or, when the client names a job (its traffic class at chunk stores:
chunkstore/traffic.py), ``r | job | weight`` with the auth frame's ``job`` and ``weight``
fields: the job is bound into both MACs, so it is as authenticated as the role is (any
holder of a role's key may name any job: a job is a share of the stores, not a right).

The client checks the server's MAC too, so neither side talks to an impostor. Each side
draws its own nonce, so a recorded exchange cannot be replayed.

Frames after the handshake: the handshake alone proves who opened the connection, not who
sends what follows on it; a relay that passed it through could send its own requests. So
every later frame carries the ``framing.FLAG_TAG`` flag and a 16-byte tag after its
payload: AES-256-GCM with no plaintext (GMAC) over the frame's prefix, header and payload,
keyed per direction by ``HMAC(key_r, "frame key" | direction | sn | cn)`` and with the frame's
sequence number in that direction (0, 1, 2...) as the nonce. A forged, altered, replayed,
dropped or reordered frame fails the check and ends the connection. GMAC is used because
it runs at memory speed where AES-NI and carry-less multiply exist (every x86-64 and
ARMv8 server CPU), so a 4 MiB chunk's tag costs a small share of what moving it costs;
HMAC-SHA256 or keyed BLAKE2b would cost several times the rest of the data path. Frames
are not encrypted: checkpoints on a trusted network need integrity, not secrecy.

Memory before authentication: the handshake reads its frames with ``HANDSHAKE_LIMITS``
(a small header, no payload), so a peer that has not authenticated cannot make the server
(or a client) allocate more than that per connection.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import trio
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tectonic_py.core.errors import AuthError, ConfigError, ProtocolError, error_from_code
from tectonic_py.core.framing import (
    FLAG_TAG,
    TAG_BYTES,
    Buffer,
    Head,
    Limits,
    drain,
    pack_frame,
    read_prefix_and_header,
    recv_exactly,
    send_all,
    send_pieces,
)

PROTO = 3  # 2: frames after the handshake carry a tag; 3: the auth frame names its role
NONCE_BYTES = 32
MIN_SECRET_BYTES = 16
MAX_JOB_LEN = 64
MAX_JOB_WEIGHT = 1000
# The handshake's frames are ~100 bytes: a peer that has not authenticated may send no more.
HANDSHAKE_LIMITS = Limits(max_header=512, max_payload=0)
_NONCE = struct.Struct("!4xQ")  # GCM's 96-bit nonce: the frame's sequence number


def load_secret(path: str | os.PathLike[str], *, what: str = "secret file") -> bytes:
    """Read a cluster secret file (or another key file, ``what`` naming it in errors);
    refuse one too short to be a secret, or one that users other than its owner may read or
    write (as ssh refuses such a key): a secret others can read is no longer a secret, and
    the operator should hear so, not find out later."""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if mode & 0o077:
                raise ConfigError(
                    f"{what} {os.fspath(path)!r} is accessible by others "
                    f"(mode {mode & 0o777:04o}); run: chmod 600 {os.fspath(path)}"
                )
            data = f.read().strip()
    except OSError as e:
        raise ConfigError(f"cannot read {what} {os.fspath(path)!r}: {e.strerror}") from None
    if len(data) < MIN_SECRET_BYTES:
        raise ConfigError(f"{what} {os.fspath(path)!r} holds under 16 bytes")
    return data


ROLE_CLIENT = "client"
ROLE_MAINTENANCE = "maintenance"
ROLE_ADMIN = "admin"
ROLE_NODE = "node"
ROLES = (ROLE_CLIENT, ROLE_MAINTENANCE, ROLE_ADMIN, ROLE_NODE)


def role_key(secret: bytes, role: str) -> bytes:
    """The key of ``role`` under the cluster secret (module docstring), as the hex text its
    key file holds."""
    if role not in ROLES:
        raise ConfigError(f"unknown role {role!r}; the roles are {', '.join(ROLES)}")
    return hmac.new(secret, b"role key|" + role.encode(), hashlib.sha256).hexdigest().encode()


@dataclass(frozen=True)
class Credential:
    """What a connecting process proves: its role and that role's key."""

    role: str
    key: bytes = b""
    job: str = ""  # the traffic class named in the handshake ("" for none)
    weight: int = 0  # the job's weight where the stores do not set it (0: theirs)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"unknown role {self.role!r}; the roles are {', '.join(ROLES)}")
        check_job(self.job, self.weight)

    @classmethod
    def from_secret(cls, secret: bytes, role: str) -> Credential:
        """A process that holds the cluster secret itself (a server, a cluster directory made
        before roles) speaks as ``role`` with the key derived for it."""
        return cls(role, role_key(secret, role))

    def __repr__(self) -> str:  # never the key
        return f"Credential(role={self.role!r}, job={self.job!r})"


def check_job(job: str, weight: int) -> None:
    """ConfigError unless ``job`` and ``weight`` can be named in a handshake."""
    if len(job) > MAX_JOB_LEN or not all(c.isalnum() or c in "_.-" for c in job):
        raise ConfigError(f"bad job name {job!r}: up to 64 letters, digits and '_.-'")
    if isinstance(weight, bool) or not isinstance(weight, int):
        raise ConfigError(f"bad job weight {weight!r}: an integer 1..{MAX_JOB_WEIGHT}")
    if not 0 <= weight <= MAX_JOB_WEIGHT or (weight and not job):
        raise ConfigError(f"bad job weight {weight}: 1..{MAX_JOB_WEIGHT}, and only with a job")


def _tag(role: str, job: str, weight: int) -> bytes:
    """What the MACs bind besides the nonces: the role, and the job when one is named."""
    return role.encode() if not job else f"{role}|{job}|{weight}".encode()


class Keyring:
    """The roles a server accepts and their keys: every role's, derived from the cluster
    secret (the servers hold it), unless the server is built with fewer."""

    def __init__(self, keys: Mapping[str, bytes]) -> None:
        self._keys = dict(keys)

    @classmethod
    def from_secret(cls, secret: bytes) -> Keyring:
        return cls({role: role_key(secret, role) for role in ROLES})

    def key(self, role: object) -> bytes:
        key = self._keys.get(role) if isinstance(role, str) else None
        if key is None:
            raise AuthError(f"role {role!r} is not accepted here")
        return key

    def __repr__(self) -> str:
        return f"Keyring(roles={sorted(self._keys)})"


def as_credential(who: bytes | Credential, role: str = ROLE_ADMIN) -> Credential:
    """A credential, or the cluster secret itself (then speaking as ``role``)."""
    return who if isinstance(who, Credential) else Credential.from_secret(who, role)


def as_keyring(keys: bytes | Keyring) -> Keyring:
    """A keyring, or the cluster secret itself (every role accepted)."""
    return keys if isinstance(keys, Keyring) else Keyring.from_secret(keys)


def mac(key: bytes, direction: bytes, a: bytes, b: bytes) -> bytes:
    """The MAC one side sends: ``direction`` (b"client|" or b"server|" and the role) binds
    it to its direction and role."""
    return hmac.new(key, direction + b"|" + a + b"|" + b, hashlib.sha256).digest()


async def answer_handshake(sock: trio.socket.SocketType, keys: Keyring) -> FrameSession:
    """The server's half; returns the connection's ``FrameSession``, its ``role`` the one
    the peer proved. Raises ``ProtocolError`` for a frame that is not a well-formed auth
    frame and ``AuthError`` for a wrong MAC or a role not accepted; the caller sends the
    error and closes."""
    sn = secrets.token_bytes(NONCE_BYTES)
    await send_all(sock, pack_frame({"op": "hello", "proto": PROTO, "nonce": sn}, 0))
    header, plen = await read_prefix_and_header(sock, HANDSHAKE_LIMITS)
    if plen or header.get("op") != "auth":
        raise ProtocolError("expected an auth frame")
    cn, their_mac, role = header.get("nonce"), header.get("mac"), header.get("role")
    job, weight = header.get("job", ""), header.get("weight", 0)
    if not (
        isinstance(cn, bytes)
        and isinstance(their_mac, bytes)
        and len(cn) == NONCE_BYTES
        and isinstance(role, str)
        and isinstance(job, str)
    ):
        raise ProtocolError("malformed auth frame")
    try:
        check_job(job, weight)
    except ConfigError as e:
        raise ProtocolError(f"malformed auth frame: {e}") from None
    key = keys.key(role)
    tag = _tag(role, job, weight)
    if not hmac.compare_digest(their_mac, mac(key, b"client|" + tag, sn, cn)):
        raise AuthError(f"authentication failed (as role {role})")
    welcome = {"op": "welcome", "mac": mac(key, b"server|" + tag, cn, sn)}
    await send_all(sock, pack_frame(welcome, 0))
    session = FrameSession.derive(key, sn, cn, server=True, role=role)
    session.job, session.weight = job, weight
    return session


async def offer_handshake(
    sock: trio.socket.SocketType, who: bytes | Credential, address: str
) -> FrameSession:
    """The client's half; returns the connection's ``FrameSession``. ``who``: the
    credential, or the cluster secret itself (then as role admin). Raises ``ProtocolError``
    for an unexpected frame, ``AuthError`` when the server refuses us or fails its own MAC
    (``address`` names it in the error)."""
    cred = as_credential(who)
    header, plen = await read_prefix_and_header(sock, HANDSHAKE_LIMITS)
    sn = header.get("nonce")
    if header.get("op") != "hello" or plen or not isinstance(sn, bytes) or len(sn) != NONCE_BYTES:
        raise ProtocolError(f"{address}: bad hello")
    if header.get("proto") != PROTO:
        raise ProtocolError(f"{address}: protocol {header.get('proto')} unsupported")
    cn = secrets.token_bytes(NONCE_BYTES)
    tag = _tag(cred.role, cred.job, cred.weight)
    auth: dict[str, Any] = {
        "op": "auth",
        "role": cred.role,
        "nonce": cn,
        "mac": mac(cred.key, b"client|" + tag, sn, cn),
    }
    if cred.job:
        auth |= {"job": cred.job, "weight": cred.weight}
    await send_all(sock, pack_frame(auth, 0))
    header, plen = await read_prefix_and_header(sock, HANDSHAKE_LIMITS)
    if "err" in header:
        raise error_from_code(str(header["err"]), f"{address}: {header.get('msg', '')}")
    their_mac = header.get("mac")
    if header.get("op") != "welcome" or not isinstance(their_mac, bytes):
        raise ProtocolError(f"{address}: bad welcome")
    if not hmac.compare_digest(their_mac, mac(cred.key, b"server|" + tag, cn, sn)):
        raise AuthError(f"{address}: server failed authentication")
    return FrameSession.derive(cred.key, sn, cn, server=False, role=cred.role)


# --- frames after the handshake ------------------------------------------------------------


def _gmac(aead: AESGCM, key: bytes, seq: int, head: Buffer, payload: Buffer | None) -> bytes:
    """The tag of one frame: GMAC over ``head`` (prefix and header) then ``payload``.

    A frame without a payload takes the one-call AEAD (a fraction of a microsecond); one with
    a payload feeds both pieces to an incremental GCM context, so a payload is never joined
    to its header in a new buffer. Both give the tag of the pieces' concatenation."""
    nonce = _NONCE.pack(seq)
    if payload is None or not memoryview(payload).nbytes:
        return aead.encrypt(nonce, b"", memoryview(head))
    ctx = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
    ctx.authenticate_additional_data(memoryview(head))
    ctx.authenticate_additional_data(memoryview(payload))
    ctx.finalize()
    return ctx.tag


class FrameSession:
    """The per-direction keys and sequence numbers of one authenticated connection.

    Event-loop thread only. Frames are sealed in the order they go onto the socket (the
    caller holds the connection's send lock from ``seal`` until the frame is written) and
    checked in the order they come off it (one reader per connection)."""

    def __init__(self, send_key: bytes, recv_key: bytes, role: str = ROLE_ADMIN) -> None:
        self.role = role  # the role the client side proved in the handshake
        self.job, self.weight = "", 0  # the job it named (server side: core/auth docstring)
        self._send_key, self._recv_key = send_key, recv_key
        self._send, self._recv = AESGCM(send_key), AESGCM(recv_key)
        self.send_seq = 0
        self.recv_seq = 0

    @classmethod
    def derive(
        cls, key: bytes, sn: bytes, cn: bytes, *, server: bool, role: str = ROLE_ADMIN
    ) -> FrameSession:
        """Keys from the role's key and both nonces (an HKDF expand step keyed by it): fresh
        for every connection, and one per direction so that no (key, nonce) pair is ever
        used twice."""
        c2s, s2c = (
            hmac.new(key, b"frame key|" + side + b"|" + sn + cn, hashlib.sha256).digest()
            for side in (b"client", b"server")
        )
        return cls(s2c, c2s, role) if server else cls(c2s, s2c, role)

    def seal(self, head: Buffer, payload: Buffer | None) -> bytes:
        """The tag of the next frame this side sends."""
        tag = _gmac(self._send, self._send_key, self.send_seq, head, payload)
        self.send_seq += 1
        return tag

    def unseal(self) -> None:
        """Take back the last ``seal``: its frame was never sent (not one byte of it)."""
        self.send_seq -= 1

    def check(self, head: Head) -> FrameCheck:
        """The check of the next frame received, whose prefix and header are ``head``."""
        check = FrameCheck(self, self.recv_seq, head)
        self.recv_seq += 1
        return check


@dataclass
class FrameCheck:
    """The tag check of one received frame: ``feed`` it the payload as it arrives (the
    payload buffer, or what ``drain`` throws away), then ``verify``."""

    session: FrameSession
    seq: int
    head: Head
    _ctx: Any = None  # the incremental GCM context, made when a payload is fed

    def feed(self, piece: Buffer) -> None:
        if self._ctx is None:
            key = self.session._recv_key
            ctx = Cipher(algorithms.AES(key), modes.GCM(_NONCE.pack(self.seq))).encryptor()
            ctx.authenticate_additional_data(self.head.raw)
            self._ctx = ctx
        self._ctx.authenticate_additional_data(piece)

    async def verify(self, sock: trio.socket.SocketType) -> None:
        """Read the frame's tag off ``sock`` and check it; ``ProtocolError`` if it is wrong:
        the frame was forged, altered, replayed or reordered, and the connection ends."""
        tag = bytearray(TAG_BYTES)
        await recv_exactly(sock, memoryview(tag))
        if self._ctx is None:
            want = self.session._recv.encrypt(_NONCE.pack(self.seq), b"", self.head.raw)
        else:
            self._ctx.finalize()
            want = self._ctx.tag
        if not hmac.compare_digest(bytes(tag), want):
            raise ProtocolError("frame failed authentication")

    async def drain(self, sock: trio.socket.SocketType, n: int) -> None:
        """Discard the frame's ``n``-byte payload, then verify the tag."""
        await drain(sock, n, self.feed)
        await self.verify(sock)


def require_tag(head: Head) -> None:
    """Frames after the handshake carry a tag; one that says it does not is refused."""
    if not head.flags & FLAG_TAG:
        raise ProtocolError("frame without a tag after the handshake")


async def send_sealed(
    sock: trio.socket.SocketType,
    session: FrameSession,
    head: bytes,
    payload: Buffer | None,
    sent: list[int] | None = None,
) -> None:
    """Seal and send one frame (``head`` from ``pack_frame(..., flags=FLAG_TAG)``) in one
    ``writev``. The caller holds the connection's send lock. A send that fails or is
    cancelled before its first byte went out takes its sequence number back, so the stream
    stays usable; ``sent[0]`` counts the bytes that went out."""
    counter = sent if sent is not None else [0]
    before = counter[0]
    pieces = [memoryview(head)]
    if payload is not None and memoryview(payload).nbytes:
        pieces.append(memoryview(payload).cast("B"))
    pieces.append(memoryview(session.seal(head, payload)))
    try:
        await send_pieces(sock, pieces, counter)
    except BaseException:
        if counter[0] == before:
            session.unseal()
        raise


def sealed_pieces(session: FrameSession, heads: list[memoryview]) -> list[memoryview]:
    """Payload-free frames and their tags, in the order given, ready for one ``writev``."""
    pieces: list[memoryview] = []
    for head in heads:
        pieces.append(head)
        pieces.append(memoryview(session.seal(head, None)))
    return pieces
