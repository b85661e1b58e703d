"""``tectonic commit`` of a checkpoint step of many files: its time and its metadata ops.

A local cluster (2 metadata servers, 16 shards, 6 chunk stores) under a temporary
directory; a step of ``--files`` small files (4 KiB each, written by 64 concurrent writers
in a few subdirectories as DCP and torch.save jobs lay them out: one directory of rank
files, one per optimizer shard group) is written under ``<step>.staging-bench``, then
committed with ``--latest latest``: the sealed walk and the one ``name.commit``
transaction. Each metadata RPC the commit sends is counted by op (the client's ``_call``
wrapped), so the figure is "ops per commit", not a guess. The commit is timed end to end
as ``tectonic commit`` runs it (path lookups included), three times, and
the median is printed beside the cost of one ``rename`` of the same directory (the
non-atomic way: one Name-layer transaction, no sealed check), which also puts the step
back under its staging name for the next commit (one write, three commits).

``python -m bench.bench_commit [--files N] [--json]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import trio

from tectonic_py.cli.commit import commit_paths
from tectonic_py.client.tectonic_client import TectonicClient, open_client
from tectonic_py.launch.local_cluster import LocalCluster

SUBDIRS = 4
WRITERS = 64
FILE_BYTES = 4096


async def _write_step(client: TectonicClient, staging: str, files: int) -> None:
    for d in range(SUBDIRS):
        await client.mkdir(f"{staging}/group_{d}", parents=True)
    payload = b"\x5a" * FILE_BYTES
    queue = list(range(files))

    async def writer() -> None:
        while queue:
            i = queue.pop()
            w = await client.create(f"{staging}/group_{i % SUBDIRS}/__{i}_0.distcp")
            await w.write(payload)
            await w.close()

    async with trio.open_nursery() as nursery:
        for _ in range(WRITERS):
            nursery.start_soon(writer)


def _count_calls(client: TectonicClient) -> Counter[str]:
    """Count every metadata RPC the client sends from now on, by op (until the instance
    attribute is deleted again)."""
    counts: Counter[str] = Counter()
    meta = client.meta
    inner = meta._call

    async def counted(address: str, op: str, fields: dict[str, Any], **how: Any) -> dict[str, Any]:
        counts[op] += 1
        return await inner(address, op, fields, **how)

    meta._call = counted  # type: ignore[method-assign]
    return counts


async def run(files: int, root: Path) -> dict[str, Any]:
    with LocalCluster(root, chunkstores=6, metadata_servers=2, shards=16, ec="rs-4-2") as c:
        async with open_client(c.cluster_file) as client:
            times, rename_times, ops = [], [], Counter[str]()
            staging = "/ck/step.staging-bench"
            start = time.perf_counter()
            await _write_step(client, staging, files)
            write_s = time.perf_counter() - start
            for trial in range(3):
                counts = _count_calls(client)
                start = time.perf_counter()
                r = await commit_paths(client, staging, f"/ck/step_{trial}", latest="latest")
                times.append(time.perf_counter() - start)
                del client.meta._call  # the class's own again
                assert r["files"] == files, r
                ops = counts
                # Back under the staging name for the next trial: the same tree walked again.
                start = time.perf_counter()
                await client.rename(f"/ck/step_{trial}", staging)
                rename_times.append(time.perf_counter() - start)
            return {
                "files": files,
                "dirs": SUBDIRS + 1,
                "write_s": round(write_s, 2),
                "commit_s_median": round(statistics.median(times), 4),
                "commit_s_all": [round(t, 4) for t in times],
                "rename_s_median": round(statistics.median(rename_times), 4),
                "metadata_ops": sum(ops.values()),
                "metadata_ops_by_op": dict(sorted(ops.items())),
            }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=4096)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-commit-") as tmp:
        result = trio.run(run, args.files, Path(tmp) / "cluster")
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:>20}: {value}")


if __name__ == "__main__":
    main()
