"""What a load test measures, and the figures made from it.

``phase_figures`` turns one phase's rank results into that phase's figures; ``Recorder``
collects the phases, errors and metadata timings of the whole run and ``Recorder.result``
makes the run's figures (the ``--json`` object). A new figure is one entry in either dict:
the per-rank raw data (``RankResult``) and the workers' ``done`` messages are all here.

CPU-seconds are counted for all processes together, by role: the workers (their own
rusage), the coordinator, the local cluster's metadata servers and chunk stores (found by
``loadtest.daemons``) and any other watched PIDs (``--watch-pids``: a mount, a peer
filesystem's daemons), per GiB written and read. Peak RSS of workers and watched processes
shows memory stays bounded.

``chunk_puts_per_file``: the chunk puts the workers' clients sent (stored chunks and
hedges) over the files written; None through a mount, whose client is the mount's.

The cost of a file (``cpu_ms_per_file``) is what the burst cost beyond its bytes: the CPU of
all processes during the write bursts, less what the same number of bytes costs when written
as one stream (``baseline``: CPU-s per byte of one file of the same total size, measured in
the same run), divided by the files closed. Without ``--baseline-stream`` only the gross
figure (all CPU over files) is known.

Creates (``create_figures``): every rank times its create call alone (``RankResult.open_s``:
``open(O_CREAT|O_TRUNC)`` through a mount, the client's ``create`` otherwise) and its whole
file (``busy_s``). A write burst reports the files created (ranks whose create returned),
``creates_per_s`` (those files over the burst's wall time, barrier to last close), the create
call's p50/p99/max in ms (``open_ms``) and ``open_share``: the ranks' seconds inside the
create call over their seconds on their files, summed over the ranks. The run's figures pool
every write burst's ranks (and sum the bursts' wall times).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any

from tectonic_py.core.units import GiB
from tectonic_py.loadtest.config import LoadtestConfig, RankResult, shard_size


class CpuMeter:
    """CPU-seconds and peak RSS of a set of processes (psutil), sampled over time; processes
    that vanish keep their last reading, so a daemon that dies is not subtracted."""

    def __init__(self, pids: Iterable[int]) -> None:
        import psutil

        self.procs: dict[int, Any] = {}
        self.last: dict[int, float] = {}
        self.peak_rss: dict[int, int] = {}
        for pid in pids:
            try:
                self.procs[pid] = psutil.Process(pid)
            except psutil.Error:
                continue
        self.sample()
        self.first = dict(self.last)

    def used(self) -> float:
        """CPU-s the set spent since this meter was made."""
        return self.sample() - sum(self.first.values())

    def sample(self) -> float:
        """Total CPU-s of the set now (latest readings)."""
        import psutil

        for pid, p in self.procs.items():
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    self.last[pid] = t.user + t.system
                    rss = p.memory_info().rss
                self.peak_rss[pid] = max(self.peak_rss.get(pid, 0), rss)
            except psutil.Error:
                pass
        return sum(self.last.values())

    def max_rss(self) -> int:
        return max(self.peak_rss.values(), default=0)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def gbps(phases: list[dict[str, Any]]) -> float:
    """Aggregate GB/s over bursts: bytes moved over the sum of their pauses."""
    seconds = sum(p["seconds"] for p in phases)
    return sum(p["bytes"] for p in phases) / seconds / 1e9 if seconds > 0 else 0.0


CPU_ROLES = ("workers", "metadata", "chunkstore", "watched", "coordinator")


def phase_figures(
    phase: str,
    step: int,
    t0: float,
    results: list[RankResult],
    done: list[dict[str, Any]],
    cpu: dict[str, float],
) -> dict[str, Any]:
    """One burst's figures from its ranks' results, its workers' ``done`` messages and the
    CPU-s the other processes spent meanwhile (``cpu``: by role, see ``CPU_ROLES``)."""
    by_role = {role: float(cpu.get(role, 0.0)) for role in CPU_ROLES}
    by_role["workers"] = sum(float(m["cpu_s"]) for m in done)
    times = [r.t_done for r in results]
    opens = [r.t_open for r in results if not r.error]
    moved = sum(r.size for r in results if not r.error)
    pause = max(times, default=0.0)
    creates = create_figures(results, pause)
    if phase != "write":  # a read opens what exists: its open times, no creates
        del creates["files_created"], creates["creates_per_s"]
    return {
        "phase": phase,
        "step": step,
        "t0": t0,
        "ranks": len(results),
        "bytes": moved,
        "seconds": pause,
        "gbps": moved / pause / 1e9 if pause > 0 else 0.0,
        "p50": percentile(times, 0.5),
        "p90": percentile(times, 0.9),
        "p99": percentile(times, 0.99),
        "max": pause,
        "opened_at_p50_s": percentile(opens, 0.5),
        "opened_at_max_s": max(opens, default=0.0),
        **creates,
        "worker_cpu_s": by_role["workers"],
        "watched_cpu_s": by_role["metadata"] + by_role["chunkstore"] + by_role["watched"],
        "cpu_s": sum(by_role.values()),
        "cpu_s_by_role": by_role,
        "files": sum(1 for r in results if not r.error),
        "errors": sum(1 for r in results if r.error),
        "verified": sum(r.verified for r in results),
        "client_batches": _client_batches(done),
        "chunk_puts": (
            sum(int(m["chunk_puts"]) for m in done)
            if done and all(m.get("chunk_puts") is not None for m in done)
            else None
        ),
    }


def create_figures(results: list[RankResult], seconds: float) -> dict[str, Any]:
    """The files ``results`` created and the time their ranks spent inside the create call
    (module docstring); ``seconds`` is the wall time they are counted over. ``open_ms`` and
    ``open_share`` are None when no create returned, ``creates_per_s`` when no time passed."""
    open_s = [r.open_s for r in results if r.open_s is not None]
    busy = sum(r.busy_s for r in results if r.open_s is not None)
    ms = [1000 * t for t in open_s]
    return {
        "files_created": len(open_s),
        "creates_per_s": len(open_s) / seconds if seconds > 0 else None,
        "open_ms": (
            {"p50": percentile(ms, 0.5), "p99": percentile(ms, 0.99), "max": max(ms)}
            if ms
            else None
        ),
        "open_share": sum(open_s) / busy if open_s and busy > 0 else None,
    }


def _client_batches(done: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The workers' metadata calls that left coalesced: batch requests, the calls they
    carried, and the mean (None through a mount: its client is not a worker's)."""
    counted = [m["meta_batches"] for m in done if m.get("meta_batches")]
    if not counted:
        return None
    batches = sum(int(c.get("batches", 0)) for c in counted)
    ops = sum(int(c.get("ops", 0)) for c in counted)
    return {"batches": batches, "ops": ops, "mean": ops / batches if batches else None}


