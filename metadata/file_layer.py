"""File layer: ``file_id -> attrs`` and ``(file_id, index) -> block_id``, sharded by file_id.

Pure functions over a shard's ``sqlite3.Connection``. Directories are File-layer records too
(kind ``dir``: their attrs, the EC policy new files inherit), always in ``shard_of(id)``.

Ids: a new record's id is drawn here, by the shard that will own it, at random among the ids
that hash to this shard, and checked unused in the same transaction. The client picks the
shard (at random, to spread a burst of creates over all servers) and never draws ids itself.

Writer tokens: ``open_for_write`` (and create) issues a fresh random token with a lease
(``lease_ns``); a second writer steals the file by taking a new token, and every later commit,
seal, set_size or renew carrying the old token is refused with ``StaleWriterToken``: the first
writer is fenced. A writer's lease lets the GC service recover a file whose writer died.

Orphans: a create writes this record first (``named = 0``, with the intended parent and name
as a hint) and the Name entry second, in another shard. A crash between the two leaves a
record nobody can reach; ``orphans()`` lists unnamed records older than a grace period so the
GC can check the hint against the Name layer and ``collect_orphan`` what is not named. Seal
and rename mark a record named, so a file that was fully written is never collected.

Unlinked files: ``unlink`` takes one from ``nlink`` (a file has one per name: hard links add
them, ``add_link``). At zero, without a live writer, the record goes at once and its blocks
are queued in ``gc_blocks``; with one (POSIX: an open file stays usable), the record stays
until the writer seals, and is collected then.

Metadata-only records (symbolic links and mknod's special files, ``NODE_KINDS``) are born
sealed with no writer token; a link's target is in ``symlinks``, a device number in
``devices``, both dropped with the record. ``stored`` in a file's attrs counts the bytes its
stored blocks cover (holes excluded), for st_blocks.

Patches: a small in-place write (a 4 KiB ``pwrite`` into a large file, a SQLite commit into
a packed one) is stored as an extent of a pack laid over the file's block
(``file_patches``, ``add_patch``), at the cost of its own bytes, instead of a new version
of the block (16 MiB of chunks for a 4 KiB write into a 24 MiB RS(6,3) block). A patch that
a newer one covers whole goes at once; at ``MAX_PATCHES`` on a block the writer folds them
into a new version, whose commit at the index drops them.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

from metadata import quota_layer
from metadata.dir_entries import has_entries
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import (
    DirectoryNotEmpty,
    FileNotFound,
    FileSealed,
    InvalidArgument,
    IsADirectory,
    NotADirectory,
    PermissionDenied,
    StaleWriterToken,
    TectonicError,
    XattrNotFound,
)
from tectonic_py.core.ids import new_id, shard_of
from tectonic_py.core.records import (
    ALL_KINDS,
    KIND_BLK,
    KIND_CHR,
    KIND_DIR,
    KIND_FILE,
    KIND_SYMLINK,
    MAX_PATCHES,
    MAX_SYMLINK_TARGET,
    NODE_KINDS,
    Attrs,
)

MAX_XATTR_NAME = 255
MAX_XATTR_VALUE = 64 * 1024
MAX_XATTRS = 128


_COLS = (
    "id, kind, size, mode, uid, gid, atime_ns, mtime_ns, ctime_ns, sealed, ec, chunk_size,"
    " nlink, writer_token, lease_ns"
)


def _row_to_attrs(row: tuple[Any, ...], now_ns: int) -> Attrs:
    (fid, kind, size, mode, uid, gid, at, mt, ct, sealed, ec, cs, nlink, token, lease) = row
    return Attrs(
        id=fid,
        kind=kind,
        size=size,
        mode=mode,
        uid=uid,
        gid=gid,
        atime_ns=at,
        mtime_ns=mt,
        ctime_ns=ct,
        sealed=bool(sealed),
        ec=ec,
        chunk_size=cs,
        nlink=nlink,
        writer=bool(token) and lease > now_ns,
    )


def _row(conn: sqlite3.Connection, file_id: int) -> tuple[Any, ...]:
    row = conn.execute(f"SELECT {_COLS} FROM files WHERE id = ?", (file_id,)).fetchone()
    if row is None or (row[1] == KIND_DIR and row[12] == 0):
        raise FileNotFound(f"no file or directory {file_id}")
    return row


def get(conn: sqlite3.Connection, file_id: int, now_ns: int) -> Attrs:
    row = _row(conn, file_id)
    attrs = _row_to_attrs(row, now_ns)
    if attrs.kind == KIND_DIR:
        attrs.realm, attrs.realm_key = quota_layer.child_realm(conn, file_id)
    else:
        attrs.realm, attrs.realm_key = quota_layer.own_realm(conn, file_id)
    if attrs.kind == KIND_FILE and attrs.size:
        attrs.stored = _stored(conn, file_id, attrs.size, _bytes_per_block(row))
    elif attrs.kind in (KIND_CHR, KIND_BLK):
        dev = conn.execute("SELECT rdev FROM devices WHERE file_id = ?", (file_id,)).fetchone()
        attrs.rdev = dev[0] if dev else 0
    return attrs


def _stored(conn: sqlite3.Connection, file_id: int, size: int, per_block: int) -> int:
    """Bytes of ``[0, size)`` that stored blocks cover: holes (indexes without a block) are
    not stored, and the last block covers only up to the size."""
    count, last = conn.execute(
        "SELECT count(*), max(idx) FROM file_blocks WHERE file_id = ?", (file_id,)
    ).fetchone()
    if not count:
        return 0
    stored = count * per_block
    tail = (size - 1) // per_block
    if last == tail:
        stored -= per_block - (size - tail * per_block)
    return max(0, min(stored, size))


def parent_of(conn: sqlite3.Connection, file_id: int) -> int:
    """The parent hint: exact for directories (every rename refreshes it), a hint for files."""
    row = conn.execute("SELECT parent_id FROM files WHERE id = ?", (file_id,)).fetchone()
    if row is None:
        raise FileNotFound(f"no file or directory {file_id}")
    return int(row[0])


def draw_id(conn: sqlite3.Connection, shard: int, total_shards: int) -> int:
    """A fresh id that hashes to ``shard`` and is unused here (bounded: ~S tries expected)."""
    for _ in range(200 * total_shards + 1000):
        candidate = new_id()
        if shard_of(candidate, total_shards) != shard:
            continue
        if (
            conn.execute("SELECT 1 FROM files WHERE id = ?", (candidate,)).fetchone() is None
            and conn.execute("SELECT 1 FROM delegated_ids WHERE id = ?", (candidate,)).fetchone()
            is None
        ):
            return candidate
    raise TectonicError(f"could not draw a free id in shard {shard}")


def create(
    conn: sqlite3.Connection,
    shard: int,
    total_shards: int,
    spec: dict[str, Any],
    now_ns: int,
    lease_ns: int,
    file_id: int = 0,
    token: int = 0,
) -> tuple[Attrs, int]:
    """A new, not yet named record; a file also gets its writer token (``token``, when the
    client drew it, so that a repeated create can recognise its own file). ``file_id`` is
    given for the root directory (fixed id) and for an id a mount had delegated to it
    (``write_ops.create_named``, which checks it)."""
    kind = spec["kind"]
    if kind not in ALL_KINDS:
        raise InvalidArgument(f"unknown kind {kind!r}")
    ECPolicy.parse(spec["ec"])
    target = bytes(spec.get("target", b""))
    if kind == KIND_SYMLINK and not 0 < len(target) <= MAX_SYMLINK_TARGET:
        raise InvalidArgument(f"a symlink target is 1..{MAX_SYMLINK_TARGET} bytes")
    fid = file_id or draw_id(conn, shard, total_shards)
    token = (token or new_id()) if kind == KIND_FILE else 0
    node = kind in NODE_KINDS
    conn.execute(
        "INSERT INTO files (id, kind, size, mode, uid, gid, atime_ns, mtime_ns, ctime_ns, sealed,"
        " ec, chunk_size, nlink, writer_token, lease_ns, named, parent_id, name, created_ns)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            fid,
            kind,
            len(target),
            spec["mode"],
            spec["uid"],
            spec["gid"],
            now_ns,
            now_ns,
            now_ns,
            1 if node else 0,
            spec["ec"],
            spec["chunk_size"],
            2 if kind == KIND_DIR else 1,
            token,
            now_ns + lease_ns if token else 0,
            1 if file_id else 0,
            spec.get("parent", 0),
            spec.get("name", ""),
            now_ns,
        ),
    )
    # Its quota realm: the one the client read off the parent (a directory made in another
    # shard than its parent's), else the parent's, here when the parent is in this shard.
    realm, key = int(spec.get("realm", 0)), int(spec.get("realm_key", 0))
    parent = int(spec.get("parent", 0))
    if not realm and parent and parent != fid and shard_of(parent, total_shards) == shard:
        realm, key = quota_layer.child_realm(conn, parent)
    if realm:
        quota_layer.attach(conn, fid, realm, key)
    if kind == KIND_SYMLINK:
        conn.execute("INSERT INTO symlinks (file_id, target) VALUES (?, ?)", (fid, target))
    elif kind in (KIND_CHR, KIND_BLK):
        conn.execute(
            "INSERT INTO devices (file_id, rdev) VALUES (?, ?)", (fid, int(spec.get("rdev", 0)))
        )
    return get(conn, fid, now_ns), token


def writer_token(conn: sqlite3.Connection, file_id: int) -> int:
    """The token of the file's current writer (0: none, sealed or not a file)."""
    row = conn.execute("SELECT writer_token FROM files WHERE id = ?", (file_id,)).fetchone()
    return int(row[0]) if row is not None and row[0] else 0


