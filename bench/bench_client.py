"""Single-client sequential write and read of a large file, RS(6,3) on 9 local chunk stores,
beside ceilings measured in the same run; and a burst of many concurrent writers.

Figures: wall MB/s (10^6 bytes/s) and CPU-seconds per GiB of *all* processes together (this
client, every chunk store, every metadata server; from psutil), and the core utilisation
ratio ``MB/s / (cores * 1 GiB / CPU-s-per-GiB)``: 1.0 means every core was busy moving bytes
for the whole run. Ceilings (same run): zfec RS(6,3) encode CPU-s per GiB, raw disk write
with fsync, loopback TCP through our own wire protocol.

    python -m bench.bench_client [--size-mib 2048] [--burst] [--json]

Targets: write <= 4 CPU-s/GiB and utilisation >= 0.75; read (no chunk lost)
<= 2 CPU-s/GiB and the same utilisation; burst of 2 processes x 128 writers x 16 MiB
>= 0.8 of the single-writer throughput with no errors.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import trio

from bench.common import cpu_with, write_repeated
from tectonic_py.client.tectonic_client import open_client
from tectonic_py.launch.local_cluster import LocalCluster

log = logging.getLogger(__name__)

MiB = 1024 * 1024
GiB = 1024 * MiB
PIECE = 8 * MiB


class CpuMeter:
    """CPU seconds (user + system) of this process and the given PIDs, between two reads."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids

    def read(self) -> float:
        return cpu_with(self.pids)


def _figure(name: str, nbytes: int, seconds: float, cpu: float, cores: int) -> dict[str, Any]:
    mbps = nbytes / seconds / 1e6
    cpu_per_gib = cpu / (nbytes / GiB)
    ideal = cores * GiB / cpu_per_gib / 1e6 if cpu_per_gib else float("inf")
    return {
        "name": name,
        "bytes": nbytes,
        "seconds": round(seconds, 3),
        "MB_per_s": round(mbps, 1),
        "cpu_s_per_GiB": round(cpu_per_gib, 3),
        "core_utilisation": round(mbps / ideal, 3),
    }


def _pattern() -> bytes:
    return hashlib.sha256(b"bench").digest() * (PIECE // 32)


async def _write(cluster_file: Path, path: str, size: int, **tuning: Any) -> int:
    """Write ``size`` bytes; returns the client's peak RSS growth in bytes (sampled)."""
    piece = _pattern()
    proc = psutil.Process()
    base = peak = proc.memory_info().rss
    async with open_client(cluster_file, **tuning) as client:

        async def sample() -> None:
            nonlocal peak
            while True:
                peak = max(peak, proc.memory_info().rss)
                await trio.sleep(0.05)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sample)
            await write_repeated(await client.create(path), piece, size)
            nursery.cancel_scope.cancel()
    return peak - base


async def _read(cluster_file: Path, path: str, **tuning: Any) -> int:
    got = 0
    async with open_client(cluster_file, **tuning) as client:
        r = await client.open_read(path)
        while data := await r.read(PIECE):
            got += len(data)
    return got


def bench_single(cluster: LocalCluster, size: int, cores: int, **tuning: Any) -> list[dict]:
    meter = CpuMeter(cluster.pids())
    out = []
    c0, t0 = meter.read(), time.perf_counter()
    rss = trio.run(lambda: _write(cluster.cluster_file, "/bench.bin", size, **tuning))
    t1, c1 = time.perf_counter(), meter.read()
    out.append(_figure("write", size, t1 - t0, c1 - c0, cores))
    out[-1]["client_rss_growth_MiB"] = round(rss / MiB, 1)
    _drop_caches(cluster)
    c0, t0 = meter.read(), time.perf_counter()
    got = trio.run(lambda: _read(cluster.cluster_file, "/bench.bin", **tuning))
    t1, c1 = time.perf_counter(), meter.read()
    assert got == size, (got, size)
    out.append(_figure("read", size, t1 - t0, c1 - c0, cores))
    return out


def bench_chunk_sizes(root: Path, size: int, cores: int, sizes_mib: list[int]) -> list[dict]:
    """The same write and read at several chunk sizes C: the measurement behind the default."""
    out = []
    for c in sizes_mib:
        with LocalCluster(
            root / f"sweep{c}", chunkstores=9, metadata_servers=2, shards=64, chunk_size=c * MiB
        ) as cl:
            for fig in bench_single(cl, size, cores):
                fig["name"] = f"{fig['name']} C={c}MiB"
                out.append(fig)
    return out


