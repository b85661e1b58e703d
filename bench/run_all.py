"""One command for the whole benchmark suite: ``python -m bench.run_all``.

Run it from a directory outside the checkout, with the checkout on ``PYTHONPATH``: ``-m``
puts the working directory first on ``sys.path``, and the daemons the run starts would
otherwise import whatever checkout that directory holds. It prints its expected duration
first (``EXPECTED_S``, from earlier runs; the report sets it beside the time taken).

It measures, in one run on this machine, so every figure has a ceiling and a peer beside it:

1. ceilings: raw disk (fsync write, cold read), zfec RS(6,3), loopback TCP, msgpack
   (``bench.ceilings``), and the Python FUSE ceiling, a mount that discards data
   (``bench.nullfs``);
2. tectonic-py on a local cluster (2 metadata servers, 9 chunk stores, RS(6,3), 4 MiB chunks,
   data on the same disk): the client library, one stream; the FUSE mount with ``dd`` and
   ``torch.save`` / ``torch.load`` of 2 GiB; the checkpoint burst (``tectonic loadtest``) at
   64, 1,024 and 4,096 ranks through the client library (the 1,024-rank one beside one
   stream of the same bytes, ``--baseline-stream``, for the CPU a file costs, and the
   chunk puts a file costs now that small files share blocks; with ``--big-bursts`` also
   4,096 ranks of 4 KiB shards into one directory, for the creates rate alone, and 16,384
   ranks of 64 KiB, each many minutes on 2 cores) and at 64 ranks through the mount; on
   the same mount, empty creates in one directory beside local disk and nullfs
   (``bench.bench_dirops``), small in-place writes (``bench.bench_inplace``) and small
   fsync'd SQLite commits beside local disk (``bench.bench_small_appends``); last, the
   restore of a kept burst with m of the 9 chunk stores killed beside the same restore
   with all of them up (``tectonic loadtest --verify-only``);
3. the per-component scripts (bench_chunkstore, bench_metadata, bench_client, bench_fuse,
   bench_repair) as subprocesses with ``--json``; one that is missing is reported as such;
4. the peer, side by side: a GlusterFS 4+2 dispersed volume (``bench.gluster``) with the same
   dd, torch and loadtest --through-mount workloads, or the reason it could not run;
5. the one-directory burst through the mount beside GlusterFS, JuiceFS and local disk
   (``bench.bench_burst --install``: 1,024 ranks x 1 MiB, empty creates, git clone, tar -x,
   rm -r), the figure the project is judged by; with ``--no-peers`` (or ``--skip peer``)
   ours and local disk only.

It writes ``bench/REPORT.md`` (Markdown tables: every figure as a ratio to its ceiling and to
the peer, CPU-seconds per GiB beside GlusterFS's), ``bench/report.png`` and
``bench/results.json`` (the raw figures); ``bench.report`` renders them. ``--smoke`` runs
everything at tiny sizes into a scratch directory (the test suite uses it) and never touches
the committed report. ``--skip PARTS`` and ``--only PARTS`` (names in ``PARTS``) leave parts
out or run some alone: each section of the report names the command that reproduces it.
Optional parts (``OPTIONAL_PARTS``: ``sharing``, two jobs of weights 1:3 on one cluster,
``bench.bench_sharing``) run only when ``--only`` or ``--with`` names them.

Nothing here asserts: targets are printed as met or missed, with the figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.common import fuse_unmount, reap
from bench.mount_workloads import dd_workload, torch_workload
from bench.report import GiB, MiB, render_report, size_label, write_plot

log = logging.getLogger(__name__)

# the per-component scripts, with the arguments of a full run: sizes trimmed so that the
# whole run stays near 20 minutes on 2 cores (FUSE torch.save of 2 GiB is measured above);
# bench_metrics (the cost of the metrics, on and off) runs once it is in the checkout
OTHER_SCRIPTS: dict[str, list[str]] = {
    "bench_chunkstore": ["--total-mib", "256"],
    "bench_metadata": [],
    "bench_client": ["--size-mib", "1024", "--json"],
    "bench_fuse": ["--size", "1024"],
    "bench_repair": ["--size-mib", "512", "--write-mib", "128"],
    "bench_metrics": [],
    "bench_save": ["--repeat", "2"],
}

# Scripts whose smoke run a test of their own makes (two clusters and mounts: a minute and
# more); a smoke run of the whole suite leaves them to it.
OWN_SMOKE_TEST = {
    "bench_metrics": "smoke-tested on its own (tests/test_bench_smoke.py::test_bench_metrics_smoke)",
    "bench_save": "smoke-tested on its own (tests/test_bench_smoke.py::test_bench_save_smoke)",
}

# Every part of a run, in the order they run: the names --skip and --only take. The cluster
# parts share one LocalCluster (``tectonic`` names them all), the mount parts one mount of it.
PARTS = (
    "ceilings",
    "nullfs",
    "fuse",
    "dirops",
    "inplace",
    "appends",
    "bursts",
    "restore",
    "peer",
    "onedir",
    "others",
    "sharing",
)
# Parts a run leaves out unless --only or --with names them.
OPTIONAL_PARTS = frozenset({"sharing"})
CLUSTER_PARTS = frozenset({"fuse", "dirops", "inplace", "appends", "bursts", "restore"})
MOUNT_PARTS = frozenset({"fuse", "dirops", "inplace", "appends"})

# Seconds each part of a full run takes on a quiet 2-core machine, to print the expected
# duration before a run starts: the 2026-11-30 full run's wall times, the 2026-12-05
# bench_burst runs in README.md, and for the parts added since, their sizes at the rates
# their smoke runs showed. ``part_seconds`` in results.json holds a run's own, to correct
# these by. onedir is without installing the peers (their first install adds minutes).
EXPECTED_S: dict[str, float] = {
    "ceilings": 10,
    "nullfs": 5,
    "cluster": 15,  # the cluster's start and stop, with any cluster part
    "fuse": 60,
    "dirops": 25,
    "inplace": 20,
    "appends": 60,
    "bursts": 160,
    "restore": 40,
    "peer": 150,
    "onedir": 360,
    "others": 300,
    "sharing": 90,
}


# --- sizes of a full run and of a smoke run ----------------------------------------------------


# A burst's extra loadtest flags: beside one stream of its bytes (cpu_ms_per_file, pause
# over the stream's time).
STREAM = ("--baseline-stream",)


def plan(smoke: bool, big_bursts: bool = False) -> dict[str, Any]:
    if smoke:
        return {
            "fuse_size": 16 * MiB,
            "stream_size": 0,  # the bursts below exercise the same client-library path
            "bursts": [(8, MiB, STREAM)],
            "mount_burst": (4, MiB),
            "peer_size": 16 * MiB,
            "peer_burst": (4, MiB),
            "script_timeout": 300,
            "loadtest_max_s": 120,
            "dirops_files": 16,
            "inplace": (8 * MiB, 3),
            "appends_commits": 5,
            "restore": (4, MiB),
            "onedir_ranks": 8,  # bench_burst --smoke: 8 x 4 KiB, no users workload
            "onedir_timeout": 300,
        }
    return {
        "fuse_size": 2 * GiB,
        "stream_size": 512 * MiB,
        # (ranks, shard bytes, flags): the 64-rank run at the same 1 MiB shards is the baseline
        # of the "no collapse" target; 64 x 16 MiB shows large shards; 1,024 x 1 MiB is the
        # per-file cost beside one stream; 4,096 ranks is single-directory creates (every
        # rank's file of a step goes in one directory), with 4 KiB shards the creates alone
        "bursts": [(64, 16 * MiB, ()), (64, MiB, ()), (1024, MiB, STREAM), (4096, MiB, ())]
        + ([(4096, 4 * 1024, ()), (16384, 64 * 1024, STREAM)] if big_bursts else []),
        "mount_burst": (64, 16 * MiB),
        "peer_size": 2 * GiB,
        "peer_burst": (64, 16 * MiB),
        "script_timeout": 600,
        "loadtest_max_s": 900,
        # bench_dirops', bench_inplace's and bench_small_appends' own defaults
        "dirops_files": 1024,
        "inplace": (48 * MiB, 20),
        "appends_commits": 200,
        # (ranks, shard bytes): 1 GiB, the mount burst's shape
        "restore": (64, 16 * MiB),
        "onedir_ranks": 1024,
        "onedir_timeout": 2400,
    }


def expected_seconds(skip: set[str], smoke: bool) -> float:
    """The run's expected duration: ``EXPECTED_S`` of the parts it runs. A smoke run is
    tiny sizes, where the fixed costs (starting Python, a cluster, a mount) are most of
    it: about a tenth of each part, at least 5 s."""
    parts = [name for name in PARTS if name not in skip]
    if CLUSTER_PARTS - skip:
        parts.append("cluster")
    total = [EXPECTED_S[name] for name in parts]
    return sum(max(5.0, t / 10) for t in total) if smoke else sum(total)


def parts_arg(text: str) -> set[str]:
    """A comma list of part names (``tectonic``: every cluster part), each checked."""
    names = {n.strip() for n in text.split(",") if n.strip()}
    bad = names - set(PARTS) - {"tectonic"}
    if bad:
        raise argparse.ArgumentTypeError(f"parts are {','.join(PARTS)},tectonic; not {bad}")
    return (names - {"tectonic"}) | (set(CLUSTER_PARTS) if "tectonic" in names else set())


# --- helpers -------------------------------------------------------------------------------


def _python_module(module: str, *args: str, timeout: float) -> dict[str, Any]:
    """Run ``python -m module args`` and parse its JSON (the whole stdout or its last line)."""
    t0 = time.monotonic()
    try:
        r = subprocess.run(
            [sys.executable, "-m", module, *args],
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"status": "failed", "error": f"timed out after {timeout:.0f} s"}
    result = _parse_json(r.stdout)
    if r.returncode != 0 or result is None:
        return {
            "status": "failed",
            "error": f"exit {r.returncode}: {(r.stderr or r.stdout).strip()[-800:]}",
        }
    result.setdefault("status", "ok")
    result["wall_s"] = round(time.monotonic() - t0, 2)
    return result


def _parse_json(text: str) -> dict[str, Any] | None:
    text = text.strip()
    try:
        value = json.loads(text)
        return value if isinstance(value, dict) else {"value": value}
    except ValueError:
        pass
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith(("{", "[")):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            return value if isinstance(value, dict) else {"value": value}
    start = text.find("\n{")
    if start >= 0:
        try:
            return dict(json.loads(text[start:]))
        except ValueError:
            pass
    return None


class TectonicMount:
    """``tectonic mount --foreground`` in a subprocess; always unmounted by ``stop``."""

    def __init__(self, cluster_file: Path, mountpoint: Path, log_file: Path) -> None:
        self.cluster_file = cluster_file
        self.mountpoint = mountpoint
        self.log_file = log_file
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as logf:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tectonic_py.cli.main",
                    "mount",
                    str(self.cluster_file),
                    str(self.mountpoint),
                    "--foreground",
                ],
                cwd=REPO_ROOT,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=logf,
                start_new_session=True,
            )
        deadline = time.monotonic() + 60
        while not os.path.ismount(self.mountpoint):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_file.read_text(errors="replace")[-600:]
                raise RuntimeError(f"tectonic mount did not come up: {tail}")
            time.sleep(0.05)

    def stop(self) -> None:
        fuse_unmount(self.mountpoint)
        if self.proc is not None:
            reap(self.proc, 30, 10)
            self.proc = None

    def remount(self) -> None:
        self.stop()
        self.start()

    def pids(self) -> list[int]:
        return [self.proc.pid] if self.proc is not None and self.proc.poll() is None else []


def _loadtest(
    target: list[str],
    ranks: int,
    shard: int,
    watch: list[int],
    results_dir: Path,
    max_seconds: float,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One ``tectonic loadtest`` run; returns its full results file (with timeline). The
    loadtest finds the local cluster's daemons itself; ``watch`` adds other PIDs."""
    args = [
        "loadtest",
        *target,
        "--ranks",
        str(ranks),
        "--shard-size",
        str(shard),
        "--json",
        "--no-progress",
        "--results-dir",
        str(results_dir),
        "--max-seconds",
        str(max_seconds),
        "--watch-pids",
        ",".join(map(str, watch)),
        *extra,
    ]
    slim = _python_module("tectonic_py.cli.main", *args, timeout=max_seconds + 180)
    mode = "mount" if "--through-mount" in target else "client"
    full = results_dir / f"loadtest-{mode}-{ranks}.json"
    # the results file is written whatever the exit status (3 means the run had errors: those
    # are figures to report, not a failure of the benchmark)
    try:
        result = dict(json.loads(full.read_text()))
        result["status"] = "ok"
    except (OSError, ValueError):
        return slim
    result["shard_size"] = shard
    # keep each run's files apart: two runs with the same rank count would overwrite
    for ext in ("json", "png"):
        src = results_dir / f"loadtest-{mode}-{ranks}.{ext}"
        if src.exists():
            src.rename(results_dir / f"loadtest-{mode}-{ranks}x{size_label(shard)}.{ext}")
    return result


