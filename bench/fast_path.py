"""fast_path: does a chunk store mechanism pay for itself end to end?

For each configuration of the chunk stores (``--config NAME=FLAGS``: ``tectonic chunkstore``
flags, and ``ENV=VALUE`` words for the daemons' environment) a fresh LocalCluster (2 metadata servers, 9 chunk
stores, RS(6,3)) is started and three user-visible workloads run against it:

* ``torch_save``: torch.save (+ fsync) of a state dict of ``--size`` bytes through a real
  ``tectonic mount`` (bench.mount_workloads.torch_workload);
* ``torch_load``: a cold, verified torch.load of it through the same mount;
* ``loadtest``: ``tectonic loadtest CLUSTER --ranks 1024 --shard-size 1MiB`` (client
  library workers), write then restore.

The figure is CPU-seconds per GiB moved summed over *all* processes: the workload's own,
the mount's, and every daemon's with any children it starts, plus
wall time. Configurations run interleaved (A B C ... A B C ...) for ``--rounds`` rounds,
since the machine is shared and noisy, and each measurement holds ``/tmp/bench.lock``. The
summary gives the medians and, for each configuration, its CPU-s per GiB over the first
one's. docs/decisions/2026-12-01-chunkstore-fast-path.md has the runs that decided which
of the chunk store's mechanisms stayed.

``python -m bench.fast_path [--rounds N] [--size MiB] [--config NAME=FLAGS ...] [--out F]``,
e.g. ``--config default= --config small-reads="--max-concurrent-reads 4"``.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.bench_fuse import tectonic_mounted
from bench.mount_workloads import torch_workload
from tectonic_py.launch.local_cluster import LocalCluster

REPO_ROOT = Path(__file__).resolve().parent.parent
MiB = 1024 * 1024
GiB = 1024 * MiB
LOCK = "/tmp/bench.lock"

WORKLOADS = ("torch_save", "torch_load", "loadtest_write", "loadtest_read", "loadtest")
# name -> (chunk store flags, environment of the daemons)
Config = tuple[list[str], dict[str, str]]


def parse_config(text: str) -> tuple[str, Config]:
    """``NAME=FLAGS``: FLAGS split like a shell line; words ``K=V`` go to the environment."""
    name, _, rest = text.partition("=")
    flags: list[str] = []
    env: dict[str, str] = {}
    for word in shlex.split(rest):
        if "=" in word and not word.startswith("-"):
            k, _, v = word.partition("=")
            env[k] = v
        else:
            flags.append(word)
    return name, (flags, env)


@contextmanager
def bench_lock() -> Iterator[None]:
    """Other benchmarks on this machine take the same lock, so measurements do not overlap."""
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def with_children(pids: list[int]) -> list[int]:
    """``pids`` and every live descendant (a helper process a daemon starts)."""
    import psutil

    out: list[int] = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            out += [pid, *(c.pid for c in p.children(recursive=True))]
        except psutil.NoSuchProcess:
            continue
    return out


def _loadtest(cluster_file: Path, pids: list[int], workdir: Path) -> dict[str, dict[str, Any]]:
    argv = [
        sys.executable,
        "-m",
        "tectonic_py.cli.main",
        "loadtest",
        str(cluster_file),
        "--ranks",
        "1024",
        "--shard-size",
        "1MiB",
        "--watch-pids",
        ",".join(map(str, pids)),
        "--results-dir",
        str(workdir / "loadtest-results"),
        "--no-plot",
        "--no-progress",
        "--json",
    ]
    out = subprocess.run(
        argv, check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900
    )
    if out.returncode != 0:
        raise RuntimeError(f"loadtest failed ({out.returncode}): {out.stderr[-1500:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    wrote, read = r["bytes_written"], r["bytes_read"]
    w_s, r_s = r["pause_s"], r["restore_s"]

    def fig(cpu: float, nbytes: int, seconds: float) -> dict[str, Any]:
        return {"cpu_s_per_gib": cpu / (nbytes / GiB), "seconds": seconds, "bytes": nbytes}

    return {
        "loadtest_write": fig(r["cpu_s_write"], wrote, w_s),
        "loadtest_read": fig(r["cpu_s_read"], read, r_s),
        "loadtest": fig(r["cpu_s_write"] + r["cpu_s_read"], wrote + read, w_s + r_s),
    }


def measure(config: Config, size: int, workdir: Path) -> dict[str, dict[str, Any]]:
    """One configuration on a fresh cluster: the torch pair through a mount, then the loadtest."""
    flags, env = config
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the daemons inherit it (LocalCluster spawns them)
    try:
        c = LocalCluster(workdir / "cluster", ec="rs-6-3", chunkstore_args=flags)
        c.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    results: dict[str, dict[str, Any]] = {}
    try:
        mnt = workdir / "mnt"
        with tectonic_mounted(c.cluster_file, mnt, workdir / "mount.log") as mount_pid:
            with bench_lock():
                t = torch_workload(str(mnt), size, lambda: with_children([*c.pids(), mount_pid]))
            for k in ("torch_save", "torch_load"):
                results[k] = {f: t[k][f] for f in ("cpu_s_per_gib", "seconds", "bytes")}
        with bench_lock():
            results.update(_loadtest(c.cluster_file, with_children(c.pids()), workdir))
    finally:
        c.stop()
    return results


def summarize(runs: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Medians per configuration and workload, and each one's CPU-s per GiB over the first's."""
    med: dict[str, dict[str, dict[str, float]]] = {}
    for cfg in names:
        med[cfg] = {}
        for w in WORKLOADS:
            rs = [r["results"][w] for r in runs if r["config"] == cfg]
            med[cfg][w] = {
                "cpu_s_per_gib": statistics.median(x["cpu_s_per_gib"] for x in rs),
                "seconds": statistics.median(x["seconds"] for x in rs),
                "n": len(rs),
            }
    base = med[names[0]]
    ratios = {
        cfg: {w: med[cfg][w]["cpu_s_per_gib"] / base[w]["cpu_s_per_gib"] for w in WORKLOADS}
        for cfg in names[1:]
    }
    return {"medians": med, "cpu_ratio_to_first": ratios}


