"""What an adversary on the network or on the host must not be able to do.

A secret file others can read is refused; a peer that has not authenticated holds next to no
memory; a relay that passed the handshake through cannot inject, replay or reorder frames;
a chunk is deleted only with a capability the metadata service issued for that delete.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tectonic_py.core import auth
from tectonic_py.core.cluster_file import ClusterConfig, MetadataServer
from tectonic_py.core.errors import ConfigError

# --- the secret file ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o644, 0o666, 0o640, 0o604])
def test_a_secret_file_others_can_read_is_refused(secret_file: Path, mode: int) -> None:
    secret_file.chmod(mode)
    with pytest.raises(ConfigError, match="chmod 600"):
        auth.load_secret(secret_file)


def test_a_secret_file_of_mode_600_or_400_is_accepted(secret_file: Path, secret: bytes) -> None:
    assert auth.load_secret(secret_file) == secret
    secret_file.chmod(0o400)
    assert auth.load_secret(secret_file) == secret


def test_the_cli_refuses_a_readable_secret_with_one_line(tmp_path: Path, secret_file: Path) -> None:
    secret_file.chmod(0o644)
    cluster = tmp_path / "cluster.toml"
    ClusterConfig(
        name="t", secret_file=secret_file, shards=1,
        metadata_servers=[MetadataServer("127.0.0.1:1", [0])],
    ).write(cluster)  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "tectonic_py.cli.main", "status", str(cluster)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert "chmod 600" in lines[0] and "Traceback" not in proc.stderr
