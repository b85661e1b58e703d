"""Small in-place writes (issue 23, bug 3; issue 33): a 4 KiB ``pwrite`` into a committed
block of a reopened file is a *patch*, an extent of a pack laid over the block, costing its
own bytes (tests/test_patches.py has the rest of them). Where patches are off (a client with
``pack_limit`` 0) or a change is a large part of its block, or when a writer folds a block's
patches, the writer stores a new version of the block that rewrites only the data chunks it
touched and the parity, adopting the old version's other chunks; the old version's own
chunks come back within the short ``superseded_grace`` while a reader that opened the file
before keeps reading (it re-reads the block list when the old chunks are gone); and the
Block layer never lets a chunk that a version still places be deleted, nor a writer adopt a
chunk its file does not hold.

Real processes: a local cluster with a ``tectonic maintenance`` process (maintenance_helpers),
and the layers' functions on a real SQLite shard for the ownership rules.
"""

from __future__ import annotations

import os
import random
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio
from maintenance_helpers import (
    CHUNK,
    EC,
    block_health,
    data_of,
    make_cluster,
    node_index,
    open_fresh_client,
    open_inspector,
    put,
    read,
    total_used,
    wait_for,
)

from chunkstore.layout import file_size_for
from metadata import block_layer, file_layer, maintenance_ops
from metadata.shard import SCHEMA
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import InvalidArgument
from tectonic_py.core.ids import chunk_id
from tectonic_py.core.records import BlockInfo, ChunkPlacement
from tectonic_py.maintenance.runtime import Maintenance

ROOT = Path(__file__).resolve().parents[1]
POLICY = ECPolicy.parse(EC)  # rs-4-2: a block is 4 data chunks of CHUNK bytes + 2 parity
BLOCK = POLICY.k * CHUNK
WRITES = 12
PAGE = 4096
# For the tests that count chunk files and bytes: a put hedged to a spare store (a loaded
# machine) leaves a second copy of its chunk, which the chunk sweep collects after the hour
# of ``grace``, not the superseded GC; a hedge delay no put reaches here keeps them out.
NO_HEDGE = {"write_hedge_s": 600.0}
# A client that stores every change as a new version of its block (no packs, no patches).
VERSIONS = {"pack_limit": 0.0}


async def _chunk_files(m: Maintenance) -> dict[str, int]:
    """Every chunk file on the up stores: (node, chunk id) -> size."""
    out: dict[str, int] = {}
    for node in (await m.nodes()).values():
        if node.state != "up":
            continue
        after: str | None = ""
        while after is not None:
            r = await m.node_call(node, "list", after=after, limit=1000)
            out.update((f"{node.node_id}/{c}", size) for c, size in r["chunks"])
            after = r["next"]
    return out


async def _placed(m: Maintenance, client_blocks: list[BlockInfo]) -> set[str]:
    """The chunk files a file's blocks and the packs of their patches place."""
    blocks = [*client_blocks, *(p.source for b in client_blocks for p in b.patches)]
    return {
        f"{c.node_id}/{chunk_id(c.storage_block(b.block_id), c.index)}"
        for b in blocks
        for c in b.chunks
    }


async def _small_writes(client, path: str, model: bytearray, rng: random.Random) -> None:  # type: ignore[no-untyped-def]
    for _ in range(WRITES):
        offset = rng.randrange(0, len(model) - PAGE)
        page = rng.randbytes(PAGE)
        attrs = await client.stat(path)
        w = await client.open_writer(attrs.id)
        await w.pwrite(page, offset)
        await w.close()
        model[offset : offset + PAGE] = page


