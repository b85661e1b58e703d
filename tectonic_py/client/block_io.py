"""Block I/O: one block to chunk stores (encode, place, put, build its record) and one
block, or a range of it, back (cached, fetched whole, or read as ranges of data chunks).

Writes: zfec encodes the block in a worker thread (CRC-32C of every chunk in the same call),
the metadata service allocates a block id and places its n = k + m chunks on chunk stores in
distinct failure domains plus a few hedge nodes, and ``BlockPut`` sends them; if fewer than
``write_quorum`` (default k + 1) chunks land, the write fails with ``QuorumLost``. The caller
(the writer) commits the returned record.

A new version of a committed block that changed only some of its data chunks (an in-place
write: ``base`` and the dirty range) is a new block that *adopts* the old version's other
data chunks: it puts only the touched data chunks and the m parity chunks, each on the node
its index had, and its record names the adopted chunks by the block id they are stored as
(``ChunkPlacement.stored_as``; the Block layer keeps them alive while any version places
them). The parity comes from encoding the whole block, which the writer holds anyway, and
each adopted chunk's CRC is checked against the old record, so only a chunk that is the same
byte for byte is adopted.

Reads: a whole block is fetched by ``BlockFetch`` into the bounded ``BlockCache``; a range
read asks for byte ranges of data chunks only (systematic code: no decoding), verified by the
chunk store's CRC of the range; a range that fails is rebuilt from the same range of k other
chunks (``range_rebuild``), and the whole (degraded) block is read only when that fails too.
A whole chunk is checked against the CRC-32C recorded in the Block layer (end to end).
Every bad chunk is logged at WARNING and kept in ``statistics().bad_chunks``; a
chunk found corrupt or missing is also reported to the metadata service for repair
(``BadChunkReporter``).

Slowness is never failure: a slow get only starts a hedge while the original keeps running;
only a range read, which has a rebuild and a whole-block read to fall back on, gives up on a
slow chunk.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import trio

from chunkstore.client import ChunkPool
from tectonic_py.client.bad_chunks import BadChunkReporter
from tectonic_py.client.block_get import BlockFetch
from tectonic_py.client.block_put import BlockPut
from tectonic_py.client.buffers import BlockCache, block_buffer_size
from tectonic_py.client.codec import Codec
from tectonic_py.client.node_view import NodeView
from tectonic_py.client.range_rebuild import rebuild_range
from tectonic_py.client.stats import ClientStats
from tectonic_py.client.stripe import ChunkRange, chunk_len_for, chunk_ranges
from tectonic_py.core.aio import open_service_nursery
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import (
    ChecksumMismatch,
    ChunkCorrupt,
    ChunkNotFound,
    DiskFull,
    QuorumLost,
    TectonicError,
    Timeout,
)
from tectonic_py.core.ids import chunk_id
from tectonic_py.core.records import BlockInfo, ChunkPlacement, NodeInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockWrite:
    """One block for ``store_block``: whose it is (file, writer token, scheme, index in the
    file), its bytes, and for a new version of a committed block the version it was loaded
    from (``base``) and the range of the block that changed since (``dirty``)."""

    file_id: int
    token: int
    policy: ECPolicy
    file_index: int
    block: memoryview  # the buffer: at least k * chunk_len bytes, padded here
    data_len: int
    base: BlockInfo | None = None
    dirty: tuple[int, int] | None = None
    pack: bool = False  # a pack of many files' blocks (client/packing.py); file_id is one


@dataclass(frozen=True)
class IOTuning:
    """The block I/O knobs of ``open_client`` (``TectonicClient`` explains each)."""

    write_quorum: int | None = None
    hedge: int = 2
    chunk_timeout: float = 30.0
    write_hedge_s: float = 5.0
    slow_chunk_s: float = 10.0
    read_hedge_s: float = 2.0
    max_reconstructions: int = 2


class BlockIO:
    """Blocks to and from the chunk stores, for every writer and reader of one client."""

    def __init__(
        self,
        meta: Any,
        pool: ChunkPool,
        node_view: NodeView,
        codec: Codec,
        cache: BlockCache,
        stats: ClientStats,
        nursery: trio.Nursery,
        tuning: IOTuning,
    ) -> None:
        self.meta = meta
        self.pool = pool
        self.node_view = node_view
        self.codec = codec
        self.cache = cache
        self.stats = stats
        self._nursery = nursery
        self.tuning = tuning
        self.read_hedge_s = tuning.read_hedge_s
        self.slow_chunk_s = tuning.slow_chunk_s
        self.reconstruct = trio.CapacityLimiter(max(1, tuning.max_reconstructions))
        self.reporter = BadChunkReporter(meta, nursery, stats)
        self._fetching: dict[int, trio.Event] = {}
        self._addresses: dict[str, str] = {}

    # --- write side ----------------------------------------------------------------------------

    def quorum(self, policy: ECPolicy) -> int:
        q = self.tuning.write_quorum if self.tuning.write_quorum is not None else policy.k + 1
        return max(policy.k, min(q, policy.n))

    async def store_block(self, write: BlockWrite) -> BlockInfo:
        """Encode one block and make its chunks durable on chunk stores; returns the record
        to commit. Of a new version (``write.base``) the untouched data chunks are adopted
        where the module docstring allows. Raises QuorumLost when fewer than the write
        quorum of chunks could be written, DiskFull when that was mostly for want of space."""
        file_id, token, policy = write.file_id, write.token, write.policy
        data_len, base = write.data_len, write.base
        k = policy.k
        cl = max(1, chunk_len_for(data_len, k))
        padded = write.block[: k * cl]
        padded[data_len:] = bytes(k * cl - data_len)
        enc = await self.codec.encode(policy, padded, cl)
        adopted = self._adoptable(file_id, policy, data_len, cl, base, write.dirty, enc.checksums)
        if adopted:
            assert base is not None
            old = {c.index: c for c in base.chunks}
            targets = [
                NodeInfo(node_id=old[i].node_id, address=self.address_of(old[i]), failure_domain="")
                for i in range(policy.n)
            ]
            grant = await self.meta.allocate_block(
                file_id, token, policy.name, hedge=0, nodes=targets
            )
        else:
            grant = await self.meta.allocate_block(
                file_id, token, policy.name, hedge=self.tuning.hedge, pack=write.pack
            )
        self.node_view.refresh_soon()
        quorum = self.quorum(policy)
        put = BlockPut(
            self.meta,
            self.pool,
            self.node_view,
            self.stats,
            grant,
            policy.n,
            enc,
            write_hedge_s=self.tuning.write_hedge_s,
            chunk_timeout=self.tuning.chunk_timeout,
            quorum=quorum,
            indexes=[i for i in range(policy.n) if i not in adopted],
        )
        results = await put.run()
        if adopted:
            assert base is not None
            self.stats.adopted_chunks += len(adopted)
            for i, pl in adopted.items():
                results[i] = ChunkPlacement(
                    i, pl.node_id, pl.checksum, pl.address, pl.storage_block(base.block_id)
                )
        if len(results) < quorum:
            full = put.refused_full
            if full and 2 * full >= put.refused:
                # Mostly full stores: the writer (and a mount's ENOSPC) should say "no space",
                # not a lost quorum, which reads as failed nodes.
                raise DiskFull(
                    f"no space for block {grant.block_id:016x}: only {len(results)} of"
                    f" {policy.n} chunks stored ({full} refused by full chunk stores);"
                    f" the write quorum is {quorum}"
                )
            raise QuorumLost(
                f"only {len(results)} of {policy.n} chunks of block {grant.block_id:016x} could"
                f" be written; the write quorum is {quorum}"
            )
        if len(results) < policy.n:
            log.warning(
                "block %016x committed with %d of %d chunks (repair will restore the rest)",
                grant.block_id,
                len(results),
                policy.n,
            )
        self.stats.blocks_written += 1
        self.stats.bytes_written += data_len
        return BlockInfo(
            block_id=grant.block_id,
            ec=policy.name,
            chunk_len=cl,
            data_len=data_len,
            chunks=[results[i] for i in sorted(results)],
            file_index=write.file_index,
        )

    def _adoptable(
        self,
        file_id: int,
        policy: ECPolicy,
        data_len: int,
        cl: int,
        base: BlockInfo | None,
        dirty: tuple[int, int] | None,
        checksums: Sequence[int],
    ) -> dict[int, ChunkPlacement]:
        """The data chunks of ``base`` a new version may adopt, by index (none: write the
        whole block). Only when the block keeps its shape (scheme, lengths), lives in the
        file's shard like the new one (the Block layer checks adoptions in one shard), and
        every index has a node this client can reach to put its new chunk on."""
        if base is None or dirty is None or policy.replicated:
            return {}
        if (base.ec, base.data_len, base.chunk_len) != (policy.name, data_len, cl):
            return {}
        if self.meta.shard_of(base.block_id) != self.meta.shard_of(file_id):
            return {}  # a block of a file that predates co-location
        old = {c.index: c for c in base.chunks}
        for i in range(policy.n):
            pl = old.get(i)
            if (
                pl is None
                or not self.address_of(pl)
                or self.node_view.avoid(pl.node_id, self.address_of(pl))
            ):
                return {}
        lo, hi = dirty
        touched = set(range(lo // cl, min(policy.k, -(-hi // cl)))) if hi > lo else set()
        return {
            i: old[i]
            for i in range(policy.k)
            if i not in touched and checksums[i] == old[i].checksum
        }

    # --- chunks ------------------------------------------------------------------------------

    def address_of(self, pl: ChunkPlacement) -> str:
        """The chunk's node address as far as known without asking (may be "")."""
        return pl.address or self._addresses.get(pl.node_id, "")

    async def _address(self, pl: ChunkPlacement) -> str:
        if pl.address:
            return pl.address
        if pl.node_id not in self._addresses:
            for node in await self.meta.nodes():
                if node.state == "up":
                    self._addresses[node.node_id] = node.address
        return self._addresses.get(pl.node_id, "")

    def report_bad(self, info: BlockInfo, pl: ChunkPlacement, error: BaseException) -> None:
        """A chunk read failed: count and log it; one the store found corrupt or missing (not
        merely slow or unreachable) is reported for repair."""
        corrupt = isinstance(error, ChunkCorrupt)
        if corrupt:
            self.stats.corrupt_chunks += 1
        reason = "corrupt" if corrupt else type(error).__name__
        self.stats.bad_chunks.append((info.block_id, pl.index, pl.node_id, reason))
        if len(self.stats.bad_chunks) > 10_000:
            del self.stats.bad_chunks[:5000]
        log.warning(
            "chunk %d of block %016x on %s is %s (%s); reading degraded",
            pl.index,
            info.block_id,
            pl.node_id,
            reason,
            error,
        )
        if isinstance(error, ChunkCorrupt | ChunkNotFound):
            self.reporter.report(info.block_id, pl.index, pl.node_id, reason)

    async def get_into(
        self,
        info: BlockInfo,
        pl: ChunkPlacement,
        into: memoryview,
        offset: int = 0,
        *,
        limit: float = math.inf,
    ) -> None:
        """Fetch ``len(into)`` bytes of a chunk at ``offset`` straight into ``into``, verified:
        a whole chunk against the Block layer's CRC (end to end), a range against the chunk
        store's CRC of that range. ``limit`` is only for callers with a whole-block read to
        fall back on (a range read); whole-block fetches hedge instead of timing out.

        Bytes damaged on the way are asked for once more (the store checks every get before
        sending it); if they fail again the copy is taken for corrupt (ChunkCorrupt), as is
        one the store itself finds damaged or that differs from the Block layer's record."""
        address = await self._address(pl)
        cid = chunk_id(pl.storage_block(info.block_id), pl.index)
        whole = offset == 0 and into.nbytes == info.chunk_len
        expected = pl.checksum if whole else None
        with trio.move_on_after(limit) as scope:
            try:
                await self._get(address, cid, offset, into, expected)
            except ChecksumMismatch:
                try:
                    await self._get(address, cid, offset, into, expected)
                except ChecksumMismatch as e:
                    raise ChunkCorrupt(
                        f"{cid} on {pl.node_id} fails its checksum on a verified re-read ({e})"
                    ) from None
        if scope.cancelled_caught:
            raise Timeout(f"get of {cid} from {pl.node_id} took over {limit}s")

    async def _get(
        self,
        address: str,
        cid: str,
        offset: int,
        into: memoryview,
        expected: int | None,
    ) -> None:
        client = await self.pool.client(address)
        await client.get(cid, offset, into.nbytes, into=into, expected=expected)

    # --- read side ---------------------------------------------------------------------------

    async def read_block(self, info: BlockInfo) -> memoryview:
        """The data of one committed block (``data_len`` bytes), from cache or chunk stores,
        rebuilding it from parity when data chunks are missing, corrupt or slow. Always a
        whole block, so its buffer is reserved even over the budget: readers use
        ``read_part``, which stays inside it."""
        cached = self.cache.get(info.block_id)
        if cached is not None:
            self.stats.cache_hits += 1
            return cached
        pending = self._fetching.get(info.block_id)
        if pending is not None:
            await pending.wait()
            cached = self.cache.get(info.block_id)
            if cached is not None:
                self.stats.cache_hits += 1
                return cached
        self.stats.cache_misses += 1
        size = block_buffer_size(info)
        self.cache.reserve(size, force=True)
        return await self._fetch_and_cache(info, size)

    async def _fetch_and_cache(self, info: BlockInfo, reserved: int) -> memoryview:
        """Fetch a block whose buffer is already reserved in the cache, and cache it."""
        done = self._fetching.setdefault(info.block_id, trio.Event())
        try:
            data = await self.fetch_block(info)
        except BaseException:
            self.cache.unreserve(reserved)
            raise
        finally:
            if self._fetching.get(info.block_id) is done:
                del self._fetching[info.block_id]
            done.set()
        self.cache.put(info.block_id, data, reserved=reserved)
        return data

    async def fetch_block(self, info: BlockInfo) -> memoryview:
        """Whole-block fetch from the chunk stores (``BlockFetch``), not cached."""
        return await BlockFetch(self, info).run()

    async def read_part(
        self, info: BlockInfo, block_offset: int, length: int, *, view: bool = False
    ) -> bytes | bytearray | memoryview:
        """Block bytes ``[block_offset, block_offset + length)`` for a reader: from the cache
        or a fetch already running; else a whole-block fetch if the read budget has room
        (the reader will want the rest of the block); else only these bytes, straight from
        the chunk stores (a range read), so many readers never hold more than the budget.

        ``view``: the caller consumes the bytes before its next ``await`` (the FUSE layer
        hands them to the kernel at once), so a view of the cached block will do and the
        copy out of it, a large share of the mount's CPU per byte read, is saved."""
        end = block_offset + length
        cached = self.cache.get(info.block_id)
        if cached is None and info.block_id in self._fetching:
            await self._fetching[info.block_id].wait()
            cached = self.cache.get(info.block_id)
        if cached is not None:
            self.stats.cache_hits += 1
            return cached[block_offset:end] if view else bytes(cached[block_offset:end])
        size = block_buffer_size(info)
        if self.cache.reserve(size):
            self.stats.cache_misses += 1
            data = await self._fetch_and_cache(info, size)
            return data[block_offset:end] if view else bytes(data[block_offset:end])
        out = bytearray(length)
        await self.read_range(info, block_offset, memoryview(out))
        return out if view else bytes(out)

    async def read_range(self, info: BlockInfo, block_offset: int, out: memoryview) -> None:
        """Block bytes ``[block_offset, block_offset + len(out))`` (inside data_len) into
        ``out``: the systematic fast path (data-chunk ranges only, no decoding); a range
        that fails, is slow or lies on an avoided node is rebuilt from the same range of k
        other chunks (``rebuild_range``), and only if that fails too is the whole block read."""
        cached = self.cache.get(info.block_id)
        if cached is not None:
            self.stats.cache_hits += 1
            out[:] = cached[block_offset : block_offset + out.nbytes]
            return
        policy = ECPolicy.parse(info.ec)
        by_index = {pl.index: pl for pl in info.chunks}
        ranges = chunk_ranges(info.chunk_len, block_offset, out.nbytes, policy.k)
        lost, skip = await self._read_ranges(info, by_index, ranges, out)
        for r in lost:
            if not await rebuild_range(self, info, r, skip, out):
                data = await self.read_block(info)
                out[:] = data[block_offset : block_offset + out.nbytes]
                return

    async def _read_ranges(
        self,
        info: BlockInfo,
        by_index: dict[int, ChunkPlacement],
        ranges: Sequence[ChunkRange],
        out: memoryview,
    ) -> tuple[list[ChunkRange], set[int]]:
        """Every range into its place in ``out``; the ranges that failed, were slow or lie
        on an avoided node (not asked), and the chunk indices not worth asking again."""
        lost: list[ChunkRange] = []
        skip: set[int] = set()

        async def fetch(r: ChunkRange) -> None:
            pl = by_index.get(r.chunk_index)
            if pl is None or self.node_view.avoid(pl.node_id, self.address_of(pl)):
                lost.append(r)
                skip.add(r.chunk_index)
                return
            dst = out[r.out_offset : r.out_offset + r.length]
            try:
                await self.get_into(info, pl, dst, r.chunk_offset, limit=self.slow_chunk_s)
            except Timeout:
                lost.append(r)  # slow, not bad: rebuilt from others, reported nowhere
                skip.add(r.chunk_index)
            except TectonicError as e:
                self.report_bad(info, pl, e)
                lost.append(r)
                skip.add(r.chunk_index)

        self.stats.range_reads += 1
        async with open_service_nursery() as nursery:
            for r in ranges:
                nursery.start_soon(fetch, r)
        return lost, skip

    def prefetch(self, infos: Sequence[BlockInfo]) -> None:
        """Start whole-block fetches in the background (readahead); errors surface later in
        the foreground read that needs the block."""
        for info in infos:
            if info.block_id in self.cache or info.block_id in self._fetching:
                continue
            size = block_buffer_size(info)
            if not self.cache.reserve(size):
                return  # the budget is full of blocks readers are about to consume
            self._fetching[info.block_id] = trio.Event()
            self._nursery.start_soon(self._prefetch_one, info, size)

    async def _prefetch_one(self, info: BlockInfo, reserved: int) -> None:
        try:
            await self._fetch_and_cache(info, reserved)
        except TectonicError as e:
            log.info("readahead of block %016x failed: %s", info.block_id, e)
