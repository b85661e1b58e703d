"""Metadata ops of checkpoints: a file's durability, and the atomic commit of a step.

``CheckpointOps`` is a mixin of ``MetadataServer`` (as ``MaintenanceOps`` is): its ``op_*``
methods become ops. Each op is one shard's transaction (or read).

==================== ===================================================== ===================
op                   fields (and ``shard``)                                reply
==================== ===================================================== ===================
block.durability     ids                                                   blocks [ChunkState]
file.states          ids                                                   states [[id, kind,
                                                                           sealed, writer,
                                                                           mtime_ns]]
name.staging         after [dir, name], limit                              entries [[dir, name,
                                                                           id]], next
name.commit          dir, staging, final, replace, retire, latest          id, retired,
                                                                           old_latest
==================== ===================================================== ===================

``block.durability`` answers, for each committed block of the list (all of this shard), its
scheme, the chunks it holds and the chunks reported bad: ``tectonic_py.core.durability``'s
``ChunkState``. The client asks each block shard of a file once, with every block of the
file in that shard, and puts the answers together with the node registry's view of which
stores are up (a block shard does not know: the registry lives with one shard).

``file.states`` is the sealed check of a commit and the GC's look at a staging directory:
for each record of the list, in one read, whether it is sealed, whether a writer holds a
live lease, and its mtime. Where files are made in their directory's shard, a step's
directory of rank files is one call.

``name.staging`` lists every directory entry of the shard whose name marks a staging
directory (``STAGING_MARK``: ``<final>.staging-<id>``), for the GC of dead jobs' staging
directories: one scan per shard, no walk of the namespace.

``name.commit`` is the atomic commit of a checkpoint step. Staging and final directory are
entries of one parent, so they are in one shard (names are sharded by parent), and so is the
``latest`` pointer beside them: in ONE transaction the staging entry is renamed to the final
name (FileExists if that is taken, unless ``replace``: the old final is then renamed to
``retire``, a staging name, so the GC collects it after its grace) and ``latest`` is pointed
at the final name. A reader sees the step whole or not at all, and ``latest`` never names a
step that is not there. The client checks that every file under the staging directory is
sealed before it asks (``CheckpointCalls.commit_step``).
"""

from __future__ import annotations

import sqlite3
from typing import Any

from metadata import file_layer, name_layer
from metadata.checkpoint_client import STAGING_MARK
from metadata.shard import now_ns
from tectonic_py.core.cluster_file import DEFAULT_CHUNK_SIZE
from tectonic_py.core.durability import ChunkState
from tectonic_py.core.ec_policy import DEFAULT_POLICY, ECPolicy
from tectonic_py.core.errors import (
    FileExists,
    FileNotFound,
    InvalidArgument,
    NotADirectory,
    WrongShard,
)
from tectonic_py.core.ids import shard_of
from tectonic_py.core.records import KIND_DIR, KIND_FILE, KIND_SYMLINK, validate_name
from tectonic_py.core.rpc_server import Request

MAX_BLOCKS = 100_000
MAX_STATES = 10_000


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


def file_states(conn: sqlite3.Connection, ids: list[int], now: int) -> list[list[Any]]:
    """[id, kind, sealed, writer, mtime_ns] of each live record of the list (gone ones are
    left out: a file unlinked during a walk is no longer part of the step)."""
    out = []
    for fid in ids:
        row = conn.execute(
            "SELECT kind, sealed, writer_token, lease_ns, mtime_ns, ctime_ns, nlink FROM files"
            " WHERE id = ?",
            (fid,),
        ).fetchone()
        if row is None or (row[0] == KIND_DIR and row[6] == 0):
            continue
        kind, sealed, token, lease, mtime, ctime, _ = row
        out.append([fid, kind, bool(sealed), bool(token) and lease > now, max(mtime, ctime)])
    return out


def staging_entries(
    conn: sqlite3.Connection, after: tuple[int, str], limit: int
) -> list[tuple[int, str, int]]:
    """Directory entries whose name marks a staging directory, in key order after ``after``."""
    return [
        (r[0], r[1], r[2])
        for r in conn.execute(
            "SELECT dir_id, name, child_id FROM names WHERE kind = ? AND name GLOB ?"
            " AND (dir_id, name) > (?, ?) ORDER BY dir_id, name LIMIT ?",
            (KIND_DIR, f"*{STAGING_MARK}*", after[0], after[1], limit),
        )
    ]


