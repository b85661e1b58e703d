"""Fault injection against the client: chunk stores killed (kill -9) before a read and in the
middle of a write, too few stores for the write quorum, a chunk corrupted on disk, and the
client's memory bound while writing a large file."""

from __future__ import annotations

import hashlib
import logging
import os
import signal

import psutil
import pytest
import trio
from cluster_fixtures import suite_cluster
from maintenance_helpers import block_health, open_inspector

from chunkstore import layout as chunk_layout
from tectonic_py.client.tectonic_client import TectonicClient, open_client
from tectonic_py.core.errors import NoSpace, QuorumLost
from tectonic_py.core.ids import chunk_id
from tectonic_py.launch.local_cluster import LocalCluster

MiB = 1024 * 1024


def _data(n: int, seed: int = 0) -> bytes:
    block = hashlib.sha256(f"{seed}".encode()).digest() * 2048
    return (block * (-(-n // len(block))))[:n] if n else b""


async def _put(client: TectonicClient, path: str, data: bytes, ec: str | None = None) -> int:
    w = await client.create(path, ec=ec)
    await w.write(data)
    return (await w.close()).id


def _node_index(node_id: str) -> int:
    return int(node_id.removeprefix("cs"))


async def test_any_m_chunk_stores_killed_before_a_read(local_cluster, client, caplog):
    caplog.set_level(logging.ERROR, logger="tectonic_py.client")
    probe = await client.create("/probe")
    block = probe.layout.block_size
    await probe.close()
    data = _data(3 * block + 999, seed=3)
    fid = await _put(client, "/f", data)
    # Kill three stores that hold *data* chunks of the first block: every read is degraded.
    first = (await client.meta.block_list(fid))[0]
    victims = [_node_index(c.node_id) for c in first.chunks if c.index < 3]
    for i in victims:
        local_cluster.kill_chunkstore(i)
    async with open_client(local_cluster.cluster_file, slow_chunk_s=5.0) as fresh:
        r = await fresh.open_read("/f")
        assert await r.read() == data
        assert await r.pread(5, 100) == data[5:105]
        assert fresh.stats.degraded_reads >= 1
        assert {b[2] for b in fresh.stats.bad_chunks} >= {f"cs{i}" for i in victims}


async def test_chunk_store_killed_in_the_middle_of_a_large_write(local_cluster, client, caplog):
    caplog.set_level(logging.ERROR, logger="tectonic_py.client")
    local_cluster.add_chunkstore()  # a tenth store, so a failed chunk has somewhere to go
    w = await client.create("/big")
    block = w.layout.block_size
    total = 12 * block
    piece = _data(block, seed=11)
    for i in range(12):
        await w.write(piece)
        if i == 2:
            local_cluster.kill_chunkstore(4)
    attrs = await w.close()
    assert attrs.size == total
    assert client.stats.chunk_write_failures >= 1
    assert client.stats.chunks_replaced >= 1
    r = await client.open_read("/big")
    got = await r.read()
    assert len(got) == total and got == piece * 12
    # Every block still has all 9 chunks: the ones for the dead node were re-placed.
    blocks = await client.meta.block_list(attrs.id)
    assert all(len(b.chunks) == 9 for b in blocks)


async def test_fewer_stores_than_the_write_quorum(local_cluster, client, caplog):
    caplog.set_level(logging.CRITICAL, logger="tectonic_py.client")
    keep = _data(200_000, seed=5)
    await _put(client, "/closed", keep)
    for i in range(4):  # 5 of 9 left: RS(6,3) needs a quorum of 7
        local_cluster.kill_chunkstore(i)
    w = await client.create("/doomed")
    with pytest.raises((QuorumLost, NoSpace)) as err:
        await w.write(_data(w.layout.block_size * 2, seed=6))
        await w.close()
    assert "quorum" in str(err.value) or "nodes" in str(err.value)
    await w.abort()
    for i in range(4):
        local_cluster.start_chunkstore(i)
    async with open_client(local_cluster.cluster_file) as fresh:
        r = await fresh.open_read("/closed")
        assert await r.read() == keep


async def test_corrupt_chunk_on_disk_is_read_around_and_reported(local_cluster, client, caplog):
    data = _data(500_000, seed=9)
    fid = await _put(client, "/c", data)
    info = (await client.meta.block_list(fid))[0]
    victim = next(c for c in info.chunks if c.index == 1)
    path = chunk_layout.chunk_path(
        local_cluster.chunkstore_dir(_node_index(victim.node_id)), chunk_id(info.block_id, 1)
    )
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0xFF
    path.write_bytes(raw)
    async with open_client(local_cluster.cluster_file) as fresh:
        with caplog.at_level(logging.WARNING, logger="tectonic_py.client"):
            r = await fresh.open_read("/c")
            assert await r.read() == data
        assert fresh.stats.corrupt_chunks == 1
        assert (info.block_id, 1, victim.node_id, "corrupt") in fresh.stats.bad_chunks
        assert any("corrupt" in rec.getMessage() for rec in caplog.records)
        # The range fast path also reads around it.
        r = await fresh.open_read("/c")
        off = info.chunk_len + 10
        assert await r.pread(off, 50) == data[off : off + 50]


async def test_large_write_keeps_rss_within_the_window(tmp_path):
    window = 64 * MiB
    proc = psutil.Process()
    # 1 MiB chunks (6 MiB blocks): big enough that the window, not per-chunk costs, matters.
    with LocalCluster(
        tmp_path / "c",
        chunkstores=9,
        metadata_servers=1,
        shards=8,
        chunk_size=MiB,
        heartbeat_interval=0.5,
    ) as cluster:
        await _write_big(cluster, window, proc)


async def _write_big(cluster: LocalCluster, window: int, proc: psutil.Process) -> None:
    async with open_client(
        cluster.cluster_file, window_bytes=window, cache_bytes=32 * MiB
    ) as client:
        piece = _data(8 * MiB, seed=1)
        await _put(client, "/warm", piece)  # connections, threads, zfec tables
        base = proc.memory_info().rss
        peak = base
        done = trio.Event()

        async def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, proc.memory_info().rss)
                await trio.sleep(0.02)

        total = 256 * MiB
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sample)
            w = await client.create("/huge")
            h = hashlib.sha256()
            for i in range(total // len(piece)):
                chunk = bytes([i % 256]) + piece[1:]
                h.update(chunk)
                await w.write(chunk)
            await w.close()
            done.set()
        assert peak - base < window + 96 * MiB, f"RSS grew {(peak - base) / MiB:.0f} MiB"
        r = await client.open_read("/huge")
        h2 = hashlib.sha256()
        while chunk := await r.read(16 * MiB):
            h2.update(chunk)
        assert h2.digest() == h.digest()


async def test_a_hung_chunk_store_is_read_around(local_cluster, caplog):
    """A store that stops answering (SIGSTOP, not dead: its connections stay open) must not
    stall a read: after read_hedge_s the missing data chunks are hedged with parity."""
    caplog.set_level(logging.CRITICAL, logger="tectonic_py.client")
    data = _data(2 * 6 * 64 * 1024 + 77, seed=21)
    async with open_client(local_cluster.cluster_file) as client:
        fid = await _put(client, "/slow", data)
        first = (await client.meta.block_list(fid))[0]
    victim = _node_index(next(c.node_id for c in first.chunks if c.index == 0))
    pid = local_cluster.chunkstore_pids()[victim]
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        async with open_client(
            local_cluster.cluster_file, read_hedge_s=0.5, slow_chunk_s=60.0
        ) as fresh:
            with trio.fail_after(30):  # a bound on the test, not a timing assertion
                r = await fresh.open_read("/slow")
                assert await r.read() == data
            assert fresh.stats.degraded_reads >= 1
    finally:
        os.kill(pid, signal.SIGCONT)


async def test_writes_continue_with_a_node_known_down(local_cluster, client, caplog):
    """9 stores for RS(6,3) and one is down (the registry knows): a block gets 8 chunks,
    which meets the write quorum (k+1 = 7), and reads back."""
    caplog.set_level(logging.ERROR, logger="tectonic_py.client")
    local_cluster.kill_chunkstore(8)
    for _ in range(200):  # bounded wait for the registry's node timeout (5 s in the fixture)
        nodes = {n.node_id: n.state for n in await client.meta.nodes()}
        if nodes.get("cs8") == "down":
            break
        await trio.sleep(0.1)
    assert nodes.get("cs8") == "down"
    data = _data(3 * 6 * 64 * 1024, seed=31)
    fid = await _put(client, "/degraded-write", data)
    blocks = await client.meta.block_list(fid)
    assert all(len(b.chunks) == 8 for b in blocks)
    async with open_client(local_cluster.cluster_file) as fresh:
        r = await fresh.open_read("/degraded-write")
        assert await r.read() == data


async def test_a_hung_chunk_store_does_not_stall_a_write(local_cluster, caplog):
    """A store that stops answering mid-burst (SIGSTOP) is hedged around: its chunks go to a
    spare node after write_hedge_s, the write completes and reads back."""
    caplog.set_level(logging.CRITICAL, logger="tectonic_py.client")
    local_cluster.add_chunkstore()
    local_cluster.add_chunkstore()  # 11 stores: two spares per RS(6,3) block
    pid = local_cluster.chunkstore_pids()[2]
    assert pid is not None
    # 8 blocks: each puts its 9 chunks on 9 of the 11 stores, picked at random, so the hung
    # one takes none of them with a chance of (2/11)^8 (with 4 blocks, 1 in 900: a CI run
    # saw it once, and the write then had nothing to hedge).
    data = _data(8 * 6 * 64 * 1024, seed=41)
    async with open_client(
        local_cluster.cluster_file, write_hedge_s=0.5, chunk_timeout=60.0
    ) as client:
        os.kill(pid, signal.SIGSTOP)
        try:
            with trio.fail_after(60):  # a bound on a hang, not a timing assertion
                fid = await _put(client, "/hedged", data)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert client.stats.hedged_puts >= 1
        blocks = await client.meta.block_list(fid)
        assert all(len(b.chunks) == 9 for b in blocks)
        r = await client.open_read("/hedged")
        assert await r.read() == data


async def test_a_store_stopped_mid_put_does_not_hang_puts(local_cluster, caplog):
    """9 stores for RS(6,3): no spare to hedge to. A store stopped (SIGSTOP) while 8 puts are
    in flight must not hold them until it resumes: each block commits on the live stores
    (at least the write quorum, k + 1) within a bound, reads back, and the blocks committed
    short are the ones repair sees as degraded."""
    caplog.set_level(logging.CRITICAL, logger="tectonic_py.client")
    await _stop_a_store_mid_puts(local_cluster, files=8, blocks=4)


async def test_a_store_stopped_mid_put_of_large_chunks(tmp_path, caplog):
    """The same with 1 MiB chunks: the stopped store's socket buffers fill, so puts to it stall
    in the middle of sending a frame rather than waiting for a reply."""
    caplog.set_level(logging.CRITICAL, logger="tectonic_py.client")
    with suite_cluster(tmp_path / "c", chunk_size=MiB, node_timeout=5.0) as cluster:
        await _stop_a_store_mid_puts(cluster, files=4, blocks=2)


async def _stop_a_store_mid_puts(cluster: LocalCluster, *, files: int, blocks: int) -> None:
    hedge = 0.5
    victim = 3
    pid = cluster.chunkstore_pids()[victim]
    assert pid is not None
    async with open_client(cluster.cluster_file, write_hedge_s=hedge) as client:
        block = (await client.create("/probe")).layout.block_size
        datas = {f"/p{i}": _data(blocks * block + i, seed=50 + i) for i in range(files)}
        stopped = trio.Event()

        async def put(path: str) -> None:
            w = await client.create(path)
            for j in range(0, len(datas[path]), block):
                await w.write(datas[path][j : j + block])
                if j >= block:
                    await stopped.wait()
            await w.close()

        try:
            with trio.fail_after(60):  # a bound on the test; the timing assertion is below
                async with trio.open_nursery() as nursery:
                    for path in datas:
                        nursery.start_soon(put, path)
                    # Mid-put means the client has a connection to the victim with puts on
                    # it: stopped before that (a loaded machine), its connect fails instead
                    # and no put stalls.
                    chunks = cluster.chunkstore_dir(victim) / "chunks"
                    while not any(p.is_file() for p in chunks.glob("*/*")):
                        await trio.sleep(0.01)
                    os.kill(pid, signal.SIGSTOP)
                    t_stop = trio.current_time()
                    stopped.set()
            took = trio.current_time() - t_stop
            # Without the hedge the puts would wait for the store to resume (the 60 s bound
            # above); the margin is for a machine loaded by other work, not the hedge's cost.
            assert took < 30, f"the puts took {took:.1f}s after the store stopped"
            assert client.stats.stalled_puts >= 1
            short: set[int] = set()  # block ids: the files' tails may share one pack
            for path, data in datas.items():
                infos = await client.meta.block_list((await client.stat(path)).id)
                assert all(len(b.chunks) >= 7 for b in infos)
                short |= {b.block_id for b in infos if len(b.chunks) < 9}
                with trio.fail_after(60):
                    assert await (await client.open_read(path)).read() == data
        finally:
            os.kill(pid, signal.SIGCONT)
    assert short
    async with open_inspector(cluster) as m:
        health = await block_health(m)
    assert health["degraded"] >= len(short)


async def test_reads_from_a_stopped_store_are_hedged_to_parity(local_cluster, caplog):
    """A store stopped (SIGSTOP) after the write: whole-file reads and range reads, by the
    writer (its connection to the store open) and by a new client (whose connect the
    stopped store's kernel still accepts), are each served from parity within a bound."""
    caplog.set_level(logging.CRITICAL, logger="tectonic_py.client")
    hedge = 0.5
    tuning = {"read_hedge_s": hedge, "slow_chunk_s": 4 * hedge, "write_hedge_s": hedge}
    async with open_client(local_cluster.cluster_file, **tuning) as writer:
        block = (await writer.create("/probe")).layout.block_size
        datas = {f"/r{i}": _data(3 * block + 11 * i, seed=70 + i) for i in range(3)}
        for path, data in datas.items():
            await _put(writer, path, data)
        first = (await writer.meta.block_list((await writer.stat("/r0")).id))[0]
        victim = _node_index(next(c.node_id for c in first.chunks if c.index == 0))
        pid = local_cluster.chunkstore_pids()[victim]
        assert pid is not None
        writer.cache.capacity = 0  # every block from the chunk stores
        os.kill(pid, signal.SIGSTOP)
        try:
            async with open_client(local_cluster.cluster_file, **tuning) as fresh:
                for client in (writer, fresh):
                    for path, data in datas.items():
                        t0 = trio.current_time()
                        with trio.fail_after(60):  # a bound on a hang
                            r = await client.open_read(path)
                            assert await r.read() == data
                            assert (
                                await r.pread(block - 3, block) == data[block - 3 : 2 * block - 3]
                            )
                        took = trio.current_time() - t0
                        assert took < 10 * hedge + 5, f"reading {path} took {took:.1f}s"
                assert fresh.stats.degraded_reads >= 1
        finally:
            os.kill(pid, signal.SIGCONT)
