"""Metadata ops for the background services (repair, GC, rebalance, lease recovery).

Kept apart from the Name/File/Block layer modules because they exist only for the
``tectonic maintenance`` process (``tectonic_py/maintenance/``): the data path never calls
them. ``MaintenanceOps`` is a mixin of ``MetadataServer``: its ``op_*`` methods become ops the
same way the server's own do. Every op is one transaction in one shard and re-checks the
state it acts on inside that transaction, so a maintenance process that acted on a stale view
(or crashed and restarted, or runs twice) is refused instead of doing harm.

==================== ===================================================== ===================
op                   fields (and ``shard``)                                reply
==================== ===================================================== ===================
block.scan           after, limit                                          blocks, next
block.set_chunk      block_id, index, old_node ("" = none), new_node,      {}
                     checksum, [registry (its address)]
block.forget         block_id, state, [file_id, file_index]                forgotten, chunks
                                                                           [[n, b, i], ...]
block.dead_chunks    node_id, chunks [[block_id, index], ...]              dead [[b, i], ...]
block.bad_chunks     after, limit                                          chunks [[b, i, n]],
                                                                           next
block.node_chunks    node_id, after [block_id, index], upto, limit         chunks [[b, i, crc,
                                                                           chunk_len]]
block.caps           action ("put" | "delete"), chunks [[node_id, block_id,    caps [token | nil]
                     index], ...]
file.gc_queue        older_than_ns, limit, [superseded_before_ns]          blocks [[b, q_ns]]
file.gc_ack          block_ids                                             {}
file.referenced      refs [[file_id, index, block_id], ...]                referenced [bool]
file.scan            after, limit                                          files [{id, kind, ...}],
                                                                           next
file.expired_leases  before_ns, limit                                      files [[id, lease_ns]]
file.recover_lease   id, lease_ns, before_ns                               outcome
==================== ===================================================== ===================

``block.scan`` lists every block of a shard (allocated and committed) in block-id order with
its state, file, index, allocation time, granted nodes and chunks: the input of the GC's
block sweep and of repair's search for blocks committed with fewer than n chunks.

``block.bad_chunks`` lists every chunk a committed block lacks on an up node (the rows of
``bad_chunks``: reported by readers, the scrub, the inventory, or absent since the commit, with
node ""): with the chunks of down nodes, everything repair has to rebuild and ``tectonic
status`` reports. ``block.node_chunks`` pages through the chunks the Block layer places on one
node with their checksums and lengths, in (block_id, index) order and within a block-id
range: the inventory (``tectonic_py/maintenance/inventory.py``) compares it with what the
node's chunk store lists.

``file.collect_unreachable`` (id, ctime_ns -> deleted) is the unreachable-record sweep's
delete (tectonic_py/maintenance/unreachable.py): it re-checks in its transaction that the
record is as the sweep saw it, has no live writer and is not a directory with entries.

``block.caps`` is where the background services get their capabilities, signed with the
capability key that only metadata servers and chunk stores hold, one per chunk (nil where
refused), many chunks per call. A **delete** is granted only for a chunk the Block layer no
longer needs on that node, by the rule of ``dead_chunks``: its block is gone (forgotten by
the GC: an aborted write past its grace, a block of a deleted file), or committed with that
chunk on another node (the old copy repair or rebalance repointed away, a hedge copy). So
no peer, not even one holding the cluster secret, gets a capability to delete a chunk a
committed block still reads from that node. A **put** is granted for any chunk of a
committed block (repair rebuilds it, rebalance copies it); a put never replaces a good
chunk (chunkstore/writes.py), so it can only add a copy, which the GC later collects.

Lease recovery rule (``recover_lease``), matching the FUSE promise that a crashed writer
never leaves a file that looks complete but is not: a file whose writer lease expired
without a seal keeps its last *committed* size (the size its writer made durable with
fsync/flush, ``set_size``), blocks wholly past that size are dropped (queued for GC), the
writer token is released (a writer that was only partitioned is fenced) and the file stays
**unsealed**, which marks it incomplete: it is never sealed by anyone but a writer's close.
A file that was unlinked while being written (nlink 0) is deleted instead. An unsealed file
with no writer can be reopened for writing (which rewrites it) or removed.
"""

