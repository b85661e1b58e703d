"""The sqlite engine: each shard a SQLite file in the server's data directory.

A server's shards are fixed by its command line (``--shards``): it hosts them from its start
to its end, and no other server serves them, so the cluster file's map of shards to servers
is the truth and ``server.owners`` only repeats it. Durability is the shard file's own
(metadata/shard.py: WAL, ``synchronous=FULL``); the safety net is ``tectonic metadata
backup`` (metadata/backup.py).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import trio

from metadata.engine import ShardHost, ShardPlan
from metadata.registry import Registry
from metadata.shard import ShardStore
from tectonic_py.core.cluster_file import REGISTRY_SHARD
from tectonic_py.core.errors import WrongShard


@dataclass(frozen=True)
class SqliteSettings:
    """The sqlite engine needs nothing but the server's data directory."""

    name: str = field(default="sqlite", init=False)


def settings_from_args(args: argparse.Namespace) -> SqliteSettings:
    """The sqlite engine takes no flags of its own."""
    return SqliteSettings()


class SqliteEngine:
    """The shards of the command line, each one ``ShardStore`` in the data directory."""

    def __init__(self, plan: ShardPlan, settings: SqliteSettings) -> None:
        self.stores = {s: ShardStore(plan.data_dir, s, plan.total_shards) for s in plan.shards}
        self.on_commit = plan.on_commit
        self.registry: Registry | None = None
        if REGISTRY_SHARD in self.stores:
            self.registry = Registry(self.stores[REGISTRY_SHARD], plan.node_timeout)
        self._host: ShardHost | None = None

    def start(self, nursery: trio.Nursery) -> None:
        for store in self.stores.values():
            nursery.start_soon(store.run, self.on_commit)

    async def run(
        self, host: ShardHost, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Nothing to keep: the shards stay this server's."""
        self._host = host
        task_status.started()

    def _address(self) -> str:
        return self._host.address if self._host is not None else ""

    def check(self, shard: int) -> ShardStore:
        store = self.stores.get(shard)
        if store is None:
            raise WrongShard(f"shard {shard} is not hosted by {self._address() or 'this server'}")
        return store

    def node_registry(self) -> Registry:
        if self.registry is None:
            raise WrongShard(f"the node registry lives with shard {REGISTRY_SHARD}, not here")
        return self.registry

    async def owners(self) -> dict[int, str]:
        return {s: self._address() for s in self.stores}
