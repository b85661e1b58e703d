"""Pieces several bench scripts share, so each figure is produced the same way everywhere."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tectonic_py.client.writer import FileWriter


async def write_repeated(w: FileWriter, piece: bytes, size: int) -> None:
    """Write ``size`` bytes to ``w`` as slices of ``piece`` (at most ``len(piece)`` per call),
    then close it: the data pattern is fixed so runs compare, and the close is part of the
    write (it commits the last block)."""
    left = size
    while left:
        n = min(left, len(piece))
        await w.write(memoryview(piece)[:n])
        left -= n
    await w.close()


def process_cpu(pid: int, live_children: bool = True) -> float:
    """CPU seconds (user + system) of process ``pid`` and of its children: those reaped and,
    with ``live_children``, those running, since a daemon's figure must include any helper
    process it starts; a bench that counts its own process passes False, since it lists
    the daemons it started itself.
    0 once the process is gone."""
    import psutil

    try:
        proc = psutil.Process(pid)
        t = proc.cpu_times()
        total = t.user + t.system + t.children_user + t.children_system
        for child in proc.children(recursive=True) if live_children else []:
            try:
                c = child.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += c.user + c.system
    except psutil.NoSuchProcess:
        return 0.0
    return total


def cpu_with(pids: list[int]) -> float:
    """CPU seconds of this process (its reaped children included) and of the processes
    ``pids`` with all their children: what a bench run costs, client and daemons."""
    return process_cpu(os.getpid(), live_children=False) + sum(map(process_cpu, pids))


def print_results(results: Any, as_json: bool, format_table: Callable[[Any], str]) -> None:
    """``--json``: one JSON object on a line (what run_all reads); otherwise the table."""
    if as_json:
        json.dump(results, sys.stdout)
        print()
    else:
        print(format_table(results))


def drop_cache(path: str) -> None:
    """Drop a file's cached pages so the next read reaches the filesystem (its daemon), not
    the page cache; only that file, since other processes share this machine's cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """Run ``cmd`` to completion (an error if it fails): ``(wall seconds, its CPU seconds)``,
    user + system from RUSAGE_CHILDREN, so a dd's CPU counts beside the daemons' CPU.
    ``env``: the command's environment (this process's when None)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return seconds, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def fuse_unmount(mountpoint: str | os.PathLike[str]) -> None:
    """``fusermount3 -u`` a mount if it is one, lazily (``-uz``) if it is busy: a benchmark
    must never leave a mount behind, even after a failed run."""
    if os.path.ismount(mountpoint):
        r = subprocess.run(
            ["fusermount3", "-u", os.fspath(mountpoint)], capture_output=True, check=False
        )
        if r.returncode != 0:
            subprocess.run(
                ["fusermount3", "-uz", os.fspath(mountpoint)], capture_output=True, check=False
            )


def reap(proc: subprocess.Popen[Any], exit_s: float, term_s: float) -> None:
    """Wait ``exit_s`` for a daemon we started to exit on its own (after its unmount), then
    SIGTERM it and wait ``term_s``, then SIGKILL: its PID only, and always reaped."""
    try:
        proc.wait(timeout=exit_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=term_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def warm_memory(nbytes: int = 6 * 1024**3) -> None:
    """Touch and free ``nbytes`` of memory, so the measured run that follows does not pay
    the first touch of guest pages.

    On these VMs free guest memory is handed back to the host (free page reporting), and the
    first touch of such a page costs a fault into the host, charged as system CPU to the
    process that touched it: whichever filesystem a bench ran first paid it for its page
    cache and buffers (measured in docs/byte-budget.md)."""
    import mmap

    piece = b"\1" * (64 * 1024 * 1024)
    with mmap.mmap(-1, nbytes) as mm:
        for _ in range(nbytes // len(piece)):
            mm.write(piece)
