"""Client of the metadata service: routes each call to the shard that owns its key.

CONTRACT (the data-path client in tectonic_py/client/ and the FUSE layer code against these
signatures; the metadata implementation fills them in without changing them):

Every method raises only ``tectonic_py.core.errors`` classes (FileNotFound, FileExists,
NotADirectory, IsADirectory, DirectoryNotEmpty, InvalidName, StaleWriterToken, FileSealed,
ShardUnavailable, NoSpace, ...). Operations that span layers (create = File layer record in
the file's shard + Name layer entry in the directory's shard; commit = Block layer in the
block's shard + File layer append in the file's shard) are sequenced here so that a crash
between steps leaves only garbage that is collected later, never a visible half-done state.

Routing: shard = ``shard_of(key, S)``; Name-layer calls go to ``shard_of(dir_id)``, File-layer
calls to ``shard_of(file_id)``, Block-layer calls to ``shard_of(block_id)``. New files,
directories and blocks go to a shard picked at random (spreading a burst of creates from a
thousand ranks over every server); that shard draws the id (so ids need no central counter).

Sequencing across shards (what a crash in the middle leaves):

* create (a file): one transaction in the directory's shard (``name.create``: the record, its
  id drawn to hash there, and the Name entry; metadata/write_ops.py). Nothing to undo.
* mkdir: File record (unnamed) in a shard drawn at random, so directories spread over every
  server -> Name entry -> link (marks it named). Crash: an unnamed record, found by
  ``file.orphans``.
* unlink: one transaction in the directory's shard when the file's record is there (a file
  created in that directory: ``name.unlink``). Else Name entry removed -> File record
  unlinked in its own shard (blocks queued for GC). Crash between: a named record no entry
  reaches, kept (never a dangling name).
* rmdir: directory killed in its own shard (emptiness checked atomically, creates refused) ->
  Name entry removed -> record dropped. Crash: a dead, empty directory still listed; rmdir
  again completes it.
* rename: one transaction when both directories share a shard; else the intent protocol of
  metadata/name_layer.py (both names briefly visible, never neither).
* commit_blocks / close: a writer's blocks are allocated in its file's shard, so the Block
  layer commit, the File layer append (and for ``close`` the seal) are one transaction there
  (``file.commit``, ``file.close``). Blocks in other shards are committed there first. Crash:
  a committed block no file references (GC), never a file pointing at an uncommitted block.

Placement: the client places a block's chunks itself (metadata/placement.py) over the node
list it fetched from the registry at most ``NODE_LIST_TTL_S`` ago (one ``node.list`` per
client per interval, shared by every writer of the process, never a registry round trip per
block). The registry's view is a heartbeat old anyway; a node that died since is handled as
any failed put is (hedges, ``more_nodes``).

Directory policies (EC scheme and chunk size that new files inherit) are cached for
``DIR_POLICY_TTL_S``: a policy change reaches other clients' new files within that time.

Coalescing: the ranks of one process (a load-test worker's hundreds, a mount's eight) call
the same servers at once. While ``MAX_BATCHES_IN_FLIGHT`` calls to a server are in flight, the
next calls of the write and read paths (``_COALESCED_OPS``) wait in that server's queue and
leave together as one ``batch`` request when one returns: the server answers every item in
one frame and their mutations share its shards' transactions. Each item keeps its own result,
its own error and its own retries; a lost batch is a lost request for each item in it.

Connections: ``POOL_SIZE`` multiplexed connections per server, made lazily and replaced when
broken. A server that is restarting (kill -9, then its supervisor starts it again) refuses
connections for a few seconds, so a connection failure is retried with backoff until
``reconnect_deadline`` (``RECONNECT_DEADLINE_S`` by default) has passed: for requests that are
safe to repeat (reads, and the mutations of ``_REPEATABLE_OPS`` or whose caller recognises a
repeat's outcome: a create by its client-drawn token) always, for other mutations only when
the request never left (connect failed), because a mutation whose reply was lost may have
committed. ``Busy`` (admission control, a pinned rename) is retried with backoff a bounded
number of times (both through ``tectonic_py.core.retry``). A server still unreachable at the
deadline is ``ShardUnavailable``. Until some server has answered the client, only a few quick
tries are made: nothing is known to be restarting, and a wrong cluster file should be said at
once.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import trio

from metadata import placement
from metadata.checkpoint_client import CheckpointCalls
from tectonic_py.core import rpc_client, sockets
from tectonic_py.core.cluster_file import REGISTRY_SHARD, ClusterConfig
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import (
    Busy,
    DirectoryNotEmpty,
    FileExists,
    FileNotFound,
    FileSealed,
    InvalidArgument,
    IsADirectory,
    NoSpace,
    NotADirectory,
    ProtocolError,
    ShardUnavailable,
    TectonicError,
    Unavailable,
    WrongShard,
    error_from_code,
)
from tectonic_py.core.ids import ROOT_ID, new_id, shard_of
from tectonic_py.core.records import (
    KIND_DIR,
    KIND_FILE,
    KIND_SYMLINK,
    Attrs,
    BlockGrant,
    BlockInfo,
    DirEntry,
    NodeInfo,
    validate_name,
)
from tectonic_py.core.retry import RetryPolicy, retry

log = logging.getLogger(__name__)

T = TypeVar("T")

POOL_SIZE = 4
DIR_POLICY_TTL_S = 2.0
NODE_LIST_TTL_S = 2.0
# Busy (admission control, a pinned rename): 50 retries, pauses growing from 5 ms to 200 ms,
# about 6 s of pauses in all before the caller sees it.
BUSY_POLICY = RetryPolicy(attempts=51, first_delay=0.005, multiplier=1.15, max_delay=0.2)
# A lost connection or a server that is restarting: tries until the deadline, pauses growing
# from 20 ms to 500 ms, so a server back after a second is found within a pause of it.
RECONNECT_DEADLINE_S = 10.0


# Before any server has answered, nothing is known to be restarting: a cluster file that names
# the wrong addresses, or a cluster that is down, is said within a moment, not after the
# reconnect deadline.
FIRST_CONTACT_POLICY = RetryPolicy(attempts=3, first_delay=0.05, multiplier=2.0, max_delay=0.1)


def reconnect_policy(deadline: float) -> RetryPolicy:
    """How connection failures are retried: until ``deadline`` seconds after the first try
    (0: the first try only)."""
    return RetryPolicy(
        attempts=None, deadline=deadline, first_delay=0.02, multiplier=2.0, max_delay=0.5
    )


CALL_TIMEOUT_S = 120.0
# Under the etcd engine: a server that cannot be reached for this long is asked about no
# more; the client asks another server where the shard went (a dead owner's lease lapses in
# a few seconds, and another server takes the shard).
FOLLOW_POLICY = RetryPolicy(
    attempts=None, deadline=0.3, first_delay=0.02, multiplier=2.0, max_delay=0.1
)
OWNERS_POLICY = RetryPolicy(attempts=2, first_delay=0.02, max_delay=0.05)
FOLLOW_PAUSE_S = 0.1
FOLLOW_CALL_TIMEOUT_S = 10.0
RENAME_DEADLINE_S = 30.0
_READ_OPS = frozenset(
    {
        "name.lookup",
        "name.list",
        "name.intents",
        "file.get",
        "file.blocks",
        "file.getxattr",
        "file.listxattr",
        "file.readlink",
        "file.orphans",
        "file.gc_blocks",
        "block.locate",
        "block.by_node",
        "block.durability",
        "node.list",
        "server.stats",
    }
)


# Mutations whose repeat after a lost reply does no harm: a second allocation, a second File
# record (file.create: it is never named) are garbage the GC collects; a commit of the same
# blocks at the same indexes, a size, a lease renewal, a link hint, a drop land the same.
# (name.create carries its writer token, name.insert a fresh record's id, file.close is
# checked by its caller: each is sent again by the caller that can read a repeat's outcome.)
_REPEATABLE_OPS = frozenset(
    {
        "block.allocate",
        "block.grant",
        "block.commit",
        "file.commit",
        "file.create",
        "file.drop",
        "file.link",
        "file.set_size",
        "file.renew",
    }
)


# Ops that coalesce into ``batch`` requests (module docstring): the burst's reads and its
# small mutations, each answered quickly; never the maintenance ops with long replies.
_COALESCED_OPS = frozenset(
    {
        "name.lookup",
        "name.create",
        "name.remove",
        "name.unlink",
        "file.get",
        "file.open",
        "file.close",
        "file.commit",
        "file.unlink",
        "file.renew",
        "file.seal",
        "file.set_size",
        "block.allocate",
        "block.grant",
        "block.commit",
        "block.locate",
    }
)
MAX_BATCHES_IN_FLIGHT = 2  # per server: calls (batches) out before the next ones queue
MAX_BATCH_OPS = 256  # items in one batch request (the server takes up to 512)
# A call whose lists (entries, blocks, ids) hold more than this goes alone: a batch of such
# calls, or of their replies, could pass a frame's header limit.
MAX_COALESCED_LIST = 4
_LONG_LISTS = ("entries", "blocks", "ids")


def _coalesces(op: str, fields: dict[str, Any]) -> bool:
    if op not in _COALESCED_OPS:
        return False
    return sum(len(fields.get(k, ())) for k in _LONG_LISTS) <= MAX_COALESCED_LIST


class _Item:
    """One call waiting in a server's queue, and what became of it."""

    __slots__ = ("done", "error", "fields", "op", "result", "sent", "timeout")

    def __init__(self, op: str, fields: dict[str, Any], timeout: float) -> None:
        self.op = op
        self.fields = fields
        self.timeout = timeout
        self.sent = False  # it left this process (a mutation's outcome is then unknown)
        self.done = trio.Event()
        self.result: dict[str, Any] | None = None
        self.error: TectonicError | None = None


