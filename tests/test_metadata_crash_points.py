"""A metadata server killed exactly at a crash point (metadata/crash_points.py: it SIGKILLs
itself after a transaction commits, before the reply leaves), then restarted: a cross-server
rename is whole or not done, batched creates with delegated ids and pack commits land once,
every closed file reads back, and no File record is left that no name reaches.

One cluster for the module (2 metadata servers, 8 shards each; 9 chunk stores): each test
restarts one server with ``TECTONIC_CRASH_POINT`` set, lets its workload hit the point, and
starts the server again unarmed."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
from cluster_fixtures import suite_cluster

import metadata.name_calls
from metadata import crash_points
from tectonic_py.client.tectonic_client import TectonicClient, open_client
from tectonic_py.core.errors import FileNotFound, TectonicError
from tectonic_py.core.ids import ROOT_ID, shard_of
from tectonic_py.launch.local_cluster import LocalCluster

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
# A rename's intent is the recovery pass's once its deadline passed (30 s by default): short
# here, so that a crash's intents are settled within the test (the pass runs every 5 s).
RENAME_DEADLINE_S = 4.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with suite_cluster(tmp_path_factory.mktemp("crash") / "c", node_timeout=5.0) as c:
        yield c


@asynccontextmanager
async def _client(cluster: LocalCluster) -> AsyncIterator[TectonicClient]:
    async with open_client(cluster.cluster_file, slow_chunk_s=5.0, chunk_timeout=10.0) as c:
        yield c


def _server_of(cluster: LocalCluster, shard: int) -> int:
    return next(i for i in range(2) if shard in cluster.shards_of(i))


def _arm(cluster: LocalCluster, i: int, point: str) -> None:
    """Restart metadata server ``i`` with ``point`` armed (only that process sees it)."""
    cluster.kill_metadata(i)
    os.environ[crash_points.ENV] = point
    try:
        cluster.start_metadata(i)
    finally:
        del os.environ[crash_points.ENV]


async def _restart_once_dead(cluster: LocalCluster, i: int, died: trio.Event) -> None:
    """Wait for server ``i`` to kill itself at its point, then start it again, unarmed."""
    with trio.fail_after(120):
        while cluster.metadata_pids()[i] is not None:
            await trio.sleep(0.05)
    died.set()
    await trio.to_thread.run_sync(cluster.start_metadata, i)


async def _mkdir_on(client: TectonicClient, path: str, server: int, cluster: LocalCluster) -> int:
    """A directory ``path``N whose shard is on ``server`` (directories land in random shards)."""
    for n in range(200):
        d = await client.mkdir(f"{path}{n}")
        if _server_of(cluster, shard_of(d.id, cluster.shards)) == server:
            return d.id
    raise AssertionError(f"no directory landed on server {server}")


async def _names(client: TectonicClient, dir_id: int) -> dict[str, int]:
    out: dict[str, int] = {}
    after = ""
    for _ in range(1000):
        page, cursor = await client.meta.readdir(dir_id, after=after, limit=500)
        out.update({e.name: e.id for e in page})
        if cursor is None:
            return out
        after = cursor
    raise AssertionError("listing did not end")


async def _reachable(client: TectonicClient) -> set[int]:
    """Every record a name reaches, the root's included, by walking the tree."""
    seen, todo = {ROOT_ID}, [ROOT_ID]
    while todo:
        dir_id = todo.pop()
        for child in (await _names(client, dir_id)).values():
            if child not in seen:
                seen.add(child)
                if (await client.meta.getattr(child)).is_dir:
                    todo.append(child)
    return seen


async def _assert_no_unreachable_records(client: TectonicClient, shards: int) -> None:
    """The recovery pass is done: no rename intent left, no unnamed record once the orphan
    GC ran, and the File layer holds exactly the records that names reach."""
    for shard in range(shards):
        r = await client.meta.call_shard(shard, "name.intents", {"before_ns": 2**62})
        assert r["intents"] == [], r
    await client.meta.collect_orphans(0)
    for shard in range(shards):
        r = await client.meta.call_shard(
            shard, "file.orphans", {"older_than_ns": 2**62, "limit": 10_000}
        )
        assert r["orphans"] == [], r
    reachable = await _reachable(client)
    assert (await client.meta.statfs())["files"] == len(reachable)


