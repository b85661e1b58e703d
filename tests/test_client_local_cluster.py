"""The local cluster launcher: restart on the same root keeps data and ports, a non-default EC
policy reaches the root directory, daemons are ours and gone after stop, bad settings fail."""

from __future__ import annotations

import json

import psutil
import pytest

from tectonic_py.client.tectonic_client import open_client
from tectonic_py.core.errors import ConfigError
from tectonic_py.launch.fork_server import command_line
from tectonic_py.launch.local_cluster import LocalCluster


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


def _domains(cluster: LocalCluster) -> list[str]:
    """The --failure-domain each running chunk store was started with."""
    out = []
    for pid in cluster.chunkstore_pids():
        assert pid is not None
        argv = command_line(psutil.Process(pid))
        out.append(argv[argv.index("--failure-domain") + 1])
    return out


def test_a_restart_keeps_the_failure_domains_it_was_not_told(tmp_path):
    def cluster(**kw):
        return LocalCluster(
            tmp_path / "c", chunkstores=4, metadata_servers=1, shards=4, ec="rs-2-1", **kw
        )

    first = cluster(failure_domains=2)
    try:
        first.start()
        assert _domains(first) == ["fd0", "fd1", "fd0", "fd1"]
    finally:
        first.stop()
    again = cluster()
    try:
        again.start()
        assert _domains(again) == ["fd0", "fd1", "fd0", "fd1"]
    finally:
        again.stop()
    told = cluster(failure_domains=4)  # what a restart is told wins, and is kept
    try:
        told.start()
        assert _domains(told) == ["fd0", "fd1", "fd2", "fd3"]
    finally:
        told.stop()
    assert json.loads((tmp_path / "c" / "state.json").read_text())["failure_domains"] == 4


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ConfigError):
        LocalCluster(tmp_path, chunkstores=0)
    with pytest.raises(ConfigError):
        LocalCluster(tmp_path, metadata_servers=5, shards=4)
    with pytest.raises(ConfigError):
        LocalCluster(tmp_path, chunkstores=3, failure_domains=4)
