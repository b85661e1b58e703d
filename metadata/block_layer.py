"""Block layer: ``block_id -> (ec, chunk_len, data_len, [(index, node_id, checksum)])`` and the
reverse index ``(node_id, block_id) -> index``, sharded by block_id.

Pure functions over a shard's ``sqlite3.Connection``.

Lifecycle: ``allocate`` records a block as ``allocated`` (its file, the granted nodes and the
time), so the GC service can find chunks of writes that were aborted before commit;
``commit`` turns it ``committed`` with its chunk placements and reverse-index rows in the
same transaction. A committed block is immutable except for ``replace_chunk`` (repair and
rebalance move one chunk to another node), which keeps the reverse index in step.

A committed block may *adopt* chunks of an earlier version of itself (``ChunkPlacement.
stored_as``, table ``chunk_origins``): an in-place write of a few bytes rewrites only the
data chunks it touched and the parity, and the new version's other chunks are the old
version's files, on the same nodes under the old block id. Both versions belong to one file,
so they share its shard, and every question "does a block need this chunk file here?"
(``holders``, behind ``dead_chunks`` and so behind every delete capability) is answered in one
transaction: a chunk file lives while any committed version places it, whichever version
wrote it, and goes with the last of them.

``bad_chunks`` is the one record of chunks a committed block lacks while its node is up, so
that ``tectonic status`` and repair see the same thing and a restart of a chunk store hides
nothing: a reader that found a chunk corrupt or missing (``report_bad_chunk``), the scrub's
reports (recorded by repair), the inventory's missing or mismatched chunks, and the indexes a
writer committed without a chunk (``commit``, node_id "": the write quorum is below n). Repair
rebuilds each. A row goes when its chunk moves (``repoint_chunk``) or the block is forgotten.

A *pack* is a block shared by many small files (and tails of large files) of one shard,
written together by one client: each holds an extent of it (``file_extents``), and the
block's ``file_id`` is ``PACK_OWNER``. It is committed with its files' extents in one
transaction (``write_ops.commit_pack``) and queued for the GC when its last extent goes.

commit_blocks ordering (client side): Block layer first, File layer append second. A crash
between the two leaves a committed block no file references: garbage the GC finds by
checking ``file_id``/``file_index`` against the File layer after a grace period; never a file
pointing at a block that is not committed.
"""

from __future__ import annotations

import dataclasses
import sqlite3
import time
from typing import Any

import msgpack

from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import FileNotFound, InvalidArgument, TectonicError
from tectonic_py.core.ids import MAX_CHUNK_INDEX, NODE_ID_RE, new_id, shard_of
from tectonic_py.core.records import BlockInfo, ChunkPlacement

MAX_CHUNK_LEN = 256 * 1024 * 1024
# The ``file_id`` of a pack block: one block whose extents belong to many files of its shard
# (file_layer's ``file_extents``), so no one file owns it; it lives while any extent does.
PACK_OWNER = 0


def draw_block_id(conn: sqlite3.Connection, shard: int, total_shards: int) -> int:
    for _ in range(200 * total_shards + 1000):
        candidate = new_id()
        if shard_of(candidate, total_shards) != shard:
            continue
        if conn.execute("SELECT 1 FROM blocks WHERE block_id = ?", (candidate,)).fetchone() is None:
            return candidate
    raise TectonicError(f"could not draw a free block id in shard {shard}")


def allocate(
    conn: sqlite3.Connection,
    shard: int,
    total_shards: int,
    file_id: int,
    ec: str,
    nodes: list[str],
    now_ns: int,
) -> int:
    policy = ECPolicy.parse(ec)
    block_id = draw_block_id(conn, shard, total_shards)
    conn.execute(
        "INSERT INTO blocks (block_id, state, ec, chunk_len, data_len, file_id, file_index, nodes,"
        " allocated_ns) VALUES (?, 'allocated', ?, 0, 0, ?, -1, ?, ?)",
        (block_id, policy.name, file_id, msgpack.packb(nodes), now_ns),
    )
    return block_id


