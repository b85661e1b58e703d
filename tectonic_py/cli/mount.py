"""``tectonic mount`` and ``tectonic umount``: run the FUSE mount of a cluster.

``tectonic mount CLUSTER_FILE MOUNTPOINT [--foreground] [--allow-other]`` connects to the
cluster (and fails with one clear line if it cannot), mounts, and serves until the mount is
unmounted (``tectonic umount MOUNTPOINT`` or ``fusermount3 -u``) or the process gets SIGTERM
or SIGINT. Without ``--foreground`` it forks into the background and returns only once the
mount is up, with the child's error if it failed, so scripts can rely on its exit status.
It refuses a mount point that is not empty (files there would be hidden while mounted, and
a user who mounts over the wrong directory hears so) unless given ``--nonempty``. Every
tuning option (the data-path client's, the FUSE layer's, the mount's own) is a flag and an
``-o key=value`` option, declared once in ``cli/mount_options.py``; ``mount.tectonic``
(``cli/mount_helper.py``) lets mount(8) and fstab run this command.

``tectonic umount`` also clears a mount whose daemon died (its mount point answers "Transport
endpoint is not connected"), as ``fusermount3 -u`` does, and says so.

After mounting it raises the mount's ``read_ahead_kb`` (found through /proc/self/mountinfo,
which needs no call into the mount itself and so cannot deadlock before the main loop runs):
the kernel otherwise asks a FUSE daemon for 128 KiB per read, and larger requests are what
sequential reads need (docs/ceilings.md). Writes cannot be raised past 1 MiB: libfuse 3.14
caps the request buffer at 256 pages and pyfuse3 rejects ``-o max_write``.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyfuse3
import trio

from metadata.client import INTERACTIVE_FIRST_CONTACT_S, RECONNECT_DEADLINE_S
from tectonic_py.cli import mount_options as knobs
from tectonic_py.cli.common import add_cluster_file, add_connect_wait
from tectonic_py.core import cluster_file
from tectonic_py.core.cluster_file import ClusterConfig
from tectonic_py.core.errors import ConfigError, ShardUnavailable
from tectonic_py.core.ids import ROOT_ID
from tectonic_py.core.ready_file import write_ready_file

if TYPE_CHECKING:
    from tectonic_py.mount.operations import Operations

log = logging.getLogger(__name__)

DEFAULT_READ_AHEAD_KB = knobs.DEFAULT_READ_AHEAD_KB


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("mount", help="mount a cluster with FUSE")
    add_cluster_file(p)
    add_connect_wait(
        p,
        "how long to wait for the root directory's metadata server before mounting (a cluster"
        " that is down fails the mount); once mounted, a metadata server that cannot be"
        f" reached is waited for up to {RECONNECT_DEADLINE_S:g} s before EIO",
    )
    p.add_argument("mountpoint", metavar="MOUNTPOINT", help="an empty directory to mount on")
    p.add_argument("--foreground", action="store_true", help="do not fork into the background")
    knobs.add_flags(p)
    p.add_argument(
        "--sync-creates",
        dest="async_creates",
        action="store_false",
        default=None,
        help="the same as --no-async-creates",
    )
    p.add_argument(
        "--check-only",
        action="store_true",
        help="check the cluster file, the mount point and the options, then exit without "
        "mounting (mount(8)'s -f)",
    )
    p.add_argument(
        "--ready-file", help="write {mountpoint, pid, options} as JSON here once mounted"
    )
    p.add_argument("--log-file", help="log here when in the background (default: discard)")
    p.set_defaults(func=cmd_mount)

    u = subparsers.add_parser("umount", help="unmount a tectonic FUSE mount")
    u.add_argument("mountpoint", metavar="MOUNTPOINT")
    u.add_argument("--lazy", action="store_true", help="detach now even if files are open")
    u.set_defaults(func=cmd_umount)


def mount_options(config: ClusterConfig, *, allow_other: bool | None) -> set[str]:
    """pyfuse3's defaults (default_permissions: the kernel checks modes, so every user is
    held to the files' modes and owners) plus our names. ``allow_other`` None: on for root,
    whose mount is the node's shared one (a GPU node's jobs run as many users), off for
    anyone else. Deliberately no direct_io and no writeback_cache (see
    tectonic_py.mount.operations)."""
    options = set(pyfuse3.default_options)
    options.add(f"fsname=tectonic:{config.name}")
    options.add("subtype=tectonic")
    if os.geteuid() == 0 if allow_other is None else allow_other:
        options.add("allow_other")
    return options


def _check_mountpoint(path: str, *, nonempty: bool = False) -> str:
    mnt = os.path.abspath(path)
    if _is_dead_mount(mnt):
        raise ConfigError(f"{mnt!r} is a mount whose daemon died: run tectonic umount {mnt}")
    if not os.path.isdir(mnt):
        raise ConfigError(f"mount point {mnt!r} is not a directory")
    if os.path.ismount(mnt):
        raise ConfigError(f"{mnt!r} is already a mount point")
    if not nonempty:
        try:
            with os.scandir(mnt) as entries:
                has_entries = next(entries, None) is not None
        except OSError as e:
            raise ConfigError(f"cannot read mount point {mnt!r}: {e.strerror}") from None
        if has_entries:
            raise ConfigError(f"mount point {mnt!r} is not empty (--nonempty mounts over it)")
    return mnt


def _is_dead_mount(mnt: str) -> bool:
    """A FUSE mount whose daemon is gone: still in mountinfo, but every call on it fails
    with ENOTCONN (os.path.ismount then says False, as its stat fails)."""
    try:
        os.stat(mnt)
    except OSError as e:
        return e.errno == errno.ENOTCONN and mount_device(mnt) is not None
    return False


def _check_fuse_device() -> None:
    """Name the cause when there is no FUSE device: libfuse says only "fuse_session_mount
    failed" (its own hint goes to stderr, which a background mount discards). A device we
    may not open is left to fusermount3, which opens it setuid for ordinary users."""
    try:
        fd = os.open("/dev/fuse", os.O_RDWR)
    except PermissionError:
        return
    except OSError:
        raise ConfigError(
            "/dev/fuse is missing or has no driver: load the fuse module (modprobe fuse), "
            "or give the container the device (--device /dev/fuse)"
        ) from None
    os.close(fd)


def cmd_mount(args: argparse.Namespace) -> int:
    config = cluster_file.load(args.cluster_file)
    settings = knobs.resolve(args)
    mnt = _check_mountpoint(args.mountpoint, nonempty=settings["mount"]["nonempty"])
    _check_fuse_device()
    options = mount_options(config, allow_other=settings["mount"]["allow_other"])
    run = MountRun(
        read_ahead_kb=settings["mount"]["read_ahead_kb"],
        ready_file=args.ready_file,
        fuse=settings["fuse"],
        client=settings["client"],
        connect_wait=args.connect_wait,
        metrics_listen=settings["mount"]["metrics_listen"],
    )
    if args.check_only:
        return 0
    if args.foreground:
        trio.run(serve_mount, config, mnt, options, run)
        return 0
    return _daemonize(config, mnt, options, run, args.log_file)


@dataclass(frozen=True)
class MountRun:
    """What one mount process is told beyond the cluster and mount point: the kernel
    read-ahead, where to announce itself, the keyword arguments of ``Operations`` (``fuse``)
    and of the data-path client (``client``), from ``cli/mount_options``, and how long the
    root's server is waited for before mounting (a cluster that is down is said now; the
    client itself then waits out a restart as the data path does)."""

    read_ahead_kb: int = DEFAULT_READ_AHEAD_KB
    ready_file: str | None = None
    fuse: dict[str, Any] = field(default_factory=dict)
    client: dict[str, Any] = field(default_factory=dict)
    connect_wait: float = INTERACTIVE_FIRST_CONTACT_S
    metrics_listen: str | None = None  # HOST:PORT of the metrics endpoint; None: no metrics


def _daemonize(
    config: ClusterConfig, mnt: str, options: set[str], run: MountRun, log_file: str | None
) -> int:
    """Fork; the parent waits on a pipe for "ok" or the child's error line."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid:
        os.close(wfd)
        with os.fdopen(rfd, "rb") as pipe:
            message = pipe.read().decode(errors="replace")
        if message == "ok":
            return 0
        os.waitpid(pid, 0)
        print(f"tectonic mount: error: {message or 'the mount process died'}", file=sys.stderr)
        return 1
    os.close(rfd)
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    if log_file:
        log_fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log_fd, 2)
    else:
        os.dup2(devnull, 2)

    def ready() -> None:
        os.write(wfd, b"ok")
        os.close(wfd)

    code = 0
    try:
        trio.run(serve_mount, config, mnt, options, run, ready)
    except BaseException as e:
        log.exception("mount of %s failed", mnt)
        try:
            os.write(wfd, str(e).encode() or type(e).__name__.encode())
        except OSError:
            pass
        code = 1
    os._exit(code)