async def test_small_pwrites_cost_one_data_chunk_and_parity(tmp_path):
    """The version path (patches off). Before: each write stored the whole block (n chunks)
    again, and the old one stayed for the hour of the GC grace. After: 1 + m chunks per
    write (a page inside one chunk), the adopted chunks are the old version's files, and the
    data reads back right."""
    cluster = make_cluster(tmp_path / "c", maintenance=False)
    try:
        cluster.start()
        rng = random.Random(23)
        model = bytearray(data_of(4 * BLOCK, seed=3))
        async with (
            open_fresh_client(cluster, **NO_HEDGE, **VERSIONS) as client,
            open_inspector(cluster) as m,
        ):
            await put(client, "/f", bytes(model))
            before = await total_used(m)
            # Pages that straddle no chunk boundary: each touches exactly one data chunk.
            for _ in range(WRITES):
                chunk = rng.randrange(0, len(model) // CHUNK)
                offset = chunk * CHUNK + rng.randrange(0, CHUNK - PAGE)
                page = rng.randbytes(PAGE)
                w = await client.open_writer((await client.stat("/f")).id)
                await w.pwrite(page, offset)
                await w.close()
                model[offset : offset + PAGE] = page
            added = await total_used(m) - before
            files = await _chunk_files(m)
            per_chunk = file_size_for(CHUNK)  # a full chunk's file (header and CRC table too)
            assert added == WRITES * (1 + POLICY.m) * per_chunk, (added, per_chunk)
            assert added < WRITES * POLICY.n * per_chunk
            assert client.statistics().adopted_chunks == WRITES * (POLICY.k - 1)
            assert await read(client, "/f") == bytes(model)
            blocks = await client.meta.block_list((await client.stat("/f")).id)
            assert any(c.stored_as for b in blocks for c in b.chunks)
            assert await _placed(m, blocks) <= set(files)
        async with open_fresh_client(cluster) as other:
            assert await read(other, "/f") == bytes(model)
    finally:
        cluster.stop()


async def test_superseded_versions_come_back_soon_and_open_readers_keep_reading(tmp_path):
    """The old versions' own chunks are collected after ``superseded_grace`` (1 s here; the
    general grace stays an hour), the adopted ones stay, nothing the file places is lost,
    and a reader opened before the writes reads the current bytes after its blocks' chunks
    were collected. (A patch leaves the block as it is: a reader opened before it reads
    the block's old bytes until it opens the file again, as NFS's close-to-open.)"""
    cluster = make_cluster(
        tmp_path / "c", maintenance_args=["--grace", "3600", "--superseded-grace", "1"]
    )
    try:
        cluster.start()
        rng = random.Random(5)
        model = bytearray(data_of(3 * BLOCK + 5000, seed=4))
        async with (
            open_fresh_client(cluster, **NO_HEDGE, **VERSIONS) as client,
            open_inspector(cluster) as m,
        ):
            await put(client, "/f", bytes(model))
            file_id = (await client.stat("/f")).id

            async def placed_bytes():  # type: ignore[no-untyped-def]
                files = await _chunk_files(m)
                placed = await _placed(m, await client.meta.block_list(file_id))
                return sum(files[f] for f in placed) if placed <= set(files) else None

            # Of the files the block list places, not every store's total: a rebalance move
            # in flight holds two copies of a chunk for a moment.
            baseline = await wait_for("the file's chunks to land", placed_bytes)
            early = await client.open_read("/f")
            assert await early.pread(0, 100) == bytes(model[:100])
            await _small_writes(client, "/f", model, rng)
            assert (await client.stat("/f")).id == file_id

            differs: dict[str, object] = {}

            async def reclaimed():  # type: ignore[no-untyped-def]
                files = await _chunk_files(m)
                placed = await _placed(m, await client.meta.block_list(file_id))
                differs["extra"], differs["missing"] = set(files) - placed, placed - set(files)
                return files if set(files) == placed else None

            try:
                files = await wait_for("the superseded versions' chunks to be collected", reclaimed)
            except AssertionError as e:
                raise AssertionError(f"{e}; chunk files not placed / placed but absent: {differs}")
            assert sum(files.values()) == baseline  # same shape: same bytes as before
            assert len(files) == 4 * POLICY.n  # 3 full blocks and a short one, nothing else
            async with open_fresh_client(cluster) as other:
                assert await read(other, "/f") == bytes(model)
            # The early reader's block list names versions whose chunks are gone now.
            missed = len(client.statistics().bad_chunks)
            assert await early.pread(0, len(model)) == bytes(model)
            assert len(client.statistics().bad_chunks) > missed  # it did find them gone
            offset = rng.randrange(0, len(model) - PAGE)
            assert await early.pread(offset, PAGE) == bytes(model[offset : offset + PAGE])
            await early.aclose()
    finally:
        cluster.stop()


async def test_repair_rebuilds_a_version_from_its_adopted_chunks(tmp_path):
    """A store holding an adopted chunk dies: repair reads the version's chunks, adopted ones
    from the old version's files, rebuilds what the store held, and m more stores can go."""
    cluster = make_cluster(
        tmp_path / "c", maintenance_args=["--no-rebalance", "--superseded-grace", "1"]
    )
    try:
        cluster.start()
        model = bytearray(data_of(BLOCK, seed=6))
        async with open_fresh_client(cluster, **VERSIONS) as client:
            await put(client, "/f", bytes(model))
            w = await client.open_writer((await client.stat("/f")).id)
            await w.pwrite(b"x" * PAGE, 100)  # data chunk 0: chunks 1..3 are adopted
            await w.close()
            model[100 : 100 + PAGE] = b"x" * PAGE
            (info,) = await client.meta.block_list((await client.stat("/f")).id)
        adopted = [c for c in info.chunks if c.stored_as]
        assert [c.index for c in adopted] == [1, 2, 3]
        victim = node_index(adopted[0].node_id)
        async with open_inspector(cluster) as m:
            cluster.kill_chunkstore(victim)

            async def repaired():  # type: ignore[no-untyped-def]
                s = await block_health(m)
                return s if adopted[0].node_id in s["nodes_down"] and s["degraded"] == 0 else None

            await wait_for("repair of the new version", repaired)
        for c in info.chunks:
            if c.index in (0, 4):  # two more of the version's stores: m = 2 in all
                cluster.kill_chunkstore(node_index(c.node_id))
        async with open_fresh_client(cluster) as client:
            assert await read(client, "/f") == bytes(model)
    finally:
        cluster.stop()


UPDATER = textwrap.dedent(
    """
    import random, sys, trio
    import tectonic_py.client.tectonic_client as c

    async def main(cluster_file):
        rng = random.Random(int(sys.argv[2]))
        async with c.open_client(cluster_file) as client:
            file_id = (await client.stat("/f")).id
            for j in range(1_000_000):  # until killed
                w = await client.open_writer(file_id)
                await w.pwrite(rng.randbytes(PAGE), rng.randrange(0, SIZE - PAGE))
                await w.close()
                print("DONE", j, flush=True)

    trio.run(main, sys.argv[1])
    """
)


def _model_after(model: bytes, seed: int, updates: int) -> bytes:
    rng = random.Random(seed)
    out = bytearray(model)
    for _ in range(updates):
        page = rng.randbytes(PAGE)
        offset = rng.randrange(0, len(out) - PAGE)
        out[offset : offset + PAGE] = page
    return bytes(out)


async def test_a_writer_killed_mid_update_leaves_one_version_whole(tmp_path):
    """kill -9 of a process doing in-place updates (patches) in a loop: the file is the state
    after the last update it reported, or after the one it was making (one transaction lays
    a patch, or commits a version and retires the old one), and stays so after the GC
    collected what the dead writer left (its uncommitted chunks, its covered patches)."""
    cluster = make_cluster(
        tmp_path / "c",
        maintenance_args=["--superseded-grace", "1", "--grace", "5", "--lease-grace", "5"],
    )
    try:
        cluster.start()
        model = data_of(2 * BLOCK, seed=9)
        async with open_fresh_client(cluster) as client:
            await put(client, "/f", model)
        seed = 17
        script = UPDATER.replace("PAGE", str(PAGE)).replace("SIZE", str(len(model)))
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
        )
        log = open(tmp_path / "updater.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-c", script, str(cluster.cluster_file), str(seed)],
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
        )
        done = -1
        try:
            assert proc.stdout is not None
            while done < 5:
                line = proc.stdout.readline().decode()
                assert line.startswith("DONE"), (tmp_path / "updater.log").read_text()[-3000:]
                done = int(line.split()[1])
            await trio.sleep(random.Random(seed).uniform(0.0, 0.3))
        finally:
            proc.kill()
            proc.wait()
            log.close()
        assert proc.stdout is not None
        with proc.stdout:
            late = [int(x.split()[1]) for x in proc.stdout.read().decode().splitlines() if x]
        done = max([done, *late])
        allowed = {_model_after(model, seed, done + 1), _model_after(model, seed, done + 2)}
        async with open_fresh_client(cluster) as client, open_inspector(cluster) as m:
            assert await read(client, "/f") in allowed
            file_id = (await client.stat("/f")).id

            async def settled():  # type: ignore[no-untyped-def]
                files = await _chunk_files(m)
                placed = await _placed(m, await client.meta.block_list(file_id))
                return set(files) == placed

            await wait_for("the dead writer's leftovers to be collected", settled)
        async with open_fresh_client(cluster) as other:
            assert await read(other, "/f") in allowed
    finally:
        cluster.stop()


