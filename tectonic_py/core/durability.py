"""A file's durability: how many of its chunks are stored, and where, as one word.

What a job asks before it deletes the previous checkpoint step: is the new one fully
redundant yet? The words (the xattr ``user.tectonic.durability`` on the mount, ``tectonic
stat``, the fsspec ``info()`` field ``durability``):

* ``writing``: not sealed and a writer holds the token; more bytes may come.
* ``unsealed``: not sealed and no writer: its writer died before the close, so it may lack
  its tail for good (the seal state of the same name).
* ``quorum``: sealed; every block has at least k+1 chunks stored on live chunk stores (the
  close guarantee: the write quorum), but some block is short of k+m by chunks its writer
  never placed (a store that stalled or failed during the write). Repair places them.
* ``full``: sealed; every block has all k+m chunks on chunk stores that are up, and none is
  reported bad.
* ``degraded``: sealed, and some block lost a chunk since: one on a store that is down, or
  reported corrupt or missing (by a reader, the scrub or the inventory), or it has fewer
  than k+1 live chunks whatever the cause. Repair rebuilds them; the file still reads while
  every block keeps k.

"Live" is the node registry's word: a chunk store whose last heartbeat is within the node
timeout is up. The Block layer records the chunks a block was committed with (the writer
commits the ones that landed, at least the write quorum) and, in ``bad_chunks``, the
indexes it lacks (node "" = never placed) and the chunks reported bad; ``ChunkState`` is
that record of one block, ``classify`` puts it together with the registry's view.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

WRITING = "writing"
UNSEALED = "unsealed"
QUORUM = "quorum"
FULL = "full"
DEGRADED = "degraded"
WORDS = (WRITING, UNSEALED, QUORUM, FULL, DEGRADED)


@dataclass(frozen=True)
class ChunkState:
    """One committed block as the Block layer records it: its scheme, the chunks it was
    committed with or repaired onto (``(index, node_id)``), and the chunks reported bad
    (``(index, node_id)``; node "" = an index never placed)."""

    block_id: int
    k: int
    n: int
    placed: tuple[tuple[int, str], ...]
    bad: tuple[tuple[int, str], ...] = ()

    def to_wire(self) -> list[Any]:
        return [
            self.block_id,
            self.k,
            self.n,
            [list(p) for p in self.placed],
            [list(b) for b in self.bad],
        ]

    @classmethod
    def from_wire(cls, data: Any) -> ChunkState:
        block_id, k, n, placed, bad = data
        return cls(
            block_id=int(block_id),
            k=int(k),
            n=int(n),
            placed=tuple((int(i), str(node)) for i, node in placed),
            bad=tuple((int(i), str(node)) for i, node in bad),
        )


def block_word(state: ChunkState, up: frozenset[str] | set[str]) -> str:
    """``full``, ``quorum`` or ``degraded`` for one block (the module docstring's rules)."""
    bad = {(i, node) for i, node in state.bad if node}
    live = [(i, node) for i, node in state.placed if node in up and (i, node) not in bad]
    if len(live) == state.n:
        return FULL
    lost = len(state.placed) - len(live)
    if lost or len(live) < state.k + 1:
        return DEGRADED
    return QUORUM


def classify(states: Iterable[ChunkState], up: frozenset[str] | set[str]) -> str:
    """A sealed file's word: the worst of its blocks' (``degraded`` > ``quorum`` > ``full``);
    ``full`` for a file without blocks (nothing to lose)."""
    words = {block_word(s, up) for s in states}
    for word in (DEGRADED, QUORUM):
        if word in words:
            return word
    return FULL
