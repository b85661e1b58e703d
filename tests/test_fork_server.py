"""The local cluster's fork server (tectonic_py/launch/fork_server.py): daemons forked from it
are processes of their own, as subprocesses were, and a bad request is answered, not fatal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tectonic_py.core.errors import ConfigError
from tectonic_py.core.process_env import PROJECT_ROOT, child_env
from tectonic_py.launch.fork_server import ForkedProcess, ForkServer, command_line
from tectonic_py.launch.local_cluster import LocalCluster


def _small(root: Path, **kw: object) -> LocalCluster:
    return LocalCluster(root, chunkstores=3, metadata_servers=1, shards=4, ec="rs-2-1", **kw)  # type: ignore[arg-type]


def test_forked_daemons_are_processes_of_their_own(tmp_path: Path) -> None:
    with _small(tmp_path / "c") as cluster:
        pids = cluster.pids()
        assert len(set(pids)) == 4 and os.getpid() not in pids
        for pid in pids:
            assert os.getsid(pid) == pid  # its own session, as start_new_session gave
            args = command_line(psutil.Process(pid))
            assert args[1:3] == ["-m", "tectonic_py.cli.main"]
            assert str(tmp_path / "c") in " ".join(args)  # `cluster down` finds it by this
            assert psutil.Process(pid).cwd() == str(PROJECT_ROOT)
        victim = cluster.chunkstore_pids()[1]
        assert victim is not None
        cluster.kill_chunkstore(1)
        assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == "zombie"
        assert cluster._chunk[1].proc is not None and cluster._chunk[1].proc.poll() == -9
        others = [p for p in pids if p != victim]
        assert all(psutil.Process(p).status() != "zombie" for p in others)
        cluster.start_chunkstore(1)
        assert cluster.chunkstore_pids()[1] not in (None, victim)
        log = (tmp_path / "c" / "logs" / "chunkstore-1.log").read_text()
        assert log.count("serving") == 2  # both lives appended to the daemon's own log
    assert all(not psutil.pid_exists(p) for p in pids if p != victim)


def test_a_daemon_that_cannot_start_says_its_exit_status(tmp_path: Path) -> None:
    cluster = _small(tmp_path / "c", chunkstore_args=["--max-write-rate", "fast"])
    with pytest.raises(ConfigError, match=r"chunkstore-0 exited with status 2"):
        cluster.start()
    assert cluster.pids() == []


def test_the_subprocess_path_still_runs(tmp_path: Path) -> None:
    with _small(tmp_path / "c", fork_server=False) as cluster:
        for pid in cluster.pids():
            assert psutil.Process(pid).cmdline()[3] in ("metadata", "chunkstore")
            assert psutil.Process(pid).ppid() == os.getpid()


def test_bad_requests_are_answered_and_the_server_lives_on(tmp_path: Path) -> None:
    server = subprocess.Popen(
        [sys.executable, "-m", "tectonic_py.launch.fork_server"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=str(PROJECT_ROOT), env=child_env(),
    )  # fmt: skip
    assert server.stdin is not None and server.stdout is not None

    def ask(line: bytes) -> dict[str, object]:
        assert server.stdin is not None and server.stdout is not None
        server.stdin.write(line + b"\n")
        server.stdin.flush()
        return json.loads(server.stdout.readline())  # type: ignore[no-any-return]

    try:
        assert "bad request" in str(ask(b"{not json")["error"])
        assert "unknown op" in str(ask(b'{"op": "exec"}')["error"])
        assert "bad request" in str(ask(b'{"op": "spawn"}')["error"])
        assert "not a daemon" in str(ask(b'{"op": "poll", "pid": 1}')["error"])
        log = tmp_path / "d.log"
        spawn = {"op": "spawn", "args": ["--version"], "log": str(log), "cwd": str(tmp_path),
                 "env": child_env()}  # fmt: skip
        pid = ask(json.dumps(spawn).encode())["pid"]
        assert isinstance(pid, int)
        while (code := ask(json.dumps({"op": "poll", "pid": pid}).encode())["returncode"]) is None:
            pass
        assert code == 0 and "tectonic" in log.read_text()
    finally:
        server.stdin.close()
        assert server.wait(30) == 0
        server.stdout.close()


def test_a_handle_outlives_its_server(tmp_path: Path) -> None:
    """A daemon still running when its server closes reads as running while its PID lives."""
    forks = ForkServer(PROJECT_ROOT, child_env(), tmp_path / "server.log")
    args = ["chunkstore", "--data-dir", str(tmp_path / "d"), "--listen", "127.0.0.1:0",
            "--node-id", "cs0", "--failure-domain", "fd0",
            "--secret-file", str(tmp_path / "missing")]  # fmt: skip
    proc: ForkedProcess = forks.spawn(args, tmp_path / "cs.log", tmp_path, child_env())
    assert proc.wait(30) != 0  # no secret file: the chunk store refuses to start
    assert "missing" in (tmp_path / "cs.log").read_text()
    sleeper = forks.spawn(["metadata", "--help"], tmp_path / "m.log", tmp_path, child_env())
    sleeper.wait(30)
    forks.close()
    assert proc.poll() is not None and sleeper.poll() == 0
    orphan = ForkedProcess(forks, os.getpid(), server_pid=1)
    assert orphan.poll() is None  # its server is gone; the PID is alive


def test_a_killed_fork_server_loses_no_daemon(tmp_path: Path) -> None:
    """kill -9 of the fork server: its daemons serve on, a stop still stops them all, and
    the next start forks from a new server."""
    cluster = _small(tmp_path / "c")
    try:
        cluster.start()
        pids = cluster.pids()
        server = cluster._forks._proc  # type: ignore[union-attr]
        assert server is not None
        os.kill(server.pid, 9)
        server.wait(30)
        assert all(psutil.Process(p).status() != "zombie" for p in pids)
        cluster.kill_chunkstore(0)  # its parent is gone: reaped by init, read by its PID
        assert cluster.chunkstore_pids()[0] is None
        cluster.start_chunkstore(0)
        assert cluster._forks._proc is not server  # type: ignore[union-attr]
        pids = cluster.pids()
    finally:
        cluster.stop()
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
