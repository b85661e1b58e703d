"""Name layer: ``(dir_id, name) -> (child_id, kind)``, sharded by ``dir_id``.

Pure functions over a shard's ``sqlite3.Connection``; mutations run inside the shard's group
commit (metadata/shard.py), one SAVEPOINT each. A directory's own File-layer record lives in
``shard_of(dir_id)``, the same shard as its entries, so every check of "does this directory
exist and is it alive" is part of the same transaction as the entry it guards (a create can
never land in a directory that an rmdir has just emptied and killed).

Listing is a prefix scan of the primary key ``(dir_id, name)`` with the cursor "strictly after
this name": keys never move, so paging is stable under concurrent creates (an entry created
during a listing is returned at most once, and every entry that existed for the whole listing
is returned exactly once).

Cross-directory rename, when the two directories live in different shards (crash-safe by an
intent record in the source shard)::

    1. prepare  (src shard)  record intent {src, dst, child, deadline}; src entry stays
    2. apply    (dst shard)  insert/replace dst entry -> child; refused after the deadline
    3. finish   (src shard)  delete src entry and the intent, in one transaction
    abort       (src shard)  delete the intent only (step 2 failed or never happened)

What a concurrent reader can observe: before step 2 only the old name; between 2 and 3 BOTH
names, pointing at the same child (like a hard link); after 3 only the new name. Never
neither, and never a dst entry pointing at anything but the child. While an intent is open
the source entry is pinned: unlink/rmdir/rename of it answer the retryable ``Busy``.
Recovery (after a crash, or of an intent whose deadline passed): if the dst entry points at
the child, finish; otherwise abort. Because step 2 is refused after the deadline and recovery
only acts after it, a slow client and the recovery pass can never both decide.
Same-shard renames (also across directories of one shard) are one transaction: atomic.

A directory's own record changes with its entries, in the same transaction (the record is
in this shard): every insert, remove and rename stamps the directory's mtime and ctime, and
its ``nlink`` is 2 plus its subdirectories (their ``..``), as POSIX counts it. A directory
made before counts were kept reads 2 whatever it holds; a count never drops below 2.

Symbolic links and special files (``make_node``) are made in the shard of the directory
that names them, record and entry in one transaction: they are never orphans, and another
operation of this shard can make one inside its own transaction.
"""

from __future__ import annotations

import sqlite3
import time
from typing import Any

from metadata import file_layer
from tectonic_py.core.errors import (
    Busy,
    DirectoryNotEmpty,
    FileExists,
    FileNotFound,
    InvalidArgument,
    IsADirectory,
    NotADirectory,
    Timeout,
)
from tectonic_py.core.ids import new_id
from tectonic_py.core.records import ALL_KINDS, KIND_DIR, KIND_FILE, NODE_KINDS, Attrs, DirEntry

MAX_PAGE = 10_000


def check_dir(conn: sqlite3.Connection, dir_id: int) -> None:
    """The directory exists (its File-layer record is in this shard), is alive and a dir."""
    row = conn.execute("SELECT kind, nlink FROM files WHERE id = ?", (dir_id,)).fetchone()
    if row is None or row[1] == 0:
        raise FileNotFound(f"directory {dir_id} does not exist")
    if row[0] != KIND_DIR:
        raise NotADirectory(f"{dir_id} is not a directory")


def entry(conn: sqlite3.Connection, dir_id: int, name: str) -> tuple[int, str] | None:
    """``(child_id, kind)`` of the entry, None if the name is free."""
    row = conn.execute(
        "SELECT child_id, kind FROM names WHERE dir_id = ? AND name = ?", (dir_id, name)
    ).fetchone()
    return None if row is None else (row[0], row[1])


def _touch(conn: sqlite3.Connection, dir_id: int, subdirs: int = 0) -> None:
    """The directory's entries changed: stamp mtime and ctime; ``subdirs`` more (or fewer)
    subdirectories change its link count (never below 2)."""
    now = time.time_ns()
    conn.execute(
        "UPDATE files SET mtime_ns = ?, ctime_ns = ?, nlink = MAX(2, nlink + ?)"
        " WHERE id = ? AND kind = ? AND nlink > 0",
        (now, now, subdirs, dir_id, KIND_DIR),
    )


def _pinned(conn: sqlite3.Connection, dir_id: int, name: str) -> None:
    if conn.execute(
        "SELECT 1 FROM rename_intents WHERE src_dir = ? AND src_name = ?", (dir_id, name)
    ).fetchone():
        raise Busy(f"{name!r} is being renamed to another directory; retry")


def lookup(conn: sqlite3.Connection, dir_id: int, name: str) -> tuple[int, str]:
    check_dir(conn, dir_id)
    found = entry(conn, dir_id, name)
    if found is None:
        raise FileNotFound(f"no entry {name!r} in directory {dir_id}")
    return found


