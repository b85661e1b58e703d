"""Helpers of the maintenance tests (repair, scrub, GC, rebalance): a small real cluster with a
``tectonic maintenance`` process on short timeouts, deterministic data, and bounded waits on
what the metadata service and the chunk stores say."""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import trio

from metadata.client import MetadataClient
from tectonic_py.client.tectonic_client import TectonicClient, open_client
from tectonic_py.core import cluster_file
from tectonic_py.core.aio import open_service_nursery
from tectonic_py.launch.local_cluster import LocalCluster
from tectonic_py.maintenance.runtime import Maintenance, MaintenanceSettings

T = TypeVar("T")
KiB = 1024
CHUNK = 16 * KiB
EC = "rs-4-2"  # n = 6 of 8 chunk stores: a block always has a node to be repaired onto  # a block of rs-4-2 holds 64 KiB of data

# Short timeouts: a node is down 2 s after its last heartbeat; rounds every 0.3 s.
FAST = ["--interval", "0.3", "--sweep-interval", "0.5", "--bandwidth", str(64 * 1024 * 1024)]


def make_cluster(
    root: Path,
    *,
    chunkstores: int = 8,
    maintenance: bool = True,
    maintenance_args: list[str] | None = None,
    chunkstore_args: list[str] | None = None,
    metadata_args: list[str] | None = None,
    ec: str = EC,
) -> LocalCluster:
    return LocalCluster(
        root,
        chunkstores=chunkstores,
        metadata_servers=2,
        shards=8,
        ec=ec,
        chunk_size=CHUNK,
        heartbeat_interval=0.3,
        node_timeout=2.0,
        maintenance=maintenance,
        maintenance_args=[*FAST, *(maintenance_args or [])],
        chunkstore_args=chunkstore_args,
        metadata_args=metadata_args,
    )


def data_of(n: int, seed: int) -> bytes:
    piece = hashlib.sha256(f"maintenance-{seed}".encode()).digest() * 64
    reps = -(-n // len(piece))
    out = bytearray()
    for i in range(reps):
        out += hashlib.sha256(piece[:32] + i.to_bytes(4, "big")).digest() * 64
    return bytes(out[:n])


async def put(client: TectonicClient, path: str, data: bytes, ec: str = EC) -> int:
    w = await client.create(path, ec=ec)
    await w.write(data)
    return (await w.close()).id


async def read(client: TectonicClient, path: str) -> bytes:
    r = await client.open_read(path)
    try:
        return await r.read()
    finally:
        await r.aclose()


@asynccontextmanager
async def open_inspector(cluster: LocalCluster) -> AsyncIterator[Maintenance]:
    """A ``Maintenance`` context running no services: for looking at blocks and nodes."""
    config = cluster_file.load(cluster.cluster_file)
    async with open_service_nursery() as nursery:
        meta = MetadataClient(config, nursery=nursery)
        m = Maintenance(config, MaintenanceSettings(), meta, nursery)
        try:
            yield m
        finally:
            with trio.CancelScope(shield=True):
                await m.pool.aclose()
                await meta.aclose()
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def open_fresh_client(cluster: LocalCluster, **tuning: Any) -> AsyncIterator[TectonicClient]:
    tuning = {"slow_chunk_s": 5.0, "chunk_timeout": 10.0, **tuning}
    async with open_client(cluster.cluster_file, **tuning) as c:
        yield c


async def wait_for(
    what: str,
    probe: Callable[[], Awaitable[T | None]],
    *,
    timeout: float = 90.0,
    every: float = 0.3,
) -> T:
    """Poll ``probe`` until it returns something truthy; fail with ``what`` after ``timeout``
    (a bound on waiting for background work, not a performance assertion)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await probe()
        if last:
            return last
        await trio.sleep(every)
    raise AssertionError(f"gave up waiting for {what} after {timeout}s (last: {last!r})")


async def block_health(m: Maintenance) -> dict[str, Any]:
    from tectonic_py.maintenance.repair import repair_status

    return await repair_status(m)


async def total_used(m: Maintenance) -> int:
    """Bytes of chunk files on every up chunk store (their own accounting)."""
    total = 0
    for node in (await m.nodes()).values():
        if node.state == "up":
            total += int((await m.node_call(node, "node_stats"))["used"])
    return total


def node_index(node_id: str) -> int:
    """The local cluster's store number of a node id (``cs3`` -> 3): its data directory."""
    return int(node_id.removeprefix("cs"))