class Recorder:
    """Everything one run measured, in the order it happened."""

    def __init__(self, cfg: LoadtestConfig) -> None:
        self.cfg = cfg
        self.run_t0 = time.time()
        self.own_cpu0 = time.process_time()
        self.timeline: list[tuple[float, str, int]] = []  # (wall time, phase, cumulative bytes)
        self.phases: list[dict[str, Any]] = []
        self.rank_results: list[RankResult] = []
        self.errors: list[str] = []
        self.meta_ops = 0
        self.meta_seconds = 0.0
        self.deleted_steps: list[int] = []
        self.delete_seconds = 0.0
        self.timed_out = False
        self.baseline: dict[str, Any] | None = None  # the one-stream write (``--baseline-stream``)
        self.shard_stats: list[dict[str, Any]] = []  # each write burst's group-commit deltas
        self.daemons: dict[str, Any] | None = None  # what ``loadtest.daemons`` found
        self.store_conns: dict[str, int] = {}  # most connections one worker had to each store

    def add_phase(self, figures: dict[str, Any], results: list[RankResult]) -> None:
        self.phases.append(figures)
        self.rank_results.extend(results)
        for r in results:
            if r.error:
                self.errors.append(f"step {r.step} rank {r.rank} {r.phase}: {r.error}")

    def _per_file(self, writes: list[dict[str, Any]]) -> dict[str, Any]:
        return _per_file_figures(writes, self.baseline)

    def written(self, step: int) -> dict[str, dict[str, int]]:
        """The step's index entries: size and crc32c of every rank written without error."""
        return {
            str(r.rank): {"size": r.size, "crc32c": r.crc}
            for r in self.rank_results
            if r.step == step and r.phase == "write" and not r.error
        }

    def result(self, processes: int, worker_max_rss: int, watched_max_rss: int) -> dict[str, Any]:
        """The run's figures: the ``--json`` object."""
        cfg = self.cfg
        writes = [p for p in self.phases if p["phase"] == "write"]
        reads = [p for p in self.phases if p["phase"] == "read"]
        written = sum(p["bytes"] for p in writes)
        read = sum(p["bytes"] for p in reads)
        write_times = [r.t_done for r in self.rank_results if r.phase == "write"]
        creates = sum(p["ranks"] for p in writes)
        create_seconds = sum(p["opened_at_max_s"] for p in writes)
        write_results = [r for r in self.rank_results if r.phase == "write"]
        created = create_figures(write_results, sum(p["seconds"] for p in writes))
        write_cpu = sum(p["cpu_s"] for p in writes)
        read_cpu = sum(p["cpu_s"] for p in reads)
        return {
            "mode": "mount" if cfg.through_mount else "client",
            "target": cfg.through_mount or cfg.cluster_file,
            "ranks": cfg.ranks,
            "processes": processes,
            "steps": cfg.steps,
            "size_dist": cfg.size_dist,
            "shard_bytes_per_step": sum(shard_size(cfg, r) for r in range(cfg.ranks)),
            "errors": len(self.errors),
            "error_samples": self.errors[:10],
            "timed_out": self.timed_out,
            "bytes_written": written,
            "bytes_read": read,
            "bytes_verified": sum(p["verified"] for p in reads),
            "write_gbps": gbps(writes),
            "read_gbps": gbps(reads),
            "pause_s": max((p["seconds"] for p in writes), default=0.0),
            "pause_s_per_step": [round(p["seconds"], 4) for p in writes],
            "restore_s": max((p["seconds"] for p in reads), default=0.0),
            "rank_write_p50_s": percentile(write_times, 0.5),
            "rank_write_p90_s": percentile(write_times, 0.9),
            "rank_write_p99_s": percentile(write_times, 0.99),
            "rank_write_max_s": max(write_times, default=0.0),
            "metadata_ops": self.meta_ops + creates + sum(p["ranks"] for p in reads),
            **created,
            "create_call": "open(O_CREAT|O_TRUNC)" if cfg.through_mount else "client.create",
            # what creates_per_s meant before it was files over wall time: ranks over the
            # time until the last create returned, summed over the bursts (bench's
            # 3,000 creates/s target is this figure)
            "creates_per_s_until_last_open": (
                creates / create_seconds if create_seconds > 0 else 0.0
            ),
            "deleted_steps": self.deleted_steps,
            "delete_seconds": round(self.delete_seconds, 4),
            "cpu_s_write": write_cpu,
            "cpu_s_read": read_cpu,
            "cpu_s_per_gib_write": write_cpu / (written / GiB) if written else None,
            "cpu_s_per_gib_read": read_cpu / (read / GiB) if read else None,
            "cpu_s_by_role_write": _sum_roles(writes),
            **self._per_file(writes),
            "metadata_batches": _batch_totals(self.shard_stats),
            "client_batches_write": _client_batch_totals(writes),
            "daemons": self.daemons,
            "max_conns_per_store": max(self.store_conns.values(), default=None),
            "coordinator_cpu_s": time.process_time() - self.own_cpu0,
            "worker_max_rss": worker_max_rss,
            "watched_max_rss": watched_max_rss,
            "wall_s": time.time() - self.run_t0,
            "phases": self.phases,
            "timeline": [(round(t - self.run_t0, 4), ph, b) for t, ph, b in self.timeline],
            "rank_times": {
                "write": sorted(write_times),
                "read": sorted(r.t_done for r in self.rank_results if r.phase == "read"),
            },
        }