def grant_more(conn: sqlite3.Connection, block_id: int, nodes: list[str]) -> list[str]:
    """Add nodes to an allocated block's grant; returns the whole grant (for the capability)."""
    row = conn.execute("SELECT state, nodes FROM blocks WHERE block_id = ?", (block_id,)).fetchone()
    if row is None:
        raise FileNotFound(f"no block {block_id:016x}")
    if row[0] != "allocated":
        raise InvalidArgument(f"block {block_id:016x} is already committed")
    granted = list(msgpack.unpackb(row[1]))
    granted += [n for n in nodes if n not in granted]
    conn.execute(
        "UPDATE blocks SET nodes = ? WHERE block_id = ?", (msgpack.packb(granted), block_id)
    )
    return granted


def validate_info(info: BlockInfo) -> None:
    policy = ECPolicy.parse(info.ec)
    if not 0 <= info.chunk_len <= MAX_CHUNK_LEN:
        raise InvalidArgument(f"chunk_len {info.chunk_len} out of range")
    if not 0 <= info.data_len <= policy.k * info.chunk_len:
        raise InvalidArgument(f"data_len {info.data_len} exceeds k*chunk_len")
    if info.file_index < 0:
        raise InvalidArgument("file_index must be >= 0")
    seen = set()
    for c in info.chunks:
        if not 0 <= c.index < min(policy.n, MAX_CHUNK_INDEX + 1) or c.index in seen:
            raise InvalidArgument(f"chunk index {c.index} invalid or repeated for {info.ec}")
        if not isinstance(c.node_id, str) or not NODE_ID_RE.match(c.node_id):
            raise InvalidArgument(f"invalid node id {c.node_id!r}")
        if not isinstance(c.checksum, int) or not 0 <= c.checksum < 2**32:
            raise InvalidArgument("chunk checksum must be a 32-bit unsigned integer")
        seen.add(c.index)
    if len(seen) < policy.k:
        raise InvalidArgument(f"a block needs at least k={policy.k} chunks, got {len(seen)}")


def holders(
    conn: sqlite3.Connection, storage_block: int, index: int, node_id: str | None = None
) -> list[tuple[int, str, int, int, int]]:
    """The committed blocks that place chunk file ``storage_block.index`` on ``node_id``
    (None: on any node), as (block_id, node_id, checksum, file_id, chunk_len): the block
    itself (when it did not adopt that chunk from another) and the versions that adopted it."""
    on_node = "" if node_id is None else " AND c.node_id = ?"
    args = (storage_block, index) if node_id is None else (storage_block, index, node_id)
    own = (
        "SELECT c.block_id, c.node_id, c.checksum, b.file_id, b.chunk_len FROM block_chunks c"
        " JOIN blocks b ON b.block_id = c.block_id WHERE c.block_id = ? AND c.idx = ?"
        " AND b.state = 'committed' AND NOT EXISTS (SELECT 1 FROM"
        " chunk_origins o WHERE o.block_id = c.block_id AND o.idx = c.idx)"
    )
    adopters = (
        "SELECT o.block_id, c.node_id, c.checksum, b.file_id, b.chunk_len FROM chunk_origins o"
        " JOIN block_chunks c ON c.block_id = o.block_id AND c.idx = o.idx"
        " JOIN blocks b ON b.block_id = o.block_id WHERE o.stored_as = ? AND o.idx = ?"
        " AND b.state = 'committed'"
    )
    return [
        (r[0], r[1], r[2], r[3], r[4])
        for query in (own, adopters)
        for r in conn.execute(query + on_node, args)
    ]


def _resolve_adopted(conn: sqlite3.Connection, info: BlockInfo, file_id: int) -> BlockInfo:
    """The record with each adopted chunk checked: one a committed block of the same file
    places on that node, with that checksum and chunk length (a writer can adopt only what
    its file holds). A chunk file that repair or rebalance moved since the writer located
    it (a block of the file places that file elsewhere now) is taken where it is: the Block
    layer, not the writer's copy of the record, knows where chunks are. Anything else is
    refused."""
    chunks = []
    for c in info.chunks:
        if not c.stored_as:
            chunks.append(c)
            continue
        if c.stored_as == info.block_id:
            raise InvalidArgument(f"block {info.block_id:016x} cannot adopt its own chunk")
        # Where that chunk file is placed now, by its own block or by a version that adopted
        # it (the writer's record may predate a move, or its own last commit).
        now = sorted(
            {
                node
                for _, node, crc, fid, cl in holders(conn, c.stored_as, c.index)
                if crc == c.checksum and fid == file_id and cl == info.chunk_len
            }
        )
        if not now:
            raise InvalidArgument(
                f"block {info.block_id:016x} adopts chunk {c.stored_as:016x}.{c.index} on"
                f" {c.node_id!r}, which no committed block of file {file_id} places there"
            )
        if c.node_id not in now:
            c = ChunkPlacement(c.index, now[0], c.checksum, stored_as=c.stored_as)
        chunks.append(c)
    return dataclasses.replace(info, chunks=chunks)