# (all results so far, where to save them): each finished part is saved at once, so a run
# stopped early still leaves its figures for ``--render-only --from``
_PARTIAL: list[Any] = []
# each guarded part's wall seconds, by its key, kept in results.json as part_seconds
_SECONDS: dict[str, float] = {}


def _guard(results: dict[str, Any], key: str, fn: Callable[[], Any]) -> None:
    """Run one part; a failure is recorded in the report, never ends the suite."""
    t0 = time.monotonic()
    log.warning("run_all: %s ...", key)
    try:
        results[key] = fn()
    except Exception as e:  # noqa: BLE001 (recorded in the report, as the docstring says)
        results[key] = {
            "status": "failed",
            "error": f"{type(e).__name__}: {e}",
            "trace": traceback.format_exc()[-1500:],
        }
    _SECONDS[key] = round(time.monotonic() - t0, 1)
    log.warning("run_all: %s done in %.1f s", key, _SECONDS[key])
    if _PARTIAL:
        root, path = _PARTIAL
        path.write_text(json.dumps(root, default=str))


# --- the run -----------------------------------------------------------------------------------


def run(
    smoke: bool,
    skip: set[str],
    workdir: Path,
    results_dir: Path,
    big_bursts: bool = False,
    only_bursts: str | None = None,
    peers: bool = True,
) -> dict[str, Any]:
    """Every part not in ``skip``, in the order of ``PARTS``; ``peers``: onedir's
    GlusterFS and JuiceFS too."""
    p = plan(smoke, big_bursts or bool(only_bursts))
    if only_bursts:
        wanted = {w.strip().replace(" ", "") for w in only_bursts.split(",") if w.strip()}
        p["bursts"] = [b for b in p["bursts"] if f"{b[0]}x{size_label(b[1])}" in wanted]
        p["stream_size"] = 0
        skip = skip | (CLUSTER_PARTS - {"bursts"})
    expected = expected_seconds(skip, smoke)
    log.warning(
        "run_all: expected to take about %.0f min on a quiet 2-core machine (parts: %s)",
        expected / 60,
        ",".join(n for n in PARTS if n not in skip) or "none",
    )
    _SECONDS.clear()
    results: dict[str, Any] = {
        "smoke": smoke,
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": _machine(),
        "plan": {k: v for k, v in p.items()},
        "skipped": sorted(skip),
        "expected_s": round(expected),
        "part_seconds": _SECONDS,
    }
    results["load_before"] = os.getloadavg()
    _PARTIAL[:] = [results, results_dir / "partial-results.json"]
    flag = ["--smoke"] if smoke else []
    t = p["script_timeout"]

    if "ceilings" not in skip:
        _guard(
            results,
            "ceilings",
            lambda: _python_module(
                "bench.ceilings", "--json", "--dir", str(workdir), *flag, timeout=t
            ),
        )
    if "nullfs" not in skip:
        _guard(
            results,
            "nullfs",
            lambda: _python_module("bench.nullfs", "--measure", "--json", *flag, timeout=t),
        )

    if CLUSTER_PARTS - skip:
        _guard(
            results, "tectonic", lambda: _tectonic(p, smoke, skip, workdir, results_dir, results)
        )

    if "peer" not in skip:
        from bench import gluster

        def peer() -> dict[str, Any]:
            ranks, shard = p["peer_burst"]
            res = gluster.measure(
                p["peer_size"],
                ranks,
                shard,
                install=not smoke,
                root=str(workdir),
                max_seconds=p["loadtest_max_s"],
            )
            return res

        _guard(results, "peer", peer)

    if "onedir" not in skip:
        _guard(results, "onedir", lambda: _onedir(p, smoke, peers, workdir, results_dir))

    if "others" not in skip:
        others: dict[str, Any] = {}
        results["others"] = others
        for name, full_args in OTHER_SCRIPTS.items():
            script = REPO_ROOT / "bench" / f"{name}.py"
            if not script.exists():
                others[name] = {"status": "missing", "error": f"bench/{name}.py is not there yet"}
                continue
            if smoke and "--smoke" not in script.read_text():
                others[name] = {"status": "skipped", "error": "the script has no --smoke mode"}
                continue
            if smoke and name in OWN_SMOKE_TEST:
                others[name] = {"status": "skipped", "error": OWN_SMOKE_TEST[name]}
                continue
            extra = flag if smoke else full_args
            _guard(
                others,
                name,
                lambda name=name, extra=extra: _python_module(
                    f"bench.{name}", "--json", *extra, timeout=t
                ),
            )
            others[name]["command"] = " ".join(["python -m", f"bench.{name}", "--json", *extra])

    if "sharing" not in skip:
        _guard(
            results,
            "sharing",
            lambda: _python_module("bench.bench_sharing", "--json", *flag, timeout=t),
        )

    results["load_after"] = os.getloadavg()
    results["finished"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return results


def _tectonic(
    p: dict[str, Any],
    smoke: bool,
    skip: set[str],
    workdir: Path,
    results_dir: Path,
    results: dict[str, Any],
) -> dict[str, Any]:
    """tectonic-py on a fresh local cluster: one stream, the FUSE mount, then the bursts."""
    from tectonic_py.launch.local_cluster import LocalCluster

    out: dict[str, Any] = {}
    results["tectonic"] = out  # filled part by part, saved after each
    cluster = LocalCluster(workdir / "cluster", chunkstores=9, metadata_servers=2, shards=64)
    cluster.start()
    try:
        cf = str(cluster.cluster_file)
        out["cluster"] = {
            "chunkstores": 9,
            "metadata_servers": 2,
            "ec": cluster.ec,
            "chunk_size": cluster.chunk_size,
        }
        # the client library, one stream: a 1-rank loadtest of one large file
        if p["stream_size"] and "bursts" not in skip:
            _guard(
                out,
                "client_stream",
                lambda: _loadtest(
                    [cf], 1, p["stream_size"], cluster.pids(), results_dir, p["loadtest_max_s"]
                ),
            )
        if MOUNT_PARTS - skip:
            _through_mount(out, p, cluster, workdir, results_dir, skip)
        bursts: list[dict[str, Any]] = []
        out["bursts"] = bursts
        for ranks, shard, extra in p["bursts"] if "bursts" not in skip else []:
            box: dict[str, Any] = {}
            key = f"burst {ranks} x {size_label(shard)}"
            _guard(
                box,
                key,
                lambda ranks=ranks, shard=shard, extra=extra: _loadtest(
                    [cf], ranks, shard, cluster.pids(), results_dir, p["loadtest_max_s"], extra
                ),
            )
            bursts.append(box[key])
        # last: it kills chunk stores
        if "restore" not in skip:
            _guard(out, "restore", lambda: _restore(p, cluster, results_dir))
    finally:
        cluster.stop()
    return out


def _restore(p: dict[str, Any], cluster: Any, results_dir: Path) -> dict[str, Any]:
    """A burst kept on the cluster, restored (read back, every byte verified) with every
    chunk store up, then again with m of them killed: the restore a job makes after losing
    as many nodes as the code tolerates, beside the healthy one, in the same run."""
    from tectonic_py.core.ec_policy import ECPolicy

    ranks, shard = p["restore"]
    killed = ECPolicy.parse(cluster.ec).m

    def loadtest(name: str, *extra: str) -> dict[str, Any]:
        sub = results_dir / f"restore-{name}"
        sub.mkdir()
        flags = ("--dir", "/restore", "--no-plot", *extra)
        target = [str(cluster.cluster_file)]
        return _loadtest(target, ranks, shard, cluster.pids(), sub, p["loadtest_max_s"], flags)

    out: dict[str, Any] = {"ranks": ranks, "shard_size": shard, "ec": cluster.ec}
    out["write"] = loadtest("write", "--keep", "--no-restore")
    out["healthy"] = loadtest("healthy", "--verify-only")
    for i in range(killed):
        cluster.kill_chunkstore(i)
    out["killed"] = [cluster.node_id(i) for i in range(killed)]
    out["degraded"] = loadtest("degraded", "--verify-only")
    return out


def _onedir(
    p: dict[str, Any], smoke: bool, peers: bool, workdir: Path, results_dir: Path
) -> dict[str, Any]:
    """``bench.bench_burst`` in a subprocess: the one-directory burst through our mount
    beside GlusterFS, JuiceFS and local disk (ours and local disk alone with ``--skip
    peer`` or ``--no-peers``). Its JSON file is its result whatever its exit status: a
    failed workload is a figure it reports, not a failure of the run."""
    out_file = results_dir / "bench_burst.json"
    targets = "ours,gluster,juicefs,local" if peers else "ours,local"
    args = ["--targets", targets, "--dir", str(workdir), "--json", str(out_file)]
    args += ["--smoke"] if smoke else ["--ranks", str(p["onedir_ranks"]), "--install"]
    t0 = time.monotonic()
    try:
        r = subprocess.run(
            [sys.executable, "-m", "bench.bench_burst", *args],
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
            timeout=p["onedir_timeout"],
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"status": "failed", "error": f"timed out after {p['onedir_timeout']} s"}
    try:
        result = dict(json.loads(out_file.read_text()))
    except (OSError, ValueError):
        return {"status": "failed", "error": f"exit {r.returncode}: {r.stderr.strip()[-800:]}"}
    result["status"] = "ok"
    result["exit"] = r.returncode
    result["wall_s"] = round(time.monotonic() - t0, 2)
    return result


def _through_mount(
    out: dict[str, Any],
    p: dict[str, Any],
    cluster: Any,
    workdir: Path,
    results_dir: Path,
    skip: set[str],
) -> None:
    """dd, torch.save / torch.load and a burst, creates in one directory, small in-place
    writes and small fsync'd commits through one ``tectonic mount`` of the cluster."""
    mount = TectonicMount(cluster.cluster_file, workdir / "mnt", workdir / "mount.log")
    mount.start()
    try:

        def pids() -> list[int]:
            return cluster.pids() + mount.pids()

        if "fuse" not in skip:
            _fuse(out, p, mount, pids, results_dir)
        mnt = mount.mountpoint
        if "dirops" not in skip:
            _guard(out, "dirops", lambda: _dirops(mnt, workdir, p["dirops_files"]))
        if "inplace" not in skip:
            from bench.bench_inplace import overwrite

            size, writes = p["inplace"]
            _guard(
                out,
                "inplace",
                lambda: overwrite(mnt / "inplace.h5", cluster.root, pids(), size, writes),
            )
        if "appends" not in skip:
            from bench.bench_small_appends import compare

            def appends() -> dict[str, Any]:
                local, there = workdir / "appends-local", mnt / "appends"
                local.mkdir()
                there.mkdir()
                return compare(there, local, cluster.root, pids(), p["appends_commits"])

            _guard(out, "appends", appends)
    finally:
        mount.stop()


def _dirops(mnt: Path, workdir: Path, n: int) -> dict[str, Any]:
    """bench_dirops' figures, its mount being the one this run already has."""
    from bench.bench_dirops import figures, local_best, run_ops
    from bench.nullfs import nullfs_mounted

    local_root = workdir / "dirops-local"
    local_root.mkdir()
    local = local_best(local_root, n)
    shutil.rmtree(local_root, ignore_errors=True)
    with nullfs_mounted(workdir / "dirops-nullfs") as null:
        nullfs = run_ops(Path(null.mountpoint), n)
    (mnt / "dirops").mkdir()
    return figures(n, local, nullfs, run_ops(mnt / "dirops", n))


def _fuse(
    out: dict[str, Any],
    p: dict[str, Any],
    mount: TectonicMount,
    pids: Callable[[], list[int]],
    results_dir: Path,
) -> None:
    """dd, torch.save / torch.load and a loadtest burst through the mount."""
    _guard(
        out,
        "fuse_dd",
        lambda: dd_workload(str(mount.mountpoint), p["fuse_size"], pids, mount.remount),
    )
    _guard(
        out,
        "fuse_torch",
        lambda: torch_workload(str(mount.mountpoint), p["fuse_size"], pids, mount.remount),
    )
    ranks, shard = p["mount_burst"]
    _guard(
        out,
        "mount_burst",
        lambda: _loadtest(
            ["--through-mount", str(mount.mountpoint)],
            ranks,
            shard,
            pids(),
            results_dir,
            p["loadtest_max_s"],
        ),
    )


def _machine() -> dict[str, Any]:
    import psutil

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        check=False,
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        check=False,
    ).stdout.strip()
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / GiB, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "commit": commit + ("+uncommitted" if dirty else ""),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="run every benchmark and write the report")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, report to --out-dir")
    parser.add_argument(
        "--skip",
        type=parts_arg,
        default=set(),
        help=f"comma list of parts to skip: {','.join(PARTS)} (tectonic: all the cluster "
        "parts; peer: also the peers of onedir)",
    )
    parser.add_argument(
        "--only",
        type=parts_arg,
        help="comma list of parts: run these alone (each section of the report names its own)",
    )
    parser.add_argument(
        "--with",
        dest="with_parts",
        type=parts_arg,
        default=set(),
        help=f"optional parts to run too: {','.join(sorted(OPTIONAL_PARTS))} (two jobs of "
        "weights 1:3 sharing a cluster, bench.bench_sharing)",
    )
    parser.add_argument(
        "--no-peers",
        action="store_true",
        help="no GlusterFS or JuiceFS: skips the peer part and onedir's peers (minutes, and "
        "their install)",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        help="where REPORT.md, report.png, results.json go (default bench/; "
        "with --smoke or --only a tmp dir)",
    )
    parser.add_argument("--workdir", type=Path, help="scratch directory on the disk to measure")
    parser.add_argument("--notes", type=Path, help="a Markdown file added to the report as Notes")
    parser.add_argument(
        "--big-bursts",
        action="store_true",
        help="also the 4,096 x 4 KiB and 16,384 x 64 KiB bursts (many minutes on 2 cores)",
    )
    parser.add_argument(
        "--only-bursts",
        help="comma list of 'RANKSxSHARD' bursts to run (e.g. 4096x4KiB): the tectonic part "
        "runs these bursts alone, with no stream or FUSE rows",
    )
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="measure nothing: rewrite REPORT.md from --out-dir's results.json",
    )
    parser.add_argument(
        "--from",
        dest="source",
        type=Path,
        help="with --render-only: the results file (e.g. partial-results.json)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    notes = args.notes.read_text() if args.notes else ""
    if args.render_only:
        out_dir = args.out_dir or REPO_ROOT / "bench"
        source = args.source or out_dir / "results.json"
        results = json.loads(source.read_text())
        if args.source:  # a partial run's full results: rewrite the plot and results.json too
            write_plot(results, out_dir / "report.png")
            slim = json.loads(json.dumps(results, default=str))
            _drop_bulky(slim)
            (out_dir / "results.json").write_text(json.dumps(slim, indent=1))
        (out_dir / "REPORT.md").write_text(render_report(results, "report.png", notes))
        print(f"rewrote {out_dir / 'REPORT.md'}")
        return 0
    skip = set(args.skip) | (set(PARTS) - args.only if args.only else set())
    skip |= OPTIONAL_PARTS - (args.only or set()) - args.with_parts
    peers = not args.no_peers and "peer" not in args.skip
    if args.no_peers:
        skip.add("peer")
    # a smoke run or some parts alone never overwrite the committed report
    out_dir = args.out_dir or (
        Path(tempfile.mkdtemp(prefix="bench-smoke-"))
        if args.smoke or args.only
        else REPO_ROOT / "bench"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    results_dir = out_dir / "results"
    if results_dir.exists():
        shutil.rmtree(results_dir)
    results_dir.mkdir()
    workdir = Path(tempfile.mkdtemp(prefix="bench-run-", dir=args.workdir))
    try:
        results = run(
            args.smoke, skip, workdir, results_dir, args.big_bursts, args.only_bursts, peers
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    slim = json.loads(json.dumps(results, default=str))
    _drop_bulky(slim)
    (out_dir / "results.json").write_text(json.dumps(slim, indent=1))
    write_plot(results, out_dir / "report.png")
    report = render_report(results, "report.png", notes)
    (out_dir / "REPORT.md").write_text(report)
    print(report)
    print(f"\nwrote {out_dir / 'REPORT.md'}, {out_dir / 'report.png'}, {out_dir / 'results.json'}")
    return 0


def _drop_bulky(d: Any) -> None:
    """Timelines and per-rank lists live in results/*.json; keep results.json readable."""
    if isinstance(d, dict):
        for key in ("timeline", "rank_times", "phases"):
            d.pop(key, None)
        for v in d.values():
            _drop_bulky(v)
    elif isinstance(d, list):
        for v in d:
            _drop_bulky(v)


if __name__ == "__main__":
    sys.exit(main())
