"""One command for the whole benchmark suite: ``python -m bench.run_all``.

It measures, in one run on this machine, so every figure has a ceiling and a peer beside it:

1. ceilings: raw disk (fsync write, cold read), zfec RS(6,3), loopback TCP, msgpack
   (``bench.ceilings``), and the Python FUSE ceiling, a mount that discards data
   (``bench.nullfs``);
2. tectonic-py on a local cluster (2 metadata servers, 9 chunk stores, RS(6,3), 4 MiB chunks,
   data on the same disk): the client library, one stream; the FUSE mount with ``dd`` and
   ``torch.save`` / ``torch.load`` of 2 GiB; the checkpoint burst (``tectonic loadtest``) at
   64, 1,024 and 4,096 ranks through the client library and at 64 ranks through the mount;
3. the other engineers' scripts (bench_chunkstore, bench_metadata, bench_client, bench_fuse)
   as subprocesses with ``--json``; one that is not there yet is reported as missing;
4. the peer, side by side: a GlusterFS 4+2 dispersed volume (``bench.gluster``) with the same
   dd, torch and loadtest --through-mount workloads, or the reason it could not run.

It writes ``bench/REPORT.md`` (Markdown tables: every figure as a ratio to its ceiling and to
the peer, CPU-seconds per GiB beside GlusterFS's), ``bench/report.png`` and
``bench/results.json`` (the raw figures). ``--smoke`` runs everything at tiny sizes into a
scratch directory (the test suite uses it) and never touches the committed report.

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
from tectonic_py.loadtest import GiB, MiB

log = logging.getLogger(__name__)

# the other engineers' scripts, with the arguments of a full run: sizes trimmed so that the
# whole suite stays near 15 minutes on 2 cores (FUSE torch.save of 2 GiB is measured above)
OTHER_SCRIPTS: dict[str, list[str]] = {
    "bench_chunkstore": ["--total-mib", "256"],
    "bench_metadata": [],
    "bench_client": ["--size-mib", "1024", "--json"],
    "bench_fuse": ["--size", "1024"],
    "bench_repair": ["--size-mib", "512", "--write-mib", "128"],
}


# --- sizes of a full run and of a smoke run ----------------------------------------------------


def plan(smoke: bool) -> dict[str, Any]:
    if smoke:
        return {
            "fuse_size": 16 * MiB,
            "stream_size": 0,  # the bursts below exercise the same client-library path
            "bursts": [(8, MiB)],
            "mount_burst": (4, MiB),
            "peer_size": 16 * MiB,
            "peer_burst": (4, MiB),
            "script_timeout": 300,
            "loadtest_max_s": 120,
        }
    return {
        "fuse_size": 2 * GiB,
        "stream_size": 512 * MiB,
        # (ranks, shard bytes): the 64-rank run at the same 1 MiB shards is the baseline of the
        # "no collapse" target; 64 x 16 MiB shows large shards
        "bursts": [(64, 16 * MiB), (64, MiB), (1024, MiB), (4096, MiB)],
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
) -> dict[str, Any]:
    """One ``tectonic loadtest`` run; returns its full results file (with timeline)."""
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
            src.rename(results_dir / f"loadtest-{mode}-{ranks}x{_size_label(shard)}.{ext}")
    return result


def _size_label(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"


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


def run(smoke: bool, skip: set[str], workdir: Path, results_dir: Path) -> dict[str, Any]:
    p = plan(smoke)
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
    from tectonic_py.local_cluster import LocalCluster

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
                    lambda: torch_workload(
                        str(mount.mountpoint), p["fuse_size"], pids, mount.remount
                    ),
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
        bursts: list[dict[str, Any]] = []
        out["bursts"] = bursts
        for ranks, shard in p["bursts"]:
            box: dict[str, Any] = {}
            key = f"burst {ranks} x {_size_label(shard)}"
            _guard(
                box,
                key,
                lambda ranks=ranks, shard=shard: _loadtest(
                    [cf], ranks, shard, cluster.pids(), results_dir, p["loadtest_max_s"]
                ),
            )
            bursts.append(box[key])
    finally:
        cluster.stop()
    return out


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


# --- the report ----------------------------------------------------------------------------


def _get(d: Any, *path: Any) -> Any:
    for key in path:
        if isinstance(d, dict):
            d = d.get(key)
        elif isinstance(d, list) and isinstance(key, int) and -len(d) <= key < len(d):
            d = d[key]
        else:
            return None
    return d


def _fmt(v: Any, digits: int = 0) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def _ratio(a: Any, b: Any) -> str:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or not b:
        return "-"
    return f"{a / b:.2f}"


def _burst_label(b: dict[str, Any]) -> str:
    return f"{b.get('ranks')} x {_size_label(int(b.get('shard_size') or 0))}"


def render_report(results: dict[str, Any], plot_name: str, notes: str = "") -> str:
    ceil = results.get("ceilings") or {}
    null = results.get("nullfs") or {}
    tec = results.get("tectonic") or {}
    peer = results.get("peer") or {}
    peer_ok = bool(peer.get("available"))
    lines: list[str] = []
    add = lines.append
    m = results.get("machine", {})
    add("# tectonic-py benchmark report")
    add("")
    add(
        f"Generated by `python -m bench.run_all` on {results.get('started')} (finished "
        f"{results.get('finished')}), commit `{m.get('commit')}`, {m.get('cpus')} vCPU, "
        f"{m.get('memory_gib')} GiB, kernel {m.get('kernel')}, Python {m.get('python')}."
    )
    lb, la = results.get("load_before") or [0, 0, 0], results.get("load_after") or [0, 0, 0]
    add(
        f"Load average at start {lb[0]:.1f}, at end {la[0]:.1f}: the machine's 2 cores are "
        "shared with other engineers' test runs, so MB/s figures are noisy (up to 2x between "
        "runs); CPU-seconds per GiB are steadier. Every ratio is to a ceiling measured in this "
        "same run."
    )
    if results.get("smoke"):
        add("")
        add("**Smoke run: tiny sizes, figures meaningless.**")
    add("")
    add(f"![benchmark plot]({plot_name})")
    add("")

    # headline comparison
    add("## tectonic-py beside its ceilings and the peer (GlusterFS 4+2 dispersed)")
    add("")
    add(
        "MB/s are 10^6 bytes per second. CPU-s/GiB counts every process involved (the workload, "
        "the FUSE daemon, metadata servers and chunk stores; for GlusterFS glusterd, the six "
        "bricks, the self-heal daemon and the FUSE client). Reads are cold (remounted)."
    )
    add("")
    add(
        "| workload | tectonic-py MB/s | CPU-s/GiB | ceiling | ceiling MB/s | ratio to ceiling "
        "| GlusterFS MB/s | GlusterFS CPU-s/GiB | ratio to GlusterFS |"
    )
    add("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    nd_w, nd_r = _get(null, "dd_write", "mbps"), _get(null, "dd_read", "mbps")
    rows = [
        (
            "dd write bs=1M conv=fsync (FUSE)",
            _get(tec, "fuse_dd", "dd_write"),
            "nullfs dd write",
            nd_w,
            _get(peer, "dd_write"),
        ),
        (
            "dd read bs=1M, cold (FUSE)",
            _get(tec, "fuse_dd", "dd_read"),
            "nullfs dd read",
            nd_r,
            _get(peer, "dd_read"),
        ),
        (
            "torch.save + fsync (FUSE)",
            _get(tec, "fuse_torch", "torch_save"),
            "nullfs dd write",
            nd_w,
            _get(peer, "torch_save"),
        ),
        (
            "torch.load, cold, verified (FUSE)",
            _get(tec, "fuse_torch", "torch_load"),
            "nullfs dd read",
            nd_r,
            _get(peer, "torch_load"),
        ),
    ]
    for label, ours, cname, cval, theirs in rows:
        add(
            f"| {label} | {_fmt(_get(ours, 'mbps'))} | {_fmt(_get(ours, 'cpu_s_per_gib'), 2)} "
            f"| {cname} | {_fmt(cval)} | {_ratio(_get(ours, 'mbps'), cval)} "
            f"| {_fmt(_get(theirs, 'mbps'))} | {_fmt(_get(theirs, 'cpu_s_per_gib'), 2)} "
            f"| {_ratio(_get(ours, 'mbps'), _get(theirs, 'mbps'))} |"
        )
    stream = tec.get("client_stream") or {}
    # The higher of buffered and O_DIRECT: a buffered figure can be bound by this VM's CPU
    # rather than the disk (bench.ceilings.disk_read_direct).
    disk_w, disk_r = (
        max((v for v in (_get(ceil, name, "mbps") for name in names) if v), default=None)
        for names in (
            ("disk_write_fsync", "disk_write_direct_fsync"),
            ("disk_read_cold", "disk_read_direct"),
        )
    )
    for label, key, cpu_key, cname, cval in (
        (
            "client library write, 1 stream",
            "write_gbps",
            "cpu_s_per_gib_write",
            "disk write (fsync; buffered or O_DIRECT)",
            disk_w,
        ),
        (
            "client library read, 1 stream",
            "read_gbps",
            "cpu_s_per_gib_read",
            "disk read (cold; buffered or O_DIRECT)",
            disk_r,
        ),
    ):
        mbps = _mbps(stream.get(key))
        add(
            f"| {label} | {_fmt(mbps)} | {_fmt(stream.get(cpu_key), 2)} | {cname} | "
            f"{_fmt(cval)} | {_ratio(mbps, cval)} | - | - | - |"
        )
    mb = tec.get("mount_burst") or {}
    pl = peer.get("loadtest") or {}
    for label, key, cpu_key, cval in (
        ("loadtest --through-mount write", "write_gbps", "cpu_s_per_gib_write", nd_w),
        ("loadtest --through-mount read", "read_gbps", "cpu_s_per_gib_read", nd_r),
    ):
        ours, theirs = _mbps(mb.get(key)), _mbps(pl.get(key))
        add(
            f"| {label} ({_burst_label(mb) if mb.get('ranks') else '-'}) | {_fmt(ours)} "
            f"| {_fmt(mb.get(cpu_key), 2)} | nullfs dd | {_fmt(cval)} | {_ratio(ours, cval)} "
            f"| {_fmt(theirs)} | {_fmt(pl.get(cpu_key), 2)} | {_ratio(ours, theirs)} |"
        )
    add("")
    if mb.get("pause_s") is not None or pl.get("pause_s") is not None:
        add(
            f"GPU pause of the {mb.get('ranks') or pl.get('ranks')}-rank burst through the "
            "mount: tectonic-py "
            f"{_fmt(mb.get('pause_s'), 2)} s, GlusterFS {_fmt(pl.get('pause_s'), 2)} s."
        )
        add("")
    if not peer_ok:
        add(
            f"**GlusterFS could not run here:** {peer.get('reason') or peer.get('error') or 'skipped'}"
        )
        add("")
    else:
        add(
            f"Peer: {peer.get('version')}, {peer.get('volume')}, {peer.get('bricks')} bricks on "
            "this host under a tmp directory, FUSE mount (`mount -t glusterfs`), set up and torn "
            "down by `bench/gluster.py`."
        )
        add("")

    # targets
    add("## Targets")
    add("")
    ts, tl = (
        _get(tec, "fuse_torch", "torch_save", "mbps"),
        _get(tec, "fuse_torch", "torch_load", "mbps"),
    )
    gs, gl = _get(peer, "torch_save", "mbps"), _get(peer, "torch_load", "mbps")
    bursts = [b for b in tec.get("bursts") or [] if isinstance(b, dict)]
    base = next((b for b in bursts if b.get("ranks") == 64 and b.get("shard_size") == MiB), None)
    big = next((b for b in bursts if b.get("ranks") == 4096), None)
    add("| target | measured | met |")
    add("|---|---|---|")

    def target(name: str, measured: str, ok: bool | None) -> None:
        add(f"| {name} | {measured} | {'-' if ok is None else ('yes' if ok else '**no**')} |")

    if base and big:
        r = big.get("write_gbps", 0) / base["write_gbps"] if base.get("write_gbps") else None
        target(
            "burst: write GB/s at 4,096 ranks >= 0.8 x at 64 ranks (same 1 MiB shards)",
            f"{_fmt(big.get('write_gbps'), 3)} / {_fmt(base.get('write_gbps'), 3)} = {_fmt(r, 2)}",
            None if r is None else r >= 0.8,
        )
    else:
        target("burst: 4,096 vs 64 ranks >= 0.8", "not measured", None)
    total_errors = sum(int(b.get("errors") or 0) for b in bursts)
    target(
        "burst: zero errors, every byte verified",
        f"{total_errors} errors; "
        + ", ".join(
            f"{_burst_label(b)}: {_fmt(b.get('bytes_verified'))} of {_fmt(b.get('bytes_written'))} B"
            for b in bursts
        ),
        total_errors == 0
        and all(b.get("bytes_verified") == b.get("shard_bytes_per_step") for b in bursts)
        if bursts
        else None,
    )
    target(
        "FUSE torch.save >= 2x GlusterFS",
        f"{_fmt(ts)} vs {_fmt(gs)} MB/s = {_ratio(ts, gs)}",
        None if not (ts and gs) else ts >= 2 * gs,
    )
    target(
        "FUSE torch.load >= 2x GlusterFS",
        f"{_fmt(tl)} vs {_fmt(gl)} MB/s = {_ratio(tl, gl)}",
        None if not (tl and gl) else tl >= 2 * gl,
    )
    add("")

    # bursts
    add("## Checkpoint burst: `tectonic loadtest` through the client library")
    add("")
    add(
        "Every rank saves one shard at the same moment (a barrier), then every rank reads its "
        "shard back and checks it by crc32c. Write GB/s = bytes / GPU pause (burst start to the "
        "last close). CPU-s/GiB includes the workers, the metadata servers and the chunk stores."
    )
    add("")
    add(
        "| ranks x shard | procs | write GB/s | read GB/s | GPU pause s | rank done p50/p90/p99/max s "
        "| creates/s | errors | bytes verified | CPU-s/GiB w / r | peak RSS worker / daemon |"
    )
    add("|---|---:|---:|---:|---:|---|---:|---:|---:|---|---|")
    for b in bursts:
        if b.get("status") == "failed" and "ranks" not in b:
            add(f"| failed: {b.get('error', '')[:200]} |||||||||||")
            continue
        add(
            f"| {_burst_label(b)} | {b.get('processes')} | {_fmt(b.get('write_gbps'), 3)} "
            f"| {_fmt(b.get('read_gbps'), 3)} | {_fmt(b.get('pause_s'), 2)} | "
            + "/".join(
                _fmt(b.get(k), 2)
                for k in (
                    "rank_write_p50_s",
                    "rank_write_p90_s",
                    "rank_write_p99_s",
                    "rank_write_max_s",
                )
            )
            + f" | {_fmt(b.get('creates_per_s'))} | {b.get('errors')} "
            f"| {_fmt(b.get('bytes_verified'))} | {_fmt(b.get('cpu_s_per_gib_write'), 1)} / "
            f"{_fmt(b.get('cpu_s_per_gib_read'), 1)} | {_mib(b.get('worker_max_rss'))} / "
            f"{_mib(b.get('watched_max_rss'))} |"
        )
    add("")
    for b in bursts:
        if b.get("error_samples"):
            add(f"Errors of the {_burst_label(b)} burst (first of {b.get('errors')}):")
            add("")
            for e in b["error_samples"][:5]:
                add(f"- `{str(e)[:300]}`")
            add("")

    # metadata
    add("## Metadata creates per second")
    add("")
    add("| source | creates/s | ceiling: raw SQLite commits/s (batch 1) | ratio |")
    add("|---|---:|---:|---:|")
    md = _get(results, "others", "bench_metadata") or {}
    raw = next(
        (
            r.get("commits_per_s")
            for r in md.get("raw_sqlite") or []
            if isinstance(r, dict) and r.get("batch") == 1
        ),
        None,
    )
    for run_ in md.get("runs") or []:
        if isinstance(run_, dict):
            for key, where in (("one_dir_per_s", "one directory"), ("spread_per_s", "spread")):
                add(
                    f"| bench_metadata, {run_.get('servers')} server(s), {where} "
                    f"| {_fmt(run_.get(key))} | {_fmt(raw)} | {_ratio(run_.get(key), raw)} |"
                )
    for b in bursts:
        add(
            f"| loadtest burst {_burst_label(b)} (all ranks create at once) "
            f"| {_fmt(b.get('creates_per_s'))} | {_fmt(raw)} | {_ratio(b.get('creates_per_s'), raw)} |"
        )
    add("")

    # ceilings
    add("## Ceilings measured in this run")
    add("")
    add("| ceiling | MB/s | CPU-s/GiB |")
    add("|---|---:|---:|")
    for name, r in ceil.items():
        if isinstance(r, dict) and "mbps" in r:
            add(f"| {name} | {_fmt(r['mbps'])} | {_fmt(r.get('cpu_s_per_gib'), 2)} |")
        elif isinstance(r, dict) and "pack_us" in r:
            add(
                f"| msgpack of a 1 MiB payload: pack / unpack µs | {r['pack_us']} / "
                f"{r['unpack_us']} | |"
            )
    for key in ("dd_write", "dd_read"):
        r = null.get(key)
        if isinstance(r, dict):
            add(
                f"| nullfs (pyfuse3 + trio, discards data) {key} | {_fmt(r.get('mbps'))} | "
                f"{_fmt(null.get('cpu_s_per_gib'), 2)} |"
            )
    if ceil.get("status") == "failed" or null.get("status") == "failed":
        add("")
        add(f"Ceilings failed: {ceil.get('error') or ''} {null.get('error') or ''}")
    add("")

    # other scripts
    add("## The other engineers' bench scripts")
    add("")
    for name, r in (results.get("others") or {}).items():
        status = r.get("status", "ok") if isinstance(r, dict) else "?"
        add(f"### {name}: {status}")
        add("")
        if status != "ok":
            add(f"`{str(r.get('error', ''))[:400]}`")
        else:
            flat = _flatten(r)
            add("| figure | value |")
            add("|---|---:|")
            for k, v in flat[:40]:
                add(f"| {k} | {_fmt(v, 3) if isinstance(v, float) else v} |")
            if len(flat) > 40:
                add(f"| ... {len(flat) - 40} more in results.json | |")
        add("")

    failures = [
        (k, v.get("error"))
        for k, v in (("ceilings", ceil), ("nullfs", null), ("tectonic", tec))
        if isinstance(v, dict) and v.get("status") == "failed"
    ] + [
        (k, v.get("error"))
        for k, v in tec.items()
        if isinstance(v, dict) and v.get("status") == "failed"
    ]
    if failures:
        add("## Parts that failed in this run")
        add("")
        for k, e in failures:
            add(f"- {k}: `{str(e)[:500]}`")
        add("")
    if notes.strip():
        add("## Notes")
        add("")
        add(notes.strip())
        add("")
    add(
        "Raw figures: `bench/results.json`; per-burst plots and full results (timelines, "
        "per-rank times) go to `bench/results/`, which each run rewrites and git ignores."
    )
    add("")
    return "\n".join(lines)


def _mbps(gbps: Any) -> float | None:
    return gbps * 1000 if isinstance(gbps, (int, float)) else None


def _mib(v: Any) -> str:
    return "-" if not isinstance(v, (int, float)) else f"{v / MiB:,.0f} MiB"


def _flatten(d: Any, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    if isinstance(d, dict):
        for k, v in d.items():
            if k in ("status", "timeline", "rank_times", "trace"):
                continue
            out.extend(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(d, list):
        for i, v in enumerate(d[:12]):
            out.extend(_flatten(v, f"{prefix}[{i}]"))
    elif isinstance(d, (int, float)) and not isinstance(d, bool):
        out.append((prefix, d))
    return out


def write_plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tec = results.get("tectonic") or {}
    peer = results.get("peer") or {}
    null = results.get("nullfs") or {}
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    ax = axes[0][0]
    labels = ["dd write", "dd read", "torch.save", "torch.load"]
    ours = [
        _get(tec, "fuse_dd", "dd_write", "mbps"),
        _get(tec, "fuse_dd", "dd_read", "mbps"),
        _get(tec, "fuse_torch", "torch_save", "mbps"),
        _get(tec, "fuse_torch", "torch_load", "mbps"),
    ]
    theirs = [
        _get(peer, "dd_write", "mbps"),
        _get(peer, "dd_read", "mbps"),
        _get(peer, "torch_save", "mbps"),
        _get(peer, "torch_load", "mbps"),
    ]
    ceiling = [
        _get(null, "dd_write", "mbps"),
        _get(null, "dd_read", "mbps"),
        _get(null, "dd_write", "mbps"),
        _get(null, "dd_read", "mbps"),
    ]
    xs = list(range(len(labels)))
    for off, vals, name in (
        (-0.27, ours, "tectonic-py (FUSE)"),
        (0.0, theirs, "GlusterFS 4+2"),
        (0.27, ceiling, "nullfs ceiling"),
    ):
        ax.bar([x + off for x in xs], [v or 0 for v in vals], width=0.27, label=name)
    ax.set_xticks(xs, labels)
    ax.set_ylabel("MB/s")
    ax.set_title("through a FUSE mount, same machine, same run")
    ax.legend(fontsize="small")

    ax = axes[0][1]
    ours_cpu = [
        _get(tec, "fuse_dd", "dd_write", "cpu_s_per_gib"),
        _get(tec, "fuse_dd", "dd_read", "cpu_s_per_gib"),
        _get(tec, "fuse_torch", "torch_save", "cpu_s_per_gib"),
        _get(tec, "fuse_torch", "torch_load", "cpu_s_per_gib"),
    ]
    theirs_cpu = [
        _get(peer, "dd_write", "cpu_s_per_gib"),
        _get(peer, "dd_read", "cpu_s_per_gib"),
        _get(peer, "torch_save", "cpu_s_per_gib"),
        _get(peer, "torch_load", "cpu_s_per_gib"),
    ]
    for off, vals, name in ((-0.2, ours_cpu, "tectonic-py"), (0.2, theirs_cpu, "GlusterFS 4+2")):
        ax.bar([x + off for x in xs], [v or 0 for v in vals], width=0.4, label=name)
    ax.set_xticks(xs, labels)
    ax.set_ylabel("CPU-seconds per GiB (all processes)")
    ax.set_title("CPU cost")
    ax.legend(fontsize="small")

    bursts = [b for b in tec.get("bursts") or [] if isinstance(b, dict) and b.get("ranks")]
    ax = axes[1][0]
    names = [_burst_label(b) for b in bursts]
    bx = list(range(len(bursts)))
    ax.bar([x - 0.2 for x in bx], [b.get("write_gbps") or 0 for b in bursts], 0.4, label="write")
    ax.bar([x + 0.2 for x in bx], [b.get("read_gbps") or 0 for b in bursts], 0.4, label="read")
    ax.set_xticks(bx, names, fontsize="small")
    ax.set_ylabel("aggregate GB/s")
    ax.set_title("checkpoint burst (client library)")
    ax.legend(fontsize="small")

    ax = axes[1][1]
    for b in bursts:
        times = _get(b, "rank_times", "write") or []
        if times:
            ax.plot(times, [(i + 1) / len(times) for i in range(len(times))], label=_burst_label(b))
    ax.set_xlabel("seconds after burst start")
    ax.set_ylabel("fraction of ranks closed")
    ax.set_title("per-rank completion CDF (the GPU pause is where each line reaches 1)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


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
        results = run(args.smoke, skip, workdir, results_dir)
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
