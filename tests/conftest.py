"""Shared fixtures: a cluster secret and a capability key on disk, and helpers every test
module may use."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest

pytest_plugins = ["cluster_fixtures", "fuse_fixtures", "etcd_fixtures"]


@pytest.fixture
def secret() -> bytes:
    return secrets.token_hex(32).encode()


@pytest.fixture
def secret_file(tmp_path: Path, secret: bytes) -> Path:
    path = tmp_path / "secret"
    path.write_bytes(secret)
    path.chmod(0o600)
    return path


@pytest.fixture
def capability_key_file(tmp_path: Path) -> Path:
    """What a daemon signs or checks capabilities with: apart from the secret, as in a cluster."""
    path = tmp_path / "capability_key"
    path.write_bytes(secrets.token_hex(32).encode())
    path.chmod(0o600)
    return path


# --- heaviest files first ------------------------------------------------------------------------
#
# deploy/test.sh runs the suite as two xdist workers that take a whole file at a time, in the
# order collected (--no-loadscope-reorder: xdist would otherwise order files by test count,
# which put one-test files of two or three minutes, test_chaos and the README's quickstart,
# last, where the other worker had long run out of work). Files go longest first, by the
# seconds each took in the last run here (pytest's cache) or, on a fresh checkout, by the
# figures in file_seconds.json; a file neither knows goes first, as it may be long.

_FILE_SECONDS = Path(__file__).with_name("file_seconds.json")
_CACHE_KEY = "tectonic/file_seconds"
_spent: dict[str, float] = {}  # this run's seconds per file (setup, call and teardown)


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seconds: dict[str, float] = json.loads(_FILE_SECONDS.read_text())
    cache = getattr(config, "cache", None)  # None under -p no:cacheprovider
    if cache is not None:
        seconds.update(cache.get(_CACHE_KEY, {}))
    items.sort(key=lambda item: -seconds.get(_file_of(item.nodeid), float("inf")))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    file = _file_of(report.nodeid)
    _spent[file] = _spent.get(file, 0.0) + report.duration


def _whole_suite(config: pytest.Config) -> bool:
    """A run of every test: a part of a file (-k, -m, a test id, -x) would record the part's
    seconds as the file's."""
    return (
        config.args_source == pytest.Config.ArgsSource.TESTPATHS
        and not config.option.keyword
        and not config.option.markexpr
        and not config.option.maxfail
    )


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The controller (or a run without workers) keeps what each file took in a run of the
    whole suite, for the next run's order."""
    cache = getattr(session.config, "cache", None)
    if hasattr(session.config, "workerinput") or cache is None or not _spent:
        return
    if not _whole_suite(session.config):
        return
    seconds = dict(cache.get(_CACHE_KEY, {}))
    seconds.update({file: round(spent, 1) for file, spent in _spent.items()})
    cache.set(_CACHE_KEY, seconds)
