"""Garbage collection and lease recovery with real processes: a writer killed (kill -9) in
the middle of a large file leaves orphan chunks that are collected after the grace period and
a file resolved by the documented rule (unsealed, at its last committed size), with nothing
else touched; deleting a checkpoint directory of many files gives the space back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import trio
from maintenance_helpers import (
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

from tectonic_py.core.ids import chunk_id, parse_chunk_id
from tectonic_py.maintenance.runtime import Maintenance

ROOT = Path(__file__).resolve().parents[1]
GC_FAST = ["--grace", "1", "--lease-grace", "0.5", "--no-rebalance"]
SYNCED = 200_000

WRITER = textwrap.dedent(
    """
    import sys, trio
    import tectonic_py.client.tectonic_client as c
    import tectonic_py.client.writer as writer
    writer.LEASE_RENEW_S = 0.3  # the test's metadata servers grant 2 s writer leases

    async def main(cluster_file, ec):
        piece = bytes(range(256)) * 256  # 64 KiB
        async with c.open_client(cluster_file) as client:
            w = await client.create("/ckpt/big", ec=ec)
            data = bytearray()
            for i in range(4):
                chunk = bytes((b + i) % 256 for b in piece[: {synced} // 4])
                data += chunk
                await w.write(chunk)
            await w.fsync()
            print("SYNCED", flush=True)
            for _ in range(100_000):  # until killed
                await w.write(piece)
                await trio.sleep(0.005)

    trio.run(main, sys.argv[1], sys.argv[2])
    """
).replace("{synced}", str(SYNCED))


def _spawn_writer(cluster_file: Path, log_path: Path) -> subprocess.Popen[bytes]:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-c", WRITER, str(cluster_file), EC],
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
        )


def _expected_prefix() -> bytes:
    piece = bytes(range(256)) * 256
    return b"".join(bytes((b + i) % 256 for b in piece[: SYNCED // 4]) for i in range(4))


async def _chunks_on_disk(m: Maintenance) -> set[tuple[str, str]]:
    out = set()
    for node in (await m.nodes()).values():
        if node.state != "up":
            continue
        after: str | None = ""
        while after is not None:
            r = await m.node_call(node, "list", after=after, limit=1000)
            out |= {(c, node.node_id) for c, _ in r["chunks"]}
            after = r["next"]
    return out


async def _blocks(m: Maintenance) -> list[dict[str, Any]]:
    out = []
    for shard in range(m.config.shards):
        async for rec in m.scan_blocks(shard):
            out.append(rec)
    return out


async def _referenced(m: Maintenance) -> set[tuple[str, str]]:
    return {
        (chunk_id(b["block_id"], i), node)
        for b in await _blocks(m)
        if b["state"] == "committed"
        for i, node, _ in b["chunks"]
    }


async def test_killed_writer_orphans_collected_and_file_resolved(tmp_path):
    cluster = make_cluster(
        tmp_path / "c",
        chunkstores=7,
        maintenance_args=GC_FAST,
        metadata_args=["--writer-lease", "2"],
    )
    proc = None
    try:
        cluster.start()
        keep = data_of(180_000, seed=3)
        async with open_fresh_client(cluster) as client:
            await client.mkdir("/ckpt")
            await put(client, "/ckpt/keep", keep)
            keep_blocks = await client.meta.block_list((await client.stat("/ckpt/keep")).id)
        proc = _spawn_writer(cluster.cluster_file, tmp_path / "writer.log")
        assert proc.stdout is not None
        line = await trio.to_thread.run_sync(proc.stdout.readline)
        assert line.strip() == b"SYNCED", (tmp_path / "writer.log").read_text()
        async with open_inspector(cluster) as m:

            async def past_synced():  # type: ignore[no-untyped-def]
                blocks = await _blocks(m)
                return len([b for b in blocks if b["file_index"] >= 4]) >= 2

            await wait_for(
                "the writer to get past its synced size", past_synced, timeout=60, every=0.05
            )
            proc.send_signal(signal.SIGKILL)
            await trio.to_thread.run_sync(proc.wait)

            async def resolved():  # type: ignore[no-untyped-def]
                attrs = await m.meta.resolve("/ckpt/big")
                if attrs.writer:
                    return None
                blocks = await _blocks(m)
                if any(b["state"] != "committed" for b in blocks):
                    return None
                # The blocks written past the committed size (>= 2 of them, some perhaps
                # never committed) go with their chunks.
                if any(b["file_id"] == attrs.id and b["file_index"] >= 4 for b in blocks):
                    return None
                disk, ref = await _chunks_on_disk(m), await _referenced(m)
                return attrs if disk == ref else None

            attrs = await wait_for("orphan chunks collected and the file resolved", resolved)
            # The documented rule: unsealed (visibly incomplete), at its last committed size.
            assert not attrs.sealed and attrs.size == SYNCED
            after = await m.meta.block_list((await m.meta.resolve("/ckpt/keep")).id)
            assert [(b.block_id, [(c.index, c.node_id) for c in b.chunks]) for b in after] == [
                (b.block_id, [(c.index, c.node_id) for c in b.chunks]) for b in keep_blocks
            ]
        async with open_fresh_client(cluster) as client:
            assert await read(client, "/ckpt/big") == _expected_prefix()
            assert await read(client, "/ckpt/keep") == keep
            # An incomplete file can be rewritten by a new writer.
            await put(client, "/ckpt/big", b"fresh")
            assert await read(client, "/ckpt/big") == b"fresh"
    finally:
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        cluster.stop()


async def test_deleted_checkpoint_directory_gives_space_back(tmp_path):
    cluster = make_cluster(tmp_path / "c", chunkstores=7, maintenance_args=GC_FAST)
    try:
        cluster.start()
        keep = data_of(90_000, seed=8)
        async with open_fresh_client(cluster) as client:
            await put(client, "/keep", keep)
            async with open_inspector(cluster) as m:
                baseline = await total_used(m)
                await client.mkdir("/step_100")
                for i in range(24):
                    await put(client, f"/step_100/rank_{i}.pt", data_of(30_000 + 3_000 * i, seed=i))
                full = await total_used(m)
                assert full > baseline
                for i in range(24):
                    await client.unlink(f"/step_100/rank_{i}.pt")
                await client.rmdir("/step_100")

                async def back():  # type: ignore[no-untyped-def]
                    used = await total_used(m)
                    return used if used == baseline else None

                await wait_for("the space of the deleted files to come back", back)
                disk = {c for c, _ in await _chunks_on_disk(m)}
                live = {b["block_id"] for b in await _blocks(m)}
                assert {parse_chunk_id(c)[0] for c in disk} == live
        async with open_fresh_client(cluster) as client:
            assert await read(client, "/keep") == keep
    finally:
        cluster.stop()


async def test_stale_staging_directories_are_collected(tmp_path):
    """A dead job's staging directory (every file sealed or left unsealed, nothing changed
    for the grace) goes, tree and all; one a writer still holds stays, and so do committed
    steps and directories that are not staging directories."""
    cluster = make_cluster(tmp_path / "c", chunkstores=7, maintenance_args=GC_FAST)
    try:
        cluster.start()
        async with open_fresh_client(cluster) as client:
            await client.mkdir("/ck/step_1.staging-dead/sub", parents=True)
            await client.mkdir("/ck/step_2.staging-live", parents=True)
            await client.mkdir("/ck/step_0")
            for path in ("step_1.staging-dead/r0", "step_1.staging-dead/sub/r1", "step_0/r0"):
                await put(client, f"/ck/{path}", data_of(20_000, seed=len(path)))
            live = await client.create("/ck/step_2.staging-live/r0")
            await live.write(b"still writing")
            await live.fsync()

            async def dead_gone() -> bool:
                return "step_1.staging-dead" not in {e.name for e in await client.listdir("/ck")}

            await wait_for("the dead job's staging directory to go", dead_gone, timeout=60)
            await trio.sleep(2)  # more sweeps: the live one must stay
            names = {e.name for e in await client.listdir("/ck")}
            assert names == {"step_0", "step_2.staging-live"}
            assert await read(client, "/ck/step_0/r0") == data_of(20_000, seed=len("step_0/r0"))
            await live.close()
    finally:
        cluster.stop()


# --- the metadata ops of the services: every refusal is clear and changes nothing ------------


async def test_maintenance_ops_refuse_stale_or_bad_requests(tmp_path, secret_file):
    import pytest
    from metadata_fixtures import open_meta_cluster, register_nodes

    from tectonic_py.core.errors import FileNotFound, InvalidArgument
    from tectonic_py.core.ids import ROOT_ID, shard_of
    from tectonic_py.core.records import BlockInfo, ChunkPlacement

    async with open_meta_cluster(tmp_path, secret_file, servers=2, shards=4) as mc:
        c = mc.client
        await register_nodes(c, 4)
        f, tok = await c.create(ROOT_ID, "f", ec="rs-2-1")
        g = await c.allocate_block(f.id, tok, "rs-2-1", hedge=1)
        nodes = [n.node_id for n in g.nodes]
        info = BlockInfo(
            g.block_id,
            "rs-2-1",
            100,
            150,
            [ChunkPlacement(i, nodes[i], 70 + i) for i in range(2)],
            0,
        )
        await c.commit_blocks(f.id, tok, [info])
        bshard, fshard = shard_of(g.block_id, 4), shard_of(f.id, 4)

        async def call(shard, op, **fields):  # type: ignore[no-untyped-def]
            return await c.call_shard(shard, op, fields)

        async def chunks():  # type: ignore[no-untyped-def]
            return [
                (x.index, x.node_id, x.checksum)
                for x in (await c.locate_blocks([g.block_id]))[0].chunks
            ]

        before = await chunks()
        # A move from a node that does not hold the chunk (a stale view) is refused.
        with pytest.raises(InvalidArgument):
            await c.set_chunk(g.block_id, 0, nodes[1], nodes[3], 70)
        with pytest.raises(InvalidArgument):  # other bytes than the recorded ones
            await c.set_chunk(g.block_id, 0, nodes[0], nodes[3], 71)
        with pytest.raises(InvalidArgument):  # the first placement of a chunk that is placed
            await c.set_chunk(g.block_id, 1, "", nodes[3], 71)
        with pytest.raises(InvalidArgument):  # outside the code
            await c.set_chunk(g.block_id, 3, "", nodes[3], 1)
        with pytest.raises(InvalidArgument):
            await c.set_chunk(g.block_id, 2, "", "../etc", 1)
        with pytest.raises(FileNotFound):
            await c.set_chunk(g.block_id + 1, 0, "", nodes[3], 1)
        assert await chunks() == before
        # The chunk the writer never stored (index 2) may be placed; a real move works.
        await c.set_chunk(g.block_id, 2, "", nodes[2], 99)
        await c.set_chunk(g.block_id, 0, nodes[0], nodes[3], 70)
        assert await chunks() == [(0, nodes[3], 70), (1, nodes[1], 71), (2, nodes[2], 99)]
        assert (g.block_id, 0) in await c.blocks_on_node(nodes[3])
        assert (g.block_id, 0) not in await c.blocks_on_node(nodes[0])
        # The chunk sweep's question: the old copy on nodes[0] is dead, the others live.
        dead = await c.dead_chunks(bshard, nodes[0], [(g.block_id, 0), (g.block_id + 1, 0)])
        assert sorted(dead) == sorted([(g.block_id, 0), (g.block_id + 1, 0)])
        assert await c.dead_chunks(bshard, nodes[3], [(g.block_id, 0)]) == []
        with pytest.raises(InvalidArgument):
            await call(bshard, "block.dead_chunks", node_id=nodes[0], chunks=[[g.block_id]])
        # A forget that does not match the block's state or file is refused (returns False).
        assert await c.forget_block(g.block_id, state="allocated") is None
        assert (
            await c.forget_block(g.block_id, state="committed", file_id=f.id + 1, file_index=0)
            is None
        )
        with pytest.raises(InvalidArgument):
            await call(bshard, "block.forget", block_id=g.block_id, state="sealed")
        assert (await c.locate_blocks([g.block_id]))[0].block_id == g.block_id
        # The file holds the block: referenced. A live lease is not recovered.
        refs = [(f.id, 0, g.block_id), (f.id, 1, g.block_id)]
        assert await c.referenced(fshard, refs) == [True, False]
        assert await c.recover_lease(f.id, tok, before_ns=1) == "skipped"
        assert (await c.getattr(f.id)).writer
        with pytest.raises(InvalidArgument):
            await call(fshard, "file.gc_ack", block_ids=["x"])
        with pytest.raises(InvalidArgument):
            await call(fshard, "file.referenced", refs=[[f.id, -1, 3]])
        # Recovery of an expired lease (before_ns in the future): unsealed at its committed
        # size, the writer fenced.
        await c.set_size(f.id, tok, 120)
        # (As admin, who may fence a writer whose lease has not run out: tests/test_preconditions.)
        (row,) = [
            r for r in await c.expired_leases(fshard, before_ns=2**62, limit=10) if r[0] == f.id
        ]
        assert row[1] != tok  # the lease's expiry, never the writer token
        assert await c.recover_lease(f.id, row[1], before_ns=2**62) == "incomplete"
        attrs = await c.getattr(f.id)
        assert (attrs.size, attrs.sealed, attrs.writer) == (120, False, False)
        assert [b.block_id for b in await c.block_list(f.id)] == [g.block_id]
        from tectonic_py.core.errors import StaleWriterToken

        with pytest.raises(StaleWriterToken):
            await c.seal(f.id, tok, 150)


def test_maintenance_cli_bad_flags_are_one_line(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tectonic_py.cli.main",
            "maintenance",
            str(tmp_path / "x.toml"),
            "--interval",
            "0",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 1 and "interval must be positive" in r.stderr
    assert "Traceback" not in r.stderr
