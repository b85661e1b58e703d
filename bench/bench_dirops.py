"""bench_dirops: the namespace operations of one step directory through the mount, against
local disk in the same run.

The workload checkpoints are made of: many files created in ONE directory, as a job's
ranks write their shards into one step directory. The kernel holds the parent directory's
lock across a FUSE LOOKUP and CREATE of a new name, so the creates of one directory run one
at a time, however many processes make them, and each costs what the mount takes to answer
them. Measured here, in one process (the kernel serializes them anyway), through a
``tectonic mount`` of a LocalCluster (2 metadata servers, 9 chunk stores) with the client's
role key, and on the local disk:

* ``create``: ``open(O_CREAT|O_WRONLY|O_TRUNC)`` + ``close`` of N new empty files in one
  directory (what ``open(p, "wb")`` and ``torch.save`` do to start);
* ``create_spread``: the same N files over 16 directories;
* ``stat_missing``: ``stat`` of N names that do not exist (the negative LOOKUP before each
  create);
* ``stat``: ``stat`` of the N files;
* ``unlink``: ``unlink`` of the N files (retention deletes whole step directories).

Beside them the same on nullfs (bench/nullfs.py: a pyfuse3 + trio mount that keeps names in
memory and answers at once), the floor of any Python FUSE mount: what a create costs once
the mount answers it without waiting for the metadata service. Each figure: ms per operation
and its ratios to the local disk's and to nullfs's. With ``--profile DIR``,
py-spy records the mount and every metadata server during the creates (stacks in
DIR, as collapsed stacks: ``flamegraph.pl`` or speedscope draw them). Nothing asserts: the target of the async-creates design (creates in one directory
<= 10x local disk) is printed as met or missed.

``python -m bench.bench_dirops [--files N] [--json] [--profile DIR]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.bench_fuse import tectonic_mounted
from bench.common import print_results

SPREAD_DIRS = 16
CREATE_TARGET = 10.0  # creates in one directory: at most this many times local disk's time


def _create(path: str) -> None:
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644))


def _missing(path: str) -> None:
    try:
        os.stat(path)
    except FileNotFoundError:
        return
    raise RuntimeError(f"{path} exists")


def _timed(op: Callable[[str], None], paths: list[str]) -> float:
    start = time.perf_counter()
    for p in paths:
        op(p)
    return time.perf_counter() - start


def run_ops(root: Path, n: int) -> dict[str, float]:
    """Seconds per operation of each phase, under ``root`` (a new directory)."""
    step = root / "step"
    step.mkdir()
    names = [str(step / f"rank_{i:05d}.pt") for i in range(n)]
    spread_dirs = [root / f"d{i}" for i in range(SPREAD_DIRS)]
    for d in spread_dirs:
        d.mkdir()
    spread = [str(spread_dirs[i % SPREAD_DIRS] / f"rank_{i:05d}.pt") for i in range(n)]
    out = {"stat_missing": _timed(_missing, [p + ".absent" for p in names]) / n}
    out["create"] = _timed(_create, names) / n
    out["stat"] = _timed(os.stat, names) / n
    out["create_spread"] = _timed(_create, spread) / n
    out["unlink"] = _timed(os.unlink, names) / n
    return out


@contextmanager
def profiled(pids: dict[str, int], out: Path | None) -> Iterator[None]:
    """py-spy record of each process while the block runs (nothing when ``out`` is None)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    procs = []
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        for name, pid in pids.items():
            cmd = [
                spy,
                "record",
                "-p",
                str(pid),
                "-o",
                str(out / f"{name}.txt"),
                "-r",
                "200",
                "-f",
                "raw",
            ]
            procs.append(
                subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
        time.sleep(1.0)  # py-spy attaches
    try:
        yield
    finally:
        for p in procs:
            p.send_signal(2)  # SIGINT: py-spy writes its flame graph and exits
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


def local_best(workdir: Path, n: int) -> dict[str, float]:
    """The local disk's best of 3 (a fresh directory each): its creates vary many-fold from
    run to run (docs/decisions/2026-12-03-dirops-baseline.md), and a slow run must not
    flatter the mount's ratio."""
    runs = []
    for i in range(3):
        disk = workdir / f"disk{i}"
        disk.mkdir()
        runs.append(run_ops(disk, n))
    return {op: min(r[op] for r in runs) for op in runs[0]}


def figures(
    n: int, local: dict[str, float], nullfs: dict[str, float], mount: dict[str, float]
) -> dict[str, Any]:
    """Each operation's ms and ratios, and the creates target met or missed: apart from
    ``measure`` so that bench.run_all makes the same figures on the mount it already has."""
    results: dict[str, Any] = {"files": n, "ops": {}}
    for op, here in local.items():
        results["ops"][op] = {
            "mount_ms": round(mount[op] * 1e3, 3),
            "local_ms": round(here * 1e3, 3),
            "ratio": round(mount[op] / max(here, 1e-9), 1),
            "nullfs_ms": round(nullfs[op] * 1e3, 3),
            "over_nullfs": round(mount[op] / max(nullfs[op], 1e-9), 1),
        }
    ratio = results["ops"]["create"]["ratio"]
    results["create_target"] = {
        "max_ratio": CREATE_TARGET,
        "ratio": ratio,
        "met": ratio <= CREATE_TARGET,
    }
    return results


def measure(n: int, workdir: Path, profile: Path | None) -> dict[str, Any]:
    from bench.nullfs import nullfs_mounted
    from tectonic_py.launch.local_cluster import LocalCluster

    local = local_best(workdir, n)
    with nullfs_mounted(workdir / "nullmnt") as null:
        nullfs = run_ops(Path(null.mountpoint), n)
    with LocalCluster(workdir / "cluster", chunkstores=9, metadata_servers=2, ec="rs-6-3") as c:
        metadata_pids = {f"metadata-{i}": pid for i, pid in enumerate(c.pids()[:2])}
        mnt = workdir / "mnt"
        with (
            tectonic_mounted(c.client_file, mnt, workdir / "mount.log") as pid,
            profiled({"mount": pid, **metadata_pids}, profile),
        ):
            mount = run_ops(mnt, n)
    return figures(n, local, nullfs, mount)


def format_table(results: dict[str, Any]) -> str:
    lines = [
        f"{results['files']} files, one process",
        "op             mount ms   local ms   x local  nullfs ms  x nullfs",
    ]
    for op, r in results["ops"].items():
        lines.append(
            f"{op:14} {r['mount_ms']:9.3f} {r['local_ms']:10.3f} {r['ratio']:9.1f}"
            f" {r['nullfs_ms']:10.3f} {r['over_nullfs']:9.1f}"
        )
    t = results["create_target"]
    lines.append(
        f"creates in one directory: {t['ratio']}x local disk, target <= {t['max_ratio']}x: "
        + ("met" if t["met"] else "missed")
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--files", type=int, default=1024)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--profile", type=Path, help="py-spy flame graphs of the creates here")
    parser.add_argument("--dir", type=Path, help="scratch directory on the disk to measure")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        results = measure(args.files, Path(tmp), args.profile)
    print_results(results, args.json, format_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
