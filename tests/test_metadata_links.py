"""Symbolic links, hard links, special files, directory bookkeeping and times in the metadata
service (Name and File layers over real servers): what the mount's symlink, link, mknod and
directory attributes stand on."""

from __future__ import annotations

import pytest
from metadata_fixtures import open_meta_cluster
from test_metadata import mkdir_where

from tectonic_py.core.errors import FileExists, FileNotFound, InvalidArgument, IsADirectory
from tectonic_py.core.ids import ROOT_ID, shard_of
from tectonic_py.core.records import KIND_CHR, KIND_FIFO, KIND_SYMLINK


@pytest.fixture
async def mc(tmp_path, secret_file, meta_engine):
    async with open_meta_cluster(tmp_path, secret_file, etcd=meta_engine) as cluster:
        yield cluster


async def test_symlink_made_and_read_in_the_directory_shard(mc):
    c = mc.client
    d = await c.mkdir(ROOT_ID, "d")
    target = b"../some/where/\xff not utf-8"
    link = await c.symlink(d.id, "l", target, uid=7, gid=8)
    assert (link.kind, link.size, link.uid, link.gid, link.sealed) == (
        KIND_SYMLINK,
        len(target),
        7,
        8,
        True,
    )
    # Record and entry in one transaction of the directory's shard: never an orphan.
    assert shard_of(link.id, c.config.shards) == shard_of(d.id, c.config.shards)
    assert (await c.lookup(d.id, "l")).id == link.id
    assert await c.readlink(link.id) == target
    entries, _ = await c.readdir(d.id)
    assert [(e.name, e.kind) for e in entries] == [("l", KIND_SYMLINK)]
    with pytest.raises(FileExists):
        await c.symlink(d.id, "l", b"x")
    with pytest.raises(InvalidArgument):
        await c.symlink(d.id, "empty", b"")
    with pytest.raises(InvalidArgument):
        await c.readlink(d.id)
    with pytest.raises(InvalidArgument):
        await c.open_for_write(link.id)
    await c.unlink(d.id, "l")
    with pytest.raises(FileNotFound):
        await c.getattr(link.id)


async def test_hard_links_count_names(mc):
    c = mc.client
    a = await mkdir_where(c, ROOT_ID, "a", lambda s: True)
    b = await mkdir_where(c, ROOT_ID, "b", lambda s: s != shard_of(a.id, c.config.shards))
    f, token = await c.create(a.id, "f")
    await c.seal(f.id, token, 0)
    linked = await c.link(f.id, b.id, "g")
    assert linked.nlink == 2
    assert (await c.lookup(b.id, "g")).id == f.id
    with pytest.raises(FileExists):
        await c.link(f.id, b.id, "g")
    assert (await c.getattr(f.id)).nlink == 2  # the failed link undid its count
    with pytest.raises(IsADirectory):
        await c.link(a.id, b.id, "dir")
    await c.unlink(a.id, "f")
    assert (await c.lookup(b.id, "g")).nlink == 1
    await c.unlink(b.id, "g")
    with pytest.raises(FileNotFound):
        await c.getattr(f.id)


async def test_special_files_keep_kind_and_device(mc):
    c = mc.client
    fifo = await c.mknod(ROOT_ID, "p", KIND_FIFO, mode=0o640)
    dev = await c.mknod(ROOT_ID, "c", KIND_CHR, mode=0o600, rdev=0x0501)
    assert (fifo.kind, fifo.mode, fifo.rdev) == (KIND_FIFO, 0o640, 0)
    assert (await c.getattr(dev.id)).rdev == 0x0501
    await c.unlink(ROOT_ID, "c")
    with pytest.raises(FileNotFound):
        await c.getattr(dev.id)


async def test_directory_link_count_and_times_follow_entries(mc):
    c = mc.client
    top = await c.mkdir(ROOT_ID, "top")
    assert top.nlink == 2
    before = (await c.getattr(top.id)).mtime_ns
    sub = await c.mkdir(top.id, "sub")
    after_mkdir = await c.getattr(top.id)
    assert after_mkdir.nlink == 3 and after_mkdir.mtime_ns > before
    assert after_mkdir.ctime_ns == after_mkdir.mtime_ns
    f, token = await c.create(top.id, "f")
    await c.seal(f.id, token, 0)
    t_create = (await c.getattr(top.id)).mtime_ns
    assert t_create > after_mkdir.mtime_ns
    await c.rename(top.id, "f", top.id, "g")
    t_rename = (await c.getattr(top.id)).mtime_ns
    assert t_rename > t_create
    other = await mkdir_where(c, ROOT_ID, "o", lambda s: s != shard_of(top.id, c.config.shards))
    await c.rename(top.id, "sub", other.id, "sub")  # across shards: the intent protocol
    assert (await c.getattr(top.id)).nlink == 2
    assert (await c.getattr(other.id)).nlink == 3
    await c.rename(other.id, "sub", top.id, "sub")
    await c.unlink(top.id, "g")
    await c.rmdir(top.id, "sub")
    final = await c.getattr(top.id)
    assert final.nlink == 2 and final.mtime_ns > t_rename
    assert (await c.getattr(other.id)).nlink == 2
    assert sub.nlink == 2


async def test_stored_counts_blocks_not_holes(mc):
    """``stored`` (st_blocks) counts the bytes stored blocks cover: a hole has none."""
    from metadata import file_layer

    store = next(iter(mc.servers[0].stores.values()))
    conn = store.reader
    # Straight over SQL: a file of 10 blocks of 100 bytes with only blocks 3 and 9 stored,
    # the last one short.
    fid = 42
    assert file_layer._stored(conn, fid, 950, 100) == 0
    await store.write(
        lambda conn: conn.executemany(
            "INSERT INTO file_blocks (file_id, idx, block_id) VALUES (?, ?, ?)",
            [(fid, 3, 1), (fid, 9, 2)],
        )
    )
    assert file_layer._stored(conn, fid, 950, 100) == 150
    assert file_layer._stored(conn, fid, 1000, 100) == 200


async def test_seal_keeps_the_times_set_before_it(mc):
    """A seal changes no byte, so it stamps no time: a utime that lands between close(2)'s
    flush and the seal of the last release (shutil.copy2, cp -p) is kept."""
    c = mc.client
    f, token = await c.create(ROOT_ID, "timed")
    await c.set_size(f.id, token, 10)
    want = 1_600_000_000_123_456_789
    await c.setattr(f.id, mtime_ns=want, atime_ns=want)
    sealed = await c.seal(f.id, token, 10)
    assert (sealed.mtime_ns, (await c.getattr(f.id)).mtime_ns) == (want, want)
    token = await c.open_for_write(f.id)
    await c.setattr(f.id, mtime_ns=want)
    grown = await c.seal(f.id, token, 20)  # a seal that changes the size is a change
    assert grown.mtime_ns > want
