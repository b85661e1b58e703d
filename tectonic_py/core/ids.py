"""Identifier types and the rules that keep them safe.

Ids of files, directories and blocks are 64-bit integers, drawn at random by the shard that
will own them and checked for uniqueness there, so they are unique across the cluster
without a central counter. A chunk's id names its block and its index in the block's
erasure code: ``f"{block_id:016x}.{index}"``. Chunk stores accept nothing else, so a chunk id
can never name a path outside the data directory.
"""

from __future__ import annotations

import re
import secrets
import zlib
from typing import NewType

FileId = NewType("FileId", int)  # files and directories (Name/File layer inode numbers)
BlockId = NewType("BlockId", int)
NodeId = NewType("NodeId", str)  # a chunk store's name, chosen by the operator
ShardId = NewType("ShardId", int)
ChunkId = NewType("ChunkId", str)

ROOT_ID = FileId(1)
MAX_ID = 2**63 - 1
MAX_CHUNK_INDEX = 255

CHUNK_ID_RE = re.compile(r"\A[0-9a-f]{16}\.(0|[1-9][0-9]{0,2})\Z")
NODE_ID_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")


def new_id() -> int:
    """A random id in 2..2**63-1 (0 is never valid, 1 is the root directory)."""
    while True:
        value = secrets.randbits(63)
        if value > ROOT_ID:
            return value


def chunk_id(block_id: int, index: int) -> ChunkId:
    return ChunkId(f"{block_id:016x}.{index}")


def parse_chunk_id(value: str) -> tuple[BlockId, int]:
    """Split a chunk id; ValueError for anything that is not exactly a chunk id."""
    if not isinstance(value, str) or not CHUNK_ID_RE.match(value):
        raise ValueError(f"invalid chunk id {value!r}")
    block, index = value.split(".")
    idx = int(index)
    if idx > MAX_CHUNK_INDEX:
        raise ValueError(f"chunk index {idx} over {MAX_CHUNK_INDEX}")
    return BlockId(int(block, 16)), idx


def shard_of(key: int, shards: int) -> ShardId:
    """Shard = hash(id) mod S. A stable hash (crc32 of the 8 id bytes), never Python's hash()."""
    return ShardId(zlib.crc32(key.to_bytes(8, "big")) % shards)
