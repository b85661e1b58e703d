"""Metadata service through MetadataClient against real servers on 127.0.0.1."""

from __future__ import annotations

import msgpack
import pytest
import trio
import trio.lowlevel
from metadata_fixtures import open_meta_cluster, register_nodes
from tmpfs_helpers import small_tmpfs

from metadata import name_layer
from tectonic_py.core import capability, rpc_client, sockets
from tectonic_py.core.errors import (
    Busy,
    DirectoryNotEmpty,
    FileExists,
    FileNotFound,
    FileSealed,
    InvalidArgument,
    InvalidName,
    IsADirectory,
    NoSpace,
    NotADirectory,
    ProtocolError,
    Refused,
    ShardUnavailable,
    StaleWriterToken,
    UnknownOp,
    WrongShard,
    XattrNotFound,
)
from tectonic_py.core.ids import ROOT_ID, shard_of
from tectonic_py.core.records import BlockInfo, ChunkPlacement, validate_name


@pytest.fixture
async def mc(tmp_path, secret_file, meta_engine):
    """Every test of the service runs on both metadata engines."""
    async with open_meta_cluster(tmp_path, secret_file, etcd=meta_engine) as cluster:
        yield cluster


async def mkdir_where(client, parent, prefix, want):
    """A new directory whose shard satisfies ``want(shard)`` (dirs land in random shards)."""
    for i in range(200):
        d = await client.mkdir(parent, f"{prefix}{i}")
        if want(shard_of(d.id, client.config.shards)):
            return d
    raise AssertionError("no directory landed in the wanted shard")


def block(grant, index, ec="rs-2-1", chunk_len=100, data_len=150, checksum=7):
    n = int(ec.split("-")[1]) + int(ec.split("-")[2])
    return BlockInfo(
        block_id=grant.block_id,
        ec=ec,
        chunk_len=chunk_len,
        data_len=data_len,
        chunks=[ChunkPlacement(i, grant.nodes[i].node_id, checksum + i) for i in range(n)],
        file_index=index,
    )


async def test_namespace_basics(mc):
    c = mc.client
    root = await c.getattr(ROOT_ID)
    assert root.is_dir and root.ec == "rs-6-3"
    d = await c.mkdir(ROOT_ID, "ckpt", mode=0o700, uid=5, gid=6)
    assert (d.kind, d.mode, d.uid, d.gid) == ("dir", 0o700, 5, 6)
    f, token = await c.create(d.id, "rank_0.pt", mode=0o600)
    assert f.kind == "file" and f.writer and not f.sealed and token
    assert (await c.lookup(d.id, "rank_0.pt")).id == f.id
    assert (await c.resolve("/ckpt/rank_0.pt")).id == f.id
    assert (await c.resolve("/")).id == ROOT_ID
    sealed = await c.seal(f.id, token, 0)
    assert sealed.sealed and not sealed.writer
    entries, cursor = await c.readdir(d.id)
    assert [(e.name, e.id, e.kind) for e in entries] == [("rank_0.pt", f.id, "file")]
    assert cursor is None
    assert await c.unlink(d.id, "rank_0.pt") == f.id
    with pytest.raises(FileNotFound):
        await c.lookup(d.id, "rank_0.pt")
    with pytest.raises(FileNotFound):
        await c.getattr(f.id)
    await c.rmdir(ROOT_ID, "ckpt")
    with pytest.raises(FileNotFound):
        await c.resolve("/ckpt")
    assert (await c.readdir(ROOT_ID))[0] == []


async def test_ec_policy_inherited_and_settable(mc):
    c = mc.client
    d = await c.mkdir(ROOT_ID, "d")
    await c.setattr(d.id, ec="rs-4-2")
    sub = await c.mkdir(d.id, "sub")
    assert sub.ec == "rs-4-2"
    f, _ = await c.create(sub.id, "x")
    assert f.ec == "rs-4-2"
    g, _ = await c.create(sub.id, "y", ec="r3")
    assert g.ec == "r3"
    with pytest.raises(InvalidArgument):
        await c.setattr(d.id, ec="rs-99-1")
    attrs = await c.setattr(g.id, mode=0o640, uid=9, mtime_ns=123)
    assert (attrs.mode, attrs.uid, attrs.mtime_ns) == (0o640, 9, 123)


