"""Daemons of a local cluster forked from one process that has imported them already.

Why: most of a daemon's start is Python importing trio, cryptography, msgpack and our own
tree, and a local cluster starts eleven daemons, again after every kill; a fork of a process
that has done those imports costs far less (docs/decisions/2026-12-05-suite-time.md). Each daemon is still a process of its own: its
own PID (``kill -9`` of one takes only it), its own session, log file, working directory and
environment, running the same ``tectonic`` command line a subprocess would.

``ForkServer`` starts ``python -m tectonic_py.launch.fork_server`` and speaks JSON lines on
its stdin and stdout: ``spawn`` (argv, log, cwd, env) answers the new daemon's PID and the
server's own (a daemon's status is asked only of its parent), ``poll`` its exit status once
it has ended (the server is the daemons' parent and reaps them).
``ForkedProcess`` is the handle a caller gets, with the part of ``subprocess.Popen``'s
interface that a supervisor uses (``pid``, ``poll``, ``wait``, ``returncode``).

The server holds no threads and no event loop when it forks (fork-safe imports only).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Any

import psutil
import setproctitle

from tectonic_py.core.errors import InvalidArgument, Unavailable

# The program a daemon runs, named as the subprocess path names it (``python -m CLI``): the
# launcher runs that command line and uses none of the CLI's or the servers' code itself, so
# they are imported by name, as a program is loaded, not as a dependency of this layer.
CLI = "tectonic_py.cli.main"
# What the daemons import: done once in the server, shared by every fork.
PRELOAD = (CLI, "chunkstore.main", "metadata.main", "tectonic_py.cli.maintenance")


class ForkServer:
    """The parent side: one server process, started on first use, thread-safe."""

    def __init__(self, cwd: Path, env: dict[str, str], log_file: Path) -> None:
        self._cwd = cwd
        self._env = env
        self._log_file = log_file
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def _call(self, request: dict[str, Any], server: int | None = None) -> dict[str, Any]:
        """``request`` to the running server (a spawn starts one if none runs); ``server``:
        only to that one (the PID of the server that forked a daemon, which alone knows its
        exit status)."""
        with self._lock:
            proc = self._proc if self._proc is not None and self._proc.poll() is None else None
            if request["op"] == "spawn":
                proc = proc or self._start()
            elif proc is None or proc.pid != server:
                raise Unavailable("the fork server of that daemon is gone")
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(json.dumps(request).encode() + b"\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
            except OSError as e:
                raise Unavailable(f"fork server: {e}") from e
        if not line:
            raise Unavailable(f"the fork server exited; its log: {self._log_file}")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise InvalidArgument(f"fork server: {reply['error']}")
        return reply

    def _start(self) -> subprocess.Popen[bytes]:
        """A new server, in place of none or of one that died (its pipes closed)."""
        if self._proc is not None:
            _close_pipes(self._proc)
        with open(self._log_file, "ab") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", __name__],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
                cwd=str(self._cwd),
                env=self._env,
            )
        return self._proc

    def spawn(
        self, args: list[str], log_file: Path, cwd: Path, env: dict[str, str]
    ) -> ForkedProcess:
        """``tectonic ARGS`` as a forked daemon, its stdout and stderr appended to ``log_file``."""
        request = {"op": "spawn", "args": args, "log": str(log_file), "cwd": str(cwd), "env": env}
        reply = self._call(request)
        return ForkedProcess(self, int(reply["pid"]), int(reply["server"]))

    def returncode(self, pid: int, server: int) -> int | None:
        """``pid``'s exit status, None while it runs; ``Unavailable`` once ``server`` (the
        server that forked it) is gone."""
        reply = self._call({"op": "poll", "pid": pid}, server)
        return reply["returncode"]  # type: ignore[no-any-return]

    def close(self) -> None:
        """End the server (its daemons run on, as subprocesses would: stop them first)."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc is not None:
            _close_pipes(proc)


def _close_pipes(proc: subprocess.Popen[bytes]) -> None:
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None and not pipe.closed:
            try:
                pipe.close()
            except OSError:  # a write buffered for a server that is gone
                pass


class ForkedProcess:
    """A daemon the fork server started: what a supervisor asks of ``subprocess.Popen``."""

    POLL_S = 0.02

    def __init__(self, server: ForkServer, pid: int, server_pid: int) -> None:
        self._server = server
        self._server_pid = server_pid
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = self._server.returncode(self.pid, self._server_pid)
            except Unavailable:
                # Its server (its parent) was closed or killed: it is running while its
                # PID is (init reaps it); the exit status went with the server.
                try:
                    os.kill(self.pid, 0)
                except ProcessLookupError:
                    self.returncode = -1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(self.POLL_S)
        assert self.returncode is not None
        return self.returncode


def tectonic_argv(args: list[str]) -> list[str]:
    """The command line of ``tectonic ARGS`` run as a subprocess, and the title a forked
    daemon shows in its place."""
    return [sys.executable, "-m", CLI, *args]


def command_line(proc: psutil.Process) -> list[str]:
    """``proc``'s arguments, as psutil gives them, also for a daemon forked here: its title,
    written by setproctitle as one string and padded with NULs, reads as one argument."""
    args = [a for a in proc.cmdline() if a]
    return args[0].split(" ") if len(args) == 1 else args


def _status(wait_status: int) -> int:
    """As ``subprocess`` reports it: the exit code, or minus the signal that ended it."""
    return os.waitstatus_to_exitcode(wait_status)


def _run_daemon(args: list[str], log: str, cwd: str, env: dict[str, str]) -> None:
    """In the forked child: become the daemon ``tectonic ARGS``; never returns."""
    code = 1
    try:
        os.setsid()
        os.chdir(cwd)
        out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.close(null)
        # ps and psutil see the command line a subprocess would have had: `tectonic cluster
        # down` finds a cluster's daemons by the paths in theirs.
        setproctitle.setproctitle(" ".join(tectonic_argv(args)))
        os.environ.clear()
        os.environ.update(env)
        main = importlib.import_module(CLI).main
        sys.argv = ["tectonic", *args]
        code = main(args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except Exception:  # noqa: BLE001 (a daemon that crashed says why in its log)
        traceback.print_exc()
    finally:  # whatever happened, the child never returns into the server's loop
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def serve(requests: IO[bytes], replies: IO[bytes]) -> None:
    """The server's loop: one request per line until its stdin closes."""
    for name in PRELOAD:
        importlib.import_module(name)
    # setproctitle takes over the memory of argv and the environment on its first call;
    # made here, before any child changes its environment.
    setproctitle.setproctitle(setproctitle.getproctitle())
    ended: dict[int, int] = {}
    children: set[int] = set()
    for line in requests:
        while children:  # reap what ended since the last request
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            ended[pid] = _status(status)
        try:
            request = json.loads(line)
            if request["op"] == "spawn":
                spec = (
                    [str(a) for a in request["args"]],
                    str(request["log"]),
                    str(request["cwd"]),
                    {str(k): str(v) for k, v in request["env"].items()},
                )
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _run_daemon(*spec)
                children.add(pid)
                reply: dict[str, Any] = {"pid": pid, "server": os.getpid()}
            elif request["op"] == "poll":
                pid = int(request["pid"])
                reply = {"returncode": ended.get(pid)}
                if pid not in ended and pid not in children:
                    reply = {"error": f"pid {pid} is not a daemon of this fork server"}
            else:
                reply = {"error": f"unknown op {request['op']!r}"}
        except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
            reply = {"error": f"bad request: {e}"}
        replies.write(json.dumps(reply).encode() + b"\n")
        replies.flush()


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer)