class _Coalescer:
    """One server's queue of calls: at most ``MAX_BATCHES_IN_FLIGHT`` requests out, the
    calls made meanwhile sent together as one ``batch`` when one returns (module
    docstring). The batches' sender tasks live in the client's nursery; a caller cancelled
    while its call is queued takes it out of the queue."""

    def __init__(
        self,
        address: str,
        connect: Callable[[str], Awaitable[rpc_client.Connection]],
        nursery: trio.Nursery,
    ) -> None:
        self.address = address
        self._connect = connect
        self._nursery = nursery
        self._queue: list[_Item] = []
        self._in_flight = 0
        self.batches = 0  # batch requests sent (tests and the load test's report read it)
        self.batched_ops = 0

    async def call(self, item: _Item) -> dict[str, Any]:
        if self._in_flight < MAX_BATCHES_IN_FLIGHT and not self._queue:
            self._in_flight += 1
            try:
                conn = await self._connect(self.address)
                item.sent = True
                return (await conn.call(item.op, item.fields)).fields
            finally:
                self._in_flight -= 1
                self._flush()
        self._queue.append(item)
        try:
            await item.done.wait()
        finally:
            if not item.done.is_set() and item in self._queue:
                self._queue.remove(item)
        if item.error is not None:
            raise item.error
        assert item.result is not None
        return item.result

    def _flush(self) -> None:
        while self._queue and self._in_flight < MAX_BATCHES_IN_FLIGHT:
            items, self._queue = self._queue[:MAX_BATCH_OPS], self._queue[MAX_BATCH_OPS:]
            try:
                self._nursery.start_soon(self._send, items)
            except RuntimeError:  # the client's nursery is closing: nothing more is sent
                for item in items:
                    item.error = ShardUnavailable("the metadata client is closed")
                    item.done.set()
                continue
            self._in_flight += 1

    async def _send(self, items: list[_Item]) -> None:
        try:
            with trio.move_on_after(max(i.timeout for i in items)) as scope:
                await self._send_batch(items)
            if scope.cancelled_caught:
                error = ShardUnavailable(f"metadata server {self.address}: batch timed out")
                for item in items:
                    item.error = error
        except TectonicError as e:
            for item in items:
                item.error = e
        finally:
            for item in items:
                if item.result is None and item.error is None:
                    item.error = Unavailable(f"{self.address}: batch not answered")
                item.done.set()
            self._in_flight -= 1
            self._flush()

    async def _send_batch(self, items: list[_Item]) -> None:
        conn = await self._connect(self.address)
        for item in items:
            item.sent = True
        if len(items) == 1:
            items[0].result = (await conn.call(items[0].op, items[0].fields)).fields
            return
        self.batches += 1
        self.batched_ops += len(items)
        r = await conn.call("batch", {"ops": [[i.op, i.fields] for i in items]})
        results = r.fields.get("results")
        if not isinstance(results, list) or len(results) != len(items):
            raise ProtocolError(f"{self.address}: a batch reply without one result per op")
        for item, res in zip(items, results, strict=True):
            if not isinstance(res, dict):
                raise ProtocolError(f"{self.address}: malformed batch result")
            if "err" in res:
                item.error = error_from_code(
                    str(res["err"]), f"{res.get('msg', '')} [{self.address}]"
                )
            else:
                fields = res.get("f")
                if not isinstance(fields, dict):
                    raise ProtocolError(f"{self.address}: malformed batch result")
                item.result = fields


def _is_busy(e: TectonicError) -> bool:
    return isinstance(e, Busy)


