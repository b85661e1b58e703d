"""Rebalance: move chunks from the fullest chunk stores to the emptiest.

Fill is each up chunk store's own ``used`` bytes over its ``capacity`` (``node_stats``; the
registry's ``free`` is the filesystem's, shared by every store of a one-machine cluster).
While the fullest node holds more than ``rebalance_tolerance`` times the mean of used bytes
more than the emptiest (in fill terms), one chunk moves from the fullest to the emptiest,
at most ``rebalance_max_moves`` per round, paced by the shared bandwidth bucket.

A move never lowers a block below full redundancy: the chunk is copied (read and verified
against the Block layer's CRC, written to the target), then ``block.set_chunk`` points the
block at the copy (refused if the chunk moved meanwhile), and only then is the source copy
deleted (the metadata service grants that delete only now: ``block.caps``). A copy whose
``set_chunk`` is refused (the block was collected meanwhile) is deleted at once; a crash
between steps leaves an extra copy, which the GC's chunk sweep removes. The
target holds no chunk of the block and, where possible, is in a failure domain the block's
other chunks do not use; a chunk whose only possible targets would share a domain stays.
A reader holding the old placement finds the source copy gone and reads degraded (correct
bytes, one decode).
"""

from __future__ import annotations

import logging

from chunkstore.client import file_size_for
from tectonic_py.core.errors import FileNotFound, TectonicError
from tectonic_py.core.records import NodeInfo
from tectonic_py.maintenance.runtime import Maintenance

log = logging.getLogger(__name__)


class Rebalancer:
    def __init__(self, m: Maintenance) -> None:
        self.m = m
        self._on_node: dict[str, list[tuple[int, int]]] = {}

    async def _usage(self, nodes: dict[str, NodeInfo]) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        for node in nodes.values():
            if node.state != "up":
                continue
            try:
                st = await self.m.node_call(node, "node_stats")
            except TectonicError as e:
                log.info("rebalance: no stats from %s: %s", node.node_id, e)
                continue
            out[node.node_id] = (int(st["used"]), max(1, int(st["capacity"])))
        return out

    async def round(self) -> int:
        s = self.m.settings
        nodes = await self.m.nodes()
        if any(n.state != "up" for n in nodes.values()):
            return 0  # repair first: moving data while a node is down only adds risk
        usage = await self._usage(nodes)
        if len(usage) < 2:
            return 0
        moved = 0
        skip: set[tuple[int, int]] = set()
        self._on_node = {}
        for _ in range(s.rebalance_max_moves):
            fill = {n: used / cap for n, (used, cap) in usage.items()}
            mean_used = sum(u for u, _ in usage.values()) / len(usage)
            src = max(fill, key=lambda n: fill[n])
            dst = min(fill, key=lambda n: fill[n])
            src_used, src_cap = usage[src]
            dst_used, dst_cap = usage[dst]
            gap = src_used - dst_used * src_cap / dst_cap
            if src == dst or gap <= max(s.rebalance_tolerance * mean_used, 1):
                break
            size = await self._move_one(nodes, src, dst, skip, gap)
            if size is None:
                break
            if size == 0:
                continue
            on_disk = file_size_for(size)
            usage[src] = (src_used - on_disk, src_cap)
            usage[dst] = (dst_used + on_disk, dst_cap)
            moved += 1
        if moved:
            log.info("rebalance: moved %d chunks", moved)
        self.m.counters.moved_chunks += moved
        return moved

    async def _move_one(
        self,
        nodes: dict[str, NodeInfo],
        src: str,
        dst: str,
        skip: set[tuple[int, int]],
        gap: float,
    ) -> int | None:
        """Move one suitable chunk from src to dst; its size, 0 if a try failed, None if
        src has no chunk that may go to dst. A chunk as large as the gap is never moved: the
        move would only swap which node is fuller (and the next round would swap it back)."""
        if src not in self._on_node:
            self._on_node[src] = await self.m.meta.blocks_on_node(src)
        for block_id, index in self._on_node[src]:
            if (block_id, index) in skip:
                continue
            skip.add((block_id, index))
            try:
                info = (await self.m.meta.locate_blocks([block_id]))[0]
            except FileNotFound:
                continue
            if file_size_for(info.chunk_len) >= gap:
                continue
            others = [c for c in info.chunks if c.index != index]
            if any(c.node_id == dst for c in info.chunks):
                continue
            domains = {nodes[c.node_id].failure_domain for c in others if c.node_id in nodes}
            if nodes[dst].failure_domain in domains and nodes[src].failure_domain not in domains:
                continue  # the move would put two chunks of the block in one domain
            chunk = next((c for c in info.chunks if c.index == index), None)
            if chunk is None or chunk.node_id != src:
                continue
            stored = chunk.storage_block(info.block_id)
            return await self._move(
                info.block_id, index, chunk.checksum, nodes[src], nodes[dst], stored
            )
        return None

    async def _move(
        self, block_id: int, index: int, crc: int, src: NodeInfo, dst: NodeInfo, stored: int
    ) -> int:
        """Copy chunk ``index`` of a block from ``src`` (its file there is ``stored``'s: the
        block's own id, or an earlier version's for an adopted chunk) to ``dst`` under the
        block's own id, repoint it, then delete the source file unless a version still
        places it."""
        copied = False
        try:
            data = await self.m.get_chunk(src, stored, index, crc)
            await self.m.put_chunk(dst, block_id, index, data, crc)
            copied = True
            await self.m.set_chunk(block_id, index, src.node_id, dst.node_id, crc)
        except TectonicError as e:
            log.info(
                "move of %016x.%d %s -> %s failed: %s", block_id, index, src.node_id, dst.node_id, e
            )
            if copied:  # collected or moved meanwhile: the copy is nobody's
                await self.m.discard_copy(dst, block_id, index)
            return 0
        try:
            await self.m.delete_chunk(src, stored, index)
        except TectonicError as e:
            log.info("source copy of %016x.%d stays for the GC: %s", block_id, index, e)
        return len(data)