from __future__ import annotations

import sqlite3
from typing import Any

import msgpack

from metadata import file_layer
from metadata.block_layer import PACK_OWNER, holders, locate, repoint_chunk
from metadata.shard import now_ns
from tectonic_py.core import capability
from tectonic_py.core.auth import ROLE_ADMIN
from tectonic_py.core.errors import FileNotFound, InvalidArgument, Refused, WrongShard
from tectonic_py.core.ids import NODE_ID_RE, ROOT_ID, shard_of
from tectonic_py.core.rpc_server import Request

MAX_SCAN = 10_000
REPAIR_PUT_TTL_S = 600.0


# --- Block layer functions -----------------------------------------------------------------


def scan_blocks(
    conn: sqlite3.Connection, after: int, limit: int
) -> tuple[list[dict[str, Any]], int | None]:
    rows = conn.execute(
        "SELECT block_id, state, ec, chunk_len, data_len, file_id, file_index, nodes, allocated_ns"
        " FROM blocks WHERE block_id > ? ORDER BY block_id LIMIT ?",
        (after, limit),
    ).fetchall()
    out = []
    for bid, state, ec, cl, dl, fid, fidx, nodes, alloc in rows:
        chunks = [
            [r[0], r[1], r[2]]
            for r in conn.execute(
                "SELECT idx, node_id, checksum FROM block_chunks WHERE block_id = ? ORDER BY idx",
                (bid,),
            )
        ]
        out.append(
            {
                "block_id": bid,
                "state": state,
                "ec": ec,
                "chunk_len": cl,
                "data_len": dl,
                "file_id": fid,
                "file_index": fidx,
                "granted": list(msgpack.unpackb(nodes)),
                "allocated_ns": alloc,
                "chunks": chunks,
            }
        )
    nxt = rows[-1][0] if len(rows) == limit else None
    return out, nxt


def set_chunk(
    conn: sqlite3.Connection,
    block_id: int,
    index: int,
    old_node: str,
    new_node: str,
    checksum: int,
) -> None:
    """Point chunk ``index`` of a committed block at ``new_node``: a move or repair when
    ``old_node`` names where it is now, the first placement of a chunk the writer never
    managed to store when ``old_node`` is "". Refused if the chunk is elsewhere by now."""
    if not NODE_ID_RE.match(new_node):
        raise InvalidArgument(f"invalid node id {new_node!r}")
    row = conn.execute("SELECT state, ec FROM blocks WHERE block_id = ?", (block_id,)).fetchone()
    if row is None or row[0] != "committed":
        raise FileNotFound(f"no committed block {block_id:016x}")
    from tectonic_py.core.ec_policy import ECPolicy

    if not 0 <= index < ECPolicy.parse(row[1]).n:
        raise InvalidArgument(f"chunk index {index} outside {row[1]}")
    cur = conn.execute(
        "SELECT node_id, checksum FROM block_chunks WHERE block_id = ? AND idx = ?",
        (block_id, index),
    ).fetchone()
    current = cur[0] if cur is not None else ""
    if current != old_node:
        raise InvalidArgument(
            f"chunk {index} of block {block_id:016x} is on {current or 'no node'!r},"
            f" not {old_node or 'no node'!r}"
        )
    if cur is not None and cur[1] != checksum:
        raise InvalidArgument(f"chunk {index} of block {block_id:016x}: checksum differs")
    repoint_chunk(conn, block_id, index, old_node, new_node, checksum)


