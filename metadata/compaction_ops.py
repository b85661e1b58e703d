"""Pack compaction in the metadata service: which packs are mostly dead, and the move of their
live extents into a new pack, one transaction of the shard.

A pack (a block whose ``file_id`` is ``PACK_OWNER``) lives while any file's block entry names
it, so a pack whose files were deleted one by one keeps all its space for its last extent.
The maintenance daemon (tectonic_py/maintenance/compaction.py) finds such packs with
``block.pack_usage``, copies their live extents into a new pack it stores itself, and calls
``file.relocate_extents``. All of a pack's files are in its shard (a pack groups the files of
one shard), so the move is one transaction:

* the new pack's block is committed (``PACK_OWNER``);
* each extent moves only if its file's entry still names the old pack at the same offset and
  length: a file rewritten, truncated or deleted meanwhile keeps what it has now, and the
  copy of its old bytes is just dead space in the new pack;
* the old pack, and the new one if no extent moved, are queued for the GC when no entry names
  them (``file_layer.queue_if_unheld``); a reader that still holds the old block list finds
  the old pack until the GC's grace is over, then re-reads the list.

A pack that holds a patch (file_layer.add_patch) is left as it is: patches leave a pack when
a writer folds them into a new version of their block, or a newer patch covers them.

A repeat after a lost reply commits the same block again (idempotent) and finds no extent left
to move; the op is declared repeatable.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from metadata import block_layer, file_layer
from metadata.shard import now_ns
from tectonic_py.core.errors import InvalidArgument, WrongShard
from tectonic_py.core.ids import shard_of
from tectonic_py.core.records import BlockInfo
from tectonic_py.core.rpc_server import Request


def pack_usage(
    conn: sqlite3.Connection, after: int, limit: int, older_than_ns: int, max_live_permille: int
) -> tuple[list[dict[str, Any]], int]:
    """Committed packs allocated before ``older_than_ns`` whose live extents hold at most
    ``max_live_permille`` of their bytes (and at least one byte: an empty pack is the GC's),
    among the next ``limit`` packs after block id ``after``; and the cursor to go on from
    (0 when the scan is done)."""
    rows = conn.execute(
        "SELECT block_id, data_len, allocated_ns FROM blocks WHERE file_id = ?"
        " AND state = 'committed' AND block_id > ? ORDER BY block_id LIMIT ?",
        (block_layer.PACK_OWNER, after, limit),
    ).fetchall()
    out = []
    for block_id, data_len, allocated_ns in rows:
        if allocated_ns >= older_than_ns:
            continue
        if conn.execute(
            "SELECT 1 FROM file_patches WHERE block_id = ? LIMIT 1", (block_id,)
        ).fetchone():
            continue  # a patch's bytes leave it when the writer folds the patches
        extents = conn.execute(
            "SELECT fb.file_id, fb.idx, fe.offset, fe.length FROM file_blocks fb"
            " JOIN file_extents fe ON fe.file_id = fb.file_id AND fe.idx = fb.idx"
            " WHERE fb.block_id = ? ORDER BY fe.offset",
            (block_id,),
        ).fetchall()
        live = sum(e[3] for e in extents)
        if 0 < live and live * 1000 <= max_live_permille * data_len:
            out.append(
                {
                    "block_id": block_id,
                    "data_len": data_len,
                    "live": live,
                    "extents": [list(e) for e in extents],
                }
            )
    cursor = rows[-1][0] if len(rows) == limit else 0
    return out, cursor


def relocate_extents(
    conn: sqlite3.Connection,
    shard: int,
    total_shards: int,
    info: BlockInfo,
    old_block: int,
    moves: list[tuple[int, int, int, int, int]],
    now: int,
) -> int:
    """Commit the new pack ``info`` and move each ``(file_id, index, old_offset, length,
    new_offset)`` that still names ``old_block`` there; the number moved (module docstring)."""
    if shard_of(info.block_id, total_shards) != shard or shard_of(old_block, total_shards) != shard:
        raise WrongShard(f"file.relocate_extents: the packs are not in shard {shard}")
    if info.block_id == old_block:
        raise InvalidArgument("file.relocate_extents: the new pack is the old one")
    for file_id, _, _, length, new_offset in moves:
        if shard_of(file_id, total_shards) != shard:
            raise WrongShard(f"file {file_id} is not in shard {shard}")
        if length < 1 or new_offset + length > info.data_len:
            raise InvalidArgument(
                f"extent {new_offset}+{length} outside the new pack's {info.data_len} bytes"
            )
    block_layer.commit(conn, info, block_layer.PACK_OWNER)
    moved = 0
    for file_id, index, old_offset, length, new_offset in moves:
        still = conn.execute(
            "SELECT 1 FROM file_blocks fb JOIN file_extents fe"
            " ON fe.file_id = fb.file_id AND fe.idx = fb.idx"
            " WHERE fb.file_id = ? AND fb.idx = ? AND fb.block_id = ?"
            " AND fe.offset = ? AND fe.length = ?",
            (file_id, index, old_block, old_offset, length),
        ).fetchone()
        if still is None:
            continue
        conn.execute(
            "UPDATE file_blocks SET block_id = ? WHERE file_id = ? AND idx = ?",
            (info.block_id, file_id, index),
        )
        conn.execute(
            "UPDATE file_extents SET offset = ? WHERE file_id = ? AND idx = ?",
            (new_offset, file_id, index),
        )
        moved += 1
    file_layer.queue_if_unheld(conn, old_block, now)
    file_layer.queue_if_unheld(conn, info.block_id, now)
    return moved


class CompactionOps:
    """Mixin of ``MetadataServer``: the two ops of pack compaction (module docstring)."""

    total_shards: int

    def _store(self, req: Request) -> Any:  # provided by MetadataServer
        raise NotImplementedError

    async def op_block__pack_usage(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        packs, cursor = store.read(
            pack_usage,
            req["after"],
            req["limit"],
            req["older_than_ns"],
            req["max_live_permille"],
        )
        return {"packs": packs, "next": cursor}

    async def op_file__relocate_extents(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        info = block_layer.info_from_wire(req["block"])
        moved = await store.write(
            relocate_extents,
            store.shard,
            self.total_shards,
            info,
            req["old_block_id"],
            list(req["moves"]),
            now_ns(),
        )
        return {"moved": moved}
