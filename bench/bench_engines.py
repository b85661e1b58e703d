"""The two metadata engines side by side, in one run: creates per second, the checkpoint
burst's pause, and (etcd) how long a dead metadata server's shards go unserved.

For each engine a fresh local cluster (``tectonic_py.launch.local_cluster``; under etcd a 3-member
etcd on loopback) and, on it:

1. creates: ``tasks`` client tasks create and close ``creates`` empty files in ONE directory
   (the hotspot of a real step) through the client library; files per second;
2. burst: ``tectonic loadtest CLUSTER --ranks R --shard-size S --no-restore --json``, its
   pause (the GPUs' wait until the last rank's close);
3. failover (etcd only): SIGKILL of the metadata server that owns the registry shard, then
   creates into a directory on one of its shards until one succeeds: seconds from the kill.

Targets (issue "metadata that survives the loss of a host"): etcd/sqlite at least 0.5 for
creates and burst; failover at most 5 s. ``python -m bench.bench_engines [--quick] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from tectonic_py.client.tectonic_client import TectonicClient, open_client
from tectonic_py.core.ids import shard_of
from tectonic_py.core.process_env import child_env
from tectonic_py.launch.local_cluster import LocalCluster


async def _creates(client: TectonicClient, count: int, tasks: int) -> float:
    await client.mkdir("/creates")
    todo = iter(range(count))

    async def worker() -> None:
        for i in todo:
            w = await client.create(f"/creates/f{i:06d}")
            await w.close()

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(tasks):
            nursery.start_soon(worker)
    return count / (time.perf_counter() - start)


def _burst(cluster: LocalCluster, ranks: int, shard_size: str, out: Path) -> float:
    argv = [
        sys.executable, "-m", "tectonic_py.cli.main", "loadtest", str(cluster.cluster_file),
        "--ranks", str(ranks), "--shard-size", shard_size, "--no-restore", "--json",
        "--no-plot", "--no-progress", "--results-dir", str(out),
    ]  # fmt: skip
    r = subprocess.run(
        argv, check=False, capture_output=True, text=True, env=child_env(), timeout=900
    )
    if r.returncode != 0:
        raise RuntimeError(f"loadtest failed ({r.returncode}): {r.stderr[-2000:]}")
    report = json.loads(r.stdout[r.stdout.index("{") :])
    return float(report["pause_s"])


async def _failover(cluster: LocalCluster, client: TectonicClient) -> float:
    """Seconds from SIGKILL of metadata server 0 to the first create served in a directory
    whose shard that server owned."""
    moved = set(cluster.shards_of(0))
    for i in range(500):
        d = await client.mkdir(f"/fo{i}")
        if shard_of(d.id, cluster.shards) in moved:
            break
    else:
        raise RuntimeError("no directory landed on server 0's shards")
    cluster.kill_metadata(0)
    killed = time.perf_counter()
    with trio.fail_after(60):
        n = 0
        while True:
            n += 1
            try:
                w = await client.create(f"/fo{i}/after{n}")
                await w.close()
                return time.perf_counter() - killed
            except Exception:  # noqa: BLE001 - until the takeover completes
                await trio.sleep(0.05)


async def _engine(engine: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    cluster = LocalCluster(root / engine, chunkstores=10, metadata_engine=engine)
    try:
        cluster.start()
        async with open_client(cluster.cluster_file) as client:
            rate = await _creates(client, args.creates, args.tasks)
        pause = await trio.to_thread.run_sync(
            _burst, cluster, args.ranks, args.shard_size, root / f"{engine}-loadtest"
        )
        result = {"engine": engine, "creates_per_s": rate, "burst_pause_s": pause}
        if engine == "etcd":
            async with open_client(cluster.cluster_file) as client:
                result["failover_s"] = await _failover(cluster, client)
        return result
    finally:
        cluster.stop()


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp:
        rows = [await _engine(e, Path(tmp), args) for e in ("sqlite", "etcd")]
    sqlite, etcd = rows
    return {
        "rows": rows,
        "creates_ratio": etcd["creates_per_s"] / sqlite["creates_per_s"],
        "burst_pause_ratio": sqlite["burst_pause_s"] / etcd["burst_pause_s"],
        "failover_s": etcd["failover_s"],
        "config": vars(args),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--creates", type=int, default=4000)
    p.add_argument("--tasks", type=int, default=128)
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--shard-size", default="1MiB")
    p.add_argument("--quick", action="store_true", help="small figures, for a smoke run")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.creates, args.ranks, args.shard_size = 400, 64, "256KiB"
    result = trio.run(main_async, args)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for row in result["rows"]:
        extra = f", failover {row['failover_s']:.2f} s" if "failover_s" in row else ""
        print(
            f"{row['engine']:>6}: {row['creates_per_s']:8.0f} creates/s,"
            f" burst pause {row['burst_pause_s']:6.2f} s{extra}"
        )
    print(
        f"etcd/sqlite: creates {result['creates_ratio']:.2f}x (target >= 0.5),"
        f" burst {result['burst_pause_ratio']:.2f}x (target >= 0.5);"
        f" failover {result['failover_s']:.2f} s (target <= 5)"
    )


if __name__ == "__main__":
    main()
