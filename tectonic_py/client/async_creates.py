"""Creates that do not wait: a file id delegated ahead of time, the create sent behind.

The kernel holds a directory's lock across the LOOKUP and CREATE of a new name, so the
creates of one directory run one at a time. A create that waits for a durable metadata
commit makes a step directory's ranks queue for one fsync each. Here, as in CephFS's
asynchronous creates, the client answers the create itself:

* **Ids delegated ahead.** Each shard hands the client a pool of file ids that hash to it
  (``name.delegate``), reserved durably, so the client knows the new inode's number
  before the shard has heard of the file, and a create sent again after a lost reply finds
  the record its id made.
* **Sent behind, batched.** ``start`` answers at once with the file's attrs and a
  ``PendingCreate``; the create goes out in a task of the client's nursery. The metadata
  client carries the calls made meanwhile in one ``batch`` frame per server, and the shard's
  group commit makes a burst of them one transaction.
* **Waited for where it matters.** A writer of a pending file has its metadata calls
  (commits, size, seal, lease) wait for the create first. ``fsync`` and ``close`` wait
  for it even when nothing was written, so close stays the durability point. A create
  that fails at the shard (the parent removed meanwhile, a delegation that expired, a
  directory of that name made by another mount) fails the file's next write, fsync or
  close with its error, and is logged.

Only ``O_CREAT|O_TRUNC`` without ``O_EXCL`` is answered this way, and the caller has to
believe the name is free. If another client took the name meanwhile, the create replaces
it (``replace``): the two are serialized as the later one's truncate and rewrite. An
exclusive create must know that exactly one of two racing clients wins, so it stays
synchronous.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import trio

from tectonic_py.core.errors import TectonicError, Unavailable
from tectonic_py.core.ids import new_id
from tectonic_py.core.records import KIND_FILE, Attrs

log = logging.getLogger(__name__)

POOL_TARGET = 256  # ids held per shard at first; a refill is asked for below half of it
MAX_POOL = 4096  # what a burst into one shard may grow its pool to (name.delegate's limit)
# A delegation lasts an hour on the server; ids older than this are dropped unused, so a
# create never carries an id whose reservation may have lapsed.
POOL_MAX_AGE_S = 1800.0


@dataclass(eq=False)
class PendingCreate:
    """One create answered before it was sent; ``wait`` returns when it is durable."""

    file_id: int
    dir_id: int
    name: str
    done: trio.Event = field(default_factory=trio.Event)
    error: BaseException | None = None
    attrs: Attrs | None = None

    async def wait(self) -> Attrs:
        await self.done.wait()
        if self.error is not None:
            raise self.error
        assert self.attrs is not None
        return self.attrs


@dataclass
class _Pool:
    ids: deque[tuple[int, float]] = field(default_factory=deque)
    target: int = POOL_TARGET  # doubled each time the pool runs dry, up to MAX_POOL
    refilling: bool = False
    failed_at: float = 0.0


class AsyncCreates:
    """The client's delegated ids, per shard, and its creates in flight."""

    REFILL_BACKOFF_S = 5.0  # after a failed refill, creates go synchronous this long

    def __init__(self, meta: Any, nursery: trio.Nursery, *, pool_target: int = POOL_TARGET):
        self.meta = meta
        self.nursery = nursery
        self.pool_target = max(1, pool_target)
        self._pools: dict[int, _Pool] = {}
        self.pending: dict[int, PendingCreate] = {}  # by file id
        self._by_dir: dict[int, dict[str, PendingCreate]] = {}
        self.started = 0  # creates answered without waiting
        self.failed = 0  # of those, the ones the shard refused
        self.dry = 0  # creates that found no id at hand (and waited)

    def prepare(self, dir_id: int) -> None:
        """Have ids of ``dir_id``'s shard at hand (asked for now if the pool is low), so
        that the creates about to come need not wait for them."""
        self._take_id(self.meta.shard_of(dir_id), take=False)

    def _take_id(self, shard: int, *, take: bool = True) -> int | None:
        pool = self._pools.get(shard)
        if pool is None:
            pool = self._pools[shard] = _Pool(target=self.pool_target)
        now = time.monotonic()
        while pool.ids and now - pool.ids[0][1] > POOL_MAX_AGE_S:
            pool.ids.popleft()
        if take and not pool.ids:
            # A burst outran the refills: hold more ids of this shard from now on.
            pool.target = min(MAX_POOL, pool.target * 2)
            self.dry += 1
        if (
            len(pool.ids) < pool.target // 2
            and not pool.refilling
            and now - pool.failed_at > self.REFILL_BACKOFF_S
        ):
            pool.refilling = True
            self.nursery.start_soon(self._refill, shard, pool)
        return pool.ids.popleft()[0] if pool.ids and take else None

    async def _refill(self, shard: int, pool: _Pool) -> None:
        try:
            ids, _ = await self.meta.delegate(shard, max(1, pool.target - len(pool.ids)))
            now = time.monotonic()
            pool.ids.extend((i, now) for i in ids)
        except TectonicError as e:
            pool.failed_at = time.monotonic()
            log.warning("no file ids delegated by shard %d (%s): creates wait meanwhile", shard, e)
        finally:
            pool.refilling = False

    def start(
        self,
        dir_id: int,
        name: str,
        *,
        mode: int,
        uid: int,
        gid: int,
        ec: str,
        chunk_size: int,
    ) -> tuple[Attrs, int, PendingCreate] | None:
        """``(attrs, token, pending)`` of a new file made without waiting, or None when no
        delegated id is at hand for the directory's shard (the caller creates synchronously;
        a refill is on its way)."""
        file_id = self._take_id(self.meta.shard_of(dir_id))
        if file_id is None:
            return None
        now = time.time_ns()
        attrs = Attrs(
            id=file_id,
            kind=KIND_FILE,
            mode=mode,
            uid=uid,
            gid=gid,
            atime_ns=now,
            mtime_ns=now,
            ctime_ns=now,
            ec=ec,
            chunk_size=chunk_size,
            writer=True,
        )
        token = new_id()
        pending = PendingCreate(file_id, dir_id, name)
        self.pending[file_id] = pending
        self._by_dir.setdefault(dir_id, {})[name] = pending
        self.started += 1
        self.nursery.start_soon(self._send, pending, attrs, token)
        return attrs, token, pending

    async def _send(self, pending: PendingCreate, attrs: Attrs, token: int) -> None:
        try:
            pending.attrs = await self.meta.create_delegated(
                pending.dir_id,
                pending.name,
                file_id=pending.file_id,
                token=token,
                mode=attrs.mode,
                uid=attrs.uid,
                gid=attrs.gid,
                ec=attrs.ec,
                chunk_size=attrs.chunk_size,
                replace=True,
            )
        except Exception as e:  # noqa: BLE001 (the file's next write, fsync or close reports it)
            pending.error = e
            self.failed += 1
            log.error(
                "create of %r in directory %d (file %d) failed after it was answered: %s: %s",
                pending.name,
                pending.dir_id,
                pending.file_id,
                type(e).__name__,
                e,
            )
        finally:
            if pending.attrs is None and pending.error is None:  # cancelled: the client closes
                pending.error = Unavailable(f"create of {pending.name!r} was not sent: closing")
            self.pending.pop(pending.file_id, None)
            in_dir = self._by_dir.get(pending.dir_id)
            if in_dir is not None and in_dir.get(pending.name) is pending:
                del in_dir[pending.name]
                if not in_dir:
                    del self._by_dir[pending.dir_id]
            pending.done.set()

    def of(self, file_id: int) -> PendingCreate | None:
        return self.pending.get(file_id)

    async def settle_file(self, file_id: int) -> None:
        """Return once the create of ``file_id`` (if one is in flight) is done, either way:
        a call about the file must not reach its shard before the file does."""
        pending = self.pending.get(file_id)
        if pending is not None:
            await pending.done.wait()

    async def settle_name(self, dir_id: int, name: str) -> None:
        """Return once the create of ``name`` in ``dir_id`` in flight (if any) is done: a
        lookup, unlink or rename of the name must not reach the shard before it."""
        pending = self._by_dir.get(dir_id, {}).get(name)
        if pending is not None:
            await pending.done.wait()

    async def settle_dir(self, dir_id: int) -> None:
        """Return once every create in flight in ``dir_id`` is done: a listing of the
        directory must find them."""
        while self._by_dir.get(dir_id):
            await next(iter(self._by_dir[dir_id].values())).done.wait()

    async def settle_all(self) -> None:
        while self.pending:
            await next(iter(self.pending.values())).done.wait()
