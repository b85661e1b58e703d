"""``tectonic fsck`` on real clusters (no maintenance daemon: nothing repairs behind fsck's
back): its report and exit codes on a clean, a degraded (one store killed) and a damaged
cluster (a dangling name, an unreachable record, a file whose block record is gone), and
``--repair`` followed by a clean pass with every reachable file reading back bit-exact."""

from __future__ import annotations

import itertools
import json
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from maintenance_helpers import (
    data_of,
    make_cluster,
    open_fresh_client,
    open_inspector,
    put,
    read,
    wait_for,
)
from test_cli import run_cli

from tectonic_py.core.errors import FileNotFound, TectonicError
from tectonic_py.core.ids import ROOT_ID, shard_of
from tectonic_py.launch.local_cluster import LocalCluster
from tectonic_py.maintenance.fsck import check_and_repair

FILES = {f"/d/f{i}": data_of(20_000 + 30_000 * i, seed=i) for i in range(4)}


def tectonic(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, timeout=timeout)


def fsck(cluster: LocalCluster, *args: str) -> tuple[int, dict[str, Any]]:
    proc = tectonic("fsck", str(cluster.cluster_file), *args, "--json", "--grace", "0")
    assert proc.returncode in (0, 3, 4), (proc.returncode, proc.stdout, proc.stderr)
    return proc.returncode, json.loads(proc.stdout)


