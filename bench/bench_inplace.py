"""bench_inplace: small in-place writes through the mount (issue 23, bug 3), and how soon
the space of the versions they replace comes back.

A LocalCluster (2 metadata servers, 9 chunk stores, RS(6,3), 4 MiB chunks: 24 MiB blocks)
and ``tectonic mount`` in its own process. A ``--size`` MiB file (default 48) is written
through the mount, then ``--writes`` times (default 20): ``open(O_RDWR)``, one 4 KiB
``pwrite`` at a random offset, ``close``: what h5py in append mode or ``np.memmap(mode="r+")``
do. Figures:

* ``raw_added``: bytes of chunk files the writes added on the stores' disks (every file under
  the stores' ``chunks/`` directories, before any GC), and per write;
* ``seconds`` / ``cpu_s``: wall time and CPU-seconds of the writes, over every process (this
  one, the mount, the cluster's daemons);
* with ``--reclaim``: a ``tectonic maintenance`` process with its default settings is
  started after the writes, and ``reclaim_s`` is how long until the chunk bytes are back to
  what the file took before the writes (or null if not within ``--reclaim-timeout``).

The content is checked against a model of the writes (read back through the mount).

``python -m bench.bench_inplace [--size MiB] [--writes N] [--reclaim] [--json]``
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.bench_fuse import tectonic_mounted
from bench.common import cpu_with, print_results
from tectonic_py.core.ids import CHUNK_ID_RE

MiB = 1024 * 1024
PAGE = 4096


def chunk_bytes(cluster_root: Path) -> int:
    """Bytes of chunk files on every store's disk (spare and temporary files excluded)."""
    total = 0
    for path in (cluster_root / "chunks").glob("*/chunks/*/*"):
        if CHUNK_ID_RE.match(path.name):
            try:
                total += path.stat().st_size
            except FileNotFoundError:
                continue  # collected by the GC meanwhile
    return total


def overwrite(
    path: Path, cluster_root: Path, pids: list[int], size: int, writes: int
) -> dict[str, Any]:
    """Write the file through a mount, then the in-place writes, and check the content: the
    figures without the reclaim, apart from ``measure`` so that bench.run_all measures them
    on the mount it already has (no second cluster to start)."""
    rng = random.Random(23)
    model = bytearray(rng.randbytes(size))
    with open(path, "wb") as f:
        f.writelines(model[i : i + MiB] for i in range(0, size, MiB))
        f.flush()
        os.fsync(f.fileno())
    before = chunk_bytes(cluster_root)
    cpu0, t0 = cpu_with(pids), time.perf_counter()
    for _ in range(writes):
        offset = rng.randrange(0, size - PAGE)
        page = rng.randbytes(PAGE)
        fd = os.open(path, os.O_RDWR)
        try:
            os.pwrite(fd, page, offset)
        finally:
            os.close(fd)
        model[offset : offset + PAGE] = page
    seconds, cpu = time.perf_counter() - t0, cpu_with(pids) - cpu0
    added = chunk_bytes(cluster_root) - before
    with open(path, "rb") as f:
        if f.read() != model:
            raise AssertionError("the file does not hold what was written")
    return {
        "file_bytes": size,
        "writes": writes,
        "raw_before": before,
        "raw_added": added,
        "raw_added_per_write": added // max(writes, 1),
        "seconds": round(seconds, 3),
        "ms_per_write": round(1000 * seconds / max(writes, 1), 1),
        "cpu_s": round(cpu, 3),
    }


def measure(size: int, writes: int, reclaim: bool, timeout: float, workdir: Path) -> dict[str, Any]:
    from tectonic_py.launch.local_cluster import LocalCluster

    with LocalCluster(workdir / "cluster", chunkstores=9, metadata_servers=2, shards=16) as c:
        mnt = workdir / "mnt"
        with tectonic_mounted(c.cluster_file, mnt, workdir / "mount.log") as mount_pid:
            out = overwrite(mnt / "data.h5", c.root, [*c.pids(), mount_pid], size, writes)
            if reclaim:
                before = out["raw_before"]
                c.maintenance = True
                c.start_maintenance()
                t1, back = time.perf_counter(), None
                while time.perf_counter() - t1 < timeout:
                    if chunk_bytes(c.root) <= before:
                        back = round(time.perf_counter() - t1, 1)
                        break
                    time.sleep(0.5)
                out["reclaim_s"] = back
                out["raw_left"] = chunk_bytes(c.root) - before
                c.stop_maintenance()
    return out


def format_table(r: dict[str, Any]) -> str:
    lines = [
        f"{r['writes']} x (open r+, 4 KiB pwrite, close) on a {r['file_bytes'] // MiB} MiB file",
        (
            f"  raw chunk bytes added: {r['raw_added'] / 1e6:,.1f} MB"
            f" ({r['raw_added_per_write'] / 1e6:,.2f} MB per write)"
        ),
        f"  time: {r['seconds']} s ({r['ms_per_write']} ms per write), {r['cpu_s']} CPU-s",
    ]
    if "reclaim_s" in r:
        lines.append(f"  back to the file's own bytes after: {r['reclaim_s']} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=48, help="file MiB (default 48)")
    parser.add_argument("--writes", type=int, default=20, help="in-place writes (default 20)")
    parser.add_argument("--reclaim", action="store_true", help="then time the GC's reclaim")
    parser.add_argument("--reclaim-timeout", type=float, default=180.0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--dir", help="work directory on local disk (default: a tmp dir)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-inplace-") as tmp:
        results = measure(
            args.size * MiB, args.writes, args.reclaim, args.reclaim_timeout, Path(tmp)
        )
    print_results(results, args.json, format_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
