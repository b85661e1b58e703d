"""Pack compaction: give back the space of packs whose files were mostly deleted.

A pack (a block shared by small files and tails: docs/decisions/2026-12-04-packs.md) lives
while any of its extents does. The files of one checkpoint step share packs, so deleting a
step frees its packs whole; but files deleted one by one (a job's logs, per-step metadata
files kept longer than the step) leave packs that hold one live extent and all their dead
bytes. Every ``sweep_interval``, for each shard, packs older than ``grace`` whose live extents
hold at most ``compact_below`` of their bytes (``block.pack_usage``) are rewritten:

1. the old pack is read whole (degraded if it must be), within the bandwidth budget;
2. its live extents, packed tightly, are coded and stored as a new pack, allocated by this
   daemon (``block.allocate pack=true`` needs no writer token from the maintenance role);
3. ``file.relocate_extents`` commits the new pack and moves every extent whose file still
   names the old pack there, in one transaction of the shard (metadata/compaction_ops.py).
   A file changed meanwhile keeps its new data; the old pack goes to the GC queue once no
   entry names it, so it is deleted after the GC's grace like any superseded block.

A crash anywhere leaves either the old entries (and an uncommitted or unheld new pack, which
the block sweep or the GC collects) or the moved ones: never an entry pointing at a pack that
was not committed, and nothing freed that an entry still names.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tectonic_py.client.block_io import BlockWrite
from tectonic_py.client.stripe import chunk_len_for
from tectonic_py.client.tectonic_client import TectonicClient
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import TectonicError
from tectonic_py.maintenance.runtime import Maintenance

log = logging.getLogger(__name__)

SCAN_LIMIT = 1000  # packs looked at per pack_usage call


class Compactor:
    """The compaction service; ``round`` walks every shard once."""

    def __init__(self, m: Maintenance, client: TectonicClient) -> None:
        self.m = m
        self.client = client

    async def round(self) -> int:
        """Compact every qualifying pack; the number compacted."""
        older = time.time_ns() - int(self.m.settings.grace * 1e9)
        done = 0
        for shard in range(self.m.config.shards):
            after = 0
            while True:
                packs, after = await self.m.meta.pack_usage(
                    shard,
                    older_than_ns=older,
                    max_live=self.m.settings.compact_below,
                    after=after,
                    limit=SCAN_LIMIT,
                )
                for pack in packs:
                    try:
                        done += await self.compact(pack)
                    except TectonicError as e:
                        log.warning("compaction of pack %016x failed: %s", pack["block_id"], e)
                if not after:
                    break
        return done

    async def compact(self, pack: dict[str, Any]) -> int:
        """Rewrite one pack's live extents into a new pack; 1 if any extent moved."""
        old_id = int(pack["block_id"])
        (info,) = await self.m.meta.locate_blocks([old_id])
        extents = [tuple(int(x) for x in e) for e in pack["extents"]]
        live = sum(e[3] for e in extents)
        await self.m.bucket.take(info.data_len)
        data = await self.client.blocks.read_block(info)
        policy = ECPolicy.parse(info.ec)
        buf = bytearray(policy.k * max(1, chunk_len_for(live, policy.k)))
        moves = []
        at = 0
        for file_id, index, offset, length in extents:
            buf[at : at + length] = data[offset : offset + length]
            moves.append((file_id, index, offset, length, at))
            at += length
        await self.m.bucket.take(live * policy.n // policy.k)
        new = await self.client.blocks.store_block(
            BlockWrite(
                file_id=extents[0][0],  # routes the allocation to the pack's shard
                token=0,
                policy=policy,
                file_index=0,
                block=memoryview(buf),
                data_len=live,
                pack=True,
            )
        )
        moved = await self.m.meta.relocate_extents(new, old_id, moves)
        self.client.cache.discard(old_id)
        counters = self.m.counters
        counters.packs_compacted += 1 if moved else 0
        counters.compacted_bytes_freed += info.data_len - live if moved else 0
        log.info(
            "compacted pack %016x (%d of %d bytes live) into %016x: %d of %d extents moved",
            old_id,
            live,
            info.data_len,
            new.block_id,
            moved,
            len(moves),
        )
        return 1 if moved else 0
