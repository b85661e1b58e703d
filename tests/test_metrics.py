"""The metrics of every process (docs/metrics.md): each endpoint's exposition parses with
prometheus_client's own parser, every family follows the naming conventions (tectonic_
prefix, base units, counters in _total, latencies as histograms, only bounded labels) and
is listed in docs/metrics.md; the endpoint answers HTTP as a scraper expects; a process
without metrics has no families at all.

The cluster, the mount and a client are real processes (a client opened in this process
with ``metrics_listen``), after a file went through the mount and one through the client,
so that the labelled families have samples.
"""

from __future__ import annotations

import json
import os
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import trio
from cluster_fixtures import suite_cluster
from fuse_fixtures import FUSE_CHUNK_SIZE, Mount, fuse_skip_reason
from metrics_helpers import convention_problems, families, family_names, scrape

from tectonic_py.client.tectonic_client import open_client
from tectonic_py.core.metrics import Metrics
from tectonic_py.core.metrics_http import serve_metrics

REPO = Path(__file__).resolve().parent.parent
MAINTENANCE_ARGS = ["--interval", "1", "--inventory-interval", "2"]


def _documented() -> set[str]:
    return set(re.findall(r"`(tectonic_[a-z_]+)`", (REPO / "docs" / "metrics.md").read_text()))


@pytest.mark.fuse
async def test_every_process_exposes_conventional_metrics(tmp_path: Path) -> None:
    reason = fuse_skip_reason()
    if reason:
        pytest.skip(reason)
    cluster = suite_cluster(
        tmp_path / "cluster",
        chunk_size=FUSE_CHUNK_SIZE,
        metrics=True,
        maintenance=True,
        maintenance_args=MAINTENANCE_ARGS,
    )
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mount = Mount(cluster, mnt, tmp_path / "mount.log")
    ready = tmp_path / "mount.ready"
    with cluster:
        try:
            mount.start("--metrics-listen", "127.0.0.1:0", "--ready-file", str(ready))
            (mnt / "f.bin").write_bytes(os.urandom(3 * 1024 * 1024))
            assert (mnt / "f.bin").read_bytes()[:10]
            async with open_client(cluster.client_file, metrics_listen="127.0.0.1:0") as client:
                w = await client.create("/g.bin")
                await w.write(os.urandom(2 * 1024 * 1024))
                await w.close()
                endpoints = {e["process"]: e["url"] for e in _cluster_endpoints(cluster.root)}
                endpoints["mount"] = f"http://{json.loads(ready.read_text())['metrics']}/metrics"
                endpoints["client"] = f"http://{client.metrics_address}/metrics"
                texts = {p: await trio.to_thread.run_sync(scrape, u) for p, u in endpoints.items()}
                stats = await trio.run_process(
                    [sys.executable, "-m", "tectonic_py.cli.main", "stats",
                     str(cluster.cluster_file), "--json", "--interval", "0.5"],
                    capture_stdout=True, cwd=REPO,
                )  # fmt: skip
        finally:
            mount.stop()
    assert len(texts) == 9 + 2 + 1 + 2  # stores, metadata servers, maintenance, mount, client
    seen: set[str] = set()
    for process, text in texts.items():
        fams = families(text)
        assert fams, process
        assert convention_problems(fams) == [], process
        seen |= family_names(fams)
    undocumented = seen - _documented()
    assert not undocumented, f"add to docs/metrics.md: {sorted(undocumented)}"
    view = json.loads(stats.stdout)
    assert view["processes_answering"] == 12  # (the mount and client are not in metrics.json)
    assert sorted(view["stores"]) == [f"chunkstore-{i}" for i in range(9)]
    assert view["cluster"]["degraded blocks"] == 0
    assert set(view["latencies"]) >= {"chunk put", "metadata op", "FUSE write"}
    # the work moved what it should, each in its own process
    mount_fams = {f.name: f for f in families(texts["mount"])}
    writes = [s for s in mount_fams["tectonic_fuse_bytes"].samples if s.labels["op"] == "write"]
    assert writes[0].value >= 3 * 1024 * 1024
    assert _value(texts["client"], "tectonic_client_written_bytes_total") >= 2 * 1024 * 1024
    stored = sum(
        _value(texts[f"chunkstore-{i}"], "tectonic_chunkstore_put_bytes_total") for i in range(9)
    )
    assert stored >= 1.5 * 5 * 1024 * 1024


def _cluster_endpoints(root: Path) -> list[dict[str, str]]:
    return list(json.loads((root / "metrics.json").read_text()))


def _value(text: str, sample_name: str) -> float:
    return sum(s.value for f in families(text) for s in f.samples if s.name == sample_name)


async def test_the_endpoint_answers_as_a_scraper_expects() -> None:
    metrics = Metrics()
    metrics.counter("tectonic_test_things_total", "Things").inc(3)
    refreshed = []

    async def hook() -> None:
        refreshed.append(1)

    metrics.on_scrape(hook)
    async with trio.open_nursery() as nursery:
        address = await nursery.start(serve_metrics, metrics, "127.0.0.1", 0)

        def get(path: str, method: str = "GET") -> tuple[int, bytes]:
            req = urllib.request.Request(f"http://{address}{path}", method=method)
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    return r.status, r.read()
            except urllib.error.HTTPError as e:
                return e.code, b""

        status, body = await trio.to_thread.run_sync(get, "/metrics")
        assert status == 200 and b"tectonic_test_things_total 3.0" in body
        assert refreshed == [1]
        assert (await trio.to_thread.run_sync(get, "/nothing"))[0] == 404
        assert (await trio.to_thread.run_sync(get, "/metrics", "POST"))[0] == 405
        nursery.cancel_scope.cancel()


def test_a_process_without_metrics_keeps_nothing() -> None:
    metrics = Metrics.off()
    metrics.counter("tectonic_test_things_total", "Things").labels("x").inc()
    metrics.histogram("tectonic_test_seconds", "Seconds").observe(1.0)
    metrics.collector(lambda: pytest.fail("a collector of a process without metrics ran"))
    assert metrics.exposition() == b""
