"""The chunk store's metrics (docs/metrics.md): its RPC ops by op and result with their
durations (``tectonic_py.core.rpc_metrics``, op ``put``, ``get``, ``delete``...), the bytes
puts stored and gets returned, the directory fsync of each put, admission refusals, disk
use and free space, chunk count, queue depth and the scrub's progress.

What the server counts anyway is read when Prometheus scrapes; only the fsync latency is
observed per put. The disk's free space is looked up (statvfs, in a worker thread) by the
scrape hook, so it is as fresh as the scrape.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

from prometheus_client.core import Metric

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
