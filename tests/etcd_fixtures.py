"""Fixtures for the etcd metadata engine (registered in conftest.py).

``etcd_cluster``: one real 3-member etcd cluster on loopback for the whole test session
(started on first use, stopped at the end); every test gets a key prefix of its own, so
tests never see each other's shards. ``etcd_settings``: such a prefix, as the servers take
it. ``meta_engine``: a test that takes it runs once per metadata engine (None for sqlite,
the settings for etcd). Tests that need etcd are skipped where the etcd server is not
installed.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator

import pytest

from metadata.etcd_shards import EtcdSettings
from tectonic_py.launch.local_etcd import EtcdCluster

HAVE_ETCD = shutil.which("etcd") is not None
needs_etcd = pytest.mark.skipif(not HAVE_ETCD, reason="etcd-server is not installed")


@pytest.fixture(scope="session")
def etcd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    if not HAVE_ETCD:
        pytest.skip("etcd-server is not installed")
    with EtcdCluster(tmp_path_factory.mktemp("etcd"), members=3) as cluster:
        yield cluster


@pytest.fixture
def etcd_settings(etcd_cluster: EtcdCluster) -> EtcdSettings:
    return EtcdSettings(etcd_cluster.endpoints, prefix=f"/test/{uuid.uuid4().hex[:12]}")


@pytest.fixture(params=["sqlite", pytest.param("etcd", marks=needs_etcd)])
def meta_engine(request: pytest.FixtureRequest) -> EtcdSettings | None:
    if request.param == "sqlite":
        return None
    settings: EtcdSettings = request.getfixturevalue("etcd_settings")
    return settings
