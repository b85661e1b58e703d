"""A logical metadata shard: one SQLite file, and group commit of its mutations.

Storage: ``shard-NNNNN.db`` in the server's data directory, WAL mode with
``synchronous=FULL``, so a committed transaction is on disk (the WAL is fsynced at commit)
before any reply leaves the server. Every shard holds the tables of all three layers (the
Name, File and Block layer rows whose keys hash to this shard); the layer modules are pure
functions over a ``sqlite3.Connection`` and own their tables' meaning.

Group commit: one writer per shard. A mutation is queued with ``await store.write(fn, *args)``;
the shard's committer task takes *every* queued mutation, applies them in ONE transaction in
a worker thread (``trio.to_thread.run_sync``: SQLite and fsync never block the event loop),
commits once (one fsync), and only then wakes each waiter with its own result or its own
error. Each mutation runs inside its own SAVEPOINT, so one failing operation (a name that
exists, a stale writer token) is rolled back alone and never fails the rest of the batch.
A thousand ranks creating files in one directory thus share a handful of fsyncs instead of
queueing for a thousand.

Reads use a second connection on the event loop's thread: WAL readers never wait for the
writer, each statement sees the last committed state, and a reply is only sent after its
write committed, so a client always reads its own writes.

The etcd engine's store (``ReplicatedStore``, metadata/etcd_engine.py) is a subclass: the same
batches, but before the COMMIT the rows the batch changed go to etcd in one transaction fenced
on this server's ownership of the shard; the file here is then only a copy, rebuilt from etcd
when the shard is taken over or after an etcd commit whose outcome is unknown. The hooks it
overrides (``_prepare``, ``_adopt``, ``_ready``, ``_commit``, ``durable``, ``max_changes``) are
this module's only points where the engines differ.

Resource handling: ``ShardStore.run`` is the committer task; it lives in the server's
nursery. ``close()`` closes both connections after the nursery ended.

Error handling: a failed COMMIT (disk full, I/O error) fails every mutation of the batch
with ``ShardUnavailable``; nothing of the batch is acknowledged, and SQLite's rollback keeps
the file consistent.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from metadata import quota_layer
from tectonic_py.core.errors import ShardUnavailable, TectonicError

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
MAX_BATCH = 4096

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value) WITHOUT ROWID;

-- Name layer: (dir_id, name) -> (child_id, kind). Sharded by dir_id.
CREATE TABLE IF NOT EXISTS names (
    dir_id INTEGER NOT NULL, name TEXT NOT NULL, child_id INTEGER NOT NULL, kind TEXT NOT NULL,
    PRIMARY KEY (dir_id, name)) WITHOUT ROWID;
-- Cross-shard rename intents, kept in the source directory's shard.
CREATE TABLE IF NOT EXISTS rename_intents (
    intent_id INTEGER PRIMARY KEY, src_dir INTEGER NOT NULL, src_name TEXT NOT NULL,
    dst_dir INTEGER NOT NULL, dst_name TEXT NOT NULL, child_id INTEGER NOT NULL,
    kind TEXT NOT NULL, dst_address TEXT NOT NULL, deadline_ns INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS rename_intents_src ON rename_intents (src_dir, src_name);

-- File layer: file_id -> attrs; (file_id, index) -> block_id. Sharded by file_id.
CREATE TABLE IF NOT EXISTS files (
    id INTEGER PRIMARY KEY, kind TEXT NOT NULL, size INTEGER NOT NULL, mode INTEGER NOT NULL,
    uid INTEGER NOT NULL, gid INTEGER NOT NULL, atime_ns INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL, ctime_ns INTEGER NOT NULL, sealed INTEGER NOT NULL,
    ec TEXT NOT NULL, chunk_size INTEGER NOT NULL, nlink INTEGER NOT NULL,
    writer_token INTEGER NOT NULL, lease_ns INTEGER NOT NULL,
    named INTEGER NOT NULL, parent_id INTEGER NOT NULL, name TEXT NOT NULL,
    created_ns INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS files_unnamed ON files (named, created_ns);
CREATE TABLE IF NOT EXISTS file_blocks (
    file_id INTEGER NOT NULL, idx INTEGER NOT NULL, block_id INTEGER NOT NULL,
    PRIMARY KEY (file_id, idx)) WITHOUT ROWID;
-- A file's block that is an extent of a shared pack block (small files and the tails of large
-- files, written together): bytes [offset, offset + length) of the block file_blocks names.
-- No row: the file's block is the whole block. A pack lives while any extent points into it.
CREATE TABLE IF NOT EXISTS file_extents (
    file_id INTEGER NOT NULL, idx INTEGER NOT NULL, offset INTEGER NOT NULL,
    length INTEGER NOT NULL, PRIMARY KEY (file_id, idx)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS file_blocks_block ON file_blocks (block_id);
-- Small overwrites laid over a file's block (copy-on-write): bytes [at, at + length) of the
-- file's block idx are bytes [offset, offset + length) of pack block_id; a higher seq lies
-- over a lower. A new block at idx drops them (it holds their bytes). Packs live while a
-- patch names them too.
CREATE TABLE IF NOT EXISTS file_patches (
    file_id INTEGER NOT NULL, idx INTEGER NOT NULL, seq INTEGER NOT NULL, at INTEGER NOT NULL,
    length INTEGER NOT NULL, block_id INTEGER NOT NULL, offset INTEGER NOT NULL,
    PRIMARY KEY (file_id, idx, seq)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS file_patches_block ON file_patches (block_id);
CREATE TABLE IF NOT EXISTS xattrs (
    file_id INTEGER NOT NULL, name TEXT NOT NULL, value BLOB NOT NULL,
    PRIMARY KEY (file_id, name)) WITHOUT ROWID;
-- Metadata-only records (File layer, beside their files row): a symbolic link's target, a
-- device file's number. Tables added later than the rest: CREATE ... IF NOT EXISTS adds them
-- to shard files made before them.
CREATE TABLE IF NOT EXISTS symlinks (file_id INTEGER PRIMARY KEY, target BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS devices (file_id INTEGER PRIMARY KEY, rdev INTEGER NOT NULL);
-- File ids reserved for a mount's creates (name.delegate): a create that did not wait
-- names its file with one of them; draws skip them; unused ones go at expires_ns.
CREATE TABLE IF NOT EXISTS delegated_ids (id INTEGER PRIMARY KEY, expires_ns INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS delegated_ids_expiry ON delegated_ids (expires_ns);
-- Retention policies (metadata/retention_ops.py): keep the newest keep_last committed steps
-- of a directory; in the directory's own shard.
CREATE TABLE IF NOT EXISTS retention (
    dir_id INTEGER PRIMARY KEY, keep_last INTEGER NOT NULL, path TEXT NOT NULL,
    set_ns INTEGER NOT NULL);
-- Blocks of deleted/overwritten files, waiting for the GC service.
CREATE TABLE IF NOT EXISTS gc_blocks (block_id INTEGER PRIMARY KEY, queued_ns INTEGER NOT NULL);
-- Queued blocks that a newer version replaced at their index (not deleted nor truncated
-- away): a reader that misses their chunks finds the file's current blocks, so the GC
-- collects them after a short grace.
CREATE TABLE IF NOT EXISTS gc_superseded (block_id INTEGER PRIMARY KEY);

-- Block layer: block_id -> scheme, lengths, chunks; reverse index by node. Sharded by block_id.
CREATE TABLE IF NOT EXISTS blocks (
    block_id INTEGER PRIMARY KEY, state TEXT NOT NULL, ec TEXT NOT NULL,
    chunk_len INTEGER NOT NULL, data_len INTEGER NOT NULL, file_id INTEGER NOT NULL,
    file_index INTEGER NOT NULL, nodes BLOB NOT NULL, allocated_ns INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS block_chunks (
    block_id INTEGER NOT NULL, idx INTEGER NOT NULL, node_id TEXT NOT NULL,
    checksum INTEGER NOT NULL, PRIMARY KEY (block_id, idx)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS node_blocks (
    node_id TEXT NOT NULL, block_id INTEGER NOT NULL, idx INTEGER NOT NULL,
    PRIMARY KEY (node_id, block_id, idx)) WITHOUT ROWID;
-- Chunks a block adopted from an earlier version of itself (an in-place write rewrote only
-- the others): chunk idx of block_id is the file of chunk idx of stored_as. Both blocks are
-- of one file, hence in this shard. No row: the chunk is stored under its own block id.
CREATE TABLE IF NOT EXISTS chunk_origins (
    block_id INTEGER NOT NULL, idx INTEGER NOT NULL, stored_as INTEGER NOT NULL,
    PRIMARY KEY (block_id, idx)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS chunk_origins_stored ON chunk_origins (stored_as, idx);
-- Chunks a reader found corrupt or missing, for repair; dropped when the chunk moves.
CREATE TABLE IF NOT EXISTS bad_chunks (
    block_id INTEGER NOT NULL, idx INTEGER NOT NULL, node_id TEXT NOT NULL,
    reason TEXT NOT NULL, reported_ns INTEGER NOT NULL,
    PRIMARY KEY (block_id, idx, node_id)) WITHOUT ROWID;

-- Quotas (metadata/quota_layer.py). In a quota directory's shard: its limits, folded usage
-- and realm key; the pages of deltas folded per source shard; writers' claims; reservations.
CREATE TABLE IF NOT EXISTS quotas (
    dir_id INTEGER PRIMARY KEY, realm_key INTEGER NOT NULL, max_bytes INTEGER NOT NULL,
    max_files INTEGER NOT NULL, used_bytes INTEGER NOT NULL, used_files INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS quota_folds (
    realm INTEGER NOT NULL, realm_key INTEGER NOT NULL, src_shard INTEGER NOT NULL,
    last_seq INTEGER NOT NULL, PRIMARY KEY (realm, realm_key, src_shard)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS quota_claims (
    realm INTEGER NOT NULL, file_id INTEGER NOT NULL, bytes INTEGER NOT NULL,
    files INTEGER NOT NULL, prealloc INTEGER NOT NULL, expires_ns INTEGER NOT NULL,
    PRIMARY KEY (realm, file_id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS quota_reservations (
    realm INTEGER NOT NULL, dir_id INTEGER NOT NULL, bytes INTEGER NOT NULL,
    expires_ns INTEGER NOT NULL, PRIMARY KEY (realm, dir_id)) WITHOUT ROWID;
-- In a record's shard: the realm it counts toward, and the deltas not yet folded there
-- (seq from quota_seq, never reused).
CREATE TABLE IF NOT EXISTS file_realms (
    file_id INTEGER PRIMARY KEY, realm INTEGER NOT NULL, realm_key INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS quota_seq (id INTEGER PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS quota_deltas (
    seq INTEGER PRIMARY KEY, realm INTEGER NOT NULL, realm_key INTEGER NOT NULL,
    file_id INTEGER NOT NULL, d_bytes INTEGER NOT NULL, d_files INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS quota_deltas_realm ON quota_deltas (realm, realm_key, seq);
-- Reserved raw space (only used in the registry shard).
CREATE TABLE IF NOT EXISTS space_reservations (
    dir_id INTEGER PRIMARY KEY, raw_bytes INTEGER NOT NULL, expires_ns INTEGER NOT NULL);

-- Node registry (only used in the registry shard).
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY, address TEXT NOT NULL, failure_domain TEXT NOT NULL,
    capacity INTEGER NOT NULL, free INTEGER NOT NULL, registered_ns INTEGER NOT NULL
) WITHOUT ROWID;
"""


