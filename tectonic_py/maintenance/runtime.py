"""Shared plumbing of the maintenance services: settings, connections, bandwidth, node choice.

``Maintenance`` holds one ``MetadataClient``, one ``ChunkPool`` of chunk store connections
and the ``TokenBucket`` that bounds the bytes repair and rebalance read and write per second,
so background traffic cannot starve checkpoint writes. It holds no capability key: every
chunk put and delete carries a capability the metadata service granted (``block.caps``),
and a delete is granted only for a chunk the Block layer no longer needs on that node. The
services themselves (``gc``, ``repair``, ``inventory``, ``rebalance``) build on this module,
and ``services.run_services`` runs them; nothing here imports them.
"""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import trio

from chunkstore.client import ChunkClient, ChunkPool
from metadata.client import MetadataClient
from tectonic_py.core.cluster_file import ClusterConfig
from tectonic_py.core.errors import (
    BadCapability,
    ConfigError,
    TectonicError,
    Timeout,
)
from tectonic_py.core.ids import chunk_id
from tectonic_py.core.records import NodeInfo

log = logging.getLogger(__name__)

T = TypeVar("T")
MiB = 1024 * 1024
SERVICES = ("repair", "gc", "rebalance", "inventory", "compaction", "quotas", "retention")
CHUNK_CALL_TIMEOUT_S = 60.0  # a chunk store that hangs (not down, not answering) is skipped


@dataclass
class MaintenanceSettings:
    """Knobs of ``tectonic maintenance`` (defaults for production; tests shorten them)."""

    interval: float = 10.0  # seconds between rounds of repair, GC and rebalance
    grace: float = 3600.0  # GC: age before unreferenced chunks and blocks are collected
    # GC: age before a block that a newer version replaced at its index is collected (its
    # readers re-read the block list when its chunks are gone: docs/decisions)
    superseded_grace: float = 30.0
    lease_grace: float = 600.0  # lease recovery: time past a writer lease's expiry
    # The unreachable-record sweep: least time between the two walks that must miss a record.
    unreachable_grace: float = 600.0
    sweep_interval: float = 3600.0  # GC: seconds between block and chunk sweeps
    inventory_interval: float = 600.0  # seconds between inventory passes over every store
    bandwidth: float = 200 * MiB  # bytes/s that repair and rebalance read + write together
    repair_concurrency: int = 4  # blocks rebuilt at once
    rebalance: bool = True
    rebalance_tolerance: float = 0.1  # move while fullest - emptiest > this * mean used
    rebalance_max_moves: int = 256  # chunk moves per rebalance round
    # compaction: packs at most this share of whose bytes are live are rewritten (0: never)
    compact_below: float = 0.25
    # quotas: seconds between folds of the usage deltas into their quotas (quota_layer.py)
    quota_interval: float = 2.0
    retention_interval: float = 5.0  # seconds between retention rounds (after a commit)
    services: tuple[str, ...] = SERVICES

    def __post_init__(self) -> None:
        for name in (
            "interval",
            "sweep_interval",
            "inventory_interval",
            "bandwidth",
            "quota_interval",
            "retention_interval",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name.replace('_', '-')} must be positive")
        for name in (
            "grace",
            "superseded_grace",
            "lease_grace",
            "unreachable_grace",
            "rebalance_tolerance",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name.replace('_', '-')} must not be negative")
        if self.repair_concurrency < 1 or self.rebalance_max_moves < 0:
            raise ConfigError("repair concurrency must be >= 1, rebalance moves >= 0")
        if not 0 <= self.compact_below < 1:
            raise ConfigError("compact-below must be at least 0 and below 1")
        unknown = set(self.services) - set(SERVICES)
        if unknown:
            raise ConfigError(f"unknown services {sorted(unknown)}")


class TokenBucket:
    """Bytes per second with a burst of one second: ``await take(n)`` waits its turn.

    A request larger than the burst is let through and paid for afterwards (the next caller
    waits), so a big chunk never deadlocks the bucket."""

    def __init__(self, rate: float, burst_s: float = 1.0) -> None:
        self.rate = float(rate)
        self.burst_s = burst_s
        self._t = 0.0
        self.taken = 0

    async def take(self, n: int) -> None:
        now = trio.current_time()
        self._t = max(self._t, now - self.burst_s) + n / self.rate
        self.taken += n
        if self._t > now:
            await trio.sleep(self._t - now)


@dataclass
class Counters:
    """What the services did since this process started (logged each round)."""

    repaired_chunks: int = 0
    repair_bytes: int = 0
    lost_blocks: int = 0
    moved_chunks: int = 0
    deleted_chunks: int = 0
    forgotten_blocks: int = 0
    leases_recovered: int = 0
    orphans_collected: int = 0
    packs_compacted: int = 0
    compacted_bytes_freed: int = 0
    unreachable_collected: int = 0
    inventory_mismatches: int = 0  # chunks found missing from or replaced on their store
    steps_retired: int = 0  # committed steps retention removed
    rounds: dict[str, int] = field(default_factory=dict)