def kinds(report: dict[str, Any]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in report["findings"]:
        out.setdefault(f["kind"], []).append(f["path"])
    return out


def admin_call(cluster: LocalCluster, op: str, **fields: Any) -> subprocess.CompletedProcess[str]:
    return tectonic("call", str(cluster.cluster_file), op, json.dumps(fields))


async def _write_files(cluster: LocalCluster) -> dict[str, int]:
    async with open_fresh_client(cluster) as c:
        await c.mkdir("/d")
        return {p: await put(c, p, data) for p, data in FILES.items()}


async def _down(cluster: LocalCluster, node: str) -> None:
    async with open_fresh_client(cluster) as c:

        async def down() -> bool:
            return any(n.node_id == node and n.state == "down" for n in await c.meta.nodes())

        await wait_for(f"{node} to be down", down, timeout=30)


async def _reads_back(cluster: LocalCluster, expect: dict[str, bytes]) -> None:
    async with open_fresh_client(cluster) as c:
        for path, data in expect.items():
            assert await read(c, path) == data, path


async def test_fsck_finds_damage_repairs_what_is_safe_and_then_is_clean(tmp_path: Path) -> None:
    cluster = make_cluster(tmp_path / "c", maintenance=False)
    cluster.start()
    try:
        file_ids = await _write_files(cluster)
        code, report = fsck(cluster)
        assert (code, report["severity"], report["findings"]) == (0, "clean", [])
        assert report["files"] == len(FILES) and report["records"] >= len(FILES) + 2

        # Damage as admin: f1's record dropped (its name dangles); f2's name removed (its
        # record, which holds data, is unreachable); one chunk store killed (degraded).
        dropped = admin_call(cluster, "file.drop", id=file_ids["/d/f1"])
        assert dropped.returncode == 0, dropped.stderr
        async with open_fresh_client(cluster) as c:
            d = (await c.stat("/d")).id
        removed = admin_call(
            cluster, "name.remove", dir=d, name="f2", kind="file", expect_id=file_ids["/d/f2"]
        )
        assert removed.returncode == 0, removed.stderr
        cluster.kill_chunkstore(0)
        await _down(cluster, "cs0")

        code, report = fsck(cluster)
        found = kinds(report)
        assert code == 4 and report["severity"] == "degraded", report
        assert found["dangling_name"] == ["/d/f1"]
        (unreachable,) = found["unreachable_record"]
        assert str(file_ids["/d/f2"]) in unreachable
        assert found["block_degraded"], found  # cs0 held a chunk of most blocks
        assert "block_lost" not in found and "block_missing" not in found
        # A subtree: only what is under it, and no record scan verdicts.
        code, sub = fsck(cluster, "/d/f0")
        assert sub["files"] == 1 and "unreachable_record" not in kinds(sub)

        # The human form: one line per finding, the exit code the same.
        proc = tectonic("fsck", str(cluster.cluster_file), "--grace", "0")
        assert proc.returncode == 4, proc.stderr
        assert "dangling_name: /d/f1:" in proc.stdout

        code, repaired = fsck(cluster, "--repair")
        assert code == 0, json.dumps([repaired["findings"], repaired["after_repair"]["findings"]])
        by_kind = {f["kind"]: f["repaired"] for f in repaired["repairs"]}
        assert "name removed" in by_kind["dangling_name"]
        lost_found = f"/lost+found/{file_ids['/d/f2']:016x}"
        assert by_kind["unreachable_record"] == f"named {lost_found}"
        code, report = fsck(cluster)
        assert (code, report["findings"]) == (0, []), report

        expect = {p: FILES[p] for p in ("/d/f0", "/d/f3")}
        expect[lost_found] = FILES["/d/f2"]
        await _reads_back(cluster, expect)
        async with open_fresh_client(cluster) as c:
            assert {e.name for e in await c.listdir("/d")} == {"f0", "f3"}

        # The summary of the last pass is kept for tectonic status.
        async with open_fresh_client(cluster) as c:
            kept = json.loads(await c.meta.getxattr(ROOT_ID, "user.tectonic.fsck"))
        assert kept["severity"] == "clean"
    finally:
        cluster.stop()


async def test_fsck_exit_3_when_a_files_block_record_is_gone(tmp_path: Path) -> None:
    """The damage ``block.forget`` can no longer do (tests/test_preconditions.py): a block
    record removed under a metadata server that is down."""
    cluster = make_cluster(tmp_path / "c", maintenance=False)
    cluster.start()
    try:
        await _write_files(cluster)
        async with open_fresh_client(cluster) as c:
            (block, *_) = await c.meta.block_list((await c.stat("/d/f3")).id)
        shard = shard_of(block.block_id, cluster.shards)
        server = next(i for i in range(2) if shard in cluster.shards_of(i))
        cluster.kill_metadata(server)
        db = cluster.metadata_dir(server) / f"shard-{shard:05d}.db"
        with sqlite3.connect(db) as conn:
            conn.execute("DELETE FROM blocks WHERE block_id = ?", (block.block_id,))
        cluster.start_metadata(server)

        # No block scan can count a block that has no record: status and repair --status
        # know only what the last fsck found, and say that none was kept.
        status = tectonic("status", str(cluster.cluster_file), "--json")
        assert status.returncode == 0 and json.loads(status.stdout)["last_fsck"] is None
        repair = tectonic("repair", str(cluster.cluster_file), "--status")
        assert repair.returncode == 0 and "last fsck: none kept" in repair.stdout

        code, report = fsck(cluster)
        assert code == 3 and report["severity"] == "lost", report
        assert kinds(report)["block_missing"] == ["/d/f3"]
        code, report = fsck(cluster, "--repair")
        assert code == 3  # nothing to rebuild it from; the name and record stay
        await _reads_back(cluster, {p: FILES[p] for p in ("/d/f0", "/d/f1", "/d/f2")})

        # Now both tell the truth: exit 3, the lost file named.
        status = tectonic("status", str(cluster.cluster_file), "--json")
        assert status.returncode == 3, status.stderr
        last = json.loads(status.stdout)["last_fsck"]
        assert (last["severity"], last["lost_paths"]) == ("lost", ["/d/f3"])
        human = tectonic("status", str(cluster.cluster_file))
        assert human.returncode == 3 and "data lost in 1 files, e.g. /d/f3" in human.stdout
        repair = tectonic("repair", str(cluster.cluster_file), "--status")
        assert repair.returncode == 3 and "lost in 1 files" in repair.stdout, repair.stdout
    finally:
        cluster.stop()


async def test_a_chunk_repointed_where_it_is_not_shows_at_the_next_pass(tmp_path: Path) -> None:
    """An admin's ``block.set_chunk`` onto a registered store that does not hold the chunk:
    the Block layer cannot tell; the inventory pass of fsck finds it, and from then on
    status and repair --status count the block degraded."""
    cluster = make_cluster(tmp_path / "c", maintenance=False)
    cluster.start()
    try:
        await _write_files(cluster)
        async with open_fresh_client(cluster) as c:
            (block, *_) = await c.meta.block_list((await c.stat("/d/f3")).id)
        used = {ch.node_id for ch in block.chunks}
        spare = next(f"cs{i}" for i in range(8) if f"cs{i}" not in used)
        first = block.chunks[0]
        assert cluster.config is not None
        registry = cluster.config.registry_address  # for a server without the registry
        ghost = admin_call(
            cluster, "block.set_chunk", block_id=block.block_id, index=first.index,
            old_node=first.node_id, new_node="cs99", checksum=first.checksum, registry=registry,
        )  # fmt: skip
        assert ghost.returncode == 1 and "not registered" in ghost.stderr, ghost.stderr
        moved = admin_call(
            cluster, "block.set_chunk", block_id=block.block_id, index=first.index,
            old_node=first.node_id, new_node=spare, checksum=first.checksum, registry=registry,
        )  # fmt: skip
        assert moved.returncode == 0, moved.stderr
        code, report = fsck(cluster)
        assert code == 4 and kinds(report)["block_degraded"] == ["/d/f3"], report
        status = json.loads(tectonic("status", str(cluster.cluster_file), "--json").stdout)
        assert [b["block_id"] for b in status["degraded_blocks"]] == [block.block_id]
        repair = json.loads(
            tectonic("repair", str(cluster.cluster_file), "--status", "--json").stdout
        )
        assert repair["degraded"] == 1 and repair["last_fsck"]["severity"] == "degraded"
        code, report = fsck(cluster, "--repair")
        assert code == 0, json.dumps(report["after_repair"]["findings"])
        await _reads_back(cluster, FILES)
    finally:
        cluster.stop()


# --- a random namespace, damaged at random: --repair never removes a reachable byte --------

DAMAGE = st.lists(
    st.tuples(st.sampled_from(["drop_record", "remove_name", "remove_dir"]), st.integers(0, 3)),
    max_size=4,
)
_runs = itertools.count()


@pytest.fixture
def model_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    cluster = make_cluster(tmp_path / "c", maintenance=False)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(damage=DAMAGE, sizes=st.lists(st.integers(0, 90_000), min_size=4, max_size=4))
async def test_fsck_repair_never_removes_a_reachable_byte(
    model_cluster: LocalCluster, damage: list[tuple[str, int]], sizes: list[int]
) -> None:
    """Files in a tree /tN/{f0,f1,s/f2,s/f3}; admin damage: a record dropped (its bytes
    are gone: that file is let off), a name removed (its record unreachable), the
    subdirectory's name removed. After fsck --repair, every other file reads back
    bit-exact, at its path or under /lost+found, and a second pass is clean."""
    run = next(_runs)
    top = f"/t{run}"
    paths = [f"{top}/f0", f"{top}/f1", f"{top}/s/f2", f"{top}/s/f3"]
    blobs = {p: data_of(n, seed=run * 10 + i) for i, (p, n) in enumerate(zip(paths, sizes))}
    async with open_fresh_client(model_cluster) as c:
        await c.mkdir(top)
        await c.mkdir(f"{top}/s")
        ids = {p: await put(c, p, data) for p, data in blobs.items()}
        dirs = {top: (await c.stat(top)).id, f"{top}/s": (await c.stat(f"{top}/s")).id}
        sub_id = dirs[f"{top}/s"]
        async with open_inspector(model_cluster) as m:
            dropped: set[str] = set()
            for what, i in damage:
                path = paths[i]
                parent, name = path.rsplit("/", 1)
                try:
                    if what == "drop_record":
                        await m.meta.call("file.drop", {"id": ids[path]})
                        dropped.add(path)
                    elif what == "remove_name":
                        await m.meta.call(
                            "name.remove",
                            {"dir": dirs[parent], "name": name, "kind": "file",
                             "expect_id": ids[path]},
                        )  # fmt: skip
                    else:
                        await m.meta.call(
                            "name.remove",
                            {"dir": dirs[top], "name": "s", "kind": "dir", "expect_id": sub_id},
                        )
                except TectonicError:
                    continue  # already damaged that way
            _, after, _ = await check_and_repair(m, "/", grace_s=0.0, inventory=False)
            assert after.findings == [], [f.to_json() for f in after.findings]
        for path, data in blobs.items():
            if path in dropped:
                continue
            fid = ids[path]
            candidates = [
                path,
                f"/lost+found/{fid:016x}",
                f"/lost+found/{sub_id:016x}/{path.rsplit('/', 1)[1]}",
            ]
            for p in candidates:
                try:
                    if (await c.stat(p)).id == fid:
                        assert await read(c, p) == data, p
                        break
                except FileNotFound:
                    continue
            else:
                # Only an empty file that lost its name may go (fsck deletes empty records).
                assert data == b"", f"{path} (record {fid}) is reachable nowhere"
