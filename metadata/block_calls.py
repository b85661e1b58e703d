"""The metadata client's Block layer calls: placement, allocation, where blocks are.

Placement: the client places a block's chunks itself (metadata/placement.py) over the node
list it fetched from the registry at most ``NODE_LIST_TTL_S`` ago (one ``node.list`` per
client per interval, shared by every writer of the process, never a registry round trip per
block). The registry's view is a heartbeat old anyway; a node that died since is handled as
any failed put is (hedges, ``more_nodes``).

A writer's blocks are allocated in its file's shard, which draws their ids to hash there, so
that their commit shares one transaction with the file's (metadata/file_calls.py).
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import trio

from metadata import placement
from metadata.routing import Router, gather
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import NoSpace
from tectonic_py.core.records import BlockGrant, BlockInfo, NodeInfo

NODE_LIST_TTL_S = 2.0


class BlockCalls:
    """Block layer calls, and the node list they place chunks over."""

    def __init__(self, router: Router) -> None:
        self._r = router
        self._node_cache: dict[str, NodeInfo] = {}
        self._nodes_at = -NODE_LIST_TTL_S  # time.monotonic() of the last node.list
        self._nodes_lock = trio.Lock()
        self._rng = random.Random()

    async def nodes(self) -> list[NodeInfo]:
        r = await self._r.call_registry("node.list")
        nodes = [NodeInfo.from_wire(n) for n in r["nodes"]]
        self._node_cache = {n.node_id: n for n in nodes}
        self._nodes_at = time.monotonic()
        return nodes

    async def allocate_block(
        self,
        file_id: int,
        token: int,
        ec: str,
        hedge: int = 2,
        nodes: Sequence[NodeInfo] | None = None,
        *,
        pack: bool = False,
    ) -> BlockGrant:
        """A new block id plus k+m+hedge placed nodes and a capability token; with ``nodes``,
        on those (a new version of a block keeps each chunk index on its old node).

        The metadata service refuses token 0 (no writer, no capability); a stale token is
        refused when the block is committed, not here: a fenced writer can only waste an
        allocation, which the GC reclaims. ``pack``: a block shared by files of the file's
        shard (``FileCalls.commit_pack``), allocated by one of their writers."""
        policy = ECPolicy.parse(ec)
        if nodes is None:
            # At least the default write quorum (k+1): with a node down in a cluster of
            # exactly k+m nodes, writes still succeed (the data client commits the chunks
            # that landed and repair restores the rest) instead of failing with NoSpace.
            nodes = await self.place(policy.n + max(hedge, 0), min(policy.n, policy.k + 1), ())
        # In the file's shard, which draws the block id to hash there: the block's commit then
        # shares one transaction with the file's (module docstring).
        a = await self._r.call_shard(
            self._r.shard_of(file_id),
            "block.allocate",
            {
                "file_id": file_id,
                "token": token,
                "ec": policy.name,
                "nodes": [n.node_id for n in nodes],
                "pack": pack,
            },
        )
        return BlockGrant(block_id=a["block_id"], nodes=list(nodes), capability=a["capability"])

    async def more_nodes(self, block_id: int, exclude: Sequence[str], count: int) -> BlockGrant:
        """Replacement nodes for a block whose chunk writes failed (same block id)."""
        nodes = await self.place(count, count, exclude)
        g = await self._r.call_shard(
            self._r.shard_of(block_id),
            "block.grant",
            {"block_id": block_id, "nodes": [n.node_id for n in nodes]},
        )
        return BlockGrant(block_id=block_id, nodes=nodes, capability=g["capability"])

    async def place(self, count: int, minimum: int, exclude: Sequence[str]) -> list[NodeInfo]:
        """Nodes for a block's chunks, placed here over the cached node list (module
        docstring); a list that leaves too few nodes is fetched again once."""
        for attempt in range(2):
            async with self._nodes_lock:  # one node.list for every writer waiting here
                if attempt or time.monotonic() - self._nodes_at > NODE_LIST_TTL_S:
                    await self.nodes()
            try:
                return placement.place(
                    self._node_cache.values(),
                    count,
                    minimum=minimum,
                    exclude=exclude,
                    rng=self._rng,
                )
            except NoSpace:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def locate_blocks(self, block_ids: Sequence[int]) -> list[BlockInfo]:
        """Block layer records of the given blocks (grouped per shard), addresses filled in."""
        ids = list(block_ids)
        if not ids:
            return []
        by_shard: dict[int, list[int]] = {}
        for b in ids:
            by_shard.setdefault(self._r.shard_of(b), []).append(b)

        def job(shard: int, group: list[int]) -> Callable[[], Awaitable[Any]]:
            return lambda: self._r.call_shard(shard, "block.locate", {"ids": group})

        shards = list(by_shard.items())
        replies = await gather([job(s, g) for s, g in shards])
        found: dict[int, BlockInfo] = {}
        for reply in replies:
            for data in reply["blocks"]:
                info = BlockInfo.from_wire(data)
                found[info.block_id] = info
        await self._fill_addresses(found.values())
        return [found[b] for b in ids]

    async def _fill_addresses(self, infos: Iterable[BlockInfo]) -> None:
        infos = list(infos)
        if any(c.node_id not in self._node_cache for i in infos for c in i.chunks):
            await self.nodes()
        for info in infos:
            for c in info.chunks:
                node = self._node_cache.get(c.node_id)
                c.address = node.address if node is not None else ""

    async def blocks_on_node(self, node_id: str) -> list[tuple[int, int]]:
        """(block_id, chunk_index) of every committed chunk on a node: the reverse index,
        gathered from every block shard (repair and ``tectonic status`` use it)."""

        def job(shard: int) -> Callable[[], Awaitable[list[tuple[int, int]]]]:
            async def run() -> list[tuple[int, int]]:
                out: list[tuple[int, int]] = []
                after = 0
                for _ in range(1_000_000):
                    r = await self._r.call_shard(
                        shard,
                        "block.by_node",
                        {"node_id": node_id, "after": after, "limit": 10_000},
                    )
                    chunks = [(int(b), int(i)) for b, i in r["chunks"]]
                    out.extend(chunks)
                    if len(chunks) < 10_000:
                        break
                    # A page may end inside one block's chunks: refetch from that block.
                    last = chunks[-1][0]
                    out = [c for c in out if c[0] != last]
                    after = last - 1
                return out

            return run

        results = await gather([job(s) for s in range(self._r.config.shards)])
        merged = sorted({c for part in results for c in part})
        return merged

    async def replace_chunk(
        self, block_id: int, index: int, old_node: str, new_node: str, checksum: int
    ) -> None:
        """Point one chunk of a committed block at a new node (repair, rebalance), keeping
        the reverse index in step; refused if the chunk is no longer on ``old_node``."""
        await self._r.call_shard(
            self._r.shard_of(block_id),
            "block.replace_chunk",
            {
                "block_id": block_id,
                "index": index,
                "old_node": old_node,
                "new_node": new_node,
                "checksum": checksum,
            },
        )

    async def report_bad_chunk(self, block_id: int, index: int, node_id: str, reason: str) -> bool:
        """Tell the Block layer a reader found this chunk corrupt or missing, so repair's next
        round rebuilds it; False if the block no longer has that chunk on that node."""
        r = await self._r.call_shard(
            self._r.shard_of(block_id),
            "block.report_bad_chunk",
            {"block_id": block_id, "index": index, "node_id": node_id, "reason": reason},
        )
        return bool(r["recorded"])
