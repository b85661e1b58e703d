"""Directory quotas and reservations: pure functions over a shard's ``sqlite3.Connection``.

Realms. A directory with a quota is a *realm*; every record below it (files, directories,
links: not the realm's own record) counts toward it: its ``size`` as logical bytes and
itself as one file. Which realm a record counts toward is its ``file_realms`` row, in the
record's own shard, with the realm's *key*: a random id drawn when the quota was set, so
that what was counted for a quota since removed never lands in a new quota of the same
directory. A new record takes its directory's realm in the transaction that makes it
(``child_realm``: the directory's quota, else the directory's own realm); ``quota set``
walks the tree once to ``attach`` what was there before (metadata/quota_calls.py).
Quotas do not nest: a quota inside a realm, or over one, is refused.

Accounting. Every change of a counted record's size, and every record that enters or
leaves a realm, writes a *delta* (``quota_deltas``) in the same transaction as the change,
in the record's shard, by triggers on the writer connection (``install_accounting``): no
code path that changes a size can forget it. Each delta has a sequence number from the
shard's own counter (``quota_seq``), never reused. The realm's counters live in the
realm's shard (``quotas``), usually another one: the maintenance daemon carries deltas
there (``pending`` -> ``fold`` -> ``ack``). ``fold`` adds a page of one shard's deltas of
one realm and records the page's last sequence number for that (realm, key, shard) in the
same transaction, so a page folded twice (a crash before its ``ack``) is refused the second
time: at any point of a kill -9 the folded usage plus the deltas not yet acked equals the
sum over the realm's records (``recount``). docs/decisions/2026-12-05-quotas.md.

Claims and reservations (in the realm's shard). A writer that grows a file first
``claim``s the bytes (``quota_claims``, per file, with an expiry); the claim shrinks as
the file's deltas are folded (by their positive part) or when the writer gives back what
it did not use (``unclaim``). A quota is checked against used + claims + reservations, so
concurrent writers cannot overshoot it whatever the folding lag. A reservation
(``quota_reservations``) holds bytes for one directory until ``release`` or its expiry;
claims of files directly in that directory draw from it first. ``fallocate`` with
KEEP_SIZE claims bytes for one file ahead (``prealloc``), which its later writes draw
from. Creates claim their file count under file id 0. A limit of 0 is no limit.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from tectonic_py.core.errors import (
    FileNotFound,
    InvalidArgument,
    NoSpace,
    NotADirectory,
    QuotaExceeded,
)
from tectonic_py.core.records import KIND_DIR

CLAIM_TTL_NS = 300 * 1_000_000_000  # a writer's claim, refreshed by each of its claims
PREALLOC_TTL_NS = 3600 * 1_000_000_000  # fallocate KEEP_SIZE: an hour, or until written

# The accounting triggers: TEMP triggers on the writer connection (the etcd engine's rebuild
# of a shard from etcd removes them first, so a restore counts nothing twice).
# No OR-clauses and no upserts in here or on the tables the triggers watch: an outer
# statement's conflict policy overrides a trigger's own (and the etcd engine's change
# capture is a trigger too).
_NEXT = (
    "UPDATE quota_seq SET value = value + 1 WHERE id = 1;"
    " INSERT INTO quota_seq (id, value) SELECT 1, 1"
    " WHERE NOT EXISTS (SELECT 1 FROM quota_seq WHERE id = 1);"
)


def _delta(realm: str, key: str, fid: str, d_bytes: str, d_files: str) -> str:
    return (
        _NEXT + "INSERT INTO quota_deltas (seq, realm, realm_key, file_id, d_bytes, d_files)"
        f" VALUES ((SELECT value FROM quota_seq WHERE id = 1), {realm}, {key}, {fid},"
        f" {d_bytes}, {d_files});"
    )


_SIZE_OF = "(SELECT size FROM main.files WHERE id = {})"
_TRIGGERS = {
    "quota_attach": (
        (
            "AFTER INSERT ON main.file_realms"
            " WHEN EXISTS (SELECT 1 FROM main.files WHERE id = NEW.file_id)"
        ),
        _delta("NEW.realm", "NEW.realm_key", "NEW.file_id", _SIZE_OF.format("NEW.file_id"), "1"),
    ),
    "quota_detach": (
        (
            "AFTER DELETE ON main.file_realms"
            " WHEN EXISTS (SELECT 1 FROM main.files WHERE id = OLD.file_id)"
        ),
        _delta(
            "OLD.realm", "OLD.realm_key", "OLD.file_id", "-" + _SIZE_OF.format("OLD.file_id"), "-1"
        ),
    ),
    "quota_move": (
        (
            "AFTER UPDATE ON main.file_realms"
            " WHEN (OLD.realm, OLD.realm_key) IS NOT (NEW.realm, NEW.realm_key)"
            " AND EXISTS (SELECT 1 FROM main.files WHERE id = NEW.file_id)"
        ),
        _delta(
            "OLD.realm", "OLD.realm_key", "OLD.file_id", "-" + _SIZE_OF.format("OLD.file_id"), "-1"
        )
        + _delta("NEW.realm", "NEW.realm_key", "NEW.file_id", _SIZE_OF.format("NEW.file_id"), "1"),
    ),
    "quota_resize": (
        (
            "AFTER UPDATE OF size ON main.files WHEN NEW.size != OLD.size"
            " AND EXISTS (SELECT 1 FROM main.file_realms WHERE file_id = NEW.id)"
        ),
        _delta(
            "(SELECT realm FROM main.file_realms WHERE file_id = NEW.id)",
            "(SELECT realm_key FROM main.file_realms WHERE file_id = NEW.id)",
            "NEW.id",
            "NEW.size - OLD.size",
            "0",
        ),
    ),
    "quota_gone": (
        (
            "AFTER DELETE ON main.files"
            " WHEN EXISTS (SELECT 1 FROM main.file_realms WHERE file_id = OLD.id)"
        ),
        _delta(
            "(SELECT realm FROM main.file_realms WHERE file_id = OLD.id)",
            "(SELECT realm_key FROM main.file_realms WHERE file_id = OLD.id)",
            "OLD.id",
            "-OLD.size",
            "-1",
        )
        + " DELETE FROM file_realms WHERE file_id = OLD.id;",
    ),
}


def install_accounting(conn: sqlite3.Connection) -> None:
    """The triggers that write a delta with every counted change (module docstring)."""
    for name, (when, body) in _TRIGGERS.items():
        conn.execute(f"CREATE TEMP TRIGGER IF NOT EXISTS {name} {when} BEGIN {body} END")


def remove_accounting(conn: sqlite3.Connection) -> None:
    for name in _TRIGGERS:
        conn.execute(f"DROP TRIGGER IF EXISTS temp.{name}")


# --- realms of records -------------------------------------------------------------------------


def child_realm(conn: sqlite3.Connection, dir_id: int) -> tuple[int, int]:
    """(realm, key) that a new entry of ``dir_id`` counts toward: the directory's own quota,
    else the realm the directory itself is in; (0, 0): none. The directory's rows are in its
    own shard, this one."""
    row = conn.execute("SELECT realm_key FROM quotas WHERE dir_id = ?", (dir_id,)).fetchone()
    if row is not None:
        return dir_id, int(row[0])
    return own_realm(conn, dir_id)


def own_realm(conn: sqlite3.Connection, file_id: int) -> tuple[int, int]:
    row = conn.execute(
        "SELECT realm, realm_key FROM file_realms WHERE file_id = ?", (file_id,)
    ).fetchone()
    return (int(row[0]), int(row[1])) if row is not None else (0, 0)


def attach(conn: sqlite3.Connection, file_id: int, realm: int, key: int) -> None:
    """The record counts toward (realm, key) from now on ((0, 0): toward none); the
    triggers move its bytes and its count."""
    if realm and key:
        cur = conn.execute(
            "UPDATE file_realms SET realm = ?, realm_key = ? WHERE file_id = ?",
            (realm, key, file_id),
        )
        if cur.rowcount == 0:
            conn.execute(
                "INSERT INTO file_realms (file_id, realm, realm_key) VALUES (?, ?, ?)",
                (file_id, realm, key),
            )
    else:
        conn.execute("DELETE FROM file_realms WHERE file_id = ?", (file_id,))


def adopt(conn: sqlite3.Connection, file_id: int, realm: int, key: int) -> str:
    """``quota set``/``rm``'s walk: the record's kind (a realm root below is refused: no
    nesting). A record gone meanwhile is skipped (FileNotFound)."""
    row = conn.execute("SELECT kind FROM files WHERE id = ?", (file_id,)).fetchone()
    if row is None:
        raise FileNotFound(f"no file or directory {file_id}")
    if realm and conn.execute("SELECT 1 FROM quotas WHERE dir_id = ?", (file_id,)).fetchone():
        raise InvalidArgument(
            f"directory {file_id} below has a quota of its own: quotas do not nest"
        )
    attach(conn, file_id, realm, key)
    return str(row[0])


# --- quotas (the realm directory's shard) ------------------------------------------------------


def set_quota(
    conn: sqlite3.Connection, dir_id: int, max_bytes: int, max_files: int, key: int
) -> dict[str, Any]:
    """New limits of ``dir_id``; a new realm gets ``key`` (``fresh`` in the answer: the
    caller then attaches what is below)."""
    row = conn.execute("SELECT kind, nlink FROM files WHERE id = ?", (dir_id,)).fetchone()
    if row is None or (row[0] == KIND_DIR and row[1] == 0):
        raise FileNotFound(f"no directory {dir_id}")
    if row[0] != KIND_DIR:
        raise NotADirectory(f"a quota is set on a directory; {dir_id} is a {row[0]}")
    outer, _ = own_realm(conn, dir_id)
    if outer:
        raise InvalidArgument(
            f"directory {dir_id} is inside the quota of directory {outer}: quotas do not nest"
        )
    found = conn.execute("SELECT realm_key FROM quotas WHERE dir_id = ?", (dir_id,)).fetchone()
    if found is not None:
        conn.execute(
            "UPDATE quotas SET max_bytes = ?, max_files = ? WHERE dir_id = ?",
            (max_bytes, max_files, dir_id),
        )
        return {"realm_key": int(found[0]), "fresh": False}
    conn.execute(
        "INSERT INTO quotas (dir_id, realm_key, max_bytes, max_files, used_bytes, used_files)"
        " VALUES (?, ?, ?, ?, 0, 0)",
        (dir_id, key, max_bytes, max_files),
    )
    return {"realm_key": key, "fresh": True}


def _quota_row(conn: sqlite3.Connection, dir_id: int) -> tuple[int, int, int, int, int] | None:
    row = conn.execute(
        "SELECT realm_key, max_bytes, max_files, used_bytes, used_files FROM quotas"
        " WHERE dir_id = ?",
        (dir_id,),
    ).fetchone()
    return None if row is None else tuple(int(x) for x in row)  # type: ignore[return-value]


def _expire(conn: sqlite3.Connection, realm: int, now: int) -> None:
    conn.execute("DELETE FROM quota_claims WHERE realm = ? AND expires_ns < ?", (realm, now))
    conn.execute("DELETE FROM quota_reservations WHERE realm = ? AND expires_ns < ?", (realm, now))


def _held(conn: sqlite3.Connection, realm: int, now: int) -> tuple[int, int, int]:
    """(claimed bytes, claimed files, reserved bytes) of the realm, unexpired."""
    c = conn.execute(
        "SELECT coalesce(sum(bytes + prealloc), 0), coalesce(sum(files), 0) FROM quota_claims"
        " WHERE realm = ? AND expires_ns >= ?",
        (realm, now),
    ).fetchone()
    r = conn.execute(
        "SELECT coalesce(sum(bytes), 0) FROM quota_reservations WHERE realm = ? AND expires_ns >= ?",
        (realm, now),
    ).fetchone()
    return int(c[0]), int(c[1]), int(r[0])


def get_quota(conn: sqlite3.Connection, dir_id: int, now: int) -> dict[str, Any]:
    q = _quota_row(conn, dir_id)
    if q is None:
        raise FileNotFound(f"directory {dir_id} has no quota")
    claimed, claimed_files, reserved = _held(conn, dir_id, now)
    return {
        "dir": dir_id,
        "max_bytes": q[1],
        "max_files": q[2],
        "used_bytes": q[3],
        "used_files": q[4],
        "claimed_bytes": claimed,
        "claimed_files": claimed_files,
        "reserved_bytes": reserved,
    }


def list_quotas(conn: sqlite3.Connection, now: int) -> list[dict[str, Any]]:
    ids = [r[0] for r in conn.execute("SELECT dir_id FROM quotas ORDER BY dir_id")]
    return [get_quota(conn, d, now) for d in ids]


def remove_quota(conn: sqlite3.Connection, dir_id: int) -> int:
    """Drop the realm (its claims, reservations and fold marks with it); returns its key,
    which the caller's walk detaches the records from."""
    q = _quota_row(conn, dir_id)
    if q is None:
        raise FileNotFound(f"directory {dir_id} has no quota")
    for table in ("quota_claims", "quota_reservations", "quota_folds"):
        conn.execute(f"DELETE FROM {table} WHERE realm = ?", (dir_id,))
    conn.execute("DELETE FROM quotas WHERE dir_id = ?", (dir_id,))
    return q[0]


