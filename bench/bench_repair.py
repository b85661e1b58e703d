"""Repair: time to restore full redundancy after losing one of 9 chunk stores, and checkpoint
write throughput while repair runs, as a ratio to the same write without repair.

Setup: a local cluster of 9 chunk stores (RS(6,2) by default: n = 8, so every block has a
ninth node to be rebuilt on; with RS(6,3) on 9 stores there is none) holding ``--size-mib``
of data. Then:

1. one chunk store is killed (kill -9) and the registry marks it down;
2. baseline: a write of ``--write-mib`` with no repair running (W0);
3. a ``tectonic maintenance`` process (repair only, ``--bandwidth``) starts, and the same
   write runs while it repairs (W1); the figure is W1 / W0;
4. the time from the maintenance start until every block is at k+m live chunks again; the
   rebuilt bytes per second beside same-run ceilings: zfec RS decode (1 thread) and the raw
   disk write with fsync. Repair reads k chunks for each chunk it writes.

    python -m bench.bench_repair [--size-mib 1024] [--write-mib 256] [--bandwidth-mib 100]
                                 [--smoke] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from bench.common import write_repeated
from tectonic_py.client.tectonic_client import open_client
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.launch.local_cluster import LocalCluster

MiB = 1024 * 1024
PIECE = 4 * MiB


def _piece(seed: int) -> bytes:
    return hashlib.sha256(f"repair-{seed}".encode()).digest() * (PIECE // 32)


async def _write(cluster_file: Path, path: str, size: int, ec: str) -> float:
    """Seconds to write and close ``size`` bytes."""
    piece = _piece(len(path))
    async with open_client(cluster_file, chunk_timeout=30.0) as client:
        t0 = time.perf_counter()
        await write_repeated(await client.create(path, ec=ec), piece, size)
        return time.perf_counter() - t0


async def _status(cluster: LocalCluster) -> dict[str, Any]:
    from tectonic_py.cli.maintenance import fetch_repair_status
    from tectonic_py.core import cluster_file

    return await fetch_repair_status(cluster_file.load(cluster.cluster_file))


def _wait(cluster: LocalCluster, pred: Any, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        s = trio.run(_status, cluster)
        if pred(s):
            return s
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up after {timeout}s: {s}")
        time.sleep(0.5)


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from bench import ceilings as c

    policy = ECPolicy.parse(args.ec)
    size, wsize = args.size_mib * MiB, args.write_mib * MiB
    cluster = LocalCluster(
        root / "cluster",
        chunkstores=9,
        metadata_servers=2,
        shards=16,
        ec=args.ec,
        chunk_size=args.chunk_kib * 1024,
        heartbeat_interval=0.5,
        node_timeout=3.0,
        maintenance_args=[
            "--interval",
            "1",
            "--services",
            "repair",
            "--bandwidth",
            str(args.bandwidth_mib * MiB),
            "--repair-concurrency",
            "2",
            "--sweep-interval",
            "3600",
        ],
    )
    out: dict[str, Any] = {"ec": args.ec, "data_bytes": size, "write_bytes": wsize}
    try:
        cluster.start()
        trio.run(_write, cluster.cluster_file, "/data", size, args.ec)
        victim = 0
        cluster.kill_chunkstore(victim)
        _wait(cluster, lambda s: "cs0" in s["nodes_down"], 60)
        before = trio.run(_status, cluster)
        out["chunks_to_rebuild"] = before["chunks_to_rebuild"]
        w0 = trio.run(_write, cluster.cluster_file, "/w0", wsize, args.ec)
        t_start = time.perf_counter()
        cluster.start_maintenance()
        w1 = trio.run(_write, cluster.cluster_file, "/w1", wsize, args.ec)
        during = trio.run(_status, cluster)
        after = _wait(cluster, lambda s: s["degraded"] == 0, args.timeout)
        t_restore = time.perf_counter() - t_start
        cluster.stop_maintenance()
        rebuilt = before["chunks_to_rebuild"] * (size // max(1, before["blocks"]) // policy.k)
        out.update(
            {
                "restore_seconds": round(t_restore, 2),
                "rebuilt_bytes_approx": rebuilt,
                "rebuilt_MB_per_s": round(rebuilt / t_restore / 1e6, 1),
                "repair_read_MB_per_s": round(policy.k * rebuilt / t_restore / 1e6, 1),
                "write_MB_per_s_without_repair": round(wsize / w0 / 1e6, 1),
                "write_MB_per_s_with_repair": round(wsize / w1 / 1e6, 1),
                "write_ratio_with_repair": round(w0 / w1, 3),
                "repair_still_running_after_the_write": during["degraded"] > 0,
                "lost_blocks": after["lost"],
            }
        )
    finally:
        cluster.stop()
    if not args.no_ceilings:
        dec = c.zfec_decode(policy.k, policy.m, 16 * MiB if args.smoke else 64 * MiB, 1, 3)
        # The higher of buffered and O_DIRECT (a buffered write can be bound by the CPU).
        disk = max(
            c.disk_write(root, min(size, 1024 * MiB))["mbps"],
            c.disk_write_direct(root, min(size, 1024 * MiB))["mbps"],
        )
        (root / "ceiling-disk.bin").unlink(missing_ok=True)
        out["ceilings"] = {"zfec_decode_MB_per_s": dec["mbps"], "disk_write_MB_per_s": disk}
        out["repair_read_vs_zfec_decode"] = round(out["repair_read_MB_per_s"] / dec["mbps"], 3)
        out["rebuilt_vs_disk_write"] = round(out["rebuilt_MB_per_s"] / disk, 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=1024, help="data held before the failure")
    p.add_argument("--write-mib", type=int, default=256, help="the checkpoint write measured")
    p.add_argument("--bandwidth-mib", type=int, default=100, help="repair's bandwidth limit")
    p.add_argument("--chunk-kib", type=int, default=1024, help="C, bytes per data chunk")
    p.add_argument("--ec", default="rs-6-2")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--no-ceilings", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script runs")
    p.add_argument("--json", action="store_true")
    p.add_argument("--dir", type=Path, default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.size_mib, args.write_mib, args.chunk_kib = 24, 12, 256
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        out = run(args, Path(tmp))
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k:40} {v}")
    return 0 if out.get("lost_blocks", 1) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
