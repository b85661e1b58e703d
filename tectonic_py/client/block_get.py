"""The get engine: one whole block from its chunks, hedged, degraded when it must be.

The k data chunks are received straight into one buffer (the code is systematic, so no
decoding when they all come back good). A chunk that fails starts a parity fetch at once;
data chunks still missing after ``read_hedge_s`` are hedged with parity fetches too, and
after ``slow_chunk_s`` every parity chunk left is asked for; the first k good chunks win and
zfec rebuilds what is missing (at most ``max_reconstructions`` decodes at once per client,
so an overload cannot become a reconstruction storm). Slow requests keep running: the fetch
fails only when every request has finished and fewer than k chunks came back good. Chunks on
nodes the client knows to be down or backing off are asked for last.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Protocol

import trio

from tectonic_py.client.buffers import BlockCache
from tectonic_py.client.codec import Codec
from tectonic_py.client.node_view import NodeView
from tectonic_py.client.stats import ClientStats
from tectonic_py.core.aio import open_service_nursery
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import QuorumLost, TectonicError
from tectonic_py.core.records import BlockInfo, ChunkPlacement

Buffer = bytes | bytearray | memoryview


class ChunkSource(Protocol):
    """What a fetch needs of the client's block I/O (``BlockIO``): one verified chunk get,
    the bad-chunk report, where the chunks' nodes are and which to avoid, the buffer it
    fills, the decode limiter and codec, the hedge delays and the counters."""

    cache: BlockCache
    node_view: NodeView
    codec: Codec
    stats: ClientStats
    reconstruct: trio.CapacityLimiter
    read_hedge_s: float
    slow_chunk_s: float

    def address_of(self, pl: ChunkPlacement) -> str: ...

    async def get_into(
        self,
        info: BlockInfo,
        pl: ChunkPlacement,
        into: memoryview,
        offset: int = 0,
        *,
        limit: float = math.inf,
    ) -> None: ...

    def report_bad(self, info: BlockInfo, pl: ChunkPlacement, error: BaseException) -> None: ...


class BlockFetch:
    """One whole-block fetch; ``run`` returns the block's ``data_len`` bytes."""

    def __init__(self, io: ChunkSource, info: BlockInfo) -> None:
        self.io = io
        self.info = info
        self.policy = ECPolicy.parse(info.ec)
        self.k, self.cl = self.policy.k, info.chunk_len
        self.out = memoryview(io.cache.take(self.k * self.cl))
        self.by_index = {pl.index: pl for pl in info.chunks}
        self.chunks: dict[int, Buffer] = {}
        self.started: set[int] = set()
        self.finished: set[int] = set()
        self.pending = 0
        self._results_send, self._results = trio.open_memory_channel[bool](self.policy.n)
        self.avoided, self.spares = self._plan()

    def _plan(self) -> tuple[set[int], deque[int]]:
        """Chunks on avoided nodes, and the order spares are asked for: parity on live
        nodes first, chunks on avoided nodes only as a last resort."""
        view, k = self.io.node_view, self.k
        avoided = {
            i for i, pl in self.by_index.items() if view.avoid(pl.node_id, self.io.address_of(pl))
        }
        spares = deque(i for i in sorted(self.by_index) if i >= k and i not in avoided)
        spares.extend(i for i in sorted(avoided) if i >= k)
        spares.extend(i for i in sorted(avoided) if i < k)
        self.io.stats.avoided_chunks += sum(1 for i in avoided if i < k)
        return avoided, spares

    async def run(self) -> memoryview:
        async with open_service_nursery() as nursery:
            self._nursery = nursery
            for i in range(self.k):
                if i in self.by_index and i not in self.avoided:
                    self._start(i)
                else:
                    self._start_spare()
            await self._collect()
            nursery.cancel_scope.cancel()
        self.io.stats.blocks_read += 1
        out = await self._assemble()
        self.io.stats.bytes_read += self.info.data_len
        return out[: self.info.data_len]

    def _start(self, i: int) -> None:
        self.pending += 1
        self.started.add(i)
        cl = self.cl
        into = self.out[i * cl : (i + 1) * cl] if i < self.k else memoryview(bytearray(cl))
        self._nursery.start_soon(self._fetch, i, into)

    def _start_spare(self) -> None:
        while self.spares:
            i = self.spares.popleft()
            if i not in self.started:
                self._start(i)
                return

    async def _fetch(self, i: int, into: memoryview) -> None:
        pl = self.by_index[i]
        ok = False
        try:
            await self.io.get_into(self.info, pl, into)
            self.chunks[i] = into
            ok = True
        except TectonicError as e:
            self.io.report_bad(self.info, pl, e)
        self.finished.add(i)
        self._results_send.send_nowait(ok)

    async def _collect(self) -> None:
        """Wait until k chunks are good or nothing is pending, hedging on the way."""
        view = self.io.node_view
        hedge_at = trio.current_time() + self.io.read_hedge_s
        slow_at = trio.current_time() + self.io.slow_chunk_s
        while len(self.chunks) < self.k and self.pending:
            with trio.move_on_at(min(hedge_at, slow_at)) as scope:
                ok = await self._results.receive()
            if scope.cancelled_caught:
                view.refresh_soon()  # a slow node may be one the registry marks down
                now = trio.current_time()
                if now >= hedge_at:
                    hedge_at = math.inf
                    for _ in range(min(self.pending, self.k - len(self.chunks))):
                        self.io.stats.hedged_gets += 1 if self.spares else 0
                        self._start_spare()
                if now >= slow_at:
                    slow_at = math.inf
                    while self.spares:
                        self._start_spare()
                continue
            self.pending -= 1
            if not ok:
                view.refresh_soon()
                self._start_spare()

    async def _assemble(self) -> memoryview:
        """The k data chunks in one buffer, decoding the missing ones from parity."""
        k, cl, out = self.k, self.cl, self.out
        good = {i for i in self.chunks if i < k}
        if len(good) == k:
            return out
        if len(self.chunks) < k:
            raise QuorumLost(
                f"block {self.info.block_id:016x}: only {len(self.chunks)} of the {k} chunks"
                " needed could be read"
            )
        self.io.stats.degraded_reads += 1
        if any(i < k for i in self.started - self.finished):
            # A cancelled data-chunk get may still be receiving into ``out``: leave that
            # buffer to the garbage collector rather than cache or recycle it.
            fresh = memoryview(bytearray(k * cl))
            for i in good:
                fresh[i * cl : (i + 1) * cl] = out[i * cl : (i + 1) * cl]
                self.chunks[i] = fresh[i * cl : (i + 1) * cl]
            out = fresh
        async with self.io.reconstruct:
            await self.io.codec.decode_into(self.policy, self.chunks, cl, out, in_place=good)
        return out