def claim(
    conn: sqlite3.Connection,
    realm: int,
    dir_id: int,
    file_id: int,
    need: int,
    want: int,
    files: int,
    prealloc: bool,
    now: int,
) -> tuple[int, int]:
    """(granted, of which set aside before): bytes granted to ``file_id`` for growth, between ``need`` and ``want``: first from
    what fallocate set aside for it, then from its directory's reservation, then from the
    free quota; ``QuotaExceeded`` (nothing taken) when ``need`` does not fit. ``files``:
    records about to be created (under file id 0). ``prealloc``: set the bytes aside for
    the file (fallocate KEEP_SIZE) instead of handing them out."""
    q = _quota_row(conn, realm)
    if q is None:
        return want, 0  # no quota (removed meanwhile): nothing to hold to
    _, max_bytes, max_files, used_bytes, used_files = q
    _expire(conn, realm, now)
    want = max(want, need)
    if files:
        _, claimed_files, _ = _held(conn, realm, now)
        if max_files and used_files + claimed_files + files > max_files:
            raise QuotaExceeded(
                f"file quota of directory {realm} exceeded: {used_files} files used,"
                f" {claimed_files} being created, limit {max_files}"
            )
        _add_claim(conn, realm, 0, 0, 0, files, now + CLAIM_TTL_NS)
    if not want:
        return 0, 0
    granted = 0
    row = conn.execute(
        "SELECT prealloc FROM quota_claims WHERE realm = ? AND file_id = ?", (realm, file_id)
    ).fetchone()
    if row is not None and not prealloc:
        granted = min(int(row[0]), want)
        conn.execute(
            "UPDATE quota_claims SET prealloc = prealloc - ? WHERE realm = ? AND file_id = ?",
            (granted, realm, file_id),
        )
    from_prealloc = granted
    if dir_id and granted < want and not prealloc:
        res = conn.execute(
            "SELECT bytes FROM quota_reservations WHERE realm = ? AND dir_id = ?", (realm, dir_id)
        ).fetchone()
        if res is not None:
            take = min(int(res[0]), want - granted)
            conn.execute(
                "UPDATE quota_reservations SET bytes = bytes - ? WHERE realm = ? AND dir_id = ?",
                (take, realm, dir_id),
            )
            granted += take
    if granted < want:
        # What the moves above took is still counted once: as the file's claim below.
        claimed, _, reserved = _held(conn, realm, now)
        free = max_bytes - used_bytes - claimed - reserved - granted if max_bytes else want
        extra = max(0, min(want - granted, free))
        if granted + extra < need:
            raise QuotaExceeded(
                f"quota of directory {realm} exceeded: {used_bytes} bytes used,"
                f" {claimed + granted} claimed by writers, {reserved} reserved, limit {max_bytes}"
            )
        granted += extra
    ttl = PREALLOC_TTL_NS if prealloc else CLAIM_TTL_NS
    _add_claim(
        conn, realm, file_id, 0 if prealloc else granted, granted if prealloc else 0, 0, now + ttl
    )
    return granted, from_prealloc