def _drop_caches(cluster: LocalCluster) -> None:
    """Evict the chunk files from the page cache (posix_fadvise), so the read is cold."""
    for i in range(cluster.chunkstores):
        for root, _dirs, files in os.walk(cluster.chunkstore_dir(i)):
            for name in files:
                try:
                    fd = os.open(os.path.join(root, name), os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def _burst_proc(cluster_file: str, proc: int, tasks: int, size: int, q: Any) -> None:
    async def main() -> int:
        errors = 0
        piece = _pattern()[:size] if size <= PIECE else _pattern()
        async with open_client(cluster_file) as client:
            await client.mkdir(f"/burst{proc}", parents=True)

            async def one(i: int) -> None:
                nonlocal errors
                try:
                    await write_repeated(await client.create(f"/burst{proc}/f{i}"), piece, size)
                except Exception as e:  # noqa: BLE001 (counted and reported, never hidden)
                    errors += 1
                    log.error("writer %d/%d failed: %s", proc, i, e)

            async with trio.open_nursery() as nursery:
                for i in range(tasks):
                    nursery.start_soon(one, i)
        return errors

    q.put(trio.run(main))


def bench_burst(
    cluster: LocalCluster, procs: int, tasks: int, size: int, cores: int
) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    meter = CpuMeter(cluster.pids())
    c0, t0 = meter.read(), time.perf_counter()
    ps = [
        ctx.Process(target=_burst_proc, args=(str(cluster.cluster_file), p, tasks, size, q))
        for p in range(procs)
    ]
    for p in ps:
        p.start()
    errors = sum(q.get(timeout=1800) for _ in ps)
    for p in ps:
        p.join(60)
    t1 = time.perf_counter()
    # The burst processes are children of this one: their CPU shows in children_* once joined.
    c1 = meter.read()
    fig = _figure(
        f"burst {procs}x{tasks}x{size // MiB}MiB", procs * tasks * size, t1 - t0, c1 - c0, cores
    )
    fig["errors"] = errors
    return fig


def ceilings(tmp: Path, size: int) -> list[dict[str, Any]]:
    """The stage ceilings from bench.ceilings, sized to this run."""
    from bench import ceilings as c

    disk = min(size, GiB)
    out = [
        c.zfec_encode(6, 3, 64 * MiB, 1, 3),
        c.zfec_encode(6, 3, 64 * MiB, 2, 3),
        c.disk_write(tmp, disk),
        c.disk_write_direct(tmp, disk),
    ]
    (tmp / "ceiling-disk.bin").unlink(missing_ok=True)
    out.extend(c.tcp_wire(disk).values())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=2048)
    parser.add_argument("--burst", action="store_true", help="also the 2 x 128 writer burst")
    parser.add_argument("--burst-procs", type=int, default=2)
    parser.add_argument("--burst-tasks", type=int, default=128)
    parser.add_argument("--burst-mib", type=int, default=16)
    parser.add_argument("--window-mib", type=int, default=256)
    parser.add_argument("--no-ceilings", action="store_true")
    parser.add_argument("--chunk-mib", type=int, default=4, help="C of the main run")
    parser.add_argument(
        "--sweep-chunk-mib",
        default="",
        help="e.g. 1,2,4,8: also write+read --sweep-size-mib at each C",
    )
    parser.add_argument("--sweep-size-mib", type=int, default=512)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--dir", type=Path, default=None, help="where the cluster lives")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    cores = os.cpu_count() or 1
    results: dict[str, Any] = {"cores": cores}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        if not args.no_ceilings:
            results["ceilings"] = ceilings(root, args.size_mib * MiB)
        if args.sweep_chunk_mib:
            results["chunk_sweep"] = bench_chunk_sizes(
                root,
                args.sweep_size_mib * MiB,
                cores,
                [int(x) for x in args.sweep_chunk_mib.split(",")],
            )
        with LocalCluster(
            root / "cluster",
            chunkstores=9,
            metadata_servers=2,
            shards=64,
            chunk_size=args.chunk_mib * MiB,
        ) as cl:
            results["single"] = bench_single(
                cl, args.size_mib * MiB, cores, window_bytes=args.window_mib * MiB
            )
            if args.burst:
                results["burst"] = bench_burst(
                    cl, args.burst_procs, args.burst_tasks, args.burst_mib * MiB, cores
                )
                single = results["single"][0]["MB_per_s"]
                results["burst"]["ratio_to_single_write"] = round(
                    results["burst"]["MB_per_s"] / single, 3
                )
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        print()
    else:
        for c in results.get("ceilings", []):
            print(
                f"ceiling {c['name']:>24}: {c.get('mbps') or 0:8.1f} MB/s  "
                f"{c.get('cpu_s_per_gib') or 0:6.2f} CPU-s/GiB"
            )
        for f in results.get("chunk_sweep", []) + results["single"]:
            rss = f.get("client_rss_growth_MiB")
            print(
                f"{f['name']:>6}: {f['MB_per_s']:8.1f} MB/s  {f['cpu_s_per_GiB']:6.2f} CPU-s/GiB"
                f"  core utilisation {f['core_utilisation']:.2f}"
                + (f"  client RSS +{rss} MiB (window {args.window_mib} MiB)" if rss else "")
            )
        if "burst" in results:
            b = results["burst"]
            print(
                f"{b['name']}: {b['MB_per_s']:.1f} MB/s {b['cpu_s_per_GiB']:.2f} CPU-s/GiB "
                f"errors {b['errors']} ratio to single write {b['ratio_to_single_write']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
