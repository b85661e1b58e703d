"""``tectonic cluster up/down``: the embedded local cluster as a command, a thin layer over
``tectonic_py.launch.local_cluster.LocalCluster``.

``up`` runs in the foreground until Ctrl-C (or SIGTERM/SIGHUP), then stops every daemon
cleanly. ``up --detach`` starts the same supervisor as a background process in its own
session and returns once the cluster is healthy; ``down`` stops it.

Files in DIR besides the cluster's own data:

* ``cluster.pid``: JSON ``{"pid", "daemons": [pids], "cluster_file"}`` written atomically by
  the supervisor once the cluster is healthy, removed when it stops. ``down`` signals only
  PIDs from this file, and only while their command line still names DIR: a PID reused by
  an unrelated process after a crash is never signalled.
* ``cluster.log``: stdout/stderr of a detached supervisor and its daemons' start-up errors.

Why a supervisor process at all (rather than detached daemons): one process owns the
daemons' lifetimes, so a Ctrl-C or a ``down`` stops all of them together and a failed
start never leaves half a cluster running.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from chunkstore.traffic import parse_weights
from tectonic_py.core import cluster_file
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import ConfigError, TectonicError, Timeout
from tectonic_py.launch.fork_server import command_line
from tectonic_py.launch.local_cluster import LocalCluster

log = logging.getLogger(__name__)

# A new cluster's layout. Ten chunk stores, one failure domain each, for RS(6,3)'s nine
# chunks per block: a spare domain, so repair has somewhere to rebuild a lost store's chunks
# (with nine, every other store already holds a chunk of each of its blocks).
FRESH: dict[str, Any] = {
    "chunkstores": 10,
    "metadata_servers": 2,
    "shards": 64,
    "ec": "rs-6-3",
    "metadata_engine": "sqlite",
}
PID_FILE = "cluster.pid"
LOG_FILE = "cluster.log"
# bounds on waiting: a cold start of 2 metadata servers and 10 chunk stores on a loaded
# 2-core machine takes seconds; minutes mean something is wrong and the log says what
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0


class _Stop(Exception):
    """A stop signal arrived (SIGINT, SIGTERM, SIGHUP)."""


def _read_pid_file(root: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((root / PID_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        raise ConfigError(f"{root / PID_FILE} is unreadable: remove it by hand") from None
    if not isinstance(data, dict) or not isinstance(data.get("pid"), int):
        raise ConfigError(f"{root / PID_FILE} is malformed: remove it by hand")
    return data


def _write_pid_file(root: Path, data: dict[str, Any]) -> None:
    tmp = root / (PID_FILE + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, root / PID_FILE)


def _ours(pid: int, root: Path) -> psutil.Process | None:
    """The live process ``pid`` if its command line names ``root`` or a path inside it (the
    supervisor's ``--dir``, a daemon's ``--data-dir``), else None. Whole path components
    only: a cluster in /x/c must never claim the processes of one in /x/c2."""
    try:
        proc = psutil.Process(pid)
        if not _alive(proc):
            return None
        cmdline = command_line(proc)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    text = str(root)
    return proc if any(a == text or a.startswith(text + os.sep) for a in cmdline) else None


def _running_supervisor(root: Path) -> psutil.Process | None:
    data = _read_pid_file(root)
    return None if data is None else _ours(data["pid"], root)


def _apply_existing(args: argparse.Namespace, root: Path) -> None:
    """Options not given default to the layout of the cluster already in ``root`` (``FRESH``
    for a new one), so a plain restart brings back exactly what was there. The shard map is
    fixed at creation: asking for another one is refused rather than silently starting
    metadata servers over the wrong shards."""
    existing = None
    if (root / "cluster.toml").exists():
        existing = cluster_file.load(root / "cluster.toml")
    fresh = dict(FRESH)
    if existing is not None:
        chunk_dirs = root / "chunks"  # LocalCluster's layout: chunks/N per chunk store
        made = [d for d in chunk_dirs.iterdir() if d.is_dir()] if chunk_dirs.is_dir() else []
        old = {
            "chunkstores": len(made) or fresh["chunkstores"],
            "metadata_servers": len(existing.metadata_servers),
            "shards": existing.shards,
            "ec": existing.default_ec,
            "metadata_engine": existing.metadata_engine,
        }
        for name in ("metadata_servers", "shards", "metadata_engine"):
            given = getattr(args, name)
            if given is not None and given != old[name]:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(
                    f"{root} holds a cluster with {old['shards']} shards on "
                    f"{old['metadata_servers']} metadata servers ({old['metadata_engine']}"
                    f" engine), fixed at creation: {flag} {given} is not possible there"
                )
        fresh.update(old)
    for name, value in fresh.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def _make_cluster(args: argparse.Namespace, root: Path) -> LocalCluster:
    """The LocalCluster for these options; it validates them (one-line ConfigError). Placement
    never puts two chunks of a block on one node, so fewer than k+m chunk stores could store
    nothing: refused here, before any process starts."""
    policy = ECPolicy.parse(args.ec)
    if args.chunkstores < policy.n:
        raise ConfigError(
            f"{policy} writes {policy.n} chunks per block on distinct nodes: "
            f"needs --chunkstores >= {policy.n}, not {args.chunkstores}"
        )
    return LocalCluster(
        root,
        chunkstores=args.chunkstores,
        metadata_servers=args.metadata_servers,
        shards=args.shards,
        ec=args.ec,
        failure_domains=args.failure_domains,
        node_timeout=args.node_timeout,
        maintenance=not args.no_maintenance,
        metrics=not args.no_metrics,
        chunkstore_args=["--scrub-interval", str(args.scrub_interval), *_job_args(args)],
        maintenance_args=["--inventory-interval", str(args.inventory_interval)],
        metadata_engine=args.metadata_engine or FRESH["metadata_engine"],
    )


def _job_args(args: argparse.Namespace) -> list[str]:
    """The chunk stores' traffic class weights (``--job NAME=WEIGHT``), checked here so a
    bad one is one line before any process starts."""
    parse_weights(args.job)
    return [a for spec in args.job for a in ("--job", spec)]


def _domains(args: argparse.Namespace) -> int:
    return args.chunkstores if args.failure_domains is None else args.failure_domains


def _metrics_lines(cluster_file: Path, args: argparse.Namespace) -> list[str]:
    if args.no_metrics:
        return []
    prometheus_yml = cluster_file.parent / "monitoring" / "prometheus.yml"
    return [
        f"metrics:       tectonic stats {cluster_file}",
        f"prometheus:    prometheus --config.file={prometheus_yml}",
    ]


def _summary(cluster_file: Path, args: argparse.Namespace, detached: bool) -> str:
    how_to_stop = (
        f"stop it:       tectonic cluster down --dir {args.dir}"
        if detached
        else "stop it:       Ctrl-C"
    )
    client_file = cluster_file.with_name("client.toml")
    policy = ECPolicy.parse(args.ec)
    spare = []
    if _domains(args) <= policy.n:
        spare.append(
            f"warning:       {_domains(args)} failure domains for {policy.n} chunks per block: "
            f"no spare for repair (use --chunkstores {policy.n + 1} or more)"
        )
    return "\n".join(
        [
            (
                f"cluster up: {args.metadata_servers} metadata server(s)"
                f" ({args.metadata_engine}), "
                f"{args.chunkstores} chunk stores, {args.ec}, data in {args.dir}"
            ),
            f"cluster file:  {cluster_file} (role admin: the operator's)",
            f"for GPU nodes: {client_file} (role client: mount, put, get, loadtest, DCP)",
            f"status:        tectonic status {cluster_file}",
            f"mount:         tectonic mount {client_file} MOUNTPOINT",
            *_metrics_lines(cluster_file, args),
            how_to_stop,
            *spare,
        ]
    )


def _run_foreground(args: argparse.Namespace, root: Path, *, detached: bool) -> int:
    """Start, publish the pid file, wait for a stop signal, stop. Always stops what started."""

    def on_signal(signum: int, frame: object) -> None:
        raise _Stop()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    cluster = _make_cluster(args, root)
    try:
        try:
            try:
                cluster.start()
            except TectonicError as e:
                # the launcher appends the daemon's log tail; the CLI's error stays one
                # line, and that line names the log to read
                raise type(e)(str(e).splitlines()[0]) from None
            pids = [int(p) for p in cluster.pids()]
            _write_pid_file(
                root,
                {"pid": os.getpid(), "daemons": pids, "cluster_file": str(cluster.cluster_file)},
            )
            print(_summary(Path(cluster.cluster_file), args, detached), flush=True)
            _watch(pids)
        finally:
            # a second Ctrl-C during the stop must not leave daemons behind
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
            cluster.stop()
            (root / PID_FILE).unlink(missing_ok=True)
    except _Stop:
        print("cluster stopped", flush=True)
        return 0
    return 0


def _watch(pids: list[int]) -> None:
    """Wait for a stop signal; say once (to stderr) when a daemon dies on its own, since the
    cluster then runs degraded until it is restarted."""
    reported: set[int] = set()
    while True:
        time.sleep(1.0)
        for pid in pids:
            if pid in reported:
                continue
            try:
                alive = _alive(psutil.Process(pid))
            except psutil.NoSuchProcess:
                alive = False
            if not alive:
                reported.add(pid)
                print(f"warning: daemon pid {pid} exited; the cluster is degraded", file=sys.stderr)


def _detach(args: argparse.Namespace, root: Path) -> int:
    """Start the supervisor in its own session and wait (bounded) until it reports healthy."""
    argv = [
        sys.executable, "-m", "tectonic_py.cli.main", "cluster", "up", "--dir", str(root),
        "--chunkstores", str(args.chunkstores), "--metadata-servers", str(args.metadata_servers),
        "--shards", str(args.shards), "--ec", args.ec, "--node-timeout", str(args.node_timeout),
        "--scrub-interval", str(args.scrub_interval),
        "--inventory-interval", str(args.inventory_interval),
        "--metadata-engine", args.metadata_engine, "--supervisor", *_job_args(args),
    ]  # fmt: skip
    if args.no_maintenance:
        argv.append("--no-maintenance")
    if args.no_metrics:
        argv.append("--no-metrics")
    if args.failure_domains is not None:
        argv += ["--failure-domains", str(args.failure_domains)]
    log_path = root / LOG_FILE
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
            start_new_session=True, close_fds=True,
        )  # fmt: skip
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        data = _read_pid_file(root)
        if data is not None and data["pid"] == proc.pid:
            print(_summary(Path(data["cluster_file"]), args, detached=True))
            print(f"supervisor pid {proc.pid}, log {log_path}")
            return 0
        if proc.poll() is not None:
            raise ConfigError(f"the cluster did not start: {_last_error(log_path)}")
        if time.monotonic() > deadline:
            proc.terminate()
            raise Timeout(
                f"the cluster was not healthy after {START_TIMEOUT_S:.0f} s; see {log_path}"
            )
        time.sleep(0.2)


def _last_error(log_path: Path) -> str:
    """The last non-empty line of the log (the supervisor's one-line error), with its path."""
    try:
        lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines()]
    except OSError:
        lines = []
    lines = [ln for ln in lines if ln]
    return f"{lines[-1]} (log: {log_path})" if lines else f"see {log_path}"


