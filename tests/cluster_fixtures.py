"""Fixtures for tests that need a running cluster (registered in conftest.py).

``local_cluster``: a real cluster (2 metadata servers, 9 chunk stores, 16 shards) as
subprocesses under ``tmp_path``, with a small chunk size (64 KiB) so multi-block files stay
small and fast; always stopped (SIGTERM, then SIGKILL) at the end.
``client``: an open ``TectonicClient`` on it, as role client (``client.toml``, a GPU node's).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tectonic_py.client.tectonic_client import TectonicClient, open_client
from tectonic_py.launch.local_cluster import LocalCluster

TEST_CHUNK_SIZE = 64 * 1024


def suite_cluster(root: Path, *, chunk_size: int = TEST_CHUNK_SIZE, **options: Any) -> LocalCluster:
    """The cluster shape the suite's fixtures share (2 metadata servers, 9 chunk stores, 16
    shards, 0.5 s heartbeats), so ``local_cluster``, ``fuse_cluster`` and test_fs_ops'
    shared cluster differ only where they say so (chunk size, node timeout)."""
    return LocalCluster(
        root,
        chunkstores=9,
        metadata_servers=2,
        shards=16,
        chunk_size=chunk_size,
        heartbeat_interval=0.5,
        **options,
    )


@pytest.fixture
def local_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with suite_cluster(tmp_path / "cluster", node_timeout=5.0) as cluster:
        yield cluster


@pytest.fixture
async def client(local_cluster: LocalCluster) -> AsyncIterator[TectonicClient]:
    async with open_client(local_cluster.client_file, slow_chunk_s=5.0, chunk_timeout=10.0) as c:
        yield c