def insert(conn: sqlite3.Connection, dir_id: int, name: str, child_id: int, kind: str) -> None:
    """New entry; FileExists if the name is taken (even by the same child: creates are
    exclusive, a retried create draws a fresh id)."""
    check_dir(conn, dir_id)
    if kind not in ALL_KINDS:
        raise InvalidArgument(f"unknown kind {kind!r}")
    if entry(conn, dir_id, name) is not None:
        raise FileExists(f"{name!r} exists in directory {dir_id}")
    conn.execute(
        "INSERT INTO names (dir_id, name, child_id, kind) VALUES (?, ?, ?, ?)",
        (dir_id, name, child_id, kind),
    )
    _touch(conn, dir_id, 1 if kind == KIND_DIR else 0)


def make_node(
    conn: sqlite3.Connection,
    shard: int,
    total_shards: int,
    dir_id: int,
    name: str,
    spec: dict[str, Any],
    now_ns: int,
) -> Attrs:
    """A symbolic link or special file named ``name`` in ``dir_id``, in one transaction of
    the directory's shard (``shard``): the File record (its id drawn to hash here, named at
    once) and the Name entry. ``spec`` as for ``file_layer.create``, with ``target`` (bytes)
    for a symlink and ``rdev`` for a device. FileExists if the name is taken."""
    if spec.get("kind") not in NODE_KINDS:
        raise InvalidArgument(
            f"make_node makes symlinks and special files, not {spec.get('kind')!r}"
        )
    check_dir(conn, dir_id)
    if entry(conn, dir_id, name) is not None:
        raise FileExists(f"{name!r} exists in directory {dir_id}")
    attrs, _ = file_layer.create(
        conn, shard, total_shards, {**spec, "parent": dir_id, "name": name}, now_ns, 0
    )
    file_layer.link(conn, attrs.id, dir_id, name)
    insert(conn, dir_id, name, attrs.id, attrs.kind)
    return attrs


def list_entries(
    conn: sqlite3.Connection, dir_id: int, after: str, limit: int
) -> tuple[list[DirEntry], str | None]:
    check_dir(conn, dir_id)
    limit = max(1, min(limit, MAX_PAGE))
    rows = conn.execute(
        "SELECT name, child_id, kind FROM names WHERE dir_id = ? AND name > ? "
        "ORDER BY name LIMIT ?",
        (dir_id, after, limit + 1),
    ).fetchall()
    entries = [DirEntry(name=r[0], id=r[1], kind=r[2]) for r in rows[:limit]]
    cursor = entries[-1].name if len(rows) > limit else None
    return entries, cursor


def remove(conn: sqlite3.Connection, dir_id: int, name: str, kind: str, expect_id: int = 0) -> int:
    """Remove an entry of the given kind; returns the child id.

    ``kind`` file: IsADirectory for a directory (unlink). ``kind`` dir: NotADirectory for a
    file (rmdir); ``expect_id`` guards against removing a different directory that took the
    name since the caller emptied and killed the one it meant.
    """
    check_dir(conn, dir_id)
    found = entry(conn, dir_id, name)
    if found is None:
        raise FileNotFound(f"no entry {name!r} in directory {dir_id}")
    child, child_kind = found
    if kind == KIND_FILE and child_kind == KIND_DIR:
        raise IsADirectory(f"{name!r} is a directory")
    if kind == KIND_DIR and child_kind != KIND_DIR:
        raise NotADirectory(f"{name!r} is not a directory")
    if expect_id and child != expect_id:
        raise FileNotFound(f"{name!r} no longer names {expect_id}")
    _pinned(conn, dir_id, name)
    conn.execute("DELETE FROM names WHERE dir_id = ? AND name = ?", (dir_id, name))
    _touch(conn, dir_id, -1 if child_kind == KIND_DIR else 0)
    return child


def _replace_check(child_kind: str, victim: tuple[int, str] | None, replace_dir: int) -> None:
    if victim is None:
        return
    victim_id, victim_kind = victim
    if victim_kind == KIND_DIR and child_kind != KIND_DIR:
        raise IsADirectory("cannot rename a file over a directory")
    if victim_kind != KIND_DIR and child_kind == KIND_DIR:
        raise NotADirectory("cannot rename a directory over a file")
    if victim_kind == KIND_DIR and victim_id != replace_dir:
        raise DirectoryNotEmpty("the target directory must be checked empty first")


