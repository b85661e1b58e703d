"""The metadata client's calls for the background services (GC, repair, rebalance, lease
recovery, the inventory): the ops of metadata/maintenance_ops.py, typed, and the orphan GC.

Only the ``tectonic maintenance`` process (tectonic_py/maintenance/) calls them; the data path
never does. Each is one call in one shard, and the server re-checks the state it acts on in
that call's transaction, so a caller acting on a stale view is refused rather than doing
harm. A call about one block or file goes to its key's shard; the scans and the calls about
many records name the shard, since their callers walk the shards one by one.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from metadata.routing import Router
from tectonic_py.core.errors import FileNotFound, NotADirectory
from tectonic_py.core.records import BlockInfo


class MaintenanceCalls:
    """Calls of the background services, over the router."""

    def __init__(self, router: Router) -> None:
        self._r = router

    async def collect_orphans(self, grace_s: float, *, limit: int = 1000) -> int:
        """Delete File records that no Name entry reaches, created over ``grace_s`` ago
        (creates interrupted between the File record and the Name entry). A record whose
        intended name does point at it is marked named instead. Returns how many went."""
        cutoff = time.time_ns() - int(grace_s * 1e9)
        collected = 0
        for shard in range(self._r.config.shards):
            r = await self._r.call_shard(
                shard, "file.orphans", {"older_than_ns": cutoff, "limit": limit}
            )
            for o in r["orphans"]:
                try:
                    found = await self._r.call_shard(
                        self._r.shard_of(o["parent"]),
                        "name.lookup",
                        {"dir": o["parent"], "name": o["name"]},
                    )
                    named = found["id"] == o["id"]
                except (FileNotFound, NotADirectory):
                    named = False
                if named:
                    await self._r.call_shard(
                        shard,
                        "file.link",
                        {"id": o["id"], "parent": o["parent"], "name": o["name"]},
                    )
                else:
                    d = await self._r.call_shard(shard, "file.collect_orphan", {"id": o["id"]})
                    collected += bool(d["deleted"])
        return collected

    # --- the Block layer ------------------------------------------------------------------

    async def scan_blocks(self, shard: int, *, page: int = 1000) -> AsyncIterator[dict[str, Any]]:
        """Every block record of a block shard (allocated and committed), page by page, in
        block-id order (``block.scan``)."""
        after = 0
        for _ in range(10_000_000):
            r = await self._r.call_shard(shard, "block.scan", {"after": after, "limit": page})
            for b in r["blocks"]:
                yield b
            if r["next"] is None:
                return
            after = int(r["next"])

    async def set_chunk(
        self, block_id: int, index: int, old_node: str, new_node: str, checksum: int
    ) -> None:
        """Place a committed block's chunk on ``new_node``, where it was on ``old_node`` (""
        for a chunk not placed since the commit); refused if it is not there any more."""
        await self._r.call_shard(
            self._r.shard_of(block_id),
            "block.set_chunk",
            {
                "block_id": block_id,
                "index": index,
                "old_node": old_node,
                "new_node": new_node,
                "checksum": checksum,
                "registry": self._r.config.registry_address,
            },
        )

    async def forget_block(
        self,
        block_id: int,
        *,
        state: str,
        file_id: int | None = None,
        file_index: int | None = None,
    ) -> list[tuple[str, int, int]] | None:
        """Drop a block's record if it is still in ``state`` (and, given them, at that index
        of that file): the (node_id, stored_as, index) of the chunk files it placed then, or
        None if it was not forgotten (never committed, or forgotten before)."""
        fields: dict[str, Any] = {"block_id": block_id, "state": state}
        if file_id is not None:
            fields["file_id"] = file_id
        if file_index is not None:
            fields["file_index"] = file_index
        r = await self._r.call_shard(self._r.shard_of(block_id), "block.forget", fields)
        if not r["forgotten"]:
            return None
        return [(str(n), int(b), int(i)) for n, b, i in r["chunks"]]

    async def dead_chunks(
        self, shard: int, node_id: str, chunks: Sequence[tuple[int, int]]
    ) -> list[tuple[int, int]]:
        """Of these (block_id, index) chunks of ``shard``'s blocks found on ``node_id``, those
        no block needs there."""
        r = await self._r.call_shard(
            shard,
            "block.dead_chunks",
            {"node_id": node_id, "chunks": [list(c) for c in chunks]},
        )
        return [(int(b), int(i)) for b, i in r["dead"]]

    async def bad_chunks(
        self, shard: int, *, after: int = 0, limit: int = 1000
    ) -> tuple[list[tuple[int, int, str]], int | None]:
        """One page of the chunks ``shard``'s committed blocks lack on up nodes, (block_id,
        index, node_id), after block ``after``; and where the next page starts, or None."""
        r = await self._r.call_shard(shard, "block.bad_chunks", {"after": after, "limit": limit})
        chunks = [(int(b), int(i), str(n)) for b, i, n in r["chunks"]]
        return chunks, None if r["next"] is None else int(r["next"])

    async def node_chunks(
        self, shard: int, node_id: str, *, after: tuple[int, int], upto: int, limit: int
    ) -> list[tuple[int, int, int, int]]:
        """One page of the chunks ``shard``'s blocks place on ``node_id``, (block_id, index,
        checksum, chunk_len) in (block_id, index) order, after ``after``, block ids up to
        ``upto``."""
        r = await self._r.call_shard(
            shard,
            "block.node_chunks",
            {"node_id": node_id, "after": list(after), "upto": upto, "limit": limit},
        )
        return [(int(b), int(i), int(crc), int(n)) for b, i, crc, n in r["chunks"]]

    async def chunk_caps(
        self, action: str, chunks: Sequence[tuple[str, int, int]]
    ) -> dict[tuple[str, int, int], bytes]:
        """Capabilities for ``action`` ("put", "delete") on (node_id, block_id, index) chunks,
        one ``block.caps`` call per block shard; the chunks the metadata service refused are
        absent."""
        by_shard: dict[int, list[tuple[str, int, int]]] = {}
        for c in chunks:
            by_shard.setdefault(self._r.shard_of(c[1]), []).append(c)
        out: dict[tuple[str, int, int], bytes] = {}
        for shard, group in by_shard.items():
            r = await self._r.call_shard(
                shard, "block.caps", {"action": action, "chunks": [list(c) for c in group]}
            )
            out.update((c, cap) for c, cap in zip(group, r["caps"]) if cap is not None)
        return out

    # --- the File layer: the GC queue and writers' leases ---------------------------------

    async def gc_queue(
        self, shard: int, *, older_than_ns: int, limit: int, superseded_before_ns: int = 0
    ) -> list[tuple[int, int]]:
        """(block_id, queued_ns) of blocks ``shard`` queued for the GC before
        ``older_than_ns`` (superseded ones: before ``superseded_before_ns``)."""
        r = await self._r.call_shard(
            shard,
            "file.gc_queue",
            {
                "older_than_ns": older_than_ns,
                "limit": limit,
                "superseded_before_ns": superseded_before_ns,
            },
        )
        return [(int(b), int(q)) for b, q in r["blocks"]]

    async def gc_ack(self, shard: int, block_ids: Sequence[int]) -> None:
        """These queued blocks of ``shard`` are collected: off the queue."""
        await self._r.call_shard(shard, "file.gc_ack", {"block_ids": list(block_ids)})

    async def referenced(self, shard: int, refs: Sequence[tuple[int, int, int]]) -> list[bool]:
        """For each (file_id, file_index, block_id) of files in ``shard``: whether the file
        holds that block at that index."""
        r = await self._r.call_shard(
            shard, "file.referenced", {"refs": [list(ref) for ref in refs]}
        )
        return [bool(x) for x in r["referenced"]]

    async def scan_files(self, shard: int, *, page: int = 1000) -> AsyncIterator[dict[str, Any]]:
        """Every File record of ``shard`` (``file.scan``), page by page, in id order: id,
        kind, named, parent, name, nlink, size, blocks, writer, lease_ns, created_ns,
        ctime_ns."""
        after = 0
        for _ in range(10_000_000):
            r = await self._r.call_shard(shard, "file.scan", {"after": after, "limit": page})
            for f in r["files"]:
                yield f
            if r["next"] is None:
                return
            after = int(r["next"])

    async def collect_unreachable(self, file_id: int, ctime_ns: int) -> bool:
        """Delete a record no name reaches if it is unchanged since ``ctime_ns``, without a
        live writer and not a directory with entries; whether it went."""
        r = await self._r.call_shard(
            self._r.shard_of(file_id),
            "file.collect_unreachable",
            {"id": file_id, "ctime_ns": ctime_ns},
        )
        return bool(r["deleted"])

    async def expired_leases(
        self, shard: int, *, before_ns: int, limit: int
    ) -> list[tuple[int, int]]:
        """(file_id, lease_ns) of ``shard``'s files whose writer lease expired before
        ``before_ns`` (the server holds it to now) without a close."""
        r = await self._r.call_shard(
            shard, "file.expired_leases", {"before_ns": before_ns, "limit": limit}
        )
        return [(int(f), int(t)) for f, t in r["files"]]

    async def recover_lease(self, file_id: int, lease_ns: int, *, before_ns: int) -> str:
        """Release a writer lease that expired (at ``lease_ns``, as ``expired_leases`` said)
        before ``before_ns`` (the rule is metadata/maintenance_ops.py's): "skipped",
        "deleted" or "incomplete"."""
        r = await self._r.call_shard(
            self._r.shard_of(file_id),
            "file.recover_lease",
            {"id": file_id, "lease_ns": lease_ns, "before_ns": before_ns},
        )
        return str(r["outcome"])

    async def pack_usage(
        self, shard: int, *, older_than_ns: int, max_live: float, after: int = 0, limit: int = 1000
    ) -> tuple[list[dict[str, Any]], int]:
        """Packs of ``shard`` allocated before ``older_than_ns`` whose live extents hold at
        most ``max_live`` of their bytes, among ``limit`` after block id ``after``; each with
        its live extents ``[file_id, index, offset, length]``. And the cursor (0: done)."""
        r = await self._r.call_shard(
            shard,
            "block.pack_usage",
            {
                "after": after,
                "limit": limit,
                "older_than_ns": older_than_ns,
                "max_live_permille": max(0, min(1000, int(max_live * 1000))),
            },
        )
        return list(r["packs"]), int(r["next"])

    async def relocate_extents(
        self, pack: BlockInfo, old_block_id: int, moves: Sequence[tuple[int, int, int, int, int]]
    ) -> int:
        """Commit the new ``pack`` and move the extents ``(file_id, index, old_offset,
        length, new_offset)`` that still name ``old_block_id`` into it, one transaction of
        the packs' shard (metadata/compaction_ops.py); how many moved."""
        r = await self._r.call_shard(
            self._r.shard_of(pack.block_id),
            "file.relocate_extents",
            {
                "block": pack.to_wire(),
                "old_block_id": old_block_id,
                "moves": [list(m) for m in moves],
            },
        )
        return int(r["moved"])
