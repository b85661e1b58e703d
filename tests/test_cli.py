"""The ``tectonic`` CLI's promise for user mistakes: one clear line on stderr, a non-zero exit,
no traceback, and nothing stopped or changed that the user did not ask for.

These run the real entry point (``python -m tectonic_py.cli.main``) in a subprocess, as a user
would, without a cluster; tests/test_cli_cluster.py covers the commands against one.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tectonic_py.cli.common import DefaultsHelpFormatter
from tectonic_py.cli.main import COMMANDS, build_parser
from tectonic_py.cli.status import layout_warnings
from tectonic_py.core.cluster_file import ClusterConfig, MetadataServer
from tectonic_py.core.records import NodeInfo
from tectonic_py.core.units import parse_size, size_arg


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tectonic_py.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert proc.returncode != 0, proc
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_cluster_file(tmp_path: Path, secret_file: Path, address: str) -> Path:
    path = tmp_path / "cluster.toml"
    ClusterConfig(
        name="t", secret_file=secret_file, shards=4,
        metadata_servers=[MetadataServer(address, [0, 1, 2, 3])],
    ).write(path)  # fmt: skip
    return path


def test_status_missing_cluster_file(tmp_path: Path) -> None:
    proc = run_cli("status", str(tmp_path / "nope.toml"))
    assert_one_line_error(proc, "nope.toml", "not found")


def test_status_cluster_file_not_toml(tmp_path: Path) -> None:
    bad = tmp_path / "cluster.toml"
    bad.write_text("this is [not toml\n")
    assert_one_line_error(run_cli("status", str(bad)), "not valid TOML")


@pytest.mark.parametrize(
    "argv",
    [
        ["status", "{cf}"],
        ["ls", "{cf}", "/"],
        ["put", "{cf}", "{cf}", "/x"],
        ["get", "{cf}", "/x", "{tmp}/x"],
        ["mount", "{cf}", "{tmp}"],
        ["repair", "{cf}", "--status"],
    ],
)
def test_cluster_file_not_utf8_is_one_line(tmp_path: Path, argv: list[str]) -> None:
    bad = tmp_path / "cluster.toml"
    bad.write_bytes(b'name = "\xff\xfe"\nshards = 4\n')
    args = [a.format(cf=bad, tmp=tmp_path) for a in argv]
    assert_one_line_error(run_cli(*args), "not UTF-8")


def test_status_cluster_file_missing_field(tmp_path: Path) -> None:
    bad = tmp_path / "cluster.toml"
    bad.write_text('name = "x"\n')
    assert_one_line_error(run_cli("status", str(bad)), "missing or has a bad field")


def test_status_unreadable_secret(tmp_path: Path) -> None:
    path = write_cluster_file(tmp_path, tmp_path / "no-secret", f"127.0.0.1:{closed_port()}")
    assert_one_line_error(run_cli("status", str(path)), "secret")


def test_status_unreachable_servers(tmp_path: Path, secret_file: Path) -> None:
    path = write_cluster_file(tmp_path, secret_file, f"127.0.0.1:{closed_port()}")
    line = assert_one_line_error(run_cli("status", str(path)), "cannot reach")
    assert "registry" in line


def test_status_json_unreachable_is_still_an_error(tmp_path: Path, secret_file: Path) -> None:
    """--json must not print a half-empty object that a script would take as healthy."""
    path = write_cluster_file(tmp_path, secret_file, f"127.0.0.1:{closed_port()}")
    proc = run_cli("status", "--json", str(path))
    assert_one_line_error(proc, "cannot reach")
    assert proc.stdout == ""


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--ec", "rs-6"], "unknown EC policy"),
        (["--ec", "rs-40-3"], "1<=k<=32"),
        (["--ec", "rs-6-3", "--chunkstores", "8"], "--chunkstores >= 9"),
        (["--ec", "r3", "--chunkstores", "0"], "--chunkstores >= 3"),
        (["--metadata-servers", "0"], "at least one"),
        (["--shards", "0"], "at least one"),
        (["--shards", "2", "--metadata-servers", "3"], "only 2 shards"),
        (["--failure-domains", "11"], "failure_domains must be 1..10"),
    ],
)
def test_cluster_up_bad_layout(tmp_path: Path, args: list[str], needle: str) -> None:
    root = tmp_path / "c"
    assert_one_line_error(run_cli("cluster", "up", "--dir", str(root), *args), needle)
    assert not root.exists(), "a refused layout must not create anything"


def test_cluster_up_dir_not_creatable(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = run_cli("cluster", "up", "--dir", str(blocker / "sub"))
    assert_one_line_error(proc, "cannot create")


def test_cluster_down_nothing_running(tmp_path: Path) -> None:
    proc = run_cli("cluster", "down", "--dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "no cluster is running" in proc.stdout


def test_cluster_down_malformed_pid_file(tmp_path: Path) -> None:
    (tmp_path / "cluster.pid").write_text("{not json")
    assert_one_line_error(run_cli("cluster", "down", "--dir", str(tmp_path)), "unreadable")


def _sleeper(*argv: str) -> subprocess.Popen[bytes]:
    """A stand-in supervisor: a process whose command line may name a cluster directory."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", *argv])


