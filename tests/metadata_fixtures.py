"""Helpers for metadata tests: an in-process metadata cluster on 127.0.0.1, port 0."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import trio

from metadata.client import MetadataClient
from metadata.etcd_shards import EtcdSettings
from metadata.server import MetadataServer
from tectonic_py.core.cluster_file import ClusterConfig
from tectonic_py.core.cluster_file import MetadataServer as ServerEntry


@dataclass
class MetaCluster:
    client: MetadataClient
    servers: list[MetadataServer]
    config: ClusterConfig
    capability_key: bytes  # what the servers sign capabilities with (clients never hold it)


@asynccontextmanager
async def open_meta_cluster(
    root: Path,
    secret_file: Path,
    *,
    servers: int = 2,
    shards: int = 8,
    node_timeout: float = 10.0,
    recovery_interval_s: float = 5.0,
    ports: list[int] | None = None,
    capability_key: bytes | None = None,
    etcd: EtcdSettings | None = None,
) -> AsyncIterator[MetaCluster]:
    """``ports``: listen on these (a restart "on the same addresses"); default any free port.
    ``capability_key``: default a fresh random one. ``etcd``: the etcd engine (each server
    claims its share of the shards first)."""
    secret = secret_file.read_bytes().strip()
    key = capability_key if capability_key is not None else secrets.token_hex(32).encode()
    async with trio.open_nursery() as nursery:
        entries = []
        objs = []
        for i in range(servers):
            hosted = list(range(i * shards // servers, (i + 1) * shards // servers))
            server = MetadataServer(
                root / f"meta{i}",
                hosted,
                shards,
                secret,
                capability_key=key,
                node_timeout=node_timeout,
                recovery_interval_s=recovery_interval_s,
                engine=etcd,
            )
            host, port = await nursery.start(server.serve, "127.0.0.1", ports[i] if ports else 0)
            entries.append(ServerEntry(f"{host}:{port}", hosted))
            objs.append(server)
        config = ClusterConfig("test", secret_file, shards, entries)
        if etcd is not None:
            config.metadata_engine = "etcd"
            config.etcd_endpoints = list(etcd.endpoints)
            config.etcd_prefix = etcd.prefix
        client = MetadataClient(config, nursery=nursery)
        try:
            yield MetaCluster(client, objs, config, key)
        finally:
            await client.aclose()
            nursery.cancel_scope.cancel()


async def register_nodes(client: MetadataClient, count: int, domains: int | None = None) -> None:
    for i in range(count):
        await client.call_registry(
            "node.heartbeat",
            {
                "node_id": f"node{i}",
                "address": f"127.0.0.1:{20000 + i}",
                "failure_domain": f"rack{i % (domains or count)}",
                "capacity": 10**12,
                "free": 10**12 - i,
                "chunk_count": 0,
                "queue_depth": 0,
            },
        )
