"""Every bench script of this part in --smoke mode, so none of them can rot unnoticed.

The figures of a smoke run mean nothing (tiny sizes on a shared machine); these tests check
that each script runs end to end, emits the JSON shape the report reads, and leaves no mount
and no process behind. Nothing here is timed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from bench import ceilings
from bench.nullfs import NullFSError, fuse_available, mount_nullfs, nullfs_mounted, unmount

REPO = Path(__file__).resolve().parent.parent
MiB = 1024 * 1024


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
        check=False,
    )


def _mounts() -> str:
    with open("/proc/self/mounts") as f:
        return f.read()


def test_ceilings_smoke(tmp_path):
    r = _run("bench.ceilings", "--smoke", "--json", "--dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for name in (
        "disk_write_fsync",
        "disk_read_cold",
        "disk_write_direct_fsync",
        "disk_read_direct",
        "zfec_encode_rs6_3_t1",
        "zfec_decode_rs6_3_t2",
        "tcp_raw_blocking",
        "tcp_trio_recv_into",
        "wire_put",
        "wire_get",
    ):
        assert out[name]["mbps"] > 0 and out[name]["cpu_s_per_gib"] is not None, name
    assert out["msgpack_1mib"]["pack_us"] > 0
    assert os.listdir(tmp_path) == []  # the disk test file and tmp dir are removed


def test_ceiling_functions_move_what_they_say(tmp_path):
    w = ceilings.disk_write(tmp_path, 3 * MiB + 5)
    assert w["bytes"] == 3 * MiB + 5 == os.path.getsize(w["path"])
    assert ceilings.disk_read(tmp_path, 3 * MiB + 5)["bytes"] == 3 * MiB + 5
    # O_DIRECT moves whole 4 KiB blocks: the file is the size rounded up, a read of the
    # buffered file stops at its end, and both are direct on a disk that allows it
    d = ceilings.disk_read_direct(tmp_path, 3 * MiB + 5)
    assert d["bytes"] == 3 * MiB + 5 and d["direct"]
    os.unlink(w["path"])
    w = ceilings.disk_write_direct(tmp_path, 3 * MiB + 5, block=MiB)
    assert w["bytes"] == 3 * MiB + 4096 == os.path.getsize(w["path"]) and w["direct"]
    assert ceilings.disk_read_direct(tmp_path, 3 * MiB + 5, block=MiB)["bytes"] == 3 * MiB + 5
    os.unlink(w["path"])
    put_shaped = ceilings.files_write_direct(tmp_path, 5, 64 * 1024 + 5, threads=2)
    assert put_shaped["bytes"] == 5 * (64 * 1024 + 4096) and put_shaped["files"] == 5
    assert os.listdir(tmp_path) == []  # its files and directory are gone
    assert ceilings.tcp_raw(5 * MiB + 1)["bytes"] == 5 * MiB + 1
    assert ceilings.tcp_trio(5 * MiB + 1)["bytes"] == 5 * MiB + 1
    wire = ceilings.tcp_wire(4 * MiB, inflight=3)
    assert wire["wire_put"]["bytes"] == wire["wire_get"]["bytes"] == 4 * MiB
    # decode checks its own output against the data before it is timed
    assert ceilings.zfec_decode(6, 3, 6 * 4096, 2, 1)["bytes"] == 2 * 6 * 4096


@pytest.mark.fuse
def test_nullfs_smoke_and_always_unmounted(tmp_path):
    reason = fuse_available()
    if reason:
        pytest.skip(reason)
    r = _run("bench.nullfs", "--smoke", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["daemon_stats"]["bytes_written"] == 16 * MiB
    assert out["daemon_stats"]["bytes_read"] == 16 * MiB  # the read was cold: it reached us
    mnt = tmp_path / "mnt"
    try:
        with nullfs_mounted(mnt) as mount:
            (mnt / "d").mkdir()
            (mnt / "d" / "f").write_bytes(b"x" * 5000)
            assert (mnt / "d" / "f").read_bytes() == bytes(5000)  # contents discarded
            os.rename(mnt / "d" / "f", mnt / "d" / "g")
            assert os.listdir(mnt / "d") == ["g"]
            with pytest.raises(OSError):
                os.rmdir(mnt / "d")
            raise RuntimeError("the body failed")
    except RuntimeError:
        pass
    assert str(mnt) not in _mounts()
    assert mount.proc.poll() is not None
    assert mount.stats()["bytes_written"] == 5000


@pytest.mark.fuse
def test_nullfs_bad_mountpoint_is_a_clear_error(tmp_path):
    if fuse_available():
        pytest.skip(fuse_available())
    target = tmp_path / "file"
    target.write_text("not a directory")
    with pytest.raises((NullFSError, OSError)):
        m = mount_nullfs(target, read_ahead_kb=None, timeout=20)
        unmount(m)
    assert str(target) not in _mounts()


def _reap_gluster_under(root) -> None:
    """If bench.gluster was killed (timeout) its own teardown never ran: glusterd runs in a
    session of its own and would outlive the test. Every gluster process of that run names
    ``root`` (or a volume whose bricks are under it) in its command line: end those only."""
    gluster = [
        (p, " ".join(p.info["cmdline"] or []))
        for p in psutil.process_iter(["name", "cmdline"])
        if (p.info["name"] or "").startswith("gluster")
    ]
    # The self-heal daemon names only the volume ("shd/tbenchNNN"), learnt from the bricks.
    marks = {str(root)} | {
        m for _, cmd in gluster if str(root) in cmd for m in re.findall(r"tbench\d+", cmd)
    }
    ours = [p for p, cmd in gluster if any(m in cmd for m in marks)]
    for p in ours:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(ours, timeout=10)


def test_gluster_smoke_runs_or_says_why(tmp_path):
    """The peer: built, measured and torn down; or one clear reason it cannot run here."""
    try:
        r = _run("bench.gluster", "--smoke", "--json", "--root", str(tmp_path), timeout=600)
    finally:
        _reap_gluster_under(tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    if not out["available"]:
        assert out["reason"]
        return
    for key in ("dd_write", "dd_read", "torch_save", "torch_load"):
        assert out[key]["mbps"] > 0 and out[key]["cpu_s_per_gib"] > 0, key
    assert out["torch_load"]["verified"] is True
    assert out["loadtest"]["errors"] == 0
    assert out["loadtest"]["bytes_verified"] == out["loadtest"]["bytes_written"] > 0
    assert "glusterfs" not in _mounts()
    assert not [
        p for p in psutil.process_iter(["cmdline"]) if "tbench" in " ".join(p.info["cmdline"] or [])
    ]
    assert os.listdir(tmp_path) == []


@pytest.mark.fuse
def test_run_all_smoke_writes_a_report(tmp_path):
    out_dir = tmp_path / "out"
    r = _run(
        "bench.run_all",
        "--smoke",
        "--skip",
        "ceilings,nullfs,others,peer",
        "--out-dir",
        str(out_dir),
        "--workdir",
        str(tmp_path),
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    report = (out_dir / "REPORT.md").read_text()
    assert "| workload | tectonic-py MB/s" in report and "## Checkpoint burst" in report
    assert (out_dir / "report.png").stat().st_size > 10_000
    results = json.loads((out_dir / "results.json").read_text())
    tec = results["tectonic"]
    assert tec.get("status") != "failed", tec
    for part in ("fuse_dd", "fuse_torch", "mount_burst"):
        assert tec[part].get("status") != "failed", (part, tec[part])
    assert tec["fuse_torch"]["torch_load"]["verified"] is True
    for burst in tec["bursts"]:
        assert burst["errors"] == 0 and burst["bytes_verified"] == burst["bytes_written"] > 0
    # the smoke burst runs beside one stream of its bytes: the per-file rows are filled
    (smoke_burst,) = tec["bursts"]
    assert smoke_burst["cpu_ms_per_file"] is not None and smoke_burst["pause_over_stream"] > 0
    assert "CPU ms/file" in report and "CPU per file" in report
    # the sections issue 35 added, each at tiny sizes, each with its command
    for part in ("dirops", "inplace", "appends", "restore"):
        assert tec[part].get("status") != "failed", (part, tec[part])
    restore = tec["restore"]
    assert len(restore["killed"]) == 3  # m of RS(6,3)
    for phase in ("healthy", "degraded"):
        got = restore[phase]
        assert got["errors"] == 0 and got["bytes_verified"] == restore["write"]["bytes_written"]
    onedir = results["onedir"]
    assert onedir["status"] == "ok" and onedir["exit"] == 0, onedir
    assert set(onedir["targets"]) == {"ours", "local"}  # --skip peer: no GlusterFS, JuiceFS
    for heading in NEW_SECTIONS:
        assert heading in report, heading
    assert "| burst pause (s) |" in report and "| wal |" in report
    assert results["expected_s"] > 0 and results["part_seconds"]["restore"] > 0
    assert str(tmp_path) not in _mounts()
    assert [p for p in os.listdir(tmp_path) if p.startswith("bench-run-")] == []


@pytest.mark.fuse
def test_bench_metrics_smoke():
    """bench_metrics runs both configurations (a cluster and a mount each) and leaves no
    mount behind; with metrics on, every daemon and the mount were scraped."""
    reason = fuse_available()
    if reason:
        pytest.skip(reason)
    before = _mounts()
    r = _run("bench.bench_metrics", "--smoke", "--json", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert [run["metrics"] for run in out["runs"]] == [False, True]
    assert out["runs"][1]["endpoints_scraped"] == 10 + 2 + 1  # stores, metadata, mount
    assert out["save_s_on_over_off"] > 0 and out["burst_pause_s_on_over_off"] > 0
    assert _mounts().count("bench-metrics-") == before.count("bench-metrics-") == 0


def test_bench_save_smoke():
    """bench_save and byte_budget run at small sizes: ours beside the disk, with the CPU of
    each process of ours, and each pass alone."""
    reason = fuse_available()
    if reason:
        pytest.skip(reason)
    before = _mounts()
    r = _run("bench.bench_save", "--size", "32", "--repeat", "1", "--no-peers", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    split = out["tectonic"]["torch_save"]["cpu_s_by_process"]
    assert set(split) == {"torch", "mount", "chunk stores", "metadata"}
    assert out["disk"]["torch_load"]["verified"] and out["tectonic"]["torch_load"]["verified"]
    assert _mounts().count("bench-save-") == before.count("bench-save-") == 0
    r = _run("bench.byte_budget", "--mib", "48", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["chunks per GiB"] == 384.0


NEW_SECTIONS = (
    "## The checkpoint burst into one directory",
    "## Creates in one directory",
    "## Restore with m chunk stores lost",
    "## Small files share blocks",
    "## Small in-place writes",
    "## Small fsync'd appends",
    "## Metrics on and off",
)


def test_report_renders_every_section_of_a_run_that_measured_nothing():
    """A run stopped early, or with parts skipped, still leaves a whole report: each section
    says it was not measured, and names the command that reproduces it."""
    from bench.report import render_report

    report = render_report({"smoke": True, "tectonic": {"restore": {"status": "failed"}}}, "p.png")
    for heading in NEW_SECTIONS:
        section = report.split(heading, 1)[1].split("\n## ", 1)[0]
        assert "Reproduce: `python -m bench.run_all --only " in section, heading
    assert "Not measured in this run (onedir was skipped)" in report
    assert "**Failed:**" in report.split("## Restore", 1)[1].split("\n## ", 1)[0]


def test_bench_sharing_smoke_through_run_all(tmp_path):
    """The optional ``sharing`` part (bench.bench_sharing: two load tests of jobs weighted
    1:3 at once, and one alone) runs through run_all --only, and its section is in the
    report; a run that does not name it leaves it out. Ratios are the benchmark's to judge,
    not a smoke run's."""
    from bench.run_all import OPTIONAL_PARTS, PARTS

    assert "sharing" in PARTS and "sharing" in OPTIONAL_PARTS
    out_dir = tmp_path / "out"
    r = _run(
        "bench.run_all", "--smoke", "--only", "sharing", "--out-dir", str(out_dir),
        "--workdir", str(tmp_path), timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads((out_dir / "results.json").read_text())
    sharing = results["sharing"]
    assert sharing["status"] == "ok" and sharing["errors"] == 0, sharing
    assert set(sharing["together_bytes_s"]) == {"a", "b"} and sharing["alone_bytes_s"] > 0
    assert "ratio_a_to_b" in sharing and sharing["weights"] == {"a": 1, "b": 3}
    assert "## Jobs sharing a cluster" in (out_dir / "REPORT.md").read_text()
    assert [p for p in os.listdir(tmp_path) if p.startswith("bench-run-")] == []
