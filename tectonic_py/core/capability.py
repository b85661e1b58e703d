"""Capability tokens: the metadata service's permission slip for a block's chunks.

A client that allocates a block (holding the file's writer token: ``block.allocate`` refuses
token 0) receives a token naming what it may do (``op``), the block, the chunk stores it may
write that block's chunks to (the placement plus hedges) and an expiry. Chunk stores check the
token on every put and every delete, so a client can only write chunks of blocks it
allocated, only to the nodes it was given, and can delete no chunk at all. A token names one
op: a put token does not license a delete. Delete tokens (and the put tokens of repair and
rebalance) come from ``block.caps``, which grants a delete only for a chunk the Block layer no
longer needs on that node (metadata/maintenance_ops.py).

Tokens are signed with the **capability key**, not the cluster secret: every client holds the
secret (it authenticates connections), so a token signed with it could be forged by any
client. Only metadata servers (which issue tokens) and chunk stores (which check them) read
the key file (``--capability-key-file``, mode 0600, as the secret file).

Token layout: msgpack ``[version=3, op, block_id, index, [node_id, ...], expiry_unix_s]``
followed by a 32-byte HMAC-SHA256 over those bytes with the capability key. ``index`` is the
one chunk of the block the token is for, or nil for any chunk of it (a writer's put token);
a delete token always names its chunk.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Sequence

import msgpack

from tectonic_py.core.auth import load_secret
from tectonic_py.core.errors import BadCapability, ConfigError

VERSION = 3
OPS = ("put", "delete")
MAC_LEN = 32
MAX_TOKEN = 16384
DEFAULT_TTL_S = 3600.0
DELETE_TTL_S = 120.0  # a delete follows its grant at once: a short life leaves little to steal


def load_key(path: str | os.PathLike[str] | None) -> bytes:
    """Read the capability key file: refused, as the secret file is, if it is short or others
    may read or write it. A daemon given none refuses to start rather than derive a key from
    the cluster secret, which every client could derive too."""
    if path is None:
        raise ConfigError(
            "no --capability-key-file: chunk stores and metadata servers need the capability"
            " key (a file of mode 0600 that clients never see)"
        )
    return load_secret(path, what="capability key file")


def issue(
    key: bytes,
    block_id: int,
    nodes: Sequence[str],
    *,
    op: str = "put",
    index: int | None = None,
    ttl_s: float = DEFAULT_TTL_S,
) -> bytes:
    """A token that lets ``op`` be done on ``nodes`` to chunk ``index`` of ``block_id`` (to
    any of its chunks when ``index`` is None, which a delete token may not be)."""
    if op not in OPS:
        raise ValueError(f"unknown capability op {op!r}")
    if op == "delete" and index is None:
        raise ValueError("a delete capability names its chunk")
    body = msgpack.packb([VERSION, op, block_id, index, list(nodes), int(time.time() + ttl_s)])
    return body + hmac.new(key, body, hashlib.sha256).digest()


def verify(
    key: bytes,
    token: bytes,
    block_id: int,
    node_id: str,
    *,
    op: str = "put",
    index: int | None = None,
) -> None:
    """Raise BadCapability unless ``token`` lets ``node_id`` do ``op`` to chunk ``index`` of
    ``block_id``."""
    if not isinstance(token, bytes) or len(token) <= MAC_LEN or len(token) > MAX_TOKEN:
        raise BadCapability(f"missing or malformed {op} capability token")
    body, mac = token[:-MAC_LEN], token[-MAC_LEN:]
    if not hmac.compare_digest(mac, hmac.new(key, body, hashlib.sha256).digest()):
        raise BadCapability("capability token signature is invalid")
    try:
        version, tok_op, tok_block, tok_index, nodes, expiry = msgpack.unpackb(body)
    except Exception:  # noqa: BLE001 (msgpack and the unpacking raise many types for garbage)
        raise BadCapability("capability token body is malformed") from None
    if version != VERSION or tok_block != block_id:
        raise BadCapability(f"capability token is not for block {block_id:016x}")
    if tok_op != op:
        raise BadCapability(f"capability token is for {tok_op!r}, not {op!r}")
    if (tok_index is None and op == "delete") or (tok_index is not None and tok_index != index):
        raise BadCapability(f"capability token is not for chunk {index} of {block_id:016x}")
    if node_id not in nodes:
        raise BadCapability(f"capability token does not name node {node_id!r}")
    if expiry < time.time():
        raise BadCapability("capability token expired")
