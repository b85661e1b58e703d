"""``tectonic metadata``: run one metadata server process (a set of logical shards);
``tectonic metadata backup`` / ``restore``: the embedded engine's safety net (metadata/backup.py).

The daemon's flags stay on ``tectonic metadata`` itself (service units call it that way); the
two admin commands are its optional subcommands, so the daemon's required flags are checked
here rather than by argparse.
"""

from __future__ import annotations

import argparse
import logging
import signal
from pathlib import Path
from typing import Any

import trio

from metadata import backup, crash_points
from metadata.client import MetadataClient
from metadata.engines import ENGINES, settings_from_args
from metadata.server import MetadataServer, parse_shard_list
from tectonic_py.core import capability, cluster_file
from tectonic_py.core.aio import _single, open_service_nursery
from tectonic_py.core.auth import load_secret
from tectonic_py.core.errors import ConfigError, TectonicError
from tectonic_py.core.sockets import parse_address

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "metadata",
        help="run a metadata server (Name/File/Block shards); backup and restore its shards",
    )
    p.add_argument("--data-dir", help="directory of the shards' SQLite files (required)")
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0: any free port)")
    p.add_argument("--shards", help="logical shards hosted here, e.g. 0-31 or 0,2 (required)")
    p.add_argument("--total-shards", type=int, help="S, fixed at cluster creation (required)")
    p.add_argument("--secret-file", help="the cluster's shared secret (required)")
    p.add_argument(
        "--capability-key-file",
        help="the key that signs capabilities (metadata servers and chunk stores only; required)",
    )
    p.add_argument("--ready-file", help="write {address, pid} as JSON here once serving")
    p.add_argument(
        "--node-timeout",
        type=float,
        default=10.0,
        help="seconds without a heartbeat before a chunk store is down",
    )
    p.add_argument(
        "--writer-lease",
        type=float,
        default=60.0,
        help="seconds a writer token stays live without renew_lease",
    )
    p.add_argument(
        "--engine",
        choices=sorted(ENGINES),
        default="sqlite",
        help="where the shards live: SQLite files in --data-dir, or etcd (then --shards are"
        " the ones this server claims first, and it takes over those of dead servers)",
    )
    p.add_argument("--etcd-endpoints", help="etcd members, comma-separated URLs (--engine etcd)")
    p.add_argument("--etcd-prefix", help="key prefix of this cluster in etcd (--engine etcd)")
    p.add_argument(
        "--etcd-lease-ttl", type=int, default=3, help="seconds a dead server's shards stay its"
    )
    p.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics (port 0: any free port;"
        " the ready file names it); default: no metrics",
    )
    # a service log shows start, ready and shutdown without -v
    p.set_defaults(func=run, daemon_loggers=["metadata"], metadata_parser=p)
    admin = p.add_subparsers(dest="metadata_command", metavar="{backup,restore}")
    b = admin.add_parser(
        "backup",
        help="online snapshot of every shard, into DEST/server-N on each server's host",
    )
    b.add_argument(
        "cluster_file", metavar="CLUSTER_FILE", type=Path, help="the cluster file (cluster.toml)"
    )
    b.add_argument("dest", type=Path, help="a new or empty directory (absolute path)")
    b.set_defaults(func=run_backup)
    r = admin.add_parser(
        "restore", help="put one server's backup into its data directory (server stopped)"
    )
    r.add_argument("backup", type=Path, help="a backup's server-N directory")
    r.add_argument("--data-dir", dest="restore_data_dir", type=Path, required=True)
    r.add_argument("--force", action="store_true", help="move the shard files already there aside")
    r.add_argument("--verify-only", action="store_true", help="check the backup, change nothing")
    r.set_defaults(func=run_restore)


def run_backup(args: argparse.Namespace) -> int:
    dest = args.dest.absolute()

    async def go() -> list[dict[str, Any]]:
        async with open_service_nursery() as nursery:
            meta = MetadataClient(cluster_file.load(args.cluster_file), nursery=nursery)
            try:
                return await meta.backup(str(dest))
            finally:
                await meta.aclose()

    for m in trio.run(go):
        took = (m["finished_ns"] - m["started_ns"]) / 1e9
        print(f"{m['server']}: {len(m['shards'])} shards in {took:.2f} s")
    print(f"backup complete: {dest}")
    return 0


def run_restore(args: argparse.Namespace) -> int:
    if args.verify_only:
        m = backup.verify(args.backup)
        print(f"{args.backup}: {len(m['shards'])} shards verified (from {m['server']})")
        return 0
    m = backup.restore(args.backup, args.restore_data_dir, force=args.force)
    print(f"restored {len(m['shards'])} shards of {m['server']} into {m['data_dir']}")
    if m["moved_aside"]:
        print(f"the shard files that were there are in {m['moved_aside']}")
    return 0


def run(args: argparse.Namespace) -> int:
    missing = [
        flag
        for flag, value in [
            ("--data-dir", args.data_dir),
            ("--shards", args.shards),
            ("--total-shards", args.total_shards),
            ("--secret-file", args.secret_file),
        ]
        if value is None
    ]
    if missing:
        args.metadata_parser.error(f"the following arguments are required: {', '.join(missing)}")
    try:
        engine = settings_from_args(args)
    except ConfigError as e:
        args.metadata_parser.error(e.message)
    crash_points.arm_from_env()  # tests only (metadata/crash_points.py)
    host, port = parse_address(args.listen)
    server = MetadataServer(
        args.data_dir,
        parse_shard_list(args.shards),
        args.total_shards,
        load_secret(args.secret_file),
        capability_key=capability.load_key(args.capability_key_file),
        node_timeout=args.node_timeout,
        lease_ns=int(args.writer_lease * 1e9),
        engine=engine,
        metrics_listen=args.metrics_listen,
    )
    log.info(
        "metadata server starting: shards %s of %d, data in %s, listening on %s",
        args.shards,
        args.total_shards,
        args.data_dir,
        args.listen,
    )
    try:
        trio.run(_serve_until_signalled, server, host, port, args.ready_file)
    except BaseExceptionGroup as group:
        # trio wraps even one failure; surface a lone startup error (a port in use) as one line.
        inner = _single(group)
        if isinstance(inner, OSError):
            raise ConfigError(f"cannot serve on {args.listen}: {inner.strerror or inner}") from None
        if inner is not None and isinstance(inner, (TectonicError, KeyboardInterrupt)):
            raise inner from None
        raise
    log.info("metadata server stopped")
    return 0


async def _serve_until_signalled(
    server: MetadataServer, host: str, port: int, ready_file: str | None
) -> None:
    """SIGTERM/SIGINT end the server cleanly: every acknowledged change is already durable
    (a reply follows its commit), so stopping needs no flush, only closing the databases."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            h, p = await nursery.start(
                lambda task_status: server.serve(
                    host, port, ready_file=ready_file, task_status=task_status
                )
            )
            log.info("metadata server ready on %s:%d", h, p)
            async for signum in signals:
                log.info("metadata server stopping on signal %d", signum)
                nursery.cancel_scope.cancel()
                break
