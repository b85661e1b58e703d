"""Spare files: deletes keep their inodes for later puts, within bounds and capacity."""

from __future__ import annotations

import pytest
import trio
from chunkstore_helpers import (
    KiB,
    MiB,
    chunk_file,
    delete_cap,
    new_chunk,
    open_client,
    payload,
    start_store,
)
from tmpfs_helpers import small_tmpfs

from chunkstore import layout
from chunkstore.spares import Spare, SpareFiles
from tectonic_py.core.errors import (
    ChunkNotFound,
    DiskFull,
)


async def test_delete_keeps_the_file_as_a_spare_and_a_put_reuses_it(nursery, tmp_path, secret):
    server, port = await start_store(nursery, tmp_path / "d", secret, spare_min=0)
    async with open_client(port, secret) as c:
        a, cap_a = new_chunk(secret)
        await c.put(a, payload(MiB, 1), cap_a)
        inode = chunk_file(server, a).stat().st_ino
        assert await c.delete(a, delete_cap(secret, a))
        assert server.spares.count == 1 and server.used == 0 and server.chunk_count == 0
        (spare,) = server.spares.directory.iterdir()
        assert spare.stat().st_ino == inode and not chunk_file(server, a).exists()
        for op in (c.get, c.stat):
            with pytest.raises(ChunkNotFound):  # deleted means gone under its id
                await op(a)
        assert a not in dict(await c.list_all())
        stats = (await c.node_stats()).free
        b, cap_b = new_chunk(secret)
        await c.put(b, payload(MiB, 2), cap_b)  # same size: the spare's inode and blocks
        assert chunk_file(server, b).stat().st_ino == inode
        assert server.spares.count == 0 and not list(server.spares.directory.iterdir())
        assert bytes(await c.get(b)) == payload(MiB, 2)
        assert (await c.node_stats()).free <= stats
        # While the pool has room, a chunk of another size neither grows nor cuts it: a
        # new file each, and the spare waits for a chunk of its size.
        assert await c.delete(b, delete_cap(secret, b))
        for size, seed in ((3 * MiB + 5, 3), (1000, 4)):
            other, cap_o = new_chunk(secret)
            await c.put(other, payload(size, seed), cap_o)
            assert chunk_file(server, other).stat().st_ino != inode and server.spares.count == 1
            assert bytes(await c.get(other)) == payload(size, seed)
        with pytest.raises(ChunkNotFound):
            await c.get(a)
    assert server.spares.reused == 1 and server.spares.recycled == 2


async def test_a_full_pool_cuts_larger_spares_and_grows_smaller_ones(nursery, tmp_path, secret):
    server, port = await start_store(nursery, tmp_path / "d", secret, spare_min=0, spare_files=1)
    async with open_client(port, secret) as c:
        big, cap = new_chunk(secret)
        await c.put(big, payload(MiB, 1), cap)
        inode = chunk_file(server, big).stat().st_ino
        assert await c.delete(big, delete_cap(secret, big)) and server.spares.count == 1
        small, cap = new_chunk(secret)
        await c.put(small, payload(1000, 2), cap)
        stat = chunk_file(server, small).stat()
        assert stat.st_ino == inode and stat.st_size == layout.file_size_for(1000)
        assert bytes(await c.get(small)) == payload(1000, 2)
        assert server.spares.count == 0
        # And a full pool's smaller spare grows for a larger chunk.
        assert await c.delete(small, delete_cap(secret, small)) and server.spares.count == 1
        large, cap = new_chunk(secret)
        await c.put(large, payload(3 * MiB + 5, 3), cap)
        stat = chunk_file(server, large).stat()
        assert stat.st_ino == inode and stat.st_size == layout.file_size_for(3 * MiB + 5)
        assert bytes(await c.get(large)) == payload(3 * MiB + 5, 3)


def test_spare_choice_exact_then_empty_then_other_sizes_only_when_full(tmp_path):
    pool = SpareFiles(tmp_path, max_files=3, max_bytes=10**9)
    for name, size in (("e", 0), ("a", 100), ("b", 400)):
        pool._add(tmp_path / name, size)
    assert pool.take(100) == Spare(tmp_path / "a", 100)  # exact
    assert pool.take(300) == Spare(tmp_path / "e", 0)  # an empty one grows
    assert pool.take(200) is None  # only a larger one: make a new file
    pool._add(tmp_path / "f", 100)
    assert pool.take(200) is None  # nor a smaller one while the pool has room
    pool._add(tmp_path / "c", 50)
    assert pool.take(200) == Spare(tmp_path / "f", 100)  # full: the largest smaller grows
    pool._add(tmp_path / "d", 60)
    assert pool.take(10) == Spare(tmp_path / "c", 50)  # full, none smaller: smallest larger
    assert pool.take(10) is None and pool.count == 2


async def test_spares_are_bounded_in_files_and_bytes(nursery, tmp_path, secret):
    server, port = await start_store(
        nursery, tmp_path / "d", secret, spare_min=0, spare_files=3, spare_bytes=5 * 100_000
    )
    async with open_client(port, secret) as c:
        cids = []
        for i in range(6):
            cid, cap = new_chunk(secret)
            await c.put(cid, payload(100_000 + 1000 * i, i), cap)
            cids.append(cid)
        async with trio.open_nursery() as n:  # at once: each may think one more fits
            for cid in cids:
                n.start_soon(c.delete, cid, delete_cap(secret, cid))
        files = list(server.spares.directory.iterdir())
        assert len(files) == server.spares.count <= 3
        assert sum(f.stat().st_size for f in files) == server.spares.bytes <= 5 * 100_000
        assert server.used == 0 and server.chunk_count == 0
    # spare_files=0: a delete unlinks, as without spares.
    server2, port2 = await start_store(nursery, tmp_path / "d2", secret, spare_min=0, spare_files=0)
    async with open_client(port2, secret) as c:
        cid, cap = new_chunk(secret)
        await c.put(cid, b"x" * 5000, cap)
        await c.delete(cid, delete_cap(secret, cid))
        assert not list(server2.spares.directory.iterdir())


