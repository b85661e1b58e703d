"""Where a local cluster's metrics are, for Prometheus and for people: written by the
launcher (``tectonic cluster up``) whenever a daemon (re)starts.

Under the cluster directory::

    metrics.json                 [{"process": "chunkstore-0", "url": "http://.../metrics"}]
                                 (``tectonic status --json`` and ``tectonic stats`` read it)
    monitoring/targets.json      the same as Prometheus file-based service discovery
    monitoring/targets.d/*.json  more targets (a mount's endpoint: ``add_target``)
    monitoring/prometheus.yml    a scrape configuration over both:
                                 ``prometheus --config.file=DIR/monitoring/prometheus.yml``

File-based discovery rather than static targets: Prometheus rereads the files on change, so a
restarted daemon's new port is scraped without a reload. ``process`` is a target label (a
name per daemon, bounded by the cluster's size), not a label of any metric.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.json"
MONITORING_DIR = "monitoring"
SCRAPE_INTERVAL_S = 5


def url(address: str) -> str:
    return f"http://{address}/metrics"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _sd(endpoints: dict[str, str], cluster: str) -> str:
    groups = [
        {"targets": [address], "labels": {"process": process, "cluster": cluster}}
        for process, address in sorted(endpoints.items())
    ]
    return json.dumps(groups, indent=1) + "\n"


def prometheus_config(root: Path, scrape_interval_s: float = SCRAPE_INTERVAL_S) -> str:
    """A Prometheus configuration that scrapes every target of the cluster at ``root``."""
    mon = root / MONITORING_DIR
    return (
        "# Made by tectonic-py's launcher (tectonic_py/launch/monitoring.py); rewritten when the\n"
        "# cluster starts. Targets come from the files below, reread on change.\n"
        "global:\n"
        f"  scrape_interval: {scrape_interval_s:g}s\n"
        f"  evaluation_interval: {scrape_interval_s:g}s\n"
        "scrape_configs:\n"
        "  - job_name: tectonic\n"
        "    file_sd_configs:\n"
        "      - files:\n"
        f"          - {json.dumps(str(mon / 'targets.json'))}\n"
        f"          - {json.dumps(str(mon / 'targets.d' / '*.json'))}\n"
        "        refresh_interval: 5s\n"
    )


def write_endpoints(root: Path, endpoints: dict[str, str], cluster: str = "local") -> None:
    """``metrics.json``, the targets file and ``prometheus.yml`` for ``endpoints``
    (process name -> HOST:PORT)."""
    listed = [{"process": p, "url": url(a)} for p, a in sorted(endpoints.items())]
    _write(root / METRICS_FILE, json.dumps(listed, indent=1) + "\n")
    _write(root / MONITORING_DIR / "targets.json", _sd(endpoints, cluster))
    (root / MONITORING_DIR / "targets.d").mkdir(exist_ok=True)
    _write(root / MONITORING_DIR / "prometheus.yml", prometheus_config(root))


def add_target(root: Path, process: str, address: str, cluster: str = "local") -> Path:
    """One more target (a mount, a training job's client) for the cluster's Prometheus."""
    path = root / MONITORING_DIR / "targets.d" / f"{process}.json"
    _write(path, _sd({process: address}, cluster))
    return path


def read_endpoints(cluster_dir: Path) -> list[dict[str, Any]]:
    """``metrics.json`` of the cluster directory, and ``targets.d``'s extra targets; [] when
    the cluster runs without metrics."""
    out: list[dict[str, Any]] = []
    try:
        out = list(json.loads((cluster_dir / METRICS_FILE).read_text()))
    except (OSError, ValueError):
        pass
    extra = cluster_dir / MONITORING_DIR / "targets.d"
    for path in sorted(extra.glob("*.json")) if extra.is_dir() else []:
        try:
            for group in json.loads(path.read_text()):
                for address in group["targets"]:
                    out.append({"process": group["labels"]["process"], "url": url(address)})
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out