def readlink(conn: sqlite3.Connection, file_id: int) -> bytes:
    """A symbolic link's target, as the bytes it was made with."""
    row = _row(conn, file_id)
    if row[1] != KIND_SYMLINK:
        raise InvalidArgument(f"{file_id} is not a symbolic link")
    target = conn.execute("SELECT target FROM symlinks WHERE file_id = ?", (file_id,)).fetchone()
    if target is None:
        raise FileNotFound(f"symbolic link {file_id} has no target")
    return bytes(target[0])


def _writable(conn: sqlite3.Connection, file_id: int, token: int) -> tuple[Any, ...]:
    row = _row(conn, file_id)
    if row[1] == KIND_DIR:
        raise IsADirectory(f"{file_id} is a directory")
    if row[1] != KIND_FILE:
        raise InvalidArgument(f"{file_id} is a {row[1]}, which holds no data")
    if token == 0 or row[13] != token:
        if row[9] and row[13] == 0:
            raise FileSealed(f"file {file_id} is sealed")
        raise StaleWriterToken(f"file {file_id} was opened for writing by another writer")
    return row


def _queue_gc(
    conn: sqlite3.Connection, block_ids: list[int], now_ns: int, *, superseded: bool = False
) -> None:
    """Queue for the GC the blocks no file holds any more. A pack block is held by every
    file with an extent in it, so it goes with the last of them; a block of its own goes
    with its file's entry."""
    gone = [b for b in set(block_ids) if not held(conn, b)]
    conn.executemany(
        "INSERT OR IGNORE INTO gc_blocks (block_id, queued_ns) VALUES (?, ?)",
        [(b, now_ns) for b in gone],
    )
    if superseded:
        conn.executemany(
            "INSERT OR IGNORE INTO gc_superseded (block_id) VALUES (?)", [(b,) for b in gone]
        )


