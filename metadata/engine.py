"""The interface of a metadata engine: how a server holds its shards, whatever keeps them.

A server (metadata/server.py) hosts shards, answers their ops from their ``ShardStore``s,
serves the node registry while it holds ``REGISTRY_SHARD`` and tells clients where shards are
(``server.owners``); which shards it holds, and how their rows are kept, is the engine's
business. Engines are chosen by name from metadata/engines.py (the cluster file's
``metadata_engine``, ``--engine``): ``sqlite`` (metadata/sqlite_engine.py: each shard a
SQLite file of the server's, fixed by its command line) and ``etcd``
(metadata/etcd_shards.py: rows in etcd, each shard served by whichever server owns it).

The server is the engine's ``ShardHost``: the engine needs only its address and a way to
have the root directory made when the root's shard arrives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import trio

from metadata.registry import Registry
from metadata.shard import ShardStore


@dataclass(frozen=True)
class ShardPlan:
    """What every engine is told of the server it serves: its data directory, the shards
    its command line names (those it hosts, or under etcd those it claims first), of how
    many, and how long a silent chunk store stays up in the registry."""

    data_dir: Path
    shards: list[int]
    total_shards: int
    node_timeout: float
    # Told of every group commit: (mutations in it, seconds it took); the server's metrics.
    on_commit: Callable[[int, float], None] | None = None


class EngineSettings(Protocol):
    """An engine's own settings; ``name`` says which engine (metadata/engines.py)."""

    @property
    def name(self) -> str: ...


class ShardHost(Protocol):
    """What an engine needs of the server hosting it."""

    @property
    def address(self) -> str:
        """Where the server listens ("" before it does)."""
        ...

    async def ensure_root(self) -> None:
        """Make the root directory if its shard is served here and lacks it."""
        ...


class Engine(Protocol):
    """How a metadata server holds its shards."""

    @property
    def stores(self) -> Mapping[int, ShardStore]:
        """The shards this server serves now."""
        ...

    @property
    def registry(self) -> Registry | None:
        """The node registry, while ``REGISTRY_SHARD`` is served here."""
        ...

    def start(self, nursery: trio.Nursery) -> None:
        """Before the server listens: start the committers of the shards held from the
        start."""
        ...

    async def run(
        self, host: ShardHost, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Once the server listens: keep its shards (taking, giving up) as long as it runs;
        started when the server may say it is ready."""
        ...

    def check(self, shard: int) -> ShardStore:
        """The store of a shard this server may serve right now, else ``WrongShard``."""
        ...

    def node_registry(self) -> Registry:
        """The node registry if it may be served here right now, else ``WrongShard``."""
        ...

    async def owners(self) -> dict[int, str]:
        """Shard -> the address serving it, as far as this server knows."""
        ...