def commit(conn: sqlite3.Connection, info: BlockInfo, file_id: int) -> None:
    """Commit one block. Idempotent for a retry with the same placement."""
    validate_info(info)
    info = _resolve_adopted(conn, info, file_id)
    row = conn.execute(
        "SELECT state, file_id FROM blocks WHERE block_id = ?", (info.block_id,)
    ).fetchone()
    if row is None:
        raise FileNotFound(f"block {info.block_id:016x} was never allocated")
    if row[1] != file_id:
        raise InvalidArgument(f"block {info.block_id:016x} belongs to another file")
    if row[0] == "committed":
        existing = locate(conn, [info.block_id])[0]
        same = sorted(
            (c.index, c.node_id, c.checksum, c.stored_as) for c in existing.chunks
        ) == sorted((c.index, c.node_id, c.checksum, c.stored_as) for c in info.chunks)
        if same and existing.data_len == info.data_len:
            return
        raise InvalidArgument(f"block {info.block_id:016x} is committed with other contents")
    conn.execute(
        "UPDATE blocks SET state = 'committed', ec = ?, chunk_len = ?, data_len = ?, file_index = ?"
        " WHERE block_id = ?",
        (
            ECPolicy.parse(info.ec).name,
            info.chunk_len,
            info.data_len,
            info.file_index,
            info.block_id,
        ),
    )
    conn.executemany(
        "INSERT INTO block_chunks (block_id, idx, node_id, checksum) VALUES (?, ?, ?, ?)",
        [(info.block_id, c.index, c.node_id, c.checksum) for c in info.chunks],
    )
    conn.executemany(
        "INSERT INTO node_blocks (node_id, block_id, idx) VALUES (?, ?, ?)",
        [(c.node_id, info.block_id, c.index) for c in info.chunks],
    )
    conn.executemany(
        "INSERT INTO chunk_origins (block_id, idx, stored_as) VALUES (?, ?, ?)",
        [(info.block_id, c.index, c.stored_as) for c in info.chunks if c.stored_as],
    )
    # Committed short (a full disk, a hung store): the absent indexes wait for repair.
    placed = {c.index for c in info.chunks}
    now = time.time_ns()
    conn.executemany(
        "INSERT OR IGNORE INTO bad_chunks (block_id, idx, node_id, reason, reported_ns)"
        " VALUES (?, ?, '', 'unplaced', ?)",
        [(info.block_id, i, now) for i in range(ECPolicy.parse(info.ec).n) if i not in placed],
    )


def locate(conn: sqlite3.Connection, block_ids: list[int]) -> list[BlockInfo]:
    out = []
    for bid in block_ids:
        row = conn.execute(
            "SELECT ec, chunk_len, data_len, file_index FROM blocks"
            " WHERE block_id = ? AND state = 'committed'",
            (bid,),
        ).fetchone()
        if row is None:
            raise FileNotFound(f"no committed block {bid:016x}")
        chunks = [
            ChunkPlacement(index=r[0], node_id=r[1], checksum=r[2], stored_as=r[3] or 0)
            for r in conn.execute(
                "SELECT c.idx, c.node_id, c.checksum, o.stored_as FROM block_chunks c"
                " LEFT JOIN chunk_origins o ON o.block_id = c.block_id AND o.idx = c.idx"
                " WHERE c.block_id = ? ORDER BY c.idx",
                (bid,),
            )
        ]
        out.append(
            BlockInfo(
                block_id=bid,
                ec=row[0],
                chunk_len=row[1],
                data_len=row[2],
                chunks=chunks,
                file_index=row[3],
            )
        )
    return out


def by_node(
    conn: sqlite3.Connection, node_id: str, after: int, limit: int
) -> list[tuple[int, int]]:
    return [
        (r[0], r[1])
        for r in conn.execute(
            "SELECT block_id, idx FROM node_blocks WHERE node_id = ? AND block_id > ?"
            " ORDER BY block_id, idx LIMIT ?",
            (node_id, after, limit),
        )
    ]