def holder(conn: sqlite3.Connection, block_id: int) -> tuple[int, int] | None:
    """A file's (id, index) whose block entry or patch names the block (a pack: any file
    with an extent or a patch in it); None when nothing holds it."""
    for table in ("file_blocks", "file_patches"):
        row = conn.execute(
            f"SELECT file_id, idx FROM {table} WHERE block_id = ? LIMIT 1", (block_id,)
        ).fetchone()
        if row is not None:
            return int(row[0]), int(row[1])
    return None


def held(conn: sqlite3.Connection, block_id: int) -> bool:
    """Whether a file's block entry or patch names the block (a pack: any file's)."""
    return holder(conn, block_id) is not None


def _drop_patches(
    conn: sqlite3.Connection, file_id: int, first_index: int, last_index: int
) -> list[int]:
    """Drop the patches of the file's blocks ``first_index..last_index``; their packs."""
    where = "file_id = ? AND idx >= ? AND idx <= ?"
    args = (file_id, first_index, last_index)
    ids = [r[0] for r in conn.execute(f"SELECT block_id FROM file_patches WHERE {where}", args)]
    if ids:
        conn.execute(f"DELETE FROM file_patches WHERE {where}", args)
    return ids


def queue_if_unheld(conn: sqlite3.Connection, block_id: int, now_ns: int) -> None:
    """Queue a block for the GC if no file holds it (a pack whose files all refused it)."""
    _queue_gc(conn, [block_id], now_ns)