def test_cluster_up_refuses_a_running_cluster_and_down_stops_it(tmp_path: Path) -> None:
    root = tmp_path / "c"
    root.mkdir()
    supervisor = _sleeper("--dir", str(root))
    try:
        (root / "cluster.pid").write_text(json.dumps({"pid": supervisor.pid, "daemons": []}))
        line = assert_one_line_error(run_cli("cluster", "up", "--dir", str(root)), "already")
        assert str(supervisor.pid) in line and "cluster down" in line
        assert supervisor.poll() is None, "a refused `up` must not touch the running cluster"

        proc = run_cli("cluster", "down", "--dir", str(root))
        assert proc.returncode == 0, proc.stderr
        assert supervisor.wait(timeout=30) is not None
        assert not (root / "cluster.pid").exists()
    finally:
        supervisor.kill()
        supervisor.wait()


def test_cluster_down_never_signals_a_reused_pid(tmp_path: Path) -> None:
    """After a crash the pid file may name a PID that now belongs to someone else."""
    stranger = _sleeper()  # its command line does not name the cluster directory
    sibling = _sleeper("--dir", f"{tmp_path}2")  # another cluster's, whose path shares a prefix
    daemon = _sleeper("--data-dir", str(tmp_path / "cs0"))  # a leftover daemon: ours
    try:
        (tmp_path / "cluster.pid").write_text(
            json.dumps({"pid": stranger.pid, "daemons": [sibling.pid, daemon.pid]})
        )
        proc = run_cli("cluster", "down", "--dir", str(tmp_path))
        assert proc.returncode == 0, proc.stderr
        assert daemon.wait(timeout=30) is not None, "a leftover daemon must be stopped"
        assert stranger.poll() is None, "a process that is not ours must never be signalled"
        assert sibling.poll() is None, "nor one of a cluster in /x/c2 when stopping /x/c"
        assert not (tmp_path / "cluster.pid").exists()
    finally:
        for p in (stranger, sibling, daemon):
            p.kill()
            p.wait()


# ls waits out the default --connect-wait (5 s), so that the default is what a user meets;
# the others say the same after 1 s of it, which is all their error's shape needs.
@pytest.mark.parametrize(
    "argv",
    [
        ["ls", "{cluster}", "/"],
        ["put", "{cluster}", "{local}", "/x", "--connect-wait", "1"],
        ["get", "{cluster}", "/x", "{local}.back", "--connect-wait", "1"],
        ["mount", "{cluster}", "{mnt}", "--connect-wait", "1"],
    ],
)
def test_data_and_mount_commands_unreachable_servers(
    tmp_path: Path, secret_file: Path, argv: list[str]
) -> None:
    cluster = write_cluster_file(tmp_path, secret_file, f"127.0.0.1:{closed_port()}")
    local = tmp_path / "local.bin"
    local.write_bytes(b"x" * 1000)
    (tmp_path / "mnt").mkdir()
    args = [a.format(cluster=cluster, local=local, mnt=tmp_path / "mnt") for a in argv]
    assert_one_line_error(run_cli(*args), "unavailable")
    assert not os.path.ismount(tmp_path / "mnt")


