"""Repair: restore every block to k+m live chunks after node failures and corrupt chunks.

Failure detection is the node registry's: a chunk store whose heartbeats stop for longer than
``--node-timeout`` is ``down`` (``node.list``); one that heartbeats again is ``up``, and its
chunks are checked against the Block layer by the GC's chunk sweep (copies that were
repaired elsewhere meanwhile are deleted, the rest count again at once).

Each round finds the blocks that need work:

* chunks on down nodes, through the Block layer's reverse index (``blocks_on_node``);
* the chunks the Block layer records as bad (``block.bad_chunks``): reported by a reader
  that found them corrupt or missing, by the inventory (``inventory.py``: gone from their
  store, or another chunk's file in their place), or absent since their block's commit;
* chunks that scrub found corrupt (``scrub_report`` of every up chunk store), which each
  round records in the Block layer too, so a restart of the store (its report is in
  memory) hides nothing from repair or ``tectonic status``;
* every ``sweep_interval``, a scan of all blocks (``block.scan``), which also finds blocks a
  writer committed with fewer than n chunks (the write quorum is k + 1).

Most endangered first: the queue is ordered by the number of live chunks (fewest first).
For each block: fetch k live chunks (verified against the CRCs the Block layer recorded),
decode with zfec in a worker thread, re-encode to get the missing chunks and check each
against its recorded CRC, put each on an up node that holds no chunk of the block, in a
failure domain the block does not use where one exists, then ``block.set_chunk`` (refused if
the chunk moved meanwhile), then delete the old copy if its node is reachable (a corrupt copy,
or a node that came back). When every other up node holds a chunk of the block already, a
chunk is put back on its own node as a last resort: that succeeds where the store lost it
(and is a no-op where the report was wrong), and is refused where the store holds other
bytes under its id. Bytes read and written go through the bandwidth ``TokenBucket``.
The put and the delete of the old copy carry capabilities from ``block.caps``: the delete's
is granted only once ``block.set_chunk`` has pointed the chunk away from the old node.
A block with fewer than k live chunks cannot be rebuilt: it is logged as lost and counted.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any

import trio

from tectonic_py.client.codec import decode_into, encode_block
from tectonic_py.core.checksum import checksum
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import ChunkCorrupt, ChunkNotFound, FileNotFound, TectonicError
from tectonic_py.core.ids import parse_chunk_id
from tectonic_py.core.records import BlockInfo, NodeInfo
from tectonic_py.maintenance import fsck_summary
from tectonic_py.maintenance.runtime import Maintenance, gather

log = logging.getLogger(__name__)

_LOCATE_BATCH = 1000  # block ids per locate call


@dataclass
class BlockHealth:
    """One block as repair sees it."""

    info: BlockInfo
    live: list[int]  # chunk indexes on up nodes, not known bad
    missing: list[int]  # indexes to rebuild


def assess(
    info: BlockInfo, nodes: dict[str, NodeInfo], bad: set[tuple[int, int, str]]
) -> BlockHealth:
    policy = ECPolicy.parse(info.ec)
    placed = {c.index: c for c in info.chunks}
    live = []
    missing = []
    for i in range(policy.n):
        c = placed.get(i)
        node = nodes.get(c.node_id) if c is not None else None
        if c is None or node is None or node.state != "up" or (info.block_id, i, c.node_id) in bad:
            missing.append(i)
        else:
            live.append(i)
    return BlockHealth(info, live, missing)


class Repairer:
    def __init__(self, m: Maintenance) -> None:
        self.m = m
        self._last_scan = 0.0
        self.queue_len = 0
        # Chunks this round found no node for. A layout with no spare failure domain (as many
        # domains as chunks per block) meets this for every chunk of every block of a lost
        # store, every round: one warning per round with the count, the chunks at DEBUG.
        self.unplaced = 0
        self._sent: set[tuple[int, int, str]] = set()  # scrub finds sent to the Block layer

    async def bad_chunks(
        self, nodes: dict[str, NodeInfo], *, record: bool = False, scrub_timeout: float = 30.0
    ) -> set[tuple[int, int, str]]:
        """(block, index, node) of every chunk an up chunk store's scrub reported bad, and of
        every chunk the Block layer records as bad that is still where it was reported
        (node "": never placed). ``record``: write the scrub's new finds to the Block layer.
        A store silent for ``scrub_timeout`` is skipped (its finds were recorded before)."""
        reported = await self.reported_chunks()
        bad: set[tuple[int, int, str]] = set()

        async def ask(node: NodeInfo) -> None:
            try:
                with trio.fail_after(scrub_timeout):
                    r = await self.m.node_call(node, "scrub_report")
            except (TectonicError, trio.TooSlowError) as e:
                log.info("no scrub report from %s: %s", node.node_id, e)
                return
            for cid, _why in r.get("bad", []):
                try:
                    block_id, index = parse_chunk_id(cid)
                except ValueError:
                    continue
                bad.add((block_id, index, node.node_id))

        async with trio.open_nursery() as nursery:
            for node in nodes.values():
                if node.state == "up":
                    nursery.start_soon(ask, node)
        if record:
            # A find the Block layer refused (an orphan chunk: the GC's) is not sent again.
            for block_id, index, node_id in sorted(bad - reported - self._sent):
                try:
                    await self.m.meta.report_bad_chunk(block_id, index, node_id, "scrub")
                except TectonicError as e:
                    log.info("scrub report of %016x.%d not recorded: %s", block_id, index, e)
                    continue
                self._sent.add((block_id, index, node_id))
            self._sent &= bad
        return bad | reported

    async def reported_chunks(self) -> set[tuple[int, int, str]]:
        """The chunks readers reported (``block.report_bad_chunk``), from every shard; a
        shard that does not answer is skipped this round, as a silent scrub is."""
        bad: set[tuple[int, int, str]] = set()
        for shard in range(self.m.config.shards):
            after = 0
            for _ in range(1_000_000):
                try:
                    chunks, nxt = await self.m.meta.bad_chunks(shard, after=after, limit=1000)
                except TectonicError as e:
                    log.info("no reported bad chunks from shard %d: %s", shard, e)
                    break
                bad.update(chunks)
                if nxt is None:
                    break
                after = nxt
        return bad

    async def find_work(
        self, nodes: dict[str, NodeInfo], bad: set[tuple[int, int, str]], full_scan: bool
    ) -> list[BlockHealth]:
        ids: set[int] = {b for b, _, _ in bad}
        for node in nodes.values():
            if node.state != "up":
                ids.update(b for b, _ in await self.m.meta.blocks_on_node(node.node_id))
        infos: dict[int, BlockInfo] = {}
        if full_scan:
            for shard in range(self.m.config.shards):
                async for rec in self.m.scan_blocks(shard):
                    if rec["state"] == "committed":
                        infos[rec["block_id"]] = _info(rec)
        todo = sorted(ids - infos.keys())
        for i in range(0, len(todo), _LOCATE_BATCH):
            infos.update((b.block_id, b) for b in await self._locate(todo[i : i + _LOCATE_BATCH]))
        work = [assess(info, nodes, bad) for info in infos.values()]
        work = [w for w in work if w.missing]
        work.sort(key=lambda w: (len(w.live), w.info.block_id))
        return work

    async def _locate(self, ids: list[int]) -> list[BlockInfo]:
        """The committed blocks of ``ids``; those collected meanwhile are left out."""
        try:
            return await self.m.meta.locate_blocks(ids)
        except FileNotFound:
            out = []
            for block_id in ids:  # one is gone: find which, one by one
                try:
                    out.extend(await self.m.meta.locate_blocks([block_id]))
                except FileNotFound:
                    continue
            return out

    async def round(self) -> None:
        nodes = await self.m.nodes()
        bad = await self.bad_chunks(nodes, record=True)
        now = time.monotonic()
        full = now - self._last_scan >= self.m.settings.sweep_interval or self._last_scan == 0.0
        work = await self.find_work(nodes, bad, full)
        if full:
            self._last_scan = now
        self.queue_len = len(work)
        if not work:
            return
        log.info(
            "repair: %d blocks need work (fewest live chunks: %d)", len(work), len(work[0].live)
        )
        # Most endangered first: the limiter admits jobs in the order they were started.
        self.unplaced = 0
        try:
            await gather(
                [functools.partial(self._repair_one, w, nodes, bad) for w in work],
                self.m.settings.repair_concurrency,
            )
        finally:
            if self.unplaced:
                log.warning(
                    "repair: %d chunks have no node to be rebuilt on (every up chunk store "
                    "holds a chunk of their block already); add a chunk store in a new "
                    "failure domain",
                    self.unplaced,
                )

    async def _repair_one(
        self, health: BlockHealth, nodes: dict[str, NodeInfo], bad: set[tuple[int, int, str]]
    ) -> None:
        await self.repair_block(health, nodes, bad)

    async def repair_block(
        self, health: BlockHealth, nodes: dict[str, NodeInfo], bad: set[tuple[int, int, str]]
    ) -> int:
        """Rebuild the missing chunks of one block; returns how many were restored."""
        info = health.info
        policy = ECPolicy.parse(info.ec)
        placed = {c.index: c for c in info.chunks}
        if len(health.live) < policy.k:
            self.m.counters.lost_blocks += 1
            log.error(
                "block %016x has %d live chunks of the %d needed: cannot be repaired now",
                info.block_id,
                len(health.live),
                policy.k,
            )
            return 0
        got = await self._fetch(info, health.live, nodes, policy.k)
        if len(got) < policy.k:
            log.warning("block %016x: only %d chunks readable; later", info.block_id, len(got))
            return 0
        rebuilt = await trio.to_thread.run_sync(
            _rebuild, policy, got, info.chunk_len, health.missing
        )
        holders = {c.node_id for c in info.chunks}
        used_domains = {
            nodes[placed[i].node_id].failure_domain
            for i in health.live
            if placed[i].node_id in nodes
        }
        order = list(nodes.values())
        restored = 0
        for index in health.missing:
            old = placed.get(index)
            data, crc = rebuilt[index]
            if old is not None and old.checksum != crc:
                log.error(
                    "block %016x chunk %d rebuilds to crc %08x, Block layer says %08x: skipped",
                    info.block_id,
                    index,
                    crc,
                    old.checksum,
                )
                continue
            target = await self._place(
                info.block_id, index, data, crc, order, holders, used_domains
            )
            if target is None and old is not None:
                target = await self._put_back(info.block_id, index, data, crc, nodes, old.node_id)
            if target is None:
                self.unplaced += 1
                log.debug("block %016x chunk %d: no node to rebuild it on", info.block_id, index)
                continue
            try:
                await self.m.set_chunk(
                    info.block_id, index, old.node_id if old else "", target.node_id, crc
                )
            except TectonicError as e:
                # Moved or collected meanwhile: our copy is unreferenced.
                log.info("block %016x chunk %d: not recorded (%s)", info.block_id, index, e)
                await self.m.discard_copy(target, info.block_id, index)
                continue
            holders.add(target.node_id)
            used_domains.add(target.failure_domain)
            restored += 1
            self.m.counters.repaired_chunks += 1
            self.m.counters.repair_bytes += len(data)
            if old is not None and old.node_id != target.node_id:
                node = nodes.get(old.node_id)
                if node is not None and node.state == "up":
                    try:
                        # Refused while another version of the block still places that file.
                        await self.m.delete_chunk(node, old.storage_block(info.block_id), index)
                    except TectonicError as e:
                        log.info(
                            "old copy of %016x.%d stays for the GC: %s", info.block_id, index, e
                        )
        return restored

    async def _fetch(
        self, info: BlockInfo, live: list[int], nodes: dict[str, NodeInfo], k: int
    ) -> dict[int, bytes]:
        placed = {c.index: c for c in info.chunks}
        got: dict[int, bytes] = {}
        pending = list(live)  # data chunks first: zfec passes them through

        async def fetch(i: int) -> None:
            c = placed[i]
            try:
                stored = c.storage_block(info.block_id)  # an adopted chunk: its version's file
                got[i] = await self.m.get_chunk(nodes[c.node_id], stored, i, c.checksum)
            except (ChunkCorrupt, ChunkNotFound) as e:
                log.warning(
                    "block %016x chunk %d on %s unreadable: %s", info.block_id, i, c.node_id, e
                )
            except TectonicError as e:
                log.info("block %016x chunk %d on %s: %s", info.block_id, i, c.node_id, e)

        while len(got) < k and pending:
            batch, pending = pending[: k - len(got)], pending[k - len(got) :]
            async with trio.open_nursery() as nursery:
                for i in batch:
                    nursery.start_soon(fetch, i)
        return dict(sorted(got.items())[:k])

    async def _place(
        self,
        block_id: int,
        index: int,
        data: bytes,
        crc: int,
        nodes: list[NodeInfo],
        holders: set[str],
        used_domains: set[str],
    ) -> NodeInfo | None:
        tried = set(holders)
        for _ in range(len(nodes)):
            target = self.m.choose_target(nodes, tried, used_domains)
            if target is None:
                return None
            tried.add(target.node_id)
            try:
                await self.m.put_chunk(target, block_id, index, data, crc)
                return target
            except TectonicError as e:
                log.info(
                    "rebuilt chunk %016x.%d to %s failed: %s", block_id, index, target.node_id, e
                )
        return None

    async def _put_back(
        self,
        block_id: int,
        index: int,
        data: bytes,
        crc: int,
        nodes: dict[str, NodeInfo],
        node_id: str,
    ) -> NodeInfo | None:
        """The chunk's own node, if it is up and takes the rebuilt chunk (see the module
        docstring); None otherwise."""
        node = nodes.get(node_id)
        if node is None or node.state != "up":
            return None
        try:
            await self.m.put_chunk(node, block_id, index, data, crc)
        except TectonicError as e:
            log.debug("rebuilt chunk %016x.%d back to %s refused: %s", block_id, index, node_id, e)
            return None
        return node


def _rebuild(
    policy: ECPolicy, chunks: dict[int, bytes], chunk_len: int, wanted: list[int]
) -> dict[int, tuple[bytes, int]]:
    """The ``wanted`` chunks of a block, with their CRC-32Cs, from any k of its chunks.

    Worker thread (zfec and crc32c release the GIL). zfec's decode yields the data chunks;
    parity is encoded again only when a parity chunk is wanted."""
    k = policy.k
    out = memoryview(bytearray(k * chunk_len))
    decode_into(policy, chunks, chunk_len, out, in_place=frozenset())
    if any(i >= k for i in wanted):
        enc = encode_block(policy, out, chunk_len)
        return {i: (bytes(enc.chunks[i]), enc.checksums[i]) for i in wanted}
    pieces = {i: bytes(out[i * chunk_len : (i + 1) * chunk_len]) for i in wanted}
    return {i: (p, checksum(p)) for i, p in pieces.items()}


def _info(rec: dict[str, Any]) -> BlockInfo:
    return BlockInfo.from_wire(
        {
            "block_id": rec["block_id"],
            "ec": rec["ec"],
            "chunk_len": rec["chunk_len"],
            "data_len": rec["data_len"],
            "file_index": rec["file_index"],
            "chunks": [{"index": i, "node_id": n, "checksum": c} for i, n, c in rec["chunks"]],
        }
    )


async def repair_status(m: Maintenance) -> dict[str, Any]:
    """Where repair stands, from the metadata service and the chunk stores alone (so any
    process can ask, running services or not): blocks by live chunk count, lost blocks, down
    nodes, chunks scrub found bad, and the last fsck's summary (files whose blocks are gone,
    which no block scan can count)."""
    nodes = await m.nodes()
    bad = await Repairer(m).bad_chunks(nodes)
    by_live: dict[int, int] = {}
    total = degraded = lost = 0
    missing_chunks = 0
    for shard in range(m.config.shards):
        async for rec in m.scan_blocks(shard):
            if rec["state"] != "committed":
                continue
            h = assess(_info(rec), nodes, bad)
            policy = ECPolicy.parse(rec["ec"])
            total += 1
            by_live[len(h.live)] = by_live.get(len(h.live), 0) + 1
            if h.missing:
                degraded += 1
                missing_chunks += len(h.missing)
            if len(h.live) < policy.k:
                lost += 1
    return {
        "blocks": total,
        "full_redundancy": total - degraded,
        "degraded": degraded,
        "lost": lost,
        "chunks_to_rebuild": missing_chunks,
        "blocks_by_live_chunks": {str(k): v for k, v in sorted(by_live.items())},
        "nodes_down": sorted(n.node_id for n in nodes.values() if n.state != "up"),
        "nodes_up": sum(1 for n in nodes.values() if n.state == "up"),
        "bad_chunks": sorted(f"{b:016x}.{i}@{n}" for b, i, n in bad),
        # What the block scan cannot see (a file whose block record is gone): fsck's.
        "last_fsck": await fsck_summary.last(m.meta),
    }
