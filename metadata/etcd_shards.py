"""The shards one metadata server serves under the etcd engine: taken, loaded, given up.

Under the sqlite engine a server's shards are fixed by its command line. Under etcd they are
whatever it owns (metadata/ownership.py): it first claims the shards its command line names
(its preferred ones), then, every ``poll_s``, any shard nobody owns (its server died and its
lease lapsed). Taking a shard means claiming its owner key, loading its rows from etcd into
a fresh SQLite copy and starting its committer; the shard is served only after that.

Giving up: a batch refused by the fence (``ReplicatedStore`` raises ``WrongShard``), or the
lease lost, drops the shard from ``stores`` and cancels its committer; requests for it then
get ``WrongShard`` and clients ask ``server.owners`` where it went.

``EtcdShards`` is the etcd engine of metadata/engine.py: the server knows it only by that
interface, and it knows the server only as a ``ShardHost``.
"""

from __future__ import annotations

import argparse
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

import trio

from metadata.engine import ShardHost, ShardPlan
from metadata.etcd_engine import ReplicatedStore, ShardReplica
from metadata.ownership import DEFAULT_TTL_S, Ownership
from metadata.registry import Registry
from metadata.shard import ShardStore
from tectonic_py.core.cluster_file import REGISTRY_SHARD
from tectonic_py.core.errors import ConfigError, TectonicError, WrongShard
from tectonic_py.core.etcd_client import EtcdClient
from tectonic_py.core.ids import ROOT_ID, shard_of

log = logging.getLogger(__name__)

POLL_S = 0.25
LOAD_PARALLEL = 32


@dataclass(frozen=True)
class EtcdSettings:
    """Where a server's etcd engine keeps its keys."""

    endpoints: list[str]
    prefix: str = "/tectonic"
    lease_ttl: int = DEFAULT_TTL_S
    poll_s: float = POLL_S
    # A shard preferred by another server is taken only after it was seen unowned this long,
    # so that at cluster start every server gets its own shards.
    takeover_delay_s: float = field(default=1.0)
    name: str = field(default="etcd", init=False)


def settings_from_args(args: argparse.Namespace) -> EtcdSettings:
    """``tectonic metadata --engine etcd``'s flags (metadata/main.py) as settings."""
    missing = [
        flag
        for flag, value in (
            ("--etcd-endpoints", args.etcd_endpoints),
            ("--etcd-prefix", args.etcd_prefix),
        )
        if not value
    ]
    if missing:
        raise ConfigError(f"the following arguments are required: {', '.join(missing)}")
    endpoints = [e.strip() for e in args.etcd_endpoints.split(",") if e.strip()]
    return EtcdSettings(endpoints, prefix=args.etcd_prefix, lease_ttl=args.etcd_lease_ttl)