def test_mount_bad_mount_points(tmp_path: Path, secret_file: Path) -> None:
    cluster = write_cluster_file(tmp_path, secret_file, f"127.0.0.1:{closed_port()}")
    assert_one_line_error(run_cli("mount", str(tmp_path / "none.toml"), "/tmp"), "not found")
    missing = tmp_path / "no-such-dir"
    assert_one_line_error(run_cli("mount", str(cluster), str(missing)), "not a directory")
    # /proc is a mount point on every Linux machine: "busy"
    assert_one_line_error(run_cli("mount", str(cluster), "/proc"), "already a mount point")


def test_mount_refuses_a_non_empty_directory(tmp_path: Path, secret_file: Path) -> None:
    cluster = write_cluster_file(tmp_path, secret_file, f"127.0.0.1:{closed_port()}")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    (mnt / "data").write_text("hidden by a mount")
    assert_one_line_error(run_cli("mount", str(cluster), str(mnt)), "not empty", "--nonempty")
    # --nonempty passes the check: what fails now is the unreachable cluster.
    assert_one_line_error(
        run_cli("mount", str(cluster), str(mnt), "--nonempty", "--connect-wait", "1"),
        "unavailable",
    )
    assert not os.path.ismount(mnt) and (mnt / "data").read_text() == "hidden by a mount"


def test_mount_without_dev_fuse(tmp_path: Path, secret_file: Path) -> None:
    """In a private mount namespace whose /dev holds only /dev/null: no FUSE device."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to hide /dev/fuse in a mount namespace")
    cluster = write_cluster_file(tmp_path, secret_file, f"127.0.0.1:{closed_port()}")
    (tmp_path / "mnt").mkdir()
    script = (
        "mount -t tmpfs tmpfs /dev && mknod -m 666 /dev/null c 1 3 && "
        f'exec "$0" -m tectonic_py.cli.main mount {cluster} {tmp_path / "mnt"}'
    )
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, sys.executable],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    if "unshare failed" in proc.stderr or "Operation not permitted" in proc.stderr:
        pytest.skip(f"mount namespaces are not permitted here: {proc.stderr.strip()}")
    assert_one_line_error(proc, "/dev/fuse is missing", "modprobe fuse")


@pytest.mark.parametrize("command", ["mkdir", "put"])
def test_bad_ec_policy_is_refused_before_anything_is_touched(
    tmp_path: Path, secret_file: Path, command: str
) -> None:
    # The servers are unreachable: if the policy were checked after connecting, the error
    # would say "unavailable"; it must name the policy instead.
    cluster = write_cluster_file(tmp_path, secret_file, f"127.0.0.1:{closed_port()}")
    local = tmp_path / "local.bin"
    local.write_bytes(b"x")
    argv = (
        ["mkdir", str(cluster), "/d"]
        if command == "mkdir"
        else ["put", str(cluster), str(local), "/f"]
    )
    assert_one_line_error(run_cli(*argv, "--ec", "bogus"), "unknown EC policy")


def test_closed_stdout_pipe_is_not_a_traceback(tmp_path: Path) -> None:
    """`tectonic status --json | head` closes the pipe early: exit quietly, as cat and ls do."""
    script = tmp_path / "noisy.py"
    script.write_text(
        "import argparse, sys\n"
        "import tectonic_py.cli.main as c\n"
        "def noisy(args):\n"
        "    for _ in range(100000):\n"
        "        print('x' * 100)\n"
        "orig = c.build_parser\n"
        "def build(*modules):\n"
        "    p = orig(*modules)\n"
        "    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))\n"
        "    sub.add_parser('noisy').set_defaults(func=noisy)\n"
        "    return p\n"
        "c.build_parser = build\n"
        "sys.exit(c.main(['noisy']))\n"
    )
    proc = subprocess.run(
        f"{sys.executable} {script} | head -1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.stdout == "x" * 100 + "\n"
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


def _subparsers(parser: argparse.ArgumentParser, prefix: str = "tectonic"):  # type: ignore[no-untyped-def]
    """(name, parser) of every subcommand, nested ones too (``cluster up``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prefix} {name}", sub
                yield from _subparsers(sub, f"{prefix} {name}")


