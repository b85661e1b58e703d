"""bench_dcp: torch.distributed.checkpoint save and load, native client against the FUSE mount.

One LocalCluster (2 metadata servers, 9 chunk stores, RS(6,3)) and ``tectonic mount`` of it
in its own process. ``--ranks`` gloo processes on 127.0.0.1 hold a state dict of ``--size``
bytes in all, 16 DTensors sharded over the ranks, and save it twice: through
``TectonicWriter`` (the client library in each rank, no kernel hop) and through DCP's own
``FileSystemWriter`` into a directory of the mount (its defaults: fsync of every file); the
native save runs once more from the same ranks, to another step (``native_save_again``: a job
saves many times, and its second save finds the client connected and its allocator warm,
where the first pays the page faults of fresh buffers, charged as system time here). Fresh
rank processes then load each checkpoint (``TectonicReader``, ``FileSystemReader`` on the
mount) and check every byte, unmeasured. Both writers write ``--threads`` files per rank.

Each phase is timed between barriers of all ranks (the time of the slowest rank, which is
the GPUs' pause), and its CPU-seconds per GiB are summed over every process involved: the
ranks (all their threads), the mount process and every cluster daemon. The figures: MB/s
(10^6 bytes/s), CPU-s/GiB, the ranks' user and system time and page faults, the machine's
disk writes and busy time (/proc/diskstats: the
disk is shared by both paths, so a save bound by it cannot differ much), and the ratios
native / mount (the issue's target: save and load at least 1.5x through the native client).

``python -m bench.bench_dcp [--size MiB] [--ranks 4] [--threads N] [--json] [--dir D]``
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.bench_fuse import tectonic_mounted
from bench.common import print_results, process_cpu
from tectonic_py.native.dcp import DEFAULT_WRITE_THREADS

MiB = 1024 * 1024
GiB = 1024 * MiB
TENSORS = 16
NATIVE_DIR = "/bench/native"
MOUNT_DIR = "bench/mount"  # relative to the mount point


def _local_shards(rank: int, world: int, size: int) -> dict[str, Any]:
    """This rank's shards of the TENSORS float32 tensors (rows of 1024 values), a pattern of
    rank and tensor so a loading rank can check what it got without any other rank's data.
    Counters, not random numbers: generating a random state dict per rank took minutes of a
    loaded 2-vCPU machine before anything was measured."""
    import torch

    rows = max(1, size // TENSORS // 4 // 1024 // world)
    n = rows * 1024
    return {
        f"layer{i}.weight": torch.arange(
            (rank * TENSORS + i) * n, (rank * TENSORS + i + 1) * n, dtype=torch.int64
        )
        .to(torch.int32)
        .view(torch.float32)
        .view(rows, 1024)
        for i in range(TENSORS)
    }


def _state_dict(mesh: Any, rank: int, world: int, size: int, *, empty: bool) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import DTensor, Shard

    shards = _local_shards(rank, world, size)
    if empty:
        shards = {k: torch.zeros_like(v) for k, v in shards.items()}
    return {k: DTensor.from_local(v, mesh, [Shard(0)]) for k, v in shards.items()}


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _self_usage() -> tuple[float, float, int]:
    """User and system CPU seconds and minor page faults of this rank: a first touch of
    fresh memory is charged as system time on these VMs (bench.common.warm_memory)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_minflt


def _disk() -> tuple[int, int]:
    """Bytes written to, and milliseconds busy of, the machine's disks so far (Linux's
    /proc/diskstats, whole disks only): whether a save waited on the disk, which both
    writers share, rather than on either path's CPU. Zeros where there is no such file."""
    written = busy = 0
    try:
        lines = Path("/proc/diskstats").read_text().splitlines()
    except OSError:
        return 0, 0
    for line in lines:
        f = line.split()
        if len(f) > 12 and os.path.exists(f"/sys/block/{f[2]}/device"):
            written += int(f[9]) * 512
            busy += int(f[12])
    return written, busy