def cmd_up(args: argparse.Namespace) -> int:
    root = Path(args.dir).resolve()
    args.dir = str(root)
    _apply_existing(args, root)
    _make_cluster(args, root)  # validate before anything is created
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create {root}: {e.strerror}") from None
    running = _running_supervisor(root)
    if running is not None:
        raise ConfigError(
            f"a cluster is already running in {root} (pid {running.pid}); "
            f"stop it with: tectonic cluster down --dir {root}"
        )
    (root / PID_FILE).unlink(missing_ok=True)  # stale: its process is gone
    if args.detach:
        return _detach(args, root)
    return _run_foreground(args, root, detached=args.supervisor)


def _alive(proc: psutil.Process) -> bool:
    """Running and not a zombie: an exited process whose parent has not reaped it yet has
    stopped as far as we are concerned (psutil.wait_procs would wait on it for nothing)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _terminate(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """SIGTERM each, wait (bounded) for all to exit; the ones still running."""
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    deadline = time.monotonic() + timeout
    alive = [p for p in procs if _alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if _alive(p)]
    return alive


def cmd_down(args: argparse.Namespace) -> int:
    root = Path(args.dir).resolve()
    data = _read_pid_file(root)
    if data is None:
        print(f"no cluster is running in {root}")
        return 0
    supervisor = _ours(data["pid"], root)
    if supervisor is not None and _terminate([supervisor], STOP_TIMEOUT_S):
        raise Timeout(
            f"the cluster supervisor (pid {supervisor.pid}) did not stop within "
            f"{STOP_TIMEOUT_S:.0f} s; see {root / LOG_FILE}"
        )
    # daemons left behind by a supervisor that was killed (kill -9, OOM): stop them too
    leftovers = [p for p in (_ours(int(pid), root) for pid in data.get("daemons", [])) if p]
    if leftovers:
        log.warning("stopping %d daemons left by a dead supervisor", len(leftovers))
        for p in _terminate(leftovers, STOP_TIMEOUT_S / 2):
            p.kill()
    (root / PID_FILE).unlink(missing_ok=True)
    print(f"cluster in {root} stopped")
    return 0


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "cluster",
        help="an embedded cluster on this machine (up/down)",
        description="Run metadata servers and chunk stores as local processes with data in "
        "one directory.",
    )
    sub = p.add_subparsers(dest="cluster_command", metavar="{up,down}")
    sub.required = True
    up = sub.add_parser(
        "up",
        help="create (first time) and start a local cluster; Ctrl-C stops it",
        description="Create the cluster in DIR on first use (secret, capability key, shard map, "
        "config), start its daemons, wait until all are healthy and write DIR/cluster.toml. "
        "Restarting on the same DIR brings back all data.",
    )
    up.add_argument("--dir", required=True, help="directory for all data and DIR/cluster.toml")
    new = "for a new cluster; else what DIR holds"
    up.add_argument(
        "--chunkstores", type=int,
        help=f"chunk store processes (default: {FRESH['chunkstores']} {new})",
    )  # fmt: skip
    up.add_argument(
        "--metadata-servers", type=int,
        help=f"metadata servers, fixed at creation (default: {FRESH['metadata_servers']} {new})",
    )  # fmt: skip
    up.add_argument(
        "--shards", type=int,
        help=f"logical metadata shards, fixed at creation (default: {FRESH['shards']} {new})",
    )  # fmt: skip
    up.add_argument(
        "--metadata-engine", choices=["sqlite", "etcd"],
        help="where the namespace lives: SQLite files on each metadata server, or a 3-member"
        f" etcd cluster on loopback that survives a server (default: sqlite {new})",
    )  # fmt: skip
    up.add_argument("--ec", help=f"default EC policy: rs-K-M or rN (default: {FRESH['ec']} {new})")
    up.add_argument(
        "--failure-domains", type=int,
        help="spread chunk stores over this many failure domains (default: one each, or"
        " what the cluster in DIR was started with); repair needs more than k+m",
    )  # fmt: skip
    up.add_argument(
        "--node-timeout", type=float, default=10.0,
        help="seconds of heartbeat silence before a chunk store counts as down",
    )  # fmt: skip
    up.add_argument(
        "--scrub-interval", type=_positive, default=3600.0,
        help="seconds between the starts of two scrub passes of every chunk store",
    )  # fmt: skip
    up.add_argument(
        "--job", action="append", default=[], metavar="NAME=WEIGHT",
        help="a job's weight in the chunk stores' fair queues (repeatable; 'default' for "
        "clients naming no job, 'background' for maintenance; each 1 unless set); a client "
        "names its job with job = NAME in its cluster file or tectonic loadtest --job",
    )  # fmt: skip
    up.add_argument(
        "--inventory-interval", type=_positive, default=600.0,
        help="seconds between the maintenance daemon's passes checking every store's chunks "
        "against the Block layer",
    )  # fmt: skip
    up.add_argument(
        "--no-maintenance", action="store_true",
        help="run without the maintenance daemon (repair, GC, rebalance): a lost chunk store "
        "then stays degraded until it comes back",
    )  # fmt: skip
    up.add_argument(
        "--no-metrics", action="store_true",
        help="run the daemons without metrics endpoints (by default each serves Prometheus "
        "metrics on a free 127.0.0.1 port, listed in DIR/metrics.json; docs/metrics.md)",
    )  # fmt: skip
    up.add_argument(
        "--detach", action="store_true",
        help="run in the background (pid file DIR/cluster.pid); stop with `cluster down`",
    )  # fmt: skip
    up.add_argument("--supervisor", action="store_true", help=argparse.SUPPRESS)
    up.set_defaults(func=cmd_up)
    down = sub.add_parser("down", help="stop a cluster started with `cluster up --detach`")
    down.add_argument("--dir", required=True, help="the directory given to `cluster up`")
    down.set_defaults(func=cmd_down)
