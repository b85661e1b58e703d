"""The ``batch`` op and the client's coalescing of concurrent calls into it: every item gets
its own result or its own error, a malformed batch is refused whole, and a client's
concurrent calls to one server leave in batches whose mutations share transactions."""

from __future__ import annotations

import os
import signal

import pytest
import trio
from metadata_fixtures import open_meta_cluster
from test_metadata_crash import SHARDS, list_all, spawn, stop, wait_ready

from metadata.client import MetadataClient
from tectonic_py.core import rpc_client, sockets
from tectonic_py.core.aio import open_service_nursery
from tectonic_py.core.cluster_file import ClusterConfig, MetadataServer
from tectonic_py.core.errors import FileExists, FileNotFound, InvalidArgument, TectonicError
from tectonic_py.core.ids import ROOT_ID, shard_of


@pytest.fixture
async def mc(tmp_path, secret_file, meta_engine):
    async with open_meta_cluster(tmp_path, secret_file, etcd=meta_engine) as cluster:
        yield cluster


async def _host(mc, shard):
    """The server serving ``shard`` now (under etcd, whichever claimed it)."""
    for _ in range(400):
        for server in mc.servers:
            if shard in server.stores:
                return server
        await trio.sleep(0.05)
    raise AssertionError(f"no server serves shard {shard}")


async def test_batch_items_fail_alone(mc):
    """A name taken, a name missing, a shard not hosted: each item's own error, raised by
    the client from its code as a lone request's would be; the other items go through."""
    d = await mc.client.mkdir(ROOT_ID, "d")
    shard = shard_of(d.id, mc.config.shards)
    server = await _host(mc, shard)
    other = next(s for s in range(mc.config.shards) if s not in server.stores)
    host, port = sockets.parse_address(server.address)

    def create(name):
        return ["name.create", {"shard": shard, "dir": d.id, "name": name}]

    async with rpc_client.open_connection(host, port, mc.config.credential()) as conn:
        r = await conn.call(
            "batch",
            {
                "ops": [
                    create("a"),
                    create("a"),
                    ["name.lookup", {"shard": shard, "dir": d.id, "name": "missing"}],
                    ["file.get", {"shard": other, "id": d.id}],
                    ["file.get", {"shard": shard, "id": "x"}],
                    create("b"),
                ]
            },
        )
        results = r.fields["results"]
        assert len(results) == 6
        # (the two creates of "a" run at once: either may be the one that wins)
        assert sorted(str(res.get("err")) for res in results[:2]) == ["None", "eexist"]
        assert [res.get("err") for res in results[2:5]] == ["enoent", "wrong_shard", "invalid"]
        assert all(res["f"]["token"] for res in results if "f" in res)
        assert "f" in results[5]
        # Refused whole: not a list of pairs, an op that cannot be batched, too many ops.
        for bad in (
            {"ops": "x"},
            {"ops": [["name.lookup"]]},
            {"ops": [["batch", {"ops": []}]]},
            {"ops": [["server.backup", {"dest": "/tmp/x"}]]},
            {"ops": [["no.such_op", {}]]},
            {"ops": [create(f"n{i}") for i in range(513)]},
        ):
            with pytest.raises(InvalidArgument):
                await conn.call("batch", bad)
        # the connection keeps serving after the refusals
        r = await conn.call("batch", {"ops": []})
        assert r.fields["results"] == []
    entries, _ = await mc.client.readdir(d.id)
    assert [e.name for e in entries] == ["a", "b"]