def replace_chunk(
    conn: sqlite3.Connection, block_id: int, index: int, old_node: str, new_node: str, checksum: int
) -> None:
    if not NODE_ID_RE.match(new_node):
        raise InvalidArgument(f"invalid node id {new_node!r}")
    row = conn.execute(
        "SELECT node_id FROM block_chunks WHERE block_id = ? AND idx = ?", (block_id, index)
    ).fetchone()
    if row is None:
        raise FileNotFound(f"block {block_id:016x} has no committed chunk {index}")
    if row[0] != old_node:
        raise InvalidArgument(
            f"chunk {index} of block {block_id:016x} is on {row[0]!r}, not {old_node!r}"
        )
    repoint_chunk(conn, block_id, index, old_node, new_node, checksum)


def report_bad_chunk(
    conn: sqlite3.Connection, block_id: int, index: int, node_id: str, reason: str, now_ns: int
) -> bool:
    """Record a report of a bad chunk (a reader's, the scrub's, the inventory's); False
    (nothing recorded) when the block has no such chunk on that node any more: the
    reporter's view was stale. ``node_id`` "" names an index of a committed block that has
    no chunk anywhere."""
    if node_id:
        row = conn.execute(
            "SELECT 1 FROM block_chunks WHERE block_id = ? AND idx = ? AND node_id = ?",
            (block_id, index, node_id),
        ).fetchone()
    else:
        row = conn.execute(
            "SELECT 1 FROM blocks b WHERE block_id = ? AND state = 'committed' AND NOT EXISTS"
            " (SELECT 1 FROM block_chunks c WHERE c.block_id = b.block_id AND c.idx = ?)",
            (block_id, index),
        ).fetchone()
    if row is None:
        return False
    conn.execute(
        "INSERT OR IGNORE INTO bad_chunks (block_id, idx, node_id, reason, reported_ns)"
        " VALUES (?, ?, ?, ?, ?)",
        (block_id, index, node_id, reason, now_ns),
    )
    return True


def repoint_chunk(
    conn: sqlite3.Connection, block_id: int, index: int, old_node: str, new_node: str, checksum: int
) -> None:
    """Write chunk ``index``'s new home in both tables (``block_chunks`` and the per-node
    index ``node_blocks``), dropping ``old_node``'s index row ("" = the chunk had no home).
    The callers have already checked that the chunk is where ``old_node`` says. The chunk
    written there is the block's own (repair and rebalance put it under this block id), so
    an adoption of the chunk ends here."""
    if old_node:
        conn.execute(
            "DELETE FROM node_blocks WHERE node_id = ? AND block_id = ? AND idx = ?",
            (old_node, block_id, index),
        )
    conn.execute(
        "DELETE FROM bad_chunks WHERE block_id = ? AND idx = ? AND node_id = ?",
        (block_id, index, old_node),
    )
    conn.execute("DELETE FROM chunk_origins WHERE block_id = ? AND idx = ?", (block_id, index))
    conn.execute(
        "INSERT OR REPLACE INTO block_chunks (block_id, idx, node_id, checksum) VALUES (?, ?, ?, ?)",
        (block_id, index, new_node, checksum),
    )
    conn.execute(
        "INSERT OR REPLACE INTO node_blocks (node_id, block_id, idx) VALUES (?, ?, ?)",
        (new_node, block_id, index),
    )


def info_from_wire(data: Any) -> BlockInfo:
    if not isinstance(data, dict):
        raise InvalidArgument("a block must be a map")
    try:
        info = BlockInfo.from_wire(data)
        for name in ("block_id", "chunk_len", "data_len", "file_index"):
            value = getattr(info, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
                raise InvalidArgument(f"block field {name!r} invalid")
        if not isinstance(info.ec, str):
            raise InvalidArgument("block field 'ec' invalid")
        for c in info.chunks:
            if not isinstance(c.index, int) or isinstance(c.index, bool):
                raise InvalidArgument("chunk index must be an integer")
            if (
                not isinstance(c.stored_as, int)
                or isinstance(c.stored_as, bool)
                or not 0 <= c.stored_as < 2**63
            ):
                raise InvalidArgument("chunk field 'stored_as' invalid")
    except (TypeError, KeyError, AttributeError, ValueError) as e:
        raise InvalidArgument(f"malformed block record: {e}") from None
    return info
