"""Inventory: what the Block layer says each chunk store holds, checked against what it holds.

The scrub verifies the chunks a store has; it cannot notice one that is gone (deleted through
the wire, its file removed) or a chunk file replaced by another chunk's valid file, which
passes every check of the file alone. A pass of the inventory, for each up chunk store,
compares the chunks the Block layer places there (``block.node_chunks``: block, index,
checksum, chunk length) with the store's own listing (``list`` with checksums), and records
each chunk that is absent (``missing``) or has another checksum or length (``mismatch``) in
the Block layer (``block.report_bad_chunk``), the record readers and the scrub feed too.
Repair rebuilds those chunks as it rebuilds those of a down node, and ``tectonic status``
counts their blocks as degraded; a restart of the store hides nothing, since the record is
the Block layer's.

Chunks written while a pass runs: for each range of block ids the pass reads the Block layer
first and the store's listing second. A block is committed only once its chunks are durable,
so every chunk of a block the Block layer named was on the store before the listing began;
a chunk that moved or was collected meanwhile is absent from the listing, and the report is
refused in the Block layer's transaction (the block no longer has it there). The pass never
holds more than one range (about ``WINDOW_CHUNKS`` chunks of the store) in memory.

Chunks the store has that the Block layer does not place there are the GC's chunk sweep's
business, not this pass's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import trio

from tectonic_py.core.errors import TectonicError
from tectonic_py.core.ids import MAX_CHUNK_INDEX, MAX_ID, parse_chunk_id
from tectonic_py.core.records import NodeInfo
from tectonic_py.maintenance.runtime import Maintenance

log = logging.getLogger(__name__)

WINDOW_CHUNKS = 20_000  # chunks of one store compared at a time (memory bound of a pass)
PAGE = 1000


@dataclass
class NodeInventory:
    """What one pass found on one chunk store."""

    node_id: str
    expected: int = 0  # chunks the Block layer places there
    listed: int = 0  # chunks the store listed in the ranges compared
    missing: list[tuple[int, int]] = field(default_factory=list)
    mismatched: list[tuple[int, int]] = field(default_factory=list)
    recorded: int = 0  # reports the Block layer took (the rest moved meanwhile)
    error: str | None = None  # the pass over this store did not finish

    def to_json(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "expected": self.expected,
            "listed": self.listed,
            "missing": [f"{b:016x}.{i}" for b, i in self.missing],
            "mismatched": [f"{b:016x}.{i}" for b, i in self.mismatched],
            "recorded": self.recorded,
            "error": self.error,
        }


class Inventory:
    """The inventory service: ``round`` is one pass over every up chunk store."""

    def __init__(self, m: Maintenance) -> None:
        self.m = m
        self.last: list[NodeInventory] = []

    async def round(self) -> list[NodeInventory]:
        nodes = [n for n in (await self.m.nodes()).values() if n.state == "up"]
        results = [NodeInventory(n.node_id) for n in nodes]

        async def one(node: NodeInfo, out: NodeInventory) -> None:
            try:
                await self.check_node(node, out)
            except (TectonicError, trio.TooSlowError) as e:
                out.error = str(e)
                log.info("inventory of %s not finished: %s", node.node_id, e)

        async with trio.open_nursery() as nursery:
            for node, out in zip(nodes, results):
                nursery.start_soon(one, node, out)
        found = sum(len(r.missing) + len(r.mismatched) for r in results)
        self.m.counters.inventory_mismatches += found
        if found:
            log.warning(
                "inventory: %d chunks missing or replaced on %d chunk stores, %d recorded"
                " for repair",
                found,
                sum(1 for r in results if r.missing or r.mismatched),
                sum(r.recorded for r in results),
            )
        self.last = results
        return results

    async def check_node(self, node: NodeInfo, out: NodeInventory) -> None:
        """Compare one store with the Block layer, range by range of block ids."""
        windows = max(1, -(-node.chunk_count // WINDOW_CHUNKS))
        step = MAX_ID // windows
        lo = 0
        for w in range(windows):
            hi = MAX_ID if w == windows - 1 else lo + step
            expected = await self._expected(node.node_id, lo, hi)  # first: see the docstring
            held = await self._held(node, lo, hi)
            out.expected += len(expected)
            out.listed += len(held)
            for key, (crc, length) in sorted(expected.items()):
                have = held.get(key)
                if have is None:
                    out.missing.append(key)
                    reason = "missing"
                elif have != (crc, length):
                    out.mismatched.append(key)
                    reason = "mismatch"
                else:
                    continue
                out.recorded += await self.m.meta.report_bad_chunk(
                    key[0], key[1], node.node_id, reason
                )
            lo = hi

    async def _expected(
        self, node_id: str, lo: int, hi: int
    ) -> dict[tuple[int, int], tuple[int, int]]:
        """(block, index) -> (checksum, chunk_len) of the chunks the Block layer places on
        the node with lo < block_id <= hi, from every shard."""
        out: dict[tuple[int, int], tuple[int, int]] = {}

        async def shard(s: int) -> None:
            after = (lo, MAX_CHUNK_INDEX)
            while True:
                chunks = await self.m.meta.node_chunks(s, node_id, after=after, upto=hi, limit=PAGE)
                for b, i, crc, length in chunks:
                    out[(b, i)] = (crc, length)
                if len(chunks) < PAGE:
                    return
                after = (chunks[-1][0], chunks[-1][1])

        async with trio.open_nursery() as nursery:
            for s in range(self.m.config.shards):
                nursery.start_soon(shard, s)
        return out

    async def _held(
        self, node: NodeInfo, lo: int, hi: int
    ) -> dict[tuple[int, int], tuple[int, int]]:
        """(block, index) -> (checksum, length) of the chunks the store lists with
        lo < block_id <= hi."""
        out: dict[tuple[int, int], tuple[int, int]] = {}
        # "/" sorts right after ".": the first id after every chunk of block ``lo``.
        after: str | None = f"{lo:016x}/" if lo else ""
        while after is not None:
            r = await self.m.node_call(node, "list", after=after, limit=PAGE, checksums=True)
            after = r["next"]
            for cid, length, crc in r["chunks"]:
                try:
                    block_id, index = parse_chunk_id(cid)
                except ValueError:
                    continue
                if block_id > hi:
                    return out
                if block_id > lo:
                    out[(block_id, index)] = (int(crc), int(length))
        return out


def summary(results: list[NodeInventory]) -> dict[str, Any]:
    """One pass as a JSON-ready object (``tectonic repair --inventory --json``)."""
    return {
        "nodes_checked": sum(1 for r in results if r.error is None),
        "expected": sum(r.expected for r in results),
        "missing": sum(len(r.missing) for r in results),
        "mismatched": sum(len(r.mismatched) for r in results),
        "recorded": sum(r.recorded for r in results),
        "nodes": [r.to_json() for r in results],
    }
