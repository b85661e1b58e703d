"""Metadata service throughput: creates + seals of small files, in ONE directory and spread
over many, with 1, 2 and 4 metadata server processes, and lookups; beside the raw SQLite
commit rate (WAL, synchronous=FULL) measured in the same run on the same disk.

Shape of a run (servers are subprocesses, ``tectonic metadata``; the client tasks run in this
process over one MetadataClient, so on a small machine the client's CPU is part of the
figure: the output says how many client processes were used):

1. raw SQLite: single-row transactions committed one by one (one fsync each: the rate a
   naive server would reach) and in batches of 256 rows (the best group commit can do);
2. for each server count: ``tasks`` concurrent client tasks each create ``files`` small files
   and seal them, (a) all in one directory, (b) each task in its own directory (directories
   made beforehand, not timed); then every task looks its files up again.

The target: the one-directory burst finishes without errors at no less than 0.5 of the
spread rate. ``python -m bench.bench_metadata [--smoke] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import trio

from metadata.client import MetadataClient
from tectonic_py.core.aio import open_service_nursery
from tectonic_py.core.cluster_file import ClusterConfig, MetadataServer
from tectonic_py.core.errors import TectonicError
from tectonic_py.core.ids import ROOT_ID

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parent.parent


def raw_sqlite(path: Path, commits: int, batch: int) -> dict[str, Any]:
    """Commits per second and rows per second of a WAL, synchronous=FULL SQLite file."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY, v TEXT)")
    start = time.perf_counter()
    k = 0
    for _ in range(commits):
        conn.execute("BEGIN IMMEDIATE")
        for _ in range(batch):
            k += 1
            conn.execute("INSERT INTO t (k, v) VALUES (?, ?)", (k, "rank_0000.pt"))
        conn.execute("COMMIT")
    seconds = time.perf_counter() - start
    conn.close()
    return {
        "batch": batch,
        "commits": commits,
        "seconds": round(seconds, 3),
        "commits_per_s": round(commits / seconds, 1),
        "rows_per_s": round(k / seconds, 1),
    }


class Servers:
    """``count`` metadata server subprocesses splitting ``shards`` logical shards."""

    def __init__(self, root: Path, secret_file: Path, count: int, shards: int) -> None:
        self.procs: list[subprocess.Popen] = []
        self.entries: list[MetadataServer] = []
        self.root, self.secret_file, self.count, self.shards = root, secret_file, count, shards

    def start(self) -> ClusterConfig:
        readies = []
        key_file = self.root / "capability_key"  # the servers' own: clients never read it
        if not key_file.exists():
            key_file.write_bytes(os.urandom(32).hex().encode())
            key_file.chmod(0o600)
        for i in range(self.count):
            lo, hi = i * self.shards // self.count, (i + 1) * self.shards // self.count
            ready = self.root / f"ready{i}.json"
            ready.unlink(missing_ok=True)
            with open(self.root / f"meta{i}.log", "ab") as logf:
                self.procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "tectonic_py.cli.main",
                            "metadata",
                            "--data-dir",
                            str(self.root / f"meta{i}"),
                            "--listen",
                            "127.0.0.1:0",
                            "--shards",
                            f"{lo}-{hi - 1}",
                            "--total-shards",
                            str(self.shards),
                            "--secret-file",
                            str(self.secret_file),
                            "--capability-key-file",
                            str(key_file),
                            "--ready-file",
                            str(ready),
                        ],
                        cwd=REPO,
                        stdout=subprocess.DEVNULL,
                        stderr=logf,
                    )
                )
            readies.append((ready, list(range(lo, hi))))
        deadline = time.monotonic() + 60
        for (ready, hosted), proc in zip(readies, self.procs):
            while not ready.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"metadata server failed to start, see {self.root}")
                time.sleep(0.05)
            self.entries.append(MetadataServer(json.loads(ready.read_text())["address"], hosted))
        return ClusterConfig("bench", self.secret_file, self.shards, self.entries)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def _burst(client: MetadataClient, dirs: list[int], files: int) -> tuple[float, int, list]:
    """Every task t creates+seals ``files`` files in dirs[t]; returns seconds, errors, ids."""
    errors = 0
    made: list[tuple[int, str]] = []

    async def task(t: int) -> None:
        nonlocal errors
        for i in range(files):
            name = f"rank_{t:05d}_{i:03d}.pt"
            try:
                f, token = await client.create(dirs[t], name)
                await client.seal(f.id, token, 4096)
                made.append((dirs[t], name))
            except TectonicError as e:
                errors += 1
                log.warning("create %s failed: %s", name, e)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for t in range(len(dirs)):
            nursery.start_soon(task, t)
    return time.perf_counter() - start, errors, made


async def _lookups(client: MetadataClient, made: list[tuple[int, str]], tasks: int) -> float:
    async def task(part: list[tuple[int, str]]) -> None:
        for dir_id, name in part:
            await client.lookup(dir_id, name)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for t in range(tasks):
            nursery.start_soon(task, made[t::tasks])
    return time.perf_counter() - start


