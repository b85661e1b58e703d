"""Fixtures for tests that need a running cluster (registered in conftest.py).

``local_cluster``: a real cluster (2 metadata servers, 9 chunk stores, 16 shards) as
subprocesses under ``tmp_path``, with a small chunk size (64 KiB) so multi-block files stay
small and fast; always stopped (SIGTERM, then SIGKILL) at the end.
``client``: an open ``TectonicClient`` on it, as role client (``client.toml``, a GPU node's).
``shared_cluster``: the same cluster started once per module, its namespace emptied after
each test; a module whose tests neither kill, stop nor reconfigure a daemon overrides
``local_cluster`` with ``shared_local_cluster``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from tectonic_py.client.tectonic_client import TectonicClient, open_client
from tectonic_py.core.errors import FileNotFound
from tectonic_py.core.records import KIND_DIR
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


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One ``local_cluster`` for a module: 11 daemons started per test were 4 s of a test's
    wall time and 5 s of CPU, for tests that only need an empty namespace."""
    with suite_cluster(tmp_path_factory.mktemp("shared") / "cluster", node_timeout=5.0) as c:
        yield c


async def _remove_tree(client: TectonicClient, path: str) -> None:
    for entry in await client.listdir(path):
        child = f"{path.rstrip('/')}/{entry.name}"
        try:
            if entry.kind == KIND_DIR:
                await _remove_tree(client, child)
                await client.rmdir(child)
            else:
                await client.unlink(child)
        except FileNotFound:
            pass


async def _empty_namespace(cluster_file: Path) -> None:
    async with open_client(cluster_file) as c:
        await _remove_tree(c, "/")


@pytest.fixture
def shared_local_cluster(shared_cluster: LocalCluster) -> Iterator[LocalCluster]:
    """``shared_cluster`` as a test gets it: with the namespace it left removed afterwards
    (as admin), so the next test finds ``/`` empty as on a fresh cluster."""
    yield shared_cluster
    trio.run(_empty_namespace, shared_cluster.cluster_file)


@pytest.fixture
async def client(local_cluster: LocalCluster) -> AsyncIterator[TectonicClient]:
    async with open_client(local_cluster.client_file, slow_chunk_s=5.0, chunk_timeout=10.0) as c:
        yield c
