"""The upkeep ops check their own preconditions, whoever calls them (issue 34): a block a
file still references is not forgotten, a chunk is not pointed at a node the registry does
not know, a taken node id is not registered from another address while it is up, and no
writer token leaves the File layer. Against real metadata servers (one, so that the
registry is beside every shard), as admin unless said otherwise."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
import trio
from etcd_fixtures import needs_etcd
from metadata_fixtures import open_meta_cluster, register_nodes

from metadata.client import MetadataClient
from metadata.etcd_shards import EtcdSettings
from tectonic_py.core.errors import Refused
from tectonic_py.core.ids import ROOT_ID
from tectonic_py.core.records import BlockInfo, ChunkPlacement

EC = "rs-2-1"


async def _committed_file(c: MetadataClient, name: str) -> tuple[int, int, int, list[str]]:
    """A file holding one committed block: (file id, token, block id, the block's nodes)."""
    f, tok = await c.create(ROOT_ID, name, ec=EC)
    g = await c.allocate_block(f.id, tok, EC)
    nodes = [n.node_id for n in g.nodes]
    info = BlockInfo(
        g.block_id, EC, 100, 150, [ChunkPlacement(i, nodes[i], 70 + i) for i in range(3)], 0
    )
    await c.commit_blocks(f.id, tok, [info])
    return f.id, tok, g.block_id, nodes


async def _block_away_from_registry(mc: Any) -> tuple[Any, int, list[str]]:
    """The server holding the registry, and a committed block (with its nodes) in a shard
    that server does not hold; skips the test if 64 blocks all landed beside it."""
    holder = next(s for s in mc.servers if s.registry is not None)
    for i in range(64):
        _, _, bid, nodes = await _committed_file(mc.client, f"f{i}")
        if mc.client.shard_of(bid) not in holder.stores:
            return holder, bid, nodes
    pytest.skip("every block landed beside the registry")


def _heartbeat(node_id: str, address: str) -> dict[str, Any]:
    return {
        "node_id": node_id,
        "address": address,
        "failure_domain": "rack0",
        "capacity": 10**12,
        "free": 10**12,
        "chunk_count": 0,
        "queue_depth": 0,
    }


async def test_forget_of_a_referenced_block_is_refused(tmp_path: Path, secret_file: Path) -> None:
    """Today ``block.forget`` without ``file_id`` dropped a committed block its file held."""
    async with open_meta_cluster(tmp_path, secret_file, servers=1, shards=4) as mc:
        c = mc.client
        await register_nodes(c, 4)
        fid, tok, bid, _ = await _committed_file(c, "held")
        await c.seal(fid, tok, 150)
        with pytest.raises(Refused, match=f"block {bid:016x} is still referenced"):
            await c.forget_block(bid, state="committed")
        with pytest.raises(Refused):  # naming its own file and index changes nothing
            await c.forget_block(bid, state="committed", file_id=fid, file_index=0)
        assert [b.block_id for b in await c.locate_blocks([bid])] == [bid]
        # Once the file is gone (its block queued for the GC) the forget goes through.
        await c.unlink(ROOT_ID, "held")
        assert await c.forget_block(bid, state="committed") is not None


async def test_set_chunk_only_onto_a_registered_node(tmp_path: Path, secret_file: Path) -> None:
    """Today ``block.set_chunk`` pointed a chunk at any well-formed node id."""
    async with open_meta_cluster(tmp_path, secret_file, servers=1, shards=4) as mc:
        c = mc.client
        await register_nodes(c, 4)
        _, _, bid, nodes = await _committed_file(c, "f")
        with pytest.raises(Refused, match="'ghost' is not registered"):
            await c.set_chunk(bid, 0, nodes[0], "ghost", 70)
        from tectonic_py.core.errors import InvalidArgument

        spare = next(f"node{i}" for i in range(4) if f"node{i}" not in nodes[:3])
        with pytest.raises(InvalidArgument):  # from a node that does not hold it
            await c.set_chunk(bid, 0, nodes[1], spare, 70)
        await c.set_chunk(bid, 0, nodes[0], spare, 70)
        (info,) = await c.locate_blocks([bid])
        assert info.chunks[0].node_id == spare


async def test_heartbeat_of_a_taken_node_id_is_refused(tmp_path: Path, secret_file: Path) -> None:
    """Today a second store with a taken id re-registered it at its own address."""
    async with open_meta_cluster(
        tmp_path, secret_file, servers=1, shards=4, node_timeout=1.0
    ) as mc:
        c = mc.client
        await c.call_registry("node.heartbeat", _heartbeat("cs0", "127.0.0.1:20000"))
        with pytest.raises(Refused, match="registered at 127.0.0.1:20000, which is up"):
            await c.call_registry("node.heartbeat", _heartbeat("cs0", "127.0.0.1:20001"))
        # The store itself, restarted on its address: always welcome.
        await c.call_registry("node.heartbeat", _heartbeat("cs0", "127.0.0.1:20000"))
        (node,) = [n for n in await c.nodes() if n.node_id == "cs0"]
        assert node.address == "127.0.0.1:20000"
        # A store that really moved: accepted once the old registration is down.
        await trio.sleep(1.3)
        await c.call_registry("node.heartbeat", _heartbeat("cs0", "127.0.0.1:20001"))
        (node,) = [n for n in await c.nodes() if n.node_id == "cs0"]
        assert (node.address, node.state) == ("127.0.0.1:20001", "up")


async def test_expired_leases_return_no_tokens(tmp_path: Path, secret_file: Path) -> None:
    """Today ``file.expired_leases`` returned writer tokens, and any ``before_ns`` the
    caller chose, so the maintenance role could take a live writer's token."""
    async with open_meta_cluster(tmp_path, secret_file, servers=1, shards=4) as mc:
        await register_nodes(mc.client, 4)
        fid, tok, _, _ = await _committed_file(mc.client, "live")
        async with trio.open_nursery() as nursery:
            maint = MetadataClient(
                dataclasses.replace(mc.config, role="maintenance"), nursery=nursery
            )
            shard = maint.shard_of(fid)
            # The writer's lease is live: a far ``before_ns`` is held to now.
            assert await maint.expired_leases(shard, before_ns=2**62, limit=100) == []
            r = await maint.call_shard(
                shard, "file.expired_leases", {"before_ns": 2**62, "limit": 100}
            )
            assert r["files"] == []
            assert await maint.recover_lease(fid, tok, before_ns=2**62) == "skipped"
            # An operator (admin) may fence a writer by hand: it gets the expiry, not the token.
            (row,) = await mc.client.expired_leases(shard, before_ns=2**62, limit=100)
            assert row[0] == fid and row[1] != tok and row[1] > time.time_ns()
            assert await maint.recover_lease(fid, row[1], before_ns=2**62) == "skipped"
            assert await mc.client.recover_lease(fid, row[1], before_ns=2**62) == "incomplete"
            await maint.aclose()


@needs_etcd
async def test_set_chunk_asks_the_registry_on_another_server(
    tmp_path: Path, secret_file: Path, etcd_settings: EtcdSettings
) -> None:
    """Under the etcd engine a server knows who holds the registry: a block of a shard the
    registry's server does not hold is still refused a chunk on an unknown node."""
    async with open_meta_cluster(
        tmp_path, secret_file, servers=2, shards=4, etcd=etcd_settings
    ) as mc:
        c = mc.client
        await register_nodes(c, 4)
        holder, bid, nodes = await _block_away_from_registry(mc)
        other = next(s for s in mc.servers if s is not holder)
        with trio.fail_after(15):  # until its poll of the owner keys has seen shard 0's
            while 0 not in await other.engine.owners():
                await trio.sleep(0.2)
        with pytest.raises(Refused, match="'ghost' is not registered"):
            await c.set_chunk(bid, 0, nodes[0], "ghost", 70)
        spare = next(f"node{i}" for i in range(4) if f"node{i}" not in nodes[:3])
        await c.set_chunk(bid, 0, nodes[0], spare, 70)


async def test_set_chunk_on_a_server_without_the_registry(
    tmp_path: Path, secret_file: Path
) -> None:
    """A sqlite server that does not hold the registry asks the one at the caller's
    ``registry`` address (as a server: a caller cannot stand in one of its own), and
    refuses when it is given none."""
    async with open_meta_cluster(tmp_path, secret_file, servers=2, shards=4) as mc:
        c = mc.client
        await register_nodes(c, 4)
        _, bid, nodes = await _block_away_from_registry(mc)
        fields = {"block_id": bid, "index": 0, "old_node": nodes[0], "checksum": 70}
        with pytest.raises(Refused, match="cannot confirm that node 'node3' is registered"):
            await c.call("block.set_chunk", {**fields, "new_node": "node3"})
        with pytest.raises(Refused, match="cannot confirm"):  # not a registry at all
            await c.call(
                "block.set_chunk", {**fields, "new_node": "node3", "registry": "127.0.0.1:1"}
            )
        with pytest.raises(Refused, match="'ghost' is not registered"):
            await c.set_chunk(bid, 0, nodes[0], "ghost", 70)  # the typed client names it
        spare = next(f"node{i}" for i in range(4) if f"node{i}" not in nodes[:3])
        await c.set_chunk(bid, 0, nodes[0], spare, 70)
