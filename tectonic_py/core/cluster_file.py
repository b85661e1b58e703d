"""The cluster file (``cluster.toml``): everything a client or a mount needs to find a cluster.

Example::

    name = "local"
    role = "client"                 # what this file's holder may do (core/auth.py roles)
    key_file = "keys/client.key"    # that role's key; relative paths are relative to this file
    shards = 64                     # logical metadata shards, fixed at creation
    default_ec = "rs-6-3"
    chunk_size = 4194304            # bytes per data chunk of a full block
    job = "train-a"                 # optional: this holder's traffic class at chunk stores
    job_weight = 3                  # optional: its weight where the stores set none

    [[metadata_servers]]
    address = "127.0.0.1:7100"
    shards = [0, 1, 2, 3]           # the logical shards this server hosts

    [metadata_engine]               # optional; without it: kind = "sqlite"
    kind = "etcd"
    endpoints = ["http://127.0.0.1:2379", "http://127.0.0.1:22379"]
    prefix = "/tectonic/local"

A cluster file names either a role's key (``key_file``, what ``tectonic cluster up`` writes:
``cluster.toml`` for the operator as admin, ``client.toml`` for GPU nodes as client,
``maintenance.toml`` for the maintenance daemon) or, as files written before roles did, the
cluster secret itself (``secret_file``): its holder then speaks as ``role`` (admin when the
file names none) with the key derived for it.

The server hosting shard 0 also keeps the node registry (chunk store membership). Under the
etcd engine a server's ``shards`` are the ones it claims first: when it dies another server
takes them over, and clients ask any server (``server.owners``) where a shard went.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from tectonic_py.core.auth import ROLE_ADMIN, ROLES, Credential, check_job, load_secret
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
    secret_file: Path | None  # the cluster secret (files written before roles), or None
    shards: int
    metadata_servers: list[MetadataServer]
    default_ec: str = "rs-6-3"
    chunk_size: int = DEFAULT_CHUNK_SIZE
    metadata_engine: str = "sqlite"
    etcd_endpoints: list[str] = field(default_factory=list)
    etcd_prefix: str = ""
    path: Path | None = field(default=None, compare=False)
    role: str = ROLE_ADMIN
    key_file: Path | None = None  # the role's own key (module docstring)
    # The job this holder's chunk traffic belongs to, and its weight where the chunk stores'
    # ``--job`` settings name none (chunkstore/traffic.py); "" and 0: none.
    job: str = ""
    job_weight: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"unknown role {self.role!r}; the roles are {', '.join(ROLES)}")
        check_job(self.job, self.job_weight)
        if (self.secret_file is None) == (self.key_file is None):
            raise ConfigError("a cluster file names one of key_file and secret_file")
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

    def credential(self) -> Credential:
        """The role this file's holder speaks as, and its key (read now, checked as a
        secret file is: mode 0600, long enough)."""
        if self.key_file is not None:
            key = load_secret(self.key_file, what=f"{self.role} key file")
        else:
            assert self.secret_file is not None
            key = Credential.from_secret(load_secret(self.secret_file), self.role).key
        return Credential(self.role, key, self.job, self.job_weight)

    def with_job(self, job: str, weight: int = 0) -> ClusterConfig:
        """The same holder, its chunk traffic in the class of ``job`` (``--job``)."""
        return dataclasses.replace(self, job=job, job_weight=weight)

    def with_role(self, role: str, key_file: Path) -> ClusterConfig:
        """The same cluster as seen by another role (``tectonic cluster up`` writes one file
        per role)."""
        return dataclasses.replace(self, role=role, key_file=key_file, secret_file=None)

    def to_toml(self) -> str:
        base = self.path.parent if self.path else None

        def relative(p: Path) -> str:
            if base is not None:
                try:
                    return str(p.relative_to(base))
                except ValueError:
                    pass
            return str(p)

        doc: dict[str, Any] = {"name": self.name, "role": self.role}
        if self.key_file is not None:
            doc["key_file"] = relative(self.key_file)
        else:
            assert self.secret_file is not None
            doc["secret_file"] = relative(self.secret_file)
        doc |= {
            "shards": self.shards,
            "default_ec": self.default_ec,
            "chunk_size": self.chunk_size,
            **({"job": self.job} if self.job else {}),
            **({"job_weight": self.job_weight} if self.job_weight else {}),
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

        def near(name: str) -> Path | None:
            if name not in doc:
                return None
            p = Path(str(doc[name]))
            return p if p.is_absolute() else path.parent / p

        secret, key_file = near("secret_file"), near("key_file")
        if secret is None and key_file is None:
            raise KeyError("key_file")
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
            key_file=key_file,
            role=str(doc.get("role", ROLE_ADMIN)),
            shards=int(doc["shards"]),
            metadata_servers=servers,
            default_ec=str(doc.get("default_ec", "rs-6-3")),
            chunk_size=int(doc.get("chunk_size", DEFAULT_CHUNK_SIZE)),
            job=str(doc.get("job", "")),
            job_weight=int(doc.get("job_weight", 0)),
            path=path,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(
            f"cluster file {str(path)!r} is missing or has a bad field: {e}"
        ) from None
