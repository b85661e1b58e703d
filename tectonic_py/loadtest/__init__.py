"""``tectonic loadtest``: a training job's checkpoint burst, measured as the GPUs feel it.

Llama 3's checkpoints were "highly bursty": every rank saves its shard at the same moment,
the storage is saturated for a short time, and the GPUs idle until the *last* rank's close
returns. So the figure that matters is the **GPU pause** (burst start to the last close),
next to aggregate write/read GB/s, the per-rank completion times (p50/p90/p99/max),
metadata operations per second, errors (must be zero) and bytes verified on restore.

The rooms:

* ``config``: what a run is asked to do, what a rank reports, where a shard lives. Each
  step is a directory laid out as torch.distributed.checkpoint writes it:
  ``step_000001/__<rank>_0.distcp`` per rank plus ``.metadata``.
* ``data``: a rank's bytes, a deterministic function of (seed, step, rank), so the restore
  checks every byte against a checksum the writer kept.
* ``backends``: the client library (one client per worker process) or real file I/O on a
  mount (``--through-mount``: blocking calls in ``trio.to_thread``, one thread per rank, an
  fsync before each close as torch.distributed.checkpoint does).
* ``worker``: a worker process, many trio tasks, one per rank.
* ``coordinator``: the workers, the barrier before each burst, the steps, the restore, the
  time bound and the cleanup.
* ``daemons``: the local cluster's metadata servers and chunk stores, found from the cluster
  file, the node registry and their listening ports, so their CPU is counted too.
* ``metrics``: the figures (a new one is one line there; ``docs/loadtest.md`` defines
  them, ``cpu_ms_per_file`` and the creates with their open() times among them);
  ``report``: progress bar, summary table, creates table and the optional plot. The
  command itself is ``tectonic_py.cli.loadtest``.
"""

from __future__ import annotations

from tectonic_py.core.units import GiB, MiB
from tectonic_py.loadtest.config import PIECE, TAG, LoadtestConfig, RankResult
from tectonic_py.loadtest.coordinator import run_loadtest
from tectonic_py.loadtest.data import ShardData
from tectonic_py.loadtest.metrics import CpuMeter

__all__ = [
    "PIECE",
    "TAG",
    "CpuMeter",
    "GiB",
    "LoadtestConfig",
    "MiB",
    "RankResult",
    "ShardData",
    "run_loadtest",
]
