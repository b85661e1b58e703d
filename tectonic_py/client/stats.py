"""Counters of one data-path client (``TectonicClient.statistics()``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ClientStats:
    """What one client did since it opened; live counters, read by tests and the load test."""

    blocks_written: int = 0
    bytes_written: int = 0
    chunks_written: int = 0
    chunk_write_failures: int = 0
    chunks_replaced: int = 0
    hedged_puts: int = 0
    hedged_gets: int = 0  # parity chunks fetched because a data chunk was slow
    # Chunk puts given up on because their store stopped answering while the rest of the
    # block landed: the block commits without them and repair restores them.
    stalled_puts: int = 0
    # Data chunks that new versions of blocks adopted from the old (in-place writes): not
    # written again.
    adopted_chunks: int = 0
    blocks_read: int = 0
    bytes_read: int = 0
    range_reads: int = 0
    degraded_reads: int = 0
    # Degraded range reads rebuilt from the same range of k other chunks, no whole block.
    range_rebuilds: int = 0
    corrupt_chunks: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    buffer_waits: int = 0
    spills: int = 0
    # Requests (and connects) sent to each chunk store, by address: a dead node should cost
    # one attempt per client, not one per block.
    node_attempts: dict[str, int] = field(default_factory=dict)
    # Chunks not asked for (reads) or not sent (writes) because their node was known down
    # or backing off.
    avoided_chunks: int = 0
    # (block_id, chunk_index, node_id, reason) of chunks found missing or corrupt.
    bad_chunks: list[tuple[int, int, str, str]] = field(default_factory=list)
    # Bad chunks reported to the metadata service for repair, and reports not sent because
    # the same chunk was reported already or the report rate was spent.
    bad_chunk_reports: int = 0
    bad_chunk_reports_skipped: int = 0