def _add_claim(
    conn: sqlite3.Connection,
    realm: int,
    file_id: int,
    nbytes: int,
    prealloc: int,
    files: int,
    expires: int,
) -> None:
    cur = conn.execute(
        "UPDATE quota_claims SET bytes = bytes + ?, files = files + ?, prealloc = prealloc + ?,"
        " expires_ns = max(expires_ns, ?) WHERE realm = ? AND file_id = ?",
        (nbytes, files, prealloc, expires, realm, file_id),
    )
    if cur.rowcount == 0:
        conn.execute(
            "INSERT INTO quota_claims (realm, file_id, bytes, files, prealloc, expires_ns)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (realm, file_id, nbytes, files, prealloc, expires),
        )


def unclaim(
    conn: sqlite3.Connection, realm: int, file_id: int, nbytes: int, keep: bool = False
) -> None:
    """A writer gives back claimed bytes it did not write (at close); ``keep``: bytes it
    drew from what fallocate set aside for the file, which stay set aside for it."""
    conn.execute(
        "UPDATE quota_claims SET prealloc = prealloc + CASE WHEN ? THEN min(bytes, ?) ELSE 0 END,"
        " bytes = max(0, bytes - ?) WHERE realm = ? AND file_id = ?",
        (keep, nbytes, nbytes, realm, file_id),
    )
    _drop_empty(conn, realm)


