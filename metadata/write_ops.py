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
name.create          dir, name, mode, uid, gid, ec, chunk_size, [token],   attrs, token,
                     [id, replace]                                         victim_id/kind
name.delegate        count                                                 ids, expires_ns
name.unlink          dir, name                                             id, released
file.commit          id, token, entries [[index, block_id], ...], [blocks] {}
file.close           id, token, size, entries, [blocks]                    attrs
file.commit_pack     block, files [{id, token, index, offset, length,      results
                     size, seal, [at]}, ...]
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

``file.commit_pack`` serves the small files a client wrote at the same time (and the tails
of large files): their bytes were coded and stored together as ONE *pack* block (allocated
with ``block.allocate`` ``pack``), and one transaction commits it and gives each file its
extent ``[offset, offset + length)`` of it at its block ``index``, its size, and for a close
its seal. Each file is checked and applied in a savepoint of its own, so a fenced writer or a
file removed meanwhile gets its own error and the others go on; a pack that no file took is
queued for the GC at once. A repeat after a lost reply finds its seals done (the same
extent, the same size) and answers them again. A file's extent with ``at`` is a *patch*: it
is laid over bytes ``[at, at + length)`` of the block the file has at ``index``
(``file_layer.add_patch``), the copy-on-write of a small in-place write.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from metadata import block_layer, crash_points, file_layer, name_layer
from metadata.shard import now_ns
from tectonic_py.core.errors import (
    FileExists,
    FileSealed,
    InvalidArgument,
    TectonicError,
    WrongShard,
)
from tectonic_py.core.ids import MAX_ID, shard_of
from tectonic_py.core.records import KIND_FILE, Attrs, BlockInfo, PackedExtent
from tectonic_py.core.rpc_server import Request, error_to_header

DELEGATION_NS = 3600 * 10**9  # a delegated id unused this long is no longer reserved


def delegate(
    conn: sqlite3.Connection, shard: int, total_shards: int, count: int, now: int
) -> tuple[list[int], int]:
    """``count`` fresh ids of this shard, reserved until the returned deadline for the
    caller's creates (``create_named`` with ``file_id``); expired reservations go first, a
    bounded number per call, so the table holds what live mounts hold."""
    conn.execute(
        "DELETE FROM delegated_ids WHERE id IN"
        " (SELECT id FROM delegated_ids WHERE expires_ns < ? LIMIT ?)",
        (now, 4 * count),
    )
    expires = now + DELEGATION_NS
    ids = [file_layer.draw_id(conn, shard, total_shards) for _ in range(count)]
    conn.executemany(
        "INSERT INTO delegated_ids (id, expires_ns) VALUES (?, ?)", [(i, expires) for i in ids]
    )
    return ids, expires


def _take_delegated(conn: sqlite3.Connection, file_id: int, now: int) -> None:
    cur = conn.execute("DELETE FROM delegated_ids WHERE id = ? AND expires_ns >= ?", (file_id, now))
    if not cur.rowcount:
        raise InvalidArgument(
            f"file id {file_id} was not delegated here, or its delegation expired"
        )


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
    file_id: int = 0,
    replace: bool = False,
) -> tuple[Attrs, int, int, str]:
    """A regular file named ``name`` in ``dir_id`` (whose shard this is), with its writer
    token: the File record (id drawn to hash here, named at once) and the Name entry.
    Returns ``(attrs, token, victim_id, victim_kind)``.

    ``token``, drawn by the client, makes the create safe to send again after a lost reply
    (a server killed under it): a name that is taken by a file whose writer holds that very
    token is the first try's, and the reply is the first try's.

    ``file_id``: an id ``delegate`` reserved, for a create the mount answered before sending
    it. A record of that id already here is the first try's (the id was this caller's
    alone), whatever became of its name since. ``replace``: such a create was an
    ``O_CREAT|O_TRUNC`` of a name the mount believed free; if another mount took the name
    meanwhile, the two are serialized as the later one's truncate and rewrite: the name
    moves to the new file and the old one loses it (``victim``; released here when its
    record is in this shard, else by the caller), so the name ends with one writer's whole
    contents, never a mix of two."""
    name_layer.check_dir(conn, dir_id)
    if file_id:
        if conn.execute("SELECT 1 FROM files WHERE id = ?", (file_id,)).fetchone() is not None:
            if file_layer.writer_token(conn, file_id) not in (0, token):
                raise FileExists(f"file id {file_id} exists and is not this create's")
            return file_layer.get(conn, file_id, now), token, 0, ""
        _take_delegated(conn, file_id, now)
    taken = name_layer.entry(conn, dir_id, name)
    victim, victim_kind = 0, ""
    if taken is not None:
        if token and file_layer.writer_token(conn, taken[0]) == token:
            return file_layer.get(conn, taken[0], now), token, 0, ""
        if not replace:
            raise FileExists(f"{name!r} exists in directory {dir_id}")
        victim, victim_kind = taken
        name_layer.remove(conn, dir_id, name, KIND_FILE)
        if shard_of(victim, total_shards) == shard:
            file_layer.unlink(conn, victim, now)
            victim, victim_kind = 0, ""
    spec = {**spec, "kind": KIND_FILE, "parent": dir_id, "name": name}
    attrs, token = file_layer.create(
        conn, shard, total_shards, spec, now, lease_ns, file_id=file_id, token=token
    )
    file_layer.link(conn, attrs.id, dir_id, name)
    name_layer.insert(conn, dir_id, name, attrs.id, KIND_FILE)
    return attrs, token, victim, victim_kind


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


