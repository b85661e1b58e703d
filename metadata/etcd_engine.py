"""The etcd engine: a shard's rows live in etcd; its owner serves them from a SQLite copy.

Why this shape: the layers are SQL over one SQLite connection per shard, and a shard has
exactly one writer (its owner, through its group committer). So the engine does not
translate the layers into key-value calls: it captures, per group-commit batch, which rows
the batch changed (temporary triggers on the writer connection, so nothing in the shard's
schema changes and the sqlite engine is untouched), and writes those rows to etcd in ONE
transaction before the SQLite transaction commits. The etcd transaction carries one compare:
the shard's owner key still has the create revision this server got when it took the shard.
A server that lost the shard (its lease expired while it was paused or cut off) has its
batch refused by etcd, rolls back, and stops serving the shard; two servers can never both
commit. That single fence replaces a compare per key read (etcd's STM) because nobody else
writes a shard's keys.

Keys (``P`` is the cluster's prefix)::

    P/shard/NNNNN/row/<table>/<primary key as JSON>   msgpack {column: value}
    P/owner/NNNNN                                     msgpack {address}, on the owner's lease

The SQLite copy (``ReplicatedStore``, a ``ShardStore`` whose batches commit this way) is a
cache: it is rebuilt from etcd whenever a server takes a shard (or after an etcd commit whose
outcome is unknown), and written without fsync.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgpack
import trio

from metadata import quota_layer
from metadata.shard import SCHEMA_VERSION, Mutation, ShardStore
from tectonic_py.core.errors import ShardUnavailable, TectonicError, WrongShard
from tectonic_py.core.etcd_client import (
    Compare,
    EtcdClient,
    KeyValue,
    delete_op,
    put_op,
)

log = logging.getLogger(__name__)

# etcd's transaction limit is set above this by the launcher (tectonic_py/launch/local_etcd.py); a
# batch stops taking mutations once it has changed this many rows.
MAX_CHANGES = 8000
_SKIP_TABLES = frozenset({"sqlite_sequence"})


def shard_prefix(prefix: str, shard: int) -> bytes:
    return f"{prefix}/shard/{shard:05d}/".encode()


def owner_key(prefix: str, shard: int) -> bytes:
    return f"{prefix}/owner/{shard:05d}".encode()


def _tables(conn: sqlite3.Connection) -> dict[str, tuple[list[str], list[str]]]:
    """Every table of the shard: its columns, and its primary key columns in key order."""
    names = [
        r[0]
        for r in conn.execute("SELECT name FROM main.sqlite_master WHERE type = 'table'")
        if r[0] not in _SKIP_TABLES
    ]
    out = {}
    for name in names:
        info = conn.execute(f"PRAGMA main.table_info({name})").fetchall()
        columns = [row[1] for row in info]
        pk = [row[1] for row in sorted((r for r in info if r[5]), key=lambda r: r[5])]
        out[name] = (columns, pk or ["rowid"])
    return out


class ShardReplica:
    """Keeps one shard's etcd keys equal to its SQLite copy, batch by batch."""

    def __init__(self, etcd: EtcdClient, prefix: str, shard: int, owner_revision: int) -> None:
        self.etcd = etcd
        self.prefix = prefix
        self.shard = shard
        self.owner_revision = owner_revision
        self.rows = shard_prefix(prefix, shard) + b"row/"
        self.max_changes = MAX_CHANGES
        self._tables: dict[str, tuple[list[str], list[str]]] = {}

    # --- change capture (writer connection, worker thread) ----------------------------------

    def install(self, conn: sqlite3.Connection) -> None:
        """Temporary triggers that note the primary key of every row a statement touches."""
        self._tables = _tables(conn)
        conn.execute(
            "CREATE TEMP TABLE IF NOT EXISTS _changes"
            " (tbl TEXT NOT NULL, pk TEXT NOT NULL, PRIMARY KEY (tbl, pk)) WITHOUT ROWID"
        )
        for table, (_, pk) in self._tables.items():
            for event, refs in (
                ("INSERT", ["NEW"]),
                ("UPDATE", ["OLD", "NEW"]),
                ("DELETE", ["OLD"]),
            ):
                body = " ".join(
                    f"INSERT OR IGNORE INTO _changes VALUES ('{table}',"
                    f" json_array({', '.join(f'{ref}.{c}' for c in pk)}));"
                    for ref in refs
                )
                conn.execute(
                    f"CREATE TEMP TRIGGER IF NOT EXISTS _capture_{table}_{event.lower()}"
                    f" AFTER {event} ON main.{table} BEGIN {body} END"
                )

    def collect(self, conn: sqlite3.Connection) -> list[dict[str, Any]]:
        """The etcd operations that bring the shard's keys to the state of the open
        transaction, and the change list emptied for the next batch."""
        ops = []
        for table, pk_text in conn.execute("SELECT tbl, pk FROM _changes").fetchall():
            columns, pk = self._tables[table]
            values = json.loads(pk_text)
            where = " AND ".join(f"{c} IS ?" for c in pk)
            row = conn.execute(
                f"SELECT {', '.join(columns)} FROM main.{table} WHERE {where}", values
            ).fetchone()
            key = self.rows + f"{table}/{pk_text}".encode()
            if row is None:
                ops.append(delete_op(key))
            else:
                ops.append(put_op(key, msgpack.packb(dict(zip(columns, row, strict=True)))))
        conn.execute("DELETE FROM _changes")
        return ops

    def discard(self, conn: sqlite3.Connection) -> None:
        conn.execute("DELETE FROM _changes")

    # --- etcd (event loop) --------------------------------------------------------------------

    async def commit(self, ops: Sequence[dict[str, Any]]) -> None:
        """Write one batch's rows, fenced by this server's ownership of the shard.

        ``WrongShard``: the fence failed, nothing was written, the shard is someone else's.
        ``ShardUnavailable``: etcd could not be reached; whether the batch was written is
        unknown, so the caller rebuilds its copy from etcd before serving again."""
        if not ops:
            return
        fence = Compare(owner_key(self.prefix, self.shard), "CREATE", self.owner_revision)
        try:
            result = await self.etcd.txn([fence], ops)
        except TectonicError as e:
            raise ShardUnavailable(f"shard {self.shard}: etcd commit failed: {e.message}") from None
        if not result.succeeded:
            raise WrongShard(f"shard {self.shard}: this server no longer owns it")

    async def load(self, conn: sqlite3.Connection) -> int:
        """Replace every row of the SQLite copy with what etcd holds, read from one etcd
        revision (the caller runs nothing else on ``conn`` meanwhile); returns the rows."""
        rows = [kv async for kv in self.etcd.scan(self.rows)]
        return await trio.to_thread.run_sync(self._replace, conn, rows)

    def _replace(self, conn: sqlite3.Connection, kvs: list[KeyValue]) -> int:
        tables = _tables(conn)
        pending: dict[str, list[tuple[Any, ...]]] = {}
        for kv in kvs:
            table = kv.key[len(self.rows) :].split(b"/", 1)[0].decode()
            if table not in tables:
                raise ShardUnavailable(f"shard {self.shard}: etcd holds rows of table {table!r}")
            row = msgpack.unpackb(kv.value)
            pending.setdefault(table, []).append(tuple(row.get(c) for c in tables[table][0]))
        quota_layer.remove_accounting(conn)  # the rows come as they are: nothing to count
        conn.execute("BEGIN IMMEDIATE")
        try:
            for table in tables:
                conn.execute(f"DELETE FROM main.{table}")
            for table, values in pending.items():
                columns = tables[table][0]
                marks = ", ".join("?" for _ in columns)
                conn.executemany(
                    f"INSERT INTO main.{table} ({', '.join(columns)}) VALUES ({marks})", values
                )
            self.discard(conn)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        finally:
            quota_layer.install_accounting(conn)
        return len(kvs)


