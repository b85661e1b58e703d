"""The metadata client's calls for the background services (GC, repair, rebalance, lease
recovery, the inventory): the ops of metadata/maintenance_ops.py, typed.

Only the ``tectonic maintenance`` process (tectonic_py/maintenance/) calls them; the data path
never does. Each is one call in one shard (its key's, or the one named), and the server
re-checks the state it acts on in that call's transaction, so a caller acting on a stale view
is refused rather than doing harm.
"""

from __future__ import annotations

import time

from metadata.routing import Router
from tectonic_py.core.errors import FileNotFound, NotADirectory


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
