"""Shared fixtures: a cluster secret on disk and helpers every test module may use."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

pytest_plugins = ["cluster_fixtures", "fuse_fixtures"]


@pytest.fixture
def secret() -> bytes:
    return secrets.token_hex(32).encode()


@pytest.fixture
def secret_file(tmp_path: Path, secret: bytes) -> Path:
    path = tmp_path / "secret"
    path.write_bytes(secret)
    path.chmod(0o600)
    return path