def _client_batch_totals(phases: list[dict[str, Any]]) -> dict[str, Any] | None:
    counted = [p["client_batches"] for p in phases if p.get("client_batches")]
    if not counted:
        return None
    batches = sum(c["batches"] for c in counted)
    ops = sum(c["ops"] for c in counted)
    return {"batches": batches, "ops": ops, "mean": ops / batches if batches else None}


def _sum_roles(phases: list[dict[str, Any]]) -> dict[str, float]:
    return {role: sum(p["cpu_s_by_role"][role] for p in phases) for role in CPU_ROLES}


def _per_file_figures(
    writes: list[dict[str, Any]], baseline: dict[str, Any] | None
) -> dict[str, Any]:
    """The cost of a file beyond its bytes (module docstring), and the pause beside the
    time the same bytes take as one stream."""
    files = sum(p["files"] for p in writes)
    cpu = sum(p["cpu_s"] for p in writes)
    moved = sum(p["bytes"] for p in writes)
    counted = writes and all(p.get("chunk_puts") is not None for p in writes)
    puts = sum(p["chunk_puts"] for p in writes) if counted else None
    out: dict[str, Any] = {
        "files_written": files,
        "chunk_puts_per_file": puts / files if puts is not None and files else None,
        "cpu_ms_per_file_gross": 1000 * cpu / files if files else None,
        "cpu_ms_per_file": None,
        "baseline_stream": baseline,
        "pause_over_stream": None,
    }
    if baseline and files and baseline.get("bytes"):
        per_byte = baseline["cpu_s"] / baseline["bytes"]
        out["cpu_ms_per_file"] = 1000 * (cpu - per_byte * moved) / files
        pause = max((p["seconds"] for p in writes), default=0.0)
        if baseline.get("seconds"):
            out["pause_over_stream"] = pause / baseline["seconds"]
    return out


