"""Client robustness under bursts: slowness starts hedges and degraded fetches, it never fails
a read or a write (only real failures do), and every writer's buffer counts against the
memory window."""

from __future__ import annotations

import hashlib
import logging
import os
import signal

import trio

from tectonic_py.client import TectonicClient, open_client
from tectonic_py.local_cluster import LocalCluster

MiB = 1024 * 1024


def _data(n: int, seed: int = 0) -> bytes:
    block = hashlib.sha256(f"{seed}".encode()).digest() * 2048
    return (block * (-(-n // len(block))))[:n] if n else b""


def _node_index(node_id: str) -> int:
    return int(node_id.removeprefix("cs"))


async def _resume_after(pids: list[int], seconds: float) -> None:
    await trio.sleep(seconds)
    for pid in pids:
        os.kill(pid, signal.SIGCONT)


def _stop(cluster: LocalCluster, indexes: list[int]) -> list[int]:
    pids = []
    for i in indexes:
        pid = cluster.chunkstore_pids()[i]
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        pids.append(pid)
    return pids


async def test_slow_chunks_never_fail_a_read(local_cluster, caplog):
    """Four stores of a block stopped (more than m = 3) for longer than a tiny slow_chunk_s:
    every chunk of every block is 'slow', parity hedges are slow too, and the read must still
    return the right bytes once the stores answer, because no request actually failed."""
    caplog.set_level(logging.CRITICAL, logger="tectonic_py.client")
    data = _data(2 * 6 * 64 * 1024 + 77, seed=51)
    async with open_client(local_cluster.cluster_file) as client:
        w = await client.create("/slow-read")
        await w.write(data)
        fid = (await w.close()).id
        first = (await client.meta.block_list(fid))[0]
    victims = sorted({_node_index(c.node_id) for c in first.chunks})[:4]
    async with open_client(local_cluster.cluster_file, slow_chunk_s=0.01,
                           read_hedge_s=0.01) as fresh:
        r = await fresh.open_read("/slow-read")
        pids = _stop(local_cluster, victims)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_resume_after, pids, 1.0)
                with trio.fail_after(60):  # a bound on a hang, not a timing assertion
                    assert await r.read() == data
                    assert await r.pread(70_000, 1000) == data[70_000:71_000]
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)


async def test_slow_chunks_never_fail_a_write(local_cluster, caplog):
    """Four of nine stores stopped during a write with a tiny chunk_timeout and hedge delay:
    there is no spare node, so the puts must simply keep running until the stores answer; the
    blocks commit with all nine chunks and read back."""
    caplog.set_level(logging.CRITICAL, logger="tectonic_py.client")
    data = _data(3 * 6 * 64 * 1024, seed=52)
    async with open_client(local_cluster.cluster_file, chunk_timeout=0.01,
                           write_hedge_s=0.01) as client:
        w = await client.create("/slow-write")
        pids = _stop(local_cluster, [0, 1, 2, 3])
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_resume_after, pids, 1.0)
                with trio.fail_after(60):  # a bound on a hang, not a timing assertion
                    await w.write(data)
                    fid = (await w.close()).id
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        blocks = await client.meta.block_list(fid)
        assert all(len(b.chunks) == 9 for b in blocks)
        r = await client.open_read("/slow-write")
        assert await r.read() == data
