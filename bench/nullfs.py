"""nullfs: a pyfuse3 + trio filesystem that discards every write and serves zeros.

It is the ceiling of a Python FUSE client on this machine: the kernel round trips, pyfuse3's
dispatch and trio, with no storage behind them. tectonic-py's FUSE figures are divided by
nullfs's, measured in the same run (docs/ceilings.md has what it reached on a project machine).

The namespace is real enough for the workloads we compare (dd, torch.save, cp, mkdir, rename,
unlink, truncate): directories and files with sizes, times and modes live in memory; only
file *contents* are discarded (a read returns zeros up to the file's size). The Operations
class is in ``bench.nullfs_operations``.

Use from another process (bench/bench_fuse.py does)::

    from bench.nullfs import nullfs_mounted
    with nullfs_mounted("/tmp/mnt") as mount:   # unmounted on exit, whatever happened
        ...                                      # mount.stats() after exit: bytes seen

or by hand: ``python -m bench.nullfs MOUNTPOINT [--ready-file F] [--stats-file F]``.
The mount runs in its own subprocess, so a benchmark's own CPU is never mixed with the
daemon's, and a crash of either cannot hang the other.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import drop_cache, fuse_unmount, reap, run_timed

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
MiB = 1024 * 1024


# --- the filesystem (runs in the mount's own process) ----------------------------------------


def _make_operations() -> Any:
    """Import the Operations lazily: importing this module must not need pyfuse3 (the test
    suite imports the helpers on machines without FUSE)."""
    from bench.nullfs_operations import NullOperations

    return NullOperations()


def serve(mountpoint: str, ready_file: str | None, stats_file: str | None) -> None:
    """Mount, serve until unmounted or signalled, then write the byte counters."""
    import pyfuse3
    import trio

    ops = _make_operations()
    options = set(pyfuse3.default_options)
    options.add("fsname=nullfs")
    options.discard("default_permissions")
    pyfuse3.init(ops, mountpoint, options)

    async def main() -> None:
        async with trio.open_nursery() as nursery:

            async def on_signal() -> None:
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for _ in signals:
                        pyfuse3.terminate()
                        return

            nursery.start_soon(on_signal)
            if ready_file:
                _write_atomic(
                    ready_file, json.dumps({"mountpoint": mountpoint, "pid": os.getpid()})
                )
            await pyfuse3.main()
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        pyfuse3.close(unmount=True)
        if stats_file:
            _write_atomic(
                stats_file,
                json.dumps(
                    {
                        "bytes_written": ops.bytes_written,
                        "bytes_read": ops.bytes_read,
                        "writes": ops.writes,
                        "reads": ops.reads,
                    }
                ),
            )


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


# --- the helpers benchmarks use ----------------------------------------------------------------


class NullFSError(RuntimeError):
    """The nullfs mount could not be started (no /dev/fuse, no permission, bad mountpoint)."""


@dataclass
class NullMount:
    """A running nullfs mount: its mountpoint, process, and (after unmount) its counters."""

    mountpoint: str
    proc: subprocess.Popen[bytes]
    stats_file: str
    workdir: str

    final_stats: dict[str, int] = field(default_factory=dict)

    def stats(self) -> dict[str, int]:
        """Bytes and calls the daemon saw; complete once the mount is gone."""
        if self.final_stats:
            return dict(self.final_stats)
        try:
            with open(self.stats_file) as f:
                return dict(json.load(f))
        except (OSError, ValueError):
            return {}


def fuse_available() -> str | None:
    """None when FUSE mounts can be made here, else the reason they cannot."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not readable and writable by this user"
    if not any(
        os.access(os.path.join(d, "fusermount3"), os.X_OK)
        for d in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep)
    ):
        return "fusermount3 is not installed"
    try:
        import pyfuse3  # noqa: F401
    except ImportError as e:
        return f"pyfuse3 cannot be imported: {e}"
    return None


def set_read_ahead(mountpoint: str | os.PathLike[str], kb: int) -> bool:
    """Raise the mount's read_ahead_kb (its backing-device entry in /sys/class/bdi): FUSE
    reads arrive in 128 KiB pieces otherwise, and 1 MiB reads are much cheaper per byte
    (docs/ceilings.md). False if this host does not let us (not root, no sysfs)."""
    dev = os.stat(mountpoint).st_dev
    path = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(kb))
        return True
    except OSError as e:
        log.info("cannot set %s: %s", path, e)
        return False


