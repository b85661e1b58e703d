"""Metadata ops of retention: keep the newest N committed steps of a directory, on the server.

``RetentionOps`` is a mixin of ``MetadataServer`` (as ``CheckpointOps`` is). A directory's
policy is a row of the ``retention`` table in the directory's own shard (its record and its
entries live there), so setting one checks the directory in the same transaction.

==================== ============================================ ===========================
op                   fields (and ``shard``)                       reply
==================== ============================================ ===========================
retention.set        dir, keep_last, path                         {}
retention.get        dir                                          keep_last (0: none), path
retention.remove     dir                                          existed
retention.list       (scan: the shard named)                      policies [[dir, keep_last,
                                                                  path]]
retention.retire     dir, protect                                 retired [[name, tomb, id]],
                                                                  tombs [[tomb, id]], dropped
==================== ============================================ ===========================

Steps: the entries of the directory that are directories, not hidden (``.``), not staging
(``<step>.staging-<id>``: never committed) and whose name holds a number; the last number in
the name orders them (``step_9`` before ``step_10``; the name breaks ties). This is how
training jobs name steps (``step_100``, ``checkpoint-2000``, ``global_step500``), and it needs
no record of when each was committed.

``retention.retire`` is the one transaction of a retention pass (the maintenance daemon's,
tectonic_py/maintenance/retention.py): it picks the steps past the newest ``keep_last``,
less any step a symbolic link of the directory names (read here for links whose record is
in this shard, and passed in ``protect`` by the caller for the others), and renames each out
of sight, to a hidden tomb ``.tectonic-retired-<id>.removing`` in the same directory. Since
every entry of the directory is in this shard, the choice and the renames are one
transaction: a crash (of this server or of the caller) leaves each step under its name,
whole, or under its tomb; nothing that looks like a step is ever half removed. The caller
then empties each tomb and removes it (``CheckpointCalls.remove_tree``); the tombs it is
told of include those a pass cut short left, so the next pass finishes them. The newest
step is never retired (``keep_last`` >= 1), nor a staging one (it is no step).
"""

from __future__ import annotations

import re
import sqlite3
from typing import Any

from metadata import name_layer
from metadata.checkpoint_client import REMOVING, STAGING_MARK
from metadata.shard import now_ns
from tectonic_py.core.errors import FileNotFound, InvalidArgument, NotADirectory, WrongShard
from tectonic_py.core.ids import ROOT_ID, shard_of
from tectonic_py.core.records import KIND_DIR, KIND_SYMLINK
from tectonic_py.core.rpc_server import Request

TOMB_PREFIX = ".tectonic-retired-"
_NUMBER = re.compile(r"\d+")


def step_key(name: str) -> tuple[int, str] | None:
    """Where a step of this name sorts (module docstring), or None if it is no step."""
    if name.startswith(".") or STAGING_MARK in name or name.endswith(REMOVING):
        return None
    numbers = _NUMBER.findall(name)
    return (int(numbers[-1]), name) if numbers else None


def tomb_name(child_id: int) -> str:
    return f"{TOMB_PREFIX}{child_id:016x}{REMOVING}"


def set_policy(conn: sqlite3.Connection, dir_id: int, keep_last: int, path: str, now: int) -> None:
    if dir_id == ROOT_ID:
        raise InvalidArgument("retention on / is refused: its entries are not one job's steps")
    name_layer.check_dir(conn, dir_id)
    conn.execute(
        "INSERT OR REPLACE INTO retention (dir_id, keep_last, path, set_ns) VALUES (?, ?, ?, ?)",
        (dir_id, keep_last, path, now),
    )


def get_policy(conn: sqlite3.Connection, dir_id: int) -> tuple[int, str]:
    row = conn.execute(
        "SELECT keep_last, path FROM retention WHERE dir_id = ?", (dir_id,)
    ).fetchone()
    return (0, "") if row is None else (int(row[0]), str(row[1]))


