"""The README's promise: its first command, on a fresh checkout, installs everything, starts
a cluster, mounts it and round-trips a real state dict bit for bit; its second is what CI
runs. The checkout here is a copy of the tracked files in a temporary directory, with a
virtualenv made from nothing (pip may reuse its wheel cache; torch comes from the local wheel).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    """The commands of the README's first code block, comments stripped."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"```sh\n(.*?)```", text, re.DOTALL)
    assert block, "README.md has no ```sh block"
    return [
        ln.split("#")[0].strip() for ln in block.group(1).splitlines() if ln.split("#")[0].strip()
    ]


def test_readme_starts_with_the_two_commands_and_ci_runs_the_second() -> None:
    text = (REPO / "README.md").read_text()
    assert text.index("```sh") < text.index("\n## "), "the commands come before any section"
    assert readme_commands() == ["bash deploy/quickstart.sh", "bash deploy/test.sh"]
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^exec bash .*deploy/test\.sh", ci, re.MULTILINE), ci
    assert os.access(REPO / ".ci" / "run", os.X_OK)


@pytest.fixture
def fresh_checkout(tmp_path: Path) -> Iterator[Path]:
    """The working tree as git sees it (tracked and new files, not ignored ones: no .venv,
    no build outputs), copied to a temporary directory."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode()  # fmt: skip
    dest = tmp_path / "tectonic-py"
    for rel in filter(None, listed.split("\0")):
        src = REPO / rel
        if not src.is_file():
            continue  # deleted in the working tree
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)
    yield dest


@pytest.mark.slow
@pytest.mark.fuse
def test_quickstart_from_a_fresh_checkout(fresh_checkout: Path) -> None:
    if not os.path.exists("/dev/fuse"):
        pytest.skip("/dev/fuse is missing")
    if os.geteuid() != 0:
        pytest.skip("the README's commands run as root (apt, FUSE)")
    repo = fresh_checkout
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env.pop("TECTONIC_DEMO_DIR", None)
    env.pop("TECTONIC_MOUNT", None)
    mnt = repo / "demo-cluster" / "mnt"
    try:
        proc = subprocess.run(
            ["bash", "deploy/quickstart.sh"], cwd=repo, env=env, capture_output=True,
            text=True, timeout=600, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "round trip bit-exact" in proc.stdout
        assert f"mount point:   {mnt}" in proc.stdout
        assert "deploy/quickstart.sh stop" in proc.stdout
        # it really is the fresh virtualenv, running the copy
        venv_python = repo / ".venv" / "bin" / "python"
        where = subprocess.run(
            [str(venv_python), "-c", "import tectonic_py, torch; print(tectonic_py.__file__)"],
            cwd="/", env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert where.stdout.strip() == str(repo / "tectonic_py" / "__init__.py")
        assert (mnt / "quickstart" / "transformer.pt").stat().st_size > 80_000_000

        # the second command turns "no tests ran" into a failure
        empty = subprocess.run(
            ["bash", "deploy/test.sh", "-q", "-n", "0", "tests/test_cli.py", "-k", "no_such_test_zzz"],
            cwd=repo, env=env, capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert empty.returncode == 1, empty.stdout + empty.stderr
        assert "collected no tests" in empty.stderr
    finally:
        stop = subprocess.run(
            ["bash", "deploy/quickstart.sh", "stop"], cwd=repo, env=env, capture_output=True,
            text=True, timeout=300, check=False,
        )  # fmt: skip
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
        if (repo / ".venv" / "bin" / "tectonic").exists():
            subprocess.run(
                [str(repo / ".venv" / "bin" / "tectonic"), "cluster", "down", "--dir",
                 str(repo / "demo-cluster")], check=False, capture_output=True, timeout=120,
            )  # fmt: skip
    assert stop.returncode == 0, stop.stderr
    assert not os.path.ismount(mnt)
    assert not (repo / "demo-cluster" / "cluster.pid").exists()


def test_systemd_units_are_valid(tmp_path: Path) -> None:
    """docs/operations.md tells operators to install these units: systemd must accept them.
    The only complaint allowed is the missing /opt/tectonic-py install on this machine."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    units = []
    for unit in sorted((REPO / "deploy" / "systemd").glob("*.service")):
        name = unit.name.replace("@.", "@x0.")  # an instance of each template
        shutil.copy(unit, tmp_path / name)
        units.append(str(tmp_path / name))
    assert len(units) == 5
    proc = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *units],
        capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path,
    )  # fmt: skip
    complaints = [
        ln
        for ln in (proc.stdout + proc.stderr).splitlines()
        if ln.strip() and "/opt/tectonic-py/.venv/bin/tectonic is not executable" not in ln
    ]
    assert complaints == []


def test_readme_documents_the_cli_exit_codes() -> None:
    from tectonic_py.cli.common import EXIT_UNHEALTHY

    text = (REPO / "README.md").read_text()
    cli = text[text.index("## The CLI") : text.index("\n## ", text.index("## The CLI") + 1)]
    assert "2 a usage error (argparse)" in cli
    assert f"{EXIT_UNHEALTHY} the command ran and found the cluster unable to serve" in cli
    assert f"exit code {EXIT_UNHEALTHY} if a metadata server is down" in cli