def _connect(path: Path, *, durable: bool = True) -> sqlite3.Connection:
    """``durable``: fsync at every commit (not for the etcd engine's copies: etcd has the
    durable copy, and a copy is rebuilt from it after any restart)."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30.0)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={'FULL' if durable else 'OFF'}")
    conn.execute("PRAGMA foreign_keys=OFF")
    return conn


@dataclass
class Mutation:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    done: trio.Event = field(default_factory=trio.Event)
    result: Any = None
    error: BaseException | None = None


@dataclass
class ShardStats:
    batches: int = 0
    mutations: int = 0
    largest_batch: int = 0


class ShardStore:
    """One logical shard's durable store with a group-committing writer (the sqlite
    engine's; the etcd engine's copy is ``ReplicatedStore``, metadata/etcd_engine.py, which
    changes how the file is made and how a batch commits)."""

    durable = True  # fsync at every commit
    max_changes = sys.maxsize  # rows one batch may change before the rest wait

    def __init__(self, data_dir: Path, shard: int, total_shards: int) -> None:
        self.shard = shard
        self.total_shards = total_shards
        self.path = Path(data_dir) / shard_file(shard)
        self._prepare()
        fresh = not self.path.exists()
        self._writer = _connect(self.path, durable=self.durable)
        # One transaction: one fsync for the whole schema instead of one per statement.
        self._writer.executescript("BEGIN IMMEDIATE;" + SCHEMA + "COMMIT;")
        self._adopt(fresh)
        quota_layer.install_accounting(self._writer)
        self.reader = _connect(self.path, durable=self.durable)
        self._queue: list[Mutation] = []
        self._has_work = trio.Event()
        self.stats = ShardStats()

    def _prepare(self) -> None:
        """Before the file is opened: a durable shard keeps the file it finds."""

    def _adopt(self, fresh: bool) -> None:
        """Once the schema is in: check the file's identity (or give a new file one)."""
        self._check_identity(fresh)

    def _check_identity(self, fresh: bool) -> None:
        """A shard file records which shard of how many it is: a moved or mislabelled file is
        refused instead of silently serving the wrong keys."""
        rows = dict(self._writer.execute("SELECT key, value FROM meta").fetchall())
        want = {"schema": SCHEMA_VERSION, "shard": self.shard, "total_shards": self.total_shards}
        if not rows:
            self._writer.execute("BEGIN IMMEDIATE")
            self._writer.executemany(
                "INSERT INTO meta (key, value) VALUES (?, ?)", list(want.items())
            )
            self._writer.execute("COMMIT")
            if fresh:
                fsync_path(self.path.parent)
            return
        for key, value in want.items():
            if rows.get(key) != value:
                raise ShardUnavailable(
                    f"{self.path}: {key} is {rows.get(key)!r}, this server expects {value!r}"
                )

    def read(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a read-only layer function on the reader connection (event loop thread)."""
        return fn(self.reader, *args)

    async def write(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Queue one mutation; return its result once the batch holding it is durable."""
        m = Mutation(fn, args)
        self._queue.append(m)
        self._has_work.set()
        await m.done.wait()
        if m.error is not None:
            raise m.error
        return m.result

    async def run(self, on_commit: Callable[[int, float], None] | None = None) -> None:
        """The committer task: forever take all queued mutations and commit them at once.
        ``on_commit(mutations, seconds)`` after each batch (the server's metrics)."""
        while True:
            await self._ready()
            await self._has_work.wait()
            batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
            if not self._queue:
                self._has_work = trio.Event()
            started = time.perf_counter()
            try:
                batch = await self._commit(batch)
            finally:
                for m in batch:
                    m.done.set()
            if on_commit is not None:
                on_commit(len(batch), time.perf_counter() - started)

    async def _ready(self) -> None:
        """Before each batch: a durable shard is always ready."""

    async def _commit(self, batch: list[Mutation]) -> list[Mutation]:
        """Apply and commit one batch (in a worker thread); returns the mutations it held."""
        await trio.to_thread.run_sync(self._apply, batch)
        return batch

    def _apply(self, batch: list[Mutation], *, commit: bool = True) -> None:
        """The batch in one transaction; committed unless ``commit`` is false (the etcd
        engine commits once etcd has the batch's rows)."""
        conn = self._writer
        try:
            conn.execute("BEGIN IMMEDIATE")
            start = conn.total_changes
            for i, m in enumerate(batch):
                conn.execute("SAVEPOINT op")
                try:
                    m.result = m.fn(conn, *m.args)
                except Exception as e:
                    if not isinstance(e, TectonicError):
                        log.exception("shard %d: mutation %s failed", self.shard, m.fn.__name__)
                    m.error = e
                    conn.execute("ROLLBACK TO op")
                conn.execute("RELEASE op")
                if conn.total_changes - start > self.max_changes:
                    self._queue[:0] = batch[i + 1 :]  # etcd's transaction limit: the rest wait
                    self._has_work.set()
                    del batch[i + 1 :]
                    break
            if commit:
                conn.execute("COMMIT")
        except sqlite3.Error as e:
            self._fail(batch, ShardUnavailable(f"shard {self.shard}: commit failed: {e}"))
            return
        self._count(batch)

    def _fail(self, batch: list[Mutation], err: TectonicError) -> None:
        log.error("shard %d: batch of %d mutations failed: %s", self.shard, len(batch), err)
        conn = self._writer
        if conn.in_transaction:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
        for m in batch:
            m.result, m.error = None, err

    def _count(self, batch: list[Mutation]) -> None:
        self.stats.batches += 1
        self.stats.mutations += len(batch)
        self.stats.largest_batch = max(self.stats.largest_batch, len(batch))

    def close(self) -> None:
        self.reader.close()
        self._writer.close()


def shard_file(shard: int) -> str:
    """The name of a shard's SQLite file in a data directory (and in a backup)."""
    return f"shard-{shard:05d}.db"


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by path (a directory: so a new entry in it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def now_ns() -> int:
    return time.time_ns()