def bytes_per_block(conn: sqlite3.Connection, file_id: int) -> int:
    """The file bytes one block of the file covers (k chunks of its chunk size)."""
    return _bytes_per_block(_row(conn, file_id))


def _drop_blocks_from(
    conn: sqlite3.Connection, file_id: int, first_index: int, now_ns: int
) -> None:
    ids = [
        r[0]
        for r in conn.execute(
            "SELECT block_id FROM file_blocks WHERE file_id = ? AND idx >= ?",
            (file_id, first_index),
        )
    ]
    conn.execute("DELETE FROM file_blocks WHERE file_id = ? AND idx >= ?", (file_id, first_index))
    conn.execute("DELETE FROM file_extents WHERE file_id = ? AND idx >= ?", (file_id, first_index))
    ids += _drop_patches(conn, file_id, first_index, 2**62)
    _queue_gc(conn, ids, now_ns)


def _delete_record(conn: sqlite3.Connection, file_id: int, now_ns: int) -> None:
    _drop_blocks_from(conn, file_id, 0, now_ns)
    conn.execute("DELETE FROM xattrs WHERE file_id = ?", (file_id,))
    conn.execute("DELETE FROM symlinks WHERE file_id = ?", (file_id,))
    conn.execute("DELETE FROM devices WHERE file_id = ?", (file_id,))
    conn.execute("DELETE FROM files WHERE id = ?", (file_id,))


def open_for_write(
    conn: sqlite3.Connection, file_id: int, truncate: bool, now_ns: int, lease_ns: int
) -> int:
    """Steal the writer token (fencing any earlier writer) and unseal."""
    row = _row(conn, file_id)
    if row[1] == KIND_DIR:
        raise IsADirectory(f"{file_id} is a directory")
    if row[1] != KIND_FILE:
        raise InvalidArgument(f"{file_id} is a {row[1]}, which holds no data")
    token = new_id()
    if truncate:
        _drop_blocks_from(conn, file_id, 0, now_ns)
    conn.execute(
        "UPDATE files SET writer_token = ?, lease_ns = ?, sealed = 0,"
        " size = CASE WHEN ? THEN 0 ELSE size END,"
        " mtime_ns = CASE WHEN ? THEN ? ELSE mtime_ns END, ctime_ns = ? WHERE id = ?",
        (token, now_ns + lease_ns, truncate, truncate, now_ns, now_ns, file_id),
    )
    return token


