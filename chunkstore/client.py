"""ChunkClient: typed calls to one chunk store over an authenticated wire connection.

The data-path client, repair and the CLI use this rather than raw ``Connection.call`` so that
field names and the end-to-end check of returned bytes live in one place: every ``get``
verifies the bytes it received, so a chunk is checked from disk to the caller's buffer.
A ranged get is checked against the CRC the store computed from verified disk data
(ChecksumMismatch, retryable, if the bytes were damaged on the way). A whole get of a large
chunk may come unverified, straight from the store's page cache (``verified: False``,
``chunkstore.layout.splice_chunk``), with the checksum the chunk was stored under: bytes
that fail it are asked for again with ``verify``, and the store then reads and checks the
chunk itself, answering ChunkCorrupt for a damaged copy on disk.
"""

from __future__ import annotations

import builtins
import logging
from dataclasses import dataclass

import trio

from chunkstore.layout import file_size_for
from tectonic_py.core import framing, rpc_client
from tectonic_py.core.checksum import KEEP_GIL_MAX
from tectonic_py.core.checksum import checksum as crc32c
from tectonic_py.core.errors import ChecksumMismatch

log = logging.getLogger(__name__)

__all__ = ["ChunkClient", "ChunkStat", "file_size_for"]

# Up to this, computing a CRC in the event loop, holding the GIL, is cheaper than a thread
# hop and the GIL hand-offs that come with it.
_INLINE_CRC = KEEP_GIL_MAX


@dataclass(frozen=True)
class ChunkStat:
    size: int
    checksum: int
    mtime: float


@dataclass(frozen=True)
class NodeStats:
    node_id: str
    failure_domain: str
    capacity: int
    free: int
    used: int
    chunk_count: int
    queue_depth: int
    bytes_in: int
    bytes_out: int


async def _crc(data: framing.Buffer) -> int:
    if memoryview(data).nbytes <= _INLINE_CRC:
        return crc32c(data, keep_gil=True)
    return await trio.to_thread.run_sync(crc32c, data)


class ChunkClient:
    """Calls on one chunk store; shares ``conn`` (many calls may be in flight at once)."""

    def __init__(self, conn: rpc_client.Connection) -> None:
        self.conn = conn

    async def put(
        self, chunk_id: str, data: framing.Buffer, cap: bytes, checksum: int | None = None
    ) -> None:
        """Store a chunk durably; returns once it is on the store's disk.

        ``checksum`` is the chunk's crc32c (computed here if not given). Raises ChunkConflict
        if other bytes are stored under the id, Busy (retryable) when the store is at its
        admission limit, DiskFull, BadCapability, ChecksumMismatch.
        """
        if checksum is None:
            checksum = await _crc(data)
        await self.conn.call("put", {"chunk_id": chunk_id, "checksum": checksum, "cap": cap}, data)

    async def get(
        self,
        chunk_id: str,
        offset: int = 0,
        length: int | None = None,
        *,
        into: bytearray | memoryview | None = None,
        verify: bool = False,
    ) -> memoryview:
        """Verified bytes of a chunk (``length`` None: to its end); a view of ``into`` when a
        buffer large enough is given. ChunkCorrupt if the store's copy is damaged.
        ``verify``: have the store check the bytes before sending them (it does for ranged
        gets anyway); a whole get that came unverified and fails its check is asked for again
        that way."""
        fields: dict[str, object] = {"chunk_id": chunk_id, "offset": offset}
        if length is not None:
            fields["length"] = length
        if verify:
            fields["verify"] = True
        resp = await self.conn.call("get", fields, into=into)
        data = resp.payload if resp.payload is not None else memoryview(b"")
        expected = resp.fields.get("range_checksum")
        got = await _crc(data)
        if got != expected:
            if resp.fields.get("verified") is False and not verify:
                log.warning(
                    "chunk %s from %s failed its checksum; asking for a verified read",
                    chunk_id,
                    self.conn.address,
                )
                return await self.get(chunk_id, offset, length, into=into, verify=True)
            raise ChecksumMismatch(
                f"chunk {chunk_id} bytes {offset}+{len(data)} damaged in transit from"
                f" {self.conn.address} (crc {got:08x} != {expected})"
            )
        return data

    async def delete(self, chunk_id: str) -> bool:
        """Remove a chunk; True if it existed."""
        resp = await self.conn.call("delete", {"chunk_id": chunk_id})
        return bool(resp.fields["existed"])

    async def stat(self, chunk_id: str) -> ChunkStat:
        f = (await self.conn.call("stat", {"chunk_id": chunk_id})).fields
        return ChunkStat(int(f["size"]), int(f["checksum"]), float(f["mtime"]))

    async def list(
        self, after: str = "", limit: int = 1000
    ) -> tuple[builtins.list[tuple[str, int]], str | None]:
        """One page of (chunk_id, size) in id order and the ``after`` of the next page."""
        f = (await self.conn.call("list", {"after": after, "limit": limit})).fields
        return [(str(c), int(n)) for c, n in f["chunks"]], f["next"]

    async def list_all(self, page: int = 1000) -> builtins.list[tuple[str, int]]:
        """Every chunk on the store, page by page."""
        out: builtins.list[tuple[str, int]] = []
        after: str | None = ""
        while after is not None:
            chunks, after = await self.list(after, page)
            out.extend(chunks)
        return out

    async def node_stats(self) -> NodeStats:
        f = (await self.conn.call("node_stats")).fields
        return NodeStats(**{k: f[k] for k in NodeStats.__dataclass_fields__})