@pytest.mark.fuse
def test_small_writes_through_the_mount(mount) -> None:  # type: ignore[no-untyped-def]
    """The issue's reproduction, smaller: open r+, a 4 KiB pwrite at a random offset, close,
    on a file of two blocks (RS(6,3), 1 MiB chunks). Before: n = 9 chunk files per write
    (issue 23: 1 + m); now a patch, n chunks of a sixth of the page each: at most the 64 KiB
    per write that issue 33 asks for."""
    from fuse_fixtures import FUSE_CHUNK_SIZE

    from bench.bench_inplace import chunk_bytes

    policy = ECPolicy.parse("rs-6-3")
    rng = random.Random(11)
    model = bytearray(rng.randbytes(2 * policy.k * FUSE_CHUNK_SIZE))
    path = mount / "data.h5"
    path.write_bytes(model)
    before = chunk_bytes(mount.cluster.root)
    writes = 8
    for _ in range(writes):
        offset = rng.randrange(0, len(model) - PAGE)
        page = rng.randbytes(PAGE)
        fd = os.open(path, os.O_RDWR)
        try:
            assert os.pwrite(fd, page, offset) == PAGE
        finally:
            os.close(fd)
        model[offset : offset + PAGE] = page
    added = chunk_bytes(mount.cluster.root) - before
    assert added <= writes * 64 * 1024, added
    assert path.read_bytes() == model