def format_table(summary: dict[str, Any]) -> str:
    med = summary["medians"]
    lines = ["config        " + "".join(f"{w:>22}" for w in WORKLOADS)]
    for cfg in med:
        cells = "".join(
            f"{med[cfg][w]['cpu_s_per_gib']:>11.2f} {med[cfg][w]['seconds']:>8.1f}s  "
            for w in WORKLOADS
        )
        lines.append(f"{cfg:<14}{cells}")
    lines.append("CPU-s/GiB over the first configuration's")
    for cfg, ratios in summary["cpu_ratio_to_first"].items():
        lines.append(f"{cfg:<14}" + "".join(f"{ratios[w]:>22.2f}" for w in WORKLOADS))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--size", type=int, default=512, help="torch state dict, MiB")
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="a configuration of the chunk stores (repeatable; default: one, 'default=')",
    )
    parser.add_argument("--out", type=Path, default=Path("fast-path.jsonl"))
    args = parser.parse_args(argv)
    configs = dict(parse_config(c) for c in args.config or ["default="])
    names = list(configs)
    runs: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for name in names:
            t0 = time.time()
            with tempfile.TemporaryDirectory(prefix="fast-path-") as tmp:
                results = measure(configs[name], args.size * MiB, Path(tmp))
            run = {"round": rnd, "config": name, "results": results, "wall": time.time() - t0}
            runs.append(run)
            with open(args.out, "a") as f:
                f.write(json.dumps(run) + "\n")
            print(json.dumps(run), flush=True)
    summary = summarize(runs, names)
    print(json.dumps(summary))
    print(format_table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
