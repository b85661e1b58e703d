"""An etcd cluster of N members on loopback, as subprocesses: the metadata store that survives
the loss of a host, for ``tectonic cluster up --metadata-engine etcd`` and the tests.

Layout under ``root``::

    etcd.json       member names, client and peer ports, the cluster token (a restart on the
                    same root reuses them, so the members find each other again)
    mN/             data directory of member N
    mN.log          its stdout and stderr

Each member runs Debian's ``etcd`` binary in its own session with fsync on (etcd's default: a
write is acknowledged once a majority has it on disk). Transactions may carry up to
``MAX_TXN_OPS`` operations and requests up to ``MAX_REQUEST_BYTES``, so that one group commit
of a metadata shard is one etcd transaction. ``stop`` signals only the PIDs it started.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import trio

from tectonic_py.core.errors import ConfigError, Timeout
from tectonic_py.core.etcd_client import EtcdClient

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
MAX_TXN_OPS = 16384
MAX_REQUEST_BYTES = 32 * 1024 * 1024
READY_TIMEOUT_S = 30.0
FRESH_START_TRIES = 3  # a new cluster whose ports were taken before its members bound them


def etcd_binary() -> str:
    path = shutil.which("etcd")
    if path is None:
        raise ConfigError(
            "the etcd engine needs the etcd server: apt-get install etcd-server (deploy/install.sh)"
        )
    return path


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _fresh_members(n: int) -> list[dict[str, int]]:
    return [{"client_port": _free_port(), "peer_port": _free_port()} for _ in range(n)]


def _port_was_taken(log_path: Path) -> bool:
    try:
        return b"address already in use" in log_path.read_bytes()[-20_000:]
    except OSError:
        return False


class EtcdCluster:
    """Start, kill, restart and re-add the members of a loopback etcd cluster."""

    def __init__(self, root: str | os.PathLike[str], members: int = 3) -> None:
        if members < 1:
            raise ConfigError(f"an etcd cluster needs at least one member, not {members}")
        self.root = Path(root)
        self.size = members
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._state: dict[str, Any] = {}

    # --- addresses -------------------------------------------------------------------------

    def name(self, i: int) -> str:
        return f"m{i}"

    def client_url(self, i: int) -> str:
        return f"http://{HOST}:{self._state['members'][i]['client_port']}"

    def peer_url(self, i: int) -> str:
        return f"http://{HOST}:{self._state['members'][i]['peer_port']}"

    @property
    def endpoints(self) -> list[str]:
        return [self.client_url(i) for i in range(self.size)]

    def data_dir(self, i: int) -> Path:
        return self.root / self.name(i)

    def pids(self) -> list[int]:
        return [p for p in (self.pid(i) for i in range(self.size)) if p is not None]

    def pid(self, i: int) -> int | None:
        proc = self._procs.get(i)
        return proc.pid if proc is not None and proc.poll() is None else None

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> list[str]:
        """Start every member (a fresh cluster, or the one this root already holds) and wait
        until each answers its health check."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._load_state()
        for attempt in range(FRESH_START_TRIES):
            try:
                for i in range(self.size):
                    if self.pid(i) is None:
                        self._spawn(i)
                for i in range(self.size):
                    self._wait_healthy(i)
                break
            except ConfigError:
                # A port picked free was taken before its member bound it (another process
                # on this host started meanwhile): a cluster never started takes new ones.
                if self._state.get("started") or attempt + 1 == FRESH_START_TRIES:
                    raise
                if not any(_port_was_taken(self._log(i)) for i in range(self.size)):
                    raise
                log.warning("an etcd member found its port taken; new ports for every member")
                self.stop()
                for i in range(self.size):
                    shutil.rmtree(self.data_dir(i), ignore_errors=True)
                self._state["members"] = _fresh_members(self.size)
                self._save_state()
        self._state["started"] = True
        self._save_state()
        return self.endpoints

    def stop(self) -> None:
        for i in list(self._procs):
            self.stop_member(i)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def kill_member(self, i: int) -> None:
        self._signal(i, signal.SIGKILL)

    def stop_member(self, i: int) -> None:
        self._signal(i, signal.SIGTERM)

    def start_member(self, i: int) -> None:
        if self.pid(i) is None:
            self._spawn(i)
        self._wait_healthy(i)

    def replace_member(self, i: int) -> None:
        """Member ``i`` lost its disk: remove it from the cluster, wipe its data directory,
        add it back as a new member and start it empty; it catches up from the others."""
        self.kill_member(i)
        shutil.rmtree(self.data_dir(i), ignore_errors=True)
        others = [self.client_url(j) for j in range(self.size) if j != i]
        trio.run(self._readd, others, self.peer_url(i))
        self._spawn(i, existing=True)
        self._wait_healthy(i)

    async def _readd(self, others: list[str], peer_url: str) -> None:
        async with EtcdClient(others, deadline=20.0) as etcd:
            for m in await etcd.members():
                if peer_url in m.get("peerURLs", []):
                    await etcd.member_remove(int(m["ID"]))
            await etcd.member_add(peer_url)

    # --- plumbing --------------------------------------------------------------------------

    def _signal(self, i: int, sig: int) -> None:
        proc = self._procs.pop(i, None)
        if proc is None or proc.poll() is not None:
            return
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(15)

    def _spawn(self, i: int, *, existing: bool | None = None) -> None:
        fresh = not (self.data_dir(i) / "member").exists()
        if existing is None:
            existing = not fresh or bool(self._state.get("started"))
        cluster = ",".join(f"{self.name(j)}={self.peer_url(j)}" for j in range(self.size))
        argv = [
            etcd_binary(),
            "--name", self.name(i),
            "--data-dir", str(self.data_dir(i)),
            "--listen-client-urls", self.client_url(i),
            "--advertise-client-urls", self.client_url(i),
            "--listen-peer-urls", self.peer_url(i),
            "--initial-advertise-peer-urls", self.peer_url(i),
            "--initial-cluster", cluster,
            "--initial-cluster-token", self._state["token"],
            "--initial-cluster-state", "existing" if existing and fresh else "new",
            "--max-txn-ops", str(MAX_TXN_OPS),
            "--max-request-bytes", str(MAX_REQUEST_BYTES),
            "--heartbeat-interval", "100",
            "--election-timeout", "1000",
            "--logger", "zap",
            "--log-outputs", "stderr",
        ]  # fmt: skip
        with open(self.root / f"{self.name(i)}.log", "ab") as out:
            self._procs[i] = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def _wait_healthy(self, i: int) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        url = self.client_url(i) + "/health"
        while True:
            proc = self._procs.get(i)
            if proc is None or proc.poll() is not None:
                raise ConfigError(f"etcd member {self.name(i)} exited; log {self._log(i)}")
            try:
                with urllib.request.urlopen(url, timeout=1.0) as r:
                    if json.loads(r.read()).get("health") == "true":
                        return
            except (OSError, ValueError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                raise Timeout(f"etcd member {self.name(i)} not healthy; log {self._log(i)}")
            time.sleep(0.1)

    def _log(self, i: int) -> Path:
        return self.root / f"{self.name(i)}.log"

    def _load_state(self) -> None:
        path = self.root / "etcd.json"
        if path.exists():
            self._state = json.loads(path.read_text())
            if len(self._state["members"]) != self.size:
                raise ConfigError(
                    f"{path}: the cluster has {len(self._state['members'])} members, not {self.size}"
                )
            return
        self._state = {
            "token": f"tectonic-{secrets.token_hex(8)}",
            "members": _fresh_members(self.size),
            "started": False,
        }
        self._save_state()

    def _save_state(self) -> None:
        path = self.root / "etcd.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._state, indent=2) + "\n")
        os.replace(tmp, path)