async def test_restart_keeps_spares_within_bounds_and_removes_strays(tmp_path, secret):
    data_dir = tmp_path / "d"
    async with trio.open_nursery() as nursery:
        server, port = await start_store(nursery, data_dir, secret, spare_min=0)
        async with open_client(port, secret) as c:
            cids = []
            for i in range(4):
                cid, cap = new_chunk(secret)
                await c.put(cid, payload(1000 * (i + 1), i), cap)
                cids.append(cid)
            for cid in cids:
                await c.delete(cid, delete_cap(secret, cid))
        nursery.cancel_scope.cancel()
    spares_dir = server.spares.directory
    (spares_dir / "not-a-spare").write_bytes(b"junk")
    async with trio.open_nursery() as nursery:
        server, port = await start_store(nursery, data_dir, secret, spare_min=0, spare_files=3)
        names = sorted(p.name for p in spares_dir.iterdir())
        assert len(names) == server.spares.count == 3 and "not-a-spare" not in names
        assert server.spares.bytes == sum((spares_dir / n).stat().st_size for n in names)
        assert server.chunk_count == 0 and server.used == 0
        async with open_client(port, secret) as c:
            cid, cap = new_chunk(secret)
            await c.put(cid, payload(2000, 9), cap)  # an exact-size spare from before
            assert bytes(await c.get(cid)) == payload(2000, 9)
            assert server.spares.count == 2
        nursery.cancel_scope.cancel()


async def test_idle_store_keeps_empty_spares_ready(nursery, tmp_path, secret):
    server, port = await start_store(nursery, tmp_path / "d", secret, spare_min=5)
    with trio.fail_after(30):
        while server.spares.count < 5:
            await trio.sleep(0.01)
    files = list(server.spares.directory.iterdir())
    assert len(files) == 5 and all(f.stat().st_size == 0 for f in files)
    async with open_client(port, secret) as c:
        cid, cap = new_chunk(secret)
        await c.put(cid, payload(70_000, 3), cap)
        assert bytes(await c.get(cid)) == payload(70_000, 3)
    assert server.spares.reused == 1
    with trio.fail_after(30):  # topped up again once the store is idle
        while server.spares.count < 5:
            await trio.sleep(0.01)
    assert server.spares.created == 6


async def _put_three_delete_two(c, server, secret):
    """Three 1 MiB chunks stored, the first two deleted into spares: (the three ids, node
    stats while all three were stored)."""
    stored = []
    for i in range(3):
        cid, cap = new_chunk(secret)
        await c.put(cid, payload(MiB, i), cap)
        stored.append(cid)
    full = await c.node_stats()
    for cid in stored[:2]:
        await c.delete(cid, delete_cap(secret, cid))
    assert server.spares.count == 2
    return stored, full


async def test_capacity_counts_spares_and_trims_them_to_make_room(nursery, tmp_path, secret):
    cap_bytes = 3 * MiB + 64 * KiB
    server, port = await start_store(
        nursery, tmp_path / "d", secret, capacity=cap_bytes, spare_min=0
    )
    async with open_client(port, secret) as c:
        _, full = await _put_three_delete_two(c, server, secret)
        stats = await c.node_stats()
        # Spares are free space to the cluster: any put may have them.
        assert stats.free == full.free + 2 * layout.file_size_for(MiB)
        # A put that needs more than the spares' neighbours leave: spares are unlinked.
        big, cap = new_chunk(secret)
        await c.put(big, payload(2 * MiB, 7), cap)
        assert server.used + server.spares.bytes <= cap_bytes
        assert len(list(server.spares.directory.iterdir())) == server.spares.count
        assert bytes(await c.get(big)) == payload(2 * MiB, 7)
        with pytest.raises(DiskFull):
            cid, cap = new_chunk(secret)
            await c.put(cid, payload(MiB, 8), cap)
        assert server.used + server.spares.bytes <= cap_bytes


@pytest.fixture
def small_fs_4m(tmp_path):
    yield from small_tmpfs(tmp_path, "4m")


async def test_real_disk_full_unlinks_spares_and_retries(small_fs_4m, secret):
    async with trio.open_nursery() as nursery:
        server, port = await start_store(nursery, small_fs_4m / "data", secret, spare_min=0)
        async with open_client(port, secret) as c:
            cids, _ = await _put_three_delete_two(c, server, secret)
            # 2.5 MiB fits only once both spares are gone: the first write (into a grown
            # spare) hits ENOSPC, the spares are unlinked and the put is tried again.
            big, cap = new_chunk(secret)
            await c.put(big, payload(5 * MiB // 2, 5), cap)
            assert bytes(await c.get(big)) == payload(5 * MiB // 2, 5)
            assert bytes(await c.get(cids[2])) == payload(MiB, 2)
            assert server.spares.count == 0 and not list(server.spares.directory.iterdir())
            assert not list(small_fs_4m.rglob(".tmp-*"))
            with pytest.raises(DiskFull):
                cid, cap = new_chunk(secret)
                await c.put(cid, payload(MiB, 6), cap)
            assert (await c.node_stats()).chunk_count == 2
        nursery.cancel_scope.cancel()
