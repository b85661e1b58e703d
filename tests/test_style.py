"""The project's own static checks, run with the suite so that CI keeps them: ruff's lint and
format (their rules are pyproject.toml's, their versions pinned in its ``lint`` extra) and mypy
on the packages (tests and bench scripts are not typed)."""

from __future__ import annotations

from pathlib import Path

from test_bench_smoke import _run  # (python -m, in the repository, output captured)


def test_ruff_finds_nothing() -> None:
    r = _run("ruff", "check", "--no-cache", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_code_is_as_ruff_formats_it() -> None:
    r = _run("ruff", "format", "--check", "--no-cache", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_finds_nothing(tmp_path: Path) -> None:
    r = _run("mypy", "--cache-dir", str(tmp_path), "tectonic_py", "chunkstore", "metadata")
    assert r.returncode == 0, r.stdout + r.stderr
