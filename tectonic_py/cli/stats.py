"""``tectonic stats CLUSTER_FILE``: the cluster's rates and latencies in the terminal, read
from the metrics endpoints ``cluster up`` lists beside the cluster file (``metrics.json``
and ``monitoring/targets.d``: a mount added there is shown too), refreshed every second, in
the spirit of ``juicefs stats``; ``--json`` prints one sample and exits.

Rates are the counters' differences between two scrapes; percentiles come from the
histograms' bucket differences over the same interval (linear within a bucket, as
Prometheus's ``histogram_quantile``), so a quiet second shows no latency rather than an old
one. No Prometheus server is needed: this is what an operator looks at during a burst.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.live import Live
from rich.table import Table

from tectonic_py.cli.common import add_cluster_file
from tectonic_py.core.errors import ConfigError
from tectonic_py.launch.monitoring import read_endpoints

SCRAPE_TIMEOUT_S = 2.0

# (row, sample name, label filter) of the byte and op rates shown.
_RATES: tuple[tuple[str, str, dict[str, str], str], ...] = (
    ("FUSE write", "tectonic_fuse_bytes_total", {"op": "write"}, "B"),
    ("FUSE read", "tectonic_fuse_bytes_total", {"op": "read"}, "B"),
    ("client written", "tectonic_client_written_bytes_total", {}, "B"),
    ("client read", "tectonic_client_read_bytes_total", {}, "B"),
    ("store puts", "tectonic_chunkstore_put_bytes_total", {}, "B"),
    ("store gets", "tectonic_chunkstore_get_bytes_total", {}, "B"),
    ("repair", "tectonic_maintenance_repair_bytes_total", {}, "B"),
    ("FUSE ops", "tectonic_fuse_operations_total", {}, "ops"),
    ("store ops", "tectonic_chunkstore_operations_total", {}, "ops"),
    ("metadata ops", "tectonic_metadata_operations_total", {}, "ops"),
    ("errors (FUSE)", "tectonic_fuse_errors_total", {}, "ops"),
)
# (row, histogram name, label filter) of the latencies shown.
_LATENCIES: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("FUSE write", "tectonic_fuse_operation_duration_seconds", {"op": "write"}),
    ("FUSE read", "tectonic_fuse_operation_duration_seconds", {"op": "read"}),
    ("FUSE create", "tectonic_fuse_operation_duration_seconds", {"op": "create"}),
    ("chunk put", "tectonic_chunkstore_operation_duration_seconds", {"op": "put"}),
    ("chunk get", "tectonic_chunkstore_operation_duration_seconds", {"op": "get"}),
    ("chunk fsync", "tectonic_chunkstore_fsync_duration_seconds", {}),
    ("metadata op", "tectonic_metadata_operation_duration_seconds", {}),
    ("group commit", "tectonic_metadata_transaction_duration_seconds", {}),
)
_GAUGES = (
    ("degraded blocks", "tectonic_maintenance_degraded_blocks"),
    ("unreadable blocks", "tectonic_maintenance_unreadable_blocks"),
    ("repair backlog (chunks)", "tectonic_maintenance_repair_backlog_chunks"),
    ("stores down", "tectonic_maintenance_nodes_down"),
)

# One scrape of every endpoint: process -> [(sample name, labels, value)].
Scrape = dict[str, list[tuple[str, dict[str, str], float]]]


async def scrape(endpoints: list[dict[str, Any]]) -> Scrape:
    """Every endpoint at once; one that does not answer is left out."""
    out: Scrape = {}

    async def one(client: httpx.AsyncClient, process: str, url: str) -> None:
        try:
            r = await client.get(url)
            r.raise_for_status()
        except httpx.HTTPError:
            return
        out[process] = [
            (s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(r.text)
            for s in family.samples
        ]

    async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S) as client, trio.open_nursery() as n:
        for e in endpoints:
            n.start_soon(one, client, str(e["process"]), str(e["url"]))
    return out


def _matching(
    s: Scrape, name: str, want: dict[str, str]
) -> Iterable[tuple[str, dict[str, str], float]]:
    for process, samples in s.items():
        for sample, labels, value in samples:
            if sample == name and all(labels.get(k) == v for k, v in want.items()):
                yield process, labels, value


def _sum(s: Scrape, name: str, want: dict[str, str]) -> float:
    return sum(v for _, _, v in _matching(s, name, want))


def _quantile(q: float, buckets: dict[float, float]) -> float | None:
    """``histogram_quantile`` over cumulative bucket counts (upper bound -> count)."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return lower


def _bucket_deltas(
    prev: Scrape, cur: Scrape, name: str, want: dict[str, str]
) -> dict[float, float]:
    deltas: dict[float, float] = defaultdict(float)
    before = {
        (p, tuple(sorted(labels.items()))): v
        for p, labels, v in _matching(prev, name + "_bucket", want)
    }
    for process, labels, value in _matching(cur, name + "_bucket", want):
        key = (process, tuple(sorted(labels.items())))
        deltas[float(labels["le"])] += max(0.0, value - before.get(key, 0.0))
    return dict(deltas)


