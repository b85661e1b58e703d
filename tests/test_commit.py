"""The atomic commit of a checkpoint step (``name.commit`` through the metadata client and
``tectonic commit``): refused while a file is not sealed, one transaction that renames the
staging directory and points ``latest`` at it, refused over an existing step unless asked
to replace it (the old one is moved aside under a staging name); a step written through a
real mount and committed with the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fuse_fixtures import Mount

from tectonic_py.client.tectonic_client import TectonicClient
from tectonic_py.core.errors import FileExists, InvalidArgument, InvalidName, WrongShard
from tectonic_py.launch.local_cluster import LocalCluster


@pytest.fixture
def local_cluster(shared_local_cluster: LocalCluster) -> LocalCluster:
    """One cluster for the module's client and CLI tests: neither kills, stops or
    reconfigures a daemon, and each works under its own directory (/ck, /jobs)."""
    return shared_local_cluster


async def _write(client: TectonicClient, path: str, data: bytes) -> None:
    w = await client.create(path)
    await w.write(data)
    await w.close()


async def _names(client: TectonicClient, path: str) -> list[str]:
    return sorted(e.name for e in await client.listdir(path))


async def test_commit_once_sealed_with_latest(client: TectonicClient) -> None:
    await client.mkdir("/ck/step_1.staging-a", parents=True)
    parent = await client.stat("/ck")
    for r in range(3):
        await _write(client, f"/ck/step_1.staging-a/rank_{r}", bytes([r]) * 1000)
    await client.mkdir("/ck/step_1.staging-a/sub")
    open_writer = await client.create("/ck/step_1.staging-a/sub/late")
    await open_writer.write(b"x")
    with pytest.raises(InvalidArgument, match="1 of 4 files .* not sealed: step_1.staging-a/sub"):
        await client.meta.commit_step(parent.id, "step_1.staging-a", "step_1", latest="latest")
    assert await _names(client, "/ck") == ["step_1.staging-a"]  # nothing moved
    await open_writer.close()
    r = await client.meta.commit_step(parent.id, "step_1.staging-a", "step_1", latest="latest")
    assert (r["files"], r["dirs"], r["retired"]) == (4, 2, 0)
    assert await _names(client, "/ck") == ["latest", "step_1"]
    assert await client.readlink("/ck/latest") == "step_1"
    assert await _names(client, "/ck/step_1") == ["rank_0", "rank_1", "rank_2", "sub"]

    # The next step moves latest in the same transaction; an existing step is refused.
    await client.mkdir("/ck/step_2.staging-b")
    await _write(client, "/ck/step_2.staging-b/rank_0", b"two")
    await client.meta.commit_step(parent.id, "step_2.staging-b", "step_2", latest="latest")
    assert await client.readlink("/ck/latest") == "step_2"
    await client.mkdir("/ck/step_2.staging-c")
    with pytest.raises(FileExists):
        await client.meta.commit_step(parent.id, "step_2.staging-c", "step_2")
    r = await client.meta.commit_step(parent.id, "step_2.staging-c", "step_2", replace=True)
    assert r["retired"]
    names = await _names(client, "/ck")
    assert [n for n in names if n.startswith("step_2.staging-replaced-")]  # the GC's to collect
    assert await _names(client, "/ck/step_2") == []  # the new, empty step
    # latest must be a symbolic link to be moved.
    await client.mkdir("/ck/step_3.staging-d")
    await _write(client, "/ck/notalink", b"")
    with pytest.raises(FileExists):
        await client.meta.commit_step(parent.id, "step_3.staging-d", "step_3", latest="notalink")
    # The op itself refuses what the client would never send.
    meta = client.meta
    shard = meta.shard_of(parent.id)
    with pytest.raises(InvalidArgument, match="must differ"):
        await meta.call_shard(
            shard, "name.commit", {"dir": parent.id, "staging": "a", "final": "a"}
        )
    other = (shard + 1) % meta.config.shards
    with pytest.raises(WrongShard):
        await meta.call_shard(
            other, "name.commit", {"dir": parent.id, "staging": "a", "final": "b"}
        )
    with pytest.raises(InvalidName):
        await meta.call_shard(
            shard, "name.commit", {"dir": parent.id, "staging": "../x", "final": "b"}
        )
    assert "step_3" not in await _names(client, "/ck")


def test_cli_commit(local_cluster: LocalCluster, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    def tectonic(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tectonic_py.cli.main", *args],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )

    cf = str(local_cluster.cluster_file)
    local = tmp_path / "rank_0.pt"
    local.write_bytes(b"weights" * 1000)
    assert tectonic("mkdir", cf, "-p", "/jobs/step_9.staging-x").returncode == 0
    assert tectonic("put", cf, str(local), "/jobs/step_9.staging-x/rank_0.pt").returncode == 0
    out = tectonic("commit", cf, "/jobs/step_9.staging-x", "/jobs/step_9", "--latest", "latest")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["files"] == 1
    bad = tectonic("commit", cf, "/jobs/nowhere.staging-y", "/other/step_9")
    assert bad.returncode == 1 and "one directory" in bad.stderr


def test_cli_commit_of_a_mount_written_step(mount: Mount) -> None:
    """Files written through the mount under a staging name, committed with the CLI: the
    mount then shows the step and its ``latest`` link (kernel caches notwithstanding)."""
    staging = mount / "ck" / "step_5.staging-job7"
    staging.mkdir(parents=True)
    for r in range(4):
        (staging / f"rank_{r}.pt").write_bytes(bytes([r]) * 300_000)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tectonic_py.cli.main",
            "commit",
            str(mount.cluster.cluster_file),
            "/ck/step_5.staging-job7",
            "/ck/step_5",
            "--latest",
            "latest",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["files"] == 4
    assert sorted(os.listdir(mount / "ck")) == ["latest", "step_5"]
    assert os.readlink(mount / "ck" / "latest") == "step_5"
    got = (mount / "ck" / "latest" / "rank_3.pt").read_bytes()
    assert got == bytes([3]) * 300_000
    durability = os.getxattr(mount / "ck" / "step_5" / "rank_3.pt", "user.tectonic.durability")
    assert durability == b"full"