class EtcdShards:
    """The shards this server owns, each a ``ReplicatedStore`` (the module docstring)."""

    def __init__(self, plan: ShardPlan, settings: EtcdSettings) -> None:
        self.settings = settings
        self.preferred = plan.shards
        self.total_shards = plan.total_shards
        self.node_timeout = plan.node_timeout
        self.on_commit = plan.on_commit
        self.cache_dir = Path(plan.data_dir) / "etcd-cache"
        self.stores: dict[int, ReplicatedStore] = {}
        self.registry: Registry | None = None
        self._host: ShardHost | None = None
        self.etcd = EtcdClient(settings.endpoints)
        self.ownership: Ownership | None = None
        self._scopes: dict[int, trio.CancelScope] = {}
        self._unowned_since: dict[int, float] = {}
        self._seen_owned: set[int] = set()
        self._owners: dict[int, str] = {}
        self._rng = random.Random()
        self._loading = trio.CapacityLimiter(LOAD_PARALLEL)

    @property
    def address(self) -> str:
        return self._host.address if self._host is not None else ""

    def start(self, nursery: trio.Nursery) -> None:
        """Nothing is held before the server listens: shards are claimed under its address."""

    def check(self, shard: int) -> ShardStore:
        """The store of a shard this server may serve right now, or the error that says why
        not: ``WrongShard`` (not executed: ask the owners, retry) also while this server's
        lease is unconfirmed, since another server may own the shard by now."""
        store = self.stores.get(shard)
        if store is not None and store.lost:
            self._nursery.start_soon(self.drop, shard)
            store = None
        if store is None:
            raise WrongShard(f"shard {shard} is not owned by {self.address}")
        if self.ownership is None or not self.ownership.valid():
            raise WrongShard(f"{self.address}: etcd lease not confirmed")
        return store

    def node_registry(self) -> Registry:
        self.check(REGISTRY_SHARD)
        if self.registry is None:
            raise WrongShard(f"the node registry lives with shard {REGISTRY_SHARD}, not here")
        return self.registry

    async def owners(self) -> dict[int, str]:
        """Where every shard is, as of the last poll (at most ``poll_s`` old): asked by
        every client that follows a moved shard, so it costs etcd nothing."""
        return dict(self._owners)

    async def run(
        self, host: ShardHost, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Claim the preferred shards (started then), then take over unowned ones."""
        self._host = host
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        try:
            async with trio.open_nursery() as nursery:
                self.ownership = Ownership(
                    # its own connections: a keep-alive never queues behind commits
                    EtcdClient(self.settings.endpoints, max_connections=4),
                    self.settings.prefix,
                    host.address,
                    ttl=self.settings.lease_ttl,
                    on_lost=self.drop_all,
                )
                await nursery.start(self.ownership.run)
                self._nursery = nursery
                async with trio.open_nursery() as claims:
                    for shard in self.preferred:
                        claims.start_soon(self._try_take, shard)
                task_status.started()
                while True:
                    await trio.sleep(self.settings.poll_s)
                    await self._poll()
        finally:
            with trio.CancelScope(shield=True) as scope:
                scope.deadline = trio.current_time() + 2.0
                if self.ownership is not None and self.ownership.lease:
                    # a clean stop hands the shards over now, not after the lease's TTL
                    try:
                        await self.ownership.etcd.lease_revoke(self.ownership.lease)
                    except TectonicError as e:
                        log.warning("lease revoke at shutdown failed: %s", e)
                await self.etcd.aclose()
                if self.ownership is not None:
                    await self.ownership.etcd.aclose()

    async def _poll(self) -> None:
        assert self.ownership is not None
        try:
            owners = await self.ownership.owners()
        except TectonicError as e:
            log.warning("cannot read shard owners from etcd: %s", e)
            return
        self._owners = owners
        now = trio.current_time()
        due: list[int] = []
        for shard in list(self.stores):
            if owners.get(shard) != self.address:
                log.warning("shard %d: owner key gone; giving it up", shard)
                await self.drop(shard)
        for shard in range(self.total_shards):
            if shard in owners:
                self._unowned_since.pop(shard, None)
                self._seen_owned.add(shard)
                continue
            since = self._unowned_since.setdefault(shard, now)
            if shard in self.preferred:
                delay = 0.0
            elif shard in self._seen_owned:  # its owner died: take it now, a jitter apart
                delay = self._rng.random() * self.settings.poll_s
            else:  # never owned yet: leave it to the server that prefers it for a while
                delay = self.settings.takeover_delay_s
            if now - since >= delay:
                due.append(shard)
        # A dead server's shards are loaded side by side: the takeover time is then about
        # one shard's load, not their sum.
        async with trio.open_nursery() as nursery:
            for shard in due:
                nursery.start_soon(self._try_take, shard)

    async def _try_take(self, shard: int) -> None:
        assert self.ownership is not None
        async with self._loading:
            await self._take(shard)

    async def _take(self, shard: int) -> None:
        assert self.ownership is not None
        try:
            revision = await self.ownership.acquire(shard)
        except TectonicError as e:
            log.warning("shard %d: claim failed: %s", shard, e)
            return
        if revision is None:
            return
        replica = ShardReplica(self.etcd, self.settings.prefix, shard, revision)
        # Making the copy (schema, triggers) is blocking SQLite work: off the event loop.
        store = await trio.to_thread.run_sync(
            lambda: ReplicatedStore(self.cache_dir, shard, self.total_shards, replica)
        )
        try:
            rows = await store.load_replica()
        except BaseException as e:
            store.close()
            with trio.CancelScope(shield=True):
                try:
                    await self.ownership.release(shard)
                except TectonicError as release_error:
                    log.warning("shard %d: release failed: %s", shard, release_error)
            if not isinstance(e, TectonicError):
                raise
            log.warning("shard %d: load from etcd failed (%s); retrying", shard, e)
            return
        scope = trio.CancelScope()
        self._scopes[shard] = scope
        self._nursery.start_soon(self._run_store, store, scope)
        self.stores[shard] = store
        self._owners[shard] = self.address
        if shard == REGISTRY_SHARD:
            self.registry = Registry(store, self.node_timeout)
        if shard == shard_of(ROOT_ID, self.total_shards) and self._host is not None:
            await self._host.ensure_root()
        self._unowned_since.pop(shard, None)
        log.info("shard %d: serving (%d rows from etcd)", shard, rows)

    async def _run_store(self, store: ReplicatedStore, scope: trio.CancelScope) -> None:
        with scope:
            try:
                await store.run(self.on_commit)
            finally:
                store.close()

    async def drop(self, shard: int) -> None:
        store = self.stores.pop(shard, None)
        if self._owners.get(shard) == self.address:
            del self._owners[shard]
        if shard == REGISTRY_SHARD:
            self.registry = None
        scope = self._scopes.pop(shard, None)
        if scope is not None:
            scope.cancel()
        if store is not None and self.ownership is not None:
            try:
                await self.ownership.release(shard)
            except TectonicError as e:
                log.warning("shard %d: release failed (its lease will lapse): %s", shard, e)

    async def drop_all(self) -> None:
        for shard in list(self.stores):
            await self.drop(shard)