async def serve_mount(
    config: ClusterConfig,
    mountpoint: str,
    options: set[str],
    run: MountRun | None = None,
    ready: Callable[[], None] | None = None,
) -> None:
    """Mount and serve until unmounted or signalled; always leaves no mount behind."""
    from tectonic_py.client.tectonic_client import open_client
    from tectonic_py.mount.metrics import FuseMetrics
    from tectonic_py.mount.operations import Operations

    run = run or MountRun()
    async with open_client(config, metrics_listen=run.metrics_listen, **run.client) as client:
        # Fail now, with one line, rather than mount a dead cluster.
        root = None
        with trio.move_on_after(run.connect_wait):
            root = await client.meta.getattr(ROOT_ID)
        if root is None:
            address = client.meta.address_of(client.meta.shard_of(ROOT_ID))
            raise ShardUnavailable(
                f"metadata server {address} unavailable: the root directory's shard did not"
                f" answer within {run.connect_wait:g} s (--connect-wait)"
            )
        ops = Operations(client, **run.fuse)
        if client.metrics.enabled:
            ops.fuse_metrics = FuseMetrics(client.metrics)
        try:
            pyfuse3.init(ops, mountpoint, options)
        except RuntimeError as e:  # libfuse printed its reason on stderr already
            raise ConfigError(f"cannot mount on {mountpoint!r}: {e}") from None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_terminate_on_signal)
                if run.read_ahead_kb > 0:
                    nursery.start_soon(_raise_read_ahead, ops, mountpoint, run.read_ahead_kb)
                if run.ready_file:
                    _write_ready_file(run.ready_file, mountpoint, run, client.metrics_address)
                if ready is not None:
                    ready()
                log.info("mounted %s on %s", config.name, mountpoint)
                await pyfuse3.main()
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await ops.shutdown()
            # As root libfuse detaches lazily; after a clean fusermount -u this is a no-op.
            pyfuse3.close(unmount=True)
            log.info("unmounted %s", mountpoint)


