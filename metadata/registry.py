"""Node registry (disk inventory): which chunk stores exist, where, and whether they are live.

Served by the metadata server hosting the registry shard (``REGISTRY_SHARD``, 0). A chunk
store's first heartbeat registers it; registrations (node id, address, failure domain,
capacity) are persisted in the registry shard's SQLite file through its group commit, but
only when they change: a heartbeat every second from every node must not cost an fsync each.
Liveness is in memory: ``last_seen`` of the latest heartbeat; a node silent for longer than
``node_timeout`` is ``down`` and is never placed on. After a restart every persisted node
starts with a fresh ``last_seen`` (a grace period of one timeout) so placement works at once;
a node that is really gone drops out when the grace period ends.

A node id is one store's: a heartbeat naming a registered id from another address is
refused (``Refused``) while the registration is up, so a second store started with a
taken id (a copied config) cannot take over its chunks' placements. A store that really
moved (a new host or port) is accepted once its old registration has been silent for
``node_timeout`` (down); a restart on the same address is always accepted.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from dataclasses import replace
from typing import Any

import trio

from metadata.shard import ShardStore, now_ns
from tectonic_py.core.errors import InvalidArgument, Refused
from tectonic_py.core.ids import NODE_ID_RE
from tectonic_py.core.records import NodeInfo
from tectonic_py.core.sockets import parse_address

log = logging.getLogger(__name__)


def _persist(conn: sqlite3.Connection, node: dict[str, Any], when_ns: int) -> None:
    conn.execute(
        "INSERT OR REPLACE INTO nodes (node_id, address, failure_domain, capacity, free,"
        " registered_ns) VALUES (?, ?, ?, ?, ?, ?)",
        (
            node["node_id"],
            node["address"],
            node["failure_domain"],
            node["capacity"],
            node["free"],
            when_ns,
        ),
    )


class Registry:
    def __init__(self, store: ShardStore, node_timeout: float) -> None:
        self.store = store
        self.node_timeout = node_timeout
        self._nodes: dict[str, NodeInfo] = {}
        start = time.time()
        for node_id, address, domain, capacity, free, _ in store.reader.execute(
            "SELECT node_id, address, failure_domain, capacity, free, registered_ns FROM nodes"
        ):
            self._nodes[node_id] = NodeInfo(
                node_id=node_id,
                address=address,
                failure_domain=domain,
                capacity=capacity,
                free=free,
                last_seen=start,
            )

    async def heartbeat(self, fields: dict[str, Any]) -> None:
        node_id = fields["node_id"]
        if not NODE_ID_RE.match(node_id):
            raise InvalidArgument(f"invalid node id {node_id!r}")
        parse_address(fields["address"])
        if not fields["failure_domain"] or len(fields["failure_domain"]) > 128:
            raise InvalidArgument("failure_domain must be 1..128 characters")
        old = self._nodes.get(node_id)
        if (
            old is not None
            and old.address != fields["address"]
            and time.time() - old.last_seen <= self.node_timeout
        ):
            raise Refused(
                f"node id {node_id!r} is registered at {old.address}, which is up; a store"
                f" moving to {fields['address']} is accepted once that one is silent for"
                f" {self.node_timeout:g}s"
            )
        changed = old is None or (old.address, old.failure_domain, old.capacity) != (
            fields["address"],
            fields["failure_domain"],
            fields["capacity"],
        )
        if changed:
            await self.store.write(_persist, fields, now_ns())
            if old is None:
                log.info(
                    "registered node %s at %s (%s)",
                    node_id,
                    fields["address"],
                    fields["failure_domain"],
                )
        self._nodes[node_id] = NodeInfo(
            node_id=node_id,
            address=fields["address"],
            failure_domain=fields["failure_domain"],
            capacity=fields["capacity"],
            free=fields["free"],
            chunk_count=fields["chunk_count"],
            queue_depth=fields["queue_depth"],
            fs_id=fields.get("fs_id", ""),
            fs_total=fields.get("fs_total", 0),
            fs_free=fields.get("fs_free", 0),
            last_seen=time.time(),
        )

    def nodes(self) -> list[NodeInfo]:
        now = time.time()
        return [
            replace(n, state="up" if now - n.last_seen <= self.node_timeout else "down")
            for n in sorted(self._nodes.values(), key=lambda n: n.node_id)
        ]

    def known(self, node_id: str) -> bool:
        """Whether ``node_id`` is registered (up or down)."""
        return node_id in self._nodes


class RemoteRegistry:
    """The registry of another server, asked as a server (role node: the handshake proves
    both ends hold the cluster secret, so no caller can stand in a registry of its own),
    its node ids kept for ``ttl_s`` so that a repair round's many repoints cost one ask."""

    def __init__(self, secret: bytes, ttl_s: float = 2.0) -> None:
        self.secret = secret
        self.ttl_s = ttl_s
        self._known: dict[str, tuple[float, frozenset[str]]] = {}

    async def knows(self, address: str, node_id: str) -> bool | None:
        """Whether the registry at ``address`` knows ``node_id``; None when it cannot be
        asked within a few seconds or does not serve the registry."""
        seen = self._known.get(address)
        if seen is not None and time.monotonic() - seen[0] < self.ttl_s:
            return node_id in seen[1]
        ids = await _node_ids(address, self.secret)
        if ids is None:
            return None
        self._known[address] = (time.monotonic(), ids)
        return node_id in ids


async def _node_ids(address: str, secret: bytes) -> frozenset[str] | None:
    from tectonic_py.core import rpc_client
    from tectonic_py.core.auth import ROLE_NODE, Credential
    from tectonic_py.core.errors import TectonicError

    try:
        host, port = parse_address(address)
        with trio.fail_after(5):
            cred = Credential.from_secret(secret, ROLE_NODE)
            async with rpc_client.open_connection(host, port, cred) as conn:
                resp = await conn.call("node.list", {})
    except (TectonicError, OSError, trio.TooSlowError):
        return None
    return frozenset(str(n.get("node_id")) for n in resp.fields["nodes"])
