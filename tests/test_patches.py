"""Copy-on-write extents for small overwrites (issue 33): a small change made durable by
fsync or close is a *patch*, an extent of a pack laid over the file's block, and costs its
own bytes instead of a new version of the block (1 + m whole chunks); a page rewritten again
keeps one patch; the writer folds a block's patches into a new version at the limit; fsync'd
appends are patches too; patches read back through every path (whole blocks, small ranges,
a fresh client, the writer itself); a patch's pack lives while the patch does, and goes with
the file; the File layer's rules on a real SQLite shard; and SQLite in WAL mode on the
mount, whose commits are fsync'd appends.

Real processes: local clusters (maintenance_helpers) and a FUSE mount (fuse_fixtures).
"""

from __future__ import annotations

import os
import random
import sqlite3

import pytest
import trio
from maintenance_helpers import (
    CHUNK,
    EC,
    data_of,
    make_cluster,
    open_fresh_client,
    open_inspector,
    put,
    read,
    total_used,
    wait_for,
)

from chunkstore.layout import file_size_for
from metadata import block_layer, file_layer, maintenance_ops, write_ops
from metadata.shard import SCHEMA
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import FileSealed, InvalidArgument, Refused
from tectonic_py.core.records import MAX_PATCHES, BlockInfo, ChunkPlacement, PackedExtent

