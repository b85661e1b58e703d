"""Inventory: chunks the Block layer places on a store that the store lacks (their file
removed; a delete through the wire leaves the store the same) or holds other bytes for
(another chunk's valid file copied over theirs) are found, shown by ``tectonic status`` and ``repair --status`` (also after the store
restarts), repaired, and read back; blocks committed short are degraded from their commit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

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
from metadata_fixtures import open_meta_cluster, register_nodes

from chunkstore import layout
from tectonic_py.cli import status as status_cli
from tectonic_py.cli.main import build_parser
from tectonic_py.core import cluster_file
from tectonic_py.core.ids import ROOT_ID, chunk_id
from tectonic_py.core.records import BlockInfo, ChunkPlacement
from tectonic_py.launch.local_cluster import LocalCluster
from tectonic_py.maintenance.inventory import Inventory
from tectonic_py.maintenance.repair import Repairer
from tectonic_py.maintenance.runtime import Maintenance, MaintenanceSettings


def _chunk_file(cluster: LocalCluster, block_id: int, c: ChunkPlacement) -> Path:
    return layout.chunk_path(
        cluster.chunkstore_dir(node_index(c.node_id)), chunk_id(block_id, c.index)
    )


async def _status(cluster: LocalCluster) -> dict[str, Any]:
    return await status_cli.gather(cluster_file.load(cluster.cluster_file))


def _degraded(st: dict[str, Any]) -> dict[int, list[str]]:
    return {b["block_id"]: b["missing"] for b in st["degraded_blocks"]}


def _damage(cluster: LocalCluster, blocks: list[BlockInfo]) -> dict[int, ChunkPlacement]:
    """One chunk of each of three blocks: its file removed, another block's chunk file
    copied over it, and a chunk file of its own block copied over it (the same length and a
    valid file: only the checksum the Block layer recorded tells them apart)."""
    gone, foreign, sibling = blocks[0].chunks[1], blocks[1].chunks[2], blocks[2].chunks[0]
    _chunk_file(cluster, blocks[0].block_id, gone).unlink()
    for block, victim, donor_block, donor in (
        (blocks[1], foreign, blocks[3], blocks[3].chunks[2]),
        (blocks[2], sibling, blocks[2], blocks[2].chunks[3]),
    ):
        shutil.copyfile(
            _chunk_file(cluster, donor_block.block_id, donor),
            _chunk_file(cluster, block.block_id, victim),
        )
    return {blocks[0].block_id: gone, blocks[1].block_id: foreign, blocks[2].block_id: sibling}


async def test_missing_and_replaced_chunks_are_found_shown_and_repaired(tmp_path):
    cluster = make_cluster(tmp_path / "c", maintenance=False, maintenance_args=["--no-rebalance"])
    try:
        cluster.start()
        data = data_of(300_000, seed=26)
        async with open_fresh_client(cluster) as client:
            fid = await put(client, "/f", data)
            blocks = await client.meta.block_list(fid)
        async with open_inspector(cluster) as m:
            victims = _damage(cluster, blocks)
            found = {r.node_id: r for r in await Inventory(m).round()}
            assert all(r.error is None for r in found.values())
            for block_id, c in victims.items():
                r = found[c.node_id]
                assert (block_id, c.index) in (r.missing + r.mismatched)
            assert sum(r.recorded for r in found.values()) == 3
            for b in blocks[1:3]:
                replaced = victims[b.block_id]
                assert (b.block_id, replaced.index) in found[replaced.node_id].mismatched

            async def shown() -> dict[str, Any]:
                st = await _status(cluster)
                assert _degraded(st) == {b: [c.node_id] for b, c in victims.items()}
                assert status_cli.healthy(st)  # k good chunks of each: readable
                health = await block_health(m)
                assert health["degraded"] == 3 and health["chunks_to_rebuild"] == 3
                assert health["full_redundancy"] == health["blocks"] - 3
                return st

            await shown()
            # A restart of a store forgets nothing: the record is the Block layer's.
            node = node_index(replaced.node_id)
            cluster.stop_chunkstore(node)
            cluster.start_chunkstore(node)

            async def back_up() -> bool:
                return (await m.nodes())[replaced.node_id].state == "up"

            await wait_for("the restarted store to be up", back_up)
            await shown()

            cluster.start_maintenance()

            async def repaired() -> dict[str, Any] | None:
                health = await block_health(m)
                return health if health["degraded"] == 0 and not health["bad_chunks"] else None

            await wait_for("repair of the missing and replaced chunks", repaired)
        async with open_fresh_client(cluster) as client:
            r = await client.open_read("/f")
            assert await r.read() == data
            assert client.stats.degraded_reads == 0 and client.stats.corrupt_chunks == 0
            await r.aclose()
        st = await _status(cluster)
        assert st["degraded_blocks"] == [] and status_cli.healthy(st)
    finally:
        cluster.stop()


async def test_the_maintenance_service_runs_the_inventory(tmp_path):
    cluster = make_cluster(
        tmp_path / "c", maintenance_args=["--no-rebalance", "--inventory-interval", "0.5"]
    )
    try:
        cluster.start()
        data = data_of(200_000, seed=13)
        async with open_fresh_client(cluster) as client:
            fid = await put(client, "/g", data)
            block = (await client.meta.block_list(fid))[1]
        victim = block.chunks[0]
        _chunk_file(cluster, block.block_id, victim).unlink()
        async with open_inspector(cluster) as m:

            async def rebuilt() -> bool:
                info = (await m.meta.locate_blocks([block.block_id]))[0]
                now = next(c for c in info.chunks if c.index == victim.index)
                health = await block_health(m)
                return (
                    now.node_id != victim.node_id
                    and _chunk_file(cluster, block.block_id, now).exists()
                    and health["degraded"] == 0
                )

            await wait_for("the inventory and repair of a removed chunk file", rebuilt)
        async with open_fresh_client(cluster) as client:
            assert await read(client, "/g") == data
    finally:
        cluster.stop()


async def test_without_a_spare_node_a_lost_chunk_is_put_back_on_its_own(tmp_path):
    # 6 stores for rs-4-2's 6 chunks: every other store holds a chunk of the block already.
    cluster = make_cluster(
        tmp_path / "c",
        chunkstores=6,
        maintenance_args=["--no-rebalance", "--inventory-interval", "0.5"],
    )
    try:
        cluster.start()
        data = data_of(100_000, seed=21)
        async with open_fresh_client(cluster) as client:
            fid = await put(client, "/p", data)
            block = (await client.meta.block_list(fid))[0]
        victim = block.chunks[2]
        path = _chunk_file(cluster, block.block_id, victim)
        path.unlink()
        async with open_inspector(cluster) as m:

            async def put_back() -> bool:
                health = await block_health(m)
                return path.exists() and health["degraded"] == 0 and not health["bad_chunks"]

            await wait_for("the lost chunk to be rebuilt on its own store", put_back)
            info = (await m.meta.locate_blocks([block.block_id]))[0]
            assert info.chunks[2].node_id == victim.node_id
        async with open_fresh_client(cluster) as client:
            assert await read(client, "/p") == data
            assert client.stats.degraded_reads == 0
    finally:
        cluster.stop()


def test_repair_inventory_runs_one_pass_on_demand(tmp_path):
    cluster = make_cluster(tmp_path / "c", maintenance=False)
    try:
        cluster.start()
        data = data_of(100_000, seed=3)

        async def write() -> BlockInfo:
            async with open_fresh_client(cluster) as client:
                fid = await put(client, "/h", data)
                return (await client.meta.block_list(fid))[0]

        block = trio.run(write)
        victim = block.chunks[5]
        _chunk_file(cluster, block.block_id, victim).unlink()
        cmd = [sys.executable, "-m", "tectonic_py.cli.main", "repair", str(cluster.cluster_file)]
        proc = subprocess.run(
            [*cmd, "--inventory", "--json"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        found = json.loads(proc.stdout)
        assert (found["missing"], found["mismatched"], found["recorded"]) == (1, 0, 1)
        assert found["nodes_checked"] == 8
        proc = subprocess.run(
            [*cmd, "--status", "--json"], capture_output=True, text=True, timeout=120, check=False
        )
        health = json.loads(proc.stdout)
        assert health["degraded"] == 1
        assert health["bad_chunks"] == [f"{block.block_id:016x}.5@{victim.node_id}"]
    finally:
        cluster.stop()


async def test_a_block_committed_short_is_degraded_until_its_chunk_is_placed(tmp_path, secret_file):
    async with open_meta_cluster(tmp_path, secret_file) as mc:
        c = mc.client
        await register_nodes(c, 7)
        f, tok = await c.create(ROOT_ID, "short", ec="rs-4-2")
        grant = await c.allocate_block(f.id, tok, "rs-4-2", hedge=1)
        # A full disk or a hung store: the write quorum (k + 1) met with 5 of 6 chunks.
        placed = [ChunkPlacement(i, grant.nodes[i].node_id, 100 + i) for i in range(5)]
        info = BlockInfo(grant.block_id, "rs-4-2", 4096, 10_000, placed, file_index=0)
        await c.commit_blocks(f.id, tok, [info])
        async with trio.open_nursery() as nursery:
            m = Maintenance(mc.config, MaintenanceSettings(), c, nursery)
            repairer = Repairer(m)
            nodes = await m.nodes()
            bad = await repairer.reported_chunks()
            assert bad == {(grant.block_id, 5, "")}
            (work,) = await repairer.find_work(nodes, bad, full_scan=False)
            assert (work.info.block_id, work.missing, len(work.live)) == (grant.block_id, [5], 5)
            # Its first placement (repair's set_chunk from no node) clears the record.
            spare = grant.nodes[5].node_id
            await m.set_chunk(grant.block_id, 5, "", spare, 105)
            assert await repairer.reported_chunks() == set()
            nursery.cancel_scope.cancel()


def test_cluster_up_takes_the_scrub_and_inventory_intervals(tmp_path):
    from tectonic_py.cli.cluster import _make_cluster

    args = build_parser().parse_args(
        ["cluster", "up", "--dir", str(tmp_path), "--scrub-interval", "60"]
        + ["--inventory-interval", "30", "--chunkstores", "10", "--ec", "rs-6-3"]
        + ["--metadata-servers", "1", "--shards", "4"]
    )
    cluster = _make_cluster(args, tmp_path)
    assert cluster.chunkstore_args == ["--scrub-interval", "60.0"]
    assert cluster.maintenance_args == ["--inventory-interval", "30.0"]