def renew_lease(
    conn: sqlite3.Connection, file_id: int, token: int, now_ns: int, lease_ns: int
) -> None:
    _writable(conn, file_id, token)
    conn.execute("UPDATE files SET lease_ns = ? WHERE id = ?", (now_ns + lease_ns, file_id))


def commit_blocks(
    conn: sqlite3.Connection,
    file_id: int,
    token: int,
    entries: Sequence[tuple[int, int] | tuple[int, int, int, int]],
    now_ns: int,
) -> None:
    """Put blocks at their indexes: ``(index, block_id)`` for a block of the file's own,
    ``(index, block_id, offset, length)`` for an extent of a pack. A replaced block is
    queued for GC as superseded (a reader that misses its chunks re-reads the file's block
    list and finds the new one), a pack only once no extent is left in it."""
    _writable(conn, file_id, token)
    for entry in entries:
        index, block_id = entry[0], entry[1]
        old = conn.execute(
            "SELECT block_id FROM file_blocks WHERE file_id = ? AND idx = ?", (file_id, index)
        ).fetchone()
        conn.execute(
            "INSERT OR REPLACE INTO file_blocks (file_id, idx, block_id) VALUES (?, ?, ?)",
            (file_id, index, block_id),
        )
        if len(entry) == 4:
            conn.execute(
                "INSERT OR REPLACE INTO file_extents (file_id, idx, offset, length)"
                " VALUES (?, ?, ?, ?)",
                (file_id, index, entry[2], entry[3]),
            )
        else:
            conn.execute("DELETE FROM file_extents WHERE file_id = ? AND idx = ?", (file_id, index))
        patched = _drop_patches(conn, file_id, index, index)  # the new block holds their bytes
        if old is not None and old[0] != block_id:
            patched.append(old[0])
        _queue_gc(conn, patched, now_ns, superseded=True)
    conn.execute("UPDATE files SET mtime_ns = ? WHERE id = ?", (now_ns, file_id))


def add_patch(
    conn: sqlite3.Connection,
    file_id: int,
    token: int,
    index: int,
    at: int,
    length: int,
    block_id: int,
    offset: int,
    now_ns: int,
) -> None:
    """Lay bytes ``[offset, offset + length)`` of pack ``block_id`` over bytes ``[at, at +
    length)`` of the file's block ``index`` (module docstring). Older patches that this one
    covers whole are dropped: rewriting one page again and again keeps one patch."""
    row = _writable(conn, file_id, token)
    if at < 0 or length <= 0 or at + length > _bytes_per_block(row):
        raise InvalidArgument(f"patch {at}+{length} does not fit a block of file {file_id}")
    if (
        conn.execute(
            "SELECT 1 FROM file_blocks WHERE file_id = ? AND idx = ?", (file_id, index)
        ).fetchone()
        is None
    ):
        raise InvalidArgument(f"file {file_id} has no block {index} to patch")
    covered = conn.execute(
        "SELECT seq, block_id FROM file_patches WHERE file_id = ? AND idx = ?"
        " AND at >= ? AND at + length <= ?",
        (file_id, index, at, at + length),
    ).fetchall()
    conn.executemany(
        "DELETE FROM file_patches WHERE file_id = ? AND idx = ? AND seq = ?",
        [(file_id, index, seq) for seq, _ in covered],
    )
    count, top = conn.execute(
        "SELECT count(*), max(seq) FROM file_patches WHERE file_id = ? AND idx = ?",
        (file_id, index),
    ).fetchone()
    if count >= MAX_PATCHES:
        raise InvalidArgument(
            f"block {index} of file {file_id} has {count} patches: store a new version of it"
        )
    conn.execute(
        "INSERT INTO file_patches (file_id, idx, seq, at, length, block_id, offset)"
        " VALUES (?, ?, ?, ?, ?, ?, ?)",
        (file_id, index, (top or 0) + 1, at, length, block_id, offset),
    )
    # A normal grace, not a superseded block's short one: a reader holding the block list
    # from before still finds the same block at the index and would not look again.
    _queue_gc(conn, [b for _, b in covered if b != block_id], now_ns)
    conn.execute("UPDATE files SET mtime_ns = ? WHERE id = ?", (now_ns, file_id))