def compute(prev: Scrape, cur: Scrape, seconds: float) -> dict[str, Any]:
    """Rates, percentiles and gauges between two scrapes ``seconds`` apart."""
    rates = {}
    for row, name, want, unit in _RATES:
        delta = _sum(cur, name, want) - _sum(prev, name, want)
        rates[row] = {"per_s": max(0.0, delta) / seconds, "unit": unit}
    latencies = {}
    for row, name, want in _LATENCIES:
        buckets = _bucket_deltas(prev, cur, name, want)
        count = buckets.get(math.inf, 0.0)
        latencies[row] = {
            "per_s": count / seconds,
            "p50_s": _quantile(0.5, buckets),
            "p99_s": _quantile(0.99, buckets),
        }
    gauges = {row: _sum(cur, name, {}) for row, name in _GAUGES}
    disks = {
        process: {
            "used_bytes": _sum({process: cur[process]}, "tectonic_chunkstore_disk_used_bytes", {}),
            "free_bytes": _sum({process: cur[process]}, "tectonic_chunkstore_disk_free_bytes", {}),
        }
        for process in sorted(cur)
        if process.startswith("chunkstore")
    }
    return {
        "interval_s": seconds,
        "processes_answering": len(cur),
        "rates": rates,
        "latencies": latencies,
        "cluster": gauges,
        "stores": disks,
    }


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1000:.2f} ms"


def render(view: dict[str, Any], endpoints: int) -> Table:
    grid = Table.grid(padding=(0, 2))
    rates = Table(title="throughput", title_justify="left")
    rates.add_column("what")
    rates.add_column("rate", justify="right")
    for row, r in view["rates"].items():
        shown = f"{_size(r['per_s'])}/s" if r["unit"] == "B" else f"{r['per_s']:.0f}/s"
        rates.add_row(row, shown)
    lat = Table(title="latency (this interval)", title_justify="left")
    for col in ("what", "ops/s", "p50", "p99"):
        lat.add_column(col, justify="right" if col != "what" else "left")
    for row, r in view["latencies"].items():
        lat.add_row(row, f"{r['per_s']:.0f}", _ms(r["p50_s"]), _ms(r["p99_s"]))
    health = Table(
        title=f"cluster ({view['processes_answering']}/{endpoints} endpoints)",
        title_justify="left",
    )
    health.add_column("what")
    health.add_column("now", justify="right")
    for row, value in view["cluster"].items():
        style = "bold red" if value and row != "repair backlog (chunks)" else ""
        health.add_row(row, f"[{style}]{value:.0f}[/]" if style else f"{value:.0f}")
    for process, d in view["stores"].items():
        health.add_row(
            f"{process} used / free", f"{_size(d['used_bytes'])} / {_size(d['free_bytes'])}"
        )
    grid.add_row(rates, lat, health)
    return grid


def cmd_stats(args: argparse.Namespace) -> int:
    endpoints = read_endpoints(Path(args.cluster_file).resolve().parent)
    if not endpoints:
        raise ConfigError(
            f"no metrics endpoints beside {args.cluster_file} (metrics.json): start the"
            " cluster with `tectonic cluster up` (metrics are on unless --no-metrics)"
        )
    if args.interval <= 0:
        raise ConfigError("--interval must be positive")

    async def run() -> None:
        prev, at = await scrape(endpoints), time.monotonic()
        if not prev:
            raise ConfigError(f"none of the {len(endpoints)} metrics endpoints answered")
        if args.json:
            await trio.sleep(args.interval)
            cur = await scrape(endpoints)
            json.dump(compute(prev, cur, time.monotonic() - at), sys.stdout, indent=2)
            sys.stdout.write("\n")
            return
        console = Console()
        with Live(console=console, auto_refresh=False) as live:
            shown = 0
            while args.count == 0 or shown < args.count:
                await trio.sleep(max(0.0, at + args.interval - time.monotonic()))
                cur, now = await scrape(endpoints), time.monotonic()
                live.update(render(compute(prev, cur, now - at), len(endpoints)), refresh=True)
                prev, at, shown = cur, now, shown + 1

    trio.run(run)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "stats",
        help="live rates and latencies of a cluster, from its metrics endpoints",
        description="Throughput (FUSE, client, chunk stores, repair), ops/s, p50/p99 latencies"
        " from the histograms, degraded blocks, repair backlog and each store's disk, read"
        " from the endpoints in metrics.json beside CLUSTER_FILE, refreshed every interval;"
        " Ctrl-C ends it. --json: one sample over one interval, then exit.",
    )
    add_cluster_file(p)
    p.add_argument("--json", action="store_true", help="print one sample as JSON and exit")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    p.add_argument(
        "--count", type=int, default=0, help="samples to show, then exit (0: until Ctrl-C)"
    )
    p.set_defaults(func=cmd_stats)
