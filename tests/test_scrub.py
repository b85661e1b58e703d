"""Scrub: bytes flipped in chunk files on disk are found by the chunk stores' scrub, repaired
by the maintenance process onto other nodes, and reads stay correct throughout."""

from __future__ import annotations

import sys
from pathlib import Path

import trio
from maintenance_helpers import (
    block_health,
    data_of,
    make_cluster,
    node_index,
    open_fresh_client,
    open_inspector,
    put,
    read,
    wait_for,
)

from chunkstore import layout, writes
from chunkstore.scrub import Scrubber
from tectonic_py.cli import status as status_cli
from tectonic_py.cli.common import EXIT_UNHEALTHY
from tectonic_py.core import cluster_file
from tectonic_py.core.checksum import checksum
from tectonic_py.core.ids import chunk_id

SCRUB = ["--scrub-rate", str(50 * 1024 * 1024), "--scrub-interval", "0.5"]


def _flip(path: Path, offset_from_end: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[-offset_from_end] ^= 0x5A
    path.write_bytes(raw)


def _store(tmp_path: Path, n: int) -> list[str]:
    ids = []
    writes.recover(tmp_path)
    for i in range(n):
        data = bytes([i]) * (3000 + 1000 * i)
        cid = chunk_id(0x1234 + i, 0)
        writes.write_chunk(tmp_path, cid, memoryview(data), checksum(data))
        ids.append(cid)
    return ids


async def test_scrub_pass_finds_flipped_bytes_and_forgets_deleted(tmp_path):
    ids = _store(tmp_path, 4)
    _flip(layout.chunk_path(tmp_path, ids[1]), 10)  # in the data
    _flip(layout.chunk_path(tmp_path, ids[3]), 3500)  # near the header
    s = Scrubber(tmp_path, rate=0, interval=1)
    assert await s.scrub_pass() == 2
    assert set(s.bad) == {ids[1], ids[3]}
    assert s.stats.chunks_checked == 4 and s.stats.passes == 1
    # Found once: a second pass reports the same chunks without counting them again.
    assert await s.scrub_pass() == 0 and set(s.bad) == {ids[1], ids[3]}
    report = s.report()
    assert [c for c, _ in report["bad"]] == sorted([ids[1], ids[3]])  # type: ignore[union-attr]
    # Deleted (repaired elsewhere): gone from the report; a vanished file is no error.
    writes.delete_chunk(tmp_path, ids[1])
    s.forget(ids[1])
    writes.delete_chunk(tmp_path, ids[3])
    assert await s.scrub_pass() == 0 and s.bad == {}


async def test_scrub_is_paced_to_its_rate(tmp_path, autojump_clock):
    _store(tmp_path, 4)
    s = Scrubber(tmp_path, rate=1.0, interval=1)
    # Virtual time only (autojump): the sleeps that pace 4 chunks of ~4-6 KiB at 1 byte/s.
    with trio.move_on_after(100) as scope:
        await s.scrub_pass()
    assert scope.cancelled_caught and s.stats.chunks_checked <= 1


async def test_flipped_bytes_are_scrubbed_and_repaired(tmp_path):
    cluster = make_cluster(
        tmp_path / "c", chunkstores=8, chunkstore_args=SCRUB, maintenance_args=["--no-rebalance"]
    )
    try:
        cluster.start()
        data = data_of(300_000, seed=5)
        async with open_fresh_client(cluster) as client:
            fid = await put(client, "/s", data)
            blocks = await client.meta.block_list(fid)
        victims = [
            (blocks[0].block_id, blocks[0].chunks[1]),
            (blocks[2].block_id, blocks[2].chunks[4]),
        ]
        for block_id, c in victims:
            node = node_index(c.node_id)
            _flip(layout.chunk_path(cluster.chunkstore_dir(node), chunk_id(block_id, c.index)), 7)
        async with open_fresh_client(cluster) as client:
            assert await read(client, "/s") == data  # degraded, still exact
        async with open_inspector(cluster) as m:

            async def repaired():  # type: ignore[no-untyped-def]
                infos = await m.meta.locate_blocks([b for b, _ in victims])
                moved = all(
                    next(c for c in info.chunks if c.index == v.index).node_id != v.node_id
                    for info, (_, v) in zip(infos, victims)
                )
                s = await block_health(m)
                return s if moved and s["degraded"] == 0 and not s["bad_chunks"] else None

            await wait_for("scrub + repair of the flipped chunks", repaired)
        for block_id, c in victims:  # the bad copies are gone from their nodes
            node = node_index(c.node_id)
            assert not layout.chunk_path(
                cluster.chunkstore_dir(node), chunk_id(block_id, c.index)
            ).exists()
        async with open_fresh_client(cluster) as client:
            r = await client.open_read("/s")
            assert await r.read() == data
            assert client.stats.degraded_reads == 0 and client.stats.corrupt_chunks == 0
            await r.aclose()
    finally:
        cluster.stop()


async def test_status_counts_blocks_the_scrub_found_bad(tmp_path):
    # No maintenance: nothing repairs or records the scrub's finds; status asks the stores.
    cluster = make_cluster(tmp_path / "c", chunkstore_args=SCRUB, maintenance=False)
    try:
        cluster.start()
        async with open_fresh_client(cluster) as client:
            fid = await put(client, "/lost", data_of(200_000, seed=9))
            blocks = await client.meta.block_list(fid)
        # m + 1 = 3 chunks of one rs-4-2 block: fewer than k good ones, the block is lost;
        # one chunk of another block: degraded.
        victims = [(blocks[0].block_id, c) for c in blocks[0].chunks[:3]]
        victims.append((blocks[1].block_id, blocks[1].chunks[4]))
        for block_id, c in victims:
            node = node_index(c.node_id)
            _flip(layout.chunk_path(cluster.chunkstore_dir(node), chunk_id(block_id, c.index)), 7)
        config = cluster_file.load(cluster.cluster_file)

        async def seen():  # type: ignore[no-untyped-def]
            st = await status_cli.gather(config)
            got = {b["block_id"]: b for b in st["degraded_blocks"]}
            if set(got) != {blocks[0].block_id, blocks[1].block_id}:
                return None
            # The scrub finds the damaged chunks one by one: wait for all four.
            found = (got[blocks[0].block_id]["live"], got[blocks[1].block_id]["live"])
            return st if found == (3, 5) else None

        st = await wait_for("status to show the scrubbed blocks", seen)
        got = {b["block_id"]: b for b in st["degraded_blocks"]}
        lost, degraded = got[blocks[0].block_id], got[blocks[1].block_id]
        assert (lost["live"], lost["readable"]) == (3, False)
        assert sorted(lost["missing"]) == sorted(c.node_id for _, c in victims[:3])
        assert (degraded["live"], degraded["readable"]) == (5, True)
        assert not status_cli.healthy(st)
        proc = await trio.run_process(
            [sys.executable, "-m", "tectonic_py.cli.main", "status", str(cluster.cluster_file)],
            capture_stdout=True, capture_stderr=True, check=False,
        )  # fmt: skip
        assert proc.returncode == EXIT_UNHEALTHY, proc.stderr
        assert "2 degraded blocks, 1 unreadable" in proc.stdout.decode()
    finally:
        cluster.stop()
