"""Small files share pack blocks (issue 33): a burst of small files is coded and stored as a
few packs, each file an extent of one; every file reads back, also with m chunk stores lost
and after a chunk store is killed mid-burst; a pack lives while any of its extents does (its
neighbours deleted and collected, the last one still read) and goes with the last; the File
layer's commit of a pack isolates each file's error, is idempotent when resent, and queues
a pack for the GC only when no extent is left. A hypothesis model runs random sequences of
create/write/overwrite/truncate/fsync/unlink/close against an in-memory model and reads
every file back, before and after a GC round.

Real processes: local clusters with ``tectonic maintenance`` (maintenance_helpers); the
layers' functions on a real SQLite shard for the transaction rules.
"""

from __future__ import annotations

import itertools
import random
import sqlite3
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from maintenance_helpers import (
    CHUNK,
    EC,
    data_of,
    make_cluster,
    open_fresh_client,
    open_inspector,
    read,
    total_used,
    wait_for,
)

from metadata import block_layer, file_layer, maintenance_ops, write_ops
from metadata.shard import SCHEMA
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import (
    FileNotFound,
    InvalidArgument,
    Refused,
    StaleWriterToken,
    WrongShard,
)
from tectonic_py.core.ids import shard_of
from tectonic_py.core.records import BlockInfo, ChunkPlacement, PackedExtent

POLICY = ECPolicy.parse(EC)
BLOCK = POLICY.k * CHUNK  # 64 KiB: files up to half of it are packed
GC_FAST = ["--grace", "1", "--lease-grace", "0.5", "--no-rebalance"]


async def _write_all(client: Any, files: dict[str, bytes], *, fsync: bool = False) -> None:
    async def one(path: str, data: bytes) -> None:
        w = await client.create(path, ec=EC)
        await w.write(data)
        if fsync:
            await w.fsync()
        await w.close()

    async with trio.open_nursery() as nursery:
        for path, data in files.items():
            nursery.start_soon(one, path, data)


async def _committed_blocks(m: Any) -> dict[int, dict[str, Any]]:
    out = {}
    for shard in range(m.config.shards):
        async for rec in m.scan_blocks(shard):
            if rec["state"] == "committed":
                out[rec["block_id"]] = rec
    return out