class Maintenance:
    """The shared context of the services of one process."""

    def __init__(
        self,
        config: ClusterConfig,
        settings: MaintenanceSettings,
        meta: MetadataClient,
        nursery: trio.Nursery,
    ) -> None:
        self.config = config
        self.settings = settings
        self.meta = meta
        self.secret = config.credential()
        self.pool = ChunkPool(self.secret, nursery)
        self.bucket = TokenBucket(settings.bandwidth)
        self.counters = Counters()
        self.rng = random.Random()

    # --- metadata ------------------------------------------------------------------------------

    async def nodes(self) -> dict[str, NodeInfo]:
        return {n.node_id: n for n in await self.meta.nodes()}

    def scan_blocks(self, shard: int) -> AsyncIterator[dict[str, Any]]:
        """Every block record of a block shard, page by page."""
        return self.meta.scan_blocks(shard)

    async def set_chunk(
        self, block_id: int, index: int, old_node: str, new_node: str, crc: int
    ) -> None:
        await self.meta.set_chunk(block_id, index, old_node, new_node, crc)

    async def chunk_caps(
        self, op: str, chunks: Sequence[tuple[str, int, int]]
    ) -> dict[tuple[str, int, int], bytes]:
        """Capabilities for ``op`` on (node_id, block_id, index) chunks, one ``block.caps``
        call per block shard; the chunks the metadata service refused are absent."""
        return await self.meta.chunk_caps(op, chunks)

    async def _chunk_cap(self, op: str, node: NodeInfo, block_id: int, index: int) -> bytes:
        key = (node.node_id, block_id, index)
        cap = (await self.chunk_caps(op, [key])).get(key)
        if cap is None:
            raise BadCapability(
                f"the metadata service grants no {op} of chunk {chunk_id(block_id, index)}"
                f" on {node.node_id}"
            )
        return cap

    # --- chunk stores ----------------------------------------------------------------------------

    async def get_chunk(self, node: NodeInfo, block_id: int, index: int, crc: int) -> bytes:
        """A chunk's bytes, verified against the CRC the Block layer recorded for it
        (ChunkCorrupt if the store's copy is not that chunk, ChecksumMismatch if the bytes
        were damaged on the way)."""
        cid = chunk_id(block_id, index)
        data = await self._on(node, "get", lambda c: c.get(cid, expected=crc))
        await self.bucket.take(data.nbytes)
        return bytes(data)

    async def put_chunk(
        self, node: NodeInfo, block_id: int, index: int, data: bytes, crc: int
    ) -> None:
        cap = await self._chunk_cap("put", node, block_id, index)
        await self.bucket.take(len(data))
        cid = chunk_id(block_id, index)
        await self._on(node, "put", lambda c: c.put(cid, data, cap, crc))

    async def delete_chunk(
        self, node: NodeInfo, block_id: int, index: int, cap: bytes | None = None
    ) -> bool:
        """Delete a chunk the Block layer no longer needs on ``node``, with ``cap`` (from
        ``chunk_caps``) or a capability asked for now; BadCapability if it is still needed."""
        token = cap if cap is not None else await self._chunk_cap("delete", node, block_id, index)
        cid = chunk_id(block_id, index)
        existed = await self._on(node, "delete", lambda c: c.delete(cid, token))
        self.counters.deleted_chunks += existed
        return existed

    async def discard_copy(self, node: NodeInfo, block_id: int, index: int) -> None:
        """Delete a copy this process put whose ``set_chunk`` was refused (the block was
        collected, or the chunk moved, meanwhile) now rather than after the chunk sweep's
        grace; the metadata service grants the delete only if no block places it there."""
        try:
            await self.delete_chunk(node, block_id, index)
        except TectonicError as e:
            log.info(
                "copy %s on %s stays for the chunk sweep: %s",
                chunk_id(block_id, index),
                node.node_id,
                e,
            )

    async def node_call(self, node: NodeInfo, op: str, **fields: Any) -> dict[str, Any]:
        """An op with no typed method (``scrub_report``, ``list``, ``node_stats``)."""
        resp = await self._on(node, op, lambda c: c.call(op, fields))
        return resp.fields

    async def _on(self, node: NodeInfo, op: str, call: Callable[[ChunkClient], Awaitable[T]]) -> T:
        """``call`` on a client of ``node``'s pooled connection, within
        ``CHUNK_CALL_TIMEOUT_S``: a store that hangs is skipped, not waited for."""
        try:
            with trio.fail_after(CHUNK_CALL_TIMEOUT_S):
                return await call(await self.pool.client(node.address))
        except trio.TooSlowError:
            raise Timeout(
                f"{op} on chunk store {node.node_id} took over {CHUNK_CALL_TIMEOUT_S}s"
            ) from None

    def choose_target(
        self,
        nodes: Sequence[NodeInfo],
        holders: set[str],
        used_domains: set[str],
        load: dict[str, float] | None = None,
    ) -> NodeInfo | None:
        """An up node holding no chunk of the block, in a failure domain the block does not
        use if there is one, then the least loaded (``load``: bytes used, else chunk count)."""
        candidates = [n for n in nodes if n.state == "up" and n.node_id not in holders]
        if not candidates:
            return None

        def key(n: NodeInfo) -> tuple[int, float, float]:
            used = load.get(n.node_id, 0.0) if load is not None else float(n.chunk_count)
            return (int(n.failure_domain in used_domains), used, self.rng.random())

        return min(candidates, key=key)


async def gather(jobs: Sequence[Callable[[], Awaitable[None]]], limit: int) -> None:
    """Run jobs, at most ``limit`` at once; a job's TectonicError is logged, not raised."""
    limiter = trio.CapacityLimiter(max(1, limit))

    async def run(job: Callable[[], Awaitable[None]]) -> None:
        async with limiter:
            try:
                await job()
            except TectonicError as e:
                log.warning("maintenance step failed: %s", e)

    async with trio.open_nursery() as nursery:
        for job in jobs:
            nursery.start_soon(run, job)