async def run_servers(
    config: ClusterConfig, pids: list[int], tasks: int, files: int
) -> dict[str, Any]:
    async with open_service_nursery() as nursery:
        client = MetadataClient(config, nursery=nursery)
        try:
            one = await client.mkdir(ROOT_ID, "one_dir")
            spread_root = await client.mkdir(ROOT_ID, "spread")
            spread: list[int] = [0] * tasks

            async def make(t: int) -> None:
                spread[t] = (await client.mkdir(spread_root.id, f"d{t:05d}")).id

            async with trio.open_nursery() as nursery:
                for t in range(tasks):
                    nursery.start_soon(make, t)
            n = tasks * files
            before = await _commit_stats(client, config)
            cpu0 = _cpu(pids)
            s_one, e_one, made_one = await _burst(client, [one.id] * tasks, files)
            cpu1 = _cpu(pids)
            s_spread, e_spread, made_spread = await _burst(client, spread, files)
            cpu2 = _cpu(pids)
            after = await _commit_stats(client, config)
            s_look = await _lookups(client, made_one + made_spread, tasks)
        finally:
            await client.aclose()
    batches, mutations = after[0] - before[0], after[1] - before[1]
    return {
        "servers": len(config.metadata_servers),
        "files": n,
        "one_dir_per_s": round(n / s_one, 1),
        "spread_per_s": round(n / s_spread, 1),
        "one_over_spread": round(s_spread / s_one, 3),
        "errors": e_one + e_spread,
        "lookups_per_s": round(len(made_one + made_spread) / s_look, 1),
        "mutations_per_commit": round(mutations / max(batches, 1), 1),
        # CPU-seconds per 1,000 create+seal, client process and all servers (steadier than rates)
        "client_cpu_s_per_1k": round((cpu2[0] - cpu0[0]) / (2 * n) * 1000, 3),
        "server_cpu_s_per_1k": round((cpu2[1] - cpu0[1]) / (2 * n) * 1000, 3),
        "one_dir_cpu_s": round(cpu1[0] - cpu0[0] + cpu1[1] - cpu0[1], 2),
    }


async def _commit_stats(client: MetadataClient, config: ClusterConfig) -> tuple[int, int]:
    stats = [await client.call_server(s.address, "server.stats") for s in config.metadata_servers]
    batches = sum(sh["batches"] for st in stats for sh in st["shards"].values())
    mutations = sum(sh["mutations"] for st in stats for sh in st["shards"].values())
    return batches, mutations


def _cpu(pids: list[int]) -> tuple[float, float]:
    """(this process, all servers) CPU seconds so far."""
    mine = psutil.Process().cpu_times()
    servers = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        servers += t.user + t.system
    return mine.user + mine.system, servers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny and quick (for the test suite)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--servers", default="1,2,4", help="server counts to try, e.g. 1,2,4")
    p.add_argument("--tasks", type=int, default=1000, help="concurrent client tasks")
    p.add_argument("--files", type=int, default=2, help="files per task")
    p.add_argument("--shards", type=int, default=64)
    p.add_argument("--data-dir", help="where servers keep their SQLite files (a real disk)")
    args = p.parse_args(argv)
    counts = [int(x) for x in args.servers.split(",")]
    tasks, files, shards, raw_commits = args.tasks, args.files, args.shards, 300
    if args.smoke:
        counts, tasks, files, shards, raw_commits = [1, 2], 30, 1, 8, 20
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(dir=args.data_dir, prefix="bench_metadata.") as tmp:
        root = Path(tmp)
        secret_file = root / "secret"
        secret_file.write_bytes(secrets.token_hex(32).encode())
        secret_file.chmod(0o600)
        raw = [
            raw_sqlite(root / "raw1.db", raw_commits, 1),
            raw_sqlite(root / "raw256.db", max(raw_commits // 10, 5), 256),
        ]
        rows = []
        for count in counts:
            run_root = root / f"s{count}"
            run_root.mkdir()
            servers = Servers(run_root, secret_file, count, shards)
            try:
                config = servers.start()
                pids = [proc.pid for proc in servers.procs]
                rows.append(trio.run(run_servers, config, pids, tasks, files))
            finally:
                servers.stop()
    result = {
        "raw_sqlite": raw,
        "runs": rows,
        "tasks": tasks,
        "files_per_task": files,
        "shards": shards,
        "client_processes": 1,
        "cpus": os.cpu_count(),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        one_fsync = raw[0]["commits_per_s"]
        print(
            f"raw SQLite (WAL, synchronous=FULL): {one_fsync:.0f} commits/s of 1 row, "
            f"{raw[1]['rows_per_s']:.0f} rows/s in commits of 256"
        )
        print(
            f"(one commit per mutation, 3 mutations per create+seal, in series: about"
            f" {one_fsync / 3:.0f} create+seal/s)"
        )
        print(
            f"{tasks} concurrent client tasks x {files} files, {shards} shards, 1 client process,"
            f" {os.cpu_count()} CPUs"
        )
        print(
            "servers  one-dir c+s/s  spread c+s/s  one/spread  one-dir/raw-commit  lookups/s"
            "  mut/commit  CPU-s/1k client  server  errors"
        )
        for r in rows:
            print(
                f"{r['servers']:>7}  {r['one_dir_per_s']:>13.0f}  {r['spread_per_s']:>12.0f}"
                f"  {r['one_over_spread']:>10.2f}  {r['one_dir_per_s'] / one_fsync:>17.2f}x"
                f"  {r['lookups_per_s']:>9.0f}  {r['mutations_per_commit']:>10.1f}"
                f"  {r['client_cpu_s_per_1k']:>15.2f}  {r['server_cpu_s_per_1k']:>6.2f}"
                f"  {r['errors']:>6}"
            )
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