async def test_client_coalesces_and_each_call_keeps_its_error(mc):
    """300 concurrent creates from one client: they leave in batches, their mutations share
    the directory shard's transactions, and the creates of names already taken (exclusive)
    fail alone with FileExists while every other name is made once."""
    c = mc.client
    d = await c.mkdir(ROOT_ID, "burst")
    taken = {f"rank_{i:03d}" for i in range(0, 300, 10)}
    for name in sorted(taken):
        await c.create(d.id, name)
    shard = shard_of(d.id, mc.config.shards)
    hosting = (await _host(mc, shard)).stores.get(shard)
    store_stats = hosting.stats if hosting is not None else None
    before = c.batch_stats()
    batches0 = store_stats.batches if store_stats else 0
    refused: list[str] = []
    made: dict[str, int] = {}

    async def one(i):
        name = f"rank_{i:03d}"
        try:
            attrs, _ = await c.create(d.id, name)
        except FileExists:
            refused.append(name)
            return
        made[name] = attrs.id

    async with trio.open_nursery() as n:
        for i in range(300):
            n.start_soon(one, i)
    assert sorted(refused) == sorted(taken)
    assert len(made) == 270 and len(set(made.values())) == 270
    after = c.batch_stats()
    batches, ops = after["batches"] - before["batches"], after["ops"] - before["ops"]
    assert batches > 0 and ops / batches > 4, (batches, ops)
    if store_stats is not None:  # (the sqlite engine: the shard's own counters)
        assert store_stats.batches - batches0 < 300 / 4
    entries, _ = await c.readdir(d.id, limit=1000)
    assert len(entries) == 300 and len({e.name for e in entries}) == 300
    for name, file_id in made.items():
        assert (await c.lookup(d.id, name)).id == file_id


async def test_cancelled_call_leaves_the_queue(mc):
    """A call cancelled while it waits in a server's queue is never sent; the calls beside
    it are answered."""
    c = mc.client
    d = await c.mkdir(ROOT_ID, "q")
    results: dict[int, str] = {}

    async def lookup(i, cancel_after):
        with trio.move_on_after(cancel_after):
            try:
                await c.lookup(d.id, f"none_{i}")
            except FileNotFound:
                results[i] = "enoent"
                return
        results.setdefault(i, "cancelled")

    async with trio.open_nursery() as n:
        for i in range(100):
            n.start_soon(lookup, i, 0 if i % 2 else 30)
    assert all(results[i] == "enoent" for i in range(0, 100, 2))
    assert len(results) == 100
    f, _ = await c.create(d.id, "after")
    assert (await c.lookup(d.id, "after")).id == f.id


@pytest.mark.slow
async def test_server_killed_mid_batch_ranks_retry_and_lose_nothing(tmp_path, secret_file):
    """128 ranks of one client create and close files in one directory, their calls
    coalesced; the server is killed with SIGKILL while batches are in flight and started
    again on its address a second later. No rank sees an error (a batch lost with the
    connection is a lost request for each of its calls, repeated where that is safe), and
    every name is there once, sealed with its rank's size."""
    data, ready = tmp_path / "meta", tmp_path / "ready.json"
    proc = spawn(data, secret_file, ready, "127.0.0.1:0")
    try:
        address = await wait_ready(proc, ready)
        config = ClusterConfig(
            "batch", secret_file, SHARDS, [MetadataServer(address, list(range(SHARDS)))]
        )
        async with open_service_nursery() as nursery:
            client = MetadataClient(config, nursery=nursery, reconnect_deadline=30.0)
            d = await client.mkdir(ROOT_ID, "step")
            closed: dict[str, int] = {}
            errors: list[str] = []
            some = trio.Event()
            ranks, files = 128, 4

            async def rank(r: int) -> None:
                for j in range(files):
                    name = f"rank_{r:03d}_{j}"
                    try:
                        f, token = await client.create(d.id, name, exclusive=False)
                        await client.close(f.id, token, r * 10 + j, [])
                    except TectonicError as e:
                        errors.append(f"{name}: {type(e).__name__}: {e}")
                        return
                    closed[name] = f.id
                    if len(closed) >= 100:
                        some.set()

            async def kill_and_restart() -> None:
                nonlocal proc
                await some.wait()
                os.kill(proc.pid, signal.SIGKILL)
                await trio.to_thread.run_sync(proc.wait)
                await trio.sleep(1.0)
                proc = spawn(data, secret_file, ready, address)
                await wait_ready(proc, ready)

            with trio.fail_after(120):
                async with trio.open_nursery() as n:
                    n.start_soon(kill_and_restart)
                    for r in range(ranks):
                        n.start_soon(rank, r)
            assert errors == []
            assert client.batch_stats()["batches"] > 0
            listed = await list_all(client, d.id)
            assert sorted(listed) == sorted(closed) and len(listed) == ranks * files
            for name, fid in listed.items():
                r, j = (int(x) for x in name.removeprefix("rank_").split("_"))
                attrs = await client.getattr(fid)
                assert attrs.sealed and attrs.size == r * 10 + j, name
            await client.aclose()
    finally:
        stop(proc)
