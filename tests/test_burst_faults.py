"""A checkpoint burst's metadata path under contention and faults: creates from many clients
into one directory (one shard takes them all: the record and the name are one transaction
there), and a metadata server killed with SIGKILL in the middle of a burst, whose ranks must
see retries, never errors, and whose every closed file must read back intact."""

from __future__ import annotations

import hashlib
import logging
import random

import trio

from tectonic_py.client.tectonic_client import open_client
from tectonic_py.core.errors import FileExists, TectonicError
from tectonic_py.core.ids import shard_of

CLIENTS = 4


def _data(n: int, seed: int) -> bytes:
    block = hashlib.sha256(f"burst-{seed}".encode()).digest() * 1024
    return (block * (-(-n // len(block))))[:n]


async def test_creates_into_one_directory_from_many_clients(local_cluster):
    """Four clients, 64 tasks each, create into one directory: every distinct name is there
    once with its own id, and of two exclusive creates of one name exactly one wins."""
    names = [f"rank_{i:04d}" for i in range(256)]
    contested = [f"shared_{i:02d}" for i in range(32)]
    won: dict[str, list[int]] = {n: [] for n in contested}
    made: dict[str, int] = {}
    async with open_client(local_cluster.cluster_file) as first:
        await first.mkdir("/step")
        async with (
            open_client(local_cluster.cluster_file) as c1,
            open_client(local_cluster.cluster_file) as c2,
            open_client(local_cluster.cluster_file) as c3,
        ):
            clients = [first, c1, c2, c3]

            async def create(i: int, name: str) -> None:
                w = await clients[i % CLIENTS].create(f"/step/{name}")
                made[name] = (await w.close()).id

            async def contend(i: int, name: str) -> None:
                try:
                    w = await clients[i % CLIENTS].create(f"/step/{name}", exclusive=True)
                except FileExists:
                    return
                won[name].append((await w.close()).id)

            async with trio.open_nursery() as nursery:
                for i, name in enumerate(names):
                    nursery.start_soon(create, i, name)
                for i, name in enumerate(contested * 2):
                    nursery.start_soon(contend, i, name)
        listing = {e.name: e.id for e in await first.listdir("/step")}
    assert sorted(listing) == sorted(names + contested)
    assert all(listing[n] == made[n] for n in names)
    assert all(len(ids) == 1 and listing[n] == ids[0] for n, ids in won.items())
    assert len(set(listing.values())) == len(listing)


async def test_metadata_server_killed_mid_burst(local_cluster, caplog):
    """128 ranks over four clients write three files each into one directory; the metadata
    server holding that directory's shard is killed with SIGKILL once a fifth of the files
    are closed and started again a second later. No rank sees an error (the clients wait
    out the restart and repeat what is safe to repeat), and every closed file reads back
    byte for byte after the restart."""
    caplog.set_level(logging.CRITICAL, logger="tectonic_py.client")
    ranks, files = 128, 3
    rng = random.Random(7)
    sizes = {(r, j): rng.randrange(1, 200_000) for r in range(ranks) for j in range(files)}
    closed: dict[str, tuple[int, int]] = {}
    errors: list[str] = []
    some_closed, restarted = trio.Event(), trio.Event()
    in_flight: list[int] = []  # files not yet closed when the server was killed
    async with open_client(local_cluster.cluster_file) as c0:
        step = await c0.mkdir("/ckpt")
        victim = next(
            i for i in range(2) if shard_of(step.id, c0.config.shards) in local_cluster.shards_of(i)
        )
        async with (
            open_client(local_cluster.cluster_file) as c1,
            open_client(local_cluster.cluster_file) as c2,
            open_client(local_cluster.cluster_file) as c3,
        ):
            clients = [c0, c1, c2, c3]

            async def rank(r: int) -> None:
                client = clients[r % CLIENTS]
                for j in range(files):
                    path = f"/ckpt/rank_{r:03d}_{j}"
                    try:
                        w = await client.create(path)
                        await w.write(_data(sizes[r, j], r * files + j))
                        await w.close()
                    except TectonicError as e:  # collected: every one fails the test
                        errors.append(f"{path}: {type(e).__name__}: {e}")
                        return
                    closed[path] = (r, j)
                    if len(closed) >= ranks * files // 5:
                        some_closed.set()

            async def kill_and_restart() -> None:
                await some_closed.wait()
                local_cluster.kill_metadata(victim)
                in_flight.append(ranks * files - len(closed))
                await trio.sleep(1.0)
                await trio.to_thread.run_sync(local_cluster.start_metadata, victim)
                restarted.set()

            with trio.fail_after(120):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(kill_and_restart)
                    for r in range(ranks):
                        nursery.start_soon(rank, r)
            assert restarted.is_set() and in_flight[0] > 0
        assert errors == []
        assert len(closed) == ranks * files
        listing = {e.name for e in await c0.listdir("/ckpt")}
        assert listing == {p.rsplit("/", 1)[1] for p in closed}
    async with open_client(local_cluster.cluster_file) as fresh:
        for path, (r, j) in closed.items():
            reader = await fresh.open_read(path)
            assert bytes(await reader.read()) == _data(sizes[r, j], r * files + j), path
