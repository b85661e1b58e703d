"""The metadata client's calls of whole servers: statistics, capacity, backups.

Each ``server.*`` op goes to every metadata server of the cluster file, by address, at once.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from metadata.block_calls import BlockCalls
from metadata.routing import Router, gather
from tectonic_py.core.records import NodeInfo


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


class ServerCalls:
    """The ``server.*`` calls, and the cluster's capacity (the registry's node list)."""

    def __init__(self, router: Router, blocks: BlockCalls) -> None:
        self._r = router
        self._blocks = blocks

    async def _every_server(self, op: str) -> list[dict[str, Any]]:
        def job(address: str) -> Callable[[], Awaitable[dict[str, Any]]]:
            return lambda: self._r.call_server(address, op)

        return await gather([job(s.address) for s in self._r.config.metadata_servers])

    async def server_stats(self) -> dict[str, dict[str, Any]]:
        """Every metadata server's ``server.stats`` (files and, per shard, the group
        commit's batches, mutations and largest batch), by server address."""
        addresses = [s.address for s in self._r.config.metadata_servers]
        stats = await self._every_server("server.stats")
        return dict(zip(addresses, stats, strict=True))

    async def statfs(self) -> dict[str, Any]:
        """Cluster capacity: {"capacity", "free", "files"...} from the registry."""
        nodes = await self._blocks.nodes()
        up = [n for n in nodes if n.state == "up"]
        stats = await self._every_server("server.stats")
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
            return lambda: self._r.call_server(address, "server.backup", {"dest": where})

        servers = self._r.config.metadata_servers
        return await gather([job(i, s.address) for i, s in enumerate(servers)])
