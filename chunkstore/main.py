"""``tectonic chunkstore``: run one chunk store daemon (flags in docs/INTERFACES.md)."""

from __future__ import annotations

import argparse
import logging
import resource
import signal
from pathlib import Path
from typing import Any

import trio

from chunkstore.server import StoreConfig, serve
from chunkstore.traffic import parse_weights
from tectonic_py.core import auth, capability, sockets
from tectonic_py.core.aio import open_service_nursery
from tectonic_py.core.units import size_arg

log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("chunkstore", help="run a chunk store daemon")
    p.add_argument("--data-dir", required=True, type=Path, help="where chunks are stored")
    p.add_argument("--listen", required=True, help="HOST:PORT to listen on (port 0: any)")
    p.add_argument("--node-id", required=True, help="this node's name in the cluster")
    p.add_argument("--failure-domain", required=True, help="e.g. the rack of this node")
    p.add_argument("--secret-file", required=True, type=Path, help="the cluster secret")
    p.add_argument(
        "--capability-key-file",
        type=Path,
        help="the key that signs capabilities (metadata servers and chunk stores only; required)",
    )
    p.add_argument(
        "--registry",
        help="HOST:PORT of the metadata server hosting shard 0 (etcd engine: every metadata"
        " server, comma-separated)",
    )
    p.add_argument(
        "--capacity", type=size_arg, help="bytes this node may store, e.g. 2TiB (default: the disk)"
    )
    p.add_argument("--heartbeat-interval", type=float, default=1.0, help="seconds")
    p.add_argument("--ready-file", type=Path, help="written (JSON address, pid) once serving")
    p.add_argument(
        "--max-concurrent-writes",
        type=int,
        default=8,
        help="puts and deletes on disk at once (disk worker threads)",
    )
    p.add_argument("--max-concurrent-reads", type=int, default=16, help="gets on disk at once")
    p.add_argument(
        "--payload-budget",
        type=size_arg,
        default="256MiB",
        help="bytes of put payloads held in memory at once",
    )
    p.add_argument(
        "--max-queued",
        type=int,
        default=1024,
        help="puts waiting for payload memory before new ones get 'busy'",
    )
    p.add_argument(
        "--reply-budget",
        type=size_arg,
        default="256MiB",
        help="bytes of get replies held in memory at once (slow readers wait beyond it)",
    )
    p.add_argument(
        "--scrub-rate",
        type=size_arg,
        default="16MiB",
        help="bytes/s that scrub re-reads and verifies (0: no scrub)",
    )
    p.add_argument(
        "--scrub-interval",
        type=float,
        default=3600.0,
        help="seconds between the starts of two scrub passes over every chunk",
    )
    p.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics (port 0: any free port;"
        " the ready file names it); default: no metrics",
    )
    p.add_argument(
        "--job",
        action="append",
        default=[],
        metavar="NAME=WEIGHT",
        help="a traffic class's weight in the fair queue of puts and gets (repeat per job;"
        " 'default': clients that name no job, 'background': maintenance; both 1 unless set)",
    )
    p.add_argument(
        "--max-write-rate",
        type=size_arg,
        default=None,
        help="bytes/s of puts admitted to the disk, shared by weight (default: no limit)",
    )
    p.add_argument(
        "--max-read-rate",
        type=size_arg,
        default=None,
        help="bytes/s of gets admitted to the disk, shared by weight (default: no limit)",
    )
    # a service log shows start, ready and shutdown without -v
    p.set_defaults(func=run, daemon_loggers=["chunkstore"])


def _raise_fd_limit() -> None:
    """A burst of connections needs descriptors; take the hard limit the operator allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run(args: argparse.Namespace) -> int:
    host, port = sockets.parse_address(args.listen)
    config = StoreConfig(
        data_dir=args.data_dir,
        node_id=args.node_id,
        failure_domain=args.failure_domain,
        secret=auth.load_secret(args.secret_file),
        capability_key=capability.load_key(args.capability_key_file),
        host=host,
        port=port,
        capacity=args.capacity,
        registry=args.registry,
        heartbeat_interval=args.heartbeat_interval,
        ready_file=args.ready_file,
        max_concurrent_writes=args.max_concurrent_writes,
        max_concurrent_reads=args.max_concurrent_reads,
        payload_budget=args.payload_budget,
        max_payload_waiters=args.max_queued,
        reply_budget=args.reply_budget,
        scrub_rate=args.scrub_rate,
        scrub_interval=args.scrub_interval,
        metrics_listen=args.metrics_listen,
        jobs=parse_weights(args.job),
        max_write_rate=args.max_write_rate or None,
        max_read_rate=args.max_read_rate or None,
    )
    _raise_fd_limit()
    log.info(
        "chunk store %s starting: data in %s, listening on %s, failure domain %s",
        args.node_id,
        args.data_dir,
        args.listen,
        args.failure_domain,
    )
    trio.run(_main, config)
    log.info("chunk store %s stopped", args.node_id)
    return 0


async def _main(config: StoreConfig) -> None:
    """Serve until SIGTERM or SIGINT, then stop cleanly (puts already acknowledged are on
    disk either way; this only spares clients a reset connection mid-reply)."""
    async with open_service_nursery() as nursery:  # a startup error surfaces as itself
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            await nursery.start(serve, config)
            async for signum in signals:
                log.info("signal %d: shutting down", signum)
                nursery.cancel_scope.cancel()
                break
