"""A whole tectonic-py cluster on one machine, as subprocesses: tests, ``tectonic cluster up``,
the FUSE tests and the load test all start clusters through this one piece of library code.

Layout under ``root``::

    secret                 the cluster secret (created on first use, mode 0600): servers only
    capability_key         the key that signs capabilities (created on first use, mode 0600);
                           passed to metadata servers and chunk stores only, never named in
                           a cluster file, so clients (and maintenance) cannot forge one
    keys/ROLE.key          each role's key (client, maintenance, admin), derived from the
                           secret (tectonic_py/core/auth.py), mode 0600
    cluster.toml           the operator's cluster file: role admin (rewritten on every start)
    client.toml            a GPU node's: the same servers, role client (what a mount needs)
    maintenance.toml       the maintenance daemon's: role maintenance
    state.json             ports of every daemon, so a restart reuses them when free, the
                           chunk store count and the failure domains they were given
    metadata/N/            data directory of metadata server N (etcd engine: its shard copies)
    etcd/                  the etcd members (``metadata_engine="etcd"``: tectonic_py/launch/local_etcd.py)
    chunks/N/              data directory of chunk store N (node id ``csN``)
    logs/*.log             stdout and stderr of every daemon
    run/*.ready            ready files the daemons write once serving
    metrics.json,          with ``metrics=True``: every daemon's metrics endpoint, and a
    monitoring/            Prometheus configuration over them (tectonic_py/launch/monitoring.py)

With ``metadata_engine="etcd"`` a 3-member etcd cluster starts first (on free loopback
ports), the metadata servers keep their shards in it and take over each other's, and chunk
stores heartbeat whichever server holds the registry.

A cluster started with an ``ec`` other than RS(6,3) sets the root directory's policy once
every daemon is up, so every file and directory created below inherits it.

Every daemon is ``tectonic metadata|chunkstore|maintenance ...`` in its own process and
session (so a Ctrl-C in a terminal reaches only the supervisor), and the launcher waits for
its ``--ready-file``. By default (``fork_server=True``) the daemons are forked from one
server process that has imported their code once (tectonic_py/launch/fork_server.py): a
start then costs a fork instead of the imports, and each daemon is still a process of its
own (logs/fork-server.log is the server's own log);
``fork_server=False`` runs each as ``python -m tectonic_py.cli.main``. ``stop`` signals only
the PIDs it started: SIGTERM, then SIGKILL after a timeout. Restarting on the same root
brings back all data, on the same ports when free.

Why processes of their own rather than in-process daemons: fault injection by ``kill -9`` is
the point of many tests, and a process per daemon is what production runs.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from tectonic_py.core import cluster_file
from tectonic_py.core.auth import ROLE_ADMIN, ROLE_CLIENT, ROLE_MAINTENANCE, load_secret, role_key
from tectonic_py.core.cluster_file import (
    DEFAULT_CHUNK_SIZE,
    ENGINES,
    ClusterConfig,
    MetadataServer,
)
from tectonic_py.core.ec_policy import DEFAULT_POLICY, ECPolicy
from tectonic_py.core.errors import ConfigError, Timeout
from tectonic_py.core.process_env import PROJECT_ROOT, child_env
from tectonic_py.launch import monitoring
from tectonic_py.launch.fork_server import ForkedProcess, ForkServer, tectonic_argv
from tectonic_py.launch.local_etcd import EtcdCluster

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
ETCD_PREFIX = "/tectonic/local"


def _port_free(port: int) -> bool:
    if not port:
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


class _Daemon:
    """One daemon process we started, its ready file and its log."""

    def __init__(
        self, name: str, ready_file: Path, log_file: Path, forks: ForkServer | None = None
    ) -> None:
        self.name = name
        self.ready_file = ready_file
        self.log_file = log_file
        self.forks = forks
        self.proc: subprocess.Popen[bytes] | ForkedProcess | None = None
        self.address = ""
        self.metrics: str | None = None  # HOST:PORT of its metrics endpoint, if it has one

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def spawn(self, args: list[str]) -> None:
        """``tectonic ARGS``, forked from the fork server where the cluster has one, else
        run as a subprocess."""
        self.ready_file.unlink(missing_ok=True)
        env = child_env()
        if self.forks is not None:
            self.proc = self.forks.spawn(args, self.log_file, PROJECT_ROOT, env)
            return
        with open(self.log_file, "ab") as out:
            self.proc = subprocess.Popen(
                tectonic_argv(args),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=str(PROJECT_ROOT),
                env=env,
            )

    def wait_ready(self, deadline: float) -> str:
        assert self.proc is not None
        while True:
            if self.ready_file.exists():
                try:
                    info = json.loads(self.ready_file.read_text())
                    self.address = str(info["address"])
                    self.metrics = info.get("metrics")
                    return self.address
                except (ValueError, KeyError, OSError):
                    pass  # written atomically, but be lenient with a half-visible file
            if self.proc.poll() is not None:
                raise ConfigError(
                    f"{self.name} exited with status {self.proc.returncode} before it was ready; "
                    f"log {self.log_file}:\n{self._log_tail()}"
                )
            if time.monotonic() > deadline:
                raise Timeout(
                    f"{self.name} not ready in time; log {self.log_file}:\n{self._log_tail()}"
                )
            time.sleep(0.05)

    def _log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def signal(self, sig: int) -> None:
        if self.running:
            assert self.proc is not None
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float) -> bool:
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.wait(30)


class LocalCluster:
    """Metadata servers and chunk stores under one directory. See the module docstring."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        chunkstores: int = 10,  # RS(6,3) and a spare failure domain for repair
        metadata_servers: int = 2,
        shards: int = 64,
        ec: str = "rs-6-3",
        failure_domains: int | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        node_timeout: float = 10.0,
        heartbeat_interval: float = 1.0,
        start_timeout: float = 60.0,
        stop_timeout: float = 10.0,
        chunkstore_args: list[str] | None = None,
        metadata_args: list[str] | None = None,
        maintenance: bool = False,
        maintenance_args: list[str] | None = None,
        metadata_engine: str = "sqlite",
        etcd_members: int = 3,
        metrics: bool = False,
        fork_server: bool = True,
    ) -> None:
        if chunkstores < 1 or metadata_servers < 1 or not 1 <= shards <= 65536:
            raise ConfigError("need at least one chunk store and one metadata server")
        if metadata_servers > shards:
            raise ConfigError(f"{metadata_servers} metadata servers for only {shards} shards")
        ECPolicy.parse(ec)
        if failure_domains is not None and not 1 <= failure_domains <= chunkstores:
            raise ConfigError(f"failure_domains must be 1..{chunkstores}")
        self.root = Path(root).resolve()
        self.chunkstore_count = chunkstores
        self.metadata_count = metadata_servers
        self.shards = shards
        self.ec = ec
        self.failure_domains = failure_domains
        self.chunk_size = chunk_size
        self.node_timeout = node_timeout
        self.heartbeat_interval = heartbeat_interval
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.chunkstore_args = list(chunkstore_args or [])
        self.metadata_args = list(metadata_args or [])
        # A ``tectonic maintenance`` process (repair, GC, rebalance) when asked for; its
        # flags (short grace periods and intervals for tests) in ``maintenance_args``.
        self.maintenance = maintenance
        self.maintenance_args = list(maintenance_args or [])
        # Every daemon serves Prometheus metrics on a free loopback port; where is written
        # to metrics.json and monitoring/ (tectonic_py/launch/monitoring.py).
        self.metrics = metrics
        self._forks = (
            ForkServer(PROJECT_ROOT, child_env(), self.root / "logs" / "fork-server.log")
            if fork_server
            else None
        )
        self._maint = self._daemon("maintenance")
        if metadata_engine not in ENGINES:
            raise ConfigError(f"metadata engine {metadata_engine!r} is not one of {ENGINES}")
        self.metadata_engine = metadata_engine
        self.etcd = (
            EtcdCluster(self.root / "etcd", etcd_members) if metadata_engine == "etcd" else None
        )
        self._meta: list[_Daemon] = []
        self._chunk: list[_Daemon] = []
        self._ports: dict[str, int] = {}
        self.config: ClusterConfig | None = None

    # --- paths ---------------------------------------------------------------------------------

    @property
    def cluster_file(self) -> Path:
        return self.root / "cluster.toml"

    @property
    def secret_file(self) -> Path:
        return self.root / "secret"

    @property
    def client_file(self) -> Path:
        """The cluster file of role client: what a GPU node (a mount, a training job) gets."""
        return self.root / "client.toml"

    @property
    def maintenance_file(self) -> Path:
        return self.root / "maintenance.toml"

    def key_file(self, role: str) -> Path:
        return self.root / "keys" / f"{role}.key"

    @property
    def capability_key_file(self) -> Path:
        return self.root / "capability_key"

    def chunkstore_dir(self, i: int) -> Path:
        return self.root / "chunks" / str(i)

    def metadata_dir(self, i: int) -> Path:
        return self.root / "metadata" / str(i)

    def node_id(self, i: int) -> str:
        return f"cs{i}"

    def failure_domain(self, i: int) -> str:
        return f"fd{i if self.failure_domains is None else i % self.failure_domains}"

    def shards_of(self, i: int) -> list[int]:
        lo = i * self.shards // self.metadata_count
        hi = (i + 1) * self.shards // self.metadata_count
        return list(range(lo, hi))

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> ClusterConfig:
        """Start (or restart) every daemon and write ``cluster.toml``; returns its config."""
        for sub in ("metadata", "chunks", "logs", "run"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        for key_file in (self.secret_file, self.capability_key_file):
            _create_key_file(key_file)
        self._write_role_keys()
        self._load_state()
        if not self._meta:
            self._meta = [self._daemon(f"metadata-{i}") for i in range(self.metadata_count)]
        if not self._chunk:
            self._chunk = [self._daemon(f"chunkstore-{i}") for i in range(self.chunkstore_count)]
        try:
            deadline = time.monotonic() + self.start_timeout
            if self.etcd is not None:
                self.etcd.start()
            for i in range(self.metadata_count):
                if not self._meta[i].running:
                    self._spawn_metadata(i)
            for i in range(self.metadata_count):
                self._ports[f"metadata-{i}"] = self._port(self._meta[i].wait_ready(deadline))
            self._write_config()
            for i in range(len(self._chunk)):
                if not self._chunk[i].running:
                    self._spawn_chunkstore(i)
            for i in range(len(self._chunk)):
                self._ports[f"chunkstore-{i}"] = self._port(self._chunk[i].wait_ready(deadline))
            self._save_state()
            self._set_root_policy()
            if self.maintenance and not self._maint.running:
                self.start_maintenance()
            self._write_endpoints()
        except BaseException:
            self.stop()
            raise
        assert self.config is not None
        return self.config

    def stop(self) -> None:
        """SIGTERM every daemon we started, SIGKILL the ones still there after a timeout."""
        daemons = [d for d in [self._maint, *self._chunk, *self._meta] if d.running]
        for d in daemons:
            d.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        for d in daemons:
            if not d.wait(max(0.0, deadline - time.monotonic())):
                log.warning("%s ignored SIGTERM; killing it", d.name)
                d.kill()
        if self._forks is not None:
            self._forks.close()
        if self.etcd is not None:
            self.etcd.stop()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def pids(self) -> list[int]:
        daemons = [*self._meta, *self._chunk, self._maint]
        etcd = self.etcd.pids() if self.etcd is not None else []
        return [d.proc.pid for d in daemons if d.running and d.proc] + etcd

    def start_maintenance(self) -> None:
        """(Re)start the ``tectonic maintenance`` process with ``maintenance_args``."""
        if not self._maint.running:
            self._maint.spawn(
                [
                    "maintenance",
                    str(self.maintenance_file),
                    "--ready-file",
                    str(self._maint.ready_file),
                    *self._metrics_args(),
                    *self.maintenance_args,
                ]
            )
        self._maint.wait_ready(time.monotonic() + self.start_timeout)
        self._write_endpoints()

    def kill_maintenance(self) -> None:
        """kill -9 the maintenance process (fault injection)."""
        self._maint.kill()

    def stop_maintenance(self) -> None:
        self._maint.signal(signal.SIGTERM)
        if not self._maint.wait(self.stop_timeout):
            self._maint.kill()

    @property
    def maintenance_pid(self) -> int | None:
        return self._maint.proc.pid if self._maint.running and self._maint.proc else None

    def chunkstore_pids(self) -> list[int | None]:
        return [d.proc.pid if d.running and d.proc else None for d in self._chunk]

    def metadata_pids(self) -> list[int | None]:
        return [d.proc.pid if d.running and d.proc else None for d in self._meta]

    @property
    def chunkstores(self) -> int:
        return len(self._chunk)

    def kill_chunkstore(self, i: int) -> None:
        """kill -9 chunk store ``i`` (fault injection); its data stays on disk."""
        self._chunk[i].kill()

    def stop_chunkstore(self, i: int) -> None:
        d = self._chunk[i]
        d.signal(signal.SIGTERM)
        if not d.wait(self.stop_timeout):
            d.kill()

    def start_chunkstore(self, i: int) -> str:
        """(Re)start chunk store ``i`` with the same node id, data dir and port when free."""
        if not self._chunk[i].running:
            self._spawn_chunkstore(i)
        addr = self._chunk[i].wait_ready(time.monotonic() + self.start_timeout)
        self._write_endpoints()
        self._ports[f"chunkstore-{i}"] = self._port(addr)
        self._save_state()
        return addr

    def add_chunkstore(self) -> int:
        i = len(self._chunk)
        self._chunk.append(self._daemon(f"chunkstore-{i}"))
        self.chunkstore_count = len(self._chunk)
        self.start_chunkstore(i)
        return i

    def kill_metadata(self, i: int) -> None:
        self._meta[i].kill()

    def start_metadata(self, i: int) -> str:
        """Restart metadata server ``i`` on its port (the cluster file names that port)."""
        if not self._meta[i].running:
            self._spawn_metadata(i, require_same_port=True)
        addr = self._meta[i].wait_ready(time.monotonic() + self.start_timeout)
        self._ports[f"metadata-{i}"] = self._port(addr)
        self._write_endpoints()
        return addr

    def metrics_endpoints(self) -> dict[str, str]:
        """Process name -> HOST:PORT of its metrics, for every daemon started with them (a
        killed one stays: Prometheus shows it as down)."""
        daemons = [*self._meta, *self._chunk, self._maint]
        return {d.name: d.metrics for d in daemons if d.metrics}

    def _write_endpoints(self) -> None:
        if self.metrics:
            monitoring.write_endpoints(self.root, self.metrics_endpoints())

    def _metrics_args(self) -> list[str]:
        return ["--metrics-listen", f"{HOST}:0"] if self.metrics else []

    def metadata_address(self, i: int) -> str:
        return self._meta[i].address

    def chunkstore_address(self, i: int) -> str:
        return self._chunk[i].address

    # --- internals -------------------------------------------------------------------------------

    def _daemon(self, name: str) -> _Daemon:
        return _Daemon(
            name,
            self.root / "run" / f"{name}.ready",
            self.root / "logs" / f"{name}.log",
            self._forks,
        )

    @staticmethod
    def _port(address: str) -> int:
        return int(address.rpartition(":")[2])

    def _listen(self, name: str, require_same_port: bool = False) -> str:
        port = self._ports.get(name, 0)
        if port and not _port_free(port):
            if require_same_port:
                raise ConfigError(f"{name}: port {port} is taken; cannot restart on it")
            port = 0
        return f"{HOST}:{port}"

    def _spawn_metadata(self, i: int, require_same_port: bool = False) -> None:
        d = self._meta[i]
        data = self.metadata_dir(i)
        data.mkdir(parents=True, exist_ok=True)
        shards = self.shards_of(i)
        argv = [
            "metadata",
            "--data-dir",
            str(data),
            "--listen",
            self._listen(d.name, require_same_port),
            "--shards",
            f"{shards[0]}-{shards[-1]}",
            "--total-shards",
            str(self.shards),
            "--secret-file",
            str(self.secret_file),
            "--capability-key-file",
            str(self.capability_key_file),
            "--ready-file",
            str(d.ready_file),
            "--node-timeout",
            str(self.node_timeout),
            *self._engine_args(),
            *self._metrics_args(),
            *self.metadata_args,
        ]
        d.spawn(argv)

    def _engine_args(self) -> list[str]:
        if self.etcd is None:
            return []
        endpoints = ",".join(self.etcd.endpoints)
        return ["--engine", "etcd", "--etcd-endpoints", endpoints, "--etcd-prefix", ETCD_PREFIX]

    def _registry_setting(self) -> str:
        assert self.config is not None
        if self.etcd is None:
            return self.config.registry_address
        return ",".join(s.address for s in self.config.metadata_servers)

    def _spawn_chunkstore(self, i: int) -> None:
        d = self._chunk[i]
        data = self.chunkstore_dir(i)
        data.mkdir(parents=True, exist_ok=True)
        assert self.config is not None
        argv = [
            "chunkstore",
            "--data-dir",
            str(data),
            "--listen",
            self._listen(d.name),
            "--node-id",
            self.node_id(i),
            "--failure-domain",
            self.failure_domain(i),
            "--secret-file",
            str(self.secret_file),
            "--capability-key-file",
            str(self.capability_key_file),
            "--registry",
            self._registry_setting(),
            "--heartbeat-interval",
            str(self.heartbeat_interval),
            "--ready-file",
            str(d.ready_file),
            *self._metrics_args(),
            *self.chunkstore_args,
        ]
        d.spawn(argv)

    def _write_config(self) -> None:
        self.config = ClusterConfig(
            name="local",
            secret_file=None,
            shards=self.shards,
            metadata_servers=[
                MetadataServer(self._meta[i].address, self.shards_of(i))
                for i in range(self.metadata_count)
            ],
            default_ec=self.ec,
            chunk_size=self.chunk_size,
            metadata_engine=self.metadata_engine,
            etcd_endpoints=self.etcd.endpoints if self.etcd else [],
            etcd_prefix=ETCD_PREFIX if self.etcd else "",
            path=self.cluster_file,
            role=ROLE_ADMIN,
            key_file=self.key_file(ROLE_ADMIN),
        )
        for role, path in (
            (ROLE_CLIENT, self.client_file),
            (ROLE_MAINTENANCE, self.maintenance_file),
        ):
            self.config.with_role(role, self.key_file(role)).write(path)
        self.config.write(self.cluster_file)

    def _write_role_keys(self) -> None:
        """Each role's key file, derived from the secret (written again on every start, so a
        cluster directory made before roles gains them)."""
        secret = load_secret(self.secret_file)
        (self.root / "keys").mkdir(mode=0o700, exist_ok=True)
        for role in (ROLE_CLIENT, ROLE_MAINTENANCE, ROLE_ADMIN):
            _write_private(self.key_file(role), role_key(secret, role))

    def _set_root_policy(self) -> None:
        """The metadata server makes the root directory with RS(6,3); a cluster started with
        another ``ec`` sets the root's policy (inherited by everything created below it)."""
        if ECPolicy.parse(self.ec) == DEFAULT_POLICY:
            return
        argv = tectonic_argv(["mkdir", str(self.cluster_file), "/", "-p", "--ec", self.ec])
        env = child_env()
        r = subprocess.run(
            argv,
            check=False,
            capture_output=True,
            text=True,
            timeout=self.start_timeout,
            cwd=str(PROJECT_ROOT),
            env=env,
        )
        if r.returncode != 0:
            raise ConfigError(f"cannot set the root EC policy to {self.ec}: {r.stderr.strip()}")

    def _load_state(self) -> None:
        path = self.root / "state.json"
        try:
            state: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        ports = state.get("ports", {})
        if isinstance(ports, dict):
            self._ports.update({str(k): int(v) for k, v in ports.items()})
        n = int(state.get("chunkstores", 0))
        self.chunkstore_count = max(self.chunkstore_count, n)
        # A restart that does not say how to spread the chunk stores keeps the domains they
        # were given: those say which stores fail together, and forgetting them (one domain
        # each) would let placement put two chunks of a block where one failure takes both.
        domains = state.get("failure_domains")
        known = isinstance(domains, int) and 1 <= domains <= self.chunkstore_count
        if self.failure_domains is None and known:
            self.failure_domains = domains

    def _save_state(self) -> None:
        path = self.root / "state.json"
        tmp = path.with_suffix(".tmp")
        state = {
            "ports": self._ports,
            "chunkstores": len(self._chunk),
            "failure_domains": self.failure_domains,
        }
        tmp.write_text(json.dumps(state))
        os.replace(tmp, path)


def _create_key_file(path: Path) -> None:
    """64 random hex digits in ``path`` unless it exists."""
    if not path.exists():
        _write_private(path, secrets.token_hex(32).encode())


def _write_private(path: Path, data: bytes) -> None:
    """``data`` in ``path``, atomically; created 0600, never briefly readable by others under
    a loose umask."""
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_config(root: str | os.PathLike[str]) -> ClusterConfig:
    """The config of a local cluster started under ``root``."""
    return cluster_file.load(Path(root) / "cluster.toml")