class ReplicatedStore(ShardStore):
    """A shard's SQLite copy under the etcd engine: made anew here, filled from etcd by
    ``load_replica``, each batch's rows written to etcd (``ShardReplica``) before it
    commits here."""

    durable = False  # etcd has the durable copy; this one is rebuilt after any restart

    def __init__(self, data_dir: Path, shard: int, total_shards: int, replica: ShardReplica):
        self.replica = replica
        self.max_changes = replica.max_changes
        self.stale = False  # an etcd commit of unknown outcome: reload before serving
        self.lost = False  # etcd refused a batch's fence: another server owns the shard now
        super().__init__(data_dir, shard, total_shards)

    def _prepare(self) -> None:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{self.path}{suffix}").unlink(missing_ok=True)

    def _adopt(self, fresh: bool) -> None:
        self.replica.install(self._writer)

    async def load_replica(self) -> int:
        """Fill the copy from etcd; a shard etcd has never held gets its identity rows there
        first. Returns the number of rows loaded."""
        rows = await self.replica.load(self._writer)
        if rows == 0:
            ops = await trio.to_thread.run_sync(self._identity_ops)
            try:
                await self.replica.commit(ops)
            except BaseException:
                await trio.to_thread.run_sync(self._writer.execute, "ROLLBACK")
                raise
            await trio.to_thread.run_sync(self._writer.execute, "COMMIT")
        self._check_identity(fresh=False)
        self.stale = False
        return rows

    def _identity_ops(self) -> list[dict[str, Any]]:
        want = {"schema": SCHEMA_VERSION, "shard": self.shard, "total_shards": self.total_shards}
        self._writer.execute("BEGIN IMMEDIATE")
        self._writer.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", list(want.items()))
        return self.replica.collect(self._writer)

    def read(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.stale:
            raise ShardUnavailable(f"shard {self.shard}: reloading from etcd")
        return super().read(fn, *args)

    async def _ready(self) -> None:
        if self.stale:
            await self._reload()

    async def _commit(self, batch: list[Mutation]) -> list[Mutation]:
        """Apply, send the changed rows to etcd in one fenced transaction, then commit.

        A refused fence (``WrongShard``) fails the batch: the server gives the shard up. An
        etcd failure leaves the outcome unknown: the batch fails and the copy is rebuilt
        from etcd before this shard serves again."""
        await trio.to_thread.run_sync(lambda: self._apply(batch, commit=False))
        if not self._writer.in_transaction:
            return batch  # the SQLite side failed; the batch holds its error
        ops = await trio.to_thread.run_sync(self.replica.collect, self._writer)
        try:
            await self.replica.commit(ops)
        except TectonicError as e:
            await trio.to_thread.run_sync(self._fail, batch, e)
            if isinstance(e, WrongShard):
                self.lost = True
            else:
                self.stale = True
            return batch
        try:
            await trio.to_thread.run_sync(self._writer.execute, "COMMIT")
        except sqlite3.Error as e:
            self.stale = True  # etcd has the batch; the copy does not
            self._fail(batch, ShardUnavailable(f"shard {self.shard}: local commit failed: {e}"))
        return batch

    def _fail(self, batch: list[Mutation], err: TectonicError) -> None:
        super()._fail(batch, err)
        self.replica.discard(self._writer)

    async def _reload(self) -> None:
        while True:
            try:
                await self.load_replica()
                return
            except TectonicError as e:
                log.warning("shard %d: reload from etcd failed (%s); retrying", self.shard, e)
                await trio.sleep(1.0)
