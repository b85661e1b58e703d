"""Directory quotas and reservations through the client library and the CLI
(metadata/quota_layer.py, docs/quotas.md): a write over the quota is refused before a byte of
it is taken and what was written stays readable; the file limit refuses creates; bad input
is one line and changes nothing; a reservation fails before anything is written when the
cluster or the quota cannot hold it, keeps its space from other writers and lapses at its
TTL; after kill -9 of a metadata server in the middle of writes, the usage recounted from
the records equals the usage accounted. One cluster for the module (the kill test last)."""

from __future__ import annotations

import io
import os
import sqlite3
from collections.abc import AsyncIterator
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
from metadata_fixtures import open_meta_cluster

from metadata import quota_layer
from metadata.etcd_shards import EtcdSettings
from metadata.shard import SCHEMA
from tectonic_py.cli.main import main
from tectonic_py.client.tectonic_client import TectonicClient, open_client
from tectonic_py.core.errors import CrossRealm, NoSpace, QuotaExceeded, TectonicError
from tectonic_py.core.ids import ROOT_ID
from tectonic_py.launch.local_cluster import LocalCluster
from tectonic_py.loadtest import LoadtestConfig, run_loadtest
from tectonic_py.maintenance.fsck import recount_quotas

KiB = 1024
MiB = 1024 * KiB


@pytest.fixture
def local_cluster(shared_local_cluster: LocalCluster) -> LocalCluster:
    return shared_local_cluster


@pytest.fixture
async def admin(local_cluster: LocalCluster) -> AsyncIterator[TectonicClient]:
    async with open_client(local_cluster.cluster_file) as c:
        yield c


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


async def _cli(*args: str) -> Ran:
    """``tectonic ARGS`` in a thread of this process (its own trio run): a subprocess
    would spend seconds importing for each call."""

    def run() -> Ran:
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:
                if not isinstance(e.code, int):
                    print(e.code, file=err)
                code = e.code if isinstance(e.code, int) else 1
        return Ran(code, out.getvalue(), err.getvalue())

    return await trio.to_thread.run_sync(run)


async def _quota(admin: TectonicClient, path: str) -> dict[str, int]:
    await admin.meta.settle_quotas()
    return dict(await admin.meta.get_quota((await admin.stat(path)).id))


async def test_write_over_quota_is_refused_and_earlier_bytes_stay(
    client: TectonicClient, admin: TectonicClient
) -> None:
    await client.mkdir("/job")
    await admin.meta.set_quota((await admin.stat("/job")).id, 1 * MiB, 0)
    piece = os.urandom(64 * KiB)
    w = await client.create("/job/ckpt")
    written = 0
    with pytest.raises(QuotaExceeded, match="quota of directory .* exceeded"):
        for _ in range(32):
            await w.write(piece)
            written += len(piece)
    assert written == 1 * MiB
    await w.write(b"")  # the writer is still usable: the refusal is not sticky
    await w.close()
    r = await client.open_read("/job/ckpt")
    assert await r.pread(0, 2 * MiB) == piece * 16
    q = await _quota(admin, "/job")
    assert (q["used_bytes"], q["used_files"], q["claimed_bytes"]) == (1 * MiB, 1, 0)
    # Deleting gives the space back once folded; a rename out of the realm is EXDEV.
    with pytest.raises(CrossRealm):
        await client.rename("/job/ckpt", "/elsewhere")
    await client.unlink("/job/ckpt")
    assert (await _quota(admin, "/job"))["used_bytes"] == 0


async def test_file_limit_cli_and_bad_input(
    client: TectonicClient, local_cluster: LocalCluster
) -> None:
    cf = str(local_cluster.cluster_file)
    await client.mkdir("/few")
    w = await client.create("/few/already")
    await w.write(b"x" * 1000)
    await w.close()
    r = await _cli("quota", "set", cf, "/few", "--files", "3", "--bytes", "1MiB")
    assert r.returncode == 0, r.stderr
    assert "bytes 1000 B of 1.0 MiB, files 1 of 3" in r.stdout  # what was there is counted
    await client.mkdir("/few/sub")
    w = await client.create("/few/sub/two")
    await w.close()
    with pytest.raises(QuotaExceeded, match="file quota"):
        await client.create("/few/sub/three")
    # Bad input: one line, exit 1 or 2 (argparse), and the quota as it was.
    for args, code, says in (
        (("--bytes", "-5"), 2, "bad size '-5'"),
        (("--bytes", "lots"), 2, "bad size 'lots'"),
        (("--files", "-1"), 2, "bad count '-1'"),
        ((), 1, "give --bytes SIZE, --files N or both"),
    ):
        r = await _cli("quota", "set", cf, "/few", *args)
        errors = [line for line in r.stderr.splitlines() if "error:" in line]
        assert r.returncode == code and len(errors) == 1 and says in errors[0], r.stderr
    r = await _cli("quota", "set", cf, "/few/already", "--bytes", "1MiB")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "is a file" in r.stderr
    r = await _cli("quota", "set", cf, "/few/sub", "--bytes", "1MiB")
    assert r.returncode == 1 and "do not nest" in r.stderr
    r = await _cli("quota", "set", str(local_cluster.client_file), "/few", "--bytes", "9MiB")
    assert r.returncode == 1 and "permission denied" in r.stderr  # admin's, not a client's
    r = await _cli("quota", "get", cf, "/few", "--json")
    assert '"max_bytes": 1048576, "max_files": 3' in r.stdout
    assert '"used_files": 3' in r.stdout
    r = await _cli("quota", "ls", cf)
    assert r.returncode == 0 and "files 3 of 3" in r.stdout
    r = await _cli("quota", "rm", cf, "/few")
    assert r.returncode == 0, r.stderr
    w = await client.create("/few/sub/three")  # no limit any more
    await w.close()
    r = await _cli("quota", "get", cf, "/few")
    assert r.returncode == 1 and "has no quota" in r.stderr


