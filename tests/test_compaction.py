"""Pack compaction (issue 33): a pack whose files were mostly deleted one by one is rewritten
by the maintenance daemon into a new pack holding only its live extents; the moved files read
back bit-exact (also through a reader opened before the move), the old pack's space comes
back, and a file changed between the scan and the move keeps its new data. The move's
transaction rules on a real SQLite shard: only extents that still name the old pack move, a
repeat moves nothing more, the old pack is queued with its last extent, a foreign file or an
extent outside the new pack is refused; ``block.pack_usage`` reports only mostly-dead packs.
"""

from __future__ import annotations

import random
import sqlite3

import pytest
from maintenance_helpers import (
    data_of,
    make_cluster,
    open_fresh_client,
    open_inspector,
    read,
    total_used,
    wait_for,
)
from test_packing import TOTAL, _commit, _file, _gc_queue, _pack, _shard, _write_all

from metadata import compaction_ops, file_layer
from tectonic_py.core.errors import InvalidArgument, WrongShard
from tectonic_py.core.ids import shard_of
from tectonic_py.core.records import PackedExtent

COMPACT = ["--grace", "1", "--lease-grace", "0.5", "--no-rebalance", "--compact-below", "0.5"]


async def _block_of(client, path: str) -> int:
    attrs = await client.stat(path)
    (block,) = await client.meta.block_list(attrs.id)
    assert block.packed
    return block.block_id


async def test_a_mostly_dead_pack_is_rewritten_and_its_space_comes_back(tmp_path):
    cluster = make_cluster(tmp_path / "c", maintenance_args=COMPACT)
    rng = random.Random(7)
    try:
        cluster.start()
        async with open_fresh_client(cluster) as client, open_inspector(cluster) as m:
            await client.mkdir("/logs")
            files = {f"/logs/r{i}": data_of(1500 + rng.randrange(3000), seed=i) for i in range(16)}
            await _write_all(client, files)
            by_pack: dict[int, list[str]] = {}
            pack_len: dict[int, int] = {}
            for path in files:
                attrs = await client.stat(path)
                (block,) = await client.meta.block_list(attrs.id)
                by_pack.setdefault(block.block_id, []).append(path)
                pack_len[block.block_id] = block.data_len
            # Keep one file of each pack, delete the rest: a pack whose kept file holds at
            # most half its bytes is compacted, the others (a file alone in its pack) stay.
            kept = {paths[0]: files[paths[0]] for paths in by_pack.values()}
            movers = [
                paths[0] for b, paths in by_pack.items() if 2 * len(files[paths[0]]) <= pack_len[b]
            ]
            assert movers, by_pack  # 16 files written at once share packs
            reader_path = movers[0]
            reader = await client.open_read(reader_path)
            for path in files:
                if path not in kept:
                    await client.unlink(path)
            used_before = await total_used(m)

            async def moved() -> bool:
                return all([await _block_of(client, p) not in by_pack for p in movers])

            await wait_for("the kept files to move to new packs", moved, timeout=90)
            for path, data in kept.items():
                assert await read(client, path) == data
            # The reader opened on the old pack still reads (the old pack, or after the
            # GC took it, the new block list).
            assert await reader.read() == kept[reader_path]
            await reader.aclose()

            async def old_packs_gone() -> bool:
                return await total_used(m) < used_before

            await wait_for("the old packs' space to come back", old_packs_gone, timeout=90)
            for path, data in kept.items():
                assert await read(client, path) == data
    finally:
        cluster.stop()


# --- the move's transaction rules, on a real SQLite shard ------------------------------------


def _relocate(conn, shard, new, old, moves):
    conn.execute("BEGIN")
    try:
        out = compaction_ops.relocate_extents(conn, shard, TOTAL, new, old, moves, 5)
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
    return out


