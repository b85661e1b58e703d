"""bench_burst runs end to end on tiny sizes (local disk and our mount) so it cannot rot, and
its pure pieces (arguments, how ranks are dealt, percentiles, ratios, the report) do what
they say. No figure is asserted: tiny sizes on a shared machine mean nothing."""

from __future__ import annotations

import argparse
import json
import os

import psutil
import pytest
from test_bench_smoke import _mounts, _run

from bench.bench_burst import assign, format_plain, parse_args, percentile, ratios, targets_arg
from bench.nullfs import fuse_available


def test_targets_are_checked_and_kept_in_the_order_given():
    assert targets_arg("local, ours,local") == ["local", "ours"]
    for bad in ("ours,nfs", "", ","):
        with pytest.raises(argparse.ArgumentTypeError):
            targets_arg(bad)
    args = parse_args([])
    assert args.targets == ["ours", "gluster", "juicefs", "local"]
    assert (args.ranks, args.size, args.procs, args.threads) == (1024, 1 << 20, 4, 8)
    assert parse_args(["--size", "64KiB"]).size == 64 * 1024
    smoke = parse_args(["--smoke"])
    assert (smoke.ranks, smoke.size, smoke.procs, smoke.threads) == (8, 4096, 2, 2)
    assert smoke.skip_users


def test_mounts_need_the_ours_target(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--targets", "local", "--mounts", "2"])
    assert "--mounts" in capsys.readouterr().err


def test_every_rank_once_and_each_mount_its_share():
    plan = assign(10, 1, 4)
    assert [d for d, _ in plan] == [0, 0, 0, 0]
    assert sorted(r for _, ranks in plan for r in ranks) == list(range(10))
    # 3 processes asked, 2 mounts: 2 processes per mount, 16 / 2 ranks through each mount
    plan = assign(16, 2, 3)
    assert len(plan) == 4
    per_mount = [sum(len(ranks) for d, ranks in plan if d == m) for m in (0, 1)]
    assert per_mount == [8, 8]
    assert len(assign(2, 1, 4)) == 2  # no process without a rank


def test_percentile_is_the_nearest_rank():
    xs = [float(i) for i in range(1, 101)]
    assert percentile(xs, 50) == 50.0 and percentile(xs, 99) == 99.0
    assert percentile(xs[::-1], 100) == 100.0
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) == 0.0


def _results() -> dict:
    burst = {"pause_s": 2.0, "creates_per_s": 512.0, "open_ms_p50": 1.0, "open_ms_p99": 4.0}
    return {
        "config": {
            "ranks": 1024,
            "size": 1 << 20,
            "procs": 4,
            "threads": 8,
            "mounts": 0,
            "load_before": [1.0, 1.0, 1.0],
            "load_after": [2.0, 2.0, 2.0],
        },
        "targets": {
            "ours": {"available": True, "burst": burst, "creates": {"error": "OSError: boom"}},
            "gluster": {"available": False, "reason": "GlusterFS needs root"},
            "local": {
                "available": True,
                "burst": {**burst, "pause_s": 0.5, "creates_per_s": 2048.0},
                "creates": {"seconds": 0.2, "ms_per_file": 0.2},
            },
        },
    }


def test_ratios_are_of_times_ours_over_theirs():
    results = _results()
    r = ratios(results)
    assert list(r) == ["ours / local"]  # gluster did not run: no ratio to it
    assert r["ours / local"]["burst.pause_s"] == 4.0
    assert "burst.creates_per_s" not in r["ours / local"]  # a rate, not a time
    assert "creates.seconds" not in r["ours / local"]  # ours failed there


def test_the_report_says_who_did_not_run_and_what_failed():
    results = _results()
    results["ratios"] = ratios(results)
    text = format_plain(results)
    assert "ours / local" in text and "4.00" in text
    assert "gluster: not measured: GlusterFS needs root" in text
    assert "ours creates: failed: OSError: boom" in text


@pytest.mark.fuse
def test_bench_burst_smoke_on_local_disk_and_our_mount(tmp_path):
    reason = fuse_available()
    if reason:
        pytest.skip(reason)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    out = tmp_path / "burst.json"
    r = _run(
        "bench.bench_burst",
        *("--targets", "ours,local", "--ranks", "8", "--size", "4KiB"),
        *("--procs", "2", "--threads", "2", "--skip-users"),
        *("--dir", str(scratch), "--json", str(out)),
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    results = json.loads(out.read_text())
    for name in ("ours", "local"):
        t = results["targets"][name]
        assert t["available"], t
        burst = t["burst"]
        assert burst["errors"] == 0 and burst["verified"], burst
        assert burst["processes"] == 2 and burst["pause_s"] > 0
        assert burst["open_ms_max"] >= burst["open_ms_p99"] >= burst["open_ms_p50"] >= 0
        assert t["creates"]["files"] == 1024 and t["creates"]["seconds"] > 0
        assert "users" not in t
    assert {"burst.pause_s", "creates.seconds"} <= set(results["ratios"]["ours / local"])
    assert "ours / local" in r.stdout
    # nothing left behind: no mount, no process of the run, no scratch data
    assert str(tmp_path) not in _mounts()
    assert os.listdir(scratch) == []
    assert not [
        p
        for p in psutil.process_iter(["cmdline"])
        if str(tmp_path) in " ".join(p.info["cmdline"] or [])
    ]