async def test_errno_cases(mc):
    c = mc.client
    d = await c.mkdir(ROOT_ID, "d")
    f, _ = await c.create(d.id, "f")
    with pytest.raises(FileExists):
        await c.create(d.id, "f")
    with pytest.raises(FileExists):
        await c.mkdir(d.id, "f")
    with pytest.raises(FileExists):
        await c.mkdir(ROOT_ID, "d")
    with pytest.raises(FileNotFound):
        await c.lookup(d.id, "nope")
    with pytest.raises(FileNotFound):
        await c.unlink(d.id, "nope")
    with pytest.raises(FileNotFound):
        await c.rmdir(d.id, "nope")
    with pytest.raises(FileNotFound):
        await c.rename(d.id, "nope", d.id, "x")
    with pytest.raises(NotADirectory):
        await c.create(f.id, "inside_a_file")
    with pytest.raises(NotADirectory):
        await c.mkdir(f.id, "inside_a_file")
    with pytest.raises(NotADirectory):
        await c.resolve("/d/f/x")
    with pytest.raises(NotADirectory):
        await c.rmdir(d.id, "f")
    with pytest.raises(DirectoryNotEmpty):
        await c.rmdir(ROOT_ID, "d")
    with pytest.raises(IsADirectory):
        await c.unlink(ROOT_ID, "d")
    with pytest.raises(IsADirectory):
        await c.open_for_write(d.id)
    with pytest.raises(IsADirectory):
        await c.create(ROOT_ID, "d", exclusive=False)
    with pytest.raises(FileNotFound):
        await c.readdir(f.id + 1 if shard_of(f.id + 1, 8) else f.id + 2)
    with pytest.raises(NotADirectory):
        await c.readdir(f.id)
    # Nothing was lost by all those refusals.
    assert (await c.lookup(d.id, "f")).id == f.id
    assert [e.name for e in (await c.readdir(ROOT_ID))[0]] == ["d"]


async def test_create_non_exclusive_truncates(mc):
    c = mc.client
    await register_nodes(c, 3)
    f, tok = await c.create(ROOT_ID, "f", ec="rs-2-1")
    g = await c.allocate_block(f.id, tok, "rs-2-1", hedge=0)
    await c.commit_blocks(f.id, tok, [block(g, 0)])
    await c.seal(f.id, tok, 150)
    again, tok2 = await c.create(ROOT_ID, "f", exclusive=False)
    assert again.id == f.id and again.size == 0 and not again.sealed
    assert await c.block_list(f.id) == []
    assert tok2 != tok
    new, _ = await c.create(ROOT_ID, "fresh", exclusive=False)
    assert new.id != f.id


async def test_a_create_sent_twice_is_answered_with_its_first_file(mc):
    """name.create repeated after a lost reply (the same client-drawn token): the file its
    first try made, not FileExists; any other create of that name, or a repeat after the
    file changed writers, is FileExists."""
    c = mc.client
    shard = c.shard_of(ROOT_ID)
    fields = {"dir": ROOT_ID, "name": "f", "token": 12345}
    first = await c.call_shard(shard, "name.create", fields)
    again = await c.call_shard(shard, "name.create", fields)
    assert again["attrs"]["id"] == first["attrs"]["id"] and again["token"] == 12345
    with pytest.raises(FileExists):
        await c.call_shard(shard, "name.create", {**fields, "token": 54321})
    with pytest.raises(FileExists):
        await c.call_shard(shard, "name.create", {"dir": ROOT_ID, "name": "f"})
    await c.open_for_write(first["attrs"]["id"])  # a second writer takes the file
    with pytest.raises(FileExists):
        await c.call_shard(shard, "name.create", fields)
    names, _ = await c.readdir(ROOT_ID)
    assert [e.name for e in names] == ["f"]


async def test_writer_fencing(mc):
    c = mc.client
    await register_nodes(c, 3)
    f, first = await c.create(ROOT_ID, "f", ec="rs-2-1")
    second = await c.open_for_write(f.id)
    assert second != first
    g = await c.allocate_block(f.id, first, "rs-2-1", hedge=0)
    with pytest.raises(StaleWriterToken):
        await c.commit_blocks(f.id, first, [block(g, 0)])
    with pytest.raises(StaleWriterToken):
        await c.seal(f.id, first, 10)
    with pytest.raises(StaleWriterToken):
        await c.set_size(f.id, first, 10)
    with pytest.raises(StaleWriterToken):
        await c.renew_lease(f.id, first)
    await c.renew_lease(f.id, second)
    await c.commit_blocks(f.id, second, [block(g, 0)])
    attrs = await c.seal(f.id, second, 150)
    assert attrs.sealed and attrs.size == 150 and not attrs.writer
    with pytest.raises(FileSealed):
        await c.commit_blocks(f.id, second, [block(g, 0)])
    # The first writer's late commit changed nothing.
    assert [b.block_id for b in await c.block_list(f.id)] == [g.block_id]


