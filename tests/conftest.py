"""Shared fixtures: a cluster secret and a capability key on disk, and helpers every test
module may use."""

from __future__ import annotations

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
