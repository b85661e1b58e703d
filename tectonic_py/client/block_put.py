"""The put engine: the n chunks of one encoded block onto chunk stores, hedged.

All n chunks go out at once over the pooled connections. A chunk store that fails gets its
chunk re-sent to a hedge node of the grant (then to nodes asked for with ``more_nodes``); a
put still running after ``write_hedge_s`` is also sent to a spare node, and the first to
accept wins. A slow put is never failed: a burst makes every store slow, and failing them
all would lose a write whose chunks are all landing. Nodes the client knows to be down or
backing off (``NodeView``) are skipped from the start.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import trio

from chunkstore.client import ChunkPool
from tectonic_py.client.codec import EncodedBlock
from tectonic_py.client.node_view import NodeView
from tectonic_py.client.stats import ClientStats
from tectonic_py.core.aio import open_service_nursery
from tectonic_py.core.errors import TectonicError, Unavailable
from tectonic_py.core.ids import chunk_id
from tectonic_py.core.records import BlockGrant, ChunkPlacement, NodeInfo
from tectonic_py.core.retry import RetryPolicy, retry

log = logging.getLogger(__name__)

Target = tuple[NodeInfo, bytes]  # a node and the capability to write there

# What the store says is retryable (Busy) is asked again a few times on the same node; an
# unreachable node is not: the chunk goes to another node instead.
PUT_RETRY = RetryPolicy(attempts=4, first_delay=0.05, max_delay=0.2)
MORE_NODES_ASKS = 2  # ``more_nodes`` calls per block once the grant's spares are used up


def _same_node_helps(e: TectonicError) -> bool:
    return not isinstance(e, Unavailable)


class BlockPut:
    """One block's chunk puts; ``run`` returns the placements of the chunks that landed."""

    def __init__(
        self,
        meta: Any,
        pool: ChunkPool,
        view: NodeView,
        stats: ClientStats,
        grant: BlockGrant,
        n: int,
        enc: EncodedBlock,
        *,
        write_hedge_s: float,
        chunk_timeout: float,
    ) -> None:
        self.meta = meta
        self.pool = pool
        self.view = view
        self.stats = stats
        self.grant = grant
        self.n = n
        self.enc = enc
        self.write_hedge_s = write_hedge_s
        self.chunk_timeout = chunk_timeout
        self.results: dict[int, ChunkPlacement] = {}
        self._spares: deque[Target] = deque((node, grant.capability) for node in grant.nodes[n:])
        self._tried: set[str] = {node.node_id for node in grant.nodes}
        self._more_lock = trio.Lock()
        self._asked_more = 0

    async def run(self) -> dict[int, ChunkPlacement]:
        async with open_service_nursery() as nursery:
            for i in range(self.n):
                nursery.start_soon(self._put_one, i, self._first_target(i))
        return self.results

    def _first_target(self, i: int) -> Target | None:
        nodes = self.grant.nodes
        first = (nodes[i], self.grant.capability) if i < len(nodes) else None
        if first is not None and self.view.avoid(first[0].node_id, first[0].address):
            # Placed before the registry saw it down, or this client just failed to reach
            # it: start on a spare (the node itself if none is left).
            self.stats.avoided_chunks += 1
            first = self._pop_live() or first
        return first

    def _pop_live(self) -> Target | None:
        """The next spare whose node this client does not know to be down or failing."""
        while self._spares:
            node, cap = self._spares.popleft()
            if not self.view.avoid(node.node_id, node.address):
                return node, cap
            self.stats.avoided_chunks += 1
        return None

    async def _replacement(self) -> Target | None:
        """A spare node for a chunk, asking the metadata service for more when the grant's
        are used up (a few times per block at most)."""
        async with self._more_lock:
            spare = self._pop_live()
            if spare is not None or self._asked_more >= MORE_NODES_ASKS:
                return spare
            self._asked_more += 1
            exclude = sorted(self._tried | self.view.down)
            try:
                more = await self.meta.more_nodes(self.grant.block_id, exclude, 2)
            except TectonicError as e:
                log.info("no replacement nodes for block %016x: %s", self.grant.block_id, e)
                return None
            for node in more.nodes:
                if node.node_id not in self._tried:
                    self._tried.add(node.node_id)
                    self._spares.append((node, more.capability))
            return self._pop_live()

    async def _put_one(self, i: int, target: Target | None) -> None:
        """Chunk i onto some node: failover to replacements (not a retry of one request: each
        try goes elsewhere), bounded so a cluster refusing everything cannot loop forever."""
        for _ in range(2 * self.n + 4):
            if target is None:
                target = await self._replacement()
                if target is None:
                    return
                self.stats.chunks_replaced += 1
            node = await self._race(i, target)
            if node is None:
                target = None
                continue
            self.results[i] = ChunkPlacement(i, node.node_id, self.enc.checksums[i], node.address)
            self.stats.chunks_written += 1
            return

    async def _race(self, i: int, target: Target) -> NodeInfo | None:
        """Put chunk i on ``target``; if that is still running after ``write_hedge_s`` and a
        spare node is left, put it there too (again every ``chunk_timeout``): the first to
        accept wins. None when every put failed."""
        cid = chunk_id(self.grant.block_id, i)
        winner: NodeInfo | None = None
        running = 0
        settled = trio.Event()

        async def run(node: NodeInfo, cap: bytes) -> None:
            nonlocal winner, running
            try:
                await self._put_chunk(node, cap, cid, i)
                if winner is None:
                    winner = node
            except TectonicError as e:
                self.stats.chunk_write_failures += 1
                log.info(
                    "chunk %d of block %016x on %s failed (%s); re-sending elsewhere",
                    i,
                    self.grant.block_id,
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
                spare = await self._replacement()
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

    async def _put_chunk(self, node: NodeInfo, cap: bytes, cid: str, i: int) -> None:
        """One chunk to one node. No time limit: a slow put is hedged by ``_race``."""
        enc = self.enc

        async def once() -> None:
            client = await self.pool.client(node.address)
            await client.put(cid, enc.chunks[i], cap, enc.checksums[i])

        await retry(once, policy=PUT_RETRY, when=_same_node_helps)
