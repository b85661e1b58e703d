"""A real Prometheus server (Debian's ``prometheus``; deploy/install.sh installs it) scrapes
a running cluster and a mount every second, and its query API shows the counters moving as
the work did: a ``tectonic put`` of an RS(6,3) file stores at least 1.5x its bytes across
the chunk stores, a load test through the mount moves the FUSE, client and metadata counters
and gives the histograms a p99; a killed chunk store shows in the degraded-blocks gauge
within one scrape of ``tectonic status`` showing it.

The server is bounded to the test: its own tmp dir, a free loopback port, the scrape
configuration ``cluster up`` writes (at a 1 s interval), killed by its PID in ``finally``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_fixtures import suite_cluster
from fuse_fixtures import FUSE_CHUNK_SIZE, REPO_ROOT, Mount, fuse_skip_reason
from metrics_helpers import Prometheus

from tectonic_py.launch import monitoring

MiB = 1024 * 1024
PUT_BYTES = 30 * MiB  # five RS(6,3) blocks of 6 MiB (1 MiB chunks)
RANKS, SHARD = 16, 1 * MiB


def _tectonic(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tectonic_py.cli.main", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.fuse
def test_prometheus_sees_the_work_and_a_lost_store(tmp_path: Path) -> None:
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus is not installed (deploy/install.sh installs it)")
    reason = fuse_skip_reason()
    if reason:
        pytest.skip(reason)
    cluster = suite_cluster(
        tmp_path / "cluster",
        chunk_size=FUSE_CHUNK_SIZE,
        node_timeout=3.0,
        metrics=True,
        maintenance=True,
        maintenance_args=["--interval", "1"],
    )
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mount = Mount(cluster, mnt, tmp_path / "mount.log")
    prom = Prometheus(cluster.root, tmp_path / "prometheus", interval=1.0)
    with cluster:
        try:
            ready = tmp_path / "mount.ready"
            mount.start("--metrics-listen", "127.0.0.1:0", "--ready-file", str(ready))
            address = json.loads(ready.read_text())["metrics"]
            monitoring.add_target(cluster.root, "mount", address)
            prom.start()
            targets = 9 + 2 + 1 + 1
            prom.wait_for('count(up{job="tectonic"} == 1)', lambda v: v == targets)

            _put_is_seen(cluster.client_file, tmp_path, prom)
            _loadtest_is_seen(mnt, prom)
            _dashboard_queries_answer(prom)
            _lost_store_is_seen(cluster, prom)
        finally:
            prom.stop()
            mount.expect_warnings = True  # (a store is killed under it)
            mount.stop()


def _put_is_seen(client_file: Path, tmp_path: Path, prom: Prometheus) -> None:
    stored = 'sum(tectonic_chunkstore_put_bytes_total{job="tectonic"})'
    before = prom.value(stored) or 0.0
    local = tmp_path / "put.bin"
    local.write_bytes(os.urandom(PUT_BYTES))
    r = _tectonic("put", str(client_file), str(local), "/put.bin")
    assert r.returncode == 0, r.stderr
    prom.wait_for(stored, lambda v: v - before >= 1.5 * PUT_BYTES)
    prom.wait_for(
        'sum(tectonic_chunkstore_operations_total{op="put",result="ok"})', lambda v: v >= 45
    )
    prom.wait_for(
        'sum(tectonic_metadata_operations_total{op=~"file.*",result="ok"})', lambda v: v > 0
    )
    # the fsync histogram has observations for every stored chunk
    prom.wait_for("sum(tectonic_chunkstore_fsync_duration_seconds_count)", lambda v: v >= 45)


def _loadtest_is_seen(mnt: Path, prom: Prometheus) -> None:
    fuse_writes = 'sum(tectonic_fuse_bytes_total{op="write",process="mount"})'
    before = prom.value(fuse_writes) or 0.0
    r = _tectonic(
        "loadtest", "--through-mount", str(mnt), "--ranks", str(RANKS),
        "--shard-size", "1MiB", "--no-plot", "--no-progress", "--results-dir",
        str(mnt.parent / "results"), timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    prom.wait_for(fuse_writes, lambda v: v - before >= RANKS * SHARD)
    prom.wait_for(
        'sum(tectonic_client_written_bytes_total{process="mount"})', lambda v: v >= RANKS * SHARD
    )
    prom.wait_for('sum(tectonic_fuse_operations_total{op="create"})', lambda v: v >= RANKS)
    prom.wait_for('sum(tectonic_fuse_bytes_total{op="read"})', lambda v: v >= RANKS * SHARD)
    # The cumulative buckets, not a rate: a rate over a window can miss a burst that ended
    # before its window (the CI run met NaN there), and the quantile is the histogram's test.
    p99 = prom.wait_for(
        "histogram_quantile(0.99, sum by (le) ("
        'tectonic_fuse_operation_duration_seconds_bucket{op="write"}))',
        lambda v: v > 0,
    )
    assert p99 < 60
    prom.wait_for("sum(tectonic_metadata_group_commit_batch_size_count)", lambda v: v > 0)


def _dashboard_queries_answer(prom: Prometheus) -> None:
    """Every query of deploy/monitoring's Grafana dashboard is valid PromQL over names the
    processes export: each returns data after the put and the load test."""
    dashboard = json.loads((REPO_ROOT / "deploy/monitoring/grafana-dashboard.json").read_text())
    queries = {
        f"{panel['title']}: {target['expr']}": target["expr"].replace("$__rate_interval", "1m")
        for panel in dashboard["panels"]
        for target in panel["targets"]
        if "errno" not in target["expr"] and "result!=" not in target["expr"]
    }
    # A rate needs two scrapes of its series inside the window: on a loaded machine a slow
    # scrape of the mount can leave one, so an empty answer is asked again for a while.
    deadline = time.monotonic() + 30.0
    empty = [name for name, expr in queries.items() if not prom.query(expr)]
    while empty and time.monotonic() < deadline:
        time.sleep(1.0)
        empty = [name for name in empty if not prom.query(queries[name])]
    assert not empty, empty


def _lost_store_is_seen(cluster: object, prom: Prometheus) -> None:
    assert prom.value("max(tectonic_maintenance_degraded_blocks)") == 0.0
    cluster.kill_chunkstore(0)  # type: ignore[attr-defined]
    deadline = time.monotonic() + 60
    while True:
        r = _tectonic("status", str(cluster.cluster_file), "--json")  # type: ignore[attr-defined]
        status = json.loads(r.stdout)
        if status["degraded_blocks"]:
            break
        assert time.monotonic() < deadline, "status never showed the lost store"
        time.sleep(0.2)
    shown = time.monotonic()
    assert status["metrics"] and all(
        e["url"].startswith("http://127.0.0.1:") for e in status["metrics"]
    )
    degraded = len(status["degraded_blocks"])
    # within one scrape (1 s) of status, and the ingestion and query after it
    prom.wait_for("max(tectonic_maintenance_degraded_blocks)", lambda v: v >= degraded, timeout=3.0)
    assert time.monotonic() - shown <= 3.0
    prom.wait_for("max(tectonic_maintenance_nodes_down)", lambda v: v == 1, timeout=3.0)
    prom.wait_for('up{process="chunkstore-0"}', lambda v: v == 0, timeout=5.0)
