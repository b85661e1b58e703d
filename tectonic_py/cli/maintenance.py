"""``tectonic maintenance CLUSTER_FILE`` (run the background services until stopped) and
``tectonic repair CLUSTER_FILE --status`` (where repair stands; exit code 3 when a block is
lost, i.e. has fewer than k live chunks, or the last fsck found a file's data lost) and ``tectonic repair CLUSTER_FILE --inventory`` (one
inventory pass now: every chunk the Block layer places on an up store checked against the
store's listing, what is missing or replaced recorded for repair).

What each service does and why it is safe to kill at any moment: tectonic_py/maintenance/.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
from pathlib import Path
from typing import Any

import trio

from metadata.client import MetadataClient
from tectonic_py.cli.common import EXIT_UNHEALTHY, add_cluster_file
from tectonic_py.core import cluster_file
from tectonic_py.core.aio import open_service_nursery
from tectonic_py.core.units import size_arg
from tectonic_py.maintenance import fsck_summary
from tectonic_py.maintenance.runtime import SERVICES, Maintenance, MaintenanceSettings
from tectonic_py.maintenance.services import run_services

log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "maintenance", help="run repair, scrub coordination, GC, lease recovery and rebalance"
    )
    add_cluster_file(p, type=Path)
    p.add_argument("--interval", type=float, default=10.0, help="seconds between rounds")
    p.add_argument(
        "--grace",
        type=float,
        default=3600.0,
        help="seconds before unreferenced chunks and blocks are collected",
    )
    p.add_argument(
        "--superseded-grace",
        type=float,
        default=30.0,
        help="seconds before a block replaced by a newer version (an in-place write) is collected",
    )
    p.add_argument(
        "--lease-grace",
        type=float,
        default=600.0,
        help="seconds past a writer lease's expiry before its file is recovered",
    )
    p.add_argument(
        "--sweep-interval",
        type=float,
        default=3600.0,
        help="seconds between full sweeps (block scan, chunk lists of every node)",
    )
    p.add_argument(
        "--bandwidth",
        type=size_arg,
        default="200MiB",
        help="bytes per second that repair and rebalance read and write together",
    )
    p.add_argument(
        "--inventory-interval",
        type=float,
        default=600.0,
        help="seconds between inventory passes (every store's chunks against the Block layer)",
    )
    p.add_argument(
        "--unreachable-grace",
        type=float,
        default=600.0,
        help="seconds between the two sweeps' walks that must both miss a record no name "
        "reaches before it is deleted",
    )
    p.add_argument("--repair-concurrency", type=int, default=4, help="blocks rebuilt at once")
    p.add_argument("--no-rebalance", action="store_true", help="do not move chunks to balance")
    p.add_argument(
        "--rebalance-tolerance",
        type=float,
        default=0.1,
        help="move while fullest - emptiest exceeds this fraction of the mean used bytes",
    )
    p.add_argument("--rebalance-max-moves", type=int, default=256, help="chunk moves per round")
    p.add_argument(
        "--compact-below",
        type=float,
        default=0.25,
        help="rewrite packs of small files at most this share of whose bytes are still live, "
        "every sweep interval, once older than the grace (0: never)",
    )
    p.add_argument(
        "--retention-interval",
        type=float,
        default=5.0,
        help="seconds between retention rounds (tectonic retention set): how soon after a"
        " commit the steps past a directory's keep-last go",
    )
    p.add_argument(
        "--services",
        default=",".join(SERVICES),
        help=f"comma-separated subset of {','.join(SERVICES)}",
    )
    p.add_argument("--ready-file", type=Path, help="written (JSON pid) once the services run")
    p.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics (port 0: any free port;"
        " the ready file names it); default: no metrics",
    )
    # a service log shows start, ready and shutdown without -v
    p.set_defaults(
        func=run_maintenance,
        daemon_loggers=["tectonic_py.maintenance", "tectonic_py.cli.maintenance"],
    )

    r = subparsers.add_parser(
        "repair",
        help="repair progress (tectonic repair CLUSTER_FILE --status), or an inventory pass now",
    )
    add_cluster_file(r, type=Path)
    what = r.add_mutually_exclusive_group(required=True)
    what.add_argument("--status", action="store_true", help="show repair progress")
    what.add_argument(
        "--inventory",
        action="store_true",
        help="check every up store's chunks against the Block layer now; record what is "
        "missing or replaced for repair",
    )
    r.add_argument("--json", action="store_true", help="machine-readable output")
    r.set_defaults(func=run_status)


def settings_from(args: argparse.Namespace) -> MaintenanceSettings:
    return MaintenanceSettings(
        interval=args.interval,
        grace=args.grace,
        superseded_grace=args.superseded_grace,
        lease_grace=args.lease_grace,
        unreachable_grace=args.unreachable_grace,
        sweep_interval=args.sweep_interval,
        inventory_interval=args.inventory_interval,
        bandwidth=args.bandwidth,
        repair_concurrency=args.repair_concurrency,
        rebalance=not args.no_rebalance,
        rebalance_tolerance=args.rebalance_tolerance,
        rebalance_max_moves=args.rebalance_max_moves,
        compact_below=args.compact_below,
        retention_interval=args.retention_interval,
        services=tuple(s.strip() for s in args.services.split(",") if s.strip()),
    )


def run_maintenance(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    config = cluster_file.load(args.cluster_file)
    log.info(
        "maintenance starting for cluster %s (%s): %s",
        config.name,
        args.cluster_file,
        ", ".join(settings.services),
    )
    trio.run(_main, config, settings, args.ready_file, args.metrics_listen)
    log.info("maintenance stopped")
    return 0


async def _main(
    config: Any, settings: MaintenanceSettings, ready_file: Path | None, metrics: str | None
) -> None:
    async with open_service_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            await nursery.start(
                lambda task_status: run_services(
                    config,
                    settings,
                    ready_file=ready_file,
                    metrics_listen=metrics,
                    task_status=task_status,
                )
            )
            log.info("maintenance ready: rounds every %g s", settings.interval)
            async for signum in signals:
                log.info("signal %d: stopping the maintenance services", signum)
                nursery.cancel_scope.cancel()


def run_status(args: argparse.Namespace) -> int:
    config = cluster_file.load(args.cluster_file)
    if args.inventory:
        return _run_inventory(config, args.json)
    status = trio.run(fetch_repair_status, config)
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print(format_status(status))
    lost = status["lost"] or fsck_summary.says_lost(status.get("last_fsck"))
    return EXIT_UNHEALTHY if lost else 0


async def fetch_repair_status(config: Any) -> dict[str, Any]:
    """One ``repair_status`` read with short-lived metadata and chunk-store connections:
    ``tectonic repair --status`` and bench/bench_repair.py poll it from outside the
    maintenance process, which keeps no status endpoint of its own."""
    from tectonic_py.maintenance.repair import repair_status

    return await with_maintenance(config, repair_status)


async def run_inventory_pass(config: Any) -> dict[str, Any]:
    """One inventory pass (``tectonic repair --inventory``), as its JSON summary."""
    from tectonic_py.maintenance.inventory import Inventory, summary

    async def one(m: Maintenance) -> dict[str, Any]:
        return summary(await Inventory(m).round())

    return await with_maintenance(config, one)


async def with_maintenance(config: Any, fn: Any) -> dict[str, Any]:
    async with open_service_nursery() as nursery:
        meta = MetadataClient(config, nursery=nursery)
        m = Maintenance(config, MaintenanceSettings(), meta, nursery)
        try:
            result: dict[str, Any] = await fn(m)
            return result
        finally:
            with trio.CancelScope(shield=True):
                await m.pool.aclose()
                await meta.aclose()
            nursery.cancel_scope.cancel()


def _run_inventory(config: Any, as_json: bool) -> int:
    found = trio.run(run_inventory_pass, config)
    if as_json:
        print(json.dumps(found, indent=2))
        return 0
    print(
        f"stores checked: {found['nodes_checked']} of {len(found['nodes'])}, chunks expected:"
        f" {found['expected']}, missing: {found['missing']}, replaced by other bytes:"
        f" {found['mismatched']}, recorded for repair: {found['recorded']}"
    )
    for node in found["nodes"]:
        if node["error"] is not None:
            print(f"{node['node_id']}: not checked: {node['error']}")
    return 0


def format_status(s: dict[str, Any]) -> str:
    total = s["blocks"]
    pct = 100.0 * s["full_redundancy"] / total if total else 100.0
    lines = [
        (
            f"blocks: {total}, at full redundancy: {s['full_redundancy']} ({pct:.1f}%),"
            f" degraded: {s['degraded']}, lost: {s['lost']}"
        ),
        f"chunks to rebuild: {s['chunks_to_rebuild']}",
        (
            "blocks by live chunks: "
            + (", ".join(f"{k}: {v}" for k, v in s["blocks_by_live_chunks"].items()) or "-")
        ),
        f"nodes up: {s['nodes_up']}, down: {', '.join(s['nodes_down']) or 'none'}",
        f"chunks found bad (scrub, readers, inventory): {len(s['bad_chunks'])}",
        fsck_summary.describe(s.get("last_fsck")),
    ]
    return "\n".join(lines)
