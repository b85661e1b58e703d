"""Helpers of the chunk store tests: a store started in-process, its client, chunk ids.

A store checks capabilities with its capability key, which no client holds; here the test's
key is derived from the test's secret (``cap_key``), so that a test of the chunk store alone
can sign the capabilities the metadata service would grant.
"""

from __future__ import annotations

import hashlib
from contextlib import asynccontextmanager
from pathlib import Path

from chunkstore import layout
from chunkstore.client import ChunkClient
from chunkstore.server import ChunkStoreServer, StoreConfig
from tectonic_py.core import capability, ids, rpc_client

NODE = "node-1"
KiB, MiB = 1024, 1024 * 1024


def cap_key(secret: bytes) -> bytes:
    """The capability key of a test's chunk store (distinct from the secret, as in a cluster)."""
    return hashlib.sha256(b"test capability key|" + secret).hexdigest().encode()


def make_config(data_dir: Path, secret: bytes, **kw) -> StoreConfig:
    kw.setdefault("capability_key", cap_key(secret))
    return StoreConfig(
        data_dir=data_dir, node_id=NODE, failure_domain="rack-1", secret=secret, **kw
    )


async def start_store(nursery, data_dir: Path, secret: bytes, **kw) -> tuple[ChunkStoreServer, int]:
    server = ChunkStoreServer(make_config(data_dir, secret, **kw))
    _, port = await nursery.start(server.serve)
    return server, port


@asynccontextmanager
async def open_client(port: int, secret: bytes):
    async with rpc_client.open_connection("127.0.0.1", port, secret) as conn:
        yield ChunkClient(conn)


def new_chunk(secret: bytes, index: int = 0, node: str = NODE) -> tuple[str, bytes]:
    """A fresh chunk id and a put capability for it, as ``block.allocate`` grants."""
    block = ids.new_id()
    return ids.chunk_id(block, index), capability.issue(cap_key(secret), block, [node])


def delete_cap(secret: bytes, chunk_id: str, node: str = NODE) -> bytes:
    """A delete capability for ``chunk_id`` on ``node``, as ``block.caps`` grants one."""
    block, index = ids.parse_chunk_id(chunk_id)
    return capability.issue(cap_key(secret), block, [node], op="delete", index=index)


def payload(n: int, seed: int = 0) -> bytes:
    return (bytes(range(251)) * (n // 251 + 2))[seed % 251 :][:n]


def chunk_file(server: ChunkStoreServer, chunk_id: str) -> Path:
    return layout.chunk_path(server.data_dir, chunk_id)


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))