def rename_local(
    conn: sqlite3.Connection,
    src_dir: int,
    src_name: str,
    dst_dir: int,
    dst_name: str,
    replace_dir: int,
) -> dict[str, Any]:
    """Rename within this shard in one transaction, also over an existing name.

    Returns ``{id, kind, victim_id, victim_kind}`` (victim 0 when nothing was replaced); the
    caller queues the victim's blocks for GC in the victim's File shard.
    """
    check_dir(conn, src_dir)
    check_dir(conn, dst_dir)
    found = entry(conn, src_dir, src_name)
    if found is None:
        raise FileNotFound(f"no entry {src_name!r} in directory {src_dir}")
    child, kind = found
    _pinned(conn, src_dir, src_name)
    if kind == KIND_DIR and child == dst_dir:
        raise InvalidArgument("cannot move a directory into itself")
    victim = entry(conn, dst_dir, dst_name)
    if victim is not None and victim[0] == child:
        return {"id": child, "kind": kind, "victim_id": 0, "victim_kind": ""}
    _replace_check(kind, victim, replace_dir)
    if victim is not None:
        _pinned(conn, dst_dir, dst_name)
    conn.execute("DELETE FROM names WHERE dir_id = ? AND name = ?", (src_dir, src_name))
    conn.execute(
        "INSERT OR REPLACE INTO names (dir_id, name, child_id, kind) VALUES (?, ?, ?, ?)",
        (dst_dir, dst_name, child, kind),
    )
    moved = 1 if kind == KIND_DIR else 0
    lost = 1 if victim is not None and victim[1] == KIND_DIR else 0
    if src_dir == dst_dir:
        _touch(conn, src_dir, -lost)
    else:
        _touch(conn, src_dir, -moved)
        _touch(conn, dst_dir, moved - lost)
    return {
        "id": child,
        "kind": kind,
        "victim_id": victim[0] if victim else 0,
        "victim_kind": victim[1] if victim else "",
    }


def rename_prepare(
    conn: sqlite3.Connection,
    src_dir: int,
    src_name: str,
    dst_dir: int,
    dst_name: str,
    dst_address: str,
    deadline_ns: int,
) -> dict[str, Any]:
    """Step 1 of a cross-shard rename: pin the source entry with an intent record."""
    check_dir(conn, src_dir)
    found = entry(conn, src_dir, src_name)
    if found is None:
        raise FileNotFound(f"no entry {src_name!r} in directory {src_dir}")
    _pinned(conn, src_dir, src_name)
    child, kind = found
    if kind == KIND_DIR and child == dst_dir:
        raise InvalidArgument("cannot move a directory into itself")
    intent = new_id()
    conn.execute(
        "INSERT INTO rename_intents (intent_id, src_dir, src_name, dst_dir, dst_name, child_id,"
        " kind, dst_address, deadline_ns) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (intent, src_dir, src_name, dst_dir, dst_name, child, kind, dst_address, deadline_ns),
    )
    return {"intent": intent, "id": child, "kind": kind}


def rename_apply(
    conn: sqlite3.Connection,
    dst_dir: int,
    dst_name: str,
    child: int,
    kind: str,
    deadline_ns: int,
    now_ns: int,
    replace_dir: int,
) -> dict[str, Any]:
    """Step 2: point the destination name at the child (replacing a victim atomically)."""
    if now_ns > deadline_ns:
        raise Timeout("rename intent expired before it was applied")
    check_dir(conn, dst_dir)
    victim = entry(conn, dst_dir, dst_name)
    if victim is not None and victim[0] == child:
        return {"victim_id": 0, "victim_kind": ""}
    _replace_check(kind, victim, replace_dir)
    if victim is not None:
        _pinned(conn, dst_dir, dst_name)
    conn.execute(
        "INSERT OR REPLACE INTO names (dir_id, name, child_id, kind) VALUES (?, ?, ?, ?)",
        (dst_dir, dst_name, child, kind),
    )
    lost = 1 if victim is not None and victim[1] == KIND_DIR else 0
    _touch(conn, dst_dir, (1 if kind == KIND_DIR else 0) - lost)
    return {"victim_id": victim[0] if victim else 0, "victim_kind": victim[1] if victim else ""}


def rename_finish(conn: sqlite3.Connection, intent: int, applied: bool) -> None:
    """Step 3 (``applied``) or abort: clear the intent, dropping the source entry if applied."""
    row = conn.execute(
        "SELECT src_dir, src_name, child_id, kind FROM rename_intents WHERE intent_id = ?",
        (intent,),
    ).fetchone()
    if row is None:
        raise FileNotFound(f"no rename intent {intent}")
    src_dir, src_name, child, kind = row
    conn.execute("DELETE FROM rename_intents WHERE intent_id = ?", (intent,))
    if applied:
        cur = conn.execute(
            "DELETE FROM names WHERE dir_id = ? AND name = ? AND child_id = ?",
            (src_dir, src_name, child),
        )
        if cur.rowcount:
            _touch(conn, src_dir, -1 if kind == KIND_DIR else 0)


def intents(conn: sqlite3.Connection, before_ns: int) -> list[dict[str, Any]]:
    """Open intents whose deadline passed before ``before_ns``: the recovery pass's work."""
    rows = conn.execute(
        "SELECT intent_id, src_dir, src_name, dst_dir, dst_name, child_id, kind, dst_address,"
        " deadline_ns FROM rename_intents WHERE deadline_ns < ? ORDER BY deadline_ns LIMIT 1000",
        (before_ns,),
    ).fetchall()
    keys = (
        "intent",
        "src_dir",
        "src_name",
        "dst_dir",
        "dst_name",
        "id",
        "kind",
        "dst_address",
        "deadline_ns",
    )
    return [dict(zip(keys, r)) for r in rows]