def _drop_empty(conn: sqlite3.Connection, realm: int) -> None:
    conn.execute(
        "DELETE FROM quota_claims WHERE realm = ? AND bytes <= 0 AND prealloc <= 0 AND files <= 0",
        (realm,),
    )


def reserve(
    conn: sqlite3.Connection, realm: int, dir_id: int, nbytes: int, expires: int, now: int
) -> dict[str, Any]:
    """Hold ``nbytes`` of the realm for ``dir_id`` until ``expires`` (replacing what it held)."""
    q = _quota_row(conn, realm)
    if q is None:
        raise FileNotFound(f"directory {realm} has no quota")
    _expire(conn, realm, now)
    conn.execute("DELETE FROM quota_reservations WHERE realm = ? AND dir_id = ?", (realm, dir_id))
    claimed, _, reserved = _held(conn, realm, now)
    free = q[1] - q[3] - claimed - reserved
    if q[1] and nbytes > free:
        raise QuotaExceeded(
            f"quota of directory {realm} cannot hold {nbytes} bytes: {max(0, free)} free"
            f" ({q[3]} used, {claimed} claimed by writers, {reserved} reserved, limit {q[1]})"
        )
    conn.execute(
        "INSERT INTO quota_reservations (realm, dir_id, bytes, expires_ns) VALUES (?, ?, ?, ?)",
        (realm, dir_id, nbytes, expires),
    )
    return {"free": free - nbytes if q[1] else 0}


