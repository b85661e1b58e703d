"""Placement: which chunk stores receive the chunks of a new block.

Pure maths over the registry's view of the nodes, so it can be property-tested. The rules,
in order of importance:

1. Only live nodes that are not excluded and have free space are eligible.
2. Never two chunks of a block on one node.
3. Distinct failure domains first: a block's k+m chunks go to k+m different domains when the
   cluster has that many, so losing a rack loses at most one chunk of a block. When there are
   fewer domains than chunks, the remaining picks reuse domains (still distinct nodes), spread
   as evenly as possible.
4. Among eligible nodes, pick at random weighted by free space and divided by reported load
   (queue depth), so empty, idle disks fill first but no node is starved or flooded: a
   deterministic "emptiest first" would send a whole burst of checkpoint writers to one node.

Hedge nodes (the extra ones a writer reserves to absorb a slow node) are simply further picks
by the same rules; the caller asks for ``count`` and the ``minimum`` it cannot do without.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Sequence

from tectonic_py.core.errors import NoSpace
from tectonic_py.core.records import NodeInfo

log = logging.getLogger(__name__)


def weight(node: NodeInfo) -> float:
    """Relative chance of a node being picked: free bytes, damped by its queue depth."""
    return max(node.free, 0) / (1.0 + max(node.queue_depth, 0))


def eligible(nodes: Iterable[NodeInfo], exclude: Iterable[str] = ()) -> list[NodeInfo]:
    banned = set(exclude)
    seen: set[str] = set()
    out = []
    for n in nodes:
        if n.state == "up" and n.node_id not in banned and n.node_id not in seen and n.free > 0:
            seen.add(n.node_id)
            out.append(n)
    return out


def _weighted_pick(rng: random.Random, candidates: Sequence[NodeInfo]) -> NodeInfo:
    total = sum(weight(n) for n in candidates)
    if total <= 0:
        return rng.choice(list(candidates))
    x = rng.random() * total
    for n in candidates:
        x -= weight(n)
        if x < 0:
            return n
    return candidates[-1]


def place(
    nodes: Iterable[NodeInfo],
    count: int,
    *,
    minimum: int | None = None,
    exclude: Iterable[str] = (),
    rng: random.Random | None = None,
) -> list[NodeInfo]:
    """Pick up to ``count`` distinct nodes following the rules above.

    Raises NoSpace when fewer than ``minimum`` (default ``count``) nodes are eligible; with
    ``minimum < count`` a short cluster yields a shorter list (fewer hedges), never an error.
    """
    if count < 0:
        raise ValueError("count must be >= 0")
    need = count if minimum is None else minimum
    rng = rng or random.Random()
    pool = eligible(nodes, exclude)
    if len(pool) < need:
        raise NoSpace(
            f"placement needs {need} live nodes with free space, the cluster has {len(pool)}"
        )
    chosen: list[NodeInfo] = []
    used_domain_count: dict[str, int] = {}
    remaining = list(pool)
    while remaining and len(chosen) < count:
        # Only nodes in the least-used failure domains compete for the next pick.
        least = min(used_domain_count.get(n.failure_domain, 0) for n in remaining)
        candidates = [n for n in remaining if used_domain_count.get(n.failure_domain, 0) == least]
        pick = _weighted_pick(rng, candidates)
        chosen.append(pick)
        remaining.remove(pick)
        used_domain_count[pick.failure_domain] = used_domain_count.get(pick.failure_domain, 0) + 1
    return chosen