async def test_reservations(
    client: TectonicClient, admin: TectonicClient, local_cluster: LocalCluster
) -> None:
    cf = str(local_cluster.cluster_file)
    await client.mkdir("/res/step.staging-a", parents=True)
    await client.mkdir("/res/other")
    await admin.meta.set_quota((await admin.stat("/res")).id, 4 * MiB, 0)
    # Larger than the cluster's free raw space: refused at once, nothing written.
    r = await _cli("reserve", cf, "/res/step.staging-a", "100TiB")
    assert r.returncode == 1 and "cannot hold" in r.stderr and r.stderr.count("\n") == 1
    with pytest.raises(NoSpace):
        await client.meta.reserve((await client.stat("/res/other")).id, 2**50, 60)
    with pytest.raises(QuotaExceeded):  # larger than the quota
        await client.meta.reserve((await client.stat("/res/other")).id, 5 * MiB, 60)
    assert await client.listdir("/res/step.staging-a") == []
    r = await _cli("reserve", cf, "/res/step.staging-a", "3MiB", "--ttl", "10m")
    assert r.returncode == 0, r.stderr
    # Another writer in the realm cannot take the reserved space ...
    other = await client.create("/res/other/greedy")
    await other.write(b"o" * MiB)
    with pytest.raises(QuotaExceeded):
        await other.write(b"o" * MiB)
    await other.close()
    # ... and the step's writers draw from it however full the rest is.
    step = await client.create("/res/step.staging-a/rank_0")
    await step.write(b"s" * 3 * MiB)
    await step.close()
    parent = await client.stat("/res")
    await client.meta.commit_step(parent.id, "step.staging-a", "step")  # ends the reservation
    q = await _quota(admin, "/res")
    assert (q["used_bytes"], q["reserved_bytes"]) == (4 * MiB, 0)

    # A reservation lapses at its TTL: then the space is anyone's again.
    await client.unlink("/res/step/rank_0")
    await client.mkdir("/res/next.staging-b")
    await admin.meta.settle_quotas()
    await client.meta.reserve((await client.stat("/res/next.staging-b")).id, 3 * MiB, 0.5)
    late = await client.create("/res/other/late")
    with pytest.raises(QuotaExceeded):
        await late.write(b"l" * 2 * MiB)
    await trio.sleep(0.6)
    await late.write(b"l" * 2 * MiB)
    await late.close()


async def test_kill9_of_a_metadata_server_never_drifts_usage(
    client: TectonicClient, local_cluster: LocalCluster
) -> None:
    """Writers and deletes run while each metadata server is killed (-9) and restarted; the
    usage folded afterwards equals the recount of the records, exactly. Last: it restarts
    the module's servers."""
    async with open_client(local_cluster.cluster_file) as admin:
        await client.mkdir("/crash/a", parents=True)
        await admin.meta.set_quota((await admin.stat("/crash")).id, 1 << 40, 0)

        cut: list[str] = []

        async def writer(n: int) -> None:
            for i in range(12):
                path = f"/crash/a/f{n}_{i}"
                try:
                    w = await client.create(path)
                    await w.write(os.urandom(100 * KiB + n * 7 + i))
                    await w.close()
                    if i % 3 == 0:
                        await client.unlink(path)
                except TectonicError as e:  # a call cut by a kill: what it left is the point
                    cut.append(f"{path}: {e}")

        async def killer() -> None:
            for i in (0, 1, 0):
                await trio.sleep(0.4)
                local_cluster.kill_metadata(i)
                await trio.to_thread.run_sync(local_cluster.start_metadata, i)

        async def folder() -> None:  # folds cut by the kills too, as maintenance's are
            for _ in range(40):
                try:
                    await admin.meta.settle_quotas()
                except TectonicError:
                    pass
                await trio.sleep(0.05)

        async with trio.open_nursery() as nursery:
            for n in range(4):
                nursery.start_soon(writer, n)
            nursery.start_soon(killer)
            nursery.start_soon(folder)
        quotas = await recount_quotas(admin.meta)
        crash = [q for q in quotas if q["dir"] == (await admin.stat("/crash")).id]
        assert crash and crash[0]["ok"], crash
        assert crash[0]["pending_bytes"] == 0
        assert crash[0]["counted_files"] > 10