def forget_block(
    conn: sqlite3.Connection,
    block_id: int,
    state: str,
    file_id: int | None,
    file_index: int | None,
) -> list[tuple[str, int, int]] | None:
    """Delete a block's record, if it is still in the state the GC saw (and, when given,
    still of that file at that index); None if it was not. Returns the chunk files it
    placed, as (node_id, stored-as block id, index), read in the same transaction: a copy
    that repair or rebalance pointed the block at after the GC located it is among them.
    ``Refused`` while any file's block entry names it (its own file's, or an extent of a
    pack), whoever calls: forgetting it would lose that file's data."""
    row = conn.execute(
        "SELECT state, file_id, file_index FROM blocks WHERE block_id = ?", (block_id,)
    ).fetchone()
    if row is None or row[0] != state:
        return None
    if file_id is not None and (row[1], row[2]) != (file_id, file_index):
        return None
    held_by = file_layer.holder(conn, block_id)
    if held_by is not None:
        what = "pack" if row[1] == PACK_OWNER else "block"
        raise Refused(
            f"{what} {block_id:016x} is still referenced (file {held_by[0]} block {held_by[1]})"
        )
    chunks = locate(conn, [block_id])[0].chunks if state == "committed" else []
    placed = [(c.node_id, c.storage_block(block_id), c.index) for c in chunks]
    conn.execute("DELETE FROM blocks WHERE block_id = ?", (block_id,))
    conn.execute("DELETE FROM block_chunks WHERE block_id = ?", (block_id,))
    conn.execute("DELETE FROM node_blocks WHERE block_id = ?", (block_id,))
    conn.execute("DELETE FROM bad_chunks WHERE block_id = ?", (block_id,))
    conn.execute("DELETE FROM chunk_origins WHERE block_id = ?", (block_id,))
    return placed


def reported_bad_chunks(
    conn: sqlite3.Connection, after: int, limit: int
) -> tuple[list[tuple[int, int, str]], int | None]:
    """Chunks readers reported bad (``block.report_bad_chunk``) that are still where they
    were reported, of up to ``limit`` blocks after ``after``: repair's input beside the
    scrub reports."""
    blocks = [
        r[0]
        for r in conn.execute(
            "SELECT DISTINCT block_id FROM bad_chunks WHERE block_id > ? ORDER BY block_id LIMIT ?",
            (after, limit),
        )
    ]
    out: list[tuple[int, int, str]] = []
    for block_id in blocks:
        # Still where reported, or (node "") still without a chunk at that index.
        out.extend(
            (block_id, r[0], r[1])
            for r in conn.execute(
                "SELECT b.idx, b.node_id FROM bad_chunks b LEFT JOIN block_chunks c"
                " ON c.block_id = b.block_id AND c.idx = b.idx WHERE b.block_id = ?"
                " AND (c.node_id = b.node_id OR (b.node_id = '' AND c.node_id IS NULL))",
                (block_id,),
            )
        )
    return out, blocks[-1] if len(blocks) == limit else None


def node_chunks(
    conn: sqlite3.Connection,
    node_id: str,
    after: tuple[int, int],
    upto: int,
    limit: int,
) -> list[tuple[int, int, int, int]]:
    """(block_id, index, checksum, chunk_len) of the committed chunks placed on ``node_id``
    after ``after`` (a (block_id, index) position) with block_id <= ``upto``, in order.
    Chunks a block adopted from an earlier version are left out: their files are listed
    under that version's id, outside this window (not yet checked by the inventory)."""
    return [
        (r[0], r[1], r[2], r[3])
        for r in conn.execute(
            "SELECT n.block_id, n.idx, c.checksum, b.chunk_len FROM node_blocks n"
            " JOIN block_chunks c ON c.block_id = n.block_id AND c.idx = n.idx"
            " JOIN blocks b ON b.block_id = n.block_id"
            " WHERE n.node_id = ? AND (n.block_id, n.idx) > (?, ?) AND n.block_id <= ?"
            " AND b.state = 'committed' AND NOT EXISTS (SELECT 1 FROM chunk_origins o"
            " WHERE o.block_id = n.block_id AND o.idx = n.idx) ORDER BY n.block_id, n.idx LIMIT ?",
            (node_id, after[0], after[1], upto, limit),
        )
    ]