def _phase(name: str, nbytes: int, pids: list[int], run: Any) -> dict[str, Any] | None:
    """Run ``run()`` on every rank between barriers; rank 0 gets the phase's figures."""
    import torch.distributed as dist

    dist.barrier()
    rank0 = dist.get_rank() == 0
    others0 = sum(map(process_cpu, pids)) if rank0 else 0.0
    disk0 = _disk()
    usage0, t0 = _self_usage(), time.perf_counter()
    run()
    dist.barrier()
    seconds = time.perf_counter() - t0
    usage = [b - a for a, b in zip(usage0, _self_usage())]
    disk1 = _disk()
    others = sum(map(process_cpu, pids)) - others0 if rank0 else 0.0
    per_rank: list[list[float]] = [[0.0, 0.0, 0.0]] * dist.get_world_size()
    dist.all_gather_object(per_rank, usage)
    if not rank0:
        return None
    gib = nbytes / GiB
    cpu = sum(u + s for u, s, _ in per_rank) + others
    return {
        "name": name,
        "bytes": nbytes,
        "seconds": round(seconds, 3),
        "mbps": round(nbytes / seconds / 1e6, 1),
        "cpu_s": round(cpu, 2),
        "cpu_s_per_gib": round(cpu / (nbytes / GiB), 3),
        "ranks_cpu_s": round(sum(u + s for u, s, _ in per_rank), 2),
        "ranks_user_s_per_gib": round(sum(u for u, _, _ in per_rank) / gib, 3),
        "ranks_sys_s_per_gib": round(sum(s for _, s, _ in per_rank) / gib, 3),
        "ranks_faults_per_gib": round(sum(f for _, _, f in per_rank) / gib),
        "disk_written_mb": round((disk1[0] - disk0[0]) / 1e6),
        "disk_busy_s": round((disk1[1] - disk0[1]) / 1000, 1),
    }