async def test_blocks_commit_locate_replace_and_reverse_index(mc):
    c = mc.client
    await register_nodes(c, 6, domains=6)
    f, tok = await c.create(ROOT_ID, "f", ec="rs-2-1")
    grants = [await c.allocate_block(f.id, tok, "rs-2-1", hedge=2) for _ in range(3)]
    g0 = grants[0]
    assert len(g0.nodes) == 5 and len({n.failure_domain for n in g0.nodes}) == 5
    for n in g0.nodes:
        capability.verify(mc.capability_key, g0.capability, g0.block_id, n.node_id)
    await c.commit_blocks(f.id, tok, [block(g, i) for i, g in enumerate(grants)])
    infos = await c.block_list(f.id)
    assert [i.file_index for i in infos] == [0, 1, 2]
    assert infos[0].chunks[0].address.startswith("127.0.0.1:")
    assert (await c.locate_blocks([g0.block_id]))[0].data_len == 150
    # Committing at an existing index replaces the block and queues the old one for GC.
    extra = await c.allocate_block(f.id, tok, "rs-2-1", hedge=0)
    await c.commit_blocks(f.id, tok, [block(extra, 1)])
    assert [i.block_id for i in await c.block_list(f.id)] == [
        g0.block_id,
        extra.block_id,
        grants[2].block_id,
    ]
    fshard = shard_of(f.id, 8)
    queued = await c.call_shard(fshard, "file.gc_blocks", {"limit": 100})
    assert grants[1].block_id in queued["block_ids"]
    # Repair: move chunk 0 of g0 to another node, keeping the reverse index in step.
    old = g0.nodes[0].node_id
    new = next(n.node_id for n in g0.nodes[3:])
    await c.replace_chunk(g0.block_id, 0, old, new, 99)
    moved = (await c.locate_blocks([g0.block_id]))[0]
    assert (moved.chunks[0].node_id, moved.chunks[0].checksum) == (new, 99)
    assert (g0.block_id, 0) in await c.blocks_on_node(new)
    assert (g0.block_id, 0) not in await c.blocks_on_node(old)
    with pytest.raises(InvalidArgument):
        await c.replace_chunk(g0.block_id, 0, old, new, 1)  # no longer on old
    # more_nodes: a fresh grant for the same block, excluding failed nodes.
    spare = await c.allocate_block(f.id, tok, "rs-2-1", hedge=0)
    more = await c.more_nodes(spare.block_id, [n.node_id for n in spare.nodes], 2)
    assert more.block_id == spare.block_id
    assert not {n.node_id for n in more.nodes} & {n.node_id for n in spare.nodes}
    capability.verify(mc.capability_key, more.capability, spare.block_id, more.nodes[0].node_id)
    capability.verify(mc.capability_key, more.capability, spare.block_id, spare.nodes[0].node_id)
    with pytest.raises(InvalidArgument):
        await c.more_nodes(extra.block_id, [], 1)  # committed blocks are immutable
    # set_size drops blocks wholly past the new size: bytes per block = k * chunk_size.
    attrs = await c.set_size(f.id, tok, 10)
    assert attrs.size == 10
    assert [i.file_index for i in await c.block_list(f.id)] == [0]
    stats = await c.statfs()
    assert stats["nodes_up"] == 6 and stats["files"] >= 2


async def test_placement_refuses_when_cluster_too_small(mc):
    c = mc.client
    await register_nodes(c, 2)
    f, tok = await c.create(ROOT_ID, "f")
    with pytest.raises(NoSpace):
        await c.allocate_block(f.id, tok, "rs-6-3")


async def test_bad_block_commits_refused(mc):
    c = mc.client
    await register_nodes(c, 3)
    f, tok = await c.create(ROOT_ID, "f", ec="rs-2-1")
    g = await c.allocate_block(f.id, tok, "rs-2-1", hedge=0)
    b = block(g, 0)
    b.data_len = 10**6  # more than k * chunk_len
    with pytest.raises(InvalidArgument):
        await c.commit_blocks(f.id, tok, [b])
    b = block(g, 0)
    b.chunks = b.chunks[:1]  # fewer than k chunks
    with pytest.raises(InvalidArgument):
        await c.commit_blocks(f.id, tok, [b])
    other, tok2 = await c.create(ROOT_ID, "other", ec="rs-2-1")
    with pytest.raises(InvalidArgument):
        await c.commit_blocks(other.id, tok2, [block(g, 0)])  # another file's block
    await c.commit_blocks(f.id, tok, [block(g, 0)])
    await c.commit_blocks(f.id, tok, [block(g, 0)])  # retry of the same commit: idempotent
    assert len(await c.block_list(f.id)) == 1


