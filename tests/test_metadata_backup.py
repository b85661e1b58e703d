"""`tectonic metadata backup` and `restore`: an online snapshot of every shard that brings the
namespace back after the metadata disks are lost, and clear refusals for every bad input."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from metadata import backup
from tectonic_py.client.tectonic_client import open_client
from tectonic_py.core.errors import ConfigError, FileNotFound, InvalidArgument
from tectonic_py.core.process_env import child_env
from tectonic_py.launch.local_cluster import LocalCluster
from tests.cluster_fixtures import suite_cluster


def tectonic(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tectonic_py.cli.main", *args],
        check=False,
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,
    )


async def _write(cluster: LocalCluster, path: str, data: bytes) -> None:
    async with open_client(cluster.cluster_file) as client:
        w = await client.create(path)
        await w.write(data)
        await w.close()


async def test_a_backup_taken_while_serving_brings_the_namespace_back(tmp_path):
    cluster = suite_cluster(tmp_path / "c")
    dest = tmp_path / "backup"
    try:
        cluster.start()
        async with open_client(cluster.cluster_file) as client:
            await client.mkdir("/ckpt")
        kept = {f"/ckpt/rank{i}": bytes([i]) * (100_000 + i) for i in range(8)}

        async def writer_during_backup() -> None:
            for i in range(20):
                await _write(cluster, f"/ckpt/during{i}", b"x" * 1000)

        async with trio.open_nursery() as nursery:
            for path, data in kept.items():
                nursery.start_soon(_write, cluster, path, data)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer_during_backup)
            done = await trio.to_thread.run_sync(
                tectonic, "metadata", "backup", str(cluster.cluster_file), str(dest)
            )
        assert done.returncode == 0, done.stderr
        assert "backup complete" in done.stdout
        servers = sorted(p.name for p in dest.iterdir())
        assert servers == ["server-0", "server-1"]
        for s in servers:
            manifest = json.loads((dest / s / "MANIFEST.json").read_text())
            assert len(manifest["shards"]) == 8
            assert (dest / s).stat().st_mode & 0o777 == 0o700

        # After the backup: one file removed, one added; then the metadata disks are lost.
        async with open_client(cluster.cluster_file) as client:
            await client.unlink("/ckpt/rank0")
        await _write(cluster, "/after", b"later")
        cluster.stop()
        for i in range(2):
            shutil.rmtree(cluster.metadata_dir(i))
            r = tectonic(
                "metadata", "restore", str(dest / f"server-{i}"),
                "--data-dir", str(cluster.metadata_dir(i)),
            )  # fmt: skip
            assert r.returncode == 0, r.stderr
        cluster.start()
        async with open_client(cluster.cluster_file) as client:
            for path, data in kept.items():
                reader = await client.open_read(path)
                assert await reader.read() == data
            with pytest.raises(FileNotFound):
                await client.stat("/after")
    finally:
        cluster.stop()


def _fake_backup(tmp_path: Path) -> Path:
    """A one-shard backup made by the real code from a shard file, no cluster needed."""
    data = tmp_path / "data"
    data.mkdir()
    conn = sqlite3.connect(data / backup.shard_file(3))
    conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value)")
    conn.executemany("INSERT INTO meta VALUES (?, ?)", [("shard", 3), ("total_shards", 4)])
    conn.commit()
    conn.close()
    dest = tmp_path / "b"
    backup.backup_shards(data, [3], 4, dest, "127.0.0.1:1")
    return dest


def test_restore_checks_before_it_changes_anything(tmp_path):
    dest = _fake_backup(tmp_path)
    target = tmp_path / "restored"
    backup.restore(dest, target)
    assert (target / "shard-00003.db").is_file()
    with pytest.raises(InvalidArgument, match="--force"):
        backup.restore(dest, target)
    moved = backup.restore(dest, target, force=True)["moved_aside"]
    assert (Path(moved) / "shard-00003.db").is_file()

    corrupt = tmp_path / "corrupt"
    shutil.copytree(dest, corrupt)
    with open(corrupt / "shard-00003.db", "r+b") as f:
        f.seek(200)
        f.write(b"\xff" * 16)
    with pytest.raises(ConfigError, match="SHA-256"):
        backup.restore(corrupt, tmp_path / "never")
    assert not (tmp_path / "never").exists()

    (corrupt / "MANIFEST.json").unlink()
    r = tectonic("metadata", "restore", str(corrupt), "--data-dir", str(tmp_path / "never"))
    assert r.returncode == 1
    assert "not a backup, or an unfinished one" in r.stderr
    assert not (tmp_path / "never").exists()


def test_a_backup_refuses_a_used_or_relative_destination(tmp_path):
    dest = _fake_backup(tmp_path)
    with pytest.raises(InvalidArgument, match="not empty"):
        backup.backup_shards(tmp_path / "data", [3], 4, dest, "x")
    with pytest.raises(InvalidArgument, match="absolute"):
        backup.backup_shards(tmp_path / "data", [3], 4, Path("rel"), "x")
    with pytest.raises(InvalidArgument, match="outside"):
        backup.backup_shards(tmp_path / "data", [3], 4, tmp_path / "data" / "b", "x")


def test_the_daemon_still_names_its_required_flags():
    r = tectonic("metadata", "--listen", "127.0.0.1:0")
    assert r.returncode == 2
    assert "--data-dir, --shards, --total-shards, --secret-file" in r.stderr