def _rank_main(rank: int, world: int, port: int, job: dict[str, Any], phase: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh

    from tectonic_py.client.sync_client import shared_client
    from tectonic_py.native.dcp import TectonicReader, TectonicWriter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # as bench_fuse: torch's spinning pool would take the cores
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        size, threads, cluster, pids = job["size"], job["threads"], job["cluster"], job["pids"]
        nbytes = sum(t.nbytes for t in _local_shards(0, world, size).values()) * world
        mounted = os.path.join(job["mountpoint"], MOUNT_DIR)
        # A training job connects once and checkpoints many times; so is the mount connected.
        shared_client(cluster).stat("/")
        results = []
        if phase == "save":
            sd = _state_dict(mesh, rank, world, size, empty=False)
            results.append(
                _phase(
                    "native_save",
                    nbytes,
                    pids,
                    lambda: dcp.save(
                        sd,
                        storage_writer=TectonicWriter(
                            NATIVE_DIR, cluster=cluster, thread_count=threads
                        ),
                    ),
                )
            )
            results.append(
                _phase(
                    "native_save_again",
                    nbytes,
                    pids,
                    lambda: dcp.save(
                        sd,
                        storage_writer=TectonicWriter(
                            NATIVE_DIR + "_again", cluster=cluster, thread_count=threads
                        ),
                    ),
                )
            )
            results.append(
                _phase(
                    "mount_save",
                    nbytes,
                    pids,
                    lambda: dcp.save(
                        sd, storage_writer=FileSystemWriter(mounted, thread_count=threads)
                    ),
                )
            )
        else:
            native = _state_dict(mesh, rank, world, size, empty=True)
            results.append(
                _phase(
                    "native_load",
                    nbytes,
                    pids,
                    lambda: dcp.load(
                        native, storage_reader=TectonicReader(NATIVE_DIR, cluster=cluster)
                    ),
                )
            )
            mount = _state_dict(mesh, rank, world, size, empty=True)
            results.append(
                _phase(
                    "mount_load",
                    nbytes,
                    pids,
                    lambda: dcp.load(mount, storage_reader=FileSystemReader(mounted)),
                )
            )
            want = _local_shards(rank, world, size)
            for got in (native, mount):
                for k, v in got.items():
                    assert torch.equal(v.to_local(), want[k]), f"rank {rank}: {k} differs"
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(ranks: int, job: dict[str, Any], phase: str, out: Path) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    mp.start_processes(
        _rank_main,
        args=(ranks, _free_port(), job, phase, str(out)),
        nprocs=ranks,
        join=True,
        start_method="spawn",
    )
    return list(json.loads(out.read_text()))


def measure(size: int, ranks: int, threads: int, workdir: Path) -> dict[str, Any]:
    from tectonic_py.launch.local_cluster import LocalCluster

    results: dict[str, Any] = {}
    with LocalCluster(workdir / "cluster", chunkstores=9, metadata_servers=2, ec="rs-6-3") as c:
        mnt = workdir / "mnt"
        with tectonic_mounted(c.cluster_file, mnt, workdir / "mount.log") as mount_pid:
            (mnt / MOUNT_DIR).mkdir(parents=True)
            job = {
                "size": size,
                "threads": threads,
                "cluster": str(c.cluster_file),
                "mountpoint": str(mnt),
                "pids": [mount_pid, *c.pids()],
            }
            for phase in ("save", "load"):
                for r in _spawn(ranks, job, phase, workdir / f"{phase}.json"):
                    results[r["name"]] = r
                    print(
                        f"  {r['name']}: {r['mbps']:,.0f} MB/s, {r['cpu_s_per_gib']} CPU-s/GiB",
                        file=sys.stderr,
                        flush=True,
                    )

    def speedup(a: str, b: str) -> float:
        return round(results[b]["seconds"] / results[a]["seconds"], 3)

    results["ratios"] = {
        "native_save_vs_mount_save (target >= 1.5)": speedup("native_save", "mount_save"),
        "native_save_again_vs_mount_save": speedup("native_save_again", "mount_save"),
        "native_load_vs_mount_load (target >= 1.5)": speedup("native_load", "mount_load"),
        "cpu_s_per_gib_save native / mount": round(
            results["native_save"]["cpu_s_per_gib"] / results["mount_save"]["cpu_s_per_gib"], 3
        ),
        "cpu_s_per_gib_load native / mount": round(
            results["native_load"]["cpu_s_per_gib"] / results["mount_load"]["cpu_s_per_gib"], 3
        ),
    }
    results["setup"] = {"ranks": ranks, "threads_per_rank": threads, "bytes": size}
    return results


def format_table(results: dict[str, Any]) -> str:
    lines = [
        (
            "| run | s | MB/s | CPU-s/GiB (all processes) | CPU-s of the ranks | of the rest "
            "| ranks' user / system CPU-s per GiB | ranks' page faults per GiB "
            "| disk MB written | disk busy s |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        if name not in ("ratios", "setup"):
            rest = round(r["cpu_s"] - r["ranks_cpu_s"], 2)
            lines.append(
                f"| {name} | {r['seconds']} | {r['mbps']:,.0f} | {r['cpu_s_per_gib']} "
                f"| {r['ranks_cpu_s']} | {rest} "
                f"| {r['ranks_user_s_per_gib']} / {r['ranks_sys_s_per_gib']} "
                f"| {r['ranks_faults_per_gib']:,} | {r['disk_written_mb']} | {r['disk_busy_s']} |"
            )
    lines += ["", "| ratio | value |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in results["ratios"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=256, help="state dict MiB (default 256)")
    parser.add_argument("--ranks", type=int, default=4, help="gloo ranks (default 4)")
    parser.add_argument(
        "--threads",
        type=int,
        default=DEFAULT_WRITE_THREADS,
        help=f"files written at once per rank, both writers (default {DEFAULT_WRITE_THREADS})",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--dir", help="work directory on local disk (default: a tmp dir)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-dcp-") as tmp:
        results = measure(args.size * MiB, args.ranks, args.threads, Path(tmp))
    print_results(results, args.json, format_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
