"""``tectonic cluster up/down`` and ``tectonic status`` against a real local cluster.

Everything runs as a user would run it: the ``tectonic`` entry point in subprocesses, daemons
as real processes on 127.0.0.1, faults by ``kill -9``. Each test stops its cluster in a
``finally`` (``cluster down`` signals only the PIDs in the cluster's own pid file).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from test_cli import run_cli

from tectonic_py.launch.fork_server import command_line

pytestmark = pytest.mark.slow

# small enough for a shared 2-core machine; rs-4-2 still spreads a block over 6 nodes
LAYOUT = ["--chunkstores", "6", "--metadata-servers", "2", "--shards", "8", "--ec", "rs-4-2"]
NODE_TIMEOUT = "2"
# for tests of the supervisor itself, where fewer processes mean a faster test
TINY = ["--chunkstores", "3", "--metadata-servers", "1", "--shards", "4", "--ec", "r3"]


def client(op: str, cluster: Path, remote: str, local: Path | None = None) -> str:
    """``tectonic put`` a local file, or ``tectonic get`` one and return its sha256."""
    if op == "put":
        assert local is not None
        proc = run_cli("put", "-q", str(cluster), str(local), remote, timeout=180)
        assert proc.returncode == 0, proc.stderr
        return ""
    target = cluster.parent / "got.bin"
    target.unlink(missing_ok=True)
    proc = run_cli("get", "-q", str(cluster), remote, str(target), timeout=180)
    assert proc.returncode == 0, proc.stderr
    return hashlib.sha256(target.read_bytes()).hexdigest()


def status(cluster: Path) -> tuple[int, dict[str, Any]]:
    proc = run_cli("status", "--json", str(cluster))
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def wait_for_status(cluster: Path, predicate: Any, what: str) -> tuple[int, dict[str, Any]]:
    """Poll ``status --json`` until ``predicate`` holds; bounded in tries, never timed."""
    for _ in range(60):
        rc, st = status(cluster)
        if predicate(st):
            return rc, st
        time.sleep(0.5)
    raise AssertionError(f"status never showed {what}: {st}")


def pid_file(root: Path) -> dict[str, Any]:
    return json.loads((root / "cluster.pid").read_text())


def chunkstore_pid(root: Path, node_id: str) -> int:
    for pid in pid_file(root)["daemons"]:
        try:
            cmdline = command_line(psutil.Process(pid))
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue  # one killed earlier in the test
        if "chunkstore" in cmdline and cmdline[cmdline.index("--node-id") + 1] == node_id:
            return int(pid)
    raise AssertionError(f"no chunk store {node_id} in {pid_file(root)}")


def assert_all_gone(pids: list[int]) -> None:
    for pid in pids:
        try:
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, f"pid {pid} still runs"
        except psutil.NoSuchProcess:
            pass


def up_detached(root: Path, *extra: str) -> None:
    proc = run_cli("cluster", "up", "--detach", "--dir", str(root), *extra, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert f"cluster file:  {root / 'cluster.toml'}" in proc.stdout


def down(root: Path) -> None:
    run_cli("cluster", "down", "--dir", str(root), timeout=120)


def test_up_put_get_kill_down_up_keeps_data(tmp_path: Path) -> None:
    root = tmp_path / "cluster"
    cluster = root / "cluster.toml"
    data = os.urandom(2 * 4 * 4 * 1024 * 1024 + 12345)  # two full rs-4-2 blocks and a short one
    local = tmp_path / "payload.bin"
    local.write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    try:
        # no repair, so the degraded state stays put for status to show
        up_detached(root, *LAYOUT, "--node-timeout", NODE_TIMEOUT, "--no-maintenance")
        first = pid_file(root)
        assert len(first["daemons"]) == 8

        client("put", cluster, "/ckpt.bin", local)
        assert client("get", cluster, "/ckpt.bin") == digest

        # chunk counts arrive with the next heartbeats: 3 blocks of 6 chunks
        rc, st = wait_for_status(
            cluster, lambda s: sum(n["chunk_count"] for n in s["nodes"]) == 3 * 6, "18 chunks"
        )
        assert rc == 0
        assert sorted(n["node_id"] for n in st["nodes"]) == [f"cs{i}" for i in range(6)]
        for n in st["nodes"]:
            assert n["state"] == "up"
            assert {"address", "failure_domain", "capacity", "free", "chunk_count"} <= n.keys()
            assert 0 < n["free"] <= n["capacity"]
            assert n["chunk_count"] == 3, "one chunk of every block on every node"
        assert [s["state"] for s in st["metadata_servers"]] == ["up", "up"]
        assert sorted(x for s in st["metadata_servers"] for x in s["shards"]) == list(range(8))
        assert st["degraded_blocks"] == []
        # 6 stores in 6 failure domains for rs-4-2's 6 chunks: no spare for repair, said once
        (warning,) = st["warnings"]
        assert "no more than the 6 chunks of a rs-4-2 block" in warning

        # one "disk" dies: its blocks are degraded but readable, and status says which
        os.kill(chunkstore_pid(root, "cs0"), signal.SIGKILL)
        rc, st = wait_for_status(
            cluster,
            lambda s: any(n["node_id"] == "cs0" and n["state"] == "down" for n in s["nodes"]),
            "cs0 down",
        )
        assert rc == 0
        assert len(st["degraded_blocks"]) == 3
        assert "only 5 failure domains" in st["warnings"][0]
        for b in st["degraded_blocks"]:
            assert (b["live"], b["total"], b["missing"], b["readable"]) == (5, 6, ["cs0"], True)
        assert client("get", cluster, "/ckpt.bin") == digest  # a degraded read
        assert "exited; the cluster is degraded" in (root / "cluster.log").read_text()

        # two more: fewer than k live chunks; status exits 2 and marks the blocks lost
        for node in ("cs1", "cs2"):
            os.kill(chunkstore_pid(root, node), signal.SIGKILL)
        rc, st = wait_for_status(
            cluster, lambda s: sum(n["state"] == "down" for n in s["nodes"]) == 3, "3 down"
        )
        assert rc == 3
        assert all(not b["readable"] for b in st["degraded_blocks"])
        table = run_cli("status", str(cluster))
        assert table.returncode == 3 and "lost" in table.stdout

        down_proc = run_cli("cluster", "down", "--dir", str(root), timeout=120)
        assert down_proc.returncode == 0, down_proc.stderr
        assert not (root / "cluster.pid").exists()
        assert_all_gone([first["pid"], *first["daemons"]])

        # the same directory, no options: the same cluster, every chunk back
        up_detached(root, "--node-timeout", NODE_TIMEOUT, "--no-maintenance")
        rc, st = wait_for_status(
            cluster, lambda s: all(n["state"] == "up" for n in s["nodes"]), "all up"
        )
        assert rc == 0 and len(st["nodes"]) == 6 and st["degraded_blocks"] == []
        assert client("get", cluster, "/ckpt.bin") == digest
    finally:
        down(root)


def test_foreground_ctrl_c_stops_everything(tmp_path: Path) -> None:
    root = tmp_path / "cluster"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tectonic_py.cli.main", "cluster", "up", "--dir", str(root), *TINY],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(600):
            if (root / "cluster.pid").exists() or proc.poll() is not None:
                break
            time.sleep(0.2)
        info = pid_file(root)
        assert info["pid"] == proc.pid
        # 1 metadata server, 3 chunk stores and the maintenance daemon (on by default)
        commands = [" ".join(command_line(psutil.Process(pid))) for pid in info["daemons"]]
        assert len(commands) == 5
        assert sum(" maintenance " in c for c in commands) == 1
        second = run_cli("cluster", "up", "--detach", "--dir", str(root))
        assert second.returncode != 0 and "already running" in second.stderr

        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert "Traceback" not in err
        assert "Ctrl-C" in out and "cluster stopped" in out
        assert not (root / "cluster.pid").exists()
        assert_all_gone(info["daemons"])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        down(root)


def test_detached_start_failure_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    """A daemon that cannot start (its data directory is a file) fails `up` cleanly."""
    root = tmp_path / "cluster"
    (root / "chunks").mkdir(parents=True)
    (root / "chunks" / "2").write_text("not a directory")
    proc = run_cli("cluster", "up", "--detach", "--dir", str(root), *TINY, timeout=240)
    try:
        assert proc.returncode != 0
        assert "Traceback" not in proc.stderr
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and "did not start" in lines[0], proc.stderr
        assert not (root / "cluster.pid").exists()
        leftovers = [
            p.pid
            for p in psutil.process_iter(["cmdline"])
            if any(str(root) in part for part in (p.info["cmdline"] or []))
        ]
        assert leftovers == []
    finally:
        down(root)


def metadata_pid(root: Path, index: int) -> int:
    for pid in pid_file(root)["daemons"]:
        try:
            cmdline = command_line(psutil.Process(pid))
        except psutil.NoSuchProcess:  # includes ZombieProcess: one killed earlier in the test
            continue
        if "metadata" in cmdline and str(root / "metadata" / str(index)) in cmdline:
            return int(pid)
    raise AssertionError(f"no metadata server {index} in {pid_file(root)}")


def test_status_with_metadata_servers_down(tmp_path: Path) -> None:
    """A down metadata server is shown and makes the exit code 3; without the registry
    status is one clear error, never a half-empty table."""
    root = tmp_path / "cluster"
    cluster = root / "cluster.toml"
    layout = ["--chunkstores", "3", "--metadata-servers", "2", "--shards", "4", "--ec", "r3"]
    try:
        up_detached(root, *layout, "--node-timeout", NODE_TIMEOUT, "--no-maintenance")
        os.kill(metadata_pid(root, 1), signal.SIGKILL)
        rc, st = status(cluster)
        assert rc == 3
        assert [s["state"] for s in st["metadata_servers"]] == ["up", "down"]
        assert "cannot connect" in st["metadata_servers"][1]["error"]
        assert st["degraded_blocks"] == [] and st["degraded_error"] is None

        # a chunk store down too: its blocks cannot all be looked up; say so, not "none"
        os.kill(chunkstore_pid(root, "cs1"), signal.SIGKILL)
        rc, st = wait_for_status(
            cluster, lambda s: any(n["state"] == "down" for n in s["nodes"]), "cs1 down"
        )
        assert rc == 3
        assert st["degraded_blocks"] is None and "unavailable" in st["degraded_error"]
        table = run_cli("status", str(cluster))
        assert table.returncode == 3 and "degraded blocks unknown" in table.stdout

        os.kill(metadata_pid(root, 0), signal.SIGKILL)
        proc = run_cli("status", "--json", str(cluster))
        assert proc.returncode == 1 and proc.stdout == ""
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "cannot reach the node registry" in lines[0]
    finally:
        down(root)
