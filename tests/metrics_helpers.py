"""Helpers of the metrics tests: scraping an endpoint and parsing it with prometheus_client's
own parser, the naming conventions every family must follow (docs/metrics.md), and a real
Prometheus server bounded to a test (a tmp dir, a free loopback port, killed by its PID).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tectonic_py.launch import monitoring

# Labels a metric may carry: each takes values from a fixed set (an op's name, a wire code, an
# errno name, a service, a kind). Paths, ids, ranks, peers and ports are never labels.
ALLOWED_LABELS = {"op", "result", "errno", "service", "kind", "job", "le"}
UNIT_WORDS = re.compile(r"_(ms|milliseconds|us|microseconds|kb|kib|mb|mib|gb|gib|percent|pct)(_|$)")
QUANTILE_WORDS = re.compile(r"_(p50|p90|p95|p99|p999|quantile|percentile|median)(_|$)")


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        return str(r.read().decode())


def families(text: str) -> list[Any]:
    return list(text_string_to_metric_families(text))


def convention_problems(fams: list[Any]) -> list[str]:
    """What in ``fams`` breaks the Prometheus conventions of docs/metrics.md."""
    out = []
    for f in fams:
        name, kind = f.name, f.type
        if not name.startswith("tectonic_"):
            out.append(f"{name}: no tectonic_ prefix")
        if not f.documentation.strip():
            out.append(f"{name}: no help text")
        if kind not in ("counter", "gauge", "histogram"):
            out.append(f"{name}: type {kind} (latencies are histograms, never summaries)")
        if UNIT_WORDS.search(name):
            out.append(f"{name}: not in base units (seconds, bytes)")
        if QUANTILE_WORDS.search(name):
            out.append(f"{name}: a percentile as a metric (use a histogram)")
        if kind != "counter" and name.endswith("_total"):
            out.append(f"{name}: _total on a {kind}")
        if ("duration" in name or "latency" in name) and kind != "histogram":
            out.append(f"{name}: a duration that is not a histogram")
        if ("duration" in name or "latency" in name) and not name.endswith("_seconds"):
            out.append(f"{name}: a duration not in _seconds")
        if "bytes" in name and not name.endswith("_bytes"):
            out.append(f"{name}: bytes not as the unit suffix")
        sample: Sample
        for sample in f.samples:
            if kind == "counter" and not sample.name.endswith("_total"):
                out.append(f"{sample.name}: a counter sample without _total")
            extra = set(sample.labels) - ALLOWED_LABELS
            if extra:
                out.append(f"{sample.name}: unbounded or unknown labels {sorted(extra)}")
        if kind == "counter":
            base = name  # the parser strips _total from a counter family's name
            if base.endswith("_total"):
                out.append(f"{name}: counter family named with _total twice")
    return out


def family_names(fams: list[Any]) -> set[str]:
    return {f.name + ("_total" if f.type == "counter" else "") for f in fams}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    """A real Prometheus server scraping a cluster's targets every ``interval`` seconds."""

    def __init__(self, cluster_root: Path, workdir: Path, interval: float = 1.0) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.interval = interval
        workdir.mkdir(parents=True, exist_ok=True)
        self.config = workdir / "prometheus.yml"
        self.config.write_text(monitoring.prometheus_config(cluster_root, interval))
        self.log = workdir / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    "prometheus",
                    f"--config.file={self.config}",
                    f"--storage.tsdb.path={self.workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=1h",
                ],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(self.url("/-/ready"), timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("prometheus did not start:\n" + self.log.read_text()[-3000:])
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's vector result."""
        q = urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(self.url(f"/api/v1/query?{q}"), timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def value(self, promql: str) -> float | None:
        """The single value of a query, or None when it has no result (yet)."""
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, promql: str, ok: Any, timeout: float = 30.0) -> float:
        """Poll ``promql`` until ``ok(value)``; the value, or AssertionError with the last."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = self.value(promql)
            if last is not None and ok(last):
                return last
            time.sleep(0.25)
        raise AssertionError(f"{promql}: still {last} after {timeout} s")
