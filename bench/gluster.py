"""The peer: a GlusterFS dispersed volume 4+2 on this host, measured with our workloads.

GlusterFS's dispersed volumes are the closest widely deployed design to ours: files are
erasure coded (Reed-Solomon, here 4 data + 2 redundancy fragments) across bricks by the
client, behind a FUSE mount. This script builds one from Debian's ``glusterfs-server``
with six bricks on this host, runs the same workloads as our mount (``dd`` with fsync,
``torch.save`` / ``torch.load``, ``tectonic loadtest --through-mount``), and tears it all
down, whatever happened:

1. ``glusterd -N`` as our own child process (refused if another glusterd is running: we
   never touch a daemon we did not start);
2. ``gluster volume create NAME disperse 6 redundancy 2 HOST:/tmp/.../brickN ... force``
   (``force`` because the bricks share the root filesystem) and ``volume start``;
3. ``mount -t glusterfs HOST:/NAME MOUNTPOINT``; for a cold read the volume is unmounted and
   mounted again, which empties the kernel's and the client translators' caches;
4. teardown: unmount, ``volume stop force``, ``volume delete``, SIGTERM to our glusterd, then
   the brick, self-heal and client processes of *our* volume (found by its unique name in
   their command lines) by PID; the bricks are removed.

HOST must resolve to a local address; GlusterFS refuses "localhost"/127.0.0.1 as a brick
host but accepts this machine's hostname even when it resolves to 127.0.0.1.

If GlusterFS cannot run here (not installed and ``--install`` not given, no /dev/fuse, not
root, hostname not local), the result says exactly why (``available: false, reason``).

CPU-seconds per GiB count every gluster process (glusterd, six glusterfsd bricks, the
self-heal daemon, the FUSE client) plus the workload's own process.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self

import psutil

from bench.mount_workloads import dd_workload, torch_workload

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
MiB = 1024 * 1024
GiB = 1024 * MiB
GLUSTER_PORT = 24007
VOLUME = "disperse 6 redundancy 2 (4+2)"


class GlusterUnavailable(RuntimeError):
    """GlusterFS cannot be set up on this machine; the message says why."""


def _gluster(*args: str, timeout: float = 120) -> str:
    r = subprocess.run(
        ["gluster", "--mode=script", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if r.returncode != 0:
        raise GlusterUnavailable(f"gluster {' '.join(args[:3])}: {(r.stderr or r.stdout).strip()}")
    return r.stdout


def why_unavailable(install: bool = False) -> str | None:
    """None when a GlusterFS volume can be built here; else the reason, in one line."""
    if os.geteuid() != 0:
        return "GlusterFS needs root (glusterd, bricks with trusted.* xattrs, mount -t glusterfs)"
    if shutil.which("glusterd") is None and install:
        r = subprocess.run(
            ["apt-get", "install", "-y", "--no-install-recommends", "glusterfs-server"],
            capture_output=True,
            text=True,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
            check=False,
        )
        if r.returncode != 0:
            return f"apt-get install glusterfs-server failed: {r.stderr.strip()[-300:]}"
    for tool in ("glusterd", "gluster", "mount.glusterfs"):
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            return f"{tool} not found: install Debian's glusterfs-server (or pass --install)"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist: the GlusterFS client is a FUSE mount"
    for p in psutil.process_iter(["name"]):
        if p.info["name"] == "glusterd":
            return f"a glusterd we did not start is running (pid {p.pid}); refusing to touch it"
    try:
        addrs = {str(a[4][0]) for a in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError as e:
        return f"hostname {socket.gethostname()!r} does not resolve: {e}"
    local = {a.address for addrs_ in psutil.net_if_addrs().values() for a in addrs_}
    if not addrs & (local | {"127.0.0.1", "::1"}) and not any(a.startswith("127.") for a in addrs):
        return f"hostname {socket.gethostname()!r} resolves to {sorted(addrs)}, not a local address"
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", GLUSTER_PORT))
        except OSError:
            return f"port {GLUSTER_PORT} (glusterd) is in use"
    return None


class GlusterVolume:
    """A dispersed volume on this host for the length of a with-statement."""

    def __init__(self, root: str | os.PathLike[str], bricks: int = 6, redundancy: int = 2) -> None:
        self.root = Path(root)
        self.bricks = bricks
        self.redundancy = redundancy
        self.name = f"tbench{os.getpid()}"
        self.host = socket.gethostname()
        self.mountpoint = str(self.root / "mnt")
        self.glusterd: subprocess.Popen[bytes] | None = None
        self.version = ""

    # lifecycle
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
        log_dir = self.root / "log"
        log_dir.mkdir(exist_ok=True)
        self.version = subprocess.run(
            ["glusterd", "--version"], capture_output=True, text=True, check=False
        ).stdout.split("\n")[0]
        self.glusterd = subprocess.Popen(
            [
                "glusterd",
                "-N",
                "-l",
                str(log_dir / "glusterd.log"),
                "-p",
                str(self.root / "glusterd.pid"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while True:
            r = subprocess.run(
                ["gluster", "--mode=script", "pool", "list"],
                capture_output=True,
                text=True,
                check=False,
            )
            if r.returncode == 0:
                break
            if self.glusterd.poll() is not None or time.monotonic() > deadline:
                raise GlusterUnavailable(
                    f"glusterd did not start: {self._tail(log_dir / 'glusterd.log')}"
                )
            time.sleep(0.3)
        bricks = []
        for i in range(1, self.bricks + 1):
            d = self.root / "bricks" / f"b{i}"
            d.mkdir(parents=True, exist_ok=True)
            bricks.append(f"{self.host}:{d}")
        _gluster(
            "volume",
            "create",
            self.name,
            "disperse",
            str(self.bricks),
            "redundancy",
            str(self.redundancy),
            *bricks,
            "force",
        )
        _gluster("volume", "start", self.name)
        self.mount()

    def mount(self) -> None:
        deadline = time.monotonic() + 60
        while True:
            r = subprocess.run(
                ["mount", "-t", "glusterfs", f"{self.host}:/{self.name}", self.mountpoint],
                capture_output=True,
                text=True,
                check=False,
            )
            if r.returncode == 0 and os.path.ismount(self.mountpoint):
                return
            if time.monotonic() > deadline:
                raise GlusterUnavailable(f"mount -t glusterfs failed: {r.stderr.strip()}")
            time.sleep(0.5)  # bricks may still be coming up

    def unmount(self) -> None:
        if os.path.ismount(self.mountpoint):
            r = subprocess.run(["umount", self.mountpoint], capture_output=True, check=False)
            if r.returncode != 0:
                subprocess.run(["umount", "-l", self.mountpoint], capture_output=True, check=False)
        # the FUSE client process exits after the unmount; wait for it so a remount's
        # figures never include a dying process
        for p in self._our_processes():
            try:  # a process may exit (or be a zombie) between listing and asking
                if "--process-name fuse" in " ".join(p.cmdline()) or "fuse" in p.name():
                    p.wait(timeout=10)
            except psutil.Error:
                pass

    def remount(self) -> None:
        """Unmount and mount again: nothing of the volume is cached client-side after it."""
        self.unmount()
        self.mount()

    def stop(self) -> None:
        """Tear everything down; safe to call at any point of ``start``."""
        self.unmount()
        if self.glusterd is not None and self.glusterd.poll() is None:
            for args in (("volume", "stop", self.name, "force"), ("volume", "delete", self.name)):
                try:
                    _gluster(*args, timeout=60)
                except (GlusterUnavailable, subprocess.TimeoutExpired) as e:
                    log.info("teardown: %s", e)
            self.glusterd.send_signal(signal.SIGTERM)
            try:
                self.glusterd.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.glusterd.kill()
                self.glusterd.wait()
        for p in self._our_processes():  # bricks, self-heal daemon, client: ours by name
            try:
                p.terminate()
                p.wait(timeout=10)
            except psutil.TimeoutExpired:
                p.kill()
            except psutil.Error:
                pass
        shutil.rmtree(self.root / "bricks", ignore_errors=True)
        shutil.rmtree(f"/var/lib/glusterd/vols/{self.name}", ignore_errors=True)

    # inspection
    def _our_processes(self) -> list[psutil.Process]:
        """Gluster processes serving our volume (its unique name is in their command line)."""
        out = []
        for p in psutil.process_iter(["name", "cmdline"]):
            name = p.info["name"] or ""
            if not name.startswith("gluster"):
                continue
            cmd = " ".join(p.info["cmdline"] or [])
            if self.name in cmd or str(self.root) in cmd:
                out.append(p)
        return out

    def pids(self) -> list[int]:
        """Every gluster process of this volume now, glusterd included (for CPU-seconds)."""
        pids = [p.pid for p in self._our_processes()]
        if self.glusterd is not None and self.glusterd.poll() is None:
            pids.append(self.glusterd.pid)
        # the self-heal daemon serves all volumes and is named by "shd/NAME"
        return sorted(set(pids))

    @staticmethod
    def _tail(path: Path, n: int = 5) -> str:
        try:
            return " | ".join(path.read_text(errors="replace").strip().splitlines()[-n:])
        except OSError:
            return "(no log)"


@contextmanager
def dispersed_volume(install: bool = False, root: str | None = None) -> Iterator[GlusterVolume]:
    """The 4+2 volume, mounted, in a new tmp directory under ``root``: every bench that
    measures the peer builds it here, so all of them measure the same volume. On exit it is
    torn down (``GlusterVolume.stop``) and the directory removed, whatever happened; when it
    cannot be built here, GlusterUnavailable says why (``why_unavailable``'s reasons, or the
    step of the setup that failed)."""
    reason = why_unavailable(install)
    if reason:
        raise GlusterUnavailable(reason)
    with (
        tempfile.TemporaryDirectory(prefix="gluster-bench-", dir=root) as tmp,
        GlusterVolume(tmp) as vol,
    ):
        yield vol


def loadtest_through(
    mountpoint: str,
    ranks: int,
    shard_size: int,
    pids: list[int],
    max_seconds: float,
    processes: int = 0,
) -> dict[str, Any]:
    """``tectonic loadtest --through-mount`` as a subprocess; returns its JSON object."""
    with tempfile.TemporaryDirectory(prefix="gluster-loadtest-") as results:
        return _loadtest_through(
            mountpoint, ranks, shard_size, pids, max_seconds, processes, results
        )


def _loadtest_through(
    mountpoint: str,
    ranks: int,
    shard_size: int,
    pids: list[int],
    max_seconds: float,
    processes: int,
    results_dir: str,
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "tectonic_py.cli.main",
        "loadtest",
        "--through-mount",
        mountpoint,
        "--ranks",
        str(ranks),
        "--shard-size",
        str(shard_size),
        "--json",
        "--no-progress",
        "--no-plot",
        "--results-dir",
        results_dir,
        "--max-seconds",
        str(max_seconds),
        "--watch-pids",
        ",".join(map(str, pids)),
    ]
    if processes:
        cmd += ["--processes", str(processes)]
    r = subprocess.run(
        cmd, capture_output=True, text=True, cwd=REPO_ROOT, timeout=max_seconds + 120, check=False
    )
    try:
        return dict(json.loads(r.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return {"errors": 1, "error_samples": [r.stderr.strip()[-500:]]}


def measure(
    size: int = 2 * GiB,
    loadtest_ranks: int = 64,
    shard_size: int = 16 * MiB,
    install: bool = False,
    root: str | None = None,
    max_seconds: float = 600,
) -> dict[str, Any]:
    """The peer's figures, or ``{"available": False, "reason": ...}``."""
    result: dict[str, Any] = {"available": True, "volume": VOLUME}
    try:
        with dispersed_volume(install, root) as vol:
            result["version"] = vol.version
            result["bricks"] = vol.bricks
            result.update(dd_workload(vol.mountpoint, size, vol.pids, vol.remount))
            result.update(torch_workload(vol.mountpoint, size, vol.pids, vol.remount))
            if loadtest_ranks:
                result["loadtest"] = loadtest_through(
                    vol.mountpoint, loadtest_ranks, shard_size, vol.pids(), max_seconds
                )
    except GlusterUnavailable as e:
        return {"available": False, "reason": str(e)}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="GlusterFS 4+2 dispersed volume: the peer")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (16 MiB, 4 ranks)")
    parser.add_argument("--size", type=int, default=2 * GiB, help="bytes for dd and torch")
    parser.add_argument("--ranks", type=int, default=64, help="loadtest ranks (0: skip)")
    parser.add_argument("--shard-size", type=int, default=16 * MiB)
    parser.add_argument("--install", action="store_true", help="apt-get glusterfs-server if absent")
    parser.add_argument("--root", help="parent directory of the bricks (default: tmp)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.smoke:
        args.size, args.ranks, args.shard_size = 16 * MiB, 4, MiB
    result = measure(args.size, args.ranks, args.shard_size, args.install, args.root)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
