"""The write path's combined ops: each does in ONE transaction of one shard what the layer ops
would do in several round trips, so a checkpoint burst of small files costs a writer two
mutations per file (create, close), and group commit batches a burst's mutations together.

Co-location makes that possible. A file's record lives in its directory's shard
(``name.create`` draws its id to hash there), and the blocks its writer allocates live in the
file's shard (the client sends ``block.allocate`` there, and the block id is drawn to hash
there). So a new file's Name entry and File record are one transaction, and a block's
Block-layer commit, its File-layer entry and the seal are another; every rank of a step
writing into one directory meets in one shard, whose committer then takes hundreds of
mutations per transaction instead of one. Directories keep a shard drawn at random
(``file.create``), so the directories of a tree, and their files with them, spread over all
servers.

``MetadataServer`` mixes ``WriteOps`` in; its ``op_*`` methods become ops as the server's own.

==================== ===================================================== ==============
op                   fields (and ``shard``)                                reply
==================== ===================================================== ==============
name.create          dir, name, mode, uid, gid, ec, chunk_size, [token]    attrs, token
name.unlink          dir, name                                             id, released
file.commit          id, token, entries [[index, block_id], ...], [blocks] {}
file.close           id, token, size, entries, [blocks]                    attrs
==================== ===================================================== ==============

``name.create`` makes a regular file, named at once (no orphan window) and holding its writer
token; FileExists if the name is taken. ``name.unlink`` removes a file's name and, when its
record is in this shard, takes the link off the record in the same transaction
(``released``); otherwise the client does that in the record's shard (``file.unlink``).
``blocks`` are Block-layer records (``BlockInfo`` wire maps) of blocks in this shard,
committed in the same transaction as the entries that point at them. Blocks in other shards
(a cluster whose files predate co-location) are committed there first by the client
(``block.commit``), so a crash between the two leaves a committed block that no file
references (GC), never an entry pointing at an uncommitted block. ``file.close`` is
``file.commit`` and then the seal of ``file_layer.seal``; a stale writer token refuses the
whole transaction, blocks included.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from metadata import block_layer, file_layer, name_layer
from metadata.shard import now_ns
from tectonic_py.core.errors import FileExists, WrongShard
from tectonic_py.core.ids import shard_of
from tectonic_py.core.records import KIND_FILE, Attrs, BlockInfo
from tectonic_py.core.rpc_server import Request


def create_named(
    conn: sqlite3.Connection,
    shard: int,
    total_shards: int,
    dir_id: int,
    name: str,
    spec: dict[str, Any],
    now: int,
    lease_ns: int,
    token: int = 0,
) -> tuple[Attrs, int]:
    """A regular file named ``name`` in ``dir_id`` (whose shard this is), with its writer
    token: the File record (id drawn to hash here, named at once) and the Name entry.

    ``token``, drawn by the client, makes the create safe to send again after a lost reply
    (a server killed under it): a name that is taken by a file whose writer holds that very
    token is the first try's, and the reply is the first try's."""
    name_layer.check_dir(conn, dir_id)
    taken = name_layer.entry(conn, dir_id, name)
    if taken is not None:
        if token and file_layer.writer_token(conn, taken[0]) == token:
            return file_layer.get(conn, taken[0], now), token
        raise FileExists(f"{name!r} exists in directory {dir_id}")
    spec = {**spec, "kind": KIND_FILE, "parent": dir_id, "name": name}
    attrs, token = file_layer.create(conn, shard, total_shards, spec, now, lease_ns, token=token)
    file_layer.link(conn, attrs.id, dir_id, name)
    name_layer.insert(conn, dir_id, name, attrs.id, KIND_FILE)
    return attrs, token


def unlink_named(
    conn: sqlite3.Connection, shard: int, total_shards: int, dir_id: int, name: str, now: int
) -> tuple[int, bool]:
    """unlink: the Name entry and, when the file's record is in this shard (a file created
    in this directory, as most are), the record's link too: ``(file_id, released)``. One
    transaction, so a repeat after a lost reply (FileNotFound) leaves nothing undone."""
    child = name_layer.remove(conn, dir_id, name, KIND_FILE)
    if shard_of(child, total_shards) != shard:
        return child, False
    file_layer.unlink(conn, child, now)
    return child, True


def commit_with_blocks(
    conn: sqlite3.Connection,
    file_id: int,
    token: int,
    infos: list[BlockInfo],
    entries: list[tuple[int, int]],
    now: int,
) -> None:
    """Commit this shard's blocks of the file and put ``entries`` in the file."""
    for info in infos:
        block_layer.commit(conn, info, file_id)
    if entries:
        file_layer.commit_blocks(conn, file_id, token, entries, now)


def close(
    conn: sqlite3.Connection,
    file_id: int,
    token: int,
    size: int,
    infos: list[BlockInfo],
    entries: list[tuple[int, int]],
    now: int,
) -> Attrs:
    """The last commit and the seal of a writer, in one transaction."""
    commit_with_blocks(conn, file_id, token, infos, entries, now)
    return file_layer.seal(conn, file_id, token, size, now)


class WriteOps:
    """Mixin of ``MetadataServer``: the combined ops of the write path (module docstring)."""

    total_shards: int
    lease_ns: int

    def _store(self, req: Request) -> Any:  # provided by MetadataServer
        raise NotImplementedError

    def _local_blocks(self, req: Request, shard: int) -> list[BlockInfo]:
        infos = [block_layer.info_from_wire(b) for b in req["blocks"]]
        for info in infos:
            if shard_of(info.block_id, self.total_shards) != shard:
                raise WrongShard(f"block {info.block_id:016x} is not in shard {shard}")
        return infos

    def _dir_here(self, req: Request, shard: int) -> int:
        """The request's directory, which must be in ``shard`` (where its entries are)."""
        dir_id = req["dir"]
        if shard_of(dir_id, self.total_shards) != shard:
            raise WrongShard(f"{req.op}: directory {dir_id} is not in shard {shard}")
        return dir_id

    async def op_name__create(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        dir_id = self._dir_here(req, store.shard)
        spec = {
            "mode": req["mode"],
            "uid": req["uid"],
            "gid": req["gid"],
            "ec": req["ec"],
            "chunk_size": req["chunk_size"],
        }
        attrs, token = await store.write(
            create_named,
            store.shard,
            self.total_shards,
            dir_id,
            req["name"],
            spec,
            now_ns(),
            self.lease_ns,
            req["token"],
        )
        return {"attrs": dict(attrs.__dict__), "token": token}

    async def op_name__unlink(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        name = req["name"]
        child, released = await store.write(
            unlink_named,
            store.shard,
            self.total_shards,
            self._dir_here(req, store.shard),
            name,
            now_ns(),
        )
        return {"id": child, "released": released}

    async def op_file__commit(self, req: Request) -> None:
        store = self._store(req)
        await store.write(
            commit_with_blocks,
            req["id"],
            req["token"],
            self._local_blocks(req, store.shard),
            req["entries"],
            now_ns(),
        )

    async def op_file__close(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        attrs = await store.write(
            close,
            req["id"],
            req["token"],
            req["size"],
            self._local_blocks(req, store.shard),
            req["entries"],
            now_ns(),
        )
        return {"attrs": dict(attrs.__dict__)}
