"""Two jobs share a cluster by weight: ``tectonic loadtest --job a`` and ``--job b`` at once,
the chunk stores set to weights a=1, b=3 (``--job a=1 --job b=3``), get 1:3 of the write
throughput; job a alone gets all of it.

A local cluster (4 chunk stores, RS(2,1), 1 MiB chunks, 1 metadata server) whose stores
admit at most ``--rate`` bytes of puts per second each (``--max-write-rate``): the stores,
not this shared 2-core machine's CPU, are then what the jobs queue for, so the figure is the
fair queue's share and not the scheduler of the operating system. Job b writes three times
job a's bytes, so under a 1:3 share both bursts end together.

What is measured: each store's per-job admitted bytes (``tectonic_chunkstore_traffic_
admitted_bytes_total{kind="put", job}``, scraped every 0.25 s), summed over the stores.
Together: the rates over the window in which both jobs are writing their bursts (from both
having 2% of their bytes in to the first having 95%), and their ratio a:b (target 1:3
within 20%, that is a/b between 0.267 and 0.4). Alone: job a's rate over its own burst, beside the rate of the
two together (target: the same within 20%).

``python -m bench.bench_sharing [--smoke] [--json] [--rate 8MiB] [--mib 96]``; run it under
``flock /tmp/bench.lock`` on a shared machine (about a minute).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tectonic_py.core.units import MiB, parse_size
from tectonic_py.launch.local_cluster import LocalCluster

WEIGHTS = {"a": 1, "b": 3}
SAMPLE_S = 0.25
FAMILY = "tectonic_chunkstore_traffic_admitted_bytes"


def _admitted(urls: list[str]) -> dict[str, float]:
    """Bytes of puts each job got admitted, summed over the stores."""
    out = dict.fromkeys(WEIGHTS, 0.0)
    for url in urls:
        with urllib.request.urlopen(f"http://{url}/metrics", timeout=10) as r:
            text = r.read().decode()
        for fam in text_string_to_metric_families(text):
            if fam.name != FAMILY:
                continue
            for s in fam.samples:
                job = s.labels.get("job")
                if s.name.endswith("_total") and s.labels.get("kind") == "put" and job in out:
                    out[job] += s.value
    return out


def _loadtest(cluster_file: Path, job: str, ranks: int, shard: int, out: Path) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable, "-m", "tectonic_py.cli.main", "loadtest", str(cluster_file),
        "--job", job, "--ranks", str(ranks), "--shard-size", str(shard), "--no-restore",
        "--json", "--no-progress", "--no-plot", "--no-daemon-cpu", "--results-dir", str(out),
        "--max-seconds", "600",
    ]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run(
    urls: list[str], procs: dict[str, subprocess.Popen]
) -> tuple[list[tuple[float, dict[str, float]]], dict[str, Any]]:
    """Sample the stores until every load test ended; the samples and each run's JSON."""
    samples = [(time.monotonic(), _admitted(urls))]
    while any(p.poll() is None for p in procs.values()):
        time.sleep(SAMPLE_S)
        samples.append((time.monotonic(), _admitted(urls)))
    results = {}
    for job, p in procs.items():
        stdout, stderr = p.communicate()
        if p.returncode not in (0, 3):
            raise RuntimeError(f"loadtest --job {job} failed: {stderr.strip()[-500:]}")
        results[job] = json.loads(stdout.strip().splitlines()[-1])
    return samples, results


def _rate(samples: list[tuple[float, dict[str, float]]], jobs: list[str]) -> dict[str, float]:
    """Bytes/s of each of ``jobs`` over the window where all of them were writing their
    burst: from the first sample at which every one had 2% of its bytes admitted to the
    first at which one had 95% (the ends are a burst's ramp and its tail: the ``.metadata``
    index written after it, ranks finishing one by one)."""
    first = samples[0][1]
    series = [(t, {j: s[j] - first[j] for j in jobs}) for t, s in samples]
    final = series[-1][1]

    def reached(j: str, share: float) -> int:
        return next(i for i, (_, s) in enumerate(series) if s[j] >= share * final[j])

    start = max(reached(j, 0.02) for j in jobs)
    end = min(reached(j, 0.95) for j in jobs)
    if end <= start:  # too short to have a window (a smoke run): the whole run
        start, end = 0, len(series) - 1
    (t0, s0), (t1, s1) = series[start], series[end]
    return {j: (s1[j] - s0[j]) / max(t1 - t0, 1e-9) for j in jobs}


