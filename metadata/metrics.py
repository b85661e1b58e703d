"""The metadata server's metrics (docs/metrics.md): every op by op and result with its
duration (``tectonic_py.core.rpc_metrics``: the items of a ``batch`` count as their own ops),
each group commit's duration and size (the transaction of a shard's batch: SQLite's commit
and fsync, under etcd the fenced etcd transaction too), and the shards this server owns
(under etcd that moves when a server dies and another takes its shards over).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.core import Metric

from tectonic_py.core.metrics import Metrics, gauge
from tectonic_py.core.metrics_http import parse_listen
from tectonic_py.core.rpc_metrics import RpcMetrics

PREFIX = "tectonic_metadata"

# Mutations per group commit: one alone, up to a burst's thousands (shard.MAX_BATCH).
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class MetadataMetrics:
    """Families of one metadata server on its own registry."""

    def __init__(self, metrics_listen: str | None) -> None:
        """``metrics_listen``: the endpoint's HOST:PORT (checked now); None: metrics off."""
        if metrics_listen is not None:
            parse_listen(metrics_listen)
        self.listen = metrics_listen
        self.metrics = metrics = Metrics(enabled=metrics_listen is not None)
        self.rpc = RpcMetrics(metrics, PREFIX, "metadata server")
        self.transaction = metrics.histogram(
            f"{PREFIX}_transaction_duration_seconds",
            "Seconds one group commit of a shard took, from taking its batch to durable",
        )
        self.batch = metrics.histogram(
            f"{PREFIX}_group_commit_batch_size",
            "Mutations committed together in one group commit (one shard transaction)",
            buckets=BATCH_BUCKETS,
        )

    def commit_hook(self) -> Callable[[int, float], None] | None:
        """What the shards call after each group commit (None when metrics are off)."""
        return self.on_commit if self.metrics.enabled else None

    def on_commit(self, mutations: int, seconds: float) -> None:
        self.transaction.observe(seconds)
        self.batch.observe(mutations)

    def watch(self, owned: Callable[[], int], total: int) -> None:
        def collect() -> Iterable[Metric]:
            yield gauge(f"{PREFIX}_shards_owned", "Logical shards this server serves now", owned())
            yield gauge(f"{PREFIX}_cluster_shards", "Logical shards of the cluster", total)

        self.metrics.collector(collect)
