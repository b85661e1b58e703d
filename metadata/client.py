"""Client of the metadata service: routes each call to the shard that owns its key.

CONTRACT (the data-path client in tectonic_py/client/ and the FUSE layer code against these
signatures; the metadata implementation fills them in without changing them):

Every method raises only ``tectonic_py.core.errors`` classes (FileNotFound, FileExists,
NotADirectory, IsADirectory, DirectoryNotEmpty, InvalidName, StaleWriterToken, FileSealed,
ShardUnavailable, NoSpace, ...). Operations that span layers (create = File layer record in
the file's shard + Name layer entry in the directory's shard; commit = Block layer in the
block's shard + File layer append in the file's shard) are sequenced by the layer's calls so
that a crash between steps leaves only garbage that is collected later, never a visible
half-done state.

Structure: ``MetadataClient`` is the router (connections, retries, coalescing, following
moved shards); its public calls are those of its parts, one module per layer, each holding
the router as a ``Router`` (metadata/routing.py): the Name layer (metadata/name_calls.py,
with the sequencing of namespace changes across shards), the File layer (file_calls.py: the
write path), the Block layer (block_calls.py: placement), checkpoints (checkpoint_client.py),
whole servers (server_calls.py) and the background services (maintenance_calls.py).

Routing: shard = ``shard_of(key, S)``; Name-layer calls go to ``shard_of(dir_id)``, File-layer
calls to ``shard_of(file_id)``, Block-layer calls to ``shard_of(block_id)``. Under the sqlite
engine the cluster file's map of shards to servers is the truth; under etcd shards move
between servers, and a call refused (``WrongShard``) or unanswered goes where
``server.owners`` says its shard is now.

Coalescing (metadata/coalescer.py): while ``MAX_BATCHES_IN_FLIGHT`` calls to a server are in
flight, the next calls of the write and read paths wait in that server's queue and leave
together as one ``batch`` request when one returns.

Connections: ``POOL_SIZE`` multiplexed connections per server, made lazily and replaced when
broken. A server that is restarting (kill -9, then its supervisor starts it again; a failover)
refuses connections until it is back, which on a loaded host takes tens of seconds, so a
connection failure is retried with backoff until ``reconnect_deadline``
(``RECONNECT_DEADLINE_S``, 60 s, by default) has passed: for requests that are safe to repeat
(reads, and the mutations of ``_RESENDABLE_OPS`` or whose caller recognises a repeat's
outcome: a create by its client-drawn token) always, for other mutations only when the
request never left (connect failed), because a mutation whose reply was lost may have
committed. ``Busy`` (admission control, a pinned rename) is retried with backoff a bounded
number of times (both through ``tectonic_py.core.retry``). A server still unreachable at the
deadline is ``ShardUnavailable``, whose message names the op, the shard and the seconds
waited. A server that has not yet answered this client is waited for up to
``first_contact_deadline`` instead (the same by default: a rank's fresh client that starts
during a restart must wait it out as the others do); an interactive command passes a short
one, since for it a cluster that is down, or a wrong cluster file, should be said at once.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from metadata.api import OPS
from metadata.block_calls import BlockCalls
from metadata.checkpoint_client import CheckpointCalls
from metadata.coalescer import Coalescer, Item, coalesces
from metadata.file_calls import FileCalls
from metadata.maintenance_calls import MaintenanceCalls
from metadata.name_calls import NameCalls
from metadata.quota_calls import QuotaCalls
from metadata.retention_calls import RetentionCalls
from metadata.routing import gather
from metadata.server_calls import ServerCalls
from tectonic_py.core import rpc_client, sockets
from tectonic_py.core.cluster_file import REGISTRY_SHARD, ClusterConfig
from tectonic_py.core.errors import (
    Busy,
    InvalidArgument,
    ShardUnavailable,
    TectonicError,
    Unavailable,
    WrongShard,
)
from tectonic_py.core.ids import MAX_ID, shard_of
from tectonic_py.core.retry import RetryPolicy, retry

log = logging.getLogger(__name__)

POOL_SIZE = 4
# Busy (admission control, a pinned rename): 50 retries, pauses growing from 5 ms to 200 ms,
# about 6 s of pauses in all before the caller sees it.
BUSY_POLICY = RetryPolicy(attempts=51, first_delay=0.005, multiplier=1.15, max_delay=0.2)
# A lost connection or a server that is restarting: tries until the deadline, pauses growing
# from 20 ms to 500 ms, so a server back after a second is found within a pause of it. The
# deadline covers a restart or failover on a loaded host (a kill -9'd server's restart took
# over 10 s under load 40-60 on the project machine) with room to spare; a checkpoint burst
# would rather wait a minute than fail every rank.
RECONNECT_DEADLINE_S = 60.0
# For an interactive command (tectonic ls/put/get/...), how long a server that has not
# answered yet is waited for: a cluster that is down is said within seconds, a restart that
# is nearly done is still ridden out.
INTERACTIVE_FIRST_CONTACT_S = 5.0


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
# What is sent again after a lost reply without the caller's say, from the contract
# (metadata/api): every read, and the mutations whose repeat does no harm (a second
# allocation, a second unnamed record: garbage the GC collects; a commit of the same blocks
# at the same indexes, a size, a lease renewal, a link hint, a drop: they land the same).
# name.create carries its writer token, name.insert a fresh record's id, file.close is
# checked by its caller: each is sent again by the caller that can read a repeat's outcome.
_RESENDABLE_OPS = OPS.names(lambda op: op.repeatable)


def _is_busy(e: TectonicError) -> bool:
    return isinstance(e, Busy)


def _shard_text(fields: dict[str, Any]) -> str:
    shard = fields.get("shard")
    return "" if shard is None else f" (shard {shard})"


_Route = Callable[
    [int, str, dict[str, Any], bool, "dict[str, bool] | None"], Awaitable[dict[str, Any]]
]


class MetadataClient:
    """One per process; owns pooled connections to every metadata server and routes each
    call to the server of its shard. The calls themselves are its parts' (module
    docstring), each public method of a part being one of this client's."""

    def __init__(
        self,
        config: ClusterConfig,
        *,
        nursery: trio.Nursery,
        reconnect_deadline: float = RECONNECT_DEADLINE_S,
        first_contact_deadline: float | None = None,
    ) -> None:
        """``reconnect_deadline``: how long a call waits for a server that cannot be reached
        (a restart) before it is ``ShardUnavailable``; a tool that reports down servers rather
        than waiting for them passes 0. ``first_contact_deadline``: the same for a server
        that has not answered this client yet (``None``: ``reconnect_deadline``); an
        interactive command passes ``INTERACTIVE_FIRST_CONTACT_S``."""
        self.config = config
        self._reconnect = reconnect_policy(reconnect_deadline)
        self._first_contact = reconnect_policy(
            reconnect_deadline if first_contact_deadline is None else first_contact_deadline
        )
        # a takeover (a lease to lapse, shards to load) plus a call that timed out on the way
        self._follow_deadline = max(reconnect_deadline, 1.0) + 2 * FOLLOW_CALL_TIMEOUT_S
        self._reached: set[str] = set()  # the servers that have answered this client
        self._nursery = nursery
        self._secret = config.credential()
        self._shard_addr = {
            s: server.address for server in config.metadata_servers for s in server.shards
        }
        # How a shard's server is found, by the engine's name: shards that stay where the
        # cluster file puts them, or shards that move and are followed.
        routes: dict[str, _Route] = {"sqlite": self._fixed, "etcd": self._followed}
        self._route = routes[config.metadata_engine]
        self._pools: dict[str, list[rpc_client.Connection | None]] = {}
        self._pool_locks: dict[tuple[str, int], trio.Lock] = {}
        self._coalescers: dict[str, Coalescer] = {}
        self._next = 0
        self._closed = False
        self._parts()

    def _parts(self) -> None:
        """The calls, by layer: each part holds this router, and its public methods are this
        client's."""
        blocks = BlockCalls(self)
        files = FileCalls(self, blocks)
        names = NameCalls(self, files)
        checkpoints = CheckpointCalls(self, names)
        servers = ServerCalls(self, blocks)
        maintenance = MaintenanceCalls(self)
        quotas = QuotaCalls(self, names, files)
        retention = RetentionCalls(self, names, files, checkpoints)
        # Name layer
        self.lookup = names.lookup
        self.resolve = names.resolve
        self.mkdir = names.mkdir
        self.create = names.create
        self.delegate = names.delegate
        self.create_delegated = names.create_delegated
        self.symlink = names.symlink
        self.mknod = names.mknod
        self.link = names.link
        self.readdir = names.readdir
        self.unlink = names.unlink
        self.rmdir = names.rmdir
        self.rename = names.rename
        # File layer
        self.getattr = files.getattr
        self.dir_policy = files.policy
        self.parent = files.parent
        self.readlink = files.readlink
        self.setattr = files.setattr
        self.getxattr = files.getxattr
        self.setxattr = files.setxattr
        self.listxattr = files.listxattr
        self.removexattr = files.removexattr
        self.open_for_write = files.open_for_write
        self.renew_lease = files.renew_lease
        self.commit_blocks = files.commit_blocks
        self.close = files.close
        self.commit_pack = files.commit_pack
        self.seal = files.seal
        self.set_size = files.set_size
        self.block_list = files.block_list
        # Block layer and the node list
        self.nodes = blocks.nodes
        self.place = blocks.place
        self.allocate_block = blocks.allocate_block
        self.more_nodes = blocks.more_nodes
        self.locate_blocks = blocks.locate_blocks
        self.blocks_on_node = blocks.blocks_on_node
        self.replace_chunk = blocks.replace_chunk
        self.report_bad_chunk = blocks.report_bad_chunk
        # checkpoints
        self.chunk_states = checkpoints.chunk_states
        self.durability = checkpoints.durability
        self.tree_state = checkpoints.tree_state
        self.commit_step = checkpoints.commit_step
        self.staging_dirs = checkpoints.staging_dirs
        self.remove_tree = checkpoints.remove_tree
        # quotas and reservations
        self.set_quota = quotas.set_quota
        self.get_quota = quotas.get_quota
        self.list_quotas = quotas.list_quotas
        self.remove_quota = quotas.remove_quota
        self.claim = quotas.claim
        self.unclaim = quotas.unclaim
        self.dir_realm = quotas.dir_realm
        self.reserve = quotas.reserve
        self.release = quotas.release
        self.settle_quotas = quotas.settle
        self.recount_quotas = quotas.recount
        # whole servers
        self.server_stats = servers.server_stats
        self.statfs = servers.statfs
        self.backup = servers.backup
        # the background services
        self.collect_orphans = maintenance.collect_orphans
        self.scan_blocks = maintenance.scan_blocks
        self.scan_files = maintenance.scan_files
        self.collect_unreachable = maintenance.collect_unreachable
        self.set_chunk = maintenance.set_chunk
        self.forget_block = maintenance.forget_block
        self.dead_chunks = maintenance.dead_chunks
        self.bad_chunks = maintenance.bad_chunks
        self.node_chunks = maintenance.node_chunks
        self.chunk_caps = maintenance.chunk_caps
        self.gc_queue = maintenance.gc_queue
        self.gc_ack = maintenance.gc_ack
        self.referenced = maintenance.referenced
        self.expired_leases = maintenance.expired_leases
        self.recover_lease = maintenance.recover_lease
        self.pack_usage = maintenance.pack_usage
        self.relocate_extents = maintenance.relocate_extents
        # retention policies
        self.set_retention = retention.set_retention
        self.retention_of = retention.retention_of
        self.remove_retention = retention.remove_retention
        self.retention_policies = retention.retention_policies
        self.retire_steps = retention.retire_steps
        self.apply_retention = retention.apply_retention

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
            self._reached.add(address)
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
        (``_RESENDABLE_OPS``, or ``repeat``: the caller handles a repeat's outcome) always,
        any other mutation only if it never left this process. ``trace["repeatable"]`` says,
        after a failure, whether the request may be sent again elsewhere; ``trace["lost"]``,
        that a try left and got no answer, so that an answer after it may be a repeat's (a
        caller reads a repeat's FileNotFound by it); ``timeout`` bounds each try (a server
        that took the connection but does not answer: a paused one)."""
        idempotent = repeat or op in _RESENDABLE_OPS
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
                    if coalesces(op, fields):
                        item = Item(op, fields, timeout)
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
        started = trio.current_time()
        try:
            policy = reconnect or (
                self._reconnect if address in self._reached else self._first_contact
            )
            return await retry(busy_retried, policy=policy, when=may_repeat)
        except Unavailable as e:
            raise ShardUnavailable(
                f"metadata server {address} unavailable during {op}{_shard_text(fields)}"
                f" after waiting {trio.current_time() - started:.1f} s: {e.message}"
            ) from None

    def _coalescer(self, address: str) -> Coalescer:
        c = self._coalescers.get(address)
        if c is None:
            c = self._coalescers[address] = Coalescer(address, self._connection, self._nursery)
        return c

    def batch_stats(self) -> dict[str, int]:
        """Batch requests sent and the calls they carried, over every server."""
        cs = self._coalescers.values()
        return {"batches": sum(c.batches for c in cs), "ops": sum(c.batched_ops for c in cs)}

    # --- routing: the public calls of metadata/routing.py's Router ----------------------------

    def shard_of(self, key: int) -> int:
        """The shard of an id: a Name entry's is its directory's, a record's its own."""
        return shard_of(key, self.config.shards)

    def address_of(self, shard: int) -> str:
        """The address of the server serving ``shard``, as far as this client knows (the
        cluster file's, or where ``server.owners`` said it went)."""
        return self._shard_addr[shard]

    async def call_shard(
        self,
        shard: int,
        op: str,
        fields: dict[str, Any],
        *,
        repeat: bool = False,
        trace: dict[str, bool] | None = None,
    ) -> dict[str, Any]:
        """``op`` on the server of ``shard``; ``repeat``, ``trace``: as for ``_call`` (the
        caller handles a repeated mutation's outcome; ``trace["lost"]`` says whether there
        may have been one)."""
        return await self._route(shard, op, {**fields, "shard": shard}, repeat, trace)

    async def call_registry(self, op: str, fields: dict[str, Any] | None = None) -> dict[str, Any]:
        """``op`` on the server of the node registry (``REGISTRY_SHARD``)."""
        return await self._route(REGISTRY_SHARD, op, dict(fields or {}), False, None)

    async def call_server(
        self, address: str, op: str, fields: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """``op`` on one server, by address (the ``server.*`` ops), retried as ``_call``."""
        return await self._call(address, op, dict(fields or {}))

    async def call(self, op: str, fields: dict[str, Any]) -> Any:
        """Any declared op by name, routed as its declaration says (``tectonic call``): to
        the shard of its key, or the ``shard`` given (the scans), the registry, one server
        or every server (then ``{address: result}``)."""
        route = OPS[op].route
        fields = dict(fields)
        if route.shard_bound:
            shard = fields.pop("shard", None)
            if shard is None and route.kind == "shard":
                shard = self._key_shard(op, fields.get(route.key))
            if not isinstance(shard, int) or isinstance(shard, bool):
                raise InvalidArgument(
                    f"{op}: name the shard to ask, 0..{self.config.shards - 1}: "
                    f'add "shard": N to the arguments'
                )
            if not 0 <= shard < self.config.shards:
                raise InvalidArgument(f"{op}: shard {shard} outside 0..{self.config.shards - 1}")
            return await self.call_shard(shard, op, fields)
        if route.kind == "registry":
            return await self.call_registry(op, fields)
        addresses = [s.address for s in self.config.metadata_servers]
        if route.kind == "any":
            return await self.call_server(addresses[0], op, fields)
        replies = await gather(
            [functools.partial(self.call_server, a, op, fields) for a in addresses]
        )
        return dict(zip(addresses, replies, strict=True))

    def _key_shard(self, op: str, key: Any) -> int | None:
        """The shard of a routing key: an id, or a list of ids that share one shard."""
        keys = key if isinstance(key, list) else [key]
        if not keys or not all(
            isinstance(k, int) and not isinstance(k, bool) and 0 < k <= MAX_ID for k in keys
        ):
            return REGISTRY_SHARD  # any shard: its server says what is wrong with the key
        shards = {self.shard_of(k) for k in keys}
        if len(shards) > 1:
            raise InvalidArgument(f"{op}: the ids are in shards {sorted(shards)}: one at a time")
        return shards.pop()

    async def _fixed(
        self,
        shard: int,
        op: str,
        fields: dict[str, Any],
        repeat: bool,
        trace: dict[str, bool] | None,
    ) -> dict[str, Any]:
        """Shards that never move (sqlite): the cluster file's map is the truth."""
        return await self._call(self._shard_addr[shard], op, fields, repeat=repeat, trace=trace)

    async def _followed(
        self,
        shard: int,
        op: str,
        fields: dict[str, Any],
        repeat: bool,
        trace: dict[str, bool] | None,
    ) -> dict[str, Any]:
        """Under the etcd engine shards move between servers: a refusal (``WrongShard``) or
        a server that cannot be reached sends the request where ``server.owners`` says the
        shard is now, until the reconnect deadline. A mutation that reached a server which
        then died is sent again only if it is safe to repeat (``_call``): it may have
        committed."""
        started = trio.current_time()
        give_up = started + self._follow_deadline
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
                if not unsent:
                    raise
                if trio.current_time() > give_up:
                    if isinstance(e, WrongShard):
                        raise
                    raise ShardUnavailable(
                        f"no metadata server answered for shard {shard} during {op} after"
                        f" waiting {trio.current_time() - started:.1f} s: {e.message}"
                    ) from None
            await self.refresh_owners(avoid=address)
            if self._shard_addr[shard] == address:
                await trio.sleep(FOLLOW_PAUSE_S)

    async def refresh_owners(self, *, avoid: str = "") -> None:
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