async def _terminate_on_signal() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("signal %d: unmounting", signum)
            pyfuse3.terminate()
            return


def _write_ready_file(path: str, mountpoint: str, run: MountRun, metrics: str | None) -> None:
    """``{mountpoint, pid, options}`` (and ``metrics``, its endpoint's HOST:PORT): the
    options are every value the mount runs with, so a script (or a test) can see what its
    flags and ``-o`` came to."""
    settings = {**run.client, **run.fuse, "read_ahead_kb": run.read_ahead_kb}
    write_ready_file(path, mountpoint=mountpoint, options=settings, metrics=metrics)


def mount_device(mountpoint: str) -> str | None:
    """``major:minor`` of the mount at ``mountpoint`` from /proc/self/mountinfo (the last
    one wins: a later mount on the same path hides the earlier ones)."""
    found = None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4 and _unescape(fields[4]) == mountpoint:
                    found = fields[2]
    except OSError:
        return None
    return found


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


async def _raise_read_ahead(ops: Operations, mountpoint: str, kb: int) -> None:
    """Set read_ahead_kb once the kernel has processed our INIT reply, which resets it to
    the INIT's max_readahead (128 KiB); checked by reading it back (bounded retries)."""
    await ops.initialized.wait()
    for _ in range(50):
        await trio.sleep(0.02)
        if set_read_ahead(mountpoint, kb) and read_ahead(mountpoint) == kb:
            return
    log.warning("read_ahead_kb of %s did not stay at %d; reads stay small", mountpoint, kb)


def read_ahead(mountpoint: str) -> int | None:
    dev = mount_device(mountpoint)
    try:
        return int((Path("/sys/class/bdi") / str(dev) / "read_ahead_kb").read_text())
    except (OSError, ValueError):
        return None


def set_read_ahead(mountpoint: str, kb: int) -> bool:
    """Raise the kernel read-ahead of the mount's backing device info; True if it worked.
    Needs root (or a writable sysfs); without it reads still work, in 128 KiB requests."""
    dev = mount_device(mountpoint)
    if dev is None:
        log.warning("cannot find %s in /proc/self/mountinfo; read-ahead left as is", mountpoint)
        return False
    path = Path("/sys/class/bdi") / dev / "read_ahead_kb"
    try:
        path.write_text(f"{kb}\n")
    except OSError as e:
        log.warning("cannot set %s to %d: %s; reads stay in 128 KiB requests", path, kb, e)
        return False
    log.debug("read_ahead_kb of %s (%s) set to %d", mountpoint, dev, kb)
    return True


def cmd_umount(args: argparse.Namespace) -> int:
    mnt = os.path.abspath(args.mountpoint)
    dead = _is_dead_mount(mnt)
    if not dead and not os.path.ismount(mnt):
        raise ConfigError(f"{mnt!r} is not mounted")
    flag = "-uz" if args.lazy else "-u"
    proc = subprocess.run(
        ["fusermount3", flag, mnt], capture_output=True, text=True, timeout=60, check=False
    )
    if proc.returncode != 0:
        msg = proc.stderr.strip() or f"fusermount3 exited {proc.returncode}"
        raise ConfigError(f"cannot unmount {mnt!r}: {msg} (files still open? try --lazy)")
    if dead:
        print(f"tectonic umount: cleared {mnt}: its mount daemon had died", file=sys.stderr)
    return 0