def test_fold_of_a_page_whose_ack_was_lost_counts_nothing_twice() -> None:
    """The layer alone (two shards' SQLite, no servers): a fold whose ack was lost, then a
    longer page that starts with the folded deltas, is refused, acked up to what the
    realm has, and the rest folded: usage equals the recount (docs/decisions)."""
    src, dst = sqlite3.connect(":memory:"), sqlite3.connect(":memory:")
    for conn in (src, dst):
        conn.executescript(SCHEMA)
        quota_layer.install_accounting(conn)
    realm, key = 77, 5
    dst.execute(
        "INSERT INTO files VALUES (77, 'dir', 0, 0, 0, 0, 0, 0, 0, 1, 'rs-6-3',"
        " 65536, 2, 0, 0, 1, 1, 'q', 0)"
    )
    quota_layer.set_quota(dst, realm, 0, 0, key)

    def add_file(fid: int, size: int) -> None:
        src.execute(
            "INSERT INTO files VALUES (?, 'file', ?, 0, 0, 0, 0, 0, 0, 0, 'rs-6-3',"
            " 65536, 1, 0, 0, 1, 77, 'f', 0)",
            (fid, 0),
        )
        quota_layer.attach(src, fid, realm, key)
        src.execute("UPDATE files SET size = ? WHERE id = ?", (size, fid))

    def fold_page() -> tuple[str, int]:
        (page,) = quota_layer.pending(src, 1000)
        outcome, last = quota_layer.fold(
            dst,
            realm,
            key,
            3,
            page["first"],
            page["upto"],
            page["bytes"],
            page["files"],
            page["grown"],
        )
        return outcome, last

    add_file(1, 100)
    add_file(2, 50)
    assert fold_page()[0] == "folded"  # ... and the ack is lost
    add_file(3, 7)
    src.execute("DELETE FROM files WHERE id = 1")
    outcome, last = fold_page()
    assert outcome == "repeat"
    quota_layer.ack(src, realm, key, last)
    assert fold_page()[0] == "folded"
    used = quota_layer.get_quota(dst, realm, 0)
    counted = quota_layer.recount(src)["records"]
    assert [[realm, key, used["used_bytes"], used["used_files"]]] == counted == [[77, 5, 57, 2]]


async def test_usage_survives_a_rebuild_from_etcd(
    tmp_path: Path, secret_file: Path, meta_engine: EtcdSettings | None
) -> None:
    """Servers with empty data directories rebuild their shards from etcd (the sqlite
    engine: from their files): the accounting triggers count nothing of the rows copied
    back, so the quota, its pending deltas and the recount agree as before."""
    async with open_meta_cluster(tmp_path, secret_file, etcd=meta_engine) as mc:
        c = mc.client
        d = await c.mkdir(ROOT_ID, "q")
        await c.set_quota(d.id, 10**9, 100)
        sub = await c.mkdir(d.id, "sub")
        for i in range(6):
            a, token = await c.create(sub.id if i % 2 else d.id, f"f{i}")
            await c.seal(a.id, token, 1000 * (i + 1))
        await c.settle_quotas()
        a, token = await c.create(d.id, "pending")  # a delta left unfolded
        await c.seal(a.id, token, 7)
    again = tmp_path if meta_engine is None else tmp_path / "again"
    async with open_meta_cluster(again, secret_file, etcd=meta_engine) as mc:
        (q,) = await mc.client.recount_quotas()
        assert q["ok"] and q["pending_bytes"] == 7, q
        assert (q["counted_bytes"], q["counted_files"]) == (21007, 8)
        await mc.client.settle_quotas()
        got = await mc.client.get_quota(d.id)
        assert (got["used_bytes"], got["used_files"]) == (21007, 8)


async def test_a_loadtest_whose_step_cannot_fit_fails_before_writing(
    local_cluster: LocalCluster, admin: TectonicClient
) -> None:
    """``--reserve``: 4 ranks of 64 GiB (384 GiB raw under RS(6,3)) on a machine with less
    free: the run reports the refusal and not a byte was written."""
    cfg = LoadtestConfig(
        cluster_file=str(local_cluster.cluster_file),
        ranks=4,
        processes=1,
        shard_size=64 << 30,
        reserve=True,
        run_dir="/lt-reserve",
        keep=True,
        max_seconds=120,
        daemon_cpu=False,
    )
    result = await run_loadtest(cfg)
    assert result["errors"] >= 1 and "cannot hold" in str(result["error_samples"])
    assert result["bytes_written"] == 0
    assert await admin.listdir("/lt-reserve/step_000001") == []
