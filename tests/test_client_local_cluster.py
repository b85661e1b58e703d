"""The local cluster launcher: restart on the same root keeps data and ports, a non-default EC
policy reaches the root directory, daemons are ours and gone after stop, bad settings fail."""

from __future__ import annotations

import psutil
import pytest

from tectonic_py.client import open_client
from tectonic_py.errors import ConfigError
from tectonic_py.local_cluster import LocalCluster


async def test_restart_brings_back_data_on_the_same_ports(tmp_path):
    cluster = LocalCluster(
        tmp_path / "c",
        chunkstores=6,
        metadata_servers=2,
        shards=8,
        ec="rs-4-2",
        chunk_size=64 * 1024,
        heartbeat_interval=0.3,
    )
    try:
        cluster.start()
        servers = [s.address for s in cluster.config.metadata_servers]
        async with open_client(cluster.cluster_file) as client:
            w = await client.create("/keep")
            await w.write(b"survives a restart" * 10_000)
            attrs = await w.close()
            assert attrs.ec == "rs-4-2"  # inherited from the root directory
        pids = cluster.pids()
        assert len(pids) == 8
        cluster.stop()
        assert not cluster.pids()
        assert not any(
            psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids
        )
        cluster.start()
        assert [s.address for s in cluster.config.metadata_servers] == servers
        cluster.kill_metadata(1)
        cluster.start_metadata(1)
        async with open_client(cluster.cluster_file) as client:
            r = await client.open_read("/keep")
            assert await r.read() == b"survives a restart" * 10_000
    finally:
        cluster.stop()


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ConfigError):
        LocalCluster(tmp_path, chunkstores=0)
    with pytest.raises(ConfigError):
        LocalCluster(tmp_path, metadata_servers=5, shards=4)
    with pytest.raises(ConfigError):
        LocalCluster(tmp_path, chunkstores=3, failure_domains=4)
