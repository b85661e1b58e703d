"""The background services of a cluster: repair, scrub coordination, inventory, GC, lease
recovery, rebalance.

They run in ``tectonic maintenance CLUSTER_FILE`` processes (``run_services``: one trio
nursery, one task per service, each a loop of rounds), not inside metadata servers: a
service round spans every shard and every chunk store, and a process of its own can be
killed, restarted, or moved without touching the metadata servers.

Restartable at any point: the services keep no state of their own but
what they store in the metadata service, and every step is idempotent and ordered so that a
crash between two steps leaves at worst an extra chunk, never a missing one:

* repair and rebalance: write the new copy first, then point the Block layer at it
  (``block.set_chunk``, refused if the chunk moved meanwhile), then delete the old copy.
  A crash after the put leaves an unreferenced copy that the chunk sweep of the GC removes
  after the grace period; a block never has fewer live chunks than before the step.
* GC: a chunk is deleted only if the Block layer says no block needs it on that node and
  its file is older than the grace period; a block record is forgotten only if it is
  unreferenced (or an allocation older than the grace period) on two sweeps a grace period
  apart, and the forget re-checks its state in the same transaction.

The only in-memory state (GC suspects, counters) is lost on a restart, which delays work and
harms nothing. Several maintenance processes may run at once; they waste work, never data.

Modules: ``repair`` (failure detection via the registry, scrub reports, the repair queue),
``inventory`` (what the Block layer places on each store against what the store holds),
``gc`` (lease recovery, orphans, the GC queue, block and chunk sweeps), ``rebalance``;
``runtime`` holds the shared plumbing (``Maintenance``: metadata client, chunk connections,
the repair bandwidth ``TokenBucket``, node choice); ``services`` runs them all.
"""

from __future__ import annotations

from tectonic_py.maintenance.runtime import Maintenance, MaintenanceSettings, TokenBucket
from tectonic_py.maintenance.services import run_services

__all__ = ["Maintenance", "MaintenanceSettings", "TokenBucket", "run_services"]
