"""Metadata ops of checkpoints: a file's durability, and the atomic commit of a step.

``CheckpointOps`` is a mixin of ``MetadataServer`` (as ``MaintenanceOps`` is): its ``op_*``
methods become ops. Each op is one shard's transaction (or read).

==================== ===================================================== ===================
op                   fields (and ``shard``)                                reply
==================== ===================================================== ===================
block.durability     ids                                                   blocks [ChunkState]
==================== ===================================================== ===================

``block.durability`` answers, for each committed block of the list (all of this shard), its
scheme, the chunks it holds and the chunks reported bad: ``tectonic_py.core.durability``'s
``ChunkState``. The client asks each block shard of a file once, with every block of the
file in that shard, and puts the answers together with the node registry's view of which
stores are up (a block shard does not know: the registry lives with one shard).
"""

from __future__ import annotations

import sqlite3
from typing import Any

from tectonic_py.core.durability import ChunkState
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import FileNotFound, InvalidArgument, WrongShard
from tectonic_py.core.ids import MAX_ID, shard_of
from tectonic_py.core.rpc_server import Request

MAX_BLOCKS = 100_000


def chunk_states(conn: sqlite3.Connection, block_ids: list[int]) -> list[ChunkState]:
    """The Block layer's record of each committed block (FileNotFound for one that is not)."""
    out = []
    for bid in block_ids:
        row = conn.execute(
            "SELECT ec FROM blocks WHERE block_id = ? AND state = 'committed'", (bid,)
        ).fetchone()
        if row is None:
            raise FileNotFound(f"no committed block {bid:016x}")
        policy = ECPolicy.parse(row[0])
        placed = conn.execute(
            "SELECT idx, node_id FROM block_chunks WHERE block_id = ? ORDER BY idx", (bid,)
        ).fetchall()
        bad = conn.execute(
            "SELECT idx, node_id FROM bad_chunks WHERE block_id = ? ORDER BY idx", (bid,)
        ).fetchall()
        out.append(
            ChunkState(
                block_id=bid,
                k=policy.k,
                n=policy.n,
                placed=tuple((int(i), str(n)) for i, n in placed),
                bad=tuple((int(i), str(n)) for i, n in bad),
            )
        )
    return out


class CheckpointOps:
    """Mixin of ``MetadataServer`` (which provides ``_store`` and ``total_shards``)."""

    total_shards: int

    def _store(self, req: Request) -> Any:  # provided by MetadataServer
        raise NotImplementedError

    async def op_block__durability(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        ids = req.list("ids", max_len=MAX_BLOCKS)
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 < i <= MAX_ID for i in ids):
            raise InvalidArgument("block.durability: ids must be block ids")
        for bid in ids:
            if shard_of(bid, self.total_shards) != store.shard:
                raise WrongShard(f"block {bid:016x} is not in shard {store.shard}")
        return {"blocks": [s.to_wire() for s in store.read(chunk_states, ids)]}
