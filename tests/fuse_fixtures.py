"""Fixtures for real FUSE mounts of a real local cluster.

``fuse_cluster``: a LocalCluster (2 metadata servers, 9 chunk stores, RS(6,3)) with 1 MiB
chunks, so a few-hundred-MB checkpoint is tens of blocks, not thousands.
``mount``: ``python -m tectonic_py.cli.main mount CLUSTER MNT --foreground`` in a SUBPROCESS (a
crash, or our own kill -9, must not take pytest with it), waited for with
``os.path.ismount``; yields a ``Mount`` (``os.fspath(mount)`` is the mount point). It is
ALWAYS unmounted in the finally (``fusermount3 -u``, lazy ``-uz`` if busy) and only its own
PID is ever killed. At teardown the mount's log must hold no WARNING or ERROR line and no
traceback unless the test said it expects them (``mount.expect_warnings``, ``expect_errors``):
a handler that hit a bug answers EIO and logs, so a test could pass while the mount
misbehaves.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_fixtures import suite_cluster

from tectonic_py.cli.mount import mount_device
from tectonic_py.launch.local_cluster import LocalCluster

REPO_ROOT = Path(__file__).resolve().parent.parent
FUSE_CHUNK_SIZE = 1024 * 1024
MOUNT_TIMEOUT_S = 60.0
UNMOUNT_TIMEOUT_S = 30.0


def fuse_skip_reason() -> str | None:
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing: no FUSE mounts on this machine"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed"
    return None


class Mount:
    """A running mount process and its mount point."""

    def __init__(self, cluster: LocalCluster, path: Path, log_file: Path) -> None:
        self.cluster = cluster
        self.path = path
        self.log_file = log_file
        self.proc: subprocess.Popen[bytes] | None = None
        self.expect_errors = False
        self.expect_warnings = False

    def __fspath__(self) -> str:
        return str(self.path)

    def __truediv__(self, other: str) -> Path:
        return self.path / other

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, *extra: str) -> None:
        """Start the mount process and wait (bounded) until the kernel shows the mount."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])]
        )
        with open(self.log_file, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tectonic_py.cli.main",
                    "-v",
                    "mount",
                    str(self.cluster.client_file),  # role client, as a GPU node mounts
                    str(self.path),
                    "--foreground",
                    *extra,
                ],
                cwd=REPO_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        while not os.path.ismount(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the mount did not come up: {self.log_tail()}")
            time.sleep(0.05)

    def mounted(self) -> bool:
        """Mounted, also when its daemon is dead: ``os.path.ismount`` is False then (the
        stat of the mount point fails with ENOTCONN), but the mount is still there to
        detach; /proc/self/mountinfo tells."""
        return mount_device(str(self.path)) is not None

    def kill(self) -> None:
        """kill -9 the mount process (fault injection), then detach its dead mount."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=UNMOUNT_TIMEOUT_S)
        if self.mounted():
            subprocess.run(["fusermount3", "-uz", str(self.path)], capture_output=True, check=False)

    def stop(self) -> None:
        """Unmount (lazily if busy) and reap the process; SIGKILL of its PID as a last resort."""
        try:
            if self.mounted():
                r = subprocess.run(
                    ["fusermount3", "-u", str(self.path)], capture_output=True, check=False
                )
                if r.returncode != 0:
                    subprocess.run(
                        ["fusermount3", "-uz", str(self.path)], capture_output=True, check=False
                    )
        finally:
            if self.proc is not None and self.proc.poll() is None:
                try:
                    self.proc.wait(timeout=UNMOUNT_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            if self.mounted():
                subprocess.run(
                    ["fusermount3", "-uz", str(self.path)], capture_output=True, check=False
                )

    def log_text(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def problems(self) -> list[str]:
        levels = ["ERROR", "CRITICAL"] + ([] if self.expect_warnings else ["WARNING"])
        return [
            line
            for line in self.log_text().splitlines()
            if (any(f" {level} " in line for level in levels) or line.startswith("Traceback"))
            and not _KERNEL_GAVE_UP.search(line)
        ]


# pyfuse3 logs at ERROR when the kernel no longer holds the request it answers (ENOENT from
# /dev/fuse): a release of an unlinked file's last handle can be such a request. The
# handler's work is done; only the kernel's bookkeeping of the reply is gone.
_KERNEL_GAVE_UP = re.compile(r"fuse_release\(\): fuse_reply_\* failed with No such file")


def _cluster(root: Path) -> LocalCluster:
    return suite_cluster(root, chunk_size=FUSE_CHUNK_SIZE, node_timeout=5.0)


def _mounted(cluster: LocalCluster, base: Path) -> Iterator[Mount]:
    mnt = base / "mnt"
    mnt.mkdir(parents=True, exist_ok=True)
    mount = Mount(cluster, mnt, base / "mount.log")
    try:
        mount.start()
        yield mount
    finally:
        mount.stop()
    if not mount.expect_errors and mount.problems():
        pytest.fail("the mount logged errors:\n" + "\n".join(mount.problems()[:20]))


@pytest.fixture
def fuse_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    reason = fuse_skip_reason()
    if reason:
        pytest.skip(reason)
    with _cluster(tmp_path / "cluster") as cluster:
        yield cluster


@pytest.fixture
def mount(fuse_cluster: LocalCluster, tmp_path: Path) -> Iterator[Mount]:
    yield from _mounted(fuse_cluster, tmp_path)


@pytest.fixture(scope="module")
def shared_mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mount]:
    """One cluster and mount for a module's non-destructive workload tests (each test works
    in its own directory): starting 11 daemons per test would eat the suite's time budget."""
    reason = fuse_skip_reason()
    if reason:
        pytest.skip(reason)
    base = tmp_path_factory.mktemp("fuse")
    with _cluster(base / "cluster") as cluster:
        yield from _mounted(cluster, base)