async def test_unlink_while_open_for_write_keeps_file_until_seal(mc):
    c = mc.client
    await register_nodes(c, 3)
    f, tok = await c.create(ROOT_ID, "f", ec="rs-2-1")
    g = await c.allocate_block(f.id, tok, "rs-2-1", hedge=0)
    await c.unlink(ROOT_ID, "f")
    with pytest.raises(FileNotFound):
        await c.lookup(ROOT_ID, "f")
    await c.commit_blocks(f.id, tok, [block(g, 0)])  # POSIX: an open file stays usable
    assert (await c.getattr(f.id)).nlink == 0
    await c.seal(f.id, tok, 150)
    with pytest.raises(FileNotFound):
        await c.getattr(f.id)
    queued = await c.call_shard(shard_of(f.id, 8), "file.gc_blocks", {"limit": 100})
    assert g.block_id in queued["block_ids"]


async def test_rename_same_directory_over_existing_file(mc):
    c = mc.client
    await register_nodes(c, 3)
    d = await c.mkdir(ROOT_ID, "d")
    old, t1 = await c.create(d.id, "step", ec="rs-2-1")
    g = await c.allocate_block(old.id, t1, "rs-2-1", hedge=0)
    await c.commit_blocks(old.id, t1, [block(g, 0)])
    await c.seal(old.id, t1, 150)
    new, t2 = await c.create(d.id, "step.tmp")
    await c.seal(new.id, t2, 0)
    await c.rename(d.id, "step.tmp", d.id, "step")
    assert (await c.lookup(d.id, "step")).id == new.id
    assert [e.name for e in (await c.readdir(d.id))[0]] == ["step"]
    with pytest.raises(FileNotFound):
        await c.getattr(old.id)
    queued = await c.call_shard(shard_of(old.id, 8), "file.gc_blocks", {"limit": 100})
    assert g.block_id in queued["block_ids"]
    await c.rename(d.id, "step", d.id, "step")  # onto itself: nothing changes
    assert (await c.lookup(d.id, "step")).id == new.id


@pytest.mark.parametrize("same_shard", [True, False])
async def test_rename_across_directories(mc, same_shard):
    c = mc.client
    a = await c.mkdir(ROOT_ID, "a")
    sa = shard_of(a.id, 8)
    b = await mkdir_where(
        c, ROOT_ID, "b", (lambda s: s == sa) if same_shard else (lambda s: s != sa)
    )
    f, tok = await c.create(a.id, "f")
    await c.seal(f.id, tok, 0)
    victim, vt = await c.create(b.id, "g")
    await c.seal(victim.id, vt, 0)
    await c.rename(a.id, "f", b.id, "g")
    assert (await c.lookup(b.id, "g")).id == f.id
    assert (await c.readdir(a.id))[0] == []
    with pytest.raises(FileNotFound):
        await c.getattr(victim.id)
    # Directories: over an empty one replaces it; over a non-empty one is refused.
    sub = await c.mkdir(a.id, "sub")
    empty = await c.mkdir(b.id, "empty")
    await c.rename(a.id, "sub", b.id, "empty")
    assert (await c.lookup(b.id, "empty")).id == sub.id
    with pytest.raises(FileNotFound):
        await c.getattr(empty.id)
    full = await c.mkdir(a.id, "full")
    await c.create(full.id, "x")
    with pytest.raises(DirectoryNotEmpty):
        await c.rename(b.id, "empty", a.id, "full")
    with pytest.raises(IsADirectory):
        await c.rename(b.id, "g", a.id, "full")
    with pytest.raises(NotADirectory):
        await c.rename(a.id, "full", b.id, "g")
    with pytest.raises(InvalidArgument):
        await c.rename(ROOT_ID, "a", a.id, "inside")
    # Nothing was lost by the refusals.
    assert sorted(e.name for e in (await c.readdir(b.id))[0]) == ["empty", "g"]
    assert sorted(e.name for e in (await c.readdir(a.id))[0]) == ["full"]


