"""Capability tokens: the metadata service's permission slip for a block's chunks.

A client that allocates a block (holding the file's writer token: ``block.allocate`` refuses
token 0) receives a token naming what it may do (``op``), the block, the chunk stores it may
write that block's chunks to (the placement plus hedges) and an expiry. Chunk stores check the
token on every put, so a client can only write chunks of blocks it allocated, and only to the
nodes it was given. A token names one op: a put token does not license a delete. Repair and
rebalance mint their own tokens with the same secret.

Token layout: msgpack ``[version=2, op, block_id, [node_id, ...], expiry_unix_s]`` followed by
a 32-byte HMAC-SHA256 over those bytes with the cluster secret.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Sequence

import msgpack

from tectonic_py.core.errors import BadCapability

VERSION = 2
OPS = ("put", "delete")
MAC_LEN = 32
DEFAULT_TTL_S = 3600.0


def issue(
    secret: bytes,
    block_id: int,
    nodes: Sequence[str],
    *,
    op: str = "put",
    ttl_s: float = DEFAULT_TTL_S,
) -> bytes:
    """A token that lets ``op`` be done to ``block_id``'s chunks on ``nodes``."""
    if op not in OPS:
        raise ValueError(f"unknown capability op {op!r}")
    body = msgpack.packb([VERSION, op, block_id, list(nodes), int(time.time() + ttl_s)])
    return body + hmac.new(secret, body, hashlib.sha256).digest()


def verify(secret: bytes, token: bytes, block_id: int, node_id: str, *, op: str = "put") -> None:
    """Raise BadCapability unless ``token`` lets ``node_id`` do ``op`` to chunks of
    ``block_id``."""
    if not isinstance(token, bytes) or len(token) <= MAC_LEN or len(token) > 16384:
        raise BadCapability("missing or malformed capability token")
    body, mac = token[:-MAC_LEN], token[-MAC_LEN:]
    if not hmac.compare_digest(mac, hmac.new(secret, body, hashlib.sha256).digest()):
        raise BadCapability("capability token signature is invalid")
    try:
        version, tok_op, tok_block, nodes, expiry = msgpack.unpackb(body)
    except Exception:  # noqa: BLE001 (msgpack and the unpacking raise many types for garbage)
        raise BadCapability("capability token body is malformed") from None
    if version != VERSION or tok_block != block_id:
        raise BadCapability(f"capability token is not for block {block_id:016x}")
    if tok_op != op:
        raise BadCapability(f"capability token is for {tok_op!r}, not {op!r}")
    if node_id not in nodes:
        raise BadCapability(f"capability token does not name node {node_id!r}")
    if expiry < time.time():
        raise BadCapability("capability token expired")