def test_each_command_module_registers_the_commands_main_names_for_it() -> None:
    """main imports only the module of the command asked for (COMMANDS), so each module must
    register exactly the commands named for it there, and together they make the whole CLI."""
    for module in set(COMMANDS.values()):
        parser = build_parser([importlib.import_module(module)])
        names = {name.split()[1] for name, _ in _subparsers(parser) if name.count(" ") == 1}
        assert names == {c for c, m in COMMANDS.items() if m == module}, module
    whole = {name.split()[1] for name, _ in _subparsers(build_parser()) if name.count(" ") == 1}
    assert whole == set(COMMANDS)


def test_a_command_imports_only_its_own_module() -> None:
    """A chunk store (a dozen processes per local cluster) pays for no other command's
    libraries: not the client's, the mount's nor httpx."""
    probe = (
        "import sys\n"
        "from tectonic_py.cli.main import main\n"
        "try:\n"
        "    main(['chunkstore', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(' '.join(sorted(sys.modules)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    modules = set(proc.stdout.split("\n")[-2].split())
    assert "chunkstore.main" in modules
    for other in ("metadata.main", "tectonic_py.cli.data", "tectonic_py.cli.mount", "httpx"):
        assert other not in modules, other


def test_every_subcommand_spells_the_cluster_file_alike_and_shows_defaults() -> None:
    found = 0
    for name, parser in _subparsers(build_parser()):
        assert parser.formatter_class is DefaultsHelpFormatter, name
        for action in parser._actions:
            assert action.dest != "cluster" and "--cluster-file" not in action.option_strings
            if action.dest == "cluster_file":
                found += 1
                assert action.metavar == "CLUSTER_FILE" and not action.option_strings, name
        formatter = parser._get_formatter()
        parser.format_help()  # every help string formats, "%(default)s" included
        for action in parser._actions:
            shown = action.default not in (None, False, [], argparse.SUPPRESS)
            if shown and action.option_strings and action.help != argparse.SUPPRESS:
                help_text = formatter._get_help_string(action)  # type: ignore[attr-defined]
                assert "default" in help_text, (name, action.option_strings)
    # put get ls rm stat mkdir status stats mount loadtest maintenance repair fsck commit call ...
    # quota set/get/ls/rm, reserve, retention set/get/ls/rm
    assert found == 22


SIZE_FLAGS = {
    ("chunkstore", "--capacity"), ("chunkstore", "--payload-budget"),
    ("chunkstore", "--reply-budget"), ("chunkstore", "--scrub-rate"),
    ("chunkstore", "--max-write-rate"), ("chunkstore", "--max-read-rate"),
    ("maintenance", "--bandwidth"),
    ("loadtest", "--shard-size"), ("loadtest", "--min-size"), ("loadtest", "--max-size"),
    ("set", "--bytes"),
}  # fmt: skip


def test_every_size_takes_units() -> None:
    seen = set()
    for name, parser in _subparsers(build_parser()):
        for action in parser._actions:
            key = (name.split()[-1], action.option_strings[-1] if action.option_strings else "")
            if key in SIZE_FLAGS:
                seen.add(key)
                assert action.type is size_arg, key
    assert seen == SIZE_FLAGS
    assert parse_size("4MiB") == 4 << 20 and parse_size("1GiB") == 1 << 30
    assert parse_size("512k") == 512 << 10 and parse_size("4096") == 4096
    args = build_parser().parse_args(["chunkstore", *_CHUNKSTORE_REQUIRED, "--capacity", "2GiB"])
    assert args.capacity == 2 << 30 and args.payload_budget == 256 << 20  # string defaults too
    bad = run_cli("chunkstore", *_CHUNKSTORE_REQUIRED, "--capacity", "2 parsecs")
    assert bad.returncode == 2 and "bad size '2 parsecs'" in bad.stderr


_CHUNKSTORE_REQUIRED = [
    "--data-dir", "d", "--listen", "127.0.0.1:0", "--node-id", "n", "--failure-domain", "f",
    "--secret-file", "s",
]  # fmt: skip


def test_version() -> None:
    proc = run_cli("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"tectonic {importlib.metadata.version('tectonic-py')}"


def _nodes(domains: list[str], down: int = 0) -> list[NodeInfo]:
    return [
        NodeInfo(f"cs{i}", "", d, state="down" if i < down else "up") for i, d in enumerate(domains)
    ]


def test_status_warns_when_repair_has_no_spare_failure_domain() -> None:
    ten = [f"fd{i}" for i in range(10)]
    assert layout_warnings(_nodes(ten), {"rs-6-3"}) == []
    (one,) = layout_warnings(_nodes(ten[:9]), {"rs-6-3"})
    assert "no more than the 9 chunks of a rs-6-3 block" in one
    assert "add chunk stores in 1 more failure domain" in one
    (down,) = layout_warnings(_nodes(ten, down=2), {"rs-6-3", "r3"})
    assert "only 8 failure domains" in down and "2 more failure domains" in down
    # ten stores in three domains: as bad as three stores
    (few,) = layout_warnings(_nodes([f"fd{i % 3}" for i in range(10)]), {"rs-4-2"})
    assert "only 3 failure domains" in few
    assert layout_warnings(_nodes(ten[:4]), {"r3"}) == []


@pytest.mark.parametrize("daemon", ["metadata", "chunkstore"])
def test_daemons_log_start_ready_and_stop_without_v(
    tmp_path: Path, secret_file: Path, capability_key_file: Path, daemon: str
) -> None:
    """A service log shows the lifecycle at INFO with no -v; nothing else is needed to see
    where a daemon listens and keeps its data."""
    ready = tmp_path / "ready.json"
    data = tmp_path / "data"
    common = [
        "--data-dir",
        str(data),
        "--secret-file",
        str(secret_file),
        "--capability-key-file",
        str(capability_key_file),
        "--ready-file",
        str(ready),
    ]
    extra = (
        ["--shards", "0-3", "--total-shards", "4"]
        if daemon == "metadata"
        else ["--listen", "127.0.0.1:0", "--node-id", "cs0", "--failure-domain", "fd0"]
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "tectonic_py.cli.main", daemon, *common, *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        for _ in range(600):
            if ready.exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert ready.exists(), proc.stderr.read() if proc.stderr else ""
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    info = [ln for ln in err.splitlines() if " INFO " in ln]
    what = "metadata server" if daemon == "metadata" else "chunk store cs0"
    assert any(f"{what} starting" in ln and str(data) in ln for ln in info), err
    assert any(("ready on" in ln or "serving" in ln) and "127.0.0.1:" in ln for ln in info), err
    assert any(f"{what} stopped" in ln for ln in info), err


def test_cluster_up_default_leaves_a_spare_failure_domain(tmp_path: Path) -> None:
    from tectonic_py.cli import cluster

    args = build_parser().parse_args(["cluster", "up", "--dir", str(tmp_path)])
    cluster._apply_existing(args, tmp_path)
    assert (args.chunkstores, args.ec, args.failure_domains) == (10, "rs-6-3", None)
    assert "warning" not in cluster._summary(tmp_path / "cluster.toml", args, detached=True)
    args.chunkstores = 9
    summary = cluster._summary(tmp_path / "cluster.toml", args, detached=True)
    assert "9 failure domains for 9 chunks per block: no spare for repair" in summary