async def test_cross_shard_rename_recovery_rolls_forward_or_back(mc):
    c = mc.client
    a = await c.mkdir(ROOT_ID, "a")
    sa = shard_of(a.id, 8)
    b = await mkdir_where(c, ROOT_ID, "b", lambda s: s != sa)
    sb = shard_of(b.id, 8)
    f1, _ = await c.create(a.id, "one")
    f2, _ = await c.create(a.id, "two")
    deadline = 1  # already passed: the recovery pass may settle it
    far = 2**62
    # "one": the client crashed after apply, before finish -> both names visible; roll forward.
    p1 = await c.call_shard(
        sa,
        "name.rename_prepare",
        {
            "src_dir": a.id,
            "src_name": "one",
            "dst_dir": b.id,
            "dst_name": "one",
            "dst_address": c.address_of(sb),
            "deadline_ns": far,
        },
    )
    await c.call_shard(
        sb,
        "name.rename_apply",
        {
            "dst_dir": b.id,
            "dst_name": "one",
            "id": f1.id,
            "kind": "file",
            "deadline_ns": far,
            "replace_dir": 0,
        },
    )
    assert (await c.lookup(a.id, "one")).id == f1.id
    assert (await c.lookup(b.id, "one")).id == f1.id
    # While pinned, the source entry cannot be unlinked (Busy, retried, then surfaced).
    # "two": crashed after prepare -> roll back.
    p2 = await c.call_shard(
        sa,
        "name.rename_prepare",
        {
            "src_dir": a.id,
            "src_name": "two",
            "dst_dir": b.id,
            "dst_name": "two",
            "dst_address": c.address_of(sb),
            "deadline_ns": deadline,
        },
    )
    with pytest.raises(Exception) as info:
        await c.call_shard(
            sb,
            "name.rename_apply",
            {
                "dst_dir": b.id,
                "dst_name": "two",
                "id": f2.id,
                "kind": "file",
                "deadline_ns": deadline,
                "replace_dir": 0,
            },
        )
    assert info.value.code == "timeout"  # too late: the recovery pass owns this intent now
    settled = sum([await s.recover_intents(before_ns=far + 1) for s in mc.servers])
    assert settled == 2
    assert p1["intent"] != p2["intent"]
    with pytest.raises(FileNotFound):
        await c.lookup(a.id, "one")
    assert (await c.lookup(b.id, "one")).id == f1.id
    assert (await c.lookup(a.id, "two")).id == f2.id
    with pytest.raises(FileNotFound):
        await c.lookup(b.id, "two")


async def test_paged_listing_stable_under_concurrent_creates(mc):
    c = mc.client
    d = await c.mkdir(ROOT_ID, "d")
    before = {f"r{i:04d}" for i in range(0, 600, 2)}
    async with trio.open_nursery() as n:
        for name in sorted(before):
            n.start_soon(c.create, d.id, name)
    seen: list[str] = []

    async def list_all():
        after = ""
        for _ in range(1000):
            page, cursor = await c.readdir(d.id, after=after, limit=37)
            seen.extend(e.name for e in page)
            if cursor is None:
                return
            after = cursor
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as n:
        n.start_soon(list_all)
        for i in range(1, 600, 2):
            n.start_soon(c.create, d.id, f"r{i:04d}")
    assert len(seen) == len(set(seen)), "an entry was listed twice"
    assert before <= set(seen), "an entry that existed throughout was skipped"
    assert seen == sorted(seen)
    everything = []
    after = ""
    while True:
        page, cursor = await c.readdir(d.id, after=after, limit=10_000)
        everything += [e.name for e in page]
        if cursor is None:
            break
        after = cursor
    assert len(everything) == 600


async def test_concurrent_creates_in_one_directory_are_group_committed(mc):
    c = mc.client
    d = await c.mkdir(ROOT_ID, "burst")
    store = next(s.stores[shard_of(d.id, 8)] for s in mc.servers if shard_of(d.id, 8) in s.stores)
    batches0, muts0 = store.stats.batches, store.stats.mutations

    async def one(i):
        f, tok = await c.create(d.id, f"rank_{i}")
        await c.seal(f.id, tok, 0)

    async with trio.open_nursery() as n:
        for i in range(300):
            n.start_soon(one, i)
    entries, _ = await c.readdir(d.id, limit=10_000)
    assert len(entries) == 300
    name_inserts = store.stats.mutations - muts0
    assert name_inserts >= 300
    assert store.stats.batches - batches0 < name_inserts / 3, "creates were not batched"


