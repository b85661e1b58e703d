"""Repair with real processes: a chunk store killed (kill -9) is repaired around; metadata
servers and the maintenance process killed at random moments during repair never leave a
block below k live chunks, and repair resumes; ``tectonic repair --status``."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import trio
from hypothesis import given, settings
from hypothesis import strategies as st
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

from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.maintenance.repair import assess
from tectonic_py.maintenance.runtime import TokenBucket


async def _full(m):  # type: ignore[no-untyped-def]
    s = await block_health(m)
    return s if s["degraded"] == 0 and s["nodes_up"] >= 1 else None


async def test_killed_store_is_repaired_then_m_more_can_go(tmp_path):
    cluster = make_cluster(
        tmp_path / "c", chunkstores=8, maintenance_args=["--no-rebalance", "--grace", "1"]
    )
    try:
        cluster.start()
        files = {f"/f{i}": data_of(150_000 + 37_000 * i, seed=i) for i in range(5)}
        async with open_fresh_client(cluster) as client:
            for path, data in files.items():
                await put(client, path, data)
            victim_node = (
                (await client.meta.block_list((await client.stat("/f0")).id))[0].chunks[0].node_id
            )
        victim = node_index(victim_node)
        async with open_inspector(cluster) as m:
            before = await block_health(m)
            assert before["degraded"] == 0 and before["blocks"] >= 10
            cluster.kill_chunkstore(victim)

            async def repaired():  # type: ignore[no-untyped-def]
                s = await block_health(m)
                return s if victim_node in s["nodes_down"] and s["degraded"] == 0 else None

            after = await wait_for("repair of every block", repaired)
            assert after["blocks"] == before["blocks"] and after["lost"] == 0
            policy = ECPolicy.parse("rs-4-2")
            assert after["blocks_by_live_chunks"] == {str(policy.n): before["blocks"]}
            # The victim returns: its copies were rebuilt elsewhere, so the GC's chunk sweep
            # checks them against the Block layer and deletes every one.
            cluster.start_chunkstore(victim)

            async def reconciled():  # type: ignore[no-untyped-def]
                nodes = await m.nodes()
                if nodes[victim_node].state != "up":
                    return None
                r = await m.node_call(nodes[victim_node], "list", after="", limit=10_000)
                return "empty" if not r["chunks"] else None

            await wait_for("the returned node's stale chunks to be collected", reconciled)
            # Full redundancy again: any m = 2 other stores may now go too.
            others = [i for i in range(8) if i != victim]
            for i in random.Random(7).sample(others, policy.m):
                cluster.kill_chunkstore(i)
        async with open_fresh_client(cluster) as client:
            for path, data in files.items():
                assert await read(client, path) == data
    finally:
        cluster.stop()


async def test_kill_metadata_and_maintenance_during_repair(tmp_path):
    """No block ever drops below k live chunks, whatever is killed when; repair resumes."""
    cluster = make_cluster(
        tmp_path / "c",
        chunkstores=8,
        maintenance_args=[
            "--no-rebalance",
            "--bandwidth",
            str(2 * 1024 * 1024),
            "--repair-concurrency",
            "1",
        ],
    )
    rng = random.Random(11)
    try:
        cluster.start()
        files = {f"/k{i}": data_of(200_000, seed=100 + i) for i in range(4)}
        async with open_fresh_client(cluster) as client:
            for path, data in files.items():
                await put(client, path, data)
        cluster.kill_chunkstore(3)
        min_live = 99
        async with open_inspector(cluster) as m:
            for _ in range(4):
                await trio.sleep(rng.uniform(0.5, 2.0))
                victim = rng.choice(["maintenance", "metadata-0", "metadata-1"])
                if victim == "maintenance":
                    cluster.kill_maintenance()
                    cluster.start_maintenance()
                else:
                    i = int(victim[-1])
                    cluster.kill_metadata(i)
                    await trio.sleep(rng.uniform(0.0, 0.5))
                    cluster.start_metadata(i)
                s = await _health_retrying(m)
                min_live = min(min_live, min(int(k) for k in s["blocks_by_live_chunks"]))
                assert s["lost"] == 0
            final = await wait_for("repair to resume and finish", lambda: _full(m))
            assert final["lost"] == 0
        assert min_live >= 4
        async with open_fresh_client(cluster) as client:
            for path, data in files.items():
                assert await read(client, path) == data
    finally:
        cluster.stop()


async def _health_retrying(m):  # type: ignore[no-untyped-def]
    from tectonic_py.core.errors import TectonicError

    for _ in range(100):
        try:
            return await block_health(m)
        except TectonicError:
            await trio.sleep(0.2)
    raise AssertionError("metadata service did not come back")


async def test_repair_status_cli(tmp_path):
    cluster = make_cluster(tmp_path / "c", chunkstores=7, maintenance=False)
    try:
        cluster.start()
        async with open_fresh_client(cluster) as client:
            await put(client, "/s", data_of(100_000, seed=1))
        out = await trio.to_thread.run_sync(
            lambda: subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "tectonic_py.cli.main",
                    "repair",
                    str(cluster.cluster_file),
                    "--status",
                    "--json",
                ],
                check=False,
                capture_output=True,
                text=True,
                timeout=120,
            )
        )
        assert out.returncode == 0, out.stderr
        s = json.loads(out.stdout)
        assert s["blocks"] == 2 and s["degraded"] == 0 and s["nodes_down"] == []
        cluster.kill_chunkstore(0)
        cluster.kill_chunkstore(1)

        async def down():  # type: ignore[no-untyped-def]
            r = await trio.to_thread.run_sync(
                lambda: subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "tectonic_py.cli.main",
                        "repair",
                        str(cluster.cluster_file),
                        "--status",
                    ],
                    check=False,
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
            )
            return r if "down: cs0, cs1" in r.stdout else None

        r = await wait_for("the status to show two nodes down", down)
        assert "degraded: 2" in r.stdout and "lost: 0" in r.stdout
        bad = await trio.to_thread.run_sync(
            lambda: subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "tectonic_py.cli.main",
                    "repair",
                    str(tmp_path / "nope.toml"),
                    "--status",
                ],
                check=False,
                capture_output=True,
                text=True,
                timeout=60,
            )
        )
        assert bad.returncode != 0 and "error" in bad.stderr and "Traceback" not in bad.stderr
    finally:
        cluster.stop()


def test_assess_orders_and_counts():
    from tectonic_py.core.records import BlockInfo, ChunkPlacement, NodeInfo

    nodes = {
        f"n{i}": NodeInfo(f"n{i}", "", f"d{i}", state="down" if i == 2 else "up") for i in range(6)
    }
    info = BlockInfo(1, "rs-4-2", 10, 40, [ChunkPlacement(i, f"n{i}", 0) for i in range(5)])
    h = assess(info, nodes, {(1, 0, "n0")})
    assert h.live == [1, 3, 4] and h.missing == [0, 2, 5]


async def test_token_bucket_paces_without_deadlock(autojump_clock):
    bucket = TokenBucket(1000.0)
    start = trio.current_time()
    for _ in range(5):
        await bucket.take(1000)
    await bucket.take(10_000)  # bigger than the burst: let through, paid for afterwards
    await bucket.take(1)
    assert trio.current_time() - start >= 14.0
    assert bucket.taken == 15_001


def test_bench_repair_smoke(tmp_path):
    from bench import bench_repair

    assert bench_repair.main(["--smoke", "--no-ceilings", "--json", "--dir", str(tmp_path)]) == 0


@settings(max_examples=40, deadline=None)
@given(
    policy=st.sampled_from(["rs-4-2", "rs-6-3", "rs-3-1", "r3"]),
    chunk_len=st.integers(1, 300),
    seed=st.integers(0, 2**32 - 1),
)
def test_rebuild_matches_the_encoder(policy, chunk_len, seed):
    """Any k chunks rebuild any missing ones bit-exact, with the encoder's CRCs."""
    from tectonic_py.client.codec import encode_block
    from tectonic_py.maintenance.repair import _rebuild

    p = ECPolicy.parse(policy)
    rng = random.Random(seed)
    block = bytes(rng.getrandbits(8) for _ in range(p.k * chunk_len))
    enc = encode_block(p, block, chunk_len)
    have = sorted(rng.sample(range(p.n), p.k))
    wanted = sorted(rng.sample([i for i in range(p.n) if i not in have], rng.randint(1, p.n - p.k)))
    got = _rebuild(p, {i: bytes(enc.chunks[i]) for i in have}, chunk_len, wanted)
    assert {i: got[i] for i in wanted} == {
        i: (bytes(enc.chunks[i]), enc.checksums[i]) for i in wanted
    }


