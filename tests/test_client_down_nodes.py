"""The client avoids chunk stores that are down: a store killed (before the registry notices:
the client's own back-off; after: the registry's "down" mark) and a store SIGSTOPped (its
open connections a blackhole) cost at most one request each, however many blocks are read,
and every byte reads back exact (degraded reads from parity)."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from cluster_fixtures import suite_cluster

from tectonic_py.client.tectonic_client import TectonicClient, open_client
from tectonic_py.core.errors import InvalidArgument
from tectonic_py.launch.local_cluster import LocalCluster

BLOCKS = 12


def _data(n: int, seed: int) -> bytes:
    block = hashlib.sha256(f"{seed}".encode()).digest() * 2048
    return (block * (-(-n // len(block))))[:n]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    # A short node timeout so the registry marks a silent store down within a few seconds.
    with suite_cluster(tmp_path / "cluster", node_timeout=2.0) as c:
        yield c


async def _wait_down(client: TectonicClient, node_id: str) -> None:
    with trio.move_on_after(60):
        while True:
            if any(n.node_id == node_id and n.state == "down" for n in await client.meta.nodes()):
                return
            await trio.sleep(0.2)
    pytest.fail(f"the registry never marked {node_id} down")


async def _put(client: TectonicClient, path: str, data: bytes) -> None:
    w = await client.create(path)
    await w.write(data)
    await w.close()


async def test_dead_and_stopped_stores_cost_one_attempt_each(cluster, caplog):
    caplog.set_level(logging.ERROR, logger="tectonic_py.client")
    async with open_client(cluster.cluster_file, node_backoff_s=600.0) as writer:
        probe = await writer.create("/probe")
        block = probe.layout.block_size
        await probe.close()
        data = _data(BLOCKS * block + 777, seed=1)
        await _put(writer, "/f", data)  # rs-6-3 on 9 stores: a chunk of every block on each

        # 1. killed, registry not yet told: the first failed connect puts it in back-off.
        dead = cluster.chunkstore_address(2)
        cluster.kill_chunkstore(2)
        async with open_client(cluster.cluster_file, node_backoff_s=600.0) as fresh:
            r = await fresh.open_read("/f")
            assert await r.read() == data
            assert await r.pread(block + 5, 3 * block) == data[block + 5 : 4 * block + 5]
            assert fresh.stats.node_attempts.get(dead, 0) <= 1
            assert fresh.stats.degraded_reads >= 1  # blocks with a data chunk on it
            # writes (and their re-sends) skip it as well, and read back exact
            more = _data(3 * block + 5, seed=2)
            await _put(fresh, "/g", more)
            assert await (await fresh.open_read("/g")).read() == more
            assert fresh.stats.node_attempts.get(dead, 0) <= 1

        # 2. marked down by the registry: a new client plans around it from the start.
        await _wait_down(writer, "cs2")
        async with open_client(cluster.cluster_file) as fresh:
            r = await fresh.open_read("/f")
            assert await r.read() == data
            assert dead not in fresh.stats.node_attempts
            assert fresh.stats.avoided_chunks >= 1

        # 3. SIGSTOPped: the writer's open connection to it is a blackhole; once the registry
        # marks it down, a read of every block sends it at most one request.
        stopped_pid = cluster.chunkstore_pids()[5]
        assert stopped_pid is not None
        stopped = cluster.chunkstore_address(5)
        os.kill(stopped_pid, signal.SIGSTOP)
        try:
            await _wait_down(writer, "cs5")
            before = writer.stats.node_attempts.get(stopped, 0)
            writer.cache.capacity = 0  # every block comes from the chunk stores again
            r = await writer.open_read("/f")
            assert await r.read() == data
            assert await r.pread(7, 2 * block) == data[7 : 2 * block + 7]
            assert writer.stats.node_attempts.get(stopped, 0) - before <= 1
        finally:
            os.kill(stopped_pid, signal.SIGCONT)

        # bad settings are refused with a clear error
        for bad in ({"connect_timeout": 0}, {"connect_timeout": -1.0}, {"node_backoff_s": -1.0}):
            with pytest.raises(InvalidArgument):
                async with open_client(cluster.cluster_file, **bad):
                    pass


async def test_a_random_read_on_a_dead_store_rebuilds_its_range_not_the_block(cluster):
    """A small random read whose data chunk is on a dead store is rebuilt from the same range
    of k other chunks: no whole block is fetched, and the bytes are exact, also for a range
    that spans a live and a dead data chunk."""
    async with open_client(cluster.cluster_file) as writer:
        probe = await writer.create("/probe")
        block = probe.layout.block_size
        await probe.close()
        data = _data(BLOCKS * block + 777, seed=3)
        await _put(writer, "/r", data)
        attrs = await writer.stat("/r")
        infos = {b.file_index: b for b in await writer.meta.block_list(attrs.id)}
    info = infos[5]
    cl = info.chunk_len
    (lost,) = [pl for pl in info.chunks if pl.index == 1]
    cluster.kill_chunkstore(int(lost.node_id.removeprefix("cs")))
    async with open_client(cluster.cluster_file, node_backoff_s=600.0) as fresh:
        r = await fresh.open_read("/r")
        inside = 5 * block + cl + 1000  # inside data chunk 1 of block 5
        assert await r.pread(inside, 4096) == data[inside : inside + 4096]
        r = await fresh.open_read("/r")  # a new reader: not a continuation of that read
        across = 5 * block + 2 * cl - 300  # the end of chunk 1 (dead), the start of chunk 2
        assert await r.pread(across, 600) == data[across : across + 600]
        assert fresh.stats.range_rebuilds == 2
        assert fresh.stats.blocks_read == 0  # no whole-block fetch
        assert fresh.stats.degraded_reads == 2
