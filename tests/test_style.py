"""The project's own static checks, run with the suite so that CI keeps them: ruff's lint and
format (their rules are pyproject.toml's, their versions pinned in its ``lint`` extra) and mypy
on the packages (tests and bench scripts are not typed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from test_bench_smoke import _run  # (python -m, in the repository, output captured)


def test_ruff_finds_nothing() -> None:
    r = _run("ruff", "check", "--no-cache", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_code_is_as_ruff_formats_it() -> None:
    r = _run("ruff", "format", "--check", "--no-cache", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_finds_nothing() -> None:
    """mypy keeps its incremental cache outside the checkout (each module is checked against
    its source's hash, so a cache from another checkout is only a head start): a warm run
    takes seconds, a cold one a minute or two of the suite's budget."""
    cache = Path.home() / ".cache" / "tectonic-py" / "mypy"
    r = _run("mypy", "--cache-dir", str(cache), "tectonic_py", "chunkstore", "metadata")
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_layers_hold() -> None:
    """The import contracts of pyproject.toml ([tool.importlinter]): arrows point down only,
    and above the servers only their one typed client is imported."""
    lint_imports = Path(sys.executable).parent / "lint-imports"
    r = subprocess.run(
        [str(lint_imports), "--no-cache"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
