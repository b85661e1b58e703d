"""Online backup and offline restore of a metadata server's SQLite shards.

The embedded engine keeps each shard on one disk, so its safety net is a copy taken while
the server serves. A backup opens one read transaction per shard, all of them before any
copying starts: WAL readers see the last committed state and never block the committer, so
every shard file in the backup is a consistent snapshot, and the shards of one server are
snapshots of (nearly) one instant. Each copy is checked with ``PRAGMA integrity_check``,
fsynced, and listed with its SHA-256 in ``MANIFEST.json``, written last: a backup without a
manifest is an unfinished one.

Restore is offline (the server stopped): every file is verified against the manifest and its
own identity row (which shard of how many) before anything in the data directory changes;
the shard files it replaces are moved aside, never deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from metadata.shard import fsync_path, shard_file
from tectonic_py.core.errors import ConfigError, InvalidArgument

MANIFEST = "MANIFEST.json"
FORMAT = 1


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _identity(conn: sqlite3.Connection) -> dict[str, Any]:
    return dict(conn.execute("SELECT key, value FROM meta").fetchall())


def _check_integrity(conn: sqlite3.Connection, what: str) -> None:
    result = conn.execute("PRAGMA integrity_check").fetchall()
    if result != [("ok",)]:
        raise ConfigError(f"{what}: integrity check failed: {result[:3]}")


def _new_dest(dest: Path) -> None:
    """A backup goes into a directory of its own: never over another backup or live data."""
    if not dest.is_absolute():
        raise InvalidArgument(f"backup destination must be an absolute path, not {str(dest)!r}")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise InvalidArgument(f"backup destination {str(dest)!r} exists and is not empty")
    try:
        dest.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise InvalidArgument(f"cannot create {str(dest)!r}: {e.strerror}") from None


def backup_shards(
    data_dir: Path, shards: list[int], total_shards: int, dest: Path, server: str
) -> dict[str, Any]:
    """Copy every hosted shard into ``dest`` (blocking: run it in a worker thread)."""
    dest = Path(dest)
    if dest.resolve().is_relative_to(Path(data_dir).resolve()):
        raise InvalidArgument("backup destination must be outside the server's data directory")
    _new_dest(dest)
    started = time.time_ns()
    entries = []
    with ExitStack() as stack:
        sources = {}
        for s in shards:
            conn = sqlite3.connect(Path(data_dir) / shard_file(s), isolation_level=None)
            stack.callback(conn.close)
            conn.execute("BEGIN")
            conn.execute("SELECT count(*) FROM meta").fetchone()  # pins this read snapshot
            sources[s] = conn
        for s, src in sources.items():
            target = dest / shard_file(s)
            dst = sqlite3.connect(target, isolation_level=None)
            try:
                src.backup(dst)
                dst.execute("PRAGMA journal_mode=DELETE")
                _check_integrity(dst, str(target))
            finally:
                dst.close()
            fsync_path(target)
            entries.append({"shard": s, "file": target.name, "sha256": _sha256(target)})
    manifest = {
        "format": FORMAT,
        "server": server,
        "total_shards": total_shards,
        "shards": entries,
        "started_ns": started,
        "finished_ns": time.time_ns(),
    }
    tmp = dest / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    fsync_path(tmp)
    os.replace(tmp, dest / MANIFEST)
    fsync_path(dest)
    return manifest


def read_manifest(backup: Path) -> dict[str, Any]:
    path = Path(backup) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{backup}: no {MANIFEST}: not a backup, or an unfinished one") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: unreadable: {e}") from None
    if manifest.get("format") != FORMAT:
        raise ConfigError(f"{path}: backup format {manifest.get('format')!r} is not {FORMAT}")
    return manifest


def verify(backup: Path) -> dict[str, Any]:
    """Check every shard file of a backup against its manifest and its own identity row."""
    backup = Path(backup)
    manifest = read_manifest(backup)
    for entry in manifest["shards"]:
        path = backup / entry["file"]
        if not path.is_file():
            raise ConfigError(f"{path}: listed in the manifest but missing")
        if _sha256(path) != entry["sha256"]:
            raise ConfigError(f"{path}: its SHA-256 does not match the manifest")
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            _check_integrity(conn, str(path))
            ident = _identity(conn)
        finally:
            conn.close()
        want = (entry["shard"], manifest["total_shards"])
        if (ident.get("shard"), ident.get("total_shards")) != want:
            raise ConfigError(f"{path}: holds shard {ident.get('shard')!r}, manifest says {want}")
    return manifest


def restore(backup: Path, data_dir: Path, *, force: bool = False) -> dict[str, Any]:
    """Put a verified backup's shard files into a stopped server's data directory."""
    manifest = verify(backup)
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    present = sorted(data_dir.glob("shard-*.db*"))
    aside = None
    if present:
        if not force:
            raise InvalidArgument(
                f"{data_dir} already holds {len(present)} shard files; stop its server and"
                " pass --force to move them aside"
            )
        aside = data_dir / f"replaced-{time.strftime('%Y%m%dT%H%M%S')}"
        aside.mkdir()
        for p in present:
            os.replace(p, aside / p.name)
    for entry in manifest["shards"]:
        tmp = data_dir / (entry["file"] + ".restoring")
        shutil.copyfile(Path(backup) / entry["file"], tmp)
        fsync_path(tmp)
        os.replace(tmp, data_dir / entry["file"])
    fsync_path(data_dir)
    return {**manifest, "data_dir": str(data_dir), "moved_aside": str(aside) if aside else None}
