"""The etcd client and the loopback etcd cluster under the etcd metadata engine: transactions
with compares, scans, leases, failover past a killed member, and a member whose disk is lost
re-added until the cluster heals. Real etcd processes, started and stopped here."""

from __future__ import annotations

import shutil
import socket

import pytest
import trio

from tectonic_py.core.errors import InvalidArgument, Unavailable
from tectonic_py.core.etcd_client import (
    Compare,
    EtcdClient,
    delete_op,
    prefix_end,
    put_op,
    range_op,
)
from tectonic_py.launch import local_etcd
from tectonic_py.launch.local_etcd import EtcdCluster

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd-server not installed")


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    with EtcdCluster(tmp_path_factory.mktemp("etcd"), members=3) as cluster:
        yield cluster


def test_prefix_end():
    assert prefix_end(b"a/") == b"a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"


async def test_keys_transactions_and_scans(etcd):
    async with EtcdClient(etcd.endpoints) as c:
        rev = await c.put(b"t/k", b"v1")
        kv = await c.get(b"t/k")
        assert kv is not None and kv.value == b"v1" and kv.mod_revision == rev
        # compare on the revision: the stale writer loses, the current one wins
        ok = await c.txn([Compare(b"t/k", "MOD", rev)], [put_op(b"t/k", b"v2")])
        stale = await c.txn(
            [Compare(b"t/k", "MOD", rev)], [put_op(b"t/k", b"v3")], [range_op(b"t/k")]
        )
        assert ok.succeeded and not stale.succeeded
        assert stale.ranges()[0][0].value == b"v2"
        # a key that does not exist has create revision 0
        created = await c.txn(
            [Compare(b"t/new", "CREATE", 0)], [put_op(b"t/new", b"x"), delete_op(b"t/k")]
        )
        assert created.succeeded and await c.get(b"t/k") is None
        for i in range(25):
            await c.put(b"s/%03d" % i, b"%d" % i)
        await c.put(b"s0", b"outside the prefix")
        keys = [kv.key async for kv in c.scan(b"s/", page=7)]
        assert keys == [b"s/%03d" % i for i in range(25)]
        with pytest.raises(InvalidArgument):
            await c.txn([], [put_op(b"", b"empty key")])


async def test_a_lease_takes_its_keys_with_it(etcd):
    async with EtcdClient(etcd.endpoints) as c:
        lease = await c.lease_grant(2)
        await c.put(b"l/owner", b"me", lease=lease)
        assert await c.lease_keepalive(lease) > 0
        await c.lease_revoke(lease)
        assert await c.get(b"l/owner") is None
        assert await c.lease_keepalive(lease) == 0
        await c.lease_revoke(lease)  # a second revoke is not an error


async def test_a_killed_member_is_failed_over_and_a_wiped_one_heals(etcd):
    async with EtcdClient(etcd.endpoints, deadline=20.0) as c:
        await c.put(b"h/before", b"1")
        etcd.kill_member(0)  # the endpoint the client talks to first
        with trio.fail_after(20):
            await c.put(b"h/during", b"2")
            assert (await c.get(b"h/before")).value == b"1"
        etcd.start_member(0)
        await trio.to_thread.run_sync(etcd.replace_member, 1)
        members = await c.members()
        assert len(members) == 3
    # the re-added member serves what was written before it lost its disk
    async with EtcdClient([etcd.client_url(1)], deadline=20.0) as only_new:
        with trio.fail_after(20):
            while (await only_new.get(b"h/during")) is None:
                await trio.sleep(0.1)


async def test_no_member_reachable_is_unavailable():
    async with EtcdClient(["127.0.0.1:9"], deadline=0.5) as c:
        with pytest.raises(Unavailable, match="unreachable"):
            await c.get(b"x")


def test_a_new_cluster_whose_port_was_taken_starts_on_new_ports(tmp_path, monkeypatch):
    """Another process bound a port between its pick and the member's bind (two test workers
    starting clusters at once): a cluster never started picks new ports and starts."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    real = local_etcd._free_port
    picks = iter([port])
    monkeypatch.setattr(local_etcd, "_free_port", lambda: next(picks, None) or real())
    try:
        with EtcdCluster(tmp_path / "etcd", members=1) as cluster:
            assert str(port) not in cluster.endpoints[0]
            assert cluster.pids()
    finally:
        taken.close()