def measure(smoke: bool, rate: int, mib: int) -> dict[str, Any]:
    ranks = 4 if smoke else 16
    a_bytes = (4 if smoke else mib) * MiB
    with tempfile.TemporaryDirectory(prefix="bench-sharing-") as tmp:
        store_args = ["--max-write-rate", str(rate)]
        for job, weight in WEIGHTS.items():
            store_args += ["--job", f"{job}={weight}"]
        cluster = LocalCluster(
            Path(tmp) / "cluster",
            chunkstores=4,
            metadata_servers=1,
            shards=8,
            ec="rs-2-1",
            chunk_size=MiB,
            chunkstore_args=store_args,
            metrics=True,
        )
        with cluster:
            urls = [u for name, u in cluster.metrics_endpoints().items() if "chunkstore" in name]
            cf = cluster.client_file
            out = Path(tmp) / "results"
            alone_samples, alone = _run(
                urls, {"a": _loadtest(cf, "a", ranks, a_bytes // ranks, out / "alone")}
            )
            together_samples, together = _run(
                urls,
                {
                    "a": _loadtest(cf, "a", ranks, a_bytes // ranks, out / "a"),
                    "b": _loadtest(cf, "b", ranks, 3 * a_bytes // ranks, out / "b"),
                },
            )
    alone_rate = _rate(alone_samples, ["a"])["a"]
    both = _rate(together_samples, ["a", "b"])
    ratio = both["a"] / both["b"] if both["b"] else float("nan")
    want = WEIGHTS["a"] / WEIGHTS["b"]
    total = both["a"] + both["b"]
    return {
        "weights": WEIGHTS,
        "store_rate_bytes_s": rate,
        "stores": 4,
        "ec": "rs-2-1",
        "bytes": {"a": a_bytes, "b": 3 * a_bytes},
        "together_bytes_s": both,
        "ratio_a_to_b": round(ratio, 4),
        "ratio_target": round(want, 4),
        "ratio_within_20pct": abs(ratio / want - 1) <= 0.2,
        "alone_bytes_s": alone_rate,
        "alone_over_together_total": round(alone_rate / total, 4) if total else None,
        "alone_within_20pct": bool(total) and abs(alone_rate / total - 1) <= 0.2,
        "loadtest_write_gbps": {
            "alone a": alone["a"].get("write_gbps"),
            "a": together["a"].get("write_gbps"),
            "b": together["b"].get("write_gbps"),
        },
        "errors": sum(r.get("errors", 0) for r in (alone["a"], together["a"], together["b"])),
    }


def report_section(r: dict[str, Any], fmt: Callable[..., str]) -> list[str]:
    """The section of bench/REPORT.md (bench.report) for a run of ``measure``."""
    lines = ["## Jobs sharing a cluster (traffic classes)", ""]
    if r.get("status", "ok") != "ok":
        return lines + [f"Not measured: `{str(r.get('error', ''))[:400]}`", ""]
    both = r.get("together_bytes_s") or {}
    shape = (
        f"Job a (weight 1) writes {fmt(r['bytes']['a'] // MiB)} MiB and job b (weight 3)"
        f" three times that, at once, on {r['stores']} stores paced to"
        f" {fmt(r['store_rate_bytes_s'] // MiB)} MiB/s of puts each ({r['ec']})."
    )
    return lines + [
        shape,
        "",
        "| figure | value |",
        "|---|---:|",
        f"| job a, MB/s together | {fmt(both.get('a', 0) / 1e6, 1)} |",
        f"| job b, MB/s together | {fmt(both.get('b', 0) / 1e6, 1)} |",
        f"| a:b (target 0.333 within 20%) | {fmt(r.get('ratio_a_to_b'), 3)} |",
        f"| job a alone over the two together | {fmt(r.get('alone_over_together_total'), 3)} |",
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes (seconds), no target")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument(
        "--rate", type=parse_size, default=8 * MiB, help="bytes/s of puts per chunk store"
    )
    p.add_argument("--mib", type=int, default=96, help="MiB job a writes (job b: three times)")
    args = p.parse_args(argv)
    rate = 4 * MiB if args.smoke and args.rate == 8 * MiB else args.rate
    r = measure(args.smoke, rate, args.mib)
    if args.json:
        print(json.dumps(r))
        return 0
    both = r["together_bytes_s"]
    print(
        f"together: a {both['a'] / MiB:.1f} MiB/s, b {both['b'] / MiB:.1f} MiB/s:"
        f" a:b = {r['ratio_a_to_b']:.3f} (weights 1:3 = {r['ratio_target']:.3f},"
        f" {'within' if r['ratio_within_20pct'] else 'NOT within'} 20%)"
    )
    print(
        f"alone: a {r['alone_bytes_s'] / MiB:.1f} MiB/s = {r['alone_over_together_total']:.3f}"
        f" of the two together ({'within' if r['alone_within_20pct'] else 'NOT within'} 20%)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
