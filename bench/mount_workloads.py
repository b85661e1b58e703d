"""Workloads run against any mounted filesystem: ours, the nullfs ceiling, or the peer.

The same functions measure every mount so the figures are comparable:

* ``dd_workload``: ``dd bs=1M conv=fsync`` write, then a cold ``dd`` read;
* ``torch_workload``: ``torch.save`` of a state dict followed by an fsync of the file (the GPU
  pause ends when the checkpoint is durable), then a cold ``torch.load`` whose tensors are
  checked against what was saved.

The torch process runs with one OpenMP thread (``OMP_NUM_THREADS=1``), on every mount alike.
Why: on a 2-core machine torch's thread pool spins between tensors and takes the core the
FUSE daemon needs (the measurement is in docs/decisions/2026-12-01-torch-one-thread.md). A
GPU node has dozens of idle cores, so one thread is the closer model of a trainer's restore,
and it measures the filesystem rather than the scheduler.

"Cold" means the mount's caches hold nothing of the file: the caller passes ``remount`` (the
peer is unmounted and mounted again, which empties its client-side caches too) or the
file's kernel pages are dropped with POSIX_FADV_DONTNEED.

CPU-seconds per GiB count every process involved: the workload's own (``dd`` via rusage,
the torch process measures itself, excluding interpreter start and import) plus the
filesystem's daemons, found by ``daemon_pids()`` *after* any remount.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import drop_cache, run_timed, warm_memory
from tectonic_py.loadtest import CpuMeter

REPO_ROOT = Path(__file__).resolve().parent.parent
MiB = 1024 * 1024
GiB = 1024 * MiB
TENSOR_BYTES = 64 * MiB

PidsFn = Callable[[], list[int]]

# One OpenMP thread for the torch worker, on every mount alike (module docstring).
TORCH_ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def _figure(name: str, nbytes: int, seconds: float, cpu_s: float, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "bytes": nbytes,
        "seconds": round(seconds, 4),
        "mbps": round(nbytes / max(seconds, 1e-9) / 1e6, 1),
        "cpu_s": round(cpu_s, 3),
        "cpu_s_per_gib": round(cpu_s / (nbytes / GiB), 3) if nbytes else None,
        **extra,
    }


def _cold(path: str, remount: Callable[[], None] | None) -> None:
    if remount is not None:
        remount()
    else:
        drop_cache(path)


def dd_workload(
    mountpoint: str,
    size: int,
    daemon_pids: PidsFn = list,
    remount: Callable[[], None] | None = None,
    block: int = MiB,
) -> dict[str, dict[str, Any]]:
    """dd write with conv=fsync, then a cold dd read of the same file; the file is removed."""
    path = os.path.join(mountpoint, "bench-dd.bin")
    count = max(1, size // block)
    nbytes = count * block
    out: dict[str, dict[str, Any]] = {}
    try:
        for name, cmd in (
            (
                "dd_write",
                ["dd", "if=/dev/zero", f"of={path}", f"bs={block}", f"count={count}", "conv=fsync"],
            ),
            ("dd_read", ["dd", f"if={path}", "of=/dev/null", f"bs={block}"]),
        ):
            if name == "dd_read":
                _cold(path, remount)
            meter = CpuMeter(daemon_pids())
            seconds, client = run_timed(cmd)
            daemons = meter.used()
            out[name] = _figure(
                name,
                nbytes,
                seconds,
                client + daemons,
                client_cpu_s=round(client, 3),
                daemon_cpu_s=round(daemons, 3),
            )
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return out


def torch_workload(
    mountpoint: str,
    size: int,
    daemon_pids: PidsFn = list,
    remount: Callable[[], None] | None = None,
    groups: dict[str, list[int]] | None = None,
    verbs: tuple[str, ...] = ("save", "load"),
) -> dict[str, dict[str, Any]]:
    """torch.save (+ fsync) then a cold, verified torch.load of ``size`` bytes of tensors.

    Each runs in a fresh ``python -m bench.mount_workloads`` process that times only the
    call itself, so interpreter start and ``import torch`` are not charged to the mount.
    ``groups`` names subsets of the daemons whose CPU-seconds are also given apart
    (``cpu_s_by_process``), for a byte budget.
    """
    path = os.path.join(mountpoint, "bench-state.pt")
    out: dict[str, dict[str, Any]] = {}
    try:
        for verb in verbs:
            name = f"torch_{verb}"
            if verb == "load":
                _cold(path, remount)
            warm_memory(min(6 * GiB, 4 * size))  # what a save of size may touch afresh
            pids = daemon_pids()
            proc = subprocess.Popen(
                [sys.executable, "-m", "bench.mount_workloads", verb, path, str(size)],
                cwd=REPO_ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=TORCH_ENV,
            )
            assert proc.stdout is not None and proc.stdin is not None
            ready = proc.stdout.readline()  # the state dict is built; start measuring
            if not ready.startswith("ready"):
                err = proc.communicate(timeout=60)[1]
                raise RuntimeError(f"torch {verb} worker failed: {err[-800:]}")
            meter = CpuMeter(pids)
            apart = {g: CpuMeter(p) for g, p in (groups or {}).items()}
            stdout, stderr = proc.communicate("go\n", timeout=3600)
            daemons = meter.used()
            by_process = {g: round(m.used(), 3) for g, m in apart.items()}
            if proc.returncode != 0:
                raise RuntimeError(f"torch {verb} failed: {stderr[-800:]}")
            r = json.loads(stdout.strip().splitlines()[-1])
            out[name] = _figure(
                name,
                r["bytes"],
                r["seconds"],
                r["cpu_s"] + daemons,
                client_cpu_s=round(r["cpu_s"], 3),
                daemon_cpu_s=round(daemons, 3),
                **(
                    {"cpu_s_by_process": {"torch": round(r["cpu_s"], 3), **by_process}}
                    if groups
                    else {}
                ),
                **{k: v for k, v in r.items() if k not in ("bytes", "seconds", "cpu_s")},
            )
            if verb == "load" and not r.get("verified"):
                raise RuntimeError(f"torch.load from {mountpoint} returned wrong tensors")
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return out


# --- the torch side (its own process) -----------------------------------------------------


def _state_dict(size: int) -> dict[str, Any]:
    """``size`` bytes of float32 tensors of up to 64 MiB: a seeded random base plus the
    tensor's index, so every tensor differs and a load can be checked exactly."""
    import torch

    g = torch.Generator().manual_seed(1234)
    n_full, rest = divmod(size, TENSOR_BYTES)
    base = torch.rand(TENSOR_BYTES // 4, generator=g)
    sd: dict[str, Any] = {}
    for i in range(n_full):
        sd[f"layer{i}.weight"] = base + i
    if rest >= 4:
        sd[f"layer{n_full}.weight"] = base[: rest // 4] + n_full
    return sd


def _torch_main(verb: str, path: str, size: int) -> int:
    import torch

    expected = _state_dict(size)
    print("ready", flush=True)
    sys.stdin.readline()
    c0, t0 = time.process_time(), time.perf_counter()
    result: dict[str, Any] = {}
    if verb == "save":
        torch.save(expected, path)
        t_saved = time.perf_counter()
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        seconds = time.perf_counter() - t0
        result = {"save_s": round(t_saved - t0, 4), "fsync_s": round(seconds - (t_saved - t0), 4)}
    else:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
        seconds = time.perf_counter() - t0
        result = {
            "verified": set(loaded) == set(expected)
            and all(torch.equal(loaded[k], expected[k]) for k in expected)
        }
    cpu = time.process_time() - c0
    result.update(bytes=os.path.getsize(path), seconds=seconds, cpu_s=cpu)
    print(json.dumps(result), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one torch.save/torch.load, self-timed")
    parser.add_argument("verb", choices=["save", "load"])
    parser.add_argument("path")
    parser.add_argument("size", type=int)
    args = parser.parse_args(argv)
    return _torch_main(args.verb, args.path, args.size)


if __name__ == "__main__":
    sys.exit(main())
