"""The data-path client: striped, erasure-coded writes and reads (Tectonic's client library).

All the logic of reads and writes lives here, as in Tectonic; the FUSE mount, the ``tectonic``
CLI, the blocking wrapper and the load test are thin layers over it::

    async with open_client("cluster.toml") as client:
        w = await client.create("/ckpt/rank_0.pt")
        await w.write(data)
        await w.close()                  # durable, committed and sealed
        r = await client.open_read("/ckpt/rank_0.pt")
        data = await r.read()

Write path. Bytes go into the *open block*, a buffer of one block (k chunks of C bytes) taken
from the client-wide ``BufferPool``. When the open block is full it is handed to a flush task
in the client's nursery: zfec encodes it in a worker thread (CRC-32C of every chunk in the
same call), the metadata service allocates a block id and places its n = k + m chunks on
chunk stores in distinct failure domains plus a few hedge nodes, all n chunks go out at once
over pooled, persistent connections, and the block is committed (Block layer, then File layer
at its ``file_index``, with the writer token). A chunk store that fails or stalls mid-write
gets its chunk re-sent to a hedge node (then to nodes asked for with ``more_nodes``); if fewer
than ``write_quorum`` (default k + 1) chunks land, the write fails with ``QuorumLost``.

Backpressure: the pool holds at most ``window_bytes`` of block buffers (and their parity)
across all writers of the client, so a writer that outruns the cluster waits in ``write``
for a buffer; nothing buffers without bound. Several blocks are in flight at once inside the
window, which keeps both cores busy (one encoding while another's chunks are on the wire).

``fsync`` flushes the open block, even a short one (committed at its index; when the writer
later fills it, the full block replaces it at the same index), and waits until every flush
task has committed. ``close`` is fsync + seal. Commits of one index are ordered by a per-index
generation, so an older, slower flush of a block never overwrites a newer one. A writer whose
token was stolen gets ``StaleWriterToken`` from its next commit, and from every call after.

Read path. A reader fetches the file's block list once. ``pread`` maps a range to blocks and
then to byte ranges of data chunks (systematic code: no decoding), verified by the chunk
store's CRC of the range. Sequential ``read`` fetches whole blocks (k chunks received straight
into one buffer, each checked against the CRC-32C recorded in the Block layer) and reads ahead
``readahead_blocks`` in parallel into the bounded block cache. Any chunk that is missing,
corrupt makes the read *degraded*: parity chunks are fetched and zfec rebuilds the data (at most ``max_reconstructions`` at once per client, so an overload
cannot become a reconstruction storm). Every bad chunk is logged at WARNING and recorded in
``statistics().bad_chunks`` for the repair service.

Down nodes are planned around, not timed out on. ``NodeView`` keeps the registry's "down"
marks (``node.list``, asked at most every 1.5 s and only when a request failed or went slow, a
block was placed or a file opened) and the stores this client just failed to reach (avoided
for ``node_backoff_s``): a data chunk on such a node is replaced by a parity fetch from the
start, and puts and hedges go to other nodes, so a dead store costs one timeout per client
rather than one per block (a cut host made every block of a read wait for it).

Slowness is never failure. Under a burst every chunk store queues, parity chunks as much as
data chunks; a client that gave up on slow requests would fail reads and writes whose bytes are
all there (4,096-rank restore: 1,179 ranks got QuorumLost). So a slow get or put only *starts*
a hedge (a parity fetch, a put to a spare node) while the original request keeps running; a
block read or write fails only when too many requests have actually failed (an error from the
store, or the connection lost).

Error handling: every public method raises only ``tectonic_py.core.errors`` classes, never
exception groups. Resource handling: background tasks (flushes, readahead, connection
receivers) live in the nursery of ``open_client``; leaving it closes every connection.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from tectonic_py.client.codec import Codec, EncodedBlock
from tectonic_py.client.stripe import Layout, chunk_len_for, chunk_ranges
from tectonic_py.core import cluster_file, rpc_client, sockets
from tectonic_py.core.aio import open_service_nursery
from tectonic_py.core.cluster_file import ClusterConfig
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import (
    ChunkCorrupt,
    FileExists,
    FileNotFound,
    InvalidArgument,
    InvalidName,
    QuorumLost,
    TectonicError,
    Timeout,
    Unavailable,
)
from tectonic_py.core.ids import ROOT_ID, chunk_id
from tectonic_py.core.records import (
    Attrs,
    BlockGrant,
    BlockInfo,
    ChunkPlacement,
    DirEntry,
    NodeInfo,
)

log = logging.getLogger(__name__)

MiB = 1024 * 1024
Buffer = bytes | bytearray | memoryview

DEFAULT_WINDOW_BYTES = 256 * MiB
DEFAULT_CACHE_BYTES = 192 * MiB
LEASE_RENEW_S = 15.0  # well inside the metadata server's writer lease (60 s by default)


@dataclass
class ClientStats:
    """Counters of one client (``TectonicClient.statistics()``)."""

    blocks_written: int = 0
    bytes_written: int = 0
    chunks_written: int = 0
    chunk_write_failures: int = 0
    chunks_replaced: int = 0
    hedged_puts: int = 0
    blocks_read: int = 0
    bytes_read: int = 0
    range_reads: int = 0
    degraded_reads: int = 0
    corrupt_chunks: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    buffer_waits: int = 0
    spills: int = 0
    # Requests (and connects) sent to each chunk store, by address: a dead node should cost
    # one attempt per client, not one per block.
    node_attempts: dict[str, int] = field(default_factory=dict)
    # Chunks not asked for (reads) or not sent (writes) because their node was known down
    # or backing off.
    avoided_chunks: int = 0
    # (block_id, chunk_index, node_id, reason) of chunks found missing or corrupt: repair's input.
    bad_chunks: list[tuple[int, int, str, str]] = field(default_factory=list)


# --- memory window ---------------------------------------------------------------------------


class BufferPool:
    """The client-wide memory window: block buffers, reused, at most ``capacity`` bytes.

    A buffer is charged ``charge`` bytes (its size plus the parity zfec will allocate for it)
    from ``acquire`` to ``release``. Up to two released buffers are kept for reuse
    (allocation of large buffers is costly, CEILINGS.md), so the pool's memory stays within
    the capacity plus two buffers; spares of other sizes are dropped to make room.

    Idle writers are spilled: a writer's open block holds a buffer between writes, so a
    program that writes many files round-robin from one thread could hold the whole window
    in half-filled blocks while it waits for a buffer for the next file, forever. A waiter
    that has waited ``SPILL_AFTER_S`` asks every writer idle that long to flush its open
    block (committed as a short block; the writer reloads it when it writes again).
    """

    SPILL_AFTER_S = 1.0

    def __init__(self, capacity: int, stats: ClientStats) -> None:
        self.capacity = capacity
        self._stats = stats
        self._charged = 0
        self._spare: dict[int, list[bytearray]] = {}
        self._spare_bytes = 0
        self._lot = trio.lowlevel.ParkingLot()
        self.holders: set[FileWriter] = set()
        self.spill: Any = None  # set by the client: starts a writer's spill task

    @property
    def charged(self) -> int:
        return self._charged

    async def acquire(self, size: int, charge: int) -> bytearray:
        charge = min(max(charge, size), self.capacity)
        if self._charged + charge > self.capacity:
            self._stats.buffer_waits += 1
            while self._charged + charge > self.capacity:
                with trio.move_on_after(self.SPILL_AFTER_S / 2):
                    await self._lot.park()
                self._spill_idle()
        self._charged += charge
        spares = self._spare.get(size)
        if spares:
            self._spare_bytes -= size
            return spares.pop()
        while self._spare_bytes and self._charged + self._spare_bytes > self.capacity:
            self._drop_one_spare()
        return bytearray(size)

    def release(self, buf: bytearray, charge: int) -> None:
        charge = min(max(charge, len(buf)), self.capacity)
        self._charged -= charge
        # Keep at most two spare buffers: the next acquire nearly always takes one at once
        # (a fresh 24 MiB buffer costs a memset and thousands of page faults), and memory
        # stays within the window plus two buffers.
        if self._spare_bytes + len(buf) <= 2 * len(buf):
            self._spare.setdefault(len(buf), []).append(buf)
            self._spare_bytes += len(buf)
        self._lot.unpark_all()

    def _spill_idle(self) -> None:
        if self.spill is None:
            return
        now = time.monotonic()
        for writer in list(self.holders):
            if now - writer.last_write >= self.SPILL_AFTER_S and not writer.spilling:
                writer.spilling = True
                self._stats.spills += 1
                self.spill(writer)

    def _drop_one_spare(self) -> None:
        for size, bufs in self._spare.items():
            if bufs:
                bufs.pop()
                self._spare_bytes -= size
                return


class BlockCache:
    """The readers' memory budget: whole blocks cached (keyed by block id, blocks are
    immutable) *and* the buffers of block fetches in flight, at most ``capacity`` bytes.

    Why fetches count: 64 readers each fetching a 16 MiB block (plus readahead) held 1 GiB
    of buffers that the cache never saw. A fetch now ``reserve``s its buffer first; a reader
    that gets no room reads the bytes it asked for straight from the chunk stores (a range
    read into its own buffer) instead of a whole block.

    Admission: a fetched block is *pinned* (a reader is about to consume it) until that
    reader has read to its end (``done``) or nobody touched it for ``GRACE_S``. Reservations
    (readahead, a reader's next block) evict only unpinned blocks, least recently used first,
    so one reader's readahead never evicts the block another reader is in the middle of
    (the thrash that made 64 readers through the mount 10x slower than one ``dd``).

    Evicted blocks' buffers are kept (a few) and handed to the next block fetch: a fresh
    24 MiB bytearray costs a memset and thousands of page faults, a measurable share of the
    read path's CPU. Safe because every user of ``get``/``read_block`` copies out of the
    view before its next ``await`` (developer note: keep it that way).
    """

    KEEP_FREE = 2
    GRACE_S = 5.0

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[int, memoryview] = OrderedDict()
        self._pinned: dict[int, float] = {}  # block id -> last access
        self._bytes = 0  # cached blocks' buffers plus reservations of fetches in flight
        self._free: list[bytearray] = []

    @property
    def used(self) -> int:
        return self._bytes

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._blocks

    def get(self, block_id: int) -> memoryview | None:
        data = self._blocks.get(block_id)
        if data is not None:
            self._blocks.move_to_end(block_id)
            if block_id in self._pinned:
                self._pinned[block_id] = time.monotonic()
        return data

    def reserve(self, size: int, *, force: bool = False) -> bool:
        """Room for a fetch buffer of ``size`` bytes, evicting unpinned blocks (any block
        when ``force``d, and then even over capacity: a caller that must have the whole
        block, such as a degraded fallback). False, and nothing reserved, when no room."""
        now = time.monotonic()
        if self._bytes + size > self.capacity:
            for bid in list(self._blocks):
                if self._bytes + size <= self.capacity:
                    break
                touched = self._pinned.get(bid)
                if force or touched is None or now - touched >= self.GRACE_S:
                    self.discard(bid)
        if self._bytes + size > self.capacity and not force:
            return False
        self._bytes += size
        return True

    def unreserve(self, size: int) -> None:
        self._bytes -= size

    def put(self, block_id: int, data: memoryview, *, reserved: int = 0) -> None:
        """Cache a fetched block (pinned), turning its fetch's reservation into its entry."""
        self._bytes -= reserved
        size = _buffer_size(data)
        if size > self.capacity:
            return
        self.discard(block_id)
        self._blocks[block_id] = data
        self._pinned[block_id] = time.monotonic()
        self._bytes += size
        while self._bytes > self.capacity and len(self._blocks) > 1:
            self.discard(next(iter(self._blocks)))

    def done(self, block_id: int) -> None:
        """A reader has read to the end of this block: it may be evicted first."""
        self._pinned.pop(block_id, None)

    def discard(self, block_id: int) -> None:
        old = self._blocks.pop(block_id, None)
        self._pinned.pop(block_id, None)
        if old is not None:
            self._bytes -= _buffer_size(old)
            self._recycle(old)

    def _recycle(self, view: memoryview) -> None:
        buf = view.obj
        if isinstance(buf, bytearray) and len(self._free) < self.KEEP_FREE:
            self._free.append(buf)

    def take(self, size: int) -> bytearray:
        """A buffer of exactly ``size`` bytes for a block fetch (contents undefined)."""
        for i, buf in enumerate(self._free):
            if len(buf) == size:
                return self._free.pop(i)
        self._free.clear()  # wrong sizes: do not keep memory outside the budget
        return bytearray(size)


def _block_buffer_size(info: BlockInfo) -> int:
    """The fetch buffer of a block: its k data chunks."""
    return ECPolicy.parse(info.ec).k * info.chunk_len


def _buffer_size(view: memoryview) -> int:
    """Bytes a cached view keeps alive: its whole underlying buffer."""
    obj = view.obj
    return len(obj) if isinstance(obj, bytearray) else view.nbytes


# --- connections to chunk stores -------------------------------------------------------------


class NodeView:
    """The client's view of which chunk stores to avoid: the registry's "down" marks, and
    nodes this client itself just failed to reach (backing off).

    Why: after a host's link is cut, every block read first tried the dead node and waited
    out a connect timeout (reading 40 MB through a cut host took 24-31 s). With this view a
    block whose data chunk sits on a down node goes straight to a degraded read, and a node
    that just failed costs one timeout per client, not one per block. The registry is asked
    (``node.list``) at most every ``REFRESH_S``, and only when something suggests the view
    is stale (a chunk request failed or went slow, a block was placed, a file opened), never
    per request.
    """

    REFRESH_S = 1.5

    def __init__(self, meta: Any, nursery: trio.Nursery, backoff_s: float) -> None:
        self._meta = meta
        self._nursery = nursery
        self.backoff_s = backoff_s
        self.down: set[str] = set()  # node ids the registry marks down
        self._failed: dict[str, float] = {}  # address -> back off until (trio clock)
        self._refreshed = -math.inf
        self._refreshing = False

    def backing_off(self, address: str) -> bool:
        until = self._failed.get(address)
        if until is None:
            return False
        if trio.current_time() < until:
            return True
        del self._failed[address]
        return False

    def avoid(self, node_id: str, address: str) -> bool:
        """Whether a chunk on this node should be fetched or sent elsewhere if possible."""
        return node_id in self.down or bool(address and self.backing_off(address))

    def failed(self, address: str) -> None:
        """This client could not reach ``address`` (connect refused or timed out, connection
        lost): avoid it for ``backoff_s`` and ask the registry what it knows."""
        if address not in self._failed:
            log.info("chunk store %s unreachable; avoiding it for %.1fs", address, self.backoff_s)
        self._failed[address] = trio.current_time() + self.backoff_s
        self.refresh_soon()

    def stale(self) -> bool:
        return not self._refreshing and trio.current_time() - self._refreshed >= self.REFRESH_S

    def refresh_soon(self) -> None:
        """Refresh in the background (rate limited): callers never wait for the registry."""
        if self.stale():
            self._refreshing = True
            self._nursery.start_soon(self._refresh)

    async def refresh(self) -> None:
        """Refresh now if the view is older than ``REFRESH_S`` (opening a file for reading)."""
        if self.stale():
            self._refreshing = True
            await self._refresh()

    async def _refresh(self) -> None:
        try:
            nodes = await self._meta.nodes()
        except TectonicError as e:
            log.info("node list unavailable (%s); keeping the last view", e)
        else:
            down = {n.node_id for n in nodes if n.state != "up"}
            if down != self.down:
                log.info("chunk stores marked down by the registry: %s", sorted(down) or "none")
            self.down = down
        finally:
            self._refreshed = trio.current_time()
            self._refreshing = False


class ChunkPool:
    """Persistent, pooled connections to chunk stores, one (or a few) per node.

    Connections are opened on first use and replaced when broken; their receiver tasks live
    in the client's nursery. ``rpc_client.Connection`` multiplexes many requests, so one connection
    per node carries every block's chunk for that node.
    """

    def __init__(
        self,
        secret: bytes,
        nursery: trio.Nursery,
        per_node: int = 1,
        *,
        view: NodeView | None = None,
        stats: ClientStats | None = None,
        connect_timeout: float = 3.0,
    ) -> None:
        self._secret = secret
        self._nursery = nursery
        self._per_node = max(1, per_node)
        self._view = view
        self._stats = stats
        self.connect_timeout = connect_timeout
        self._conns: dict[str, list[rpc_client.Connection]] = {}
        self._locks: dict[str, trio.Lock] = {}
        self._rr = itertools.count()

    def _check_backoff(self, address: str) -> None:
        if self._view is not None and self._view.backing_off(address):
            raise Unavailable(f"chunk store {address} was unreachable moments ago (backing off)")

    def _attempt(self, address: str) -> None:
        if self._stats is not None:
            attempts = self._stats.node_attempts
            attempts[address] = attempts.get(address, 0) + 1

    async def get(self, address: str) -> rpc_client.Connection:
        return (await self._get(address))[0]

    async def _get(self, address: str) -> tuple[rpc_client.Connection, bool]:
        """A live connection to ``address``, and whether a connect was attempted for it.
        Raises Unavailable at once while the address is backing off, so the tasks queued
        behind a failed connect do not each try (and time out) again."""
        if not address:
            raise Unavailable("chunk store address unknown (node not registered)")
        conns = self._conns.setdefault(address, [])
        conns[:] = [c for c in conns if c.broken is None]
        if len(conns) >= self._per_node:
            return conns[next(self._rr) % len(conns)], False
        self._check_backoff(address)
        lock = self._locks.setdefault(address, trio.Lock())
        async with lock:
            conns[:] = [c for c in conns if c.broken is None]
            if len(conns) >= self._per_node:
                return conns[-1], False
            self._check_backoff(address)
            self._attempt(address)
            conns.append(await self._connect(address))
            return conns[-1], True

    async def _connect(self, address: str) -> rpc_client.Connection:
        """Connect within ``connect_timeout``: a cut link blackholes SYNs (no RST comes
        back), and the kernel's own retries would take minutes."""
        host, port = sockets.parse_address(address)
        try:
            with trio.move_on_after(self.connect_timeout) as scope:
                return await rpc_client.Connection.connect(
                    host, port, self._secret, nursery=self._nursery
                )
            assert scope.cancelled_caught
            raise Unavailable(f"cannot connect to {address}: no answer in {self.connect_timeout}s")
        except Unavailable:
            if self._view is not None:
                self._view.failed(address)
            raise

    async def call(
        self,
        address: str,
        op: str,
        fields: dict[str, Any],
        payload: Buffer | None = None,
        *,
        into: memoryview | None = None,
    ) -> rpc_client.Response:
        conn, connected = await self._get(address)
        if not connected:
            self._attempt(address)  # a connect already counted as this request's attempt
        try:
            return await conn.call(op, fields, payload, into=into)
        except Unavailable:
            if conn.broken is not None and self._view is not None:
                self._view.failed(address)  # the connection died, not a busy store
            raise

    async def aclose(self) -> None:
        for conns in self._conns.values():
            for c in conns:
                with trio.CancelScope(shield=True):
                    await c.aclose()
        self._conns.clear()


# --- the client --------------------------------------------------------------------------------


class TectonicClient:
    """One per process: metadata client, chunk-store pool, codec threads, window and cache.

    Tuning (keyword arguments of ``open_client``):

    * ``window_bytes``: memory for block buffers across all writers (backpressure bound);
    * ``cache_bytes``: the readers' memory budget: cached blocks and block fetches in
      flight (readahead lands here; a reader with no room reads ranges);
    * ``readahead_blocks``: whole blocks fetched ahead of a sequential reader;
    * ``write_quorum``: chunks that must land for a block to commit (default k + 1);
    * ``hedge``: extra nodes asked for with every block, for re-sending failed chunks;
    * ``write_hedge_s``: a chunk put still running after this is also sent to a spare
      (hedge) node, and the first to accept wins;
    * ``chunk_timeout``: a put still running this long after its last hedge is hedged again
      (while spare nodes are left); it never fails the put;
    * ``slow_chunk_s``: a block's chunks still missing after this get every parity chunk
      left fetched as well, and a range read falls back to a whole-block read; the slow
      requests keep running and never count as failed;
    * ``read_hedge_s``: data chunks of a block still missing after this are hedged with
      parity fetches (first k good chunks win);
    * ``codec_threads``: zfec/CRC worker threads (the cores);
    * ``max_reconstructions``: degraded decodes at once;
    * ``connect_timeout``: a connect to a chunk store not answered in this long fails (a
      cut link drops SYNs silently);
    * ``node_backoff_s``: a chunk store this client failed to reach is avoided this long
      (reads go degraded, puts go to other nodes), so it costs one timeout, not one per
      block; nodes the registry marks down are avoided until it marks them up.
    """

    def __init__(
        self,
        config: ClusterConfig,
        meta: Any,
        nursery: trio.Nursery,
        *,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        readahead_blocks: int = 3,
        write_quorum: int | None = None,
        hedge: int = 2,
        chunk_timeout: float = 30.0,
        write_hedge_s: float = 5.0,
        slow_chunk_s: float = 10.0,
        read_hedge_s: float = 2.0,
        codec_threads: int = 2,
        max_reconstructions: int = 2,
        conns_per_node: int = 1,
        connect_timeout: float = 3.0,
        node_backoff_s: float = 10.0,
    ) -> None:
        if window_bytes < MiB:
            raise InvalidArgument("window_bytes must be at least 1 MiB")
        if not connect_timeout > 0 or not node_backoff_s >= 0:
            raise InvalidArgument(
                f"connect_timeout ({connect_timeout}) must be > 0 and node_backoff_s "
                f"({node_backoff_s}) >= 0"
            )
        self.config = config
        self.meta = meta
        self._nursery = nursery
        self.stats = ClientStats()
        self.node_view = NodeView(meta, nursery, node_backoff_s)
        self.pool = ChunkPool(
            config.secret(),
            nursery,
            conns_per_node,
            view=self.node_view,
            stats=self.stats,
            connect_timeout=connect_timeout,
        )
        self.buffers = BufferPool(window_bytes, self.stats)
        self.buffers.spill = lambda writer: nursery.start_soon(writer.spill_open)
        self.cache = BlockCache(cache_bytes)
        self.codec = Codec(codec_threads)
        self.readahead_blocks = max(0, readahead_blocks)
        self.write_quorum = write_quorum
        self.hedge = max(0, hedge)
        self.chunk_timeout = chunk_timeout
        self.write_hedge_s = write_hedge_s
        self.slow_chunk_s = slow_chunk_s
        self.read_hedge_s = read_hedge_s
        self._reconstruct = trio.CapacityLimiter(max(1, max_reconstructions))
        self._fetching: dict[int, trio.Event] = {}
        self._addresses: dict[str, str] = {}
        self._closed = False

    def statistics(self) -> ClientStats:
        return self.stats

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.pool.aclose()

    # --- path level ------------------------------------------------------------------------

    async def stat(self, path: str) -> Attrs:
        return await self.meta.resolve(_normpath(path))

    async def listdir(self, path: str) -> list[DirEntry]:
        d = await self.stat(path)
        out: list[DirEntry] = []
        after = ""
        while True:
            page, nxt = await self.meta.readdir(d.id, after, 1000)
            out.extend(page)
            if nxt is None or not page:
                return out
            after = nxt

    async def mkdir(self, path: str, mode: int = 0o755, parents: bool = False) -> Attrs:
        path = _normpath(path)
        if not parents:
            parent, name = _split(path)
            d = await self.meta.resolve(parent)
            return await self.meta.mkdir(d.id, name, mode=mode)
        current = await self.meta.getattr(ROOT_ID)
        for name in [p for p in path.split("/") if p]:
            try:
                current = await self.meta.lookup(current.id, name)
            except FileNotFound:
                try:
                    current = await self.meta.mkdir(current.id, name, mode=mode)
                except FileExists:
                    current = await self.meta.lookup(current.id, name)
        return current

    async def unlink(self, path: str) -> None:
        parent, name = _split(_normpath(path))
        d = await self.meta.resolve(parent)
        await self.meta.unlink(d.id, name)

    async def rmdir(self, path: str) -> None:
        parent, name = _split(_normpath(path))
        d = await self.meta.resolve(parent)
        await self.meta.rmdir(d.id, name)

    async def rename(self, src: str, dst: str) -> None:
        sp, sn = _split(_normpath(src))
        dp, dn = _split(_normpath(dst))
        sd = await self.meta.resolve(sp)
        dd = sd if dp == sp else await self.meta.resolve(dp)
        await self.meta.rename(sd.id, sn, dd.id, dn)

    async def create(
        self, path: str, *, mode: int = 0o644, exclusive: bool = False, ec: str | None = None
    ) -> FileWriter:
        parent, name = _split(_normpath(path))
        d = await self.meta.resolve(parent)
        return await self.create_in(d.id, name, mode=mode, exclusive=exclusive, ec=ec)

    async def open_read(self, path: str) -> FileReader:
        attrs = await self.stat(path)
        return await self.open_reader(attrs.id)

    # --- id level ----------------------------------------------------------------------------

    async def create_in(
        self,
        dir_id: int,
        name: str,
        *,
        mode: int = 0o644,
        uid: int = 0,
        gid: int = 0,
        exclusive: bool = False,
        ec: str | None = None,
    ) -> FileWriter:
        if ec is not None:
            ECPolicy.parse(ec)
        attrs, token = await self.meta.create(
            dir_id, name, mode=mode, uid=uid, gid=gid, exclusive=exclusive, ec=ec
        )
        return FileWriter(self, attrs, token, {})

    async def open_writer(self, file_id: int, *, truncate: bool = False) -> FileWriter:
        token = await self.meta.open_for_write(file_id, truncate=truncate)
        attrs = await self.meta.getattr(file_id)
        blocks: dict[int, BlockInfo] = {}
        if not truncate and attrs.size:
            blocks = {b.file_index: b for b in await self.meta.block_list(file_id)}
        return FileWriter(self, attrs, token, blocks)

    async def open_reader(self, file_id: int) -> FileReader:
        attrs = await self.meta.getattr(file_id)
        if attrs.is_dir:
            from tectonic_py.core.errors import IsADirectory

            raise IsADirectory(f"file id {file_id} is a directory")
        blocks = await self.meta.block_list(file_id) if attrs.size else []
        if blocks:
            await self.node_view.refresh()  # rate limited: plan this file's reads around down nodes
        return FileReader(self, attrs, {b.file_index: b for b in blocks})

    # --- write side: one block to chunk stores ----------------------------------------------

    def _quorum(self, policy: ECPolicy) -> int:
        q = self.write_quorum if self.write_quorum is not None else policy.k + 1
        return max(policy.k, min(q, policy.n))

    async def store_block(
        self,
        file_id: int,
        token: int,
        policy: ECPolicy,
        file_index: int,
        block: memoryview,
        data_len: int,
    ) -> BlockInfo:
        """Encode one block held in ``block`` (>= k * chunk_len bytes) and make its chunks
        durable on chunk stores; returns the record to commit. Raises QuorumLost when fewer
        than the write quorum of chunks could be written."""
        k = policy.k
        cl = max(1, chunk_len_for(data_len, k))
        padded = block[: k * cl]
        padded[data_len:] = bytes(k * cl - data_len)
        enc = await self.codec.encode(policy, padded, cl)
        grant = await self.meta.allocate_block(file_id, token, policy.name, hedge=self.hedge)
        self.node_view.refresh_soon()
        placements = await self._put_chunks(grant, policy, enc)
        self.stats.blocks_written += 1
        self.stats.bytes_written += data_len
        return BlockInfo(
            block_id=grant.block_id,
            ec=policy.name,
            chunk_len=cl,
            data_len=data_len,
            chunks=placements,
            file_index=file_index,
        )

    async def _put_chunks(
        self, grant: BlockGrant, policy: ECPolicy, enc: EncodedBlock
    ) -> list[ChunkPlacement]:
        n = policy.n
        spares: deque[tuple[NodeInfo, bytes]] = deque(
            (node, grant.capability) for node in grant.nodes[n:]
        )
        tried: set[str] = {node.node_id for node in grant.nodes}
        results: dict[int, ChunkPlacement] = {}
        more_lock = trio.Lock()
        asked_more = 0

        view = self.node_view

        def pop_live() -> tuple[NodeInfo, bytes] | None:
            """The next spare whose node this client does not know to be down or failing."""
            while spares:
                node, cap = spares.popleft()
                if not view.avoid(node.node_id, node.address):
                    return node, cap
                self.stats.avoided_chunks += 1
            return None

        async def replacement() -> tuple[NodeInfo, bytes] | None:
            nonlocal asked_more
            async with more_lock:
                spare = pop_live()
                if spare is not None:
                    return spare
                if asked_more >= 2:
                    return None
                asked_more += 1
                exclude = sorted(tried | view.down)
                try:
                    more = await self.meta.more_nodes(grant.block_id, exclude, 2)
                except TectonicError as e:
                    log.info("no replacement nodes for block %016x: %s", grant.block_id, e)
                    return None
                for node in more.nodes:
                    if node.node_id not in tried:
                        tried.add(node.node_id)
                        spares.append((node, more.capability))
                return pop_live()

        async def race(i: int, target: tuple[NodeInfo, bytes]) -> NodeInfo | None:
            """Put chunk i on ``target``; if that is still running after ``write_hedge_s``
            and a spare node is left, put it there too: the first to accept wins."""
            cid = chunk_id(grant.block_id, i)
            winner: NodeInfo | None = None
            running = 0
            settled = trio.Event()

            async def run(node: NodeInfo, cap: bytes) -> None:
                nonlocal winner, running
                try:
                    await self._put_chunk(node, cap, cid, enc, i)
                    if winner is None:
                        winner = node
                except TectonicError as e:
                    self.stats.chunk_write_failures += 1
                    log.info(
                        "chunk %d of block %016x on %s failed (%s); re-sending elsewhere",
                        i,
                        grant.block_id,
                        node.node_id,
                        e,
                    )
                finally:
                    running -= 1
                    if winner is not None or running == 0:
                        settled.set()

            async with open_service_nursery() as puts:
                running += 1
                puts.start_soon(run, *target)
                wait = self.write_hedge_s
                while not settled.is_set():
                    with trio.move_on_after(wait):
                        await settled.wait()
                    if settled.is_set():
                        break
                    spare = await replacement()
                    if spare is None:
                        # No node left to hedge to: the running puts are slow, not failed.
                        await settled.wait()
                        break
                    self.stats.hedged_puts += 1
                    running += 1
                    puts.start_soon(run, *spare)
                    wait = self.chunk_timeout
                puts.cancel_scope.cancel()
            return winner

        async def put_one(i: int, target: tuple[NodeInfo, bytes] | None) -> None:
            attempts = 0
            while attempts < 2 * n + 4:
                attempts += 1
                if target is None:
                    target = await replacement()
                    if target is None:
                        return
                    self.stats.chunks_replaced += 1
                node = await race(i, target)
                if node is None:
                    target = None
                    continue
                results[i] = ChunkPlacement(i, node.node_id, enc.checksums[i], node.address)
                self.stats.chunks_written += 1
                return

        async with open_service_nursery() as nursery:
            for i in range(n):
                first = (grant.nodes[i], grant.capability) if i < len(grant.nodes) else None
                if first is not None and view.avoid(first[0].node_id, first[0].address):
                    # Placed before the registry saw it down, or this client just failed to
                    # reach it: start on a spare (the node itself if none is left).
                    self.stats.avoided_chunks += 1
                    first = pop_live() or first
                nursery.start_soon(put_one, i, first)
        quorum = self._quorum(policy)
        if len(results) < quorum:
            raise QuorumLost(
                f"only {len(results)} of {n} chunks of block {grant.block_id:016x} could be "
                f"written; the write quorum is {quorum}"
            )
        if len(results) < n:
            log.warning(
                "block %016x committed with %d of %d chunks (repair will restore the rest)",
                grant.block_id,
                len(results),
                n,
            )
        return [results[i] for i in sorted(results)]

    async def _put_chunk(
        self, node: NodeInfo, cap: bytes, cid: str, enc: EncodedBlock, i: int
    ) -> None:
        """One chunk to one node, retrying only what the server says is retryable. No time
        limit: a slow put is hedged by ``_put_chunks``, never failed (a burst makes every
        store slow, and failing them all would lose the write)."""
        for attempt in range(4):
            try:
                await self.pool.call(
                    node.address,
                    "put",
                    {"chunk_id": cid, "checksum": enc.checksums[i], "cap": cap},
                    enc.chunks[i],
                )
                return
            except TectonicError as e:
                if not e.retryable or isinstance(e, Unavailable) or attempt == 3:
                    raise
            await trio.sleep(0.05 * (attempt + 1))

    # --- read side: blocks and ranges ----------------------------------------------------------

    async def _address(self, pl: ChunkPlacement) -> str:
        if pl.address:
            return pl.address
        if pl.node_id not in self._addresses:
            for node in await self.meta.nodes():
                if node.state == "up":
                    self._addresses[node.node_id] = node.address
        return self._addresses.get(pl.node_id, "")

    def _report_bad(self, info: BlockInfo, pl: ChunkPlacement, error: BaseException) -> None:
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

    async def _get_into(
        self,
        info: BlockInfo,
        pl: ChunkPlacement,
        into: memoryview,
        offset: int = 0,
        *,
        limit: float = math.inf,
        verify: bool = False,
    ) -> None:
        """Fetch ``len(into)`` bytes of a chunk at ``offset`` straight into ``into``, verified:
        a whole chunk against the Block layer's CRC (end to end), a range against the chunk
        store's CRC of that range. ``limit`` is only for callers with a whole-block read to
        fall back on (a range read); whole-block fetches hedge instead of timing out.
        ``verify``: the store checks the bytes before sending them; a whole chunk that came
        unverified (``verified: False``, straight from the store's page cache) and fails is
        fetched once more that way, so that only a damaged copy on disk is ChunkCorrupt."""
        address = await self._address(pl)
        cid = chunk_id(info.block_id, pl.index)
        fields: dict[str, Any] = {"chunk_id": cid, "offset": offset, "length": into.nbytes}
        if verify:
            fields["verify"] = True
        with trio.move_on_after(limit) as scope:
            resp = await self.pool.call(address, "get", fields, into=into)
        if scope.cancelled_caught:
            raise Timeout(f"get of {cid} from {pl.node_id} took over {limit}s")
        payload = resp.payload
        if payload is None or payload.nbytes != into.nbytes:
            got = 0 if payload is None else payload.nbytes
            raise ChunkCorrupt(f"{cid} on {pl.node_id}: {got} bytes where {into.nbytes} expected")
        whole = offset == 0 and into.nbytes == info.chunk_len
        expected = pl.checksum if whole else resp.fields.get("range_checksum")
        if expected is None:
            return
        (crc,) = await self.codec.checksums([into])
        if crc != expected:
            if resp.fields.get("verified") is False and not verify:
                await self._get_into(info, pl, into, offset, limit=limit, verify=True)
                return
            raise ChunkCorrupt(f"{cid} on {pl.node_id} failed its checksum")

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
        size = _block_buffer_size(info)
        self.cache.reserve(size, force=True)
        return await self._fetch_and_cache(info, size)

    async def _fetch_and_cache(self, info: BlockInfo, reserved: int) -> memoryview:
        """Fetch a block whose buffer is already reserved in the cache, and cache it."""
        done = self._fetching.setdefault(info.block_id, trio.Event())
        try:
            data = await self._fetch_block(info)
        except BaseException:
            self.cache.unreserve(reserved)
            raise
        finally:
            if self._fetching.get(info.block_id) is done:
                del self._fetching[info.block_id]
            done.set()
        self.cache.put(info.block_id, data, reserved=reserved)
        return data

    async def read_part(
        self, info: BlockInfo, block_offset: int, length: int, *, view: bool = False
    ) -> bytes | bytearray | memoryview:
        """Block bytes ``[block_offset, block_offset + length)`` for a reader: from the cache
        or a fetch already running; else a whole-block fetch if the read budget has room
        (the reader will want the rest of the block); else only these bytes, straight from
        the chunk stores (a range read), so many readers never hold more than the budget.

        ``view``: the caller consumes the bytes before its next ``await`` (the FUSE layer
        hands them to the kernel at once), so a view of the cached block will do and the
        copy out of it, a sixth of the mount's CPU per byte read, is saved (BlockCache)."""
        end = block_offset + length
        cached = self.cache.get(info.block_id)
        if cached is None and info.block_id in self._fetching:
            await self._fetching[info.block_id].wait()
            cached = self.cache.get(info.block_id)
        if cached is not None:
            self.stats.cache_hits += 1
            return cached[block_offset:end] if view else bytes(cached[block_offset:end])
        size = _block_buffer_size(info)
        if self.cache.reserve(size):
            self.stats.cache_misses += 1
            data = await self._fetch_and_cache(info, size)
            return data[block_offset:end] if view else bytes(data[block_offset:end])
        out = bytearray(length)
        await self.read_range(info, block_offset, memoryview(out))
        return out if view else bytes(out)

    async def _fetch_block(self, info: BlockInfo) -> memoryview:
        """Whole-block fetch: the k data chunks straight into one buffer; a chunk that fails
        starts a parity fetch at once, data chunks still missing after ``read_hedge_s`` are
        hedged with parity fetches too, and after ``slow_chunk_s`` every parity chunk left is
        asked for; the first k good chunks win. Slow requests keep running: the fetch fails
        only when every request has finished and fewer than k chunks came back good."""
        policy = ECPolicy.parse(info.ec)
        k, cl = policy.k, info.chunk_len
        out = memoryview(self.cache.take(k * cl))
        by_index = {pl.index: pl for pl in info.chunks}
        view = self.node_view
        avoided = {
            i
            for i, pl in by_index.items()
            if view.avoid(pl.node_id, pl.address or self._addresses.get(pl.node_id, ""))
        }
        # Parity on live nodes first; chunks on avoided nodes only as a last resort.
        spares = deque(i for i in sorted(by_index) if i >= k and i not in avoided)
        spares.extend(i for i in sorted(avoided) if i >= k)
        spares.extend(i for i in sorted(avoided) if i < k)
        self.stats.avoided_chunks += sum(1 for i in avoided if i < k)
        chunks: dict[int, Buffer] = {}
        results_send, results = trio.open_memory_channel[tuple[int, bool]](policy.n)
        pending = 0
        started: set[int] = set()
        finished: set[int] = set()

        async def fetch(i: int, into: memoryview) -> None:
            pl = by_index[i]
            ok = False
            try:
                await self._get_into(info, pl, into)
                chunks[i] = into
                ok = True
            except TectonicError as e:
                self._report_bad(info, pl, e)
            finished.add(i)
            results_send.send_nowait((i, ok))

        async with open_service_nursery() as nursery:

            def start(i: int) -> None:
                nonlocal pending
                pending += 1
                started.add(i)
                into = out[i * cl : (i + 1) * cl] if i < k else memoryview(bytearray(cl))
                nursery.start_soon(fetch, i, into)

            def start_spare() -> None:
                while spares:
                    i = spares.popleft()
                    if i not in started:
                        start(i)
                        return

            for i in range(k):
                if i in by_index and i not in avoided:
                    start(i)
                else:
                    start_spare()
            hedge_at = trio.current_time() + self.read_hedge_s
            slow_at = trio.current_time() + self.slow_chunk_s
            while len(chunks) < k and pending:
                with trio.move_on_at(min(hedge_at, slow_at)) as scope:
                    _i, ok = await results.receive()
                if scope.cancelled_caught:
                    view.refresh_soon()  # a slow node may be one the registry marks down
                    now = trio.current_time()
                    if now >= hedge_at:
                        hedge_at = math.inf
                        for _ in range(min(pending, k - len(chunks))):
                            start_spare()
                    if now >= slow_at:
                        slow_at = math.inf
                        while spares:
                            start_spare()
                    continue
                pending -= 1
                if not ok:
                    view.refresh_soon()
                    start_spare()
            nursery.cancel_scope.cancel()
        self.stats.blocks_read += 1
        good = {i for i in chunks if i < k}
        if len(good) < k:
            if len(chunks) < k:
                raise QuorumLost(
                    f"block {info.block_id:016x}: only {len(chunks)} of the {k} chunks needed "
                    "could be read"
                )
            self.stats.degraded_reads += 1
            if any(i < k for i in started - finished):
                # A cancelled data-chunk get may still be receiving into ``out``: leave that
                # buffer to the garbage collector rather than cache or recycle it.
                fresh = memoryview(bytearray(k * cl))
                for i in good:
                    fresh[i * cl : (i + 1) * cl] = out[i * cl : (i + 1) * cl]
                    chunks[i] = fresh[i * cl : (i + 1) * cl]
                out = fresh
            async with self._reconstruct:
                await self.codec.decode_into(policy, chunks, cl, out, in_place=good)
        self.stats.bytes_read += info.data_len
        return out[: info.data_len]

    async def read_range(self, info: BlockInfo, block_offset: int, out: memoryview) -> None:
        """Block bytes ``[block_offset, block_offset + len(out))`` (inside data_len) into
        ``out``: the systematic fast path (data-chunk ranges only, no decoding), falling back
        to a whole (degraded) block read if any range fails."""
        cached = self.cache.get(info.block_id)
        if cached is not None:
            self.stats.cache_hits += 1
            out[:] = cached[block_offset : block_offset + out.nbytes]
            return
        policy = ECPolicy.parse(info.ec)
        by_index = {pl.index: pl for pl in info.chunks}
        ranges = chunk_ranges(info.chunk_len, block_offset, out.nbytes, policy.k)
        view = self.node_view
        for r in ranges:
            pl = by_index.get(r.chunk_index)
            if pl is not None and view.avoid(
                pl.node_id, pl.address or self._addresses.get(pl.node_id, "")
            ):
                # A range on a down node: straight to the (degraded) whole-block read.
                data = await self.read_block(info)
                out[:] = data[block_offset : block_offset + out.nbytes]
                return
        failed = False

        async def fetch(r: Any) -> None:
            nonlocal failed
            pl = by_index.get(r.chunk_index)
            if pl is None:
                failed = True
                return
            try:
                await self._get_into(
                    info,
                    pl,
                    out[r.out_offset : r.out_offset + r.length],
                    r.chunk_offset,
                    limit=self.slow_chunk_s,
                )
            except Timeout:
                failed = True  # slow, not bad: read the whole block (hedged), report nothing
            except TectonicError as e:
                self._report_bad(info, pl, e)
                failed = True

        self.stats.range_reads += 1
        async with open_service_nursery() as nursery:
            for r in ranges:
                nursery.start_soon(fetch, r)
        if failed:
            data = await self.read_block(info)
            out[:] = data[block_offset : block_offset + out.nbytes]

    def prefetch(self, infos: Sequence[BlockInfo]) -> None:
        """Start whole-block fetches in the background (readahead); errors surface later in
        the foreground read that needs the block."""
        for info in infos:
            if info.block_id in self.cache or info.block_id in self._fetching:
                continue
            size = _block_buffer_size(info)
            if not self.cache.reserve(size):
                return  # the budget is full of blocks readers are about to consume
            self._fetching[info.block_id] = trio.Event()
            self._nursery.start_soon(self._prefetch_one, info, size)

    async def _prefetch_one(self, info: BlockInfo, reserved: int) -> None:
        try:
            await self._fetch_and_cache(info, reserved)
        except TectonicError as e:
            log.info("readahead of block %016x failed: %s", info.block_id, e)


# --- writers -----------------------------------------------------------------------------------


class FileWriter:
    """An open file being written; holds the writer token. See the module docstring."""

    def __init__(
        self, client: TectonicClient, attrs: Attrs, token: int, blocks: dict[int, BlockInfo]
    ) -> None:
        self.client = client
        self.attrs = attrs
        self.file_id = attrs.id
        self.token = token
        self.policy = ECPolicy.parse(attrs.ec)
        self.layout = Layout(self.policy, attrs.chunk_size)
        self.size = attrs.size
        self._lock = trio.Lock()
        self._committed = blocks
        self._charge = self.layout.block_size * self.policy.n // self.policy.k
        self._open_index: int | None = None
        self._open_buf: bytearray | None = None
        self._open_len = 0
        self._dirty = False
        self._gen = itertools.count(1)
        self._committed_gen: dict[int, int] = {}
        self._commit_locks: dict[int, trio.Lock] = {}
        self._inflight: dict[int, int] = {}
        self._idle = trio.lowlevel.ParkingLot()
        self._synced_size = self.size
        self._error: TectonicError | None = None
        self._aborted = False
        self._closed = False
        self._final: Attrs | None = None
        self._renewed = time.monotonic()
        self.last_write = time.monotonic()
        self.spilling = False

    # --- public ------------------------------------------------------------------------------

    async def write(self, data: Buffer) -> int:
        """Append at the current end of the file: the fast path."""
        async with self._lock:
            return await self._pwrite(data, self.size)

    async def pwrite(self, data: Buffer, offset: int) -> int:
        """Write anywhere: the open block is patched, committed blocks are rewritten
        (read-modify-write at the same index), a write past the end leaves a hole."""
        async with self._lock:
            return await self._pwrite(data, offset)

    async def pread(self, offset: int, length: int) -> bytes:
        """Read back what this writer wrote: buffered bytes and committed blocks."""
        async with self._lock:
            return await self._pread(offset, length)

    async def truncate(self, size: int) -> None:
        """Shrink (later bytes are dropped) or grow sparse (the new bytes read as zeros)."""
        async with self._lock:
            await self._truncate(size)

    async def fsync(self) -> None:
        """Return when every byte written so far is durable and committed."""
        async with self._lock:
            await self._fsync()

    async def close(self) -> Attrs:
        """fsync, then seal the file and release the writer token. Idempotent."""
        async with self._lock:
            return await self._close()

    async def abort(self) -> None:
        """Drop buffered bytes; the file keeps its last committed state."""
        self._aborted = True
        self._closed = True
        async with self._lock:
            self._release_open()

    # --- internals ---------------------------------------------------------------------------

    async def spill_open(self) -> None:
        """Flush the open block of an idle writer to give its buffer back (BufferPool)."""
        try:
            async with self._lock:
                if self._open_buf is not None and not self._closed:
                    await self._flush_open()
        finally:
            self.spilling = False

    async def _pwrite(self, data: Buffer, offset: int) -> int:
        self._check()
        self.last_write = time.monotonic()
        if offset < 0:
            raise InvalidArgument(f"negative write offset {offset}")
        view = memoryview(data).cast("B")
        if not view.nbytes:
            return 0
        layout = self.layout
        for piece in layout.pieces(offset, view.nbytes):
            if piece.block_index != self._open_index:
                await self._switch_open(piece.block_index)
            buf = self._open_buf
            assert buf is not None
            bo, n = piece.block_offset, piece.length
            if bo > self._open_len:
                buf[self._open_len : bo] = bytes(bo - self._open_len)
            buf[bo : bo + n] = view[piece.out_offset : piece.out_offset + n]
            self._open_len = max(self._open_len, bo + n)
            self._dirty = True
            self.size = max(self.size, layout.block_start(piece.block_index) + bo + n)
            if bo + n == layout.block_size:
                await self._flush_open()
            self._check()
        return view.nbytes

    async def _pread(self, offset: int, length: int) -> bytes:
        self._check()
        if offset < 0 or length < 0:
            raise InvalidArgument(f"bad read range {offset}+{length}")
        length = max(0, min(length, self.size - offset))
        out = bytearray(length)
        view = memoryview(out)
        for piece in self.layout.pieces(offset, length):
            dst = view[piece.out_offset : piece.out_offset + piece.length]
            if piece.block_index == self._open_index:
                assert self._open_buf is not None
                avail = max(0, min(piece.length, self._open_len - piece.block_offset))
                dst[:avail] = memoryview(self._open_buf)[
                    piece.block_offset : piece.block_offset + avail
                ]
                continue
            await self._wait_index(piece.block_index)
            self._check()
            info = self._committed.get(piece.block_index)
            if info is None:
                continue
            avail = max(0, min(piece.length, info.data_len - piece.block_offset))
            if avail:
                data = await self.client.read_block(info)
                dst[:avail] = data[piece.block_offset : piece.block_offset + avail]
        return bytes(out)

    async def _truncate(self, size: int) -> None:
        self._check()
        if size < 0:
            raise InvalidArgument(f"negative size {size}")
        await self._flush_open()
        await self._drain()
        self._check()
        layout = self.layout
        await self._meta_call(self.client.meta.set_size(self.file_id, self.token, size))
        if size < self.size:
            for index in [i for i in self._committed if layout.block_start(i) >= size]:
                del self._committed[index]
            self.size = size
            bi = layout.block_of(size)
            info = self._committed.get(bi)
            if info is not None and layout.block_start(bi) + info.data_len > size:
                # Cut the block that straddles the new end, so that growing the file later
                # shows zeros there rather than the old bytes.
                await self._switch_open(bi)
                self._dirty = True
        self.size = size
        self._synced_size = size

    async def _fsync(self) -> None:
        self._check()
        if self._dirty and self._open_buf is not None and self._open_index is not None:
            index, n = self._open_index, self._open_len
            gen = next(self._gen)
            self._begin(index)
            try:
                info = await self.client.store_block(
                    self.file_id, self.token, self.policy, index, memoryview(self._open_buf), n
                )
                await self._commit(index, gen, info)
            except TectonicError as e:
                self._fail(e)
            finally:
                self._end(index)
            self._dirty = False
        await self._drain()
        self._check()
        if self.size != self._synced_size:
            await self._meta_call(self.client.meta.set_size(self.file_id, self.token, self.size))
            self._synced_size = self.size

    async def _close(self) -> Attrs:
        if self._final is not None:
            return self._final
        try:
            await self._fsync()
            self._final = await self._meta_call(
                self.client.meta.seal(self.file_id, self.token, self.size)
            )
            self.attrs = self._final
            return self._final
        finally:
            self._release_open()
            self._closed = True

    def _check(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise InvalidArgument(f"file {self.file_id} is closed for writing")

    def _fail(self, error: TectonicError) -> None:
        if self._error is None:
            self._error = error
            log.info("writer of file %d failed: %s", self.file_id, error)

    async def _meta_call(self, coro: Any) -> Any:
        try:
            return await coro
        except TectonicError as e:
            self._fail(e)
            raise

    def _release_open(self) -> None:
        self.client.buffers.holders.discard(self)
        if self._open_buf is not None:
            self.client.buffers.release(self._open_buf, self._charge)
        self._open_buf = None
        self._open_index = None
        self._open_len = 0
        self._dirty = False

    async def _switch_open(self, index: int) -> None:
        """Make block ``index`` the open block, loading what it already holds."""
        await self._flush_open()
        buf = await self.client.buffers.acquire(self.layout.block_size, self._charge)
        self._open_buf, self._open_index, self._open_len, self._dirty = buf, index, 0, False
        self.client.buffers.holders.add(self)
        valid = self.layout.block_data_len(index, self.size)
        if valid <= 0:
            return
        await self._wait_index(index)
        self._check()
        info = self._committed.get(index)
        have = 0
        if info is not None:
            have = min(info.data_len, valid)
            data = await self.client.read_block(info)
            buf[:have] = data[:have]
        buf[have:valid] = bytes(valid - have)
        self._open_len = valid

    async def _flush_open(self) -> None:
        """Hand the open block to a background flush task (or drop it if clean)."""
        buf, index, n, dirty = self._open_buf, self._open_index, self._open_len, self._dirty
        self._open_buf, self._open_index, self._open_len, self._dirty = None, None, 0, False
        self.client.buffers.holders.discard(self)
        if buf is None:
            return
        if not dirty or n == 0 or index is None:
            self.client.buffers.release(buf, self._charge)
            return
        gen = next(self._gen)
        self._begin(index)
        self.client._nursery.start_soon(self._flush_task, index, buf, n, gen)
        now = time.monotonic()
        if now - self._renewed > LEASE_RENEW_S:
            self._renewed = now
            self.client._nursery.start_soon(self._renew_lease)

    async def _renew_lease(self) -> None:
        """Keep the writer token's lease alive during a long write (GC recovers files whose
        writer's lease ran out); a stolen token shows up here as StaleWriterToken."""
        try:
            await self.client.meta.renew_lease(self.file_id, self.token)
        except TectonicError as e:
            self._fail(e)

    async def _flush_task(self, index: int, buf: bytearray, n: int, gen: int) -> None:
        try:
            info = await self.client.store_block(
                self.file_id, self.token, self.policy, index, memoryview(buf), n
            )
            await self._commit(index, gen, info)
        except TectonicError as e:
            self._fail(e)
        except Exception as e:  # a bug: keep the client alive, fail this writer loudly
            log.exception("flush of block %d of file %d failed", index, self.file_id)
            self._fail(TectonicError(f"internal error flushing block {index}: {e!r}"))
        finally:
            self.client.buffers.release(buf, self._charge)
            self._end(index)

    async def _commit(self, index: int, gen: int, info: BlockInfo) -> None:
        lock = self._commit_locks.setdefault(index, trio.Lock())
        async with lock:
            if self._aborted or self._error is not None:
                return
            if gen < self._committed_gen.get(index, 0):
                return  # a newer version of this block is already committed
            await self.client.meta.commit_blocks(self.file_id, self.token, [info])
            self._committed_gen[index] = gen
            old = self._committed.get(index)
            if old is not None:
                self.client.cache.discard(old.block_id)
            self._committed[index] = info

    def _begin(self, index: int) -> None:
        self._inflight[index] = self._inflight.get(index, 0) + 1

    def _end(self, index: int) -> None:
        left = self._inflight[index] - 1
        if left:
            self._inflight[index] = left
        else:
            del self._inflight[index]
        self._idle.unpark_all()

    async def _wait_index(self, index: int) -> None:
        while index in self._inflight:
            await self._idle.park()

    async def _drain(self) -> None:
        while self._inflight:
            await self._idle.park()


# --- readers -----------------------------------------------------------------------------------


class FileReader:
    """An open file being read: its block list fetched once, readahead for sequential reads.

    Sequential detection keeps a few *streams* (the ends of recent runs of reads): a read
    that starts within one block of a stream's end continues it. One "last end" was not
    enough: torch.load reads the zip's tail, then jumps back, and the kernel's readahead sends
    FUSE reads slightly out of order, and each such read dropped the reader out of
    sequential mode into a round trip per 128 KiB.
    """

    STREAMS = 4

    def __init__(self, client: TectonicClient, attrs: Attrs, blocks: dict[int, BlockInfo]) -> None:
        self.client = client
        self.attrs = attrs
        self.file_id = attrs.id
        self.size = attrs.size
        self.layout = Layout(ECPolicy.parse(attrs.ec), attrs.chunk_size)
        self._blocks = blocks
        self._pos = 0
        # Ends of recent sequential runs, most recent last; a file is usually read from 0.
        self._streams: list[int] = [0]

    def _sequential(self, offset: int, length: int) -> bool:
        """Whether this read continues a recent run (and record it as that run's end)."""
        slack = self.layout.block_size
        for i, end in enumerate(self._streams):
            if end - slack <= offset <= end + slack:
                del self._streams[i]
                self._streams.append(max(end, offset + length))
                return True
        self._streams.append(offset + length)
        del self._streams[: -self.STREAMS]
        return False

    async def pread(self, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)``, short at EOF, zeros in holes."""
        data = await self._pread(offset, length, view=False)
        assert isinstance(data, bytes)
        return data

    async def pread_view(self, offset: int, length: int) -> bytes | bytearray | memoryview:
        """``pread`` for a caller that uses the bytes before its next ``await`` and never
        keeps them (the FUSE layer): they may be a view of a cached block, saving a copy
        (``TectonicClient.read_part``)."""
        return await self._pread(offset, length, view=True)

    async def _pread(
        self, offset: int, length: int, *, view: bool
    ) -> bytes | bytearray | memoryview:
        if offset < 0 or length < 0:
            raise InvalidArgument(f"bad read range {offset}+{length}")
        length = max(0, min(length, self.size - offset))
        sequential = self._sequential(offset, length)
        pieces = self.layout.pieces(offset, length)
        if len(pieces) == 1 and (sequential or length >= self.layout.block_size // 2):
            # The common sequential case: one copy from the cached block (none for a view).
            piece = pieces[0]
            info = self._blocks.get(piece.block_index)
            if info is not None and piece.block_offset + piece.length <= info.data_len:
                self._readahead(sequential, offset, length)
                data = await self.client.read_part(
                    info, piece.block_offset, piece.length, view=view
                )
                if piece.block_offset + piece.length == info.data_len:
                    self.client.cache.done(info.block_id)
                return data
        out = bytearray(length)
        await self._fill(offset, memoryview(out), sequential)
        return out if view else bytes(out)

    async def pread_into(self, offset: int, dest: memoryview) -> int:
        """Read ``[offset, offset + len(dest))`` into ``dest``; the count, short at EOF.

        Why: a caller with its own buffer (``BufferedReader.readinto`` under torch.load
        through ``tectonic_py.connect``) gets the bytes in one copy from the cached blocks,
        where ``pread`` made three (into a block-spanning buffer, into bytes, into ``dest``).
        """
        if offset < 0:
            raise InvalidArgument(f"bad read offset {offset}")
        dest = memoryview(dest).cast("B")
        length = max(0, min(dest.nbytes, self.size - offset))
        dest = dest[:length]
        await self._fill(offset, dest, self._sequential(offset, length))
        return length

    async def _fill(self, offset: int, dest: memoryview, sequential: bool) -> None:
        """``dest`` gets the file's bytes from ``offset`` (zeros in holes), which lie inside
        the file; whole blocks for a sequential or large read, else ranges."""
        length = dest.nbytes
        bs = self.layout.block_size
        for piece in self.layout.pieces(offset, length):
            dst = dest[piece.out_offset : piece.out_offset + piece.length]
            info = self._blocks.get(piece.block_index)
            avail = 0
            if info is not None:
                avail = max(0, min(piece.length, info.data_len - piece.block_offset))
            if avail < piece.length:
                dst[avail:] = bytes(piece.length - avail)  # a hole, or past a short block
            if not avail:
                continue
            assert info is not None
            if sequential or avail >= bs // 2:
                dst[:avail] = await self.client.read_part(
                    info, piece.block_offset, avail, view=True
                )
                if piece.block_offset + avail == info.data_len:
                    self.client.cache.done(info.block_id)
            else:
                await self.client.read_range(info, piece.block_offset, dst[:avail])
        self._readahead(sequential, offset, length)

    def _readahead(self, sequential: bool, offset: int, length: int) -> None:
        if sequential and length and self.client.readahead_blocks:
            last = self.layout.block_of(offset + length - 1)
            ahead = [
                self._blocks[i]
                for i in range(last + 1, last + 1 + self.client.readahead_blocks)
                if i in self._blocks
            ]
            self.client.prefetch(ahead)

    async def read(self, n: int = -1) -> bytes:
        """Sequential read from the current position, with readahead."""
        if n < 0:
            n = max(0, self.size - self._pos)
        data = await self.pread(self._pos, n)
        self._pos += len(data)
        return data

    def seek(self, pos: int) -> None:
        if pos < 0:
            raise InvalidArgument(f"negative position {pos}")
        self._pos = pos

    def tell(self) -> int:
        return self._pos

    async def aclose(self) -> None:
        self._blocks = {}


# --- helpers -----------------------------------------------------------------------------------


def _normpath(path: str) -> str:
    if not isinstance(path, str) or not path.startswith("/"):
        raise InvalidName(f"path {path!r} must be absolute (start with '/')")
    parts = [p for p in path.split("/") if p and p != "."]
    if ".." in parts:
        raise InvalidName(f"path {path!r} may not contain '..'")
    return "/" + "/".join(parts)


def _split(path: str) -> tuple[str, str]:
    if path == "/":
        raise InvalidName("the root directory has no name")
    parent, _, name = path.rpartition("/")
    return parent or "/", name


@asynccontextmanager
async def open_client(
    cluster: ClusterConfig | str | os.PathLike[str], **tuning: Any
) -> AsyncIterator[TectonicClient]:
    """Connect to a cluster (a ``ClusterConfig`` or the path of its cluster file)."""
    from metadata.client import MetadataClient

    config = cluster if isinstance(cluster, ClusterConfig) else cluster_file.load(cluster)
    async with open_service_nursery() as nursery:
        meta = MetadataClient(config, nursery=nursery)
        client = TectonicClient(config, meta, nursery, **tuning)
        try:
            yield client
        finally:
            with trio.CancelScope(shield=True):
                await client.aclose()
                await meta.aclose()
            nursery.cancel_scope.cancel()
