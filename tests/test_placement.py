"""Placement maths: distinct nodes, distinct failure domains first, weights, exclusions."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metadata import placement
from tectonic_py.core.errors import NoSpace
from tectonic_py.core.records import NodeInfo

node_st = st.builds(
    NodeInfo,
    node_id=st.integers(0, 40).map(lambda i: f"n{i}"),
    address=st.just("127.0.0.1:1"),
    failure_domain=st.integers(0, 6).map(lambda i: f"rack{i}"),
    state=st.sampled_from(["up", "up", "up", "down"]),
    free=st.sampled_from([0, 1, 10**6, 10**9, 10**12]),
    queue_depth=st.integers(0, 100),
)


@settings(max_examples=300, deadline=None)
@given(
    nodes=st.lists(node_st, max_size=30),
    count=st.integers(0, 14),
    slack=st.integers(0, 5),
    exclude=st.lists(st.integers(0, 40).map(lambda i: f"n{i}"), max_size=5),
    seed=st.integers(0, 2**32),
)
def test_place_properties(nodes, count, slack, exclude, seed):
    minimum = max(0, count - slack)
    pool = placement.eligible(nodes, exclude)
    if len(pool) < minimum:
        with pytest.raises(NoSpace):
            placement.place(nodes, count, minimum=minimum, exclude=exclude, rng=random.Random(seed))
        return
    chosen = placement.place(
        nodes, count, minimum=minimum, exclude=exclude, rng=random.Random(seed)
    )
    ids = [n.node_id for n in chosen]
    assert len(ids) == len(set(ids)), "two chunks on one node"
    assert len(chosen) == min(count, len(pool))
    assert len(chosen) >= minimum
    for n in chosen:
        assert n.state == "up" and n.free > 0 and n.node_id not in exclude
    # Failure domains: as many distinct as possible, and reuse only as even as possible.
    domains_available = {n.failure_domain for n in pool}
    used = Counter(n.failure_domain for n in chosen)
    assert len(used) == min(len(chosen), len(domains_available))
    # A domain is used more than once beyond another only when the other has no node left.
    chosen_ids = set(ids)
    for d in domains_available:
        left = [n for n in pool if n.failure_domain == d and n.node_id not in chosen_ids]
        if left and used:
            assert max(used.values()) - used.get(d, 0) <= 1, (d, used)


def test_distinct_domains_when_cluster_has_them():
    nodes = [NodeInfo(f"n{i}", "127.0.0.1:1", f"rack{i % 9}", free=10**9) for i in range(27)]
    for seed in range(50):
        chosen = placement.place(nodes, 9, rng=random.Random(seed))
        assert len({n.failure_domain for n in chosen}) == 9


def test_weighted_by_free_space_and_load():
    nodes = [
        NodeInfo("empty", "h:1", "a", free=10**12),
        NodeInfo("full", "h:2", "b", free=10**9),
        NodeInfo("busy", "h:3", "c", free=10**12, queue_depth=999),
    ]
    rng = random.Random(7)
    first = Counter(placement.place(nodes, 1, rng=rng)[0].node_id for _ in range(2000))
    assert first["empty"] > 10 * first["full"]
    assert first["empty"] > 10 * first["busy"]


def test_too_few_nodes_is_no_space_with_clear_message():
    nodes = [NodeInfo(f"n{i}", "h:1", "a", free=1) for i in range(3)]
    with pytest.raises(NoSpace, match="needs 4 live nodes"):
        placement.place(nodes, 4)
    # Hedges are optional: a short cluster gives fewer, not an error.
    assert len(placement.place(nodes, 5, minimum=3)) == 3


def test_down_and_excluded_nodes_never_chosen():
    nodes = [
        NodeInfo("up1", "h:1", "a", free=5),
        NodeInfo("down", "h:2", "b", free=5, state="down"),
        NodeInfo("gone", "h:3", "c", free=5),
    ]
    for seed in range(20):
        chosen = placement.place(nodes, 1, exclude=["gone"], rng=random.Random(seed))
        assert [n.node_id for n in chosen] == ["up1"]
