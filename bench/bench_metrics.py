"""Metrics on against metrics off, in the same run: torch.save and a cold torch.load of a
state dict through the mount, and the checkpoint burst of N ranks x 1 MiB through the mount
(``tectonic loadtest --through-mount``, its GPU pause).

"On" is what ``tectonic cluster up`` runs: every daemon and the mount serve their metrics,
and a scraper in this process reads every endpoint once a second for the whole run (as
Prometheus would, a little more often than its default). "Off" is the same cluster layout
without ``--metrics-listen``: no families at all (``Metrics.off()``). Each configuration
gets a fresh cluster and mount; the order alternates (off, on, on, off, ...) so that a
drift of the shared machine lands on both.

    python -m bench.bench_metrics [--size 1GiB] [--ranks 1024] [--rounds 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.bench_fuse import state_dict, torch_round_trip
from tectonic_py.core.units import parse_size
from tectonic_py.launch.local_cluster import LocalCluster
from tectonic_py.launch.monitoring import add_target, read_endpoints

REPO_ROOT = Path(__file__).resolve().parent.parent
MiB = 1024 * 1024


@contextmanager
def _mounted(cluster: LocalCluster, mnt: Path, metrics: bool) -> Iterator[tuple[int, str | None]]:
    mnt.mkdir(parents=True, exist_ok=True)
    ready = mnt.parent / "mount.ready"
    ready.unlink(missing_ok=True)
    extra = ["--metrics-listen", "127.0.0.1:0"] if metrics else []
    argv = [sys.executable, "-m", "tectonic_py.cli.main", "mount", str(cluster.client_file)]
    with open(mnt.parent / "mount.log", "ab") as log:
        proc = subprocess.Popen(
            [*argv, str(mnt), "--foreground", "--ready-file", str(ready), *extra],
            cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the mount did not come up; see {mnt.parent / 'mount.log'}")
            time.sleep(0.05)
        yield proc.pid, json.loads(ready.read_text()).get("metrics")
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True, check=False)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def _scraping(cluster: LocalCluster, on: bool) -> Iterator[None]:
    """``tectonic stats`` in a subprocess for the whole block: it reads every endpoint of
    the cluster directory (the mount's is added to it) once a second, as Prometheus would."""
    if not on:
        yield
        return
    argv = [sys.executable, "-m", "tectonic_py.cli.main", "stats", str(cluster.cluster_file)]
    proc = subprocess.Popen(
        [*argv, "--interval", "1"], cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
    )  # fmt: skip
    try:
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def one_config(metrics: bool, size: int, ranks: int, workdir: Path) -> dict[str, Any]:
    root = workdir / ("on" if metrics else "off")
    cluster = LocalCluster(root / "cluster", metrics=metrics)
    with cluster, _mounted(cluster, root / "mnt", metrics) as (pid, mount_metrics):
        if mount_metrics:
            add_target(cluster.root, "mount", mount_metrics)
        endpoints = len(read_endpoints(cluster.root))
        with _scraping(cluster, metrics):
            sd = state_dict(size)
            figures = torch_round_trip(
                "tectonic", root / "mnt", sd, [pid, *cluster.pids()], fsync=False
            )
            del sd
            r = subprocess.run(
                [sys.executable, "-m", "tectonic_py.cli.main", "loadtest", "--through-mount",
                 str(root / "mnt"), "--ranks", str(ranks), "--shard-size", "1MiB",
                 "--no-restore", "--json", "--no-plot", "--no-progress",
                 "--results-dir", str(root / "results")],
                cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800, check=False,
                env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
            )  # fmt: skip
            if r.returncode != 0:
                raise RuntimeError(f"loadtest failed: {r.stderr[-2000:]}")
            burst = json.loads(r.stdout)
    by_name = {f["name"]: f for f in figures}
    return {
        "metrics": metrics,
        "endpoints_scraped": endpoints if metrics else 0,
        "save_s": by_name["tectonic_torch_save"]["seconds"],
        "load_s": by_name["tectonic_torch_load"]["seconds"],
        "burst_pause_s": burst["pause_s"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", type=parse_size, default="1GiB", help="state dict bytes")
    p.add_argument("--ranks", type=int, default=1024, help="ranks of the 1 MiB burst")
    p.add_argument("--rounds", type=int, default=1, help="off/on pairs (order alternates)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (for the test suite)")
    args = p.parse_args(argv)
    if args.smoke:
        args.size, args.ranks, args.rounds = 8 * MiB, 8, 1
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-metrics-") as tmp:
        for i in range(args.rounds):
            order = (False, True) if i % 2 == 0 else (True, False)
            for metrics in order:
                runs.append(one_config(metrics, args.size, args.ranks, Path(tmp) / f"r{i}"))
    summary: dict[str, Any] = {"size": args.size, "ranks": args.ranks, "runs": runs}
    for key in ("save_s", "load_s", "burst_pause_s"):
        on = [r[key] for r in runs if r["metrics"]]
        off = [r[key] for r in runs if not r["metrics"]]
        summary[f"{key}_on_over_off"] = (sum(on) / len(on)) / (sum(off) / len(off))
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        for r in runs:
            print(
                f"metrics {'on ' if r['metrics'] else 'off'}: save {r['save_s']:.2f} s, load"
                f" {r['load_s']:.2f} s, burst pause {r['burst_pause_s']:.2f} s"
                f" ({r['endpoints_scraped']} endpoints scraped every second)"
            )
        for key in ("save_s", "load_s", "burst_pause_s"):
            print(f"{key} on/off: {summary[f'{key}_on_over_off']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