# --- the Block layer's ownership rules, on a real shard database ---------------------------


@pytest.fixture
def conn():  # type: ignore[no-untyped-def]
    c = sqlite3.connect(":memory:", isolation_level=None)
    c.executescript(SCHEMA)
    yield c
    c.close()


def _block(conn: sqlite3.Connection, file_id: int, adopt: dict[int, tuple[int, int]]) -> BlockInfo:
    """Commit a block of ``file_id`` at index 0 whose chunk i is on node ``n<i>``; ``adopt``:
    index -> (stored_as, checksum) of chunks taken from an earlier version."""
    nodes = [f"n{i}" for i in range(POLICY.n)]
    bid = block_layer.allocate(conn, 0, 1, file_id, EC, nodes, 1)
    chunks = [
        ChunkPlacement(i, nodes[i], adopt[i][1], stored_as=adopt[i][0])
        if i in adopt
        else ChunkPlacement(i, nodes[i], 1000 + i)
        for i in range(POLICY.n)
    ]
    info = BlockInfo(bid, EC, CHUNK, BLOCK, chunks, 0)
    block_layer.commit(conn, info, file_id)
    return block_layer.locate(conn, [bid])[0]


def test_adopted_chunks_live_while_any_version_places_them(conn):
    v1 = _block(conn, 7, {})
    v2 = _block(conn, 7, {i: (v1.block_id, 1000 + i) for i in (1, 2, 3)})
    v3 = _block(conn, 7, {i: (v1.block_id, 1000 + i) for i in (2, 3)})
    assert [c.stored_as for c in v3.chunks] == [0, 0, v1.block_id, v1.block_id, 0, 0]
    v1_files = [(v1.block_id, i) for i in range(POLICY.n)]
    dead = maintenance_ops.dead_chunks
    # v1 and v2 forgotten (the GC queue): only the files v3 still places stay needed.
    assert maintenance_ops.forget_block(conn, v1.block_id, "committed", None, None) is not None
    assert maintenance_ops.forget_block(conn, v2.block_id, "committed", None, None) is not None
    for i in range(POLICY.n):
        assert (dead(conn, f"n{i}", [v1_files[i]]) == []) == (i in (2, 3)), i
        assert dead(conn, f"n{i}", [(v2.block_id, i)]) == [(v2.block_id, i)]
    # The same file on another node is not what v3 places: dead there.
    assert dead(conn, "n9", [v1_files[2]]) == [v1_files[2]]
    assert maintenance_ops.grantable(conn, "delete", [("n2", v1.block_id, 2)]) == [False]
    # A repair that rewrites chunk 2 under v3's own id ends the adoption of v1's file.
    block_layer.repoint_chunk(conn, v3.block_id, 2, "n2", "n8", 1002)
    assert dead(conn, "n2", [v1_files[2]]) == [v1_files[2]]
    assert dead(conn, "n8", [(v3.block_id, 2)]) == []
    assert maintenance_ops.forget_block(conn, v3.block_id, "committed", None, None) is not None
    assert dead(conn, "n3", [v1_files[3]]) == [v1_files[3]]
    assert conn.execute("SELECT count(*) FROM chunk_origins").fetchone()[0] == 0