async def test_no_node_to_rebuild_on_is_one_warning_per_round(monkeypatch, caplog):
    """A layout with no spare node (every up store holds a chunk of the block) cannot place
    rebuilt chunks: each round says so once, with the count; the chunks go to DEBUG."""
    import logging
    from types import SimpleNamespace

    from tectonic_py.core.records import BlockInfo, ChunkPlacement, NodeInfo
    from tectonic_py.maintenance import repair as repair_module

    nodes = {
        f"n{i}": NodeInfo(f"n{i}", "", f"d{i}", state="down" if i == 0 else "up") for i in range(6)
    }
    chunks = [ChunkPlacement(i, f"n{i}", 7) for i in range(6)]
    infos = [BlockInfo(b, "rs-4-2", 10, 40, chunks) for b in range(3)]
    m = SimpleNamespace(
        settings=SimpleNamespace(sweep_interval=3600.0, repair_concurrency=2),
        counters=SimpleNamespace(lost_blocks=0),
    )

    async def all_nodes():  # type: ignore[no-untyped-def]
        return nodes

    async def no_bad_chunks(_nodes, **_kw):  # type: ignore[no-untyped-def]
        return set()

    async def work(_nodes, _bad, _full):  # type: ignore[no-untyped-def]
        return [assess(info, nodes, set()) for info in infos]

    async def fetch(_info, live, _nodes, k):  # type: ignore[no-untyped-def]
        return {i: b"x" for i in live[:k]}

    async def nowhere(*_args):  # type: ignore[no-untyped-def]
        return None

    m.nodes = all_nodes
    repairer = repair_module.Repairer(m)  # type: ignore[arg-type]
    monkeypatch.setattr(repairer, "bad_chunks", no_bad_chunks)
    monkeypatch.setattr(repairer, "find_work", work)
    monkeypatch.setattr(repairer, "_fetch", fetch)
    monkeypatch.setattr(repairer, "_place", nowhere)
    monkeypatch.setattr(
        repair_module, "_rebuild", lambda _p, _c, _len, wanted: {i: (b"", 7) for i in wanted}
    )
    caplog.set_level(logging.DEBUG, logger="tectonic_py.maintenance.repair")
    await repairer.round()
    await repairer.round()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2 and all(
        w.startswith("repair: 3 chunks have no node") for w in warnings
    )
    per_chunk = [r for r in caplog.records if "no node to rebuild it on" in r.getMessage()]
    assert len(per_chunk) == 6 and {r.levelno for r in per_chunk} == {logging.DEBUG}