def dead_chunks(
    conn: sqlite3.Connection, node_id: str, chunks: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    """Chunks a node holds that no block needs there: no committed block places that chunk
    file on that node, neither its own block (gone, or committed with that chunk on another
    node, or without it) nor a later version that adopted it (``block_layer.holders``).
    Chunks of allocated (uncommitted) blocks are not dead here: the block sweep forgets
    stale allocations first."""
    dead = []
    for block_id, index in chunks:
        row = conn.execute("SELECT state FROM blocks WHERE block_id = ?", (block_id,)).fetchone()
        if row is not None and row[0] != "committed":
            continue
        if not holders(conn, block_id, index, node_id):
            dead.append((block_id, index))
    return dead


def grantable(conn: sqlite3.Connection, op: str, chunks: list[tuple[str, int, int]]) -> list[bool]:
    """For each (node_id, block_id, index): may ``op`` be licensed there (the rule of the
    module docstring)? Delete: the chunk is dead on that node; put: the block is committed
    and the index is one of its scheme's."""
    from tectonic_py.core.ec_policy import ECPolicy

    out = []
    for node_id, block_id, index in chunks:
        if op == "delete":
            out.append(bool(dead_chunks(conn, node_id, [(block_id, index)])))
            continue
        row = conn.execute(
            "SELECT state, ec FROM blocks WHERE block_id = ?", (block_id,)
        ).fetchone()
        out.append(row is not None and row[0] == "committed" and index < ECPolicy.parse(row[1]).n)
    return out


# --- File layer functions ------------------------------------------------------------------


def gc_queue(
    conn: sqlite3.Connection, older_than_ns: int, limit: int, superseded_before_ns: int = 0
) -> list[tuple[int, int]]:
    """Queued blocks older than ``older_than_ns``, and the superseded ones (replaced at their
    index by a newer version, ``gc_superseded``) older than ``superseded_before_ns``."""
    rows = conn.execute(
        "SELECT block_id, queued_ns FROM gc_blocks WHERE queued_ns < ? ORDER BY queued_ns LIMIT ?",
        (older_than_ns, limit),
    ).fetchall()
    if superseded_before_ns > older_than_ns and len(rows) < limit:
        rows += conn.execute(
            "SELECT g.block_id, g.queued_ns FROM gc_superseded s JOIN gc_blocks g"
            " ON g.block_id = s.block_id WHERE g.queued_ns >= ? AND g.queued_ns < ?"
            " ORDER BY g.queued_ns LIMIT ?",
            (older_than_ns, superseded_before_ns, limit - len(rows)),
        ).fetchall()
    return [(r[0], r[1]) for r in rows]


def gc_ack(conn: sqlite3.Connection, block_ids: list[int]) -> None:
    conn.executemany("DELETE FROM gc_blocks WHERE block_id = ?", [(b,) for b in block_ids])
    conn.executemany("DELETE FROM gc_superseded WHERE block_id = ?", [(b,) for b in block_ids])


def referenced(conn: sqlite3.Connection, refs: list[tuple[int, int, int]]) -> list[bool]:
    """For each (file_id, index, block_id): does the file hold that block at that index?
    For a pack (file_id ``PACK_OWNER``): does any file hold an extent in it?"""
    out = []
    for file_id, index, block_id in refs:
        if file_id == PACK_OWNER:
            out.append(file_layer.held(conn, block_id))
            continue
        row = conn.execute(
            "SELECT block_id FROM file_blocks WHERE file_id = ? AND idx = ?", (file_id, index)
        ).fetchone()
        out.append(row is not None and row[0] == block_id)
    return out


def scan_files(
    conn: sqlite3.Connection, after: int, limit: int
) -> tuple[list[dict[str, Any]], int | None]:
    """Every record of a shard, in id order, as fsck and the unreachable-record sweep need
    it: kind, name hint, link count, size, how many block entries, whether a writer holds
    it and its lease's expiry (never the token)."""
    rows = conn.execute(
        "SELECT f.id, f.kind, f.named, f.parent_id, f.name, f.nlink, f.size, f.writer_token != 0,"
        " f.lease_ns, f.created_ns, f.ctime_ns,"
        " (SELECT count(*) FROM file_blocks b WHERE b.file_id = f.id)"
        " FROM files f WHERE f.id > ? ORDER BY f.id LIMIT ?",
        (after, limit),
    ).fetchall()
    keys = (
        "id",
        "kind",
        "named",
        "parent",
        "name",
        "nlink",
        "size",
        "writer",
        "lease_ns",
        "created_ns",
        "ctime_ns",
        "blocks",
    )
    out = [dict(zip(keys, r)) for r in rows]
    for rec in out:
        rec["named"], rec["writer"] = bool(rec["named"]), bool(rec["writer"])
    return out, (rows[-1][0] if len(rows) == limit else None)


def collect_unreachable(conn: sqlite3.Connection, file_id: int, ctime_ns: int, now: int) -> bool:
    """Delete a record the maintenance daemon's walks found unreachable, if it is still as
    they saw it (``ctime_ns``: a hard link made to it since changes that), holds no live
    writer (an open handle) and is not a directory with entries; False when kept."""
    from metadata.dir_entries import has_entries

    row = conn.execute(
        "SELECT kind, ctime_ns, writer_token, lease_ns FROM files WHERE id = ?", (file_id,)
    ).fetchone()
    if file_id == ROOT_ID or row is None or row[1] != ctime_ns or (row[2] and row[3] > now):
        return False
    if row[0] == "dir" and has_entries(conn, file_id):
        return False
    file_layer._delete_record(conn, file_id, now)
    return True


def expired_leases(conn: sqlite3.Connection, before_ns: int, limit: int) -> list[tuple[int, int]]:
    """(file_id, lease_ns) of files whose writer lease ran out before ``before_ns``. The
    lease's expiry, not the writer token, is what ``recover_lease`` fences on: a token is
    the writer's credential and never leaves the File layer."""
    return [
        (r[0], r[1])
        for r in conn.execute(
            "SELECT id, lease_ns FROM files WHERE writer_token != 0 AND lease_ns < ?"
            " AND kind = 'file' ORDER BY lease_ns LIMIT ?",
            (before_ns, limit),
        )
    ]


def recover_lease(
    conn: sqlite3.Connection, file_id: int, lease_ns: int, before_ns: int, now: int
) -> str:
    """Apply the lease recovery rule of the module docstring; returns what was done.
    ``lease_ns`` is the expiry ``expired_leases`` reported: a writer that renewed or a new
    writer that reopened the file since has another, and is left alone."""
    from metadata import file_layer

    row = conn.execute(
        "SELECT writer_token, lease_ns, nlink, size, ec, chunk_size FROM files"
        " WHERE id = ? AND kind = 'file'",
        (file_id,),
    ).fetchone()
    if row is None or row[0] == 0 or row[1] != lease_ns or row[1] >= before_ns:
        return "skipped"  # gone, closed, reopened by a new writer, or renewed meanwhile
    if row[2] == 0:
        file_layer._delete_record(conn, file_id, now)
        return "deleted"
    from tectonic_py.core.ec_policy import ECPolicy

    per_block = ECPolicy.parse(row[4]).k * row[5]
    file_layer._drop_blocks_from(conn, file_id, -(-row[3] // per_block), now)
    conn.execute(
        "UPDATE files SET writer_token = 0, lease_ns = 0, sealed = 0, ctime_ns = ? WHERE id = ?",
        (now, file_id),
    )
    return "incomplete"


# --- handlers --------------------------------------------------------------------------------


def _in_shard(chunks: list[tuple[str, int, int]], shard: int, total_shards: int) -> None:
    """Every chunk's block must be in this shard: a block of another shard is absent here,
    which must never read as "gone, so deletable"."""
    for _, block_id, _ in chunks:
        if shard_of(block_id, total_shards) != shard:
            raise WrongShard(f"block {block_id:016x} is not in shard {shard}")


def _bounded(req: Request) -> int:
    """``before_ns`` as far as the caller may push it: never past now (a lease that has not
    run out is a live writer's), except for an operator (admin) fencing a writer by hand."""
    before: int = req["before_ns"]
    return before if req.role == ROLE_ADMIN else min(before, now_ns())


class MaintenanceOps:
    """Mixin of ``MetadataServer`` (which provides ``_store``, ``total_shards``,
    ``capability_key`` and ``registered``)."""

    total_shards: int
    capability_key: bytes

    def _store(self, req: Request) -> Any:  # provided by MetadataServer
        raise NotImplementedError

    async def registered(self, node_id: str, hint: str = "") -> bool | None:  # MetadataServer
        """Whether the node registry knows ``node_id``; None where it cannot be asked."""
        raise NotImplementedError

    async def op_block__scan(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        blocks, nxt = store.read(scan_blocks, req["after"], req["limit"])
        return {"blocks": blocks, "next": nxt}

    async def op_block__set_chunk(self, req: Request) -> None:
        """Only onto a node the registry knows: this server's, the one the etcd engine says
        holds it, or the one at the caller's ``registry`` address (docs/operations.md)."""
        store = self._store(req)
        new_node = req["new_node"]
        if not NODE_ID_RE.match(new_node):
            raise InvalidArgument(f"invalid node id {new_node!r}")
        known = await self.registered(new_node, req["registry"])
        if known is None:
            raise Refused(
                f"cannot confirm that node {new_node!r} is registered: this server does not"
                " hold the node registry; pass its address as 'registry'"
            )
        if not known:
            raise Refused(f"node {new_node!r} is not registered: no chunk may be placed on it")
        await store.write(
            set_chunk,
            req["block_id"],
            req["index"],
            req["old_node"],
            req["new_node"],
            req["checksum"],
        )

    async def op_block__forget(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        state = req["state"]
        placed = await store.write(
            forget_block,
            req["block_id"],
            state,
            req["file_id"],
            req["file_index"],
        )
        return {"forgotten": placed is not None, "chunks": [list(c) for c in placed or []]}

    async def op_block__dead_chunks(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        node = req["node_id"]
        chunks = [(b, i) for b, i in req["chunks"]]
        return {"dead": [list(c) for c in store.read(dead_chunks, node, chunks)]}

    async def op_block__bad_chunks(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        chunks, nxt = store.read(
            reported_bad_chunks,
            req["after"],
            req["limit"],
        )
        return {"chunks": [list(c) for c in chunks], "next": nxt}

    async def op_block__node_chunks(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        chunks = store.read(
            node_chunks,
            req["node_id"],
            req["after"],
            req["upto"],
            req["limit"],
        )
        return {"chunks": [list(c) for c in chunks]}

    async def op_block__caps(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        op = req["action"]
        chunks = req["chunks"]
        _in_shard(chunks, store.shard, self.total_shards)
        ttl = capability.DELETE_TTL_S if op == "delete" else REPAIR_PUT_TTL_S
        return {
            "caps": [
                capability.issue(self.capability_key, b, [n], op=op, index=i, ttl_s=ttl)
                if ok
                else None
                for (n, b, i), ok in zip(chunks, store.read(grantable, op, chunks))
            ]
        }

    async def op_file__gc_queue(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        rows = store.read(
            gc_queue,
            req["older_than_ns"],
            req["limit"],
            req["superseded_before_ns"],
        )
        return {"blocks": [list(r) for r in rows]}

    async def op_file__gc_ack(self, req: Request) -> None:
        store = self._store(req)
        await store.write(gc_ack, req["block_ids"])

    async def op_file__referenced(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        return {"referenced": store.read(referenced, req["refs"])}

    async def op_file__scan(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        files, nxt = store.read(scan_files, req["after"], req["limit"])
        return {"files": files, "next": nxt}

    async def op_file__collect_unreachable(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        deleted = await store.write(collect_unreachable, req["id"], req["ctime_ns"], now_ns())
        return {"deleted": deleted}

    async def op_file__expired_leases(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        rows = store.read(expired_leases, _bounded(req), req["limit"])
        return {"files": [list(r) for r in rows]}

    async def op_file__recover_lease(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        outcome = await store.write(
            recover_lease,
            req["id"],
            req["lease_ns"],
            _bounded(req),
            now_ns(),
        )
        return {"outcome": outcome}