def test_forget_names_the_files_placed_when_it_ran(conn):
    """The GC deletes what ``forget_block`` says the block placed, read in its transaction:
    a chunk rebalance or repair pointed elsewhere after the GC located the block (a copy it
    would otherwise leave on the new node for the chunk sweep's hour) is among them, and an
    adopted chunk is named by the file it is stored as."""
    v1 = _block(conn, 7, {})
    v2 = _block(conn, 7, {1: (v1.block_id, 1001)})
    block_layer.repoint_chunk(conn, v2.block_id, 5, "n5", "n9", 1005)
    placed = maintenance_ops.forget_block(conn, v2.block_id, "committed", None, None)
    assert placed is not None
    assert ("n9", v2.block_id, 5) in placed and ("n5", v2.block_id, 5) not in placed
    assert ("n1", v1.block_id, 1) in placed and ("n1", v2.block_id, 1) not in placed
    assert len(placed) == POLICY.n
    assert maintenance_ops.forget_block(conn, v2.block_id, "committed", None, None) is None


def test_a_block_adopts_only_what_its_file_places(conn):
    v1 = _block(conn, 7, {})
    for bad in (
        {1: (v1.block_id, 999)},  # another checksum
        {1: (v1.block_id + 1, 1001)},  # no such block
    ):
        with pytest.raises(InvalidArgument):
            _block(conn, 7, bad)
    with pytest.raises(InvalidArgument, match="no committed block of file 8"):
        _block(conn, 8, {1: (v1.block_id, 1001)})  # another file's chunk
    # A chunk repair or rebalance moved after the writer located it is taken where it is.
    block_layer.repoint_chunk(conn, v1.block_id, 1, "n1", "n9", 1001)
    v2 = _block(conn, 7, {1: (v1.block_id, 1001)})  # the writer still says n1
    assert (v2.chunks[1].node_id, v2.chunks[1].stored_as) == ("n9", v1.block_id)
    assert maintenance_ops.dead_chunks(conn, "n9", [(v1.block_id, 1)]) == []
    # And so is one its own last commit placed (the writer's record of it is older).
    block_layer.repoint_chunk(conn, v1.block_id, 1, "n9", "n8", 1001)
    v3 = _block(conn, 7, {1: (v1.block_id, 1001)})
    assert v3.chunks[1].node_id in ("n8", "n9")  # v1's file is on both now (v2: n9)
    # The refused commits left nothing behind them in the shard's tables (v2, v3: one each).
    assert conn.execute("SELECT count(*) FROM chunk_origins").fetchone()[0] == 2


def test_a_replaced_block_is_queued_as_superseded_a_deleted_one_is_not(conn):
    now = 10**18
    attrs, token = file_layer.create(
        conn, 0, 1, {"kind": "file", "mode": 0o644, "uid": 0, "gid": 0, "ec": EC,
                     "chunk_size": CHUNK}, now, 10**12
    )  # fmt: skip
    v1 = _block(conn, attrs.id, {})
    file_layer.commit_blocks(conn, attrs.id, token, [(0, v1.block_id)], now)
    v2 = _block(conn, attrs.id, {1: (v1.block_id, 1001)})
    file_layer.commit_blocks(conn, attrs.id, token, [(0, v2.block_id)], now)
    queue = maintenance_ops.gc_queue
    assert queue(conn, now, 10) == []  # the general grace has not passed
    assert queue(conn, now, 10, superseded_before_ns=now + 1) == [(v1.block_id, now)]
    maintenance_ops.gc_ack(conn, [v1.block_id])
    file_layer.set_size(conn, attrs.id, token, 0, now)  # truncated away: the long grace
    assert queue(conn, now, 10, superseded_before_ns=now + 1) == []
    assert queue(conn, now + 1, 10) == [(v2.block_id, now)]
