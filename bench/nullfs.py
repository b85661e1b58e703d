"""nullfs: a pyfuse3 + trio filesystem that discards every write and serves zeros.

It is the ceiling of a Python FUSE client on this machine: the kernel round trips, pyfuse3's
dispatch and trio, with no storage behind them. tectonic-py's FUSE figures are divided by
nullfs's, measured in the same run (shared/CEILINGS.md: about 1.8 GB/s for dd write, 2 GB/s
for a cold dd read, 3.6 GB/s with read_ahead_kb raised to 1 MiB).

The namespace is real enough for the workloads we compare (dd, torch.save, cp, mkdir, rename,
unlink, truncate): directories and files with sizes, times and modes live in memory; only
file *contents* are discarded (a read returns zeros up to the file's size).

Use from another process (the FUSE engineer's bench does)::

    from bench.nullfs import nullfs_mounted
    with nullfs_mounted("/tmp/mnt") as mount:   # unmounted on exit, whatever happened
        ...                                      # mount.stats() after exit: bytes seen

or by hand: ``python -m bench.nullfs MOUNTPOINT [--ready-file F] [--stats-file F]``.
The mount runs in its own subprocess, so a benchmark's own CPU is never mixed with the
daemon's, and a crash of either cannot hang the other.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import shutil
import signal
import stat
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
    """Build the Operations class lazily: importing this module must not need pyfuse3 (the
    test suite imports the helpers on machines without FUSE)."""
    import pyfuse3

    @dataclass
    class Node:
        inode: int
        mode: int
        size: int = 0
        nlink: int = 1
        mtime_ns: int = field(default_factory=time.time_ns)
        children: dict[bytes, int] | None = None

    class NullOperations(pyfuse3.Operations):  # type: ignore[misc]
        """In-memory namespace; contents discarded on write and zeros on read."""

        supports_dot_lookup = False
        enable_writeback_cache = False

        def __init__(self) -> None:
            super().__init__()
            root = Node(pyfuse3.ROOT_INODE, stat.S_IFDIR | 0o755, nlink=2, children={})
            self.nodes: dict[int, Node] = {root.inode: root}
            self.next_inode = pyfuse3.ROOT_INODE + 1
            self.zeros: dict[int, bytes] = {}
            self.bytes_written = 0
            self.bytes_read = 0
            self.writes = 0
            self.reads = 0

        # helpers
        def _node(self, inode: int) -> Node:
            node = self.nodes.get(inode)
            if node is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return node

        def _dir(self, inode: int) -> Node:
            node = self._node(inode)
            if node.children is None:
                raise pyfuse3.FUSEError(errno.ENOTDIR)
            return node

        def _attr(self, node: Node) -> Any:
            a = pyfuse3.EntryAttributes()
            a.st_ino = node.inode
            a.st_mode = node.mode
            a.st_nlink = node.nlink
            a.st_size = node.size
            a.st_uid = os.getuid()
            a.st_gid = os.getgid()
            a.st_blksize = MiB
            a.st_blocks = -(-node.size // 512)
            a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = node.mtime_ns
            a.entry_timeout = a.attr_timeout = 300
            return a

        def _new(self, parent: int, name: bytes, mode: int) -> Node:
            pdir = self._dir(parent)
            assert pdir.children is not None
            if name in pdir.children:
                raise pyfuse3.FUSEError(errno.EEXIST)
            node = Node(self.next_inode, mode)
            self.next_inode += 1
            if stat.S_ISDIR(mode):
                node.children, node.nlink = {}, 2
            self.nodes[node.inode] = node
            pdir.children[name] = node.inode
            pdir.mtime_ns = time.time_ns()
            return node

        # lookups and attributes
        async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> Any:
            pdir = self._dir(parent_inode)
            assert pdir.children is not None
            if name == b".":
                return self._attr(pdir)
            inode = pdir.children.get(name)
            if inode is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return self._attr(self.nodes[inode])

        async def getattr(self, inode: int, ctx: Any = None) -> Any:
            return self._attr(self._node(inode))

        async def setattr(self, inode: int, attr: Any, fields: Any, fh: Any, ctx: Any) -> Any:
            node = self._node(inode)
            if fields.update_size:
                node.size = attr.st_size
            if fields.update_mode:
                node.mode = stat.S_IFMT(node.mode) | stat.S_IMODE(attr.st_mode)
            if fields.update_mtime:
                node.mtime_ns = attr.st_mtime_ns
            return self._attr(node)

        async def statfs(self, ctx: Any) -> Any:
            s = pyfuse3.StatvfsData()
            s.f_bsize = s.f_frsize = 4096
            s.f_blocks = s.f_bfree = s.f_bavail = 2**40 // 4096
            s.f_files = s.f_ffree = s.f_favail = 2**32
            s.f_namemax = 255
            return s

        async def forget(self, inode_list: Any) -> None:
            return None

        # directories
        async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any) -> Any:
            return self._attr(self._new(parent_inode, name, stat.S_IFDIR | stat.S_IMODE(mode)))

        async def opendir(self, inode: int, ctx: Any) -> int:
            self._dir(inode)
            return inode

        async def readdir(self, fh: int, start_id: int, token: Any) -> None:
            node = self._dir(fh)
            assert node.children is not None
            entries = sorted(node.children.items())
            for i, (name, inode) in enumerate(entries[start_id:], start_id + 1):
                if not pyfuse3.readdir_reply(token, name, self._attr(self.nodes[inode]), i):
                    break

        async def releasedir(self, fh: int) -> None:
            return None

        async def fsyncdir(self, fh: int, datasync: bool) -> None:
            return None

        async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
            pdir = self._dir(parent_inode)
            assert pdir.children is not None
            inode = pdir.children.get(name)
            if inode is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            node = self._dir(inode)
            if node.children:
                raise pyfuse3.FUSEError(errno.ENOTEMPTY)
            del pdir.children[name]
            del self.nodes[inode]

        async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
            pdir = self._dir(parent_inode)
            assert pdir.children is not None
            inode = pdir.children.get(name)
            if inode is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            if self.nodes[inode].children is not None:
                raise pyfuse3.FUSEError(errno.EISDIR)
            del pdir.children[name]
            del self.nodes[inode]

        async def rename(
            self, p_old: int, name_old: bytes, p_new: int, name_new: bytes, flags: int, ctx: Any
        ) -> None:
            src, dst = self._dir(p_old), self._dir(p_new)
            assert src.children is not None and dst.children is not None
            inode = src.children.get(name_old)
            if inode is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            old = dst.children.get(name_new)
            if old is not None and old != inode:
                victim = self.nodes[old]
                if victim.children:
                    raise pyfuse3.FUSEError(errno.ENOTEMPTY)
                del self.nodes[old]
            del src.children[name_old]
            dst.children[name_new] = inode

        # files
        async def create(
            self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Any
        ) -> Any:
            node = self._new(parent_inode, name, stat.S_IFREG | stat.S_IMODE(mode))
            return pyfuse3.FileInfo(fh=node.inode, keep_cache=False), self._attr(node)

        async def open(self, inode: int, flags: int, ctx: Any) -> Any:
            node = self._node(inode)
            if node.children is not None:
                raise pyfuse3.FUSEError(errno.EISDIR)
            if flags & os.O_TRUNC:
                node.size = 0
            # keep_cache off: every open drops the file's pages, so a read after a write
            # reaches the daemon (a ceiling measured from the page cache would be a lie).
            return pyfuse3.FileInfo(fh=inode, keep_cache=False)

        async def read(self, fh: int, off: int, size: int) -> bytes:
            node = self.nodes.get(fh)
            n = 0 if node is None else max(0, min(size, node.size - off))
            self.reads += 1
            self.bytes_read += n
            z = self.zeros.get(n)
            if z is None:
                z = self.zeros[n] = bytes(n)
            return z

        async def write(self, fh: int, off: int, buf: bytes) -> int:
            node = self.nodes.get(fh)
            if node is not None and off + len(buf) > node.size:
                node.size = off + len(buf)
            self.writes += 1
            self.bytes_written += len(buf)
            return len(buf)

        async def flush(self, fh: int) -> None:
            return None

        async def fsync(self, fh: int, datasync: bool) -> None:
            return None

        async def release(self, fh: int) -> None:
            return None

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
    reads arrive in 128 KiB pieces otherwise (+70% at 1 MiB, CEILINGS.md). False if this
    host does not let us (not root, no sysfs)."""
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
