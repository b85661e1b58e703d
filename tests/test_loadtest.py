"""tectonic loadtest: small real bursts (client library on a local cluster, file I/O on a
directory standing in for a mount, and through a real FUSE mount of a local cluster),
corruption caught by the restore's checksums, time bounds, the creates figures, and bad
arguments refused with one clear line."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from metadata.client import RECONNECT_DEADLINE_S
from tectonic_py import loadtest
from tectonic_py.cli.loadtest import client_options
from tectonic_py.client.tectonic_client import open_client
from tectonic_py.core.errors import ConfigError
from tectonic_py.core.units import parse_size
from tectonic_py.launch.local_cluster import LocalCluster
from tectonic_py.loadtest import LoadtestConfig, RankResult, ShardData, run_loadtest
from tectonic_py.loadtest.coordinator import SHARD_STATS_WAIT_S, _Run
from tectonic_py.loadtest.metrics import Recorder, phase_figures
from tectonic_py.loadtest.report import creates_table, summary_table

REPO = Path(__file__).resolve().parent.parent
KiB = 1024
MiB = 1024 * KiB


@pytest.fixture
def local_cluster(shared_local_cluster: LocalCluster) -> LocalCluster:
    """One cluster for the module's client-library runs: none kills or stops a daemon."""
    return shared_local_cluster


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
    # no open() without a mount: the client's create call is what is timed
    assert result["create_call"] == "client.create"
    assert result["files_created"] == result["files_written"] == 64
    assert 0 < result["open_ms"]["p50"] <= result["open_ms"]["max"]
    assert 0 < result["open_share"] < 1
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


async def test_group_commit_figures_never_wait_out_a_dead_metadata_server(autojump_clock, caplog):
    """A metadata server killed during the burst (tests/test_metadata_etcd.py's 1,024 ranks)
    would hold ``server.stats`` for the client's reconnect deadline: the figures are left
    out after SHARD_STATS_WAIT_S instead, with one warning."""

    class DeadServer:
        async def server_stats(self):  # type: ignore[no-untyped-def]
            await trio.sleep(RECONNECT_DEADLINE_S)
            raise AssertionError("waited out the reconnect deadline")

    run = _Run(LoadtestConfig(through_mount="/x", ranks=1), None, False, meta=DeadServer())
    start = trio.current_time()
    assert await run._shard_stats() is None
    assert trio.current_time() - start == pytest.approx(SHARD_STATS_WAIT_S)
    assert "no group-commit figures" in caplog.text


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
    for key in (
        "errors",
        "ranks",
        "write_gbps",
        "read_gbps",
        "pause_s",
        "bytes_verified",
        "files_created",
        "creates_per_s",
        "open_ms",
        "open_share",
        "create_call",
    ):
        assert key in out
    assert out["files_created"] == 8 and out["open_ms"]["max"] > 0
    assert "creates: open() per write step" in r.stderr  # the table (stderr under --json)
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


def _rank(step, rank, *, open_s, busy_s, t_done, error=None, phase="write"):
    return RankResult(
        rank, step, phase, 100, 0.01, t_done, 0, error=error, open_s=open_s, busy_s=busy_s
    )