def commit_step(
    conn: sqlite3.Connection,
    shard: int,
    total_shards: int,
    dir_id: int,
    names: tuple[str, str, str, str],
    replace: bool,
    now: int,
) -> dict[str, Any]:
    """The ``name.commit`` transaction (module docstring); ``names`` are the staging,
    final, retire and latest names ("" for none). Returns the step's id, the id of a
    replaced step (0 if none) and the id of the old ``latest`` link's record when the
    client must unlink it in another shard (0 if none)."""
    staging, final, retire, latest = names
    name_layer.check_dir(conn, dir_id)
    found = name_layer.entry(conn, dir_id, staging)
    if found is None:
        raise FileNotFound(f"no staging directory {staging!r} in directory {dir_id}")
    if found[1] != KIND_DIR:
        raise NotADirectory(f"{staging!r} is not a directory")
    old_latest = name_layer.entry(conn, dir_id, latest) if latest else None
    if old_latest is not None and old_latest[1] != KIND_SYMLINK:
        raise FileExists(f"{latest!r} exists in directory {dir_id} and is not a symbolic link")
    victim = name_layer.entry(conn, dir_id, final)
    retired = 0
    if victim is not None:
        if not replace:
            raise FileExists(f"{final!r} exists in directory {dir_id}: the step is committed")
        if victim[1] != KIND_DIR:
            raise NotADirectory(f"{final!r} exists and is not a directory")
        if name_layer.entry(conn, dir_id, retire) is not None:
            raise FileExists(f"{retire!r} exists in directory {dir_id}")
        retired = name_layer.remove(conn, dir_id, final, KIND_DIR, victim[0])
        name_layer.insert(conn, dir_id, retire, retired, KIND_DIR)
    child = name_layer.remove(conn, dir_id, staging, KIND_DIR, found[0])
    name_layer.insert(conn, dir_id, final, child, KIND_DIR)
    unlink_there = 0
    if latest:
        unlink_there = _point_latest(conn, shard, total_shards, dir_id, latest, final, now)
    return {"id": child, "retired": retired, "old_latest": unlink_there}


def _point_latest(
    conn: sqlite3.Connection,
    shard: int,
    total_shards: int,
    dir_id: int,
    latest: str,
    final: str,
    now: int,
) -> int:
    """Point the symbolic link ``latest`` of ``dir_id`` at ``final`` (a relative target,
    so the pointer stays right when the parent moves): a new link made in this shard
    (``name_layer.make_node``), the old one's entry dropped and its record with it when it
    lives here; otherwise its id is returned for the client to unlink in its shard."""
    old = 0
    if name_layer.entry(conn, dir_id, latest) is not None:
        old = name_layer.remove(conn, dir_id, latest, KIND_FILE)
    spec = {
        "kind": KIND_SYMLINK,
        "mode": 0o777,
        "uid": 0,
        "gid": 0,
        "ec": DEFAULT_POLICY.name,
        "chunk_size": DEFAULT_CHUNK_SIZE,
        "target": final.encode(),
    }
    name_layer.make_node(conn, shard, total_shards, dir_id, latest, spec, now)
    if old and shard_of(old, total_shards) == shard:
        file_layer.unlink(conn, old, now)
        return 0
    return old


class CheckpointOps:
    """Mixin of ``MetadataServer`` (which provides ``_store`` and ``total_shards``)."""

    total_shards: int

    def _store(self, req: Request) -> Any:  # provided by MetadataServer
        raise NotImplementedError

    async def op_block__durability(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        ids = req["ids"]
        for bid in ids:
            if shard_of(bid, self.total_shards) != store.shard:
                raise WrongShard(f"block {bid:016x} is not in shard {store.shard}")
        return {"blocks": [s.to_wire() for s in store.read(chunk_states, ids)]}

    async def op_file__states(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        ids = req["ids"]
        return {"states": store.read(file_states, ids, now_ns())}

    async def op_name__staging(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        limit = req["limit"]
        rows = store.read(staging_entries, req["after"], limit)
        nxt = [rows[-1][0], rows[-1][1]] if len(rows) == limit else None
        return {"entries": [list(r) for r in rows], "next": nxt}

    async def op_name__commit(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        dir_id = req["dir"]
        staging = req["staging"]
        final = req["final"]
        replace = req["replace"]
        retire = validate_name(req["retire"]) if replace else ""
        latest = req["latest"]
        if latest:
            validate_name(latest)
        names = [staging, final] + [n for n in (retire, latest) if n]
        if len(set(names)) != len(names):
            raise InvalidArgument("name.commit: staging, final, retire and latest must differ")
        if shard_of(dir_id, self.total_shards) != store.shard:
            raise WrongShard(f"directory {dir_id} is not in shard {store.shard}")
        return await store.write(
            commit_step,
            store.shard,
            self.total_shards,
            dir_id,
            (staging, final, retire, latest),
            replace,
            now_ns(),
        )