def mount_nullfs(
    mountpoint: str | os.PathLike[str], *, read_ahead_kb: int | None = 1024, timeout: float = 30
) -> NullMount:
    """Start ``python -m bench.nullfs`` on ``mountpoint`` and wait until it serves.

    The caller must call ``unmount`` (or use ``nullfs_mounted``, which always does).
    """
    reason = fuse_available()
    if reason:
        raise NullFSError(f"cannot mount nullfs: {reason}")
    mountpoint = os.fspath(mountpoint)
    os.makedirs(mountpoint, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="nullfs-")
    ready, stats_file = os.path.join(workdir, "ready"), os.path.join(workdir, "stats")
    with open(os.path.join(workdir, "stderr"), "wb") as stderr:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.nullfs",
                mountpoint,
                "--ready-file",
                ready,
                "--stats-file",
                stats_file,
            ],
            cwd=REPO_ROOT,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    mount = NullMount(mountpoint, proc, stats_file, workdir)
    deadline = time.monotonic() + timeout
    while not os.path.exists(ready):
        if proc.poll() is not None or time.monotonic() > deadline:
            err = Path(workdir, "stderr").read_text(errors="replace").strip()
            unmount(mount)
            raise NullFSError(f"nullfs did not come up on {mountpoint}: {err[-500:] or 'timeout'}")
        time.sleep(0.02)
    if read_ahead_kb:
        set_read_ahead(mountpoint, read_ahead_kb)
    return mount


def unmount(mount: NullMount, timeout: float = 15) -> None:
    """Unmount and reap the daemon. Lazy unmount if busy; SIGKILL (its PID only) as a last
    resort, so a benchmark never leaves a dead mount or a stray process behind."""
    fuse_unmount(mount.mountpoint)
    reap(mount.proc, timeout, 5)
    if os.path.ismount(mount.mountpoint):
        subprocess.run(["fusermount3", "-uz", mount.mountpoint], capture_output=True, check=False)
    mount.final_stats = mount.stats()
    shutil.rmtree(mount.workdir, ignore_errors=True)


@contextmanager
def nullfs_mounted(
    mountpoint: str | os.PathLike[str], *, read_ahead_kb: int | None = 1024
) -> Iterator[NullMount]:
    """A nullfs mount for the body of a with-statement; always unmounted afterwards."""
    mount = mount_nullfs(mountpoint, read_ahead_kb=read_ahead_kb)
    try:
        yield mount
    finally:
        unmount(mount)


# --- a self-measurement: dd through the mount ----------------------------------------------------


def dd_through(mountpoint: str, size: int, block: int = MiB) -> dict[str, Any]:
    """dd write (conv=fsync) then dd read of one file on a mount, with the process's own CPU.

    Used for nullfs here and for the peer's mount in bench/gluster.py.
    """
    path = os.path.join(mountpoint, "dd.bin")
    count = max(1, size // block)
    out: dict[str, Any] = {}
    for name, cmd in (
        (
            "dd_write",
            ["dd", "if=/dev/zero", f"of={path}", f"bs={block}", f"count={count}", "conv=fsync"],
        ),
        ("dd_read", ["dd", f"if={path}", "of=/dev/null", f"bs={block}"]),
    ):
        if name == "dd_read":
            drop_cache(path)
        seconds, cpu = run_timed(cmd)
        nbytes = count * block
        out[name] = {
            "name": name,
            "bytes": nbytes,
            "seconds": round(seconds, 4),
            "mbps": round(nbytes / seconds / 1e6, 1),
            "client_cpu_s": round(cpu, 3),
        }
    os.unlink(path)
    return out


def measure(size: int = 2 * 1024 * MiB) -> dict[str, Any]:
    """The nullfs ceiling: dd write and read of ``size`` bytes, with the daemon's CPU."""
    import psutil

    with tempfile.TemporaryDirectory(prefix="nullfs-mnt-") as mnt:
        with nullfs_mounted(mnt) as mount:
            daemon = psutil.Process(mount.proc.pid)
            results: dict[str, Any] = {}
            for name, r in dd_through(mnt, size).items():
                results[name] = r
            cpu = daemon.cpu_times()
            results["daemon_cpu_s"] = round(cpu.user + cpu.system, 3)
        results["daemon_stats"] = mount.stats()
    gib = size / (1024 * MiB)
    for key in ("dd_write", "dd_read"):
        results[key]["name"] = f"nullfs_{key}"
    results["cpu_s_per_gib"] = round(
        (
            results["daemon_cpu_s"]
            + results["dd_write"]["client_cpu_s"]
            + results["dd_read"]["client_cpu_s"]
        )
        / (2 * gib),
        3,
    )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="nullfs: the Python FUSE ceiling")
    parser.add_argument("mountpoint", nargs="?", help="serve a mount here (foreground)")
    parser.add_argument("--ready-file", help="written once the mount serves")
    parser.add_argument("--stats-file", help="byte counters written at exit")
    parser.add_argument("--measure", action="store_true", help="mount in a tmp dir and dd it")
    parser.add_argument("--smoke", action="store_true", help="with --measure: 16 MiB only")
    parser.add_argument("--json", action="store_true", help="with --measure: JSON on stdout")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.measure or args.smoke:
        try:
            results = measure(16 * MiB if args.smoke else 2 * 1024 * MiB)
        except NullFSError as e:
            print(f"nullfs: {e}", file=sys.stderr)
            return 2
        print(json.dumps(results) if args.json else json.dumps(results, indent=2))
        return 0
    if not args.mountpoint:
        parser.error("a mountpoint (or --measure) is required")
    serve(args.mountpoint, args.ready_file, args.stats_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
