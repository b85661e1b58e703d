"""Traffic classes (chunkstore/traffic.py): the deficit round robin's shares, its handing of
an idle class's share to the others and its bound on waits, by hypothesis; the trio
admission in front of the disk; and two jobs' puts through a real chunk store, served in
weight order under backlog (counted, never timed)."""

from __future__ import annotations

import itertools
import math

import pytest
import trio
from chunkstore_helpers import new_chunk, payload, start_store
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkstore import writes
from chunkstore.client import ChunkClient
from chunkstore.traffic import (
    BACKGROUND,
    DEFAULT,
    MAX_JOBS,
    Drr,
    FairAdmission,
    TrafficPolicy,
    parse_weights,
)
from tectonic_py.core import auth, rpc_client
from tectonic_py.core.checksum import checksum
from tectonic_py.core.errors import ConfigError

Q = 1000  # a small quantum keeps the examples' numbers readable

weights_st = st.lists(st.integers(1, 10), min_size=2, max_size=5)
costs_st = st.lists(st.integers(1, 4 * Q), min_size=1, max_size=6)


def _backlogged(weights: list[int], costs: list[list[int]], pops: int):
    """Every class always has work (its costs cycled, three requests queued); yields the
    bytes served per class after each pop."""
    drr = Drr(Q)
    feeds = [itertools.cycle(c) for c in costs]
    pending: list[list[int]] = [[] for _ in weights]
    for i, w in enumerate(weights):
        for _ in range(3):
            pending[i].append(next(feeds[i]))
            drr.push(str(i), w, i, pending[i][-1])
    served = [0] * len(weights)
    for _ in range(pops):
        i = drr.pop()
        assert i is not None, "a backlogged scheduler never idles"
        served[i] += pending[i].pop(0)
        pending[i].append(next(feeds[i]))
        drr.push(str(i), weights[i], i, pending[i][-1])
        yield list(served)


@settings(max_examples=60, deadline=None)
@given(weights_st, st.data())
def test_backlogged_shares_follow_weights(weights, data):
    """Under backlog, bytes served per unit of weight never drift apart by more than one
    round's quantum plus the largest request (DRR's bound), so shares converge to the
    weights."""
    costs = [data.draw(costs_st) for _ in weights]
    bound = Q + max(max(c) for c in costs)
    served = None
    for served in _backlogged(weights, costs, 400):
        norm = [s / w for s, w in zip(served, weights)]
        assert max(norm) - min(norm) < bound, (served, weights)
    assert served is not None
    total = sum(served)
    for s, w in zip(served, weights):
        share = w / sum(weights)
        assert abs(s / total - share) <= len(weights) * bound * w / total + 1e-9


@settings(max_examples=60, deadline=None)
@given(weights_st, st.data())
def test_an_idle_class_share_goes_to_the_others(weights, data):
    """Classes with nothing queued take no turn: the scheduler serves whatever waits, in
    each class's order, until nothing is left (work-conserving), and the busy classes
    share the store by their own weights."""
    items = [data.draw(st.lists(st.integers(1, 3 * Q), max_size=12)) for _ in weights]
    drr = Drr(Q)
    for i, (w, costs) in enumerate(zip(weights, items)):
        for n, c in enumerate(costs):
            drr.push(str(i), w, (i, n), c)
    order = []
    while (item := drr.pop()) is not None:
        order.append(item)
    assert len(order) == sum(len(c) for c in items) and len(drr) == 0
    for i, costs in enumerate(items):
        assert [n for j, n in order if j == i] == list(range(len(costs)))
    # Only two classes busy, the rest idle: the two split by their weights alone.
    drr = Drr(Q)
    busy = [0, 1]
    for i in busy:
        for n in range(200):
            drr.push(str(i), weights[i], i, Q)
    got = [0, 0]
    for _ in range(100):
        got[drr.pop()] += 1
    expect = 100 * weights[0] / (weights[0] + weights[1])
    assert abs(got[0] - expect) <= weights[0] + weights[1]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 100), min_size=1, max_size=4), st.integers(1, 4 * Q), st.data())