def test_creates_figures_per_step_and_overall():
    """files created are the ranks whose create returned (a rank that failed later still
    created its file; one whose open failed did not); creates/s is over the burst's wall time
    (barrier to last close), not over the time spent in open(); open() times are ms
    quantiles; the share is seconds in open() over seconds on the files, summed over ranks.
    The run's figures pool the steps' ranks and sum their wall times; a read has no creates."""
    cfg = LoadtestConfig(through_mount="/mnt", ranks=4, steps=2, run_dir="/r")
    rec = Recorder(cfg)
    step1 = [
        _rank(1, 0, open_s=0.001, busy_s=0.5, t_done=0.5),
        _rank(1, 1, open_s=0.003, busy_s=1.0, t_done=1.0),
        _rank(1, 2, open_s=0.002, busy_s=0.8, t_done=0.9, error="OSError: EIO on write"),
        _rank(1, 3, open_s=None, busy_s=0.1, t_done=0.1, error="OSError: EACCES on open"),
    ]
    step2 = [_rank(2, r, open_s=0.010 * (r + 1), busy_s=0.2, t_done=0.25) for r in range(4)]
    reads = [_rank(2, r, open_s=0.0005, busy_s=0.1, t_done=0.1, phase="read") for r in range(4)]
    phases = [("write", 1, step1), ("write", 2, step2), ("read", 2, reads)]
    for phase, step, results in phases:
        rec.add_phase(phase_figures(phase, step, 0.0, results, [], {}), results)

    one, two, read = rec.phases
    assert one["files_created"] == 3 and one["files"] == 2  # created vs written whole
    assert one["seconds"] == 1.0 and one["creates_per_s"] == pytest.approx(3.0)
    assert one["open_ms"] == {
        "p50": pytest.approx(2.0),
        "p99": pytest.approx(2.98),
        "max": pytest.approx(3.0),
    }
    assert one["open_share"] == pytest.approx(0.006 / 2.3)
    assert two["files_created"] == 4 and two["creates_per_s"] == pytest.approx(4 / 0.25)
    assert two["open_ms"]["max"] == pytest.approx(40.0)
    assert two["open_share"] == pytest.approx(0.1 / 0.8)
    assert "files_created" not in read and "creates_per_s" not in read
    assert read["open_ms"]["max"] == pytest.approx(0.5)

    result = rec.result(processes=2, worker_max_rss=0, watched_max_rss=0)
    assert result["create_call"] == "open(O_CREAT|O_TRUNC)"
    assert result["files_created"] == 7
    assert result["creates_per_s"] == pytest.approx(7 / 1.25)
    assert result["open_ms"]["p50"] == pytest.approx(10.0)  # of 1, 3, 2, 10, 20, 30, 40 ms
    assert result["open_ms"]["max"] == pytest.approx(40.0)
    assert result["open_share"] == pytest.approx(0.106 / 3.1)
    # the old figure, under its own name: ranks over the time until the last create returned
    assert result["creates_per_s_until_last_open"] == pytest.approx(8 / 0.02)

    text = _rendered(summary_table(result)) + _rendered(creates_table(result))
    assert "creates/s (files / burst wall time)" in text and "5.6" in text
    assert "open() ms p50/p99/max" in text and "3.4%" in text  # 0.106 / 3.1
    assert "timed in each rank's thread" in text


def test_creates_figures_absent_when_nothing_was_timed():
    """A run with no write burst (verify-only) has no creates figures: null, not zero."""
    rec = Recorder(LoadtestConfig(cluster_file="c.toml", ranks=2, run_dir="/r"))
    result = rec.result(processes=1, worker_max_rss=0, watched_max_rss=0)
    assert result["create_call"] == "client.create" and result["files_created"] == 0
    assert result["creates_per_s"] is None
    assert result["open_ms"] is None and result["open_share"] is None
    text = _rendered(summary_table(result)) + _rendered(creates_table(result))
    assert "client.create ms p50/p99/max" in text and "no open() without a mount" in text


def _rendered(table) -> str:
    from rich.console import Console

    console = Console(width=200, record=True, file=io.StringIO())
    console.print(table)
    return console.export_text()


@pytest.mark.fuse
async def test_creates_and_open_times_through_a_real_fuse_mount(mount):
    """A small burst through a real FUSE mount of a local cluster: every file written was
    created and counted once, each open() took a measurable time, and the figures hold
    together per step and overall."""
    cfg = LoadtestConfig(
        through_mount=os.fspath(mount),
        ranks=4,
        processes=2,
        shard_size=256 * KiB,
        steps=2,
        run_dir="/lt-creates",
        max_seconds=180,
        watch_pids=[mount.pid],
    )
    result = await run_loadtest(cfg)
    assert result["errors"] == 0, result["error_samples"]
    assert result["create_call"] == "open(O_CREAT|O_TRUNC)"
    assert result["files_created"] == result["files_written"] == 4 * 2
    writes = [p for p in result["phases"] if p["phase"] == "write"]
    assert [p["files_created"] for p in writes] == [4, 4]
    for fig in (*writes, result):
        ms = fig["open_ms"]
        assert 0 < ms["p50"] <= ms["p99"] <= ms["max"]
        assert 0 < fig["open_share"] < 1
    for p in writes:
        assert p["creates_per_s"] == pytest.approx(4 / p["seconds"])
        # open() is timed alone: it ends before the rank's last close
        assert p["open_ms"]["max"] / 1000 < p["seconds"]
    wall = sum(p["seconds"] for p in writes)
    assert result["creates_per_s"] == pytest.approx(8 / wall)
    assert not (mount / "lt-creates").exists()  # cleaned up through the mount
