"""tectonic loadtest: small real bursts (client library on a local cluster, and file I/O on a
directory standing in for a mount), corruption caught by the restore's checksums, time bounds,
and bad arguments refused with one clear line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tectonic_py import loadtest
from tectonic_py.cli.loadtest import client_options
from tectonic_py.client.tectonic_client import open_client
from tectonic_py.core.errors import ConfigError
from tectonic_py.core.units import parse_size
from tectonic_py.loadtest import LoadtestConfig, ShardData, run_loadtest

REPO = Path(__file__).resolve().parent.parent
KiB = 1024
MiB = 1024 * KiB


def _no_workers_left() -> bool:
    """No live loadtest worker below this process (a zombie or one gone meanwhile is not live)."""
    left = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "tectonic_py.loadtest" in " ".join(p.cmdline()):
                left.append(p)
        except psutil.NoSuchProcess:  # includes ZombieProcess
            pass
    return not left


async def test_client_burst_every_byte_verified(local_cluster):
    cfg = LoadtestConfig(
        cluster_file=str(local_cluster.cluster_file),
        ranks=32,
        processes=2,
        size_dist="uniform",
        min_size=1,  # includes tiny shards; the fixture's blocks are 6 x 64 KiB
        max_size=700 * KiB,
        steps=2,
        keep_last=1,
        run_dir="/ckpt-run",
        max_seconds=240,
        watch_pids=local_cluster.pids(),
    )
    result = await run_loadtest(cfg)
    assert result["errors"] == 0, result["error_samples"]
    assert result["ranks"] == 32 and result["processes"] == 2
    last_step = result["shard_bytes_per_step"]
    assert result["bytes_written"] == 2 * last_step
    assert result["bytes_verified"] == result["bytes_read"] == last_step
    assert result["deleted_steps"] == [1]
    assert result["write_gbps"] > 0 and result["read_gbps"] > 0 and result["pause_s"] > 0
    assert result["rank_write_p50_s"] <= result["rank_write_p99_s"] <= result["rank_write_max_s"]
    assert result["cpu_s_per_gib_write"] > 0 and result["watched_max_rss"] > 0
    # it cleaned up after itself
    async with open_client(local_cluster.cluster_file) as client:
        names = [e.name for e in await client.listdir("/")]
    assert "ckpt-run" not in names
    assert _no_workers_left()


async def test_local_daemons_counted_and_the_burst_beside_one_stream(local_cluster):
    """With no --watch-pids the local cluster's daemons are found (ready files, listening
    ports) and their CPU counted by role; --baseline-stream writes the same bytes as one file
    in the same run, so the per-file cost and the pause/stream ratio are reported; the
    metadata shards' group-commit deltas come from server.stats; every rank of a worker
    shares one connection per chunk store."""
    cfg = LoadtestConfig(
        cluster_file=str(local_cluster.cluster_file),
        ranks=24,
        processes=2,
        shard_size=200 * KiB,
        run_dir="/per-file",
        max_seconds=240,
        baseline_stream=True,
    )
    result = await run_loadtest(cfg)
    assert result["errors"] == 0, result["error_samples"]
    daemons = result["daemons"]
    assert daemons["missing"] == []
    assert len(daemons["pids"]["metadata"]) == 2 and len(daemons["pids"]["chunkstore"]) == 9
    assert set(daemons["pids"]["metadata"] + daemons["pids"]["chunkstore"]) <= set(
        local_cluster.pids()
    )
    roles = result["cpu_s_by_role_write"]
    assert roles["workers"] > 0 and roles["chunkstore"] > 0 and roles["metadata"] > 0
    assert result["cpu_s_write"] == pytest.approx(sum(roles.values()))
    stream = result["baseline_stream"]
    assert stream["bytes"] == 24 * 200 * KiB and stream["seconds"] > 0 and stream["errors"] == 0
    assert result["files_written"] == 24
    per_byte = stream["cpu_s"] / stream["bytes"]
    expected = 1000 * (result["cpu_s_write"] - per_byte * result["bytes_written"]) / 24
    assert result["cpu_ms_per_file"] == pytest.approx(expected)
    assert result["cpu_ms_per_file_gross"] == pytest.approx(1000 * result["cpu_s_write"] / 24)
    assert result["pause_over_stream"] == pytest.approx(result["pause_s"] / stream["seconds"])
    batches = result["metadata_batches"]
    assert batches["batches"] > 0 and batches["mutations"] >= batches["batches"]
    assert batches["largest_batch"] >= 1
    assert result["max_conns_per_store"] == 1
    async with open_client(local_cluster.cluster_file) as client:
        names = [e.name for e in await client.listdir("/")]
    assert "per-file" not in names  # the stream's file went with the rest


async def test_daemons_found_by_listening_port_without_ready_files(local_cluster, tmp_path):
    """A cluster file with no local cluster's ready files beside it (a copy elsewhere): the
    daemons are found from their listening sockets alone; an address on another host is
    listed as missing, not guessed."""
    from tectonic_py.core import cluster_file as cluster_files
    from tectonic_py.loadtest.daemons import find_daemons, is_loopback

    config = cluster_files.load(local_cluster.cluster_file)
    config.path = None
    copy = tmp_path / "elsewhere" / "cluster.toml"
    copy.parent.mkdir()
    config.write(copy)
    async with open_client(copy) as client:
        found = await find_daemons(client, str(copy))
    assert found.missing == []
    assert sorted(found.all_pids()) == sorted(local_cluster.pids())  # no maintenance here
    assert is_loopback("127.0.0.1:1") and is_loopback("[::1]:1") and not is_loopback("10.0.0.1:1")


async def test_mount_mode_layout_and_cleanup(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cfg = LoadtestConfig(
        through_mount=str(mnt),
        ranks=16,
        processes=2,
        shard_size=300 * KiB + 7,
        steps=3,
        keep_last=2,
        run_dir="/job",
        keep=True,
        max_seconds=120,
    )
    result = await run_loadtest(cfg)
    assert result["errors"] == 0, result["error_samples"]
    assert result["bytes_verified"] == 16 * (300 * KiB + 7)
    # DCP layout, old steps deleted as a trainer does, the index lists every rank
    assert sorted(os.listdir(mnt / "job")) == ["step_000002", "step_000003"]
    files = sorted(os.listdir(mnt / "job" / "step_000003"))
    assert files == sorted([".metadata"] + [f"__{r}_0.distcp" for r in range(16)])
    index = json.loads((mnt / "job" / "step_000003" / ".metadata").read_text())
    assert set(index["files"]) == {str(r) for r in range(16)}
    assert all(f["size"] == 300 * KiB + 7 for f in index["files"].values())


async def test_restore_catches_a_corrupt_byte_and_a_missing_shard(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    base = {
        "through_mount": str(mnt),
        "ranks": 6,
        "processes": 2,
        "shard_size": 2 * MiB + 3,
        "run_dir": "/run",
        "max_seconds": 120,
    }
    written = await run_loadtest(LoadtestConfig(**base, keep=True, restore=False))
    assert written["errors"] == 0 and written["bytes_verified"] == 0
    ok = await run_loadtest(LoadtestConfig(**base, verify_only=True))
    assert ok["errors"] == 0 and ok["bytes_verified"] == 6 * (2 * MiB + 3)

    victim = mnt / "run" / "step_000001" / "__4_0.distcp"
    with open(victim, "r+b") as f:
        f.seek(MiB + 100)
        byte = f.read(1)
        f.seek(MiB + 100)
        f.write(bytes([byte[0] ^ 0x01]))
    (mnt / "run" / "step_000001" / "__1_0.distcp").unlink()
    bad = await run_loadtest(LoadtestConfig(**base, verify_only=True))
    assert bad["errors"] == 2
    text = " ".join(bad["error_samples"])
    assert "rank 4 read: checksum mismatch" in text and "rank 1 read" in text
    assert bad["bytes_verified"] == 4 * (2 * MiB + 3)
    assert victim.exists()  # verify-only never deletes


async def test_max_seconds_stops_the_run_and_kills_its_workers(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cfg = LoadtestConfig(
        through_mount=str(mnt),
        ranks=4,
        processes=2,
        shard_size=64 * MiB,
        steps=50,
        run_dir="/slow",
        max_seconds=1.0,
    )
    result = await run_loadtest(cfg)
    assert result["timed_out"] and result["errors"] >= 1
    assert "max-seconds" in " ".join(result["error_samples"])
    assert _no_workers_left()
    assert not (mnt / "slow").exists()  # still cleaned up


def test_bad_arguments_are_refused_clearly(tmp_path):
    def refused(**kw):
        with pytest.raises(ConfigError):
            LoadtestConfig(**{"run_dir": "/r", **kw}).validate()

    refused()  # neither a cluster file nor a mount
    refused(cluster_file=str(tmp_path / "missing.toml"))
    refused(through_mount=str(tmp_path), cluster_file=str(tmp_path))
    refused(through_mount=str(tmp_path / "nope"))
    refused(through_mount=str(tmp_path), ranks=0)
    refused(through_mount=str(tmp_path), size_dist="gauss")
    refused(through_mount=str(tmp_path), size_dist="uniform", min_size=10, max_size=5)
    refused(through_mount=str(tmp_path), run_dir="relative")
    refused(through_mount=str(tmp_path), run_dir="/a/../b")
    refused(through_mount=str(tmp_path), max_seconds=0)
    refused(through_mount=str(tmp_path), client_options={"slow_chunk_s": 5})
    (tmp_path / "c.toml").write_text("")
    refused(cluster_file=str(tmp_path / "c.toml"), client_options={"no_such_knob": 1})
    assert client_options(["slow_chunk_s=60", "hedge=3", "x=y"]) == {
        "slow_chunk_s": 60,
        "hedge": 3,
        "x": "y",
    }
    for bad in (["novalue"], ["=3"], ["a b=1"]):
        with pytest.raises(ConfigError):
            client_options(bad)
    for text in ("", "abc", "1.5.2M", "-3", "4 XB"):
        with pytest.raises(ConfigError):
            parse_size(text)
    assert parse_size("4MiB") == parse_size("4M") == 4 * MiB
    assert parse_size("1MB") == 1_000_000 and parse_size("4GB") == 4 * 10**9
    assert parse_size("123") == 123 and parse_size("2k") == 2048


def test_cli_errors_are_one_line_and_exit_nonzero(tmp_path):
    run = [sys.executable, "-m", "tectonic_py.cli.main", "loadtest"]
    r = subprocess.run(
        [*run, str(tmp_path / "nope.toml")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=False,
    )
    assert r.returncode == 1
    assert "not found" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run(
        [*run, "--through-mount", str(tmp_path), "--shard-size", "abc"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=False,
    )
    assert r.returncode == 2 and "bad size 'abc'" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run(
        [*run, "--through-mount", str(tmp_path), "--verify-only"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=False,
    )
    assert r.returncode == 1 and "--dir" in r.stderr and "Traceback" not in r.stderr


def test_cli_json_and_plot(tmp_path):
    mnt, res = tmp_path / "mnt", tmp_path / "res"
    mnt.mkdir()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tectonic_py.cli.main",
            "loadtest",
            "--through-mount",
            str(mnt),
            "--ranks",
            "8",
            "--processes",
            "2",
            "--shard-size",
            "1MB",
            "--results-dir",
            str(res),
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("errors", "ranks", "write_gbps", "read_gbps", "pause_s", "bytes_verified"):
        assert key in out
    assert out["errors"] == 0 and out["bytes_verified"] == 8 * 1_000_000
    assert (res / "loadtest-mount-8.png").stat().st_size > 1000
    assert json.loads((res / "loadtest-mount-8.json").read_text())["timeline"]
    assert os.listdir(mnt) == []


def test_cli_without_matplotlib_skips_the_plot_in_one_line(tmp_path):
    """matplotlib is only in the bench extra: a plain install runs the load test, writes the
    JSON and says in one line that there is no plot."""
    mnt, res = tmp_path / "mnt", tmp_path / "res"
    mnt.mkdir()
    script = (
        "import sys; sys.modules['matplotlib'] = None\n"  # import matplotlib now fails
        "from tectonic_py.cli.main import main; sys.exit(main(sys.argv[1:]))"
    )
    r = subprocess.run(
        [sys.executable, "-c", script, "loadtest", "--through-mount", str(mnt), "--ranks", "2",
         "--processes", "1", "--shard-size", "64KiB", "--results-dir", str(res), "--json"],
        capture_output=True, text=True, cwd=REPO, timeout=120, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert [ln for ln in r.stderr.splitlines() if "no plot" in ln] == [
        "loadtest: no plot: matplotlib is not installed (pip install 'tectonic-py[bench]')"
    ]
    assert json.loads(r.stdout)["bytes_verified"] == 2 * 64 * KiB
    assert sorted(os.listdir(res)) == ["loadtest-mount-2.json"]


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**63 - 1),
    step=st.integers(0, 2**31),
    rank=st.integers(0, 2**31),
    size=st.integers(0, 3 * MiB),
)
def test_shard_data_is_deterministic_and_distinct(seed, step, rank, size):
    a, b = ShardData(seed), ShardData(seed)
    buf = bytearray(loadtest.PIECE)
    one = b"".join(bytes(p) for p in a.pieces(step, rank, size, buf))
    two = b"".join(bytes(p) for p in b.pieces(step, rank, size, buf))
    assert one == two and len(one) == size
    if size >= loadtest.TAG.size:
        other = b"".join(bytes(p) for p in a.pieces(step, rank + 1, size, buf))
        assert other != one
        later = b"".join(bytes(p) for p in a.pieces(step + 1, rank, size, buf))
        assert later != one