def test_no_class_starves(heavy, victim_cost, data):
    """A weight-1 class among classes of weight up to 100 is served within a bound of
    grants set by the weights and costs, whatever comes after."""
    chunky = st.lists(st.integers(Q // 4, 4 * Q), min_size=1, max_size=6)
    costs = [data.draw(chunky) for _ in heavy]
    max_cost = max(max(max(c) for c in costs), victim_cost)
    min_cost = min(min(min(c) for c in costs), victim_cost)
    rounds = math.ceil(max_cost / Q)
    bound = rounds * sum((Q * w + max_cost) // min_cost + 1 for w in heavy)
    drr = Drr(Q)
    feeds = [itertools.cycle(c) for c in costs]
    for i, w in enumerate(heavy):
        for _ in range(2):
            drr.push(f"h{i}", w, i, next(feeds[i]))
    drr.push("victim", 1, "victim", victim_cost)
    drr.push("victim", 1, "victim", victim_cost)
    since = 0
    served = 0
    while served < 2:
        item = drr.pop()
        if item == "victim":
            served += 1
            since = 0
            continue
        since += 1
        assert since <= bound, "the light class waited past DRR's bound"
        drr.push(f"h{item}", heavy[item], item, next(feeds[item]))


def test_removed_waiter_leaves_no_trace():
    drr = Drr(Q)
    drr.push("a", 1, "x", Q)
    drr.push("b", 1, "y", Q)
    assert drr.remove("a", "x") and not drr.remove("a", "x")
    assert drr.pop() == "y" and drr.pop() is None and len(drr) == 0


def test_policy_classes():
    policy = TrafficPolicy(parse_weights(["a=1", "b=3", "background=2"]))
    assert policy.classify(auth.ROLE_MAINTENANCE, "b", 0) == (BACKGROUND, 2)
    assert policy.classify(auth.ROLE_CLIENT, "", 0) == (DEFAULT, 1)
    assert policy.classify(auth.ROLE_CLIENT, "background", 9) == (DEFAULT, 1)
    assert policy.classify(auth.ROLE_CLIENT, "b", 7) == ("b", 3)  # the store's weight wins
    assert policy.classify(auth.ROLE_CLIENT, "new", 7) == ("new", 7)
    for n in range(MAX_JOBS + 5):
        policy.classify(auth.ROLE_CLIENT, f"j{n}", 1)
    assert len(policy.classes()) <= MAX_JOBS + 4  # label values stay bounded
    for bad in (["a"], ["a=0"], ["a=x"], ["a b=1"], ["a=1001"]):
        with pytest.raises(ConfigError):
            parse_weights(bad)


async def test_admission_waits_in_fair_order_and_forgets_the_cancelled():
    """One slot, taken; a waiter cancelled leaves the queue; the rest are admitted in DRR
    order when the slot frees (a weight 1, b weight 3)."""
    adm = FairAdmission(1, quantum=Q)
    order: list[str] = []
    release = trio.Event()
    scopes: list[trio.CancelScope] = []

    async def hold() -> None:
        async with adm.slot("x", 1, Q):
            await release.wait()

    async def one(cls: str, weight: int, tag: str) -> None:
        with trio.CancelScope() as scope:
            scopes.append(scope)
            async with adm.slot(cls, weight, Q):
                order.append(tag)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(one, "c", 1, "cancelled")
        await trio.testing.wait_all_tasks_blocked()
        for n in range(4):
            nursery.start_soon(one, "a", 1, f"a{n}")
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(one, "b", 3, f"b{n}")
            await trio.testing.wait_all_tasks_blocked()
        assert adm.waiting == 9 and adm.stats["c"].queued == 1
        scopes[0].cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert adm.waiting == 8 and adm.stats["c"].queued == 0
        release.set()
    assert order == ["a0", "b0", "b1", "b2", "a1", "b3", "a2", "a3"]
    assert adm.waiting == 0 and adm.busy == 0


# --- a real chunk store: two jobs' puts under backlog ----------------------------------------


async def test_two_jobs_puts_are_served_by_weight(tmp_path, secret, monkeypatch):
    """Jobs a (weight 1) and b (weight 3) each queue 12 puts of 1 MiB behind a store whose
    disk slots are taken; once freed, the store writes them a:b = 1:3 while both wait."""
    served: list[str] = []
    real = writes.write_chunk

    def recorded(data_dir, chunk_id, *args):
        served.append(jobs_of[chunk_id])
        return real(data_dir, chunk_id, *args)

    monkeypatch.setattr(writes, "write_chunk", recorded)
    jobs_of: dict[str, str] = {}
    size = 1024 * 1024
    data = payload(size)
    crc = checksum(data)
    async with trio.open_nursery() as nursery:
        server, port = await start_store(
            nursery, tmp_path / "store", secret, max_concurrent_writes=1, jobs={"a": 1, "b": 3}
        )
        queue = server.write_queue
        release = trio.Event()

        async def block() -> None:
            async with queue.slot(BACKGROUND, 1, 0):
                await release.wait()

        for _ in range(queue.slots):
            nursery.start_soon(block)
        await trio.testing.wait_all_tasks_blocked()
        key = auth.role_key(secret, auth.ROLE_CLIENT)
        async with trio.open_nursery() as puts:
            for job in ("a", "b"):
                cred = auth.Credential(auth.ROLE_CLIENT, key, job)
                conn = await rpc_client.Connection.connect("127.0.0.1", port, cred, nursery=nursery)
                client = ChunkClient(conn)
                for _ in range(12):
                    chunk_id, cap = new_chunk(secret)
                    jobs_of[chunk_id] = job
                    puts.start_soon(client.put, chunk_id, data, cap, crc)
            while queue.waiting < 24:
                await trio.sleep(0.01)
            release.set()
        stats = server.traffic_stats()
        nursery.cancel_scope.cancel()
    assert len(served) == 24
    assert stats["put"]["a"].served == stats["put"]["b"].served == 12
    # While both jobs wait (until b's last put), every prefix of the disk's order holds
    # b = 3 a within one round (the two slots that were free when the queue opened aside).
    last_b = max(i for i, j in enumerate(served) if j == "b")
    for n in range(1, last_b + 2):
        a, b = served[:n].count("a"), served[:n].count("b")
        assert abs(3 * a - b) <= 4, served
    assert served[: last_b + 1].count("a") <= 5, served


def test_the_job_comes_from_the_cluster_file_and_is_checked(tmp_path, secret_file):
    """``job``/``job_weight`` of a cluster file reach the credential a client connects
    with; a bad job is one clear error, as is a loadtest --weight without --job."""
    from tectonic_py.core import cluster_file
    from tectonic_py.core.cluster_file import ClusterConfig, MetadataServer
    from tectonic_py.loadtest import LoadtestConfig

    config = ClusterConfig(
        name="t",
        secret_file=secret_file,
        shards=1,
        metadata_servers=[MetadataServer("127.0.0.1:1", [0])],
        role=auth.ROLE_CLIENT,
        job="train-a",
        job_weight=3,
    )
    config.write(tmp_path / "client.toml")
    loaded = cluster_file.load(tmp_path / "client.toml")
    cred = loaded.credential()
    assert (cred.role, cred.job, cred.weight) == (auth.ROLE_CLIENT, "train-a", 3)
    assert loaded.with_job("b", 0).credential().job == "b"
    for job, weight in (("a b", 0), ("x" * 65, 0), ("", 3), ("a", 1001)):
        with pytest.raises(ConfigError):
            auth.Credential(auth.ROLE_CLIENT, b"k" * 16, job, weight)
    cfg = LoadtestConfig(cluster_file=str(tmp_path / "client.toml"), run_dir="/r", job_weight=2)
    with pytest.raises(ConfigError, match="--weight needs --job"):
        cfg.validate()


async def test_paced_admission_waits_in_the_queue_not_in_a_slot(autojump_clock):
    """With a rate, requests are admitted one cost/rate apart, in DRR order, and none holds
    a slot while it waits for its time (the pacer admits them; a virtual clock)."""
    adm = FairAdmission(4, quantum=Q, rate=Q)  # one request of cost Q per second
    order: list[tuple[str, float]] = []

    async def one(cls: str, weight: int) -> None:
        async with adm.slot(cls, weight, Q):
            order.append((cls, trio.current_time()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(adm.pace)
        async with trio.open_nursery() as jobs:
            jobs.start_soon(one, "x", 1)
            await trio.testing.wait_all_tasks_blocked()
            for _ in range(3):
                for cls, weight in (("a", 1), ("b", 3)):
                    jobs.start_soon(one, cls, weight)
                    await trio.testing.wait_all_tasks_blocked()
            assert adm.busy == 0 and adm.waiting == 6  # x went at once and is done
        nursery.cancel_scope.cancel()
    assert order == [(c, float(t)) for t, c in enumerate("xabbbaa")]
