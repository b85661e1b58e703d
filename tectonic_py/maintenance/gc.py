"""Garbage collection and lease recovery: give back the space of data nobody can reach.

Each round, in this order:

1. **Lease recovery.** Files whose writer lease expired more than ``lease_grace`` ago
   without a seal (the writer crashed, or its mount was killed) are resolved by the rule of
   ``metadata/maintenance_ops.py``: the file keeps its last committed size (what its writer
   made durable with fsync/flush), blocks past it are dropped, the writer token is released
   and the file stays **unsealed**, i.e. visibly incomplete, never a file that looks complete
   but is not; a file that was unlinked while being written is deleted. ``lease_grace`` is
   generous (10 minutes) because clients renew the lease only as they flush blocks: a
   writer that holds a file open without writing for longer than the lease plus the grace
   is fenced (its close fails, the file stays unsealed), which is the safe side.
2. **Orphan records**: File records of creates that crashed before their Name entry
   (``MetadataClient.collect_orphans``), after ``grace``.
3. **The GC queue**: blocks of deleted, truncated or overwritten files (queued by the File
   layer), once queued for ``grace``, or for ``superseded_grace`` when a newer version of
   the block replaced it at its index (an in-place write, a fsync'd short block filled
   later): a reader that then misses its chunks re-reads the file's block list and reads
   the new version, so no reader needs it for long. The block record is forgotten, then
   its chunks are deleted from their nodes (each chunk file under the block id it is
   stored as: a chunk adopted from an earlier version is that version's file), except
   those a newer version adopted and still places (no delete capability for them), then
   the queue entry acknowledged. The record goes first
   because the metadata service grants a delete capability only for a chunk no block
   needs (``block.caps``); a crash after it leaves chunks of a forgotten block, which the
   chunk sweep collects, as it does the chunks on nodes that are down.
4. Every ``sweep_interval``, the **block sweep**: blocks allocated but never committed
   (aborted writes, a killed writer) and committed blocks that their file does not hold
   (a crash between Block-layer commit and File-layer append) whose allocation is older
   than ``grace`` are *suspects*; a suspect still in that state on a sweep at least
   ``grace`` later is forgotten (``block.forget`` re-checks the state in its transaction).
   Two sightings keep a slow writer's commit, which happens between the two layers, safe.
5. Every ``sweep_interval``, the **chunk sweep**: every up chunk store's chunk list is
   checked against the Block layer (``block.dead_chunks``); a chunk no block needs on that
   node (its block forgotten, or the chunk repaired or moved elsewhere, or a hedge copy)
   whose file is older than ``grace`` is deleted, with a delete capability asked for after
   the age check (``block.caps`` applies the same rule again, so a chunk moved back here
   meanwhile gets none). This is also how a node that comes back after being down is
   reconciled with the Block layer.

6. Every ``sweep_interval``, the **staging sweep**: staging directories of checkpoint steps
   never committed (``<step>.staging-<id>``: a job that died before its commit, and steps
   a commit replaced and moved aside) are found by name, one ``name.staging`` scan per
   shard; one whose whole tree is untouched for ``grace`` (no record in it changed since)
   and where no writer holds a live lease is removed, tree and all. A job still writing
   into it keeps it: its writers renew their leases and every create stamps the directory.

7. Every ``sweep_interval``, the **unreachable-record sweep**
   (``tectonic_py/maintenance/unreachable.py``): records no name reaches in two walks of the
   namespace at least ``unreachable_grace`` apart (what a crash between the two shards of an
   unlink or a rename leaves), unchanged and without a live writer, are deleted.

Nothing referenced is ever deleted: a chunk goes only if the Block layer says no committed
block needs it there (and a chunk store deletes nothing without the metadata service's
capability saying so), a block record only when unreferenced twice, ``grace`` apart.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from tectonic_py.core.errors import FileNotFound, Refused, TectonicError
from tectonic_py.core.ids import chunk_id, parse_chunk_id, shard_of
from tectonic_py.core.records import NodeInfo
from tectonic_py.maintenance.runtime import Maintenance, gather
from tectonic_py.maintenance.unreachable import UnreachableSweep

log = logging.getLogger(__name__)

PAGE = 1000


class GarbageCollector:
    def __init__(self, m: Maintenance) -> None:
        self.m = m
        self._suspects: dict[int, float] = {}  # block id -> monotonic time first seen
        self._last_sweep = 0.0
        self.staging_removed = 0  # staging directories removed since this process started
        self.unreachable = UnreachableSweep(m)

    async def round(self) -> None:
        s = self.m.settings
        await self.recover_leases()
        self.m.counters.orphans_collected += await self.m.meta.collect_orphans(s.grace)
        await self.drain_queue()
        now = time.monotonic()
        if self._last_sweep == 0.0 or now - self._last_sweep >= s.sweep_interval:
            await self.sweep_blocks()
            await self.sweep_chunks()
            await self.sweep_staging()
            try:
                await self.unreachable.round()
            except TectonicError as e:  # a walk that failed sweeps nothing; the rest stands
                log.info("unreachable-record sweep skipped this time: %s", e)
            self._last_sweep = now

    # --- 1. lease recovery -------------------------------------------------------------------

    async def recover_leases(self) -> int:
        before = time.time_ns() - int(self.m.settings.lease_grace * 1e9)
        done = 0
        for shard in range(self.m.config.shards):
            expired = await self.m.meta.expired_leases(shard, before_ns=before, limit=PAGE)
            for file_id, lease_ns in expired:
                outcome = await self.m.meta.recover_lease(file_id, lease_ns, before_ns=before)
                if outcome != "skipped":
                    done += 1
                    log.warning(
                        "file %d: writer lease expired without a close; %s",
                        file_id,
                        "deleted (it was unlinked)"
                        if outcome == "deleted"
                        else "left unsealed (incomplete) at its last committed size",
                    )
        self.m.counters.leases_recovered += done
        return done

    # --- 3. the GC queue -------------------------------------------------------------------

    async def drain_queue(self) -> int:
        now = time.time_ns()
        before = now - int(self.m.settings.grace * 1e9)
        superseded = now - int(self.m.settings.superseded_grace * 1e9)
        nodes = await self.m.nodes()
        done = 0
        for shard in range(self.m.config.shards):
            queued = await self.m.meta.gc_queue(
                shard, older_than_ns=before, limit=PAGE, superseded_before_ns=superseded
            )
            ids = [b for b, _ in queued]
            if not ids:
                continue
            acked: list[int] = []

            async def collect(block_id: int, out: list[int]) -> None:
                if await self.collect_block(block_id, nodes):
                    out.append(block_id)

            await gather([functools.partial(collect, b, acked) for b in ids], 8)
            if acked:
                await self.m.meta.gc_ack(shard, acked)
                done += len(acked)
        return done

    async def collect_block(self, block_id: int, nodes: dict[str, NodeInfo]) -> bool:
        """Forget a dropped block, then delete the chunk files it placed when it was
        forgotten (one ``block.caps`` call for all of them); True when it is gone for good.
        The placements come from the forget itself, not a lookup before it: repair or
        rebalance may point the block at a new copy in between, and that copy would stay."""
        try:
            placed = await self.m.meta.forget_block(block_id, state="committed")
        except Refused as e:
            # A pack an extent was committed into after it was queued: it lives on, and is
            # queued again when its last extent goes.
            log.info("queued block stays: %s", e)
            return True
        if placed is None:
            return True  # never committed, or forgotten by an earlier (crashed) round
        self.m.counters.forgotten_blocks += 1
        up = [
            (node_id, stored, index)
            for node_id, stored, index in placed
            if node_id in nodes and nodes[node_id].state == "up"
        ]  # a chunk on a node that is down: the chunk sweep deletes it when the node is back
        # No capability for a chunk file that another version still places (adopted).
        caps = await self.m.chunk_caps("delete", up) if up else {}
        for (node_id, stored, index), cap in caps.items():
            try:
                await self.m.delete_chunk(nodes[node_id], stored, index, cap)
            except TectonicError as e:
                log.info("chunk %s stays for the chunk sweep: %s", chunk_id(stored, index), e)
        return True

    # --- 4. the block sweep ----------------------------------------------------------------

    async def sweep_blocks(self) -> int:
        grace = self.m.settings.grace
        cutoff = time.time_ns() - int(grace * 1e9)
        now = time.monotonic()
        seen: set[int] = set()
        forgotten = 0
        for shard in range(self.m.config.shards):
            committed: list[dict[str, Any]] = []
            candidates: list[dict[str, Any]] = []
            async for rec in self.m.scan_blocks(shard):
                if rec["allocated_ns"] >= cutoff:
                    continue
                if rec["state"] == "allocated":
                    candidates.append(rec)
                else:
                    committed.append(rec)
            candidates += await self._unreferenced(committed)
            for rec in candidates:
                bid = rec["block_id"]
                seen.add(bid)
                first = self._suspects.setdefault(bid, now)
                if now - first < grace:
                    continue
                try:
                    placed = await self.m.meta.forget_block(
                        bid,
                        state=rec["state"],
                        file_id=rec["file_id"],
                        file_index=rec["file_index"],
                    )
                except Refused:
                    continue  # a file took it since the scan

                if placed is not None:
                    forgotten += 1
                    log.info(
                        "forgot %s block %016x of file %d (unreferenced past the grace period)",
                        rec["state"],
                        bid,
                        rec["file_id"],
                    )
        self._suspects = {b: t for b, t in self._suspects.items() if b in seen}
        self.m.counters.forgotten_blocks += forgotten
        return forgotten

    async def _unreferenced(self, recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        by_shard: dict[int, list[dict[str, Any]]] = {}
        for rec in recs:
            by_shard.setdefault(shard_of(rec["file_id"], self.m.config.shards), []).append(rec)
        out = []
        for shard, group in by_shard.items():
            for i in range(0, len(group), PAGE):
                page = group[i : i + PAGE]
                refs = await self.m.meta.referenced(
                    shard, [(g["file_id"], g["file_index"], g["block_id"]) for g in page]
                )
                out += [g for g, ref in zip(page, refs) if not ref]
        return out

    # --- 5. the chunk sweep ----------------------------------------------------------------

    async def sweep_chunks(self) -> int:
        nodes = await self.m.nodes()
        deleted = 0

        def job(node: NodeInfo) -> Callable[[], Awaitable[None]]:
            async def run() -> None:
                nonlocal deleted
                deleted += await self.sweep_node(node)

            return run

        await gather([job(n) for n in nodes.values() if n.state == "up"], 4)
        return deleted

    async def sweep_node(self, node: NodeInfo) -> int:
        """Delete the chunks on one node that no block needs there (older than grace)."""
        cutoff = time.time() - self.m.settings.grace
        deleted = 0
        after: str | None = ""
        while after is not None:
            r = await self.m.node_call(node, "list", after=after, limit=PAGE)
            after = r["next"]
            by_shard: dict[int, list[tuple[int, int]]] = {}
            for cid, _size in r["chunks"]:
                try:
                    b, i = parse_chunk_id(cid)
                except ValueError:
                    continue
                by_shard.setdefault(self.m.meta.shard_of(b), []).append((b, i))
            for shard, chunks in by_shard.items():
                dead = await self.m.meta.dead_chunks(shard, node.node_id, chunks)
                old: list[tuple[str, int, int]] = []
                for block, index in dead:
                    try:
                        st = await self.m.node_call(node, "stat", chunk_id=chunk_id(block, index))
                    except TectonicError:
                        continue
                    if st["mtime"] > cutoff:
                        continue  # a copy being made right now (repair, rebalance, a writer)
                    old.append((node.node_id, block, index))
                # Granted only if still dead: a chunk moved back here meanwhile gets no cap.
                caps = await self.m.chunk_caps("delete", old) if old else {}
                for (_, bid, idx), cap in caps.items():
                    if await self.m.delete_chunk(node, bid, idx, cap):
                        deleted += 1
            await trio.lowlevel.checkpoint()
        if deleted:
            log.info("chunk sweep: deleted %d unreferenced chunks on %s", deleted, node.node_id)
        return deleted

    # --- 6. the staging sweep --------------------------------------------------------------

    async def sweep_staging(self) -> int:
        """Remove the staging directories of dead jobs (step 6 of the module docstring)."""
        cutoff = time.time_ns() - int(self.m.settings.grace * 1e9)
        meta = self.m.meta
        removed = 0
        for parent, name, dir_id in await meta.staging_dirs(self.m.config.shards):
            try:
                state = await meta.tree_state(dir_id, name)
                if state.newest_ns >= cutoff or any(w == "writing" for _, w in state.unsealed):
                    continue
                gone = await meta.remove_tree(parent, name, dir_id)
            except FileNotFound:
                continue  # committed or removed meanwhile
            if gone:
                removed += 1
                log.info(
                    "removed stale staging directory %r (%d files, untouched for %.0fs)",
                    name,
                    state.files,
                    (time.time_ns() - state.newest_ns) / 1e9,
                )
        self.staging_removed += removed
        return removed
