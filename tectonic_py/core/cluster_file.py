"""The cluster file (``cluster.toml``): everything a client or a mount needs to find a cluster.

Example::

    name = "local"
    secret_file = "secret"          # relative paths are relative to this file
    shards = 64                     # logical metadata shards, fixed at creation
    default_ec = "rs-6-3"
    chunk_size = 4194304            # bytes per data chunk of a full block

    [[metadata_servers]]
    address = "127.0.0.1:7100"
    shards = [0, 1, 2, 3]           # the logical shards this server hosts

    [metadata_engine]               # optional; without it: kind = "sqlite"
    kind = "etcd"
    endpoints = ["http://127.0.0.1:2379", "http://127.0.0.1:22379"]
    prefix = "/tectonic/local"

The server hosting shard 0 also keeps the node registry (chunk store membership). Under the
etcd engine a server's ``shards`` are the ones it claims first: when it dies another server
takes them over, and clients ask any server (``server.owners``) where a shard went.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import tomli_w

from tectonic_py.core.auth import load_secret
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import ConfigError
from tectonic_py.core.sockets import parse_address

REGISTRY_SHARD = 0
ENGINES = ("sqlite", "etcd")
DEFAULT_CHUNK_SIZE = 4 * 1024 * 1024


@dataclass
class MetadataServer:
    address: str
    shards: list[int]


@dataclass
class ClusterConfig:
    name: str
    secret_file: Path
    shards: int
    metadata_servers: list[MetadataServer]
    default_ec: str = "rs-6-3"
    chunk_size: int = DEFAULT_CHUNK_SIZE
    metadata_engine: str = "sqlite"
    etcd_endpoints: list[str] = field(default_factory=list)
    etcd_prefix: str = ""
    path: Path | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not 1 <= self.shards <= 65536:
            raise ConfigError(f"shards must be 1..65536, not {self.shards}")
        if not self.metadata_servers:
            raise ConfigError("the cluster file lists no metadata servers")
        seen: dict[int, str] = {}
        for server in self.metadata_servers:
            parse_address(server.address)
            for s in server.shards:
                if not 0 <= s < self.shards:
                    raise ConfigError(f"shard {s} of {server.address} outside 0..{self.shards - 1}")
                if s in seen:
                    raise ConfigError(f"shard {s} is on both {seen[s]} and {server.address}")
                seen[s] = server.address
        missing = set(range(self.shards)) - set(seen)
        if missing:
            raise ConfigError(f"{len(missing)} shards have no server (e.g. {min(missing)})")
        ECPolicy.parse(self.default_ec)
        if self.metadata_engine not in ENGINES:
            raise ConfigError(f"metadata engine {self.metadata_engine!r} is not one of {ENGINES}")
        if self.metadata_engine == "etcd" and not (self.etcd_endpoints and self.etcd_prefix):
            raise ConfigError("the etcd metadata engine needs endpoints and a prefix")
        if not 4096 <= self.chunk_size <= 64 * 1024 * 1024 or self.chunk_size % 4096:
            raise ConfigError("chunk_size must be a multiple of 4096 between 4 KiB and 64 MiB")

    def server_for_shard(self, shard: int) -> str:
        for server in self.metadata_servers:
            if shard in server.shards:
                return server.address
        raise ConfigError(f"no server for shard {shard}")

    @property
    def registry_address(self) -> str:
        return self.server_for_shard(REGISTRY_SHARD)

    def secret(self) -> bytes:
        return load_secret(self.secret_file)

    def to_toml(self) -> str:
        base = self.path.parent if self.path else None
        secret = self.secret_file
        if base is not None:
            try:
                secret = secret.relative_to(base)
            except ValueError:
                pass
        doc = {
            "name": self.name,
            "secret_file": str(secret),
            "shards": self.shards,
            "default_ec": self.default_ec,
            "chunk_size": self.chunk_size,
            "metadata_servers": [
                {"address": s.address, "shards": list(s.shards)} for s in self.metadata_servers
            ],
        }
        if self.metadata_engine != "sqlite":
            doc["metadata_engine"] = {
                "kind": self.metadata_engine,
                "endpoints": list(self.etcd_endpoints),
                "prefix": self.etcd_prefix,
            }
        return "# tectonic-py cluster file\n" + tomli_w.dumps(doc)

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write atomically (tmp + fsync + rename): a reader never sees half a cluster file."""
        path = Path(path)
        self.path = path
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write(self.to_toml())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def load(path: str | os.PathLike[str]) -> ClusterConfig:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"cluster file {str(path)!r} not found") from None
    except OSError as e:
        raise ConfigError(f"cannot read cluster file {str(path)!r}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"cluster file {str(path)!r} is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        # TOML is UTF-8; tomllib lets the decoder's error through rather than its own.
        raise ConfigError(
            f"cluster file {str(path)!r} is not UTF-8 text (byte {e.start}: {e.reason})"
        ) from None
    try:
        secret = Path(doc["secret_file"])
        if not secret.is_absolute():
            secret = path.parent / secret
        servers = [
            MetadataServer(str(s["address"]), [int(x) for x in s["shards"]])
            for s in doc["metadata_servers"]
        ]
        engine = doc.get("metadata_engine", {"kind": "sqlite"})
        return ClusterConfig(
            metadata_engine=str(engine["kind"]),
            etcd_endpoints=[str(e) for e in engine.get("endpoints", [])],
            etcd_prefix=str(engine.get("prefix", "")),
            name=str(doc.get("name", "tectonic")),
            secret_file=secret,
            shards=int(doc["shards"]),
            metadata_servers=servers,
            default_ec=str(doc.get("default_ec", "rs-6-3")),
            chunk_size=int(doc.get("chunk_size", DEFAULT_CHUNK_SIZE)),
            path=path,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(
            f"cluster file {str(path)!r} is missing or has a bad field: {e}"
        ) from None
