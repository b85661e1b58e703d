"""``run_services``: every configured maintenance service as a loop of rounds in one nursery.

A round that fails (a metadata server or chunk store down, a refused step) is logged and
retried next interval: failures are what these services exist for, so none of them ends the
process. Apart from ``runtime`` (the plumbing every service shares) so that the services
import the plumbing and only this module imports the services.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from metadata.client import MetadataClient
from tectonic_py.client.tectonic_client import TectonicClient
from tectonic_py.core.aio import open_service_nursery
from tectonic_py.core.cluster_file import ClusterConfig
from tectonic_py.core.errors import TectonicError
from tectonic_py.core.metrics import Metrics
from tectonic_py.core.metrics_http import parse_listen, start_endpoint
from tectonic_py.core.ready_file import write_ready_file
from tectonic_py.maintenance.compaction import Compactor
from tectonic_py.maintenance.gc import GarbageCollector
from tectonic_py.maintenance.inventory import Inventory
from tectonic_py.maintenance.metrics import MaintenanceMetrics
from tectonic_py.maintenance.rebalance import Rebalancer
from tectonic_py.maintenance.repair import Repairer
from tectonic_py.maintenance.retention import Retention
from tectonic_py.maintenance.runtime import Maintenance, MaintenanceSettings

log = logging.getLogger(__name__)

MiB = 1024 * 1024


async def _loop(
    m: Maintenance,
    name: str,
    interval: float,
    round_fn: Callable[[], Awaitable[Any]],
    measures: MaintenanceMetrics | None = None,
) -> None:
    failing = False
    while True:
        started = time.monotonic()
        try:
            await round_fn()
            m.counters.rounds[name] = m.counters.rounds.get(name, 0) + 1
            if failing:
                log.info("%s: rounds succeed again", name)
            failing = False
        except TectonicError as e:
            log.log(logging.INFO if failing else logging.WARNING, "%s round failed: %s", name, e)
            failing = True
        except Exception:
            # A bug, loudly, but the other services (and this one, next round) keep going:
            # a cluster without repair is worse than a traceback in a log.
            log.exception("%s round failed with an internal error", name)
            failing = True
        if measures is not None:
            measures.round_done(name, time.monotonic() - started, failing)
        await trio.sleep(max(0.05, interval - (time.monotonic() - started)))


async def run_services(
    config: ClusterConfig,
    settings: MaintenanceSettings,
    *,
    ready_file: Path | None = None,
    metrics_listen: str | None = None,
    task_status: trio.TaskStatus[Maintenance] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the configured services until cancelled; ``metrics_listen``: HOST:PORT of the
    metrics endpoint (None: no metrics)."""
    if metrics_listen is not None:
        parse_listen(metrics_listen)  # (a bad address is said before anything starts)
    async with open_service_nursery() as nursery:
        meta = MetadataClient(config, nursery=nursery)
        m = Maintenance(config, settings, meta, nursery)
        client: TectonicClient | None = None
        measures = None if metrics_listen is None else MaintenanceMetrics(Metrics(), m)
        try:
            metrics_address = None
            if measures is not None:
                metrics_address = await start_endpoint(nursery, measures.metrics, metrics_listen)

            def loop(name: str, interval: float, fn: Callable[[], Awaitable[Any]]) -> None:
                nursery.start_soon(_loop, m, name, interval, fn, measures)

            if "repair" in settings.services:
                loop("repair", settings.interval, Repairer(m).round)
            if "gc" in settings.services:
                loop("gc", settings.interval, GarbageCollector(m).round)
            if "rebalance" in settings.services and settings.rebalance:
                loop("rebalance", settings.interval, Rebalancer(m).round)
            if "inventory" in settings.services:
                loop("inventory", settings.inventory_interval, Inventory(m).round)
            if "quotas" in settings.services:
                loop("quotas", settings.quota_interval, meta.settle_quotas)
            if "compaction" in settings.services and settings.compact_below > 0:
                # Compaction's data path (read a pack, code and store the new one), with a
                # small write window and no block cache: packs are rewritten one at a time.
                client = TectonicClient(config, meta, nursery, window_bytes=64 * MiB, cache_bytes=0)
                loop("compaction", settings.sweep_interval, Compactor(m, client).round)
            if "retention" in settings.services:
                loop("retention", settings.retention_interval, Retention(m).round)
            if ready_file is not None:
                await trio.to_thread.run_sync(
                    functools.partial(
                        write_ready_file, ready_file, address="", metrics=metrics_address
                    )
                )
            task_status.started(m)
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                if client is not None:
                    await client.aclose()
                await m.pool.aclose()
                await meta.aclose()