async def test_xattrs(mc):
    c = mc.client
    f, _ = await c.create(ROOT_ID, "f")
    await c.setxattr(f.id, "user.step", b"1000")
    await c.setxattr(f.id, "user.a", b"")
    assert await c.getxattr(f.id, "user.step") == b"1000"
    assert await c.listxattr(f.id) == ["user.a", "user.step"]
    await c.removexattr(f.id, "user.a")
    with pytest.raises(XattrNotFound):
        await c.getxattr(f.id, "user.a")
    with pytest.raises(XattrNotFound):
        await c.removexattr(f.id, "user.a")
    with pytest.raises(InvalidArgument):
        await c.setxattr(f.id, "user.big", b"x" * (64 * 1024 + 1))
    with pytest.raises(InvalidArgument):
        await c.setxattr(f.id, "", b"x")
    assert await c.listxattr(f.id) == ["user.step"]


async def test_orphan_records_are_collected(mc):
    c = mc.client
    # A create that crashed between the File record and the Name entry: record, no name.
    r = await c.call_shard(3, "file.create", {"kind": "file", "parent": ROOT_ID, "name": "lost"})
    orphan = r["attrs"]["id"]
    # seal marks named...
    await c.call_shard(3, "file.seal", {"id": orphan, "token": r["token"], "size": 0})
    r2 = await c.call_shard(3, "file.create", {"kind": "file", "parent": ROOT_ID, "name": "lost2"})
    orphan2 = r2["attrs"]["id"]
    await c.call_shard(3, "file.renew", {"id": orphan2, "token": r2["token"]})
    # A complete create that was never sealed: named, but not yet marked named.
    live, _ = await c.create(ROOT_ID, "live")
    # Writers hold live leases: nothing is collected while they may still finish.
    assert await c.collect_orphans(0) == 0
    for s in mc.servers:
        s.lease_ns = 0
    await c.open_for_write(orphan2)  # token with an already expired lease
    await c.open_for_write(live.id)
    assert await c.collect_orphans(0) == 1
    with pytest.raises(FileNotFound):
        await c.getattr(orphan2)
    assert (await c.lookup(ROOT_ID, "live")).id == live.id
    assert (await c.getattr(orphan)).sealed


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "/", "nul\x00", "x" * 256, "é" * 128])
async def test_bad_names_refused_everywhere(mc, bad):
    c = mc.client
    with pytest.raises(InvalidName):
        validate_name(bad)
    with pytest.raises(InvalidName):
        await c.create(ROOT_ID, bad)
    with pytest.raises(InvalidName):
        await c.mkdir(ROOT_ID, bad)
    with pytest.raises(InvalidName):
        await c.lookup(ROOT_ID, bad)
    with pytest.raises(InvalidName):
        await c.rename(ROOT_ID, "x", ROOT_ID, bad)
    # The server checks too (a client that skips validation gets the same answer).
    with pytest.raises(InvalidName):
        await c.call_shard(
            shard_of(ROOT_ID, 8),
            "name.insert",
            {"dir": ROOT_ID, "name": bad, "id": 12345, "kind": "file"},
        )
    assert (await c.readdir(ROOT_ID))[0] == []


async def test_max_length_name_accepted(mc):
    c = mc.client
    name = "é" * 127 + "x"  # 255 bytes of UTF-8
    f, _ = await c.create(ROOT_ID, name)
    assert (await c.lookup(ROOT_ID, name)).id == f.id