def packed_from_wire(item: Any) -> PackedExtent:
    """One file of a ``file.commit_pack`` request, checked."""
    if not isinstance(item, dict):
        raise InvalidArgument("file.commit_pack: each file must be a map")
    try:
        f = PackedExtent(
            item["id"],
            item["token"],
            item["index"],
            item["offset"],
            item["length"],
            item["size"],
            item.get("seal", False),
            item.get("at", -1),
        )
    except KeyError as e:
        raise InvalidArgument(f"file.commit_pack: a file lacks {e.args[0]!r}") from None
    ints = (f.file_id, f.token, f.index, f.offset, f.length, f.size, f.at)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints):
        raise InvalidArgument("file.commit_pack: file fields must be integers")
    if not isinstance(f.seal, bool):
        raise InvalidArgument("file.commit_pack: 'seal' must be a boolean")
    if not (0 < f.file_id <= MAX_ID and 0 < f.token <= MAX_ID and 0 <= f.index < 2**40):
        raise InvalidArgument(f"file.commit_pack: bad id, token or index of {f.file_id}")
    if f.offset < 0 or f.length <= 0 or not 0 <= f.size < 2**62 or f.at < -1:
        raise InvalidArgument(f"file.commit_pack: bad extent or size of file {f.file_id}")
    return f


def _pack_one(conn: sqlite3.Connection, info: BlockInfo, f: PackedExtent, now: int) -> Attrs:
    if f.offset + f.length > info.data_len:
        raise InvalidArgument(
            f"extent {f.offset}+{f.length} of file {f.file_id} lies outside pack"
            f" {info.block_id:016x} ({info.data_len} bytes)"
        )
    per_block = file_layer.bytes_per_block(conn, f.file_id)
    at = max(f.at, 0)
    if at + f.length > per_block or f.index * per_block + at + f.length > f.size:
        raise InvalidArgument(
            f"extent of {f.length} bytes at {at} of block {f.index} does not fit file"
            f" {f.file_id} of size {f.size} ({per_block} bytes a block)"
        )
    entry = (f.index, info.block_id, f.offset, f.length)
    patch = (f.index, f.at, f.length, info.block_id, f.offset)
    try:
        if f.at >= 0:
            file_layer.add_patch(conn, f.file_id, f.token, *patch, now)
        else:
            file_layer.commit_blocks(conn, f.file_id, f.token, [entry], now)
    except FileSealed:
        # A repeat of this very close (its reply was lost): the seal is done if the file
        # holds this extent (or patch) at this size.
        if f.at >= 0:
            done = patch in file_layer.patches(conn, f.file_id)
        else:
            done = entry in file_layer.blocks(conn, f.file_id)
        attrs = file_layer.get(conn, f.file_id, now)
        if not f.seal or not done or attrs.size != f.size:
            raise
        return attrs
    if f.seal:
        return file_layer.seal(conn, f.file_id, f.token, f.size, now)
    return file_layer.set_size(conn, f.file_id, f.token, f.size, now)


def commit_pack(
    conn: sqlite3.Connection,
    shard: int,
    total_shards: int,
    info: BlockInfo,
    files: list[PackedExtent],
    now: int,
) -> list[Attrs | TectonicError]:
    """The pack block and every file's extent, one transaction (module docstring)."""
    block_layer.commit(conn, info, block_layer.PACK_OWNER)
    out: list[Attrs | TectonicError] = []
    for f in files:
        conn.execute("SAVEPOINT pack_file")
        try:
            if shard_of(f.file_id, total_shards) != shard:
                raise WrongShard(f"file {f.file_id} is not in shard {shard}")
            out.append(_pack_one(conn, info, f, now))
        except TectonicError as e:
            conn.execute("ROLLBACK TO pack_file")
            out.append(e)
        conn.execute("RELEASE pack_file")
    file_layer.queue_if_unheld(conn, info.block_id, now)
    return out


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
        file_id = req["id"]
        if file_id and shard_of(file_id, self.total_shards) != store.shard:
            raise WrongShard(f"name.create: file id {file_id} is not of shard {store.shard}")
        spec = {
            "mode": req["mode"],
            "uid": req["uid"],
            "gid": req["gid"],
            "ec": req["ec"],
            "chunk_size": req["chunk_size"],
        }
        attrs, token, victim, victim_kind = await store.write(
            create_named,
            store.shard,
            self.total_shards,
            dir_id,
            req["name"],
            spec,
            now_ns(),
            self.lease_ns,
            req["token"],
            file_id,
            req["replace"],
        )
        crash_points.reached("create.after_commit")
        return {
            "attrs": dict(attrs.__dict__),
            "token": token,
            "victim_id": victim,
            "victim_kind": victim_kind,
        }

    async def op_name__delegate(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        ids, expires = await store.write(
            delegate, store.shard, self.total_shards, req["count"], now_ns()
        )
        return {"ids": ids, "expires_ns": expires}

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

    async def op_file__commit_pack(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        info = block_layer.info_from_wire(req["block"])
        if shard_of(info.block_id, self.total_shards) != store.shard:
            raise WrongShard(f"pack {info.block_id:016x} is not in shard {store.shard}")
        files = [packed_from_wire(item) for item in req["files"]]
        results = await store.write(
            commit_pack, store.shard, self.total_shards, info, files, now_ns()
        )
        crash_points.reached("pack.after_commit")
        out: list[dict[str, Any]] = []
        for r in results:
            if isinstance(r, Attrs):
                out.append({"attrs": dict(r.__dict__)})
            else:
                header = error_to_header(0, r)
                out.append({"err": header["err"], "msg": header["msg"]})
        return {"results": out}
