"""bench_small_appends: small fsync'd appends through the mount, beside local disk in the same
run: SQLite commits, what a job's run log, an experiment tracker's database or a dataloader's
index do on a shared filesystem.

A LocalCluster (2 metadata servers, 9 chunk stores, RS(6,3), 4 MiB chunks: 24 MiB blocks)
and ``tectonic mount`` in its own process. For each journal mode (``wal``: WAL with
synchronous=FULL, an fsync per commit; ``delete``: the rollback journal, a journal file
created, written, fsync'd and unlinked per commit), ``--commits`` transactions of one 100-byte
row each, on the mount and on the local disk. Figures per mode:

* ``commits_per_s`` on each, and the mount's ratio to the disk's;
* ``raw_added_per_commit``: bytes of chunk files the commits added on the stores' disks
  (before any GC): what one small fsync'd append costs the cluster;
* ``cpu_ms_per_commit`` over every process of the cluster and the mount.

The table is read back through the mount and checked row by row. Nothing asserts.

``python -m bench.bench_small_appends [--commits N] [--json] [--dir DIR]``
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.bench_fuse import tectonic_mounted
from bench.bench_inplace import chunk_bytes
from bench.common import cpu_with, print_results

MODES = ("wal", "delete")
ROW = b"r" * 100


def commits(db: Path, mode: str, n: int) -> float:
    """Seconds for ``n`` one-row commits to a new database in ``mode``; then checked."""
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        conn.execute(f"PRAGMA journal_mode={mode}")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("CREATE TABLE t (i INTEGER PRIMARY KEY, v BLOB)")
        t0 = time.perf_counter()
        for i in range(n):
            conn.execute("BEGIN")
            conn.execute("INSERT INTO t VALUES (?, ?)", (i, ROW))
            conn.execute("COMMIT")
        seconds = time.perf_counter() - t0
        rows = conn.execute("SELECT i, v FROM t ORDER BY i").fetchall()
    finally:
        conn.close()
    if rows != [(i, ROW) for i in range(n)]:
        raise AssertionError(f"{db}: the table does not hold the {n} rows committed")
    return seconds


def compare(mnt: Path, local: Path, cluster_root: Path, pids: list[int], n: int) -> dict[str, Any]:
    """Each mode's commits in ``mnt`` (a mount of the cluster at ``cluster_root``, whose
    processes are ``pids``) and in ``local``: apart from ``measure`` so that bench.run_all
    measures them on the mount it already has (no second cluster to start)."""
    out: dict[str, Any] = {"commits": n, "modes": {}}
    for mode in MODES:
        disk_s = commits(local / f"{mode}.db", mode, n)
        before, cpu0 = chunk_bytes(cluster_root), cpu_with(pids)
        mount_s = commits(mnt / f"{mode}.db", mode, n)
        added, cpu = chunk_bytes(cluster_root) - before, cpu_with(pids) - cpu0
        out["modes"][mode] = {
            "mount_commits_per_s": round(n / mount_s, 1),
            "disk_commits_per_s": round(n / disk_s, 1),
            "ratio_to_disk": round(disk_s / mount_s, 4),
            "raw_added_per_commit": added // n,
            "cpu_ms_per_commit": round(1000 * cpu / n, 2),
        }
    return out


def measure(n: int, workdir: Path) -> dict[str, Any]:
    from tectonic_py.launch.local_cluster import LocalCluster

    local = workdir / "local"
    local.mkdir()
    with LocalCluster(workdir / "cluster", chunkstores=9, metadata_servers=2, shards=16) as c:
        mnt = workdir / "mnt"
        with tectonic_mounted(c.cluster_file, mnt, workdir / "mount.log") as mount_pid:
            return compare(mnt, local, c.root, [*c.pids(), mount_pid], n)


def format_table(r: dict[str, Any]) -> str:
    lines = [
        f"{r['commits']} one-row SQLite commits (synchronous=FULL)",
        (
            f"{'journal':<8} {'mount/s':>9} {'disk/s':>9} {'ratio':>7} {'raw/commit':>12} "
            f"{'CPU ms/commit':>14}"
        ),
    ]
    for mode, m in r["modes"].items():
        lines.append(
            f"{mode:<8} {m['mount_commits_per_s']:>9} {m['disk_commits_per_s']:>9} "
            f"{m['ratio_to_disk']:>7} {m['raw_added_per_commit'] / 1e3:>10.1f}kB "
            f"{m['cpu_ms_per_commit']:>14}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=200, help="commits per mode (200)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--dir", help="work directory on local disk (default: a tmp dir)")
    args = parser.parse_args(argv)
    if args.commits < 1:
        parser.error("--commits must be at least 1")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-appends-") as tmp:
        results = measure(args.commits, Path(tmp))
    print_results(results, args.json, format_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