async def test_malformed_requests_and_unknown_shards(mc):
    addr = mc.config.metadata_servers[0].address
    host, port = sockets.parse_address(addr)
    secret = mc.config.credential()
    async with rpc_client.open_connection(host, port, secret) as conn:
        with pytest.raises(WrongShard):
            await conn.call("file.get", {"shard": 7, "id": 5})
        with pytest.raises(InvalidArgument):
            await conn.call("file.get", {"shard": 999999999999, "id": 5})
        with pytest.raises(InvalidArgument):
            await conn.call("file.get", {"id": 5})  # no shard
        with pytest.raises(InvalidArgument):
            await conn.call("file.get", {"shard": 0, "id": "five"})
        with pytest.raises(InvalidArgument):
            await conn.call("file.get", {"shard": 0, "id": 0})
        with pytest.raises(InvalidArgument):
            await conn.call(
                "name.insert", {"shard": 0, "dir": 1, "name": "x", "id": 9, "kind": "pipe"}
            )
        with pytest.raises(InvalidName):
            await conn.call(
                "name.insert", {"shard": 0, "dir": 1, "name": 42, "id": 9, "kind": "file"}
            )
        with pytest.raises(InvalidArgument):
            await conn.call("file.commit", {"shard": 0, "id": 9, "token": 1, "entries": [[1]]})
        with pytest.raises(InvalidArgument):
            await conn.call("file.commit", {"shard": 0, "id": 9, "token": 1, "entries": "x"})
        with pytest.raises(InvalidArgument):
            await conn.call(
                "block.commit", {"shard": 0, "file_id": 9, "blocks": [{"block_id": "x"}]}
            )
        with pytest.raises(InvalidArgument):
            await conn.call("block.commit", {"shard": 0, "file_id": 9, "blocks": [7]})
        with pytest.raises(InvalidArgument):
            await conn.call("block.locate", {"shard": 0, "ids": [True]})
        with pytest.raises(InvalidArgument):
            await conn.call(
                "node.heartbeat", {"node_id": "../etc", "address": "h:1", "failure_domain": "a"}
            )
        with pytest.raises(UnknownOp):
            await conn.call("name.drop_table", {"shard": 0})
        # The connection survived every refusal.
        r = (
            await conn.call("file.get", {"shard": shard_of(ROOT_ID, 8), "id": ROOT_ID})
            if shard_of(ROOT_ID, 8) < 4
            else None
        )
        assert r is None or r.fields["attrs"]["id"] == ROOT_ID
    # The registry lives with shard 0: the other server refuses registry ops.
    host, port = sockets.parse_address(mc.config.metadata_servers[1].address)
    async with rpc_client.open_connection(host, port, secret) as conn:
        with pytest.raises(WrongShard):
            await conn.call("node.list", {})
    # Wrong secret: refused at the handshake.
    with pytest.raises(Exception) as info:
        async with rpc_client.open_connection(host, port, b"x" * 32):
            pass
    assert info.value.code in ("auth", "unavailable")


async def test_garbage_frame_closes_only_that_connection(mc):
    host, port = sockets.parse_address(mc.config.metadata_servers[0].address)
    sock = trio.socket.socket()
    await sock.connect((host, port))
    await sock.recv(4096)  # hello
    await sock.send(b"\x07" * 64)
    sock.close()
    # Other clients are unaffected.
    assert (await mc.client.getattr(ROOT_ID)).id == ROOT_ID
    with pytest.raises(ProtocolError):
        raise ProtocolError("sanity")  # the class is importable for callers
    assert msgpack.packb({}) == b"\x80"


async def test_registry_liveness_and_persistence(tmp_path, secret_file):
    async with open_meta_cluster(tmp_path, secret_file, servers=1, shards=4, node_timeout=5) as mc:
        c = mc.client
        await register_nodes(c, 4)
        nodes = await c.nodes()
        assert [n.state for n in nodes] == ["up"] * 4
        reg = mc.servers[0].registry
        reg._nodes["node0"].last_seen -= 100  # silent for longer than the timeout
        nodes = {n.node_id: n for n in await c.nodes()}
        assert nodes["node0"].state == "down"
        placed = await c.place(3, 3, ())  # placed by the client, over the node list
        assert "node0" not in [n.node_id for n in placed]
        with pytest.raises(NoSpace):
            await c.place(4, 4, ())
        # An address change (restart on a new port) updates the registration, once the old
        # one is silent: while it is up, another address claiming its id is refused.
        moved = {
            "node_id": "node1",
            "address": "127.0.0.1:30001",
            "failure_domain": "rack1",
            "capacity": 5,
            "free": 5,
            "chunk_count": 0,
            "queue_depth": 0,
        }
        with pytest.raises(Refused, match="is up"):
            await c.call_registry("node.heartbeat", moved)
        reg._nodes["node1"].last_seen -= 100
        await c.call_registry("node.heartbeat", moved)
    async with open_meta_cluster(tmp_path, secret_file, servers=1, shards=4) as mc:
        nodes = {n.node_id: n for n in await mc.client.nodes()}
        assert set(nodes) == {"node0", "node1", "node2", "node3"}
        assert nodes["node1"].address == "127.0.0.1:30001"
        # A namespace change made before survives too.


async def test_shard_file_identity_is_checked(tmp_path, secret_file):
    async with open_meta_cluster(tmp_path, secret_file, servers=1, shards=4) as mc:
        await mc.client.mkdir(ROOT_ID, "kept")
    async with open_meta_cluster(tmp_path, secret_file, servers=1, shards=4) as mc:
        assert (await mc.client.lookup(ROOT_ID, "kept")).is_dir
    from metadata.server import MetadataServer
    from tectonic_py.core.errors import ShardUnavailable

    with pytest.raises(ShardUnavailable, match="total_shards"):
        MetadataServer(tmp_path / "meta0", [0, 1], 8, b"s" * 32, capability_key=b"k" * 32)


