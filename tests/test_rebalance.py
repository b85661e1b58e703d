"""Rebalance with real processes: an empty chunk store added to a cluster gets data moved to
it; every file reads bit-exact during and after the moves, and no block is ever below full
redundancy."""

from __future__ import annotations

import pytest
import trio
from maintenance_helpers import (
    block_health,
    data_of,
    make_cluster,
    open_fresh_client,
    open_inspector,
    put,
    read,
    wait_for,
)

from tectonic_py.core.errors import ConfigError
from tectonic_py.maintenance.runtime import MaintenanceSettings


async def _used_by_node(m):  # type: ignore[no-untyped-def]
    out = {}
    for node in (await m.nodes()).values():
        if node.state == "up":
            out[node.node_id] = int((await m.node_call(node, "node_stats"))["used"])
    return out


async def test_empty_store_gets_data_and_reads_stay_exact(tmp_path):
    cluster = make_cluster(
        tmp_path / "c",
        chunkstores=7,
        maintenance_args=["--grace", "1", "--rebalance-tolerance", "0.25"],
    )
    try:
        cluster.start()
        files = {f"/r{i}": data_of(120_000 + 20_000 * i, seed=40 + i) for i in range(6)}
        async with open_fresh_client(cluster) as client:
            for path, data in files.items():
                await put(client, path, data)
        new = cluster.add_chunkstore()
        new_id = cluster.node_id(new)
        reads = 0
        degraded_seen = []
        async with open_inspector(cluster) as m:

            async def reader() -> None:
                nonlocal reads
                for _ in range(1000):
                    async with open_fresh_client(cluster) as client:
                        for path, data in files.items():
                            assert await read(client, path) == data
                            reads += 1
                    await trio.sleep(0.05)

            async def balanced():  # type: ignore[no-untyped-def]
                s = await block_health(m)
                degraded_seen.append(s["degraded"])
                used = await _used_by_node(m)
                if new_id not in used:
                    return None
                mean = sum(used.values()) / len(used)
                gap = max(used.values()) - min(used.values())
                return used if used[new_id] > 0 and gap <= 0.25 * mean + 64 * 1024 else None

            async with trio.open_nursery() as nursery:
                nursery.start_soon(reader)
                used = await wait_for("rebalance onto the new chunk store", balanced)
                nursery.cancel_scope.cancel()
            assert used[new_id] > 0
            assert reads > 0
            assert set(degraded_seen) == {0}  # never below full redundancy
            assert (await block_health(m))["degraded"] == 0
            nodes = await m.nodes()
            for shard in range(m.config.shards):
                async for rec in m.scan_blocks(shard):
                    domains = [nodes[n].failure_domain for _, n, _ in rec["chunks"]]
                    assert len(set(domains)) == len(domains)  # still one chunk per domain
        async with open_fresh_client(cluster) as client:
            for path, data in files.items():
                assert await read(client, path) == data
    finally:
        cluster.stop()


def test_settings_refuse_bad_values():
    with pytest.raises(ConfigError):
        MaintenanceSettings(interval=0)
    with pytest.raises(ConfigError):
        MaintenanceSettings(grace=-1)
    with pytest.raises(ConfigError):
        MaintenanceSettings(services=("repair", "defrag"))
    with pytest.raises(ConfigError):
        MaintenanceSettings(repair_concurrency=0)


async def test_no_ping_pong_of_a_chunk_larger_than_the_gap(tmp_path):
    """Two stores, one small block's chunks: nothing is moved back and forth."""
    cluster = make_cluster(tmp_path / "c", chunkstores=3, maintenance=False)
    try:
        cluster.start()
        async with open_fresh_client(cluster) as client:
            await put(client, "/one", b"x" * 1000, ec="r2")
        async with open_inspector(cluster) as m:
            from tectonic_py.maintenance.rebalance import Rebalancer

            r = Rebalancer(m)
            first = await r.round()
            assert await r.round() == 0  # settled after at most one move
            assert first <= 1
        async with open_fresh_client(cluster) as client:
            assert await read(client, "/one") == b"x" * 1000
    finally:
        cluster.stop()
