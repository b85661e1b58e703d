"""``tectonic metadata``: run one metadata server process (a set of logical shards)."""

from __future__ import annotations

import argparse
import logging
import signal

import trio

from metadata.server import MetadataServer, parse_shard_list
from tectonic_py.core import capability
from tectonic_py.core.aio import _single
from tectonic_py.core.auth import load_secret
from tectonic_py.core.errors import ConfigError, TectonicError
from tectonic_py.core.sockets import parse_address

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("metadata", help="run a metadata server (Name/File/Block shards)")
    p.add_argument("--data-dir", required=True, help="directory of the shards' SQLite files")
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0: any free port)")
    p.add_argument("--shards", required=True, help="logical shards hosted here, e.g. 0-31 or 0,2")
    p.add_argument("--total-shards", type=int, required=True, help="S, fixed at cluster creation")
    p.add_argument("--secret-file", required=True)
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
    # a service log shows start, ready and shutdown without -v
    p.set_defaults(func=run, daemon_loggers=["metadata"])


def run(args: argparse.Namespace) -> int:
    host, port = parse_address(args.listen)
    server = MetadataServer(
        args.data_dir,
        parse_shard_list(args.shards),
        args.total_shards,
        load_secret(args.secret_file),
        capability_key=capability.load_key(args.capability_key_file),
        node_timeout=args.node_timeout,
        lease_ns=int(args.writer_lease * 1e9),
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
