"""Many writers, then many readers, in ONE client process: peak RSS growth per phase against
the client's own memory bounds, and read MB/s.

Why: a burst worker's RSS is one figure for both phases; only a measurement per phase says
whether the writers or the readers overran their bound
(docs/decisions/2026-12-01-client-memory-per-phase.md). The ceiling each figure is printed
against is the bound the client promises in the same run: window_bytes (+ two spare
buffers) for writes, cache_bytes for reads.

    .venv/bin/python -m bench.bench_many_clients --writers 64 --size-mib 16
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time

import psutil
import trio

from tectonic_py.client.tectonic_client import (
    DEFAULT_CACHE_BYTES,
    DEFAULT_WINDOW_BYTES,
    open_client,
)
from tectonic_py.launch.local_cluster import LocalCluster

log = logging.getLogger(__name__)
MiB = 1024 * 1024


async def _run(cluster_file: str, writers: int, size: int) -> dict[str, float]:
    proc = psutil.Process()
    peak = [0]
    piece = bytes(range(256)) * (MiB // 256)

    async def sampler() -> None:
        while True:
            peak[0] = max(peak[0], proc.memory_info().rss)
            await trio.sleep(0.02)

    out: dict[str, float] = {}
    async with open_client(cluster_file) as client, trio.open_nursery() as nursery:
        nursery.start_soon(sampler)
        await client.mkdir("/many")

        async def write(i: int) -> None:
            w = await client.create(f"/many/{i}")
            for _ in range(size // MiB):
                await w.write(piece)
            await w.close()

        async def read(i: int) -> None:
            r = await client.open_read(f"/many/{i}")
            offset = 0
            while offset < size:
                got = await r.pread(offset, MiB)
                if got != piece:
                    raise RuntimeError(f"file {i}: wrong bytes at {offset}")
                offset += len(got)

        for phase, fn in (("write", write), ("read", read)):
            base = proc.memory_info().rss
            peak[0] = base
            t0, cpu0 = time.monotonic(), time.process_time()
            async with trio.open_nursery() as workers:
                for i in range(writers):
                    workers.start_soon(fn, i)
            out[f"{phase}_s"] = time.monotonic() - t0
            out[f"{phase}_client_cpu_s"] = time.process_time() - cpu0
            out[f"{phase}_rss_growth"] = peak[0] - base
        nursery.cancel_scope.cancel()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writers", type=int, default=64)
    parser.add_argument("--size-mib", type=int, default=16)
    args = parser.parse_args(argv)
    size = args.size_mib * MiB
    with tempfile.TemporaryDirectory(prefix="bench-many-") as tmp:
        cluster = LocalCluster(f"{tmp}/cluster", chunkstores=9, metadata_servers=1, shards=16)
        cluster.start()
        try:
            r = trio.run(_run, str(cluster.cluster_file), args.writers, size)
        finally:
            cluster.stop()
    total = args.writers * size
    block = 6 * 4 * MiB
    write_bound = DEFAULT_WINDOW_BYTES + 2 * block
    print(f"{args.writers} x {args.size_mib} MiB in one client process")
    print(
        f"write: {total / r['write_s'] / 1e6:.0f} MB/s, client {r['write_client_cpu_s']:.1f}"
        f" CPU-s, peak RSS growth {r['write_rss_growth'] / MiB:.0f} MiB ="
        f" {r['write_rss_growth'] / write_bound:.2f} x the window + 2 spare blocks"
    )
    print(
        f"read:  {total / r['read_s'] / 1e6:.0f} MB/s, client {r['read_client_cpu_s']:.1f}"
        f" CPU-s, peak RSS growth {r['read_rss_growth'] / MiB:.0f} MiB ="
        f" {r['read_rss_growth'] / DEFAULT_CACHE_BYTES:.2f} x the read budget (cache_bytes)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