def _data(name: str, n: int) -> bytes:
    block = hashlib.sha256(name.encode()).digest() * 256
    return (block * (-(-n // len(block))))[:n]


# --- renames across two servers ------------------------------------------------------------


@pytest.mark.parametrize(
    ("point", "armed_side"),
    [
        ("rename.after_prepare", "src"),
        ("rename.after_dst_insert", "dst"),
        ("rename.after_finish", "src"),
    ],
)
async def test_rename_across_servers_killed_at_each_step_is_whole_or_not_done(
    cluster: LocalCluster, point: str, armed_side: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight files renamed at once from a directory on one server to a directory on the
    other; the server of ``armed_side`` dies at ``point`` (the first rename to reach it, and
    any others in its group commit). After the restart and the recovery pass, each file has
    exactly one of its two names, and its record is intact."""
    monkeypatch.setattr(metadata.name_calls, "RENAME_DEADLINE_S", RENAME_DEADLINE_S)
    tag = point.rsplit(".", 1)[1]
    async with _client(cluster) as client:
        src = await _mkdir_on(client, f"/src_{tag}_", 0, cluster)
        dst = await _mkdir_on(client, f"/dst_{tag}_", 1, cluster)
        ids = {}
        for k in range(8):
            w = await client.create_in(src, f"f{k}")
            await w.write(_data(f"{tag}{k}", 1000 + k))
            ids[f"f{k}"] = (await w.close()).id
        armed = 0 if armed_side == "src" else 1
        await trio.to_thread.run_sync(_arm, cluster, armed, point)
        outcome: dict[str, str] = {}

        async def rename(name: str) -> None:
            try:
                await client.meta.rename(src, name, dst, name)
                outcome[name] = "done"
            except TectonicError as e:  # a lost reply: whole or not done, settled below
                outcome[name] = f"{type(e).__name__}: {e}"

        died = trio.Event()
        with trio.fail_after(150):
            async with trio.open_nursery() as n:
                n.start_soon(_restart_once_dead, cluster, armed, died)
                for name in ids:
                    n.start_soon(rename, name)
        assert died.is_set()
        assert any(o != "done" for o in outcome.values()), outcome  # one reply was lost

        async def settled() -> bool:
            for shard in range(cluster.shards):
                r = await client.meta.call_shard(shard, "name.intents", {"before_ns": 2**62})
                if r["intents"]:
                    return False
            src_names, dst_names = await _names(client, src), await _names(client, dst)
            return not (set(src_names) & set(dst_names))

        with trio.fail_after(60):  # the deadline, then a recovery pass (every 5 s)
            while not await settled():
                await trio.sleep(0.5)
        src_names, dst_names = await _names(client, src), await _names(client, dst)
        for name, fid in ids.items():
            where = [d for d, names in (("src", src_names), ("dst", dst_names)) if name in names]
            assert len(where) == 1, (name, where, outcome.get(name))
            assert {**src_names, **dst_names}[name] == fid
            if outcome[name] == "done":
                assert where == ["dst"], name
            reader = await client.open_reader(fid)
            assert bytes(await reader.read()) == _data(f"{tag}{name[1:]}", 1000 + int(name[1:]))
        await _assert_no_unreachable_records(client, cluster.shards)


# --- batched creates with delegated ids, and pack commits ----------------------------------


@pytest.mark.parametrize("point", ["create.after_commit@10", "pack.after_commit"])
async def test_creates_and_packs_killed_after_commit_land_once(
    cluster: LocalCluster, point: str
) -> None:
    """48 ranks write small files (packed) into one directory, their creates answered at
    once from delegated ids and sent behind in batches; the directory's server dies after
    the 10th create, or the first pack, commits (its reply lost). Every close returns, every
    name is there once with its own bytes, and the File layer holds nothing unnamed."""
    tag = re.sub(r"\W", "_", point)
    async with _client(cluster) as client:
        step = await client.mkdir(f"/step_{tag}")
        armed = _server_of(cluster, shard_of(step.id, cluster.shards))
        closed: dict[str, int] = {}
        for _ in range(100):  # the shard's delegated ids at hand before the burst
            made = await client.create_pending(step.id, "warm")
            if made is not None:
                closed["warm"] = (await made[0].close()).id
                break
            await trio.sleep(0.05)
        await trio.to_thread.run_sync(_arm, cluster, armed, point)
        errors: list[str] = []
        pending = 0

        async def rank(r: int) -> None:
            nonlocal pending
            name = f"rank_{r:02d}"
            try:
                made = await client.create_pending(step.id, name)
                if made is None:
                    w = await client.create_in(step.id, name)
                else:
                    w = made[0]
                    pending += 1
                await w.write(_data(name, 3000 + 97 * r))
                closed[name] = (await w.close()).id
            except TectonicError as e:
                errors.append(f"{name}: {type(e).__name__}: {e}")

        died = trio.Event()
        with trio.fail_after(150):
            async with trio.open_nursery() as n:
                n.start_soon(_restart_once_dead, cluster, armed, died)
                for r in range(48):
                    n.start_soon(rank, r)
        assert died.is_set() and errors == []
        assert pending > 0  # the delegated-id path was taken
        names = await _names(client, step.id)
        assert names == closed
        packed = 0
        for name, fid in names.items():
            reader = await client.open_reader(fid)
            size = 0 if name == "warm" else 3000 + 97 * int(name[5:])
            assert bytes(await reader.read()) == _data(name, size), name
            packed += any(b.packed for b in await client.meta.block_list(fid))
        assert packed > 0
        with pytest.raises(FileNotFound):
            await client.meta.lookup(step.id, "rank_48")
        await _assert_no_unreachable_records(client, cluster.shards)


def test_every_crash_point_is_placed_once_in_the_server() -> None:
    """A point named in POINTS that no code reaches could never fire; one reached that is
    not in POINTS could never be armed."""
    used: list[str] = []
    for path in (REPO / "metadata").glob("*.py"):
        used += re.findall(r'crash_points\.reached\("([^"]+)"\)', path.read_text())
    assert sorted(used) == sorted(crash_points.POINTS)
