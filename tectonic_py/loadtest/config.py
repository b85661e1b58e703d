"""What a load test run is asked to do (``LoadtestConfig``), what one rank reports
(``RankResult``), and where a rank's shard of a step lives in the filesystem.

The config travels to every worker process as JSON (``dataclasses.asdict``), so it holds
only plain values; a worker rebuilds it with ``LoadtestConfig(**spec)``.
"""

from __future__ import annotations

import inspect
import math
import os
import random
import struct
from dataclasses import dataclass, field
from typing import Any

from tectonic_py.core import cluster_file
from tectonic_py.core.auth import check_job
from tectonic_py.core.cluster_file import ClusterConfig
from tectonic_py.core.errors import ConfigError
from tectonic_py.core.units import GiB, MiB

PIECE = MiB  # the unit of generated data and of each write call
POOL_SIZE = 8 * MiB
TAG = struct.Struct("!QIIQ")  # seed, step, rank, piece: 24 bytes
START_DELAY = 0.5  # seconds from "go" to the barrier time: enough for every worker to hear it
PROGRESS_INTERVAL = 0.2
SIZE_DISTS = ("fixed", "uniform", "loguniform")


@dataclass
class LoadtestConfig:
    cluster_file: str | None = None
    through_mount: str | None = None
    ranks: int = 64
    processes: int = 0  # 0: chosen from ranks
    size_dist: str = "fixed"  # fixed | uniform | loguniform
    shard_size: int = 16 * MiB
    min_size: int = 1_000_000
    max_size: int = 64 * MiB
    steps: int = 1
    keep_last: int = 0  # 0: keep all steps
    restore: bool = True
    seed: int = 1
    run_dir: str = ""
    max_seconds: float = 600.0
    keep: bool = False
    verify_only: bool = False  # read and verify step ``steps`` of an existing run (its .metadata)
    client_options: dict[str, Any] = field(default_factory=dict)  # open_client(**tuning)
    watch_pids: list[int] = field(default_factory=list)
    daemon_cpu: bool = True  # find the local cluster's daemons and count their CPU
    baseline_stream: bool = False  # also write the same bytes as one file (loadtest.baseline)
    reserve: bool = False  # reserve each step's bytes in its directory before its burst
    job: str = ""  # --job: the traffic class of the run's chunk traffic (chunkstore/traffic.py)
    job_weight: int = 0  # --weight: its weight where the chunk stores set none

    def cluster(self) -> ClusterConfig:
        """The cluster file, speaking as ``job`` when one is given."""
        assert self.cluster_file is not None
        config = cluster_file.load(self.cluster_file)
        return config.with_job(self.job, self.job_weight) if self.job else config

    def validate(self) -> None:
        """ConfigError (one line naming the flag) for anything a run cannot do."""
        self._validate_target()
        checks = [
            (1 <= self.ranks <= 65536, "--ranks must be 1..65536"),
            (0 <= self.processes <= 256, "--processes must be 0 (auto) .. 256"),
            (self.size_dist in SIZE_DISTS, "--size-dist must be fixed, uniform or loguniform"),
            (1 <= self.shard_size <= 64 * GiB, "--shard-size must be 1 byte .. 64 GiB"),
            (
                1 <= self.min_size <= self.max_size <= 64 * GiB,
                "need 1 <= --min-size <= --max-size <= 64 GiB",
            ),
            (1 <= self.steps <= 10000, "--steps must be 1..10000"),
            (self.keep_last >= 0, "--keep-last must be >= 0"),
            (0 < self.max_seconds <= 86400, "--max-seconds must be in (0, 86400]"),
            (0 <= self.seed < 2**63, "--seed must be 0 .. 2**63-1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        self._validate_client_options()
        if self.job_weight and not self.job:
            raise ConfigError("--weight needs --job")
        if self.job and self.through_mount:
            raise ConfigError(
                "--job is for the client library; a mount's job is its cluster file's"
            )
        check_job(self.job, self.job_weight)
        if not self.run_dir.startswith("/") or "//" in self.run_dir or ".." in self.run_dir:
            raise ConfigError("the run directory must be an absolute path without '..'")

    def _validate_target(self) -> None:
        if (self.cluster_file is None) == (self.through_mount is None):
            raise ConfigError("give a CLUSTER_FILE or --through-mount MOUNTPOINT (one of them)")
        if self.baseline_stream and self.through_mount is not None:
            raise ConfigError("--baseline-stream writes through the client library, not a mount")
        if self.through_mount is not None and not os.path.isdir(self.through_mount):
            raise ConfigError(f"--through-mount {self.through_mount!r} is not a directory")
        if self.cluster_file is not None and not os.path.exists(self.cluster_file):
            raise ConfigError(f"cluster file {self.cluster_file!r} not found")

    def _validate_client_options(self) -> None:
        """Tuning keywords are checked against open_client's here, before any worker starts,
        so a typo is one line rather than a traceback from every worker."""
        if not self.client_options:
            return
        if self.through_mount:
            raise ConfigError("--client-opt applies to the client library, not a mount")
        from tectonic_py.client.tectonic_client import TectonicClient

        params = inspect.signature(TectonicClient.__init__).parameters
        known = set(params) - {"self", "config", "meta", "nursery"}
        unknown = set(self.client_options) - known
        if unknown:
            raise ConfigError(
                f"unknown --client-opt {sorted(unknown)}; known: {', '.join(sorted(known))}"
            )

    def worker_count(self) -> int:
        """Worker processes: one per 64 ranks up to 8 for the client library (one client
        each), up to 16 through a mount (one thread per rank, so processes matter less)."""
        if self.processes:
            return min(self.processes, self.ranks)
        if self.through_mount:
            return min(self.ranks, 16)
        return max(1, min(self.ranks // 64, 8)) if self.ranks >= 64 else 1


@dataclass
class RankResult:
    rank: int
    step: int
    phase: str  # write | read
    size: int
    t_open: float  # seconds after the burst start when create/open returned
    t_done: float  # ... when close (write) or the last read (read) returned
    crc: int
    error: str | None = None
    verified: int = 0
    # Seconds inside the create/open call itself (write: open(O_CREAT|O_TRUNC) through a
    # mount, the client's create otherwise); None when it did not return (it failed).
    open_s: float | None = None
    # Seconds the rank spent on its file: from its start after the barrier (just before its
    # create/open call) to its close or failure; the share of its time inside open() is
    # open_s over this.
    busy_s: float = 0.0


def shard_size(cfg: LoadtestConfig, rank: int) -> int:
    """A rank's shard size: fixed, or drawn once per rank (the same every step, as a model's
    shards are) from ``size_dist`` between ``min_size`` and ``max_size``."""
    if cfg.size_dist == "fixed":
        return cfg.shard_size
    rng = random.Random(f"{cfg.seed}/{rank}")
    lo, hi = cfg.min_size, max(cfg.min_size, cfg.max_size)
    if cfg.size_dist == "uniform":
        return rng.randint(lo, hi)
    return int(math.exp(rng.uniform(math.log(lo), math.log(hi))))  # loguniform


def step_dir(cfg: LoadtestConfig, step: int) -> str:
    return f"{cfg.run_dir}/step_{step:06d}"


def rank_file(cfg: LoadtestConfig, step: int, rank: int) -> str:
    return f"{step_dir(cfg, step)}/__{rank}_0.distcp"