def release(conn: sqlite3.Connection, realm: int, dir_id: int) -> int:
    """End ``dir_id``'s reservation; the bytes it still held (0: none)."""
    row = conn.execute(
        "SELECT bytes FROM quota_reservations WHERE realm = ? AND dir_id = ?", (realm, dir_id)
    ).fetchone()
    conn.execute("DELETE FROM quota_reservations WHERE realm = ? AND dir_id = ?", (realm, dir_id))
    return int(row[0]) if row is not None else 0


# --- folding deltas (maintenance: pending in the record's shard, fold in the realm's) ------


def pending(conn: sqlite3.Connection, limit: int) -> list[dict[str, Any]]:
    """The oldest ``limit`` deltas of this shard, summed per realm: each with ``upto``, its
    last sequence number (every delta of that realm up to it is in the sum) and per file the
    positive part of its growth (what the file's claim shrinks by)."""
    rows = conn.execute(
        "SELECT seq, realm, realm_key, file_id, d_bytes, d_files FROM quota_deltas"
        " ORDER BY seq LIMIT ?",
        (limit,),
    ).fetchall()
    out: dict[tuple[int, int], dict[str, Any]] = {}
    grown: dict[tuple[int, int], dict[int, list[int]]] = {}
    for seq, realm, key, fid, d_bytes, d_files in rows:
        page = out.setdefault(
            (realm, key),
            {"realm": realm, "realm_key": key, "first": seq, "upto": 0, "bytes": 0, "files": 0},
        )
        page["upto"] = max(page["upto"], seq)
        page["bytes"] += d_bytes
        page["files"] += d_files
        g = grown.setdefault((realm, key), {}).setdefault(fid, [0, 0])
        g[0] += max(0, d_bytes)
        g[1] += max(0, d_files)
    for k, page in out.items():
        page["grown"] = [[fid, b, f] for fid, (b, f) in grown[k].items() if b or f]
    return list(out.values())


