"""Client robustness under bursts: slowness starts hedges and degraded fetches, it never fails
a read or a write (only real failures do), and every writer's buffer counts against the
memory window."""

from __future__ import annotations

import hashlib
import logging
import os
import signal

import trio

from tectonic_py.client.tectonic_client import TectonicClient, open_client
from tectonic_py.launch.local_cluster import LocalCluster

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
    async with open_client(
        local_cluster.cluster_file, slow_chunk_s=0.01, read_hedge_s=0.01
    ) as fresh:
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
    async with open_client(
        local_cluster.cluster_file, chunk_timeout=0.01, write_hedge_s=0.01
    ) as client:
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


def _count_fetches(client: TectonicClient) -> dict[str, int]:
    """Wrap the client's whole-block fetch to record how many run at once and in total (a
    probe on the real fetch, which still runs)."""
    seen = {"now": 0, "peak": 0, "total": 0, "peak_bytes": 0}
    fetch = client.blocks.fetch_block

    async def counted(info):  # type: ignore[no-untyped-def]
        size = 6 * info.chunk_len
        seen["now"] += size
        seen["total"] += 1
        seen["peak"] = max(seen["peak"], seen["now"])
        try:
            return await fetch(info)
        finally:
            seen["now"] -= size
            seen["peak_bytes"] = max(seen["peak_bytes"], getattr(client.cache, "used", 0))

    client.blocks.fetch_block = counted  # type: ignore[method-assign]
    return seen


async def _write_files(cluster_file, directory: str, files: dict[str, bytes]) -> None:
    async with open_client(cluster_file) as client:
        await client.mkdir(directory)
        for path, data in files.items():
            w = await client.create(path)
            await w.write(data)
            await w.close()


async def test_many_readers_stay_inside_the_read_budget(local_cluster, caplog):
    """48 readers at once with a budget of four blocks: block fetches in flight never hold
    more than the budget (before the fix each reader fetched its whole block outside it),
    readers that find no room read their bytes directly, and every byte is right."""
    caplog.set_level(logging.ERROR, logger="tectonic_py.client")
    block = 6 * 64 * 1024
    files = {f"/r/{i}": _data(block + 1000 * i, seed=100 + i) for i in range(48)}
    await _write_files(local_cluster.cluster_file, "/r", files)
    budget = 4 * block
    async with open_client(local_cluster.cluster_file, cache_bytes=budget) as client:
        seen = _count_fetches(client)

        async def read_one(path: str) -> None:
            r = await client.open_read(path)
            got = bytearray()
            while piece := await r.read(100_000):
                got += piece
            assert got == files[path], path

        async with trio.open_nursery() as nursery:
            for path in files:
                nursery.start_soon(read_one, path)
        assert 0 < seen["peak"] <= budget
        assert client.cache.used <= budget
        assert client.stats.range_reads > 0  # readers without room read ranges


async def test_readahead_does_not_evict_blocks_other_readers_are_about_to_use(
    local_cluster, caplog
):
    """8 sequential readers of 6-block files share a cache of 5 blocks: readahead may only
    evict blocks their readers have finished, so no block is fetched twice (before, readahead
    evicted blocks other readers were about to consume, and they were fetched again)."""
    caplog.set_level(logging.ERROR, logger="tectonic_py.client")
    block = 6 * 64 * 1024
    files = {f"/s/{i}": _data(6 * block, seed=200 + i) for i in range(8)}
    await _write_files(local_cluster.cluster_file, "/s", files)
    async with open_client(
        local_cluster.cluster_file, cache_bytes=5 * block, readahead_blocks=3
    ) as client:
        seen = _count_fetches(client)

        async def read_one(path: str) -> None:
            r = await client.open_read(path)
            got = bytearray()
            while piece := await r.read(64 * 1024):
                got += piece
                await trio.lowlevel.checkpoint()
            assert got == files[path], path

        async with trio.open_nursery() as nursery:
            for path in files:
                nursery.start_soon(read_one, path)
        assert seen["total"] <= 6 * len(files)
        assert seen["peak"] <= 5 * block


async def test_out_of_order_and_tail_reads_stay_sequential(local_cluster, caplog):
    """The kernel's readahead sends FUSE reads a little out of order and torch.load reads the
    zip tail first: the reader must still read whole blocks ahead, not one round trip per
    read (before, every one of these reads was a separate range read)."""
    caplog.set_level(logging.ERROR, logger="tectonic_py.client")
    block = 6 * 64 * 1024
    data = _data(4 * block, seed=300)
    async with open_client(local_cluster.cluster_file) as client:
        w = await client.create("/t")
        await w.write(data)
        await w.close()
        r = await client.open_read("/t")
        p = 128 * 1024
        assert await r.pread(len(data) - 100, 100) == data[-100:]  # the zip tail first
        for i in range(0, len(data) // p, 2):  # then pairs, second piece first
            for j in (i + 1, i):
                assert await r.pread(j * p, p) == data[j * p : (j + 1) * p]
        assert client.stats.range_reads <= 1


async def _filled_socketpair() -> tuple[trio.socket.SocketType, trio.socket.SocketType]:
    """A connected pair whose first end's send buffer is full (the peer reads nothing)."""
    import socket as stdlib_socket

    a, b = trio.socket.socketpair()
    a.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_SNDBUF, 4096)
    filler = b"x" * 65536
    while True:  # bounded by the socket buffers: a send that would block is cancelled
        with trio.move_on_after(0.2) as scope:
            await a.send(filler)
        if scope.cancelled_caught:
            return a, b


async def test_a_request_cancelled_before_its_frame_went_out_keeps_the_connection():
    """Cancelling a request whose frame had not started (a hedge loser, a slow get) must not
    drop the connection that every other request to that store shares; one cancelled
    half-way through its frame must (the stream would be garbage)."""
    from tectonic_py.core import auth, framing, rpc_client

    a, b = await _filled_socketpair()
    session = auth.FrameSession(b"k" * 32, b"k" * 32)
    conn = rpc_client.Connection(a, "pair", framing.DEFAULT_LIMITS, session)
    try:
        with trio.move_on_after(0.2):  # cancel it while it waits to send
            await conn.call("get", {"chunk_id": "x", "offset": 0, "length": 1})
        assert conn.broken is None
        await b.recv(8192)  # room for part of the next frame only
        with trio.move_on_after(0.2):
            await conn.call("put", {"chunk_id": "x"}, b"y" * (4 * MiB))
        assert conn.broken is not None
    finally:
        a.close()
        b.close()