def _bytes_per_block(row: tuple[Any, ...]) -> int:
    return ECPolicy.parse(row[10]).k * row[11]


def set_size(conn: sqlite3.Connection, file_id: int, token: int, size: int, now_ns: int) -> Attrs:
    row = _writable(conn, file_id, token)
    per_block = _bytes_per_block(row)
    first_gone = -(-size // per_block)  # blocks starting at or past the new size
    _drop_blocks_from(conn, file_id, first_gone, now_ns)
    conn.execute(
        "UPDATE files SET size = ?, mtime_ns = ?, ctime_ns = ? WHERE id = ?",
        (size, now_ns, now_ns, file_id),
    )
    return get(conn, file_id, now_ns)


def seal(conn: sqlite3.Connection, file_id: int, token: int, size: int, now_ns: int) -> Attrs:
    """Final size, writer token released, sealed, and marked named (the create completed).
    A file unlinked while it was being written is collected here.

    The times stay as the last commit or size change stamped them: the seal changes no byte,
    and a seal that stamped "now" would move the mtime a program saw at close(2), or undo one
    it set right after (utime, shutil.copy2), since the seal may land after both."""
    row = _writable(conn, file_id, token)
    per_block = _bytes_per_block(row)
    _drop_blocks_from(conn, file_id, -(-size // per_block), now_ns)
    if size != row[2]:
        conn.execute(
            "UPDATE files SET mtime_ns = ?, ctime_ns = ? WHERE id = ?", (now_ns, now_ns, file_id)
        )
    conn.execute(
        "UPDATE files SET size = ?, sealed = 1, writer_token = 0, lease_ns = 0, named = 1"
        " WHERE id = ?",
        (size, file_id),
    )
    attrs = get(conn, file_id, now_ns)
    if row[12] == 0:
        _delete_record(conn, file_id, now_ns)
    return attrs


def setattr_(conn: sqlite3.Connection, file_id: int, changes: dict[str, Any], now_ns: int) -> Attrs:
    _row(conn, file_id)
    allowed = ("mode", "uid", "gid", "atime_ns", "mtime_ns", "ec")
    sets = {k: v for k, v in changes.items() if k in allowed and v is not None}
    if "ec" in sets:
        sets["ec"] = ECPolicy.parse(sets["ec"]).name
    if sets:
        assigns = ", ".join(f"{k} = ?" for k in sets)
        conn.execute(
            f"UPDATE files SET {assigns}, ctime_ns = ? WHERE id = ?",
            (*sets.values(), now_ns, file_id),
        )
    return get(conn, file_id, now_ns)


def link(conn: sqlite3.Connection, file_id: int, parent: int, name: str) -> None:
    """The record is reachable by (parent, name): not an orphan; keep the hint current."""
    conn.execute(
        "UPDATE files SET named = 1, parent_id = ?, name = ? WHERE id = ?", (parent, name, file_id)
    )


def add_link(conn: sqlite3.Connection, file_id: int, now_ns: int) -> Attrs:
    """One more name for a file (a hard link): taken before the name entry is made, so a
    crash between the two leaves a count one too high (a file kept), never one too low."""
    row = _row(conn, file_id)
    if row[1] == KIND_DIR:
        raise IsADirectory(f"{file_id} is a directory: no hard links to directories")
    if row[12] == 0:
        raise FileNotFound(f"file {file_id} has no name left")
    conn.execute("UPDATE files SET nlink = nlink + 1, ctime_ns = ? WHERE id = ?", (now_ns, file_id))
    return get(conn, file_id, now_ns)


def unlink(conn: sqlite3.Connection, file_id: int, now_ns: int) -> None:
    """The file lost a name: with names left, one fewer; else collect it now, or when its
    live writer seals."""
    row = conn.execute(
        "SELECT kind, writer_token, lease_ns, nlink FROM files WHERE id = ?", (file_id,)
    ).fetchone()
    if row is None:
        return
    if row[0] == KIND_DIR:
        raise IsADirectory(f"{file_id} is a directory")
    if row[3] > 1:
        conn.execute(
            "UPDATE files SET nlink = nlink - 1, ctime_ns = ? WHERE id = ?", (now_ns, file_id)
        )
        return
    if row[1] and row[2] > now_ns:
        conn.execute(
            "UPDATE files SET nlink = 0, named = 1, ctime_ns = ? WHERE id = ?", (now_ns, file_id)
        )
        return
    _delete_record(conn, file_id, now_ns)


def kill_dir(conn: sqlite3.Connection, dir_id: int, expect_empty: bool = True) -> None:
    """rmdir step 1, in the directory's own shard: refuse if it has entries, else mark it
    dead (nlink 0) so no create can enter it; the record is dropped by ``drop``."""
    row = _row(conn, dir_id)
    if row[1] != KIND_DIR:
        raise NotADirectory(f"{dir_id} is not a directory")
    if expect_empty and has_entries(conn, dir_id):
        raise DirectoryNotEmpty(f"directory {dir_id} is not empty")
    conn.execute("UPDATE files SET nlink = 0 WHERE id = ?", (dir_id,))


def revive_dir(conn: sqlite3.Connection, dir_id: int) -> None:
    """Undo ``kill_dir`` (a rename over the directory failed after killing it)."""
    conn.execute("UPDATE files SET nlink = 2 WHERE id = ? AND kind = ?", (dir_id, KIND_DIR))


def drop(
    conn: sqlite3.Connection, file_id: int, now_ns: int, only_unreachable: bool = False
) -> None:
    """Delete a record whatever its state (rmdir's last step, a dead directory's remains);
    ``only_unreachable``: only a dead directory or a record never named (a client's drop:
    it must not destroy a file that a name still reaches), else ``PermissionDenied``."""
    if only_unreachable:
        row = conn.execute(
            "SELECT kind, nlink, named FROM files WHERE id = ?", (file_id,)
        ).fetchone()
        if row is not None and row[2] and not (row[0] == KIND_DIR and row[1] == 0):
            raise PermissionDenied(
                f"permission denied: file.drop of {file_id}, which a name may still reach,"
                " needs role maintenance; a client removes a name with unlink or rmdir"
            )
    _delete_record(conn, file_id, now_ns)


def blocks(conn: sqlite3.Connection, file_id: int) -> list[tuple[int, int, int, int]]:
    """(index, block_id, offset, length) of each block of the file; length 0: the whole
    block, else the extent of a pack block it is."""
    _row(conn, file_id)
    return [
        (r[0], r[1], r[2] or 0, r[3] or 0)
        for r in conn.execute(
            "SELECT b.idx, b.block_id, e.offset, e.length FROM file_blocks b"
            " LEFT JOIN file_extents e ON e.file_id = b.file_id AND e.idx = b.idx"
            " WHERE b.file_id = ? ORDER BY b.idx",
            (file_id,),
        )
    ]


def patches(conn: sqlite3.Connection, file_id: int) -> list[tuple[int, int, int, int, int]]:
    """(index, at, length, block_id, offset) of each patch of the file, oldest first."""
    return [
        (r[0], r[1], r[2], r[3], r[4])
        for r in conn.execute(
            "SELECT idx, at, length, block_id, offset FROM file_patches WHERE file_id = ?"
            " ORDER BY idx, seq",
            (file_id,),
        )
    ]


def block_map(conn: sqlite3.Connection, file_id: int) -> dict[str, list[list[int]]]:
    """``file.blocks``' answer: the file's blocks and the patches over them."""
    return {
        "blocks": [list(b) for b in blocks(conn, file_id)],
        "patches": [list(p) for p in patches(conn, file_id)],
    }


# --- xattrs (small: a handful per file, values up to 64 KiB) -----------------------------------


def _check_xattr_name(name: str) -> None:
    if not name or len(name.encode()) > MAX_XATTR_NAME or "\x00" in name:
        raise InvalidArgument(f"invalid xattr name {name!r}")


def getxattr(conn: sqlite3.Connection, file_id: int, name: str) -> bytes:
    _row(conn, file_id)
    row = conn.execute(
        "SELECT value FROM xattrs WHERE file_id = ? AND name = ?", (file_id, name)
    ).fetchone()
    if row is None:
        raise XattrNotFound(f"no xattr {name!r} on {file_id}")
    return bytes(row[0])


def setxattr(conn: sqlite3.Connection, file_id: int, name: str, value: bytes) -> None:
    _row(conn, file_id)
    _check_xattr_name(name)
    if len(value) > MAX_XATTR_VALUE:
        raise InvalidArgument(f"xattr value over {MAX_XATTR_VALUE} bytes")
    count = conn.execute("SELECT count(*) FROM xattrs WHERE file_id = ?", (file_id,)).fetchone()[0]
    exists = conn.execute(
        "SELECT 1 FROM xattrs WHERE file_id = ? AND name = ?", (file_id, name)
    ).fetchone()
    if not exists and count >= MAX_XATTRS:
        raise InvalidArgument(f"file {file_id} has {MAX_XATTRS} xattrs already")
    conn.execute(
        "INSERT OR REPLACE INTO xattrs (file_id, name, value) VALUES (?, ?, ?)",
        (file_id, name, value),
    )


def listxattr(conn: sqlite3.Connection, file_id: int) -> list[str]:
    _row(conn, file_id)
    return [
        r[0]
        for r in conn.execute("SELECT name FROM xattrs WHERE file_id = ? ORDER BY name", (file_id,))
    ]


def removexattr(conn: sqlite3.Connection, file_id: int, name: str) -> None:
    _row(conn, file_id)
    cur = conn.execute("DELETE FROM xattrs WHERE file_id = ? AND name = ?", (file_id, name))
    if cur.rowcount == 0:
        raise XattrNotFound(f"no xattr {name!r} on {file_id}")


# --- garbage collection support ----------------------------------------------------------------


def orphans(conn: sqlite3.Connection, older_than_ns: int, limit: int) -> list[dict[str, Any]]:
    rows = conn.execute(
        "SELECT id, kind, parent_id, name, created_ns FROM files WHERE named = 0 AND created_ns < ?"
        " ORDER BY created_ns LIMIT ?",
        (older_than_ns, limit),
    ).fetchall()
    return [dict(zip(("id", "kind", "parent", "name", "created_ns"), r)) for r in rows]


def collect_orphan(conn: sqlite3.Connection, file_id: int, now_ns: int) -> bool:
    """Delete a record that is still unnamed and has no live writer; True if deleted."""
    row = conn.execute(
        "SELECT named, writer_token, lease_ns FROM files WHERE id = ?", (file_id,)
    ).fetchone()
    if row is None or row[0] or (row[1] and row[2] > now_ns):
        return False
    _delete_record(conn, file_id, now_ns)
    return True


def gc_blocks(conn: sqlite3.Connection, limit: int) -> list[int]:
    return [
        r[0]
        for r in conn.execute("SELECT block_id FROM gc_blocks ORDER BY queued_ns LIMIT ?", (limit,))
    ]


def count_files(conn: sqlite3.Connection) -> int:
    return conn.execute("SELECT count(*) FROM files").fetchone()[0]