def remove_policy(conn: sqlite3.Connection, dir_id: int) -> bool:
    return conn.execute("DELETE FROM retention WHERE dir_id = ?", (dir_id,)).rowcount > 0


def policies(conn: sqlite3.Connection) -> list[list[Any]]:
    rows = conn.execute("SELECT dir_id, keep_last, path FROM retention ORDER BY dir_id")
    return [[int(d), int(k), str(p)] for d, k, p in rows]


def _linked_names(conn: sqlite3.Connection, dir_id: int) -> set[str]:
    """Every path component of every symbolic link of the directory whose record is in this
    shard: a step any of them names is kept (a link ``latest -> step_100``, or a longer
    target through it)."""
    out: set[str] = set()
    rows = conn.execute(
        "SELECT s.target FROM names n JOIN symlinks s ON s.file_id = n.child_id"
        " WHERE n.dir_id = ? AND n.kind = ?",
        (dir_id, KIND_SYMLINK),
    )
    for (target,) in rows:
        out.update(bytes(target).decode("utf-8", "replace").split("/"))
    return out


def retire(conn: sqlite3.Connection, dir_id: int, protect: list[str]) -> dict[str, Any]:
    """The ``retention.retire`` transaction (module docstring)."""
    keep_last, _ = get_policy(conn, dir_id)
    try:
        name_layer.check_dir(conn, dir_id)
    except (FileNotFound, NotADirectory):
        # The directory went: so does its policy.
        remove_policy(conn, dir_id)
        return {"retired": [], "tombs": [], "dropped": True}
    rows = conn.execute(
        "SELECT name, child_id FROM names WHERE dir_id = ? AND kind = ?", (dir_id, KIND_DIR)
    ).fetchall()
    steps = sorted((key, int(child)) for name, child in rows if (key := step_key(name)))
    retired = []
    if keep_last:
        kept = set(protect) | _linked_names(conn, dir_id)
        for (_, name), child in steps[: max(len(steps) - keep_last, 0)]:
            if name in kept:
                continue
            tomb = tomb_name(child)
            if name_layer.entry(conn, dir_id, tomb) is not None:
                continue  # (cannot be: ids are unique) never overwrite a name
            name_layer.remove(conn, dir_id, name, KIND_DIR, child)
            name_layer.insert(conn, dir_id, tomb, child, KIND_DIR)
            retired.append([name, tomb, child])
    tombs = [
        [str(name), int(child)] for name, child in rows if str(name).startswith(TOMB_PREFIX)
    ] + [[tomb, child] for _, tomb, child in retired]
    return {"retired": retired, "tombs": tombs, "dropped": False}


class RetentionOps:
    """Mixin of ``MetadataServer`` (which provides ``_store`` and ``total_shards``)."""

    total_shards: int

    def _store(self, req: Request) -> Any:  # provided by MetadataServer
        raise NotImplementedError

    def _dir_store(self, req: Request) -> Any:
        store = self._store(req)
        if shard_of(req["dir"], self.total_shards) != store.shard:
            raise WrongShard(f"directory {req['dir']} is not in shard {store.shard}")
        return store

    async def op_retention__set(self, req: Request) -> dict[str, Any]:
        store = self._dir_store(req)
        await store.write(set_policy, req["dir"], req["keep_last"], req["path"], now_ns())
        return {}

    async def op_retention__get(self, req: Request) -> dict[str, Any]:
        keep_last, path = self._dir_store(req).read(get_policy, req["dir"])
        return {"keep_last": keep_last, "path": path}

    async def op_retention__remove(self, req: Request) -> dict[str, Any]:
        store = self._dir_store(req)
        return {"existed": await store.write(remove_policy, req["dir"])}

    async def op_retention__list(self, req: Request) -> dict[str, Any]:
        return {"policies": self._store(req).read(policies)}

    async def op_retention__retire(self, req: Request) -> dict[str, Any]:
        store = self._dir_store(req)
        result: dict[str, Any] = await store.write(retire, req["dir"], list(req["protect"]))
        return result