async def test_a_burst_of_small_files_is_a_few_packs_and_reads_back(tmp_path):
    cluster = make_cluster(tmp_path / "c", maintenance=False)
    rng = random.Random(33)
    try:
        cluster.start()
        async with open_fresh_client(cluster) as client, open_inspector(cluster) as m:
            before = await _committed_blocks(m)
            await client.mkdir("/step_1")
            files = {
                f"/step_1/rank_{i}.pt": data_of(rng.randrange(1, BLOCK // 8), seed=i)
                for i in range(60)
            }
            await _write_all(client, files, fsync=True)
            packs = {b: rec for b, rec in (await _committed_blocks(m)).items() if b not in before}
            # 60 files of up to an eighth of a block each fit in far fewer blocks than files.
            assert 0 < len(packs) <= 60 // 3, len(packs)
            assert all(rec["file_id"] == block_layer.PACK_OWNER for rec in packs.values())
            assert client.packer.files_packed >= 60
            for path, data in files.items():
                assert await read(client, path) == data
                attrs = await client.stat(path)
                (block,) = await client.meta.block_list(attrs.id)
                assert block.packed and block.file_len == len(data)
                assert block.block_id in packs
                assert block.ext_off + block.ext_len <= block.data_len
            # m chunk stores lost: every file still reads, rebuilt from the others.
            cluster.stop_chunkstore(0)
            cluster.stop_chunkstore(1)
        async with open_fresh_client(cluster, read_hedge_s=0.5) as client:
            for path, data in rng.sample(sorted(files.items()), 20):
                assert await read(client, path) == data
    finally:
        cluster.stop()


async def test_a_chunk_store_killed_while_packs_are_stored(tmp_path):
    cluster = make_cluster(tmp_path / "c", maintenance=False)
    try:
        cluster.start()
        async with open_fresh_client(cluster, write_hedge_s=1.0) as client:
            await client.mkdir("/step")
            files = {f"/step/r{i}": data_of(3000 + 211 * i, seed=100 + i) for i in range(80)}

            async def kill_soon() -> None:
                await trio.sleep(0.05)
                cluster.kill_chunkstore(3)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(kill_soon)
                await _write_all(client, files)
            for path, data in files.items():
                assert await read(client, path) == data
    finally:
        cluster.stop()


async def test_a_pack_lives_while_any_extent_does(tmp_path):
    # Compaction off: it would move the last extent out of its mostly dead pack
    # (tests/test_compaction.py), where this test checks the GC alone keeps the pack.
    cluster = make_cluster(tmp_path / "c", maintenance_args=[*GC_FAST, "--compact-below", "0"])
    try:
        cluster.start()
        async with open_fresh_client(cluster) as client, open_inspector(cluster) as m:
            baseline = await total_used(m)
            await client.mkdir("/step_7")
            files = {f"/step_7/r{i}": data_of(2000 + 500 * i, seed=i) for i in range(12)}
            await _write_all(client, files)
            ids = {p: await client.stat(p) for p in files}
            packs = {(await client.meta.block_list(a.id))[0].block_id for a in ids.values()}
            last = "/step_7/r11"
            (kept,) = [b.block_id for b in await client.meta.block_list(ids[last].id)]
            reader = await client.open_reader(ids[last].id)
            for path in files:
                if path != last:
                    await client.unlink(path)

            # GC rounds run (grace 1 s): the packs of deleted files only go once empty, and
            # the last file's pack stays, read through the reader opened before.
            async def others_gone() -> bool:
                live = await _committed_blocks(m)
                return all(b not in live for b in packs - {kept})

            await wait_for("packs of the deleted files to go", others_gone)
            await trio.sleep(3)
            assert kept in await _committed_blocks(m)
            assert await reader.pread(0, 1 << 20) == files[last]
            assert await read(client, last) == files[last]
            await reader.aclose()
            await client.unlink(last)
            await client.rmdir("/step_7")

            async def back() -> bool:
                return await total_used(m) == baseline

            await wait_for("the packs' space to come back", back)
            assert kept not in await _committed_blocks(m)
    finally:
        cluster.stop()


# --- the transaction rules, on a real SQLite shard -------------------------------------------

TOTAL = 4


def _shard() -> sqlite3.Connection:
    conn = sqlite3.connect(":memory:", isolation_level=None)
    conn.executescript(SCHEMA)
    return conn


def _file(conn: sqlite3.Connection, shard: int) -> tuple[int, int]:
    spec = {"kind": "file", "mode": 0o644, "uid": 0, "gid": 0, "parent": 1, "name": "f",
            "ec": EC, "chunk_size": CHUNK}  # fmt: skip
    attrs, token = file_layer.create(conn, shard, TOTAL, spec, 1, 10**12)
    file_layer.link(conn, attrs.id, 1, f"f{attrs.id}")
    return attrs.id, token


def _pack(conn: sqlite3.Connection, shard: int, data_len: int) -> BlockInfo:
    nodes = [f"cs{i}" for i in range(POLICY.n)]
    bid = block_layer.allocate(conn, shard, TOTAL, block_layer.PACK_OWNER, EC, nodes, 1)
    cl = -(-data_len // POLICY.k)
    chunks = [ChunkPlacement(i, nodes[i], 7) for i in range(POLICY.n)]
    return BlockInfo(bid, EC, cl, data_len, chunks)


def _commit(conn: sqlite3.Connection, shard: int, info: BlockInfo, files: list[PackedExtent]):
    conn.execute("BEGIN")
    out = write_ops.commit_pack(conn, shard, TOTAL, info, files, 2)
    conn.execute("COMMIT")
    return out


def _gc_queue(conn: sqlite3.Connection) -> set[int]:
    return {r[0] for r in conn.execute("SELECT block_id FROM gc_blocks")}


def test_commit_pack_isolates_each_files_error_and_repeats_safely():
    conn, shard = _shard(), 1
    (a, ta), (b, tb), (c, tc) = (_file(conn, shard) for _ in range(3))
    info = _pack(conn, shard, 30_000)
    other = next(i for i in range(1, 10**6) if shard_of(i, TOTAL) != shard)
    absent = next(i for i in range(1, 10**6) if shard_of(i, TOTAL) == shard and i not in (a, b, c))
    files = [
        PackedExtent(a, ta, 0, 0, 10_000, 10_000, True),
        PackedExtent(b, tb + 1, 0, 10_000, 10_000, 10_000, True),  # a fenced writer
        PackedExtent(c, tc, 0, 20_000, 10_000, 10_000, False),  # an fsync: no seal
        PackedExtent(other, 5, 0, 0, 100, 100, True),  # not in this shard
        PackedExtent(absent, 5, 0, 0, 100, 100, True),  # no such file
        PackedExtent(a, ta, 0, 25_000, 10_000, 40_000, True),  # past the pack's end
    ]
    out = _commit(conn, shard, info, files)
    assert out[0].sealed and out[0].size == 10_000
    assert isinstance(out[1], StaleWriterToken)
    assert not out[2].sealed and out[2].size == 10_000
    assert isinstance(out[3], WrongShard)
    assert isinstance(out[4], FileNotFound)
    assert isinstance(out[5], InvalidArgument)
    assert file_layer.blocks(conn, a) == [(0, info.block_id, 0, 10_000)]
    assert file_layer.blocks(conn, b) == []  # the fenced writer's extent is not there
    # Resent after a lost reply: the seal is found done, the rest answer as before.
    again = _commit(conn, shard, info, files[:3])
    assert again[0].sealed and isinstance(again[1], StaleWriterToken)
    assert _gc_queue(conn) == set()


def test_a_pack_is_queued_for_gc_with_its_last_extent():
    conn, shard = _shard(), 2
    (a, ta), (b, tb) = _file(conn, shard), _file(conn, shard)
    info = _pack(conn, shard, 8_000)
    _commit(conn, shard, info, [PackedExtent(a, ta, 0, 0, 4_000, 4_000, True),
                                PackedExtent(b, tb, 0, 4_000, 4_000, 4_000, True)])  # fmt: skip
    assert maintenance_ops.referenced(conn, [(block_layer.PACK_OWNER, 0, info.block_id)]) == [True]
    conn.execute("BEGIN")
    file_layer.unlink(conn, a, 3)
    conn.execute("COMMIT")
    assert _gc_queue(conn) == set()  # b still holds it
    # A forget of a pack some extent still holds (a stale queue entry) is refused.
    with pytest.raises(Refused):
        maintenance_ops.forget_block(conn, info.block_id, "committed", None, None)
    conn.execute("BEGIN")
    file_layer.unlink(conn, b, 4)
    conn.execute("COMMIT")
    assert _gc_queue(conn) == {info.block_id}
    assert maintenance_ops.referenced(conn, [(block_layer.PACK_OWNER, 0, info.block_id)]) == [False]
    assert maintenance_ops.forget_block(conn, info.block_id, "committed", None, None)


def test_a_pack_no_file_took_is_queued_at_once():
    conn, shard = _shard(), 3
    a, ta = _file(conn, shard)
    info = _pack(conn, shard, 1_000)
    (out,) = _commit(conn, shard, info, [PackedExtent(a, ta + 1, 0, 0, 1_000, 1_000, True)])
    assert isinstance(out, StaleWriterToken)
    assert _gc_queue(conn) == {info.block_id}


@pytest.mark.parametrize(
    "item",
    [
        "not a map",
        {"id": 1, "token": 1, "index": 0, "offset": 0, "length": 1},  # no size
        {"id": 1, "token": 1, "index": 0, "offset": 0, "length": 0, "size": 0},
        {"id": 1, "token": 0, "index": 0, "offset": 0, "length": 1, "size": 1},
        {"id": 1, "token": 1, "index": -1, "offset": 0, "length": 1, "size": 1},
        {"id": 1, "token": 1, "index": 0, "offset": -5, "length": 1, "size": 1},
        {"id": 1, "token": 1, "index": 0, "offset": 0, "length": 1, "size": 1, "seal": 1},
        {"id": "1", "token": 1, "index": 0, "offset": 0, "length": 1, "size": 1},
    ],
)
def test_malformed_pack_files_are_refused(item):
    with pytest.raises(InvalidArgument):
        write_ops.packed_from_wire(item)


# --- a model of many files, some packed, some not --------------------------------------------

OPS = st.lists(
    st.tuples(
        st.sampled_from(["write", "pwrite", "truncate", "fsync", "close", "unlink"]),
        st.integers(0, 3),  # which file
        st.integers(0, 3 * BLOCK),  # offset or size
        st.integers(1, BLOCK // 2),  # length
    ),
    min_size=1,
    max_size=14,
)


@pytest.fixture(scope="module")
def model_cluster(tmp_path_factory):
    cluster = make_cluster(tmp_path_factory.mktemp("pack-model") / "c", maintenance_args=GC_FAST)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(ops=OPS, seed=st.integers(0, 2**16))
def test_random_writes_match_a_model(model_cluster, ops, seed):
    trio.run(_model_run, model_cluster, ops, seed)


_RUNS = itertools.count()


async def _model_run(cluster: Any, ops: list[tuple[str, int, int, int]], seed: int) -> None:
    rng = random.Random(seed)
    root = f"/model_{next(_RUNS)}"  # hypothesis may replay an example on the same cluster
    async with open_fresh_client(cluster) as client:
        await client.mkdir(root)
        model: dict[int, bytearray] = {}
        writers: dict[int, Any] = {}

        async def writer(i: int) -> Any:
            if i not in writers:
                path = f"{root}/f{i}"
                if i in model:
                    writers[i] = await client.open_writer((await client.stat(path)).id)
                else:
                    writers[i] = await client.create(path, ec=EC)
                    model[i] = bytearray()
            return writers[i]

        for op, i, at, n in ops:
            data = rng.randbytes(n)
            if op == "unlink":
                if i in model:
                    if i in writers:
                        await writers.pop(i).close()
                    await client.unlink(f"{root}/f{i}")
                    del model[i]
                continue
            w = await writer(i)
            body = model[i]
            if op == "write":
                await w.write(data)
                body += data
            elif op == "pwrite":
                await w.pwrite(data, at)
                if at > len(body):
                    body += bytes(at - len(body))
                body[at : at + n] = data
            elif op == "truncate":
                await w.truncate(at)
                del body[at:]
                body += bytes(at - len(body))
            elif op == "fsync":
                await w.fsync()
            else:
                await writers.pop(i).close()
        for w in writers.values():
            await w.close()
        for i, body in model.items():
            assert await read(client, f"{root}/f{i}") == bytes(body), i
        await trio.sleep(1.5)  # a GC round (grace 1 s) frees nothing a file still holds
        for i, body in model.items():
            assert await read(client, f"{root}/f{i}") == bytes(body), i
