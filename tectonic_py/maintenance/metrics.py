"""The maintenance daemon's metrics (docs/metrics.md): what the services did (the
``Counters`` they keep anyway, read at scrape time), each service's rounds, failures and
round durations, and the cluster's redundancy as of the scrape: degraded blocks, blocks
below k, and the repair backlog in chunks.

The redundancy gauges are computed when Prometheus scrapes, the way ``tectonic status``
computes them (the Block layer's reverse index of down nodes, the chunks recorded bad and the
scrub reports; no block is scanned that is not suspect), so a killed store shows in them at
the first scrape after the registry marks it down, not at the next repair round. Scrapes
closer together than ``MIN_REFRESH_S`` share one computation.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client.core import Metric

from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.metrics import Metrics, counter, gauge, labelled_counter
from tectonic_py.maintenance.repair import Repairer
from tectonic_py.maintenance.runtime import Maintenance

PREFIX = "tectonic_maintenance"
MIN_REFRESH_S = 1.0
SCRUB_REPORT_TIMEOUT_S = 3.0  # a store that does not answer is left out of this scrape


class MaintenanceMetrics:
    """Families of one maintenance process on its own registry."""

    def __init__(self, metrics: Metrics, m: Maintenance) -> None:
        self.metrics = metrics
        self.m = m
        self.round_seconds = metrics.histogram(
            f"{PREFIX}_round_duration_seconds",
            "Seconds one round of a maintenance service took, by service",
            ["service"],
        )
        self.failures: dict[str, int] = {}
        self.degraded = self.unreadable = self.backlog = self.nodes_down = 0
        self.refreshed_at = 0.0
        metrics.collector(self._collect)
        metrics.on_scrape(self.refresh)

    def round_done(self, service: str, seconds: float, failed: bool) -> None:
        self.round_seconds.labels(service).observe(seconds)
        if failed:
            self.failures[service] = self.failures.get(service, 0) + 1

    async def refresh(self) -> None:
        """The redundancy gauges, as ``tectonic status`` would show them now."""
        if time.monotonic() - self.refreshed_at < MIN_REFRESH_S:
            return
        nodes = await self.m.nodes()
        repairer = Repairer(self.m)
        bad = await repairer.bad_chunks(nodes, scrub_timeout=SCRUB_REPORT_TIMEOUT_S)
        work = await repairer.find_work(nodes, bad, full_scan=False)
        self.degraded = len(work)
        self.unreadable = sum(1 for w in work if len(w.live) < ECPolicy.parse(w.info.ec).k)
        self.backlog = sum(len(w.missing) for w in work)
        self.nodes_down = sum(1 for n in nodes.values() if n.state != "up")
        self.refreshed_at = time.monotonic()

    def _collect(self) -> Iterable[Metric]:
        c = self.m.counters
        yield gauge(
            f"{PREFIX}_degraded_blocks",
            "Blocks with fewer than k+m good chunks (on a down store, found bad, never"
            " stored), as of this scrape",
            self.degraded,
        )
        yield gauge(
            f"{PREFIX}_unreadable_blocks",
            "Blocks with fewer than k good chunks: unreadable until a store returns",
            self.unreadable,
        )
        yield gauge(
            f"{PREFIX}_repair_backlog_chunks",
            "Chunks of degraded blocks that repair has still to rebuild",
            self.backlog,
        )
        yield gauge(f"{PREFIX}_nodes_down", "Chunk stores the registry marks down", self.nodes_down)
        yield counter(f"{PREFIX}_repaired_chunks_total", "Chunks repair rebuilt", c.repaired_chunks)
        yield counter(
            f"{PREFIX}_repair_bytes_total",
            "Bytes of chunks repair rebuilt and stored",
            c.repair_bytes,
        )
        yield counter(
            f"{PREFIX}_lost_blocks_total",
            "Times repair met a block with fewer than k good chunks",
            c.lost_blocks,
        )
        yield counter(
            f"{PREFIX}_moved_chunks_total",
            "Chunks rebalance moved to emptier stores",
            c.moved_chunks,
        )
        yield counter(
            f"{PREFIX}_deleted_chunks_total",
            "Chunks deleted from stores: the GC's reclaimed chunks, and the copies repair and"
            " rebalance replaced",
            c.deleted_chunks,
        )
        yield counter(
            f"{PREFIX}_gc_collected_blocks_total",
            "Block records the GC collected (their chunks deleted)",
            c.forgotten_blocks,
        )
        yield counter(
            f"{PREFIX}_gc_leases_recovered_total",
            "Files of crashed writers whose leases were recovered",
            c.leases_recovered,
        )
        yield counter(
            f"{PREFIX}_gc_orphans_collected_total",
            "Unnamed file records the GC collected",
            c.orphans_collected + c.unreachable_collected,
        )
        yield counter(
            f"{PREFIX}_compacted_packs_total", "Packs compaction rewrote", c.packs_compacted
        )
        yield counter(
            f"{PREFIX}_compaction_reclaimed_bytes_total",
            "Bytes of dead extents compaction freed",
            c.compacted_bytes_freed,
        )
        yield counter(
            f"{PREFIX}_retired_steps_total",
            "Committed steps retention removed (past a directory's keep-last)",
            c.steps_retired,
        )
        yield counter(
            f"{PREFIX}_inventory_mismatches_total",
            "Chunks the inventory found missing from, or replaced on, their store",
            c.inventory_mismatches,
        )
        yield labelled_counter(
            f"{PREFIX}_rounds_total", "Rounds completed, by service", "service", c.rounds
        )
        yield labelled_counter(
            f"{PREFIX}_round_failures_total",
            "Rounds that failed (retried next interval), by service",
            "service",
            self.failures,
        )
