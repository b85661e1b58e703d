"""The unreachable-record sweep: File records that no name reaches, deleted after a grace.

Most operations that change names and records in two shards leave, when the process dies
between the two, a record no name reaches (metadata/NOTES.md): an unlink whose record lives
in another shard than its directory (the name gone, the record's link not yet dropped), a
rename that replaced a file of another shard (the victim's name overwritten, its release not
yet made), a checkpoint commit's old ``latest`` link. Each was meant to go; this sweep
finishes the job. Unnamed records of creates that died before their name are the orphan GC's
(``collect_orphans``, by their name hint), and are swept here too once no name reaches them.

A record is swept only when all of these hold:

* two full walks of the namespace from the root (``Fsck.reachable``: names only), at least
  ``unreachable_grace`` apart, both missed it; a walk that fails anywhere counts for nothing
  (a shard that did not answer hides its subtree). Two walks because a subtree moved by a
  rename while one walk ran can be missed by that walk, never by both unless renames race
  it again and again;
* it is older than the grace, and its ``ctime`` did not change between the sightings;
* its name hint does not resolve to it (some entry, perhaps in a directory that is itself
  unreachable, still names it: left for ``tectonic fsck --repair``, which names such
  records in ``/lost+found``);
* it is not the child of a pending cross-shard rename intent;
* in the delete's own transaction (``file.collect_unreachable``): unchanged since the walk
  (``ctime_ns``), no live writer lease (an open handle of a writer; readers hold no lease,
  as for unlink), and not a directory with entries.

Records swept are counted (``counters.unreachable_collected``); ``pending`` is how many wait
for their second sighting. ``tectonic fsck`` counts the unreachable records a pass finds,
which ``tectonic status`` shows with the last fsck's summary.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from tectonic_py.core.errors import FileNotFound, NotADirectory
from tectonic_py.core.ids import ROOT_ID
from tectonic_py.maintenance.fsck import Fsck
from tectonic_py.maintenance.runtime import Maintenance

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sighting:
    first: float  # monotonic time of the first walk that missed it
    ctime_ns: int


class UnreachableSweep:
    """``round`` is one walk and the deletes it allows."""

    def __init__(self, m: Maintenance) -> None:
        self.m = m
        self._seen: dict[int, Sighting] = {}
        self.pending = 0

    async def round(self) -> int:
        grace = self.m.settings.unreachable_grace
        fsck = Fsck(self.m)
        reached = await fsck.reachable()
        renaming = await fsck.renaming()
        now, young = time.monotonic(), time.time_ns() - int(grace * 1e9)
        seen: dict[int, Sighting] = {}
        swept = 0
        meta = self.m.meta
        for shard in range(self.m.config.shards):
            async for rec in meta.scan_files(shard):
                fid, ctime = int(rec["id"]), int(rec["ctime_ns"])
                if fid in reached or fid == ROOT_ID or fid in renaming:
                    continue
                if rec["created_ns"] >= young or (
                    rec["writer"] and rec["lease_ns"] > time.time_ns()
                ):
                    continue
                if await self._named(rec):
                    continue
                before = self._seen.get(fid)
                if before is None or before.ctime_ns != ctime:
                    seen[fid] = Sighting(now, ctime)
                    continue
                if now - before.first < grace:
                    seen[fid] = before
                    continue
                if await meta.collect_unreachable(fid, ctime):
                    swept += 1
                    log.warning(
                        "swept %s record %d that no name reached for %.0fs (was %r in %d,"
                        " %d bytes)",
                        rec["kind"],
                        fid,
                        now - before.first,
                        rec["name"],
                        rec["parent"],
                        rec["size"],
                    )
        self._seen = seen
        self.pending = len(seen)
        self.m.counters.unreachable_collected += swept
        return swept

    async def _named(self, rec: dict[str, object]) -> bool:
        """Whether the record's name hint still names it (an entry the walk did not reach)."""
        name, parent = rec.get("name"), rec.get("parent")
        if not isinstance(name, str) or not name or not isinstance(parent, int):
            return False
        try:
            found = await self.m.meta.lookup(parent, name)
        except (FileNotFound, NotADirectory):
            return False
        return bool(found.id == rec["id"])