async def test_killed_directory_refuses_creates_until_revived(mc):
    """The mechanism behind rmdir and rename over an empty directory: once killed (emptiness
    checked in the same transaction) nothing can be created in it; a failed rename revives it."""
    c = mc.client
    d = await c.mkdir(ROOT_ID, "victim")
    shard = shard_of(d.id, 8)
    await c.call_shard(shard, "file.kill_dir", {"id": d.id})
    with pytest.raises(FileNotFound):
        await c.create(d.id, "late")
    await c.call_shard(shard, "file.revive_dir", {"id": d.id})
    f, _ = await c.create(d.id, "late")
    with pytest.raises(DirectoryNotEmpty):
        await c.call_shard(shard, "file.kill_dir", {"id": d.id})
    assert (await c.lookup(d.id, "late")).id == f.id


async def test_rename_intents_settled_on_server_restart(tmp_path, secret_file):
    """A client that died mid cross-shard rename: the restarted servers settle its intents."""
    async with open_meta_cluster(tmp_path, secret_file, recovery_interval_s=3600) as mc:
        c = mc.client
        a = await c.mkdir(ROOT_ID, "a")
        sa = shard_of(a.id, 8)
        b = await mkdir_where(c, ROOT_ID, "b", lambda s: s != sa)
        sb = shard_of(b.id, 8)
        f, _ = await c.create(a.id, "f")
        await c.call_shard(
            sa,
            "name.rename_prepare",
            {
                "src_dir": a.id,
                "src_name": "f",
                "dst_dir": b.id,
                "dst_name": "f",
                "dst_address": c.address_of(sb),
                "deadline_ns": 1,
            },
        )
        store = next(s.stores[sa] for s in mc.servers if sa in s.stores)
        with pytest.raises(Busy):  # pinned while the intent is open
            await store.write(name_layer.remove, a.id, "f", "file", 0)
        ports = [int(s.address.rsplit(":", 1)[1]) for s in mc.config.metadata_servers]
    async with open_meta_cluster(tmp_path, secret_file, ports=ports, recovery_interval_s=0.1) as mc:
        c = mc.client
        for _ in range(600):  # recovery passes run from the servers' start
            r = await c.call_shard(sa, "name.intents", {"before_ns": 2**62})
            if not r["intents"]:
                break
            await trio.sleep(0.05)
        assert r["intents"] == []
        assert (await c.lookup(a.id, "f")).id == f.id  # rolled back: never applied
        with pytest.raises(FileNotFound):
            await c.lookup(b.id, "f")
        await c.unlink(a.id, "f")


@pytest.fixture
def small_fs(tmp_path):
    """A real 4 MiB filesystem (tmpfs) so ENOSPC comes from the kernel."""
    yield from small_tmpfs(tmp_path, "4m")


def fill(path):
    """Take the filesystem's free space (leaves well under a megabyte)."""
    with open(path, "wb") as out:
        try:
            for _ in range(64):
                out.write(b"\0" * 65536)
                out.flush()
        except OSError:
            pass


async def test_full_disk_fails_the_batch_cleanly_and_recovers(small_fs, secret_file):
    async with open_meta_cluster(small_fs, secret_file, servers=1, shards=2) as mc:
        c = mc.client
        f, _ = await c.create(ROOT_ID, "f")
        filler = small_fs / "filler"
        fill(filler)
        acknowledged = []
        with pytest.raises(ShardUnavailable, match="full"):
            for i in range(200):
                await c.setxattr(f.id, f"user.k{i}", bytes([i]) * 60_000)
                acknowledged.append(i)
        filler.unlink()
        # Every acknowledged change is there; the failed one is not half-applied.
        names = await c.listxattr(f.id)
        assert names == sorted(f"user.k{i}" for i in acknowledged)
        for i in acknowledged[:3]:
            assert await c.getxattr(f.id, f"user.k{i}") == bytes([i]) * 60_000
        # With space back, the same shard takes writes again.
        await c.setxattr(f.id, "user.after", b"ok")
        assert await c.getxattr(f.id, "user.after") == b"ok"
        g, _ = await c.create(ROOT_ID, "g")
        assert (await c.lookup(ROOT_ID, "g")).id == g.id
