"""The chunk store's metrics (docs/metrics.md): its RPC ops by op and result with their
durations (``tectonic_py.core.rpc_metrics``, op ``put``, ``get``, ``delete``...), the bytes
puts stored and gets returned, the directory fsync of each put, admission refusals, disk
use and free space, chunk count, queue depth and the scrub's progress; per traffic class
(label ``job``: the store's configured jobs, at most ``traffic.MAX_JOBS`` declared ones,
``default`` and ``background``, so a bounded set) and kind (``put``, ``get``), the requests
waiting in its fair queue, and the requests and bytes admitted (``chunkstore.traffic``).

What the server counts anyway is read when Prometheus scrapes; only the fsync latency is
observed per put. The disk's free space is looked up (statvfs, in a worker thread) by the
scrape hook, so it is as fresh as the scrape.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tectonic_py.core.metrics import Metrics, counter, gauge
from tectonic_py.core.rpc_metrics import RpcMetrics

PREFIX = "tectonic_chunkstore"


class StoreView(Protocol):
    """What the collector reads of the server (``chunkstore.server.ChunkStoreServer``)."""

    used: int
    chunk_count: int
    put_bytes: int
    get_bytes: int
    disk_capacity: int
    disk_free: int

    @property
    def queue_depth(self) -> int: ...

    def scrub_progress(self) -> dict[str, float]: ...

    def traffic_stats(self) -> dict[str, Any]: ...


def traffic_families(stats: dict[str, Any]) -> Iterable[Metric]:
    """The fair queue's families (``ChunkStoreServer.traffic_stats``)."""
    queued = GaugeMetricFamily(
        f"{PREFIX}_traffic_queue_depth",
        "Requests of a traffic class waiting in the store's fair queue for a disk slot",
        labels=["kind", "job"],
    )
    admitted = CounterMetricFamily(
        f"{PREFIX}_traffic_admitted",
        "Requests of a traffic class the fair queue admitted to the disk",
        labels=["kind", "job"],
    )
    admitted_bytes = CounterMetricFamily(
        f"{PREFIX}_traffic_admitted_bytes",
        "Bytes of the requests of a traffic class the fair queue admitted (its served share)",
        labels=["kind", "job"],
    )
    weights = GaugeMetricFamily(
        f"{PREFIX}_traffic_weight", "The weight of a traffic class at this store", labels=["job"]
    )
    for job, weight in sorted(stats["weights"].items()):
        weights.add_metric([job], weight)
        for kind in ("put", "get"):
            st = stats[kind].get(job)
            queued.add_metric([kind, job], st.queued if st else 0)
            admitted.add_metric([kind, job], st.served if st else 0)
            admitted_bytes.add_metric([kind, job], st.served_bytes if st else 0)
    return (queued, admitted, admitted_bytes, weights)


class StoreMetrics:
    """Families of one chunk store on its own registry."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.rpc = RpcMetrics(metrics, PREFIX, "chunk store")
        self.fsync = metrics.histogram(
            f"{PREFIX}_fsync_duration_seconds",
            "Seconds the fsync of a chunk's directory took, which makes a put's name durable"
            " (the data itself is written with O_DSYNC and counted in the put's duration)",
        )

    def watch(self, store: StoreView, refresh_disk: Callable[[], Awaitable[object]]) -> None:
        def collect() -> Iterable[Metric]:
            yield counter(
                f"{PREFIX}_put_bytes_total",
                "Chunk bytes stored by puts (a put of a chunk already there adds nothing)",
                store.put_bytes,
            )
            yield counter(
                f"{PREFIX}_get_bytes_total", "Chunk bytes returned by gets", store.get_bytes
            )
            yield gauge(f"{PREFIX}_disk_used_bytes", "Bytes of chunk files", store.used)
            yield gauge(
                f"{PREFIX}_disk_free_bytes",
                "Bytes this store may still fill (its capacity and the filesystem bound it)",
                store.disk_free,
            )
            yield gauge(
                f"{PREFIX}_disk_capacity_bytes",
                "Bytes this store may hold (--capacity, else the filesystem's size)",
                store.disk_capacity,
            )
            yield gauge(f"{PREFIX}_chunks", "Chunks stored", store.chunk_count)
            yield gauge(
                f"{PREFIX}_queue_depth",
                "Requests admitted and not done with the disk, plus puts waiting for memory",
                store.queue_depth,
            )
            yield from traffic_families(store.traffic_stats())
            scrub = store.scrub_progress()
            yield counter(f"{PREFIX}_scrub_passes_total", "Scrub passes completed", scrub["passes"])
            yield counter(
                f"{PREFIX}_scrub_checked_chunks_total",
                "Chunks the scrub re-read and verified",
                scrub["chunks_checked"],
            )
            yield counter(
                f"{PREFIX}_scrub_checked_bytes_total",
                "Bytes the scrub re-read and verified",
                scrub["bytes_checked"],
            )
            yield counter(
                f"{PREFIX}_scrub_bad_chunks_total",
                "Chunks the scrub found corrupt or unreadable",
                scrub["bad_found"],
            )
            yield gauge(
                f"{PREFIX}_scrub_last_pass_seconds",
                "Seconds the last complete scrub pass took",
                scrub["last_pass_s"],
            )

        self.metrics.collector(collect)
        self.metrics.on_scrape(refresh_disk)
