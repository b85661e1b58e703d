"""One command for the whole benchmark suite: ``python -m bench.run_all``.

It measures, in one run on this machine, so every figure has a ceiling and a peer beside it:

1. ceilings: raw disk (fsync write, cold read), zfec RS(6,3), loopback TCP, msgpack
   (``bench.ceilings``), and the Python FUSE ceiling, a mount that discards data
   (``bench.nullfs``);
2. tectonic-py on a local cluster (2 metadata servers, 9 chunk stores, RS(6,3), 4 MiB chunks,
   data on the same disk): the client library, one stream; the FUSE mount with ``dd`` and
   ``torch.save`` / ``torch.load`` of 2 GiB; the checkpoint burst (``tectonic loadtest``) at
   64, 1,024 and 4,096 ranks through the client library (the 1,024-rank one beside one
   stream of the same bytes, ``--baseline-stream``, for the CPU a file costs; with
   ``--big-bursts`` also 4,096 ranks of 4 KiB shards into one directory, for the creates
   rate alone, and 16,384 ranks of 64 KiB, each many minutes on 2 cores) and at 64 ranks
   through the mount;
3. the per-component scripts (bench_chunkstore, bench_metadata, bench_client, bench_fuse,
   bench_repair) as subprocesses with ``--json``; one that is missing is reported as such;
4. the peer, side by side: a GlusterFS 4+2 dispersed volume (``bench.gluster``) with the same
   dd, torch and loadtest --through-mount workloads, or the reason it could not run.

It writes ``bench/REPORT.md`` (Markdown tables: every figure as a ratio to its ceiling and to
the peer, CPU-seconds per GiB beside GlusterFS's), ``bench/report.png`` and
``bench/results.json`` (the raw figures); ``bench.report`` renders them. ``--smoke`` runs
everything at tiny sizes into a scratch directory (the test suite uses it) and never touches
the committed report.

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
# whole suite stays near 15 minutes on 2 cores (FUSE torch.save of 2 GiB is measured above)
OTHER_SCRIPTS: dict[str, list[str]] = {
    "bench_chunkstore": ["--total-mib", "256"],
    "bench_metadata": [],
    "bench_client": ["--size-mib", "1024", "--json"],
    "bench_fuse": ["--size", "1024"],
    "bench_repair": ["--size-mib", "512", "--write-mib", "128"],
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
    }


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
    log.warning("run_all: %s done in %.1f s", key, time.monotonic() - t0)
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
) -> dict[str, Any]:
    p = plan(smoke, big_bursts or bool(only_bursts))
    if only_bursts:
        wanted = {w.strip().replace(" ", "") for w in only_bursts.split(",") if w.strip()}
        p["bursts"] = [b for b in p["bursts"] if f"{b[0]}x{size_label(b[1])}" in wanted]
        p["stream_size"] = 0
        skip = skip | {"fuse"}
    results: dict[str, Any] = {
        "smoke": smoke,
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": _machine(),
        "plan": {k: v for k, v in p.items()},
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

    if "tectonic" not in skip:
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
            extra = flag if smoke else full_args
            _guard(
                others,
                name,
                lambda name=name, extra=extra: _python_module(
                    f"bench.{name}", "--json", *extra, timeout=t
                ),
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
        if p["stream_size"]:
            _guard(
                out,
                "client_stream",
                lambda: _loadtest(
                    [cf], 1, p["stream_size"], cluster.pids(), results_dir, p["loadtest_max_s"]
                ),
            )
        if "fuse" not in skip:
            _through_mount(out, p, cluster, workdir, results_dir)
        bursts: list[dict[str, Any]] = []
        out["bursts"] = bursts
        for ranks, shard, extra in p["bursts"]:
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
    finally:
        cluster.stop()
    return out


def _through_mount(
    out: dict[str, Any], p: dict[str, Any], cluster: Any, workdir: Path, results_dir: Path
) -> None:
    """dd, torch.save / torch.load and a burst through one ``tectonic mount`` of the cluster."""
    mount = TectonicMount(cluster.cluster_file, workdir / "mnt", workdir / "mount.log")
    mount.start()
    try:

        def pids() -> list[int]:
            return cluster.pids() + mount.pids()

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
    finally:
        mount.stop()


def _machine() -> dict[str, Any]:
    import psutil

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
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
        "commit": commit,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="run every benchmark and write the report")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, report to --out-dir")
    parser.add_argument(
        "--skip",
        default="",
        help="comma list of parts to skip: ceilings,nullfs,tectonic,fuse,others,peer",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        help="where REPORT.md, report.png, results.json go (default bench/; "
        "with --smoke a tmp dir)",
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
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    out_dir = args.out_dir or (
        Path(tempfile.mkdtemp(prefix="bench-smoke-")) if args.smoke else REPO_ROOT / "bench"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    results_dir = out_dir / "results"
    if results_dir.exists():
        shutil.rmtree(results_dir)
    results_dir.mkdir()
    workdir = Path(tempfile.mkdtemp(prefix="bench-run-", dir=args.workdir))
    try:
        results = run(args.smoke, skip, workdir, results_dir, args.big_bursts, args.only_bursts)
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
