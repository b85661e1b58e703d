"""The put engine: the n chunks of one encoded block onto chunk stores, hedged.

All n chunks go out at once over the pooled connections. A chunk store that fails gets its
chunk re-sent to a hedge node of the grant (then to nodes asked for with ``more_nodes``); a
put still running after ``write_hedge_s`` is also sent to a spare node, and the first to
accept wins. Nodes the client knows to be down or backing off (``NodeView``) are skipped
from the start.

A slow put is not failed while the block still needs it: a burst makes every store slow,
and failing them all would lose a write whose chunks are all landing. But once the write
quorum of the block has landed, a chunk still unplaced is a straggler, and a store that
stopped (SIGSTOP, a hung disk) keeps its connections open and never answers: waiting for it
would hold the block, and the file's close, for as long as it stays stopped. So a straggler
is given up at ``start + 2 * write_hedge_s + 2 * (time the quorum took)``, that is a bound
of twice the hedge delay plus the write itself, stretched under a burst as the write slows,
if its store has answered nothing at all (on any connection) for ``write_hedge_s``: it has
stopped. Its connections are dropped, failing the other requests stuck on them at once and
leaving nowhere for a late reply to land, and the client backs off from it. A store that
still answers other requests is slow, not stopped (a burst queues every store): it gets
``chunk_timeout`` more before the chunk is given up, and keeps its connections. Either way
the block commits with the chunks that landed (``stalled_puts``) and repair restores the
rest.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import trio

from chunkstore.client import ChunkPool
from tectonic_py.client.codec import EncodedBlock
from tectonic_py.client.node_view import NodeView
from tectonic_py.client.stats import ClientStats
from tectonic_py.core.aio import open_service_nursery
from tectonic_py.core.errors import DiskFull, TectonicError, Unavailable
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
        quorum: int,
        indexes: Sequence[int] | None = None,
    ) -> None:
        """``indexes``: the chunks to put (all n by default; a new version of a block puts
        only those it rewrote, the others are the old version's)."""
        self.meta = meta
        self.pool = pool
        self.view = view
        self.stats = stats
        self.grant = grant
        self.n = n
        self.indexes = list(range(n)) if indexes is None else list(indexes)
        self.enc = enc
        self.write_hedge_s = write_hedge_s
        self.chunk_timeout = chunk_timeout
        self.results: dict[int, ChunkPlacement] = {}
        # Chunk puts refused, and how many of them by a full store (counts: an exception
        # kept would keep its frames, and the chunk buffers they hold, alive).
        self.refused = 0
        self.refused_full = 0
        self._spares: deque[Target] = deque((node, grant.capability) for node in grant.nodes[n:])
        self._tried: set[str] = {node.node_id for node in grant.nodes}
        self._more_lock = trio.Lock()
        self._asked_more = 0
        self.quorum = quorum
        self._start = math.inf
        self._quorum_at: float | None = None
        self._wakes: set[trio.Event] = set()  # races to wake when the quorum has landed
        self._given_up: set[int] = set()  # indexes of straggler chunks (left for repair)

    async def run(self) -> dict[int, ChunkPlacement]:
        self._start = trio.current_time()
        async with open_service_nursery() as nursery:
            for i in self.indexes:
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
            if i in self._given_up:
                return
            if node is None:
                target = None
                continue
            self.results[i] = ChunkPlacement(i, node.node_id, self.enc.checksums[i], node.address)
            self.stats.chunks_written += 1
            if self._quorum_at is None and len(self.results) >= self.quorum:
                self._quorum_at = trio.current_time()
                for wake in self._wakes:
                    wake.set()
            return

    def _give_up_at(self, race_start: float) -> float:
        """When a put still running is a straggler to give up on (the module docstring):
        never before the quorum has landed, nor before the put had ``write_hedge_s``."""
        if self._quorum_at is None:
            return math.inf
        took = self._quorum_at - self._start
        return max(self._start + 2 * (self.write_hedge_s + took), race_start + self.write_hedge_s)

    async def _race(self, i: int, target: Target) -> NodeInfo | None:
        """Put chunk i on ``target``; if that is still running after ``write_hedge_s`` and a
        spare node is left, put it there too (again every ``chunk_timeout``): the first to
        accept wins. None when every put failed, or was given up as a straggler."""
        cid = chunk_id(self.grant.block_id, i)
        winner: NodeInfo | None = None
        running: list[NodeInfo] = []
        wake = trio.Event()

        async def run(node: NodeInfo, cap: bytes) -> None:
            nonlocal winner
            try:
                await self._put_chunk(node, cap, cid, i)
                if winner is None:
                    winner = node
            except TectonicError as e:
                self.stats.chunk_write_failures += 1
                self.refused += 1
                self.refused_full += isinstance(e, DiskFull)
                log.info(
                    "chunk %d of block %016x on %s failed (%s); re-sending elsewhere",
                    i,
                    self.grant.block_id,
                    node.node_id,
                    e,
                )
            finally:
                running.remove(node)
                wake.set()

        started = trio.current_time()
        hedge_at = started + self.write_hedge_s
        patience = -math.inf  # a look again at slow stores that still answer
        async with open_service_nursery() as puts:
            running.append(target[0])
            puts.start_soon(run, *target)
            while winner is None and running:
                wake = trio.Event()
                self._wakes.add(wake)
                give_up_at = max(self._give_up_at(started), patience)
                with trio.move_on_at(min(hedge_at, give_up_at)):
                    await wake.wait()
                self._wakes.discard(wake)
                if winner is not None or not running:
                    break
                now = trio.current_time()
                if now >= give_up_at:
                    last = self._give_up_at(started) + self.chunk_timeout
                    if self._all_silent(running) or now >= last:
                        self._give_up(i, running, now - started)
                        break
                    patience = now + self.write_hedge_s
                if now >= hedge_at:
                    spare = await self._replacement()
                    if spare is None:
                        # Nowhere to hedge to: the running puts are slow, not failed, until
                        # the block's quorum has landed without them.
                        hedge_at = math.inf
                        continue
                    self.stats.hedged_puts += 1
                    running.append(spare[0])
                    puts.start_soon(run, *spare)
                    hedge_at = now + self.chunk_timeout
            puts.cancel_scope.cancel()
        return winner

    def _all_silent(self, running: list[NodeInfo]) -> bool:
        """Whether every store with a put of this chunk running has answered nothing, on any
        connection, for ``write_hedge_s``: stopped, not merely slow."""
        return all(self.pool.silent_for(n.address) >= self.write_hedge_s for n in running)

    def _give_up(self, i: int, running: list[NodeInfo], took: float) -> None:
        """Chunk i's puts are stragglers. A store that has answered nothing on any connection
        for ``write_hedge_s`` has stopped: its connections are dropped and the client backs
        off from it. One that still answers other requests is only slow (a burst, a hung
        disk behind a live server): it keeps them, since dropping would fail every request
        in flight there."""
        self.stats.stalled_puts += 1
        self._given_up.add(i)
        for node in running:
            silent = self.pool.silent_for(node.address)
            log.warning(
                "chunk %d of block %016x: no answer from %s in %.1fs (silent for %.1fs) while"
                " the rest of the block landed; committing without it (repair restores it)",
                i,
                self.grant.block_id,
                node.node_id,
                took,
                silent,
            )
            if silent >= self.write_hedge_s:
                self.pool.drop(node.address)
                self.view.failed(node.address)

    async def _put_chunk(self, node: NodeInfo, cap: bytes, cid: str, i: int) -> None:
        """One chunk to one node. No time limit: a slow put is hedged by ``_race``."""
        enc = self.enc

        async def once() -> None:
            client = await self.pool.client(node.address)
            await client.put(cid, enc.chunks[i], cap, enc.checksums[i], enc.tables[i])

        await retry(once, policy=PUT_RETRY, when=_same_node_helps)