def shard_totals(stats: dict[str, dict[str, Any]]) -> dict[str, int]:
    """Every metadata server's ``server.stats`` summed over its shards: group commits
    (batches), the mutations they held and the largest batch any shard committed."""
    shards = [sh for server in stats.values() for sh in server.get("shards", {}).values()]
    return {
        "batches": sum(int(sh.get("batches", 0)) for sh in shards),
        "mutations": sum(int(sh.get("mutations", 0)) for sh in shards),
        "largest_batch": max((int(sh.get("largest_batch", 0)) for sh in shards), default=0),
    }


def shard_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, Any]:
    """What one burst added to the shards' group-commit counters. ``largest_batch`` is the
    servers' running maximum (since they started): it says a burst's batch was at most that
    large, and exactly that when it grew during the burst."""
    batches = after["batches"] - before["batches"]
    mutations = after["mutations"] - before["mutations"]
    return {
        "batches": batches,
        "mutations": mutations,
        "mean_batch": mutations / batches if batches else None,
        "largest_batch": after["largest_batch"],
        "largest_batch_grew": after["largest_batch"] > before["largest_batch"],
        "before": before,
        "after": after,
    }


def _batch_totals(deltas: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The write bursts' group-commit deltas together (None: no ``server.stats``)."""
    if not deltas:
        return None
    batches = sum(d["batches"] for d in deltas)
    mutations = sum(d["mutations"] for d in deltas)
    return {
        "batches": batches,
        "mutations": mutations,
        "mean_batch": mutations / batches if batches else None,
        "largest_batch": max(d["largest_batch"] for d in deltas),
        "per_step": deltas,
    }