def fold(
    conn: sqlite3.Connection,
    realm: int,
    key: int,
    src_shard: int,
    first: int,
    upto: int,
    d_bytes: int,
    d_files: int,
    grown: list[list[int]],
) -> tuple[str, int]:
    """Add one page of a shard's deltas (sequence numbers ``first``..``upto``) to the
    realm's usage, once. (outcome, the last sequence number folded from that shard):
    ``folded``; ``repeat``: the page, or its start, was folded before (an ack lost to a
    crash; the caller acks up to the number returned and reads the page again, so a page
    that mixes folded and new deltas is never added); ``discarded``: the realm or its key
    is gone, nothing counts toward it any more."""
    q = _quota_row(conn, realm)
    if q is None or q[0] != key:
        return "discarded", upto
    row = conn.execute(
        "SELECT last_seq FROM quota_folds WHERE realm = ? AND realm_key = ? AND src_shard = ?",
        (realm, key, src_shard),
    ).fetchone()
    last = int(row[0]) if row is not None else 0
    if first <= last:
        return "repeat", last
    if row is None:
        conn.execute(
            "INSERT INTO quota_folds (realm, realm_key, src_shard, last_seq) VALUES (?, ?, ?, ?)",
            (realm, key, src_shard, upto),
        )
    else:
        conn.execute(
            "UPDATE quota_folds SET last_seq = ? WHERE realm = ? AND realm_key = ?"
            " AND src_shard = ?",
            (upto, realm, key, src_shard),
        )
    conn.execute(
        "UPDATE quotas SET used_bytes = used_bytes + ?, used_files = used_files + ?"
        " WHERE dir_id = ?",
        (d_bytes, d_files, realm),
    )
    new_files = 0
    for fid, nbytes, nfiles in grown:
        new_files += nfiles
        conn.execute(
            "UPDATE quota_claims SET bytes = max(0, bytes - ?) WHERE realm = ? AND file_id = ?",
            (nbytes, realm, fid),
        )
    if new_files:
        conn.execute(
            "UPDATE quota_claims SET files = max(0, files - ?) WHERE realm = ? AND file_id = 0",
            (new_files, realm),
        )
    _drop_empty(conn, realm)
    return "folded", upto


def ack(conn: sqlite3.Connection, realm: int, key: int, upto: int) -> None:
    """The page up to ``upto`` is in the realm's usage: its deltas go."""
    conn.execute(
        "DELETE FROM quota_deltas WHERE realm = ? AND realm_key = ? AND seq <= ?",
        (realm, key, upto),
    )


def recount(conn: sqlite3.Connection) -> dict[str, Any]:
    """This shard's part of a recount: per (realm, key), the bytes and records that count
    toward it, and the deltas not yet folded."""
    records = [
        list(r)
        for r in conn.execute(
            "SELECT r.realm, r.realm_key, coalesce(sum(f.size), 0), count(*) FROM file_realms r"
            " JOIN files f ON f.id = r.file_id GROUP BY r.realm, r.realm_key"
        )
    ]
    unfolded = [
        list(r)
        for r in conn.execute(
            "SELECT realm, realm_key, sum(d_bytes), sum(d_files) FROM quota_deltas"
            " GROUP BY realm, realm_key"
        )
    ]
    return {"records": records, "pending": unfolded}


def quota_keys(conn: sqlite3.Connection) -> list[list[int]]:
    """[dir, key, used_bytes, used_files] of every quota of this shard."""
    return [
        [int(x) for x in r]
        for r in conn.execute("SELECT dir_id, realm_key, used_bytes, used_files FROM quotas")
    ]


# --- raw space reservations (the registry's shard) ---------------------------------------------


def space_reserve(
    conn: sqlite3.Connection, dir_id: int, raw: int, free: int, expires: int, now: int
) -> int:
    """Hold ``raw`` bytes of the cluster's free raw space for ``dir_id`` (replacing what it
    held); ``NoSpace`` when the free space less the other reservations cannot. Returns what
    is left free after it."""
    conn.execute("DELETE FROM space_reservations WHERE expires_ns < ? OR dir_id = ?", (now, dir_id))
    held = conn.execute("SELECT coalesce(sum(raw_bytes), 0) FROM space_reservations").fetchone()[0]
    left = free - int(held)
    if raw > left:
        raise NoSpace(
            f"the cluster cannot hold {raw} raw bytes: {max(0, left)} free"
            f" ({free} free on live chunk stores, {held} reserved)"
        )
    conn.execute(
        "INSERT INTO space_reservations (dir_id, raw_bytes, expires_ns) VALUES (?, ?, ?)",
        (dir_id, raw, expires),
    )
    return left - raw


def space_release(conn: sqlite3.Connection, dir_id: int) -> None:
    conn.execute("DELETE FROM space_reservations WHERE dir_id = ?", (dir_id,))