def test_only_extents_that_still_name_the_old_pack_move_and_a_repeat_moves_nothing():
    conn, shard = _shard(), 1
    (a, ta), (b, tb), (c, tc) = (_file(conn, shard) for _ in range(3))
    old = _pack(conn, shard, 30_000)
    _commit(conn, shard, old, [PackedExtent(a, ta, 0, 0, 10_000, 10_000, True),
                               PackedExtent(b, tb, 0, 10_000, 10_000, 10_000, True),
                               PackedExtent(c, tc, 0, 20_000, 10_000, 10_000, True)])  # fmt: skip
    conn.execute("BEGIN")
    file_layer.unlink(conn, c, 3)  # c goes: the pack is two thirds live
    conn.execute("COMMIT")
    packs, cursor = compaction_ops.pack_usage(conn, 0, 100, 10**18, 700)
    assert [p["block_id"] for p in packs] == [old.block_id] and cursor == 0
    assert packs[0]["live"] == 20_000
    assert compaction_ops.pack_usage(conn, 0, 100, 10**18, 600)[0] == []  # 2/3 > 0.6
    assert compaction_ops.pack_usage(conn, 0, 100, 1, 700)[0] == []  # too young

    new = _pack(conn, shard, 20_000)
    moves = [(a, 0, 0, 10_000, 0), (b, 0, 10_000, 10_000, 10_000)]
    # b is rewritten meanwhile: its entry names the old pack at another offset now.
    conn.execute("UPDATE file_extents SET offset = 15000, length = 5000 WHERE file_id = ?", (b,))
    assert _relocate(conn, shard, new, old.block_id, moves) == 1
    assert file_layer.blocks(conn, a) == [(0, new.block_id, 0, 10_000)]
    assert file_layer.blocks(conn, b) == [(0, old.block_id, 15_000, 5_000)]
    assert old.block_id not in _gc_queue(conn)  # b still names it
    assert _relocate(conn, shard, new, old.block_id, moves) == 0  # a repeat: nothing more
    conn.execute("BEGIN")
    file_layer.unlink(conn, b, 6)
    conn.execute("COMMIT")
    assert old.block_id in _gc_queue(conn) and new.block_id not in _gc_queue(conn)


def test_a_move_that_takes_nothing_queues_the_new_pack_and_bad_moves_are_refused():
    conn, shard = _shard(), 2
    a, ta = _file(conn, shard)
    old = _pack(conn, shard, 8_000)
    _commit(conn, shard, old, [PackedExtent(a, ta, 0, 0, 4_000, 4_000, True)])
    new = _pack(conn, shard, 4_000)
    assert _relocate(conn, shard, new, old.block_id, [(a, 0, 100, 4_000, 0)]) == 0
    assert new.block_id in _gc_queue(conn) and old.block_id not in _gc_queue(conn)
    other = next(i for i in range(1, 10**6) if shard_of(i, TOTAL) != shard)
    fresh = _pack(conn, shard, 4_000)
    with pytest.raises(WrongShard):
        _relocate(conn, shard, fresh, old.block_id, [(other, 0, 0, 4_000, 0)])
    with pytest.raises(InvalidArgument):
        _relocate(conn, shard, fresh, old.block_id, [(a, 0, 0, 4_000, 1)])  # past its end
    with pytest.raises(InvalidArgument):
        _relocate(conn, shard, old, old.block_id, [])
    assert file_layer.blocks(conn, a) == [(0, old.block_id, 0, 4_000)]


def test_an_empty_pack_is_left_to_the_gc() -> None:
    conn: sqlite3.Connection = _shard()
    shard = 3
    a, ta = _file(conn, shard)
    old = _pack(conn, shard, 1_000)
    _commit(conn, shard, old, [PackedExtent(a, ta, 0, 0, 1_000, 1_000, True)])
    conn.execute("BEGIN")
    file_layer.unlink(conn, a, 3)
    conn.execute("COMMIT")
    assert compaction_ops.pack_usage(conn, 0, 100, 10**18, 1000)[0] == []
