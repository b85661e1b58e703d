"""The data-path client's metrics (docs/metrics.md), read from its ``ClientStats`` when
Prometheus scrapes: the client counts these anyway, so a metrics endpoint adds no work to
the data path. Served by the mount (with the FUSE layer's families) and by any process that
opens a client with ``metrics_listen`` (``open_client``, ``tectonic_py.connect``).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import Metric

from tectonic_py.client.stats import ClientStats
from tectonic_py.core.metrics import Metrics, counter, labelled_counter

PREFIX = "tectonic_client"

# (ClientStats field, metric name, help): the plain counters.
_COUNTERS = (
    ("bytes_written", "written_bytes", "Bytes of file data written and stored (before coding)"),
    ("bytes_read", "read_bytes", "Bytes of file data read from chunk stores (cache hits not)"),
    ("blocks_written", "blocks_encoded", "Blocks erasure-coded and stored"),
    ("blocks_read", "blocks_read", "Whole blocks fetched"),
    ("range_reads", "range_reads", "Reads of a byte range of a block, without the whole"),
    ("chunks_written", "chunks_written", "Chunks stored on chunk stores"),
    ("chunk_write_failures", "chunk_write_failures", "Chunk puts that failed"),
    ("stalled_puts", "stalled_puts", "Chunk puts given up on once the block landed without them"),
    ("degraded_reads", "degraded_reads", "Block reads that decoded missing chunks from parity"),
    ("corrupt_chunks", "corrupt_chunks", "Chunks that failed their checksum on arrival"),
    ("cache_hits", "cache_hits", "Block reads answered from the block cache"),
    ("cache_misses", "cache_misses", "Block reads that went to the chunk stores"),
    ("buffer_waits", "buffer_waits", "Writes that waited for the write window"),
    ("avoided_chunks", "avoided_chunks", "Chunks not sent to or asked of a store known down"),
    ("bad_chunk_reports", "bad_chunk_reports", "Bad chunks reported to the metadata service"),
)


def watch_client(metrics: Metrics, stats: ClientStats) -> None:
    """The client's counters as families on ``metrics``."""

    def collect() -> Iterable[Metric]:
        for field, name, doc in _COUNTERS:
            yield counter(f"{PREFIX}_{name}_total", doc, getattr(stats, field))
        yield labelled_counter(
            f"{PREFIX}_hedged_requests_total",
            "Chunk requests also sent elsewhere because the first was slow, by kind"
            " (put: to a spare store; get: a parity chunk)",
            "kind",
            {"put": stats.hedged_puts, "get": stats.hedged_gets},
        )

    metrics.collector(collect)