POLICY = ECPolicy.parse(EC)
BLOCK = POLICY.k * CHUNK
PAGE = 4096
NO_HEDGE = {"write_hedge_s": 600.0}  # no second copy of a slow put in the byte counts
# What a page's patch costs on the stores: n chunk files of a k-th of the page, with slack
# for the padding of the encode.
PATCH_RAW = POLICY.n * file_size_for(-(-PAGE // POLICY.k) + 64)


@pytest.fixture
def mount(shared_mount):  # type: ignore[no-untyped-def]
    """One cluster and mount for the module's two mount tests: each works on its own file
    (runs.db, ckpt.bin) and neither kills nor stops a daemon."""
    return shared_mount


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):  # type: ignore[no-untyped-def]
    """One cluster for the tests that need no maintenance daemon (each its own file)."""
    c = make_cluster(tmp_path_factory.mktemp("patches") / "c", maintenance=False)
    c.start()
    try:
        yield c
    finally:
        c.stop()


async def _overwrite(client, path: str, model: bytearray, offset: int, data: bytes) -> None:  # type: ignore[no-untyped-def]
    w = await client.open_writer((await client.stat(path)).id)
    await w.pwrite(data, offset)
    await w.close()
    model[offset : offset + len(data)] = data


async def _blocks(client, path: str) -> list[BlockInfo]:  # type: ignore[no-untyped-def]
    return await client.meta.block_list((await client.stat(path)).id)


async def test_small_overwrites_are_patches_that_cost_their_bytes(cluster):
    """12 random 4 KiB overwrites of a 4-block file: each adds a patch (two where the page
    straddles blocks) and about a page's coded bytes to the stores (before: 1 + m whole
    chunks, 48 KiB here, 16 MiB with 4 MiB chunks); the blocks keep their ids; whole reads, random page reads and a fresh client
    read the model."""
    rng = random.Random(33)
    model = bytearray(data_of(4 * BLOCK, seed=1))
    async with open_fresh_client(cluster, **NO_HEDGE) as client, open_inspector(cluster) as m:
        await put(client, "/f1", bytes(model))
        ids = [b.block_id for b in await _blocks(client, "/f1")]
        before = await total_used(m)
        writes = 12
        for _ in range(writes):
            await _overwrite(
                client, "/f1", model, rng.randrange(0, len(model) - PAGE), rng.randbytes(PAGE)
            )
        added = await total_used(m) - before
        blocks = await _blocks(client, "/f1")
        assert [b.block_id for b in blocks] == ids
        # A page that straddles two blocks is a patch of each.
        laid = sum(len(b.patches) for b in blocks)
        assert writes <= laid <= 2 * writes
        assert added <= laid * PATCH_RAW, (added, laid, PATCH_RAW)
        assert client.statistics().adopted_chunks == 0
        assert await read(client, "/f1") == bytes(model)
    async with open_fresh_client(cluster) as other:
        assert await read(other, "/f1") == bytes(model)
        r = await other.open_read("/f1")
        for _ in range(40):  # small random reads: ranges of the data chunks and patches
            at, n = rng.randrange(0, len(model)), rng.randrange(1, 3 * PAGE)
            assert await r.pread(at, n) == bytes(model[at : at + n]), (at, n)
        await r.aclose()


async def test_a_rewritten_page_keeps_one_patch_and_the_limit_folds(cluster, monkeypatch):
    """One page written five times is one patch (each covers the last whole); with the
    limit at 4, the writer folds a block's patches into a new version (patches gone, new
    block id) rather than lay a fourth, and goes on patching the new version."""
    import tectonic_py.client.writer as writer_module

    monkeypatch.setattr(writer_module, "MAX_PATCHES", 4)
    rng = random.Random(5)
    model = bytearray(data_of(BLOCK, seed=2))
    async with open_fresh_client(cluster) as client:
        await put(client, "/f2", bytes(model))
        (first,) = await _blocks(client, "/f2")
        for _ in range(5):
            await _overwrite(client, "/f2", model, 1000, rng.randbytes(PAGE))
        (b,) = await _blocks(client, "/f2")
        assert len(b.patches) == 1 and b.block_id == first.block_id
        for offset in (20_000, 40_000):
            await _overwrite(client, "/f2", model, offset, rng.randbytes(PAGE))
        (b,) = await _blocks(client, "/f2")
        assert len(b.patches) == 3 and b.block_id == first.block_id
        await _overwrite(client, "/f2", model, 50_000, rng.randbytes(PAGE))
        (folded,) = await _blocks(client, "/f2")
        assert folded.patches == () and folded.block_id != first.block_id
        await _overwrite(client, "/f2", model, 7, rng.randbytes(100))
        (b,) = await _blocks(client, "/f2")
        assert len(b.patches) == 1 and b.block_id == folded.block_id
        assert await read(client, "/f2") == bytes(model)
    async with open_fresh_client(cluster) as other:
        assert await read(other, "/f2") == bytes(model)


async def test_fsynced_appends_are_patches(cluster):
    """A log written a line and an fsync at a time: after its first fsync each fsync lays
    the new bytes as a patch past the block's own end, not the whole file again; the
    writer, a reader and a fresh client read it whole, also after the close."""
    async with open_fresh_client(cluster, **NO_HEDGE) as client, open_inspector(cluster) as m:
        w = await client.create("/log", ec=EC)
        body = bytearray(data_of(8 * PAGE, seed=3))
        await w.write(bytes(body))
        await w.fsync()
        before = await total_used(m)
        lines = 20
        for i in range(lines):
            line = f"step {i} loss {1 / (i + 1):.6f}\n".encode() * 3
            await w.write(line)
            await w.fsync()
            body += line
        added = await total_used(m) - before
        assert added <= lines * PATCH_RAW, added
        assert await w.pread(0, len(body)) == bytes(body)
        assert await read(client, "/log") == bytes(body)
        await w.close()
        (b,) = await _blocks(client, "/log")
        assert b.base_len == 8 * PAGE and b.file_len == len(body) and b.patches
    async with open_fresh_client(cluster) as other:
        assert await read(other, "/log") == bytes(body)


async def test_patch_packs_live_with_the_file_and_go_with_it(tmp_path):
    """GC rounds and their block and chunk sweeps (every second, grace 1 s), and pack
    compaction (of packs up to 90% dead), free and move nothing a patch names (the file
    reads back after them), and the file's unlink frees its blocks and its patches' packs: the stores' bytes come
    back to where they were before the file."""
    cluster = make_cluster(
        tmp_path / "c",
        maintenance_args=[
            *("--grace", "1", "--lease-grace", "0.5", "--sweep-interval", "1"),
            *("--compact-below", "0.9", "--no-rebalance"),
        ],
    )
    try:
        cluster.start()
        rng = random.Random(9)
        model = bytearray(data_of(2 * BLOCK, seed=4))
        async with open_fresh_client(cluster, **NO_HEDGE) as client, open_inspector(cluster) as m:
            empty = await total_used(m)
            await put(client, "/f", bytes(model))
            for _ in range(6):
                await _overwrite(
                    client, "/f", model, rng.randrange(0, len(model) - PAGE), rng.randbytes(PAGE)
                )
            await trio.sleep(4.0)  # rounds and sweeps past the grace (1 s)
            assert await read(client, "/f") == bytes(model)
            await client.unlink("/f")

            async def reclaimed():  # type: ignore[no-untyped-def]
                return await total_used(m) <= empty

            await wait_for("the file's blocks and patch packs to be collected", reclaimed)
    finally:
        cluster.stop()


# --- the File layer's rules, on a real shard database ----------------------------------------


@pytest.fixture
def conn():  # type: ignore[no-untyped-def]
    c = sqlite3.connect(":memory:", isolation_level=None)
    c.executescript(SCHEMA)
    yield c
    c.close()


def _pack(conn: sqlite3.Connection, data_len: int = 1000) -> BlockInfo:
    nodes = [f"n{i}" for i in range(POLICY.n)]
    bid = block_layer.allocate(conn, 0, 1, block_layer.PACK_OWNER, EC, nodes, 1)
    chunks = [ChunkPlacement(i, nodes[i], 7) for i in range(POLICY.n)]
    return BlockInfo(bid, EC, 256, data_len, chunks, 0)


def _file(conn: sqlite3.Connection) -> tuple[int, int, BlockInfo]:
    """A file being written whose block 0 is an extent of a pack: (id, token, pack)."""
    spec = {"kind": "file", "mode": 0o644, "uid": 0, "gid": 0, "ec": EC, "chunk_size": CHUNK}
    attrs, token = file_layer.create(conn, 0, 1, spec, 1, 10**15)
    pack = _pack(conn)
    f = PackedExtent(attrs.id, token, 0, 0, 500, 500, False)
    assert not isinstance(write_ops.commit_pack(conn, 0, 1, pack, [f], 2)[0], Exception)
    return attrs.id, token, pack


def _patch(file_id: int, token: int, at: int, length: int, offset: int, seal: bool = False):  # type: ignore[no-untyped-def]
    return PackedExtent(file_id, token, 0, offset, length, 500, seal, at)


def test_a_patch_needs_a_block_a_range_inside_it_and_room(conn):
    file_id, token, _ = _file(conn)
    pack = _pack(conn)
    for bad in (
        PackedExtent(file_id, token, 1, 0, 10, 500, False, 0),  # no block 1 to patch
        _patch(file_id, token, BLOCK - 5, 10, 0),  # past the block
        _patch(file_id, token, 495, 10, 0),  # past the size
    ):
        (out,) = write_ops.commit_pack(conn, 0, 1, pack, [bad], 3)
        assert isinstance(out, InvalidArgument), bad
    for i in range(MAX_PATCHES):
        file_layer.add_patch(conn, file_id, token, 0, i, 1, pack.block_id, 0, 4)
    with pytest.raises(InvalidArgument, match="patches"):
        file_layer.add_patch(conn, file_id, token, 0, 2000, 1, pack.block_id, 0, 5)


def test_a_covering_patch_drops_the_covered_and_their_packs_go_when_unheld(conn):
    file_id, token, base = _file(conn)
    p1, p2, p3 = _pack(conn), _pack(conn), _pack(conn)
    for p, at, n in ((p1, 100, 10), (p2, 300, 10), (p3, 90, 30)):  # p3 covers p1, not p2
        (out,) = write_ops.commit_pack(conn, 0, 1, p, [_patch(file_id, token, at, n, 0)], 6)
        assert not isinstance(out, Exception), out
    assert [(at, n, b) for _, at, n, b, _ in file_layer.patches(conn, file_id)] == [
        (300, 10, p2.block_id),
        (90, 30, p3.block_id),
    ]
    queued = set(file_layer.gc_blocks(conn, 100))
    assert p1.block_id in queued and p2.block_id not in queued
    with pytest.raises(Refused):  # a pack a patch names is never forgotten
        maintenance_ops.forget_block(conn, p2.block_id, "committed", None, None)
    assert maintenance_ops.referenced(conn, [(block_layer.PACK_OWNER, 0, p2.block_id)]) == [True]
    # A new block at the index holds the patches' bytes: they go, and their packs with them.
    file_layer.commit_blocks(conn, file_id, token, [(0, base.block_id, 0, 500)], 7)
    assert file_layer.patches(conn, file_id) == []
    assert {p2.block_id, p3.block_id} <= set(file_layer.gc_blocks(conn, 100))


def test_a_patch_on_close_is_answered_again_after_a_lost_reply(conn):
    file_id, token, _ = _file(conn)
    pack = _pack(conn)
    close = _patch(file_id, token, 10, 20, 0, seal=True)
    (first,) = write_ops.commit_pack(conn, 0, 1, pack, [close], 8)
    assert not isinstance(first, Exception) and first.sealed
    (again,) = write_ops.commit_pack(conn, 0, 1, pack, [close], 9)
    assert not isinstance(again, Exception) and again.size == first.size
    other = _patch(file_id, token, 50, 20, 100, seal=True)
    (refused,) = write_ops.commit_pack(conn, 0, 1, pack, [other], 10)
    assert isinstance(refused, FileSealed)


def test_unlink_and_truncate_drop_patches_with_their_blocks(conn):
    file_id, token, base = _file(conn)
    pack = _pack(conn)
    write_ops.commit_pack(conn, 0, 1, pack, [_patch(file_id, token, 10, 20, 0)], 11)
    file_layer.set_size(conn, file_id, token, 0, 12)
    assert file_layer.patches(conn, file_id) == []
    assert {base.block_id, pack.block_id} <= set(file_layer.gc_blocks(conn, 100))


# --- SQLite on the mount ----------------------------------------------------------------------


@pytest.mark.fuse
def test_sqlite_in_wal_mode_on_the_mount(mount) -> None:  # type: ignore[no-untyped-def]
    """SQLite with WAL and synchronous=FULL: every commit appends a page to the WAL and
    fsyncs it. Each commit is a patch of about a page (before: the whole WAL stored again,
    341 kB a commit); the table reads back whole from a new connection."""
    from bench.bench_inplace import chunk_bytes

    db = mount / "runs.db"
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=wal")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("CREATE TABLE t (i INTEGER PRIMARY KEY, v BLOB)")
        for i in range(5):
            conn.execute("INSERT INTO t VALUES (?, ?)", (i, os.urandom(100)))
        before = chunk_bytes(mount.cluster.root)
        commits = 30
        rows = {}
        for i in range(5, 5 + commits):
            rows[i] = os.urandom(100)
            conn.execute("INSERT INTO t VALUES (?, ?)", (i, rows[i]))
        added = chunk_bytes(mount.cluster.root) - before
    finally:
        conn.close()
    assert added <= commits * 64 * 1024, added / commits
    again = sqlite3.connect(db)
    try:
        got = dict(again.execute("SELECT i, v FROM t WHERE i >= 5").fetchall())
    finally:
        again.close()
    assert got == rows


@pytest.mark.fuse
def test_a_reader_open_before_a_patch_reads_it_after_the_close(mount) -> None:  # type: ignore[no-untyped-def]
    """Process A holds the file open for reading; B opens it r+, writes a page, closes. A
    (its page cache dropped, so the read reaches the mount) reads B's page: the patch left
    the block A's reader had located as it was, and the close handed A the sealed map."""
    path = mount / "ckpt.bin"
    model = bytearray(os.urandom(2 * 1024 * 1024 + 123))
    path.write_bytes(model)
    a = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(a, PAGE, 0) == model[:PAGE]
        page = os.urandom(PAGE)
        b = os.open(path, os.O_RDWR)
        try:
            assert os.pwrite(b, page, 1_000_000) == PAGE
        finally:
            os.close(b)
        model[1_000_000 : 1_000_000 + PAGE] = page
        os.posix_fadvise(a, 0, 0, os.POSIX_FADV_DONTNEED)
        assert os.pread(a, len(model), 0) == model
    finally:
        os.close(a)