def capacity_of(nodes: Sequence[NodeInfo]) -> tuple[int, int]:
    """(capacity, free) of these chunk stores, a shared filesystem counted once: each store
    reports its whole disk, so stores on one disk would count it once per store. Within a
    group that shares a filesystem, capacity and free are the stores' sums bounded by the
    filesystem's own size and free space (stores with a configured capacity are quotas of
    it)."""
    groups: dict[str, list[NodeInfo]] = {}
    for n in nodes:
        groups.setdefault(n.fs_id or f"node:{n.node_id}", []).append(n)
    capacity = free = 0
    for members in groups.values():
        cap = sum(n.capacity for n in members)
        fr = sum(n.free for n in members)
        sized = [n for n in members if n.fs_total]
        if sized:
            cap = min(cap, max(n.fs_total for n in sized))
            fr = min(fr, min(n.fs_free for n in sized))
        capacity += cap
        free += fr
    return capacity, free


class MetadataClient(CheckpointCalls):
    """One per process; owns pooled connections to every metadata server. The calls of
    checkpoints (durability, the atomic commit of a step) come from ``CheckpointCalls``
    (metadata/checkpoint_client.py)."""

    def __init__(
        self,
        config: ClusterConfig,
        *,
        nursery: trio.Nursery,
        reconnect_deadline: float = RECONNECT_DEADLINE_S,
    ) -> None:
        """``reconnect_deadline``: how long a call waits for a server that cannot be reached
        (a restart) before it is ``ShardUnavailable``, once some server has answered this
        client (before that, a few quick tries); a tool that reports down servers rather than
        waiting for them passes 0."""
        self.config = config
        self._reconnect = reconnect_policy(reconnect_deadline)
        # a takeover (a lease to lapse, shards to load) plus a call that timed out on the way
        self._follow_deadline = max(reconnect_deadline, 1.0) + 2 * FOLLOW_CALL_TIMEOUT_S
        self._reached = False  # some metadata server has answered this client
        self._nursery = nursery
        self._secret = config.credential()
        self._shard_addr = {
            s: server.address for server in config.metadata_servers for s in server.shards
        }
        self._pools: dict[str, list[rpc_client.Connection | None]] = {}
        self._pool_locks: dict[tuple[str, int], trio.Lock] = {}
        self._coalescers: dict[str, _Coalescer] = {}
        self._next = 0
        self._dir_policy: dict[int, tuple[float, str, int]] = {}
        self._node_cache: dict[str, NodeInfo] = {}
        self._nodes_at = -NODE_LIST_TTL_S  # time.monotonic() of the last node.list
        self._nodes_lock = trio.Lock()
        self._rng = random.Random()
        self._closed = False

    async def aclose(self) -> None:
        self._closed = True
        pools, self._pools = self._pools, {}
        with trio.CancelScope(shield=True):
            for pool in pools.values():
                for conn in pool:
                    if conn is not None:
                        await conn.aclose()

    # --- plumbing -------------------------------------------------------------------------------

    async def _connection(self, address: str) -> rpc_client.Connection:
        pool = self._pools.setdefault(address, [None] * POOL_SIZE)
        self._next = (self._next + 1) % POOL_SIZE
        slot = self._next
        conn = pool[slot]
        if conn is not None and conn.broken is None:
            return conn
        lock = self._pool_locks.setdefault((address, slot), trio.Lock())
        async with lock:
            conn = pool[slot]
            if conn is not None and conn.broken is None:
                return conn
            if self._closed:
                raise ShardUnavailable("the metadata client is closed")
            host, port = sockets.parse_address(address)
            conn = await rpc_client.Connection.connect(
                host, port, self._secret, nursery=self._nursery
            )
            self._reached = True
            pool[slot] = conn
            return conn

    async def _call(
        self,
        address: str,
        op: str,
        fields: dict[str, Any],
        *,
        repeat: bool = False,
        reconnect: RetryPolicy | None = None,
        trace: dict[str, bool] | None = None,
        timeout: float = CALL_TIMEOUT_S,
    ) -> dict[str, Any]:
        """One request, ``Busy`` retried under ``BUSY_POLICY`` and a lost connection under
        the reconnect policy (or ``reconnect``): a read or an op safe to repeat
        (``_REPEATABLE_OPS``, or ``repeat``: the caller handles a repeat's outcome) always,
        any other mutation only if it never left this process. ``trace["repeatable"]`` says,
        after a failure, whether the request may be sent again elsewhere; ``trace["lost"]``,
        that a try left and got no answer, so that an answer after it may be a repeat's (a
        caller reads a repeat's FileNotFound by it); ``timeout`` bounds each try (a server
        that took the connection but does not answer: a paused one)."""
        idempotent = repeat or op in _READ_OPS or op in _REPEATABLE_OPS
        sent = False
        if trace is not None:
            trace["repeatable"] = True

        def note_lost() -> None:
            if sent and trace is not None:
                trace["lost"] = True  # it left and no answer came: it may have landed

        async def once() -> dict[str, Any]:
            nonlocal sent
            sent = False
            try:
                with trio.fail_after(timeout):
                    if _coalesces(op, fields):
                        item = _Item(op, fields, timeout)
                        try:
                            return await self._coalescer(address).call(item)
                        finally:
                            sent = item.sent
                            if trace is not None and sent:
                                trace["repeatable"] = idempotent
                    conn = await self._connection(address)
                    sent = True
                    if trace is not None:
                        trace["repeatable"] = idempotent
                    return (await conn.call(op, fields)).fields
            except trio.TooSlowError:
                note_lost()
                raise ShardUnavailable(f"metadata server {address}: {op} timed out") from None
            except (Unavailable, ShardUnavailable):
                note_lost()
                raise

        def may_repeat(e: TectonicError) -> bool:
            return isinstance(e, Unavailable) and (idempotent or not sent)

        busy_retried = functools.partial(retry, once, policy=BUSY_POLICY, when=_is_busy)
        try:
            policy = reconnect or (self._reconnect if self._reached else FIRST_CONTACT_POLICY)
            return await retry(busy_retried, policy=policy, when=may_repeat)
        except Unavailable as e:
            raise ShardUnavailable(
                f"metadata server {address} unavailable during {op}: {e.message}"
            ) from None

    def _coalescer(self, address: str) -> _Coalescer:
        c = self._coalescers.get(address)
        if c is None:
            c = self._coalescers[address] = _Coalescer(address, self._connection, self._nursery)
        return c

    def batch_stats(self) -> dict[str, int]:
        """Batch requests sent and the calls they carried, over every server."""
        cs = self._coalescers.values()
        return {"batches": sum(c.batches for c in cs), "ops": sum(c.batched_ops for c in cs)}

    async def _shard(
        self,
        shard: int,
        op: str,
        *,
        repeat: bool = False,
        trace: dict[str, bool] | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        """``repeat``, ``trace``: as for ``_call`` (the caller handles a repeated mutation's
        outcome; ``trace["lost"]`` says whether there may have been one)."""
        fields["shard"] = shard
        if self.config.metadata_engine == "sqlite":
            return await self._call(self._shard_addr[shard], op, fields, repeat=repeat, trace=trace)
        return await self._followed(shard, op, fields, repeat=repeat, trace=trace)

    async def _followed(
        self,
        shard: int,
        op: str,
        fields: dict[str, Any],
        *,
        repeat: bool = False,
        trace: dict[str, bool] | None = None,
    ) -> dict[str, Any]:
        """Under the etcd engine shards move between servers: a refusal (``WrongShard``) or
        a server that cannot be reached sends the request where ``server.owners`` says the
        shard is now, until the reconnect deadline. A mutation that reached a server which
        then died is sent again only if it is safe to repeat (``_call``): it may have
        committed."""
        give_up = trio.current_time() + self._follow_deadline
        trace = {} if trace is None else trace  # one for all tries: "lost" spans servers
        while True:
            address = self._shard_addr[shard]
            try:
                return await self._call(
                    address,
                    op,
                    fields,
                    repeat=repeat,
                    reconnect=FOLLOW_POLICY,
                    trace=trace,
                    timeout=FOLLOW_CALL_TIMEOUT_S,
                )
            except (WrongShard, ShardUnavailable) as e:
                unsent = isinstance(e, WrongShard) or trace.get("repeatable", False)
                if not unsent or trio.current_time() > give_up:
                    raise
            await self._refresh_owners(avoid=address)
            if self._shard_addr[shard] == address:
                await trio.sleep(FOLLOW_PAUSE_S)

    async def _refresh_owners(self, *, avoid: str) -> None:
        """Learn every shard's owner from the first server that answers."""
        addresses = [s.address for s in self.config.metadata_servers]
        addresses += sorted(set(self._shard_addr.values()) - set(addresses))
        for address in sorted(addresses, key=lambda a: a == avoid):
            try:
                r = await self._call(
                    address, "server.owners", {}, reconnect=OWNERS_POLICY, timeout=2.0
                )
            except TectonicError:
                continue
            for shard, owner in r["owners"].items():
                self._shard_addr[int(shard)] = str(owner)
            return

    def _of(self, key: int) -> int:
        return shard_of(key, self.config.shards)

    async def _registry(self, op: str, **fields: Any) -> dict[str, Any]:
        if self.config.metadata_engine == "sqlite":
            return await self._call(self._shard_addr[REGISTRY_SHARD], op, fields)
        return await self._followed(REGISTRY_SHARD, op, fields)

    async def _gather(self, jobs: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
        """Run jobs concurrently; raise the first domain error (never an exception group)."""
        results: list[Any] = [None] * len(jobs)
        errors: list[TectonicError] = []

        async def run(i: int, job: Callable[[], Awaitable[T]]) -> None:
            try:
                results[i] = await job()
            except TectonicError as e:
                errors.append(e)

        async with trio.open_nursery() as nursery:
            for i, job in enumerate(jobs):
                nursery.start_soon(run, i, job)
        if errors:
            raise errors[0]
        return results

    # --- Name layer (+ File layer records of new entries) ----------------------------------

    async def lookup(self, dir_id: int, name: str) -> Attrs:
        """Attrs of the child ``name`` of ``dir_id``; FileNotFound if absent."""
        validate_name(name)
        r = await self._shard(self._of(dir_id), "name.lookup", dir=dir_id, name=name)
        if "attrs" in r:
            return Attrs.from_wire(r["attrs"])
        return await self.getattr(r["id"])

    async def getattr(self, file_id: int) -> Attrs:
        r = await self._shard(self._of(file_id), "file.get", id=file_id)
        attrs = Attrs.from_wire(r["attrs"])
        self._note_policy(attrs)
        return attrs

    def _note_policy(self, attrs: Attrs) -> None:
        if attrs.is_dir:
            self._dir_policy[attrs.id] = (
                time.monotonic() + DIR_POLICY_TTL_S,
                attrs.ec,
                attrs.chunk_size,
            )

    async def resolve(self, path: str) -> Attrs:
        """Walk an absolute path ('/a/b') from the root directory."""
        if not path.startswith("/"):
            raise InvalidArgument(f"not an absolute path: {path!r}")
        parts = [p for p in path.split("/") if p]
        if not parts:
            return await self.getattr(ROOT_ID)
        current, kind, attrs = ROOT_ID, KIND_DIR, None
        for part in parts:
            # Directories on the way need only their id and kind, which name.lookup gives.
            if kind != KIND_DIR:
                raise NotADirectory(f"{part!r}: a component before it is not a directory")
            validate_name(part)
            r = await self._shard(self._of(current), "name.lookup", dir=current, name=part)
            current, kind, attrs = r["id"], r["kind"], r.get("attrs")
        if attrs is None:
            return await self.getattr(current)
        found = Attrs.from_wire(attrs)
        self._note_policy(found)
        return found

    async def _policy(self, dir_id: int) -> tuple[str, int]:
        cached = self._dir_policy.get(dir_id)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1], self._chunk_size(dir_id, cached[2])
        attrs = await self.getattr(dir_id)
        if not attrs.is_dir:
            raise NotADirectory(f"{dir_id} is not a directory")
        return attrs.ec, self._chunk_size(dir_id, attrs.chunk_size)

    def _chunk_size(self, dir_id: int, recorded: int) -> int:
        """The root directory is made by the server, which has no cluster file: its files
        and subdirectories take the cluster file's ``chunk_size``; others inherit theirs."""
        return self.config.chunk_size if dir_id == ROOT_ID else recorded

    async def _new_record(
        self, dir_id: int, name: str, kind: str, mode: int, uid: int, gid: int, ec: str | None
    ) -> tuple[Attrs, int]:
        """File record in a random shard, then the Name entry; undo the record on failure."""
        validate_name(name)
        dir_ec, chunk_size = await self._policy(dir_id)
        policy = ECPolicy.parse(ec or dir_ec).name
        shard = self._rng.randrange(self.config.shards)
        r = await self._shard(
            shard,
            "file.create",
            kind=kind,
            mode=mode,
            uid=uid,
            gid=gid,
            ec=policy,
            chunk_size=chunk_size,
            parent=dir_id,
            name=name,
        )
        attrs = Attrs.from_wire(r["attrs"])
        try:
            await self._insert_name(dir_id, name, attrs.id, kind)
        except ShardUnavailable:
            # The name may have landed: the orphan GC finds out and names or drops the record.
            log.info("record %d left for orphan GC: its name's outcome is unknown", attrs.id)
            raise
        except TectonicError:
            try:
                await self._shard(shard, "file.drop", id=attrs.id)
            except TectonicError as e:
                log.info("record %d left for orphan GC: %s", attrs.id, e)
            raise
        return attrs, r["token"]

    async def _insert_name(self, dir_id: int, name: str, child: int, kind: str) -> None:
        """A new record's ``name.insert``, sent again after a lost reply (a server killed
        under it): ``child`` was drawn just now, so a FileExists whose entry names it is the
        first try's, landed."""
        try:
            await self._shard(
                self._of(dir_id), "name.insert", repeat=True, dir=dir_id, name=name, id=child,
                kind=kind,
            )  # fmt: skip
        except FileExists:
            try:
                r = await self._shard(self._of(dir_id), "name.lookup", dir=dir_id, name=name)
            except FileNotFound:
                raise FileExists(f"{name!r} exists in directory {dir_id}") from None
            if r["id"] != child:
                raise

    async def mkdir(
        self, dir_id: int, name: str, *, mode: int = 0o755, uid: int = 0, gid: int = 0
    ) -> Attrs:
        """New directory; inherits the parent's EC policy. FileExists if the name is taken."""
        attrs, _ = await self._new_record(dir_id, name, KIND_DIR, mode, uid, gid, None)
        await self._shard(self._of(attrs.id), "file.link", id=attrs.id, parent=dir_id, name=name)
        return attrs

    async def create(
        self,
        dir_id: int,
        name: str,
        *,
        mode: int = 0o644,
        uid: int = 0,
        gid: int = 0,
        exclusive: bool = True,
        ec: str | None = None,
    ) -> tuple[Attrs, int]:
        """Create a file and take its writer token: ``(attrs, token)``.

        The EC policy is ``ec`` or the directory's. With ``exclusive=False`` an existing file
        of that name is opened for writing and truncated to zero (O_CREAT|O_TRUNC) instead.
        """
        validate_name(name)
        dir_ec, chunk_size = await self._policy(dir_id)
        fields: dict[str, Any] = {
            "dir": dir_id,
            "name": name,
            "mode": mode,
            "uid": uid,
            "gid": gid,
            "ec": ECPolicy.parse(ec or dir_ec).name,
            "chunk_size": chunk_size,
            # Drawn here so that a create sent again after a lost reply (a server killed
            # under it) is answered with the file its first try made, not FileExists.
            "token": new_id(),
        }
        for _ in range(3):
            try:
                r = await self._shard(self._of(dir_id), "name.create", repeat=True, **fields)
                return Attrs.from_wire(r["attrs"]), int(r["token"])
            except FileExists:
                if exclusive:
                    raise
            try:
                existing = await self.lookup(dir_id, name)
            except FileNotFound:
                continue  # removed since: create it again
            if existing.is_dir:
                raise IsADirectory(f"{name!r} is a directory")
            token = await self.open_for_write(existing.id, truncate=True)
            return await self.getattr(existing.id), token
        raise FileExists(f"{name!r} keeps appearing and disappearing; giving up")

    async def symlink(
        self, dir_id: int, name: str, target: bytes, *, uid: int = 0, gid: int = 0
    ) -> Attrs:
        """A symbolic link ``name`` in ``dir_id`` pointing at ``target`` (bytes, kept as
        given: the kernel resolves it, never the metadata service). One transaction in the
        directory's shard; FileExists if the name is taken."""
        return await self.mknod(dir_id, name, KIND_SYMLINK, target=target, uid=uid, gid=gid)

    async def mknod(
        self,
        dir_id: int,
        name: str,
        kind: str,
        *,
        mode: int = 0o777,
        rdev: int = 0,
        target: bytes = b"",
        uid: int = 0,
        gid: int = 0,
    ) -> Attrs:
        """A metadata-only record (``NODE_KINDS``: a symlink, FIFO, socket or device) with
        its name, made at once in the directory's shard."""
        validate_name(name)
        r = await self._shard(
            self._of(dir_id),
            "name.make_node",
            dir=dir_id,
            name=name,
            kind=kind,
            mode=mode,
            uid=uid,
            gid=gid,
            target=bytes(target),
            rdev=rdev,
        )
        return Attrs.from_wire(r["attrs"])

    async def readlink(self, file_id: int) -> bytes:
        """A symbolic link's target."""
        r = await self._shard(self._of(file_id), "file.readlink", id=file_id)
        return bytes(r["target"])

    async def link(self, file_id: int, dir_id: int, name: str) -> Attrs:
        """A hard link: ``name`` in ``dir_id`` also names ``file_id``. The link count goes
        up first and the name second (a crash between leaves the file kept, not a name
        that outlives its file); a name that is taken undoes the count."""
        validate_name(name)
        r = await self._shard(self._of(file_id), "file.add_link", id=file_id)
        attrs = Attrs.from_wire(r["attrs"])
        try:
            # Not sent again after a lost reply, unlike a new record's name: a FileExists
            # naming this file could be the first try's or a name that was there before.
            await self._shard(
                self._of(dir_id), "name.insert", dir=dir_id, name=name, id=file_id, kind=attrs.kind
            )
        except ShardUnavailable:
            # The name may have landed: a count too high keeps the file, one too low loses it.
            log.warning("file %d keeps a link count its name may not have", file_id)
            raise
        except TectonicError:
            with trio.CancelScope(shield=True):
                await self._release(file_id, attrs.kind)
            raise
        return attrs

    async def parent(self, dir_id: int) -> int:
        """A directory's parent (exact: every rename of a directory refreshes it)."""
        r = await self._shard(self._of(dir_id), "file.get", id=dir_id)
        return int(r["parent"])

    async def readdir(
        self, dir_id: int, after: str = "", limit: int = 1000
    ) -> tuple[list[DirEntry], str | None]:
        """One page of entries sorted by name, strictly after ``after``; next cursor or None."""
        r = await self._shard(self._of(dir_id), "name.list", dir=dir_id, after=after, limit=limit)
        entries = [DirEntry(name=n, id=i, kind=k) for n, i, k in r["entries"]]
        return entries, r["next"]

    async def unlink(self, dir_id: int, name: str) -> int:
        """Remove a file's name; its blocks are queued for GC. Returns the file's id (0 when
        a try whose reply was lost did it: the id went with the reply).

        ``name.unlink`` is sent again after a lost reply (a server killed under it). A
        repeat's FileNotFound is the first try's work: the name, and with it the link of a
        record in the directory's shard (where a file created there lives), went in one
        transaction. A record elsewhere (a hard link's, a file renamed in) is then left
        linked, kept rather than lost."""
        validate_name(name)
        trace: dict[str, bool] = {}
        try:
            r = await self._shard(
                self._of(dir_id), "name.unlink", repeat=True, trace=trace, dir=dir_id, name=name
            )
        except FileNotFound:
            if not trace.get("lost"):
                raise
            log.info("unlink of %r in %d: a try whose reply was lost did it", name, dir_id)
            return 0
        file_id: int = r["id"]
        if not r["released"]:
            await self._release(file_id, KIND_FILE)
        return file_id

    async def _release(self, file_id: int, kind: str) -> None:
        """The last name of a record is gone: unlink the file or drop the dead directory. If
        its shard cannot be reached the record is left for the GC, never surfaced as an error:
        the name is already gone and that is what the caller asked for."""
        try:
            if kind == KIND_DIR:
                await self._shard(self._of(file_id), "file.drop", id=file_id)
            else:
                await self._shard(self._of(file_id), "file.unlink", id=file_id)
        except TectonicError as e:
            log.warning("record %d left for GC after its name was removed: %s", file_id, e)

    async def rmdir(self, dir_id: int, name: str) -> None:
        validate_name(name)
        r = await self._shard(self._of(dir_id), "name.lookup", dir=dir_id, name=name)
        child, kind = r["id"], r["kind"]
        if kind != KIND_DIR:
            raise NotADirectory(f"{name!r} is not a directory")
        try:
            await self._shard(self._of(child), "file.kill_dir", repeat=True, id=child)
        except FileNotFound:
            pass  # killed by an rmdir that did not finish (or by a try sent again): complete it
        trace: dict[str, bool] = {}
        try:
            await self._shard(
                self._of(dir_id), "name.remove", repeat=True, trace=trace, dir=dir_id,
                name=name, kind=KIND_DIR, expect_id=child,
            )  # fmt: skip
        except FileNotFound:
            if not trace.get("lost"):
                raise  # "name" names another directory now, or nothing
            # A try whose reply was lost removed the name of the directory killed above.
        self._dir_policy.pop(child, None)
        await self._release(child, KIND_DIR)

    async def rename(self, src_dir: int, src_name: str, dst_dir: int, dst_name: str) -> None:
        """Atomic within one directory, also over an existing file; crash-safe across."""
        validate_name(src_name)
        validate_name(dst_name)
        if src_dir != dst_dir:
            await self._check_not_into_itself(src_dir, src_name, dst_dir)
        try:
            result = await self._rename_once(src_dir, src_name, dst_dir, dst_name, 0)
        except DirectoryNotEmpty:
            # The destination is a directory. Replace it only if it is empty, and kill it
            # first (atomically with the emptiness check, in its own shard) so that no create
            # can slip into it between the check and the replace.
            victim = await self.lookup(dst_dir, dst_name)
            await self._shard(self._of(victim.id), "file.kill_dir", id=victim.id)
            try:
                result = await self._rename_once(src_dir, src_name, dst_dir, dst_name, victim.id)
            except BaseException:
                with trio.CancelScope(shield=True):
                    try:
                        await self._shard(self._of(victim.id), "file.revive_dir", id=victim.id)
                    except TectonicError as e:
                        log.warning(
                            "directory %d left dead after a failed rename: %s", victim.id, e
                        )
                raise
        if result["victim_id"]:
            await self._release(result["victim_id"], result["victim_kind"])
        child = result["id"]
        try:
            await self._shard(self._of(child), "file.link", id=child, parent=dst_dir, name=dst_name)
        except TectonicError as e:
            log.info("rename: could not refresh the name hint of %d: %s", child, e)

    async def _check_not_into_itself(self, src_dir: int, src_name: str, dst_dir: int) -> None:
        """Moving a directory below itself would cut a loop out of the tree: walk up from the
        destination by the directories' parent pointers. Best effort under concurrent moves
        of the same directories (no cluster-wide rename lock), exact otherwise."""
        moving = await self.lookup(src_dir, src_name)
        if not moving.is_dir:
            return
        current = dst_dir
        for _ in range(4096):
            if current == moving.id:
                raise InvalidArgument("cannot move a directory below itself")
            if current == ROOT_ID:
                return
            r = await self._shard(self._of(current), "file.get", id=current)
            current = int(r["parent"])
        raise InvalidArgument("directory tree deeper than 4096 levels")

    async def _rename_once(
        self, src_dir: int, src_name: str, dst_dir: int, dst_name: str, replace_dir: int
    ) -> dict[str, Any]:
        src_shard, dst_shard = self._of(src_dir), self._of(dst_dir)
        if src_shard == dst_shard:
            return await self._shard(
                src_shard,
                "name.rename",
                src_dir=src_dir,
                src_name=src_name,
                dst_dir=dst_dir,
                dst_name=dst_name,
                replace_dir=replace_dir,
            )
        deadline = time.time_ns() + int(RENAME_DEADLINE_S * 1e9)
        prep = await self._shard(
            src_shard,
            "name.rename_prepare",
            src_dir=src_dir,
            src_name=src_name,
            dst_dir=dst_dir,
            dst_name=dst_name,
            dst_address=self._shard_addr[dst_shard],
            deadline_ns=deadline,
        )
        try:
            applied = await self._shard(
                dst_shard,
                "name.rename_apply",
                dst_dir=dst_dir,
                dst_name=dst_name,
                id=prep["id"],
                kind=prep["kind"],
                deadline_ns=deadline,
                replace_dir=replace_dir,
            )
        except ShardUnavailable:
            raise  # the intent stays; the recovery pass settles it after the deadline
        except TectonicError:
            await self._shard(src_shard, "name.rename_finish", intent=prep["intent"], applied=False)
            raise
        await self._shard(src_shard, "name.rename_finish", intent=prep["intent"], applied=True)
        return {"id": prep["id"], "kind": prep["kind"], **applied}

    async def setattr(
        self,
        file_id: int,
        *,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        atime_ns: int | None = None,
        mtime_ns: int | None = None,
        ec: str | None = None,
    ) -> Attrs:
        """Change attributes; ``ec`` on a directory sets the policy new files inherit."""
        changes: dict[str, Any] = {
            "mode": mode,
            "uid": uid,
            "gid": gid,
            "atime_ns": atime_ns,
            "mtime_ns": mtime_ns,
            "ec": ec,
        }
        r = await self._shard(
            self._of(file_id),
            "file.setattr",
            id=file_id,
            **{k: v for k, v in changes.items() if v is not None},
        )
        self._dir_policy.pop(file_id, None)
        return Attrs.from_wire(r["attrs"])

    async def getxattr(self, file_id: int, name: str) -> bytes:
        r = await self._shard(self._of(file_id), "file.getxattr", id=file_id, name=name)
        return bytes(r["value"])

    async def setxattr(self, file_id: int, name: str, value: bytes) -> None:
        await self._shard(
            self._of(file_id), "file.setxattr", id=file_id, name=name, value=bytes(value)
        )

    async def listxattr(self, file_id: int) -> list[str]:
        r = await self._shard(self._of(file_id), "file.listxattr", id=file_id)
        return list(r["names"])

    async def removexattr(self, file_id: int, name: str) -> None:
        await self._shard(self._of(file_id), "file.removexattr", id=file_id, name=name)

    # --- File layer: the write path -------------------------------------------------------

    async def open_for_write(self, file_id: int, *, truncate: bool = False) -> int:
        """Take (steal) the writer token; unseals the file. Returns the new token."""
        r = await self._shard(self._of(file_id), "file.open", id=file_id, truncate=truncate)
        return int(r["token"])

    async def renew_lease(self, file_id: int, token: int) -> None:
        await self._shard(self._of(file_id), "file.renew", id=file_id, token=token)

    async def allocate_block(
        self,
        file_id: int,
        token: int,
        ec: str,
        hedge: int = 2,
        nodes: Sequence[NodeInfo] | None = None,
    ) -> BlockGrant:
        """A new block id plus k+m+hedge placed nodes and a capability token; with ``nodes``,
        on those (a new version of a block keeps each chunk index on its old node).

        The metadata service refuses token 0 (no writer, no capability); a stale token is
        refused when the block is committed, not here: a fenced writer can only waste an
        allocation, which the GC reclaims."""
        policy = ECPolicy.parse(ec)
        if nodes is None:
            # At least the default write quorum (k+1): with a node down in a cluster of
            # exactly k+m nodes, writes still succeed (the data client commits the chunks
            # that landed and repair restores the rest) instead of failing with NoSpace.
            nodes = await self._place(policy.n + max(hedge, 0), min(policy.n, policy.k + 1), ())
        # In the file's shard, which draws the block id to hash there: the block's commit then
        # shares one transaction with the file's (module docstring).
        a = await self._shard(
            self._of(file_id),
            "block.allocate",
            file_id=file_id,
            token=token,
            ec=policy.name,
            nodes=[n.node_id for n in nodes],
        )
        return BlockGrant(block_id=a["block_id"], nodes=list(nodes), capability=a["capability"])

    async def more_nodes(self, block_id: int, exclude: Sequence[str], count: int) -> BlockGrant:
        """Replacement nodes for a block whose chunk writes failed (same block id)."""
        nodes = await self._place(count, count, exclude)
        g = await self._shard(
            self._of(block_id), "block.grant", block_id=block_id, nodes=[n.node_id for n in nodes]
        )
        return BlockGrant(block_id=block_id, nodes=nodes, capability=g["capability"])

    async def _place(self, count: int, minimum: int, exclude: Sequence[str]) -> list[NodeInfo]:
        """Nodes for a block's chunks, placed here over the cached node list (module
        docstring); a list that leaves too few nodes is fetched again once."""
        for attempt in range(2):
            async with self._nodes_lock:  # one node.list for every writer waiting here
                if attempt or time.monotonic() - self._nodes_at > NODE_LIST_TTL_S:
                    await self.nodes()
            try:
                return placement.place(
                    self._node_cache.values(),
                    count,
                    minimum=minimum,
                    exclude=exclude,
                    rng=self._rng,
                )
            except NoSpace:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def _commit_elsewhere(self, file_id: int, blocks: Sequence[BlockInfo]) -> list[Any]:
        """Commit the blocks that are not in the file's shard in their own shards (blocks
        allocated before co-location); returns the wire records of the rest."""
        home = self._of(file_id)
        by_shard: dict[int, list[dict[str, Any]]] = {}
        for b in blocks:
            by_shard.setdefault(self._of(b.block_id), []).append(b.to_wire())

        def job(shard: int, items: list[dict[str, Any]]) -> Callable[[], Awaitable[Any]]:
            return lambda: self._shard(shard, "block.commit", file_id=file_id, blocks=items)

        await self._gather([job(s, items) for s, items in by_shard.items() if s != home])
        return by_shard.get(home, [])

    async def commit_blocks(self, file_id: int, token: int, blocks: Sequence[BlockInfo]) -> None:
        """Commit blocks (Block layer) and put them at their ``file_index`` in the file.

        A block at an index that already has one replaces it (the old block is queued for
        GC). StaleWriterToken if another writer took the file since ``token`` was issued.
        """
        if not blocks:
            return
        local = await self._commit_elsewhere(file_id, blocks)
        await self._shard(
            self._of(file_id),
            "file.commit",
            id=file_id,
            token=token,
            entries=[[b.file_index, b.block_id] for b in blocks],
            blocks=local,
        )

    async def close(
        self, file_id: int, token: int, size: int, blocks: Sequence[BlockInfo]
    ) -> Attrs:
        """Commit a writer's last blocks, set the final size, release the writer token and
        seal the file: one transaction in the file's shard (``file.close``).

        Sent again after a lost reply; a repeat that finds the file sealed checks that the
        seal was this one (the size, and these blocks at their indexes) and returns it."""
        local = await self._commit_elsewhere(file_id, blocks)
        shard = self._of(file_id)
        fields: dict[str, Any] = {
            "id": file_id,
            "token": token,
            "size": size,
            "entries": [[b.file_index, b.block_id] for b in blocks],
            "blocks": local,
        }
        try:
            r = await self._shard(shard, "file.close", repeat=True, **fields)
        except FileSealed:
            attrs = await self.getattr(file_id)
            have = {
                (int(i), int(b))
                for i, b in (await self._shard(shard, "file.blocks", id=file_id))["blocks"]
            }
            if attrs.size != size or not {(b.file_index, b.block_id) for b in blocks} <= have:
                raise
            return attrs
        return Attrs.from_wire(r["attrs"])

    async def seal(self, file_id: int, token: int, size: int) -> Attrs:
        """Set the final size, release the writer token and seal the file."""
        r = await self._shard(self._of(file_id), "file.seal", id=file_id, token=token, size=size)
        return Attrs.from_wire(r["attrs"])

    async def set_size(self, file_id: int, token: int, size: int) -> Attrs:
        """Change the size of a file being written (truncate or grow sparse); blocks wholly
        past the new size are dropped and queued for GC."""
        r = await self._shard(
            self._of(file_id), "file.set_size", id=file_id, token=token, size=size
        )
        return Attrs.from_wire(r["attrs"])

    # --- Read path -----------------------------------------------------------------------------

    async def block_list(self, file_id: int) -> list[BlockInfo]:
        """Every committed block of the file, sorted by file_index, with chunk placements
        (addresses filled in from the registry)."""
        r = await self._shard(self._of(file_id), "file.blocks", id=file_id)
        pairs = [(int(i), int(b)) for i, b in r["blocks"]]
        infos = await self.locate_blocks([b for _, b in pairs])
        for (index, _), info in zip(pairs, infos):
            info.file_index = index
        return sorted(infos, key=lambda i: i.file_index)

    async def locate_blocks(self, block_ids: Sequence[int]) -> list[BlockInfo]:
        """Block layer records of the given blocks (grouped per shard), addresses filled in."""
        ids = list(block_ids)
        if not ids:
            return []
        by_shard: dict[int, list[int]] = {}
        for b in ids:
            by_shard.setdefault(self._of(b), []).append(b)

        def job(shard: int, group: list[int]) -> Callable[[], Awaitable[Any]]:
            return lambda: self._shard(shard, "block.locate", ids=group)

        shards = list(by_shard.items())
        replies = await self._gather([job(s, g) for s, g in shards])
        found: dict[int, BlockInfo] = {}
        for reply in replies:
            for data in reply["blocks"]:
                info = BlockInfo.from_wire(data)
                found[info.block_id] = info
        await self._fill_addresses(found.values())
        return [found[b] for b in ids]

    async def _fill_addresses(self, infos: Any) -> None:
        infos = list(infos)
        if any(c.node_id not in self._node_cache for i in infos for c in i.chunks):
            await self.nodes()
        for info in infos:
            for c in info.chunks:
                node = self._node_cache.get(c.node_id)
                c.address = node.address if node is not None else ""

    async def blocks_on_node(self, node_id: str) -> list[tuple[int, int]]:
        """(block_id, chunk_index) of every committed chunk on a node: the reverse index,
        gathered from every block shard (repair and ``tectonic status`` use it)."""

        def job(shard: int) -> Callable[[], Awaitable[list[tuple[int, int]]]]:
            async def run() -> list[tuple[int, int]]:
                out: list[tuple[int, int]] = []
                after = 0
                for _ in range(1_000_000):
                    r = await self._shard(
                        shard, "block.by_node", node_id=node_id, after=after, limit=10_000
                    )
                    chunks = [(int(b), int(i)) for b, i in r["chunks"]]
                    out.extend(chunks)
                    if len(chunks) < 10_000:
                        break
                    # A page may end inside one block's chunks: refetch from that block.
                    last = chunks[-1][0]
                    out = [c for c in out if c[0] != last]
                    after = last - 1
                return out

            return run

        results = await self._gather([job(s) for s in range(self.config.shards)])
        merged = sorted({c for part in results for c in part})
        return merged

    async def replace_chunk(
        self, block_id: int, index: int, old_node: str, new_node: str, checksum: int
    ) -> None:
        """Point one chunk of a committed block at a new node (repair, rebalance), keeping
        the reverse index in step; refused if the chunk is no longer on ``old_node``."""
        await self._shard(
            self._of(block_id),
            "block.replace_chunk",
            block_id=block_id,
            index=index,
            old_node=old_node,
            new_node=new_node,
            checksum=checksum,
        )

    async def report_bad_chunk(self, block_id: int, index: int, node_id: str, reason: str) -> bool:
        """Tell the Block layer a reader found this chunk corrupt or missing, so repair's next
        round rebuilds it; False if the block no longer has that chunk on that node."""
        r = await self._shard(
            self._of(block_id),
            "block.report_bad_chunk",
            block_id=block_id,
            index=index,
            node_id=node_id,
            reason=reason,
        )
        return bool(r["recorded"])

    # --- Node registry ----------------------------------------------------------------------

    async def nodes(self) -> list[NodeInfo]:
        r = await self._registry("node.list")
        nodes = [NodeInfo.from_wire(n) for n in r["nodes"]]
        self._node_cache = {n.node_id: n for n in nodes}
        self._nodes_at = time.monotonic()
        return nodes

    async def server_stats(self) -> dict[str, dict[str, Any]]:
        """Every metadata server's ``server.stats`` (files and, per shard, the group
        commit's batches, mutations and largest batch), by server address."""
        addresses = [s.address for s in self.config.metadata_servers]

        def job(address: str) -> Callable[[], Awaitable[dict[str, Any]]]:
            return lambda: self._call(address, "server.stats", {})

        stats = await self._gather([job(a) for a in addresses])
        return dict(zip(addresses, stats, strict=True))

    async def statfs(self) -> dict[str, Any]:
        """Cluster capacity: {"capacity", "free", "files"...} from the registry."""
        nodes = await self.nodes()
        up = [n for n in nodes if n.state == "up"]

        def job(address: str) -> Callable[[], Awaitable[dict[str, Any]]]:
            return lambda: self._call(address, "server.stats", {})

        stats = await self._gather([job(s.address) for s in self.config.metadata_servers])
        capacity, free = capacity_of(up)
        return {
            "capacity": capacity,
            "free": free,
            "nodes": len(nodes),
            "nodes_up": len(up),
            "files": sum(int(s["files"]) for s in stats),
        }

    async def backup(self, dest: str) -> list[dict[str, Any]]:
        """Every metadata server snapshots its shards into ``dest``/server-N on its own host
        (one directory per server, so servers sharing a host never collide)."""

        def job(i: int, address: str) -> Callable[[], Awaitable[dict[str, Any]]]:
            where = os.path.join(dest, f"server-{i}")
            return lambda: self._call(address, "server.backup", {"dest": where})

        servers = self.config.metadata_servers
        return await self._gather([job(i, s.address) for i, s in enumerate(servers)])

    # --- Garbage collection support (for the GC service) -----------------------------------

    async def collect_orphans(self, grace_s: float, *, limit: int = 1000) -> int:
        """Delete File records that no Name entry reaches, created over ``grace_s`` ago
        (creates interrupted between the File record and the Name entry). A record whose
        intended name does point at it is marked named instead. Returns how many went."""
        cutoff = time.time_ns() - int(grace_s * 1e9)
        collected = 0
        for shard in range(self.config.shards):
            r = await self._shard(shard, "file.orphans", older_than_ns=cutoff, limit=limit)
            for o in r["orphans"]:
                try:
                    found = await self._shard(
                        self._of(o["parent"]), "name.lookup", dir=o["parent"], name=o["name"]
                    )
                    named = found["id"] == o["id"]
                except (FileNotFound, NotADirectory):
                    named = False
                if named:
                    await self._shard(
                        shard, "file.link", id=o["id"], parent=o["parent"], name=o["name"]
                    )
                else:
                    d = await self._shard(shard, "file.collect_orphan", id=o["id"])
                    collected += bool(d["deleted"])
        return collected
