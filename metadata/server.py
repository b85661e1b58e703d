"""The metadata server daemon: hosts some logical shards and answers their RPCs.

One process hosts a set of logical shards (``--shards``), each a ``ShardStore`` (its own
SQLite file and group-committing writer). Every shard-scoped request names its ``shard``; a
server that does not host it answers ``WrongShard`` (the client's shard map is stale or
wrong). The server hosting ``REGISTRY_SHARD`` also serves the node registry
(``node.*``) and creates the root directory (``ROOT_ID``) in ``shard_of(ROOT_ID)`` on first
start when it hosts that shard.

Op table (fields; every ``name.*``/``file.*``/``block.*`` op also takes ``shard``):

==================== ===================================================== =====================
op                   fields                                                reply
==================== ===================================================== =====================
name.lookup          dir, name                                             id, kind, [attrs]
name.insert          dir, name, id, kind                                   {}
name.make_node       dir, name, kind, mode, uid, gid, target, rdev         attrs
name.list            dir, after, limit                                     entries, next
name.remove          dir, name, kind, expect_id                            id
name.rename          src_dir, src_name, dst_dir, dst_name, replace_dir     id, kind, victim_*
name.rename_prepare  src_dir, src_name, dst_dir, dst_name, dst_address,    intent, id, kind
                     deadline_ns
name.rename_apply    dst_dir, dst_name, id, kind, deadline_ns, replace_dir victim_id, victim_kind
name.rename_finish   intent, applied                                       {}
name.intents         before_ns                                             intents
file.create          kind, mode, uid, gid, ec, chunk_size, parent, name    attrs, token
file.get             id                                                    attrs, parent
file.open            id, truncate                                          token
file.renew           id, token                                             {}
file.seal            id, token, size                                       attrs
file.set_size        id, token, size                                       attrs
file.setattr         id, mode, uid, gid, atime_ns, mtime_ns, ec            attrs
file.link            id, parent, name                                      {}
file.add_link        id                                                    attrs
file.readlink        id                                                    target
file.unlink          id                                                    {}
file.kill_dir        id                                                    {}
file.revive_dir      id                                                    {}
file.drop            id                                                    {}
file.blocks          id                                                    blocks [[index, id]]
file.*xattr          id, name, value                                       value / names / {}
file.orphans         older_than_ns, limit                                  orphans
file.collect_orphan  id                                                    deleted
file.gc_blocks       limit                                                 block_ids
block.allocate       file_id, token, ec, nodes                             block_id, capability
block.grant          block_id, nodes                                       nodes, capability
block.commit         file_id, blocks [BlockInfo...]                        {}
block.locate         ids                                                   blocks
block.by_node        node_id, after, limit                                 chunks [[block, idx]]
block.replace_chunk  block_id, index, old_node, new_node, checksum         {}
block.report_bad_chunk                                                     recorded
                     block_id, index, node_id, reason
node.heartbeat       node_id, address, failure_domain, capacity, free,     {}
                     chunk_count, queue_depth
node.list            -                                                     nodes
server.stats         -                                                     shards, files, ...
server.owners        -                                                     owners {shard: addr}
server.backup        dest (a new directory on this host)                   manifest
batch                ops [[op, fields], ...] (``name.*``/``file.*``/        results [{f} | {err,
                     ``block.*`` ops, at most ``MAX_BATCH_OPS``)           msg}, ...]
==================== ===================================================== =====================

``batch`` carries many independent requests in one frame (the client coalesces what its
ranks send one server while a call to it is in flight, metadata/coalescer.py). Its ops run
concurrently, so their mutations meet in their shards' group commits; each gets its own
result or its own error, encoded by ``rpc_server.error_to_header`` as a lone request's is.

The combined ops of the write path (``name.create``, ``file.commit``, ``file.close``: what
several of the ops above do, in one transaction) are ``WriteOps``, metadata/write_ops.py.

Background: a recovery pass over rename intents at start and every few seconds (see
metadata/name_layer.py for the protocol). It finishes or aborts intents whose deadline has
passed, asking the destination shard (locally, or over the wire at the address the intent
recorded) whether the destination entry points at the child.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import trio

from metadata import backup, block_layer, file_layer, name_layer
from metadata.checkpoint_ops import CheckpointOps
from metadata.engine import Engine, EngineSettings, ShardPlan
from metadata.engines import open_engine
from metadata.maintenance_ops import MaintenanceOps
from metadata.registry import Registry
from metadata.shard import ShardStore, now_ns
from metadata.sqlite_engine import SqliteSettings
from metadata.write_ops import WriteOps
from tectonic_py.core import capability, rpc_client, rpc_server, sockets
from tectonic_py.core.cluster_file import DEFAULT_CHUNK_SIZE
from tectonic_py.core.ec_policy import DEFAULT_POLICY
from tectonic_py.core.errors import (
    ConfigError,
    FileNotFound,
    InvalidArgument,
    StaleWriterToken,
    TectonicError,
    WrongShard,
)
from tectonic_py.core.ids import MAX_ID, ROOT_ID, shard_of
from tectonic_py.core.records import (
    ALL_KINDS,
    KIND_DIR,
    MAX_SYMLINK_TARGET,
    NODE_KINDS,
    Attrs,
    validate_name,
)
from tectonic_py.core.rpc_server import Request, error_to_header

log = logging.getLogger(__name__)

LEASE_NS = 60 * 1_000_000_000
RECOVERY_INTERVAL_S = 5.0
MAX_MODE = 0o7777
MAX_UGID = 2**32 - 1
MAX_BATCH_OPS = 512
_BATCHABLE_PREFIXES = ("name.", "file.", "block.")


def _attrs(attrs: Attrs) -> dict[str, Any]:
    """Attrs as a wire map; a shallow copy (``asdict`` deep-copies, a hot spot in profiles)."""
    return dict(attrs.__dict__)


def _id(req: Request, name: str) -> int:
    return req.int(name, lo=1, hi=MAX_ID)


def _name(req: Request, field: str = "name") -> str:
    value = req.fields.get(field)
    return validate_name(value)


def _kind(req: Request) -> str:
    kind = req.str("kind", max_len=8)
    if kind not in ALL_KINDS:
        raise InvalidArgument(f"{req.op}: unknown kind {kind!r}")
    return kind


def write_ready_file(path: str | os.PathLike[str], address: str) -> None:
    """Atomically (tmp + fsync + rename), so a launcher never reads half a ready file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"address": address, "pid": os.getpid()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class MetadataServer(MaintenanceOps, CheckpointOps, WriteOps):
    """Handlers over the hosted shards. Create, then ``await nursery.start(server.serve, ...)``.

    The ops of the background services come from ``MaintenanceOps``
    (metadata/maintenance_ops.py), those of checkpoints (durability, the atomic commit of a
    step) from ``CheckpointOps`` (metadata/checkpoint_ops.py)."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        shards: list[int],
        total_shards: int,
        secret: bytes,
        *,
        capability_key: bytes,
        node_timeout: float = 10.0,
        lease_ns: int = LEASE_NS,
        recovery_interval_s: float = RECOVERY_INTERVAL_S,
        engine: EngineSettings | None = None,
    ) -> None:
        """``engine``: the settings of the engine that keeps the shards (metadata/engine.py;
        sqlite's by default). Under etcd ``shards`` are the ones this server claims first,
        and it serves whatever it owns."""
        if total_shards < 1:
            raise InvalidArgument(f"total shards must be at least 1, not {total_shards}")
        if not shards:
            raise InvalidArgument("a metadata server must host at least one shard")
        for s in shards:
            if not 0 <= s < total_shards:
                raise InvalidArgument(f"shard {s} outside 0..{total_shards - 1}")
        self.data_dir = Path(data_dir)
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"cannot create data directory {str(data_dir)!r}: {e.strerror}"
            ) from None
        self.total_shards = total_shards
        self.secret = secret
        if len(capability_key) < 16:
            raise ConfigError("the capability key must be at least 16 bytes")
        self.capability_key = capability_key  # signs capabilities; clients never hold it
        self.lease_ns = lease_ns
        self.recovery_interval_s = recovery_interval_s
        self.node_timeout = node_timeout
        plan = ShardPlan(self.data_dir, sorted(set(shards)), total_shards, node_timeout)
        self.engine: Engine = open_engine(engine or SqliteSettings(), plan)
        self.address = ""
        handlers: dict[str, Callable[[Request], Awaitable[Any]]] = {}
        for attr in dir(self):
            if attr.startswith("op_"):
                op = attr[3:].replace("__", ".", 1)
                handlers[op] = getattr(self, attr)
        self.rpc = rpc_server.RpcServer(f"metadata[{shards[0]}..]", secret, handlers)

    @property
    def stores(self) -> Mapping[int, ShardStore]:
        """The shards this server serves now (its engine's)."""
        return self.engine.stores

    @property
    def registry(self) -> Registry | None:
        return self.engine.registry

    # --- lifecycle ---------------------------------------------------------------------------

    async def serve(
        self,
        host: str,
        port: int,
        *,
        ready_file: str | os.PathLike[str] | None = None,
        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self.engine.start(nursery)
                await self.ensure_root()
                h, p = await nursery.start(self.rpc.serve, host, port)
                self.address = f"{h}:{p}"
                await nursery.start(self.engine.run, self)
                nursery.start_soon(self._recovery_loop)
                if ready_file is not None:
                    write_ready_file(ready_file, self.address)
                task_status.started((h, p))
        finally:
            for store in self.stores.values():
                store.close()

    async def ensure_root(self) -> None:
        """The root directory, made once in its shard when this server serves that."""
        root_shard = shard_of(ROOT_ID, self.total_shards)
        store = self.stores.get(root_shard)
        if store is None:
            return
        if store.reader.execute("SELECT 1 FROM files WHERE id = ?", (ROOT_ID,)).fetchone():
            return
        spec = {
            "kind": KIND_DIR,
            "mode": 0o755,
            "uid": 0,
            "gid": 0,
            "ec": DEFAULT_POLICY.name,
            "chunk_size": DEFAULT_CHUNK_SIZE,
            "parent": ROOT_ID,
            "name": "",
        }
        await store.write(
            file_layer.create, root_shard, self.total_shards, spec, now_ns(), 0, ROOT_ID
        )
        log.info("created the root directory in shard %d", root_shard)

    def _store(self, req: Request) -> ShardStore:
        return self.engine.check(req.int("shard", hi=2**31))

    # --- Name layer ---------------------------------------------------------------------------

    async def op_name__lookup(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        child, kind = store.read(name_layer.lookup, _id(req, "dir"), _name(req))
        reply: dict[str, Any] = {"id": child, "kind": kind}
        # The child's record is often on this server too: answer lookup in one round trip.
        child_store = self.stores.get(shard_of(child, self.total_shards))
        if child_store is not None:
            try:
                reply["attrs"] = _attrs(child_store.read(file_layer.get, child, now_ns()))
            except FileNotFound:
                pass
        return reply

    async def op_name__insert(self, req: Request) -> None:
        store = self._store(req)
        await store.write(
            name_layer.insert, _id(req, "dir"), _name(req), _id(req, "id"), _kind(req)
        )

    async def op_name__make_node(self, req: Request) -> dict[str, Any]:
        """A symlink or special file: record and entry in the directory's shard, at once."""
        store = self._store(req)
        dir_id = _id(req, "dir")
        if shard_of(dir_id, self.total_shards) != store.shard:
            raise InvalidArgument("name.make_node: the directory is not in this shard")
        kind = _kind(req)
        if kind not in NODE_KINDS:
            raise InvalidArgument(f"name.make_node: {kind!r} is not a symlink or special file")
        spec = {
            "kind": kind,
            "mode": req.int("mode", 0o777, hi=MAX_MODE),
            "uid": req.int("uid", 0, hi=MAX_UGID),
            "gid": req.int("gid", 0, hi=MAX_UGID),
            "ec": DEFAULT_POLICY.name,
            "chunk_size": DEFAULT_CHUNK_SIZE,
            "target": req.bytes("target", b"", max_len=MAX_SYMLINK_TARGET),
            "rdev": req.int("rdev", 0, hi=2**64 - 1),
        }
        attrs = await store.write(
            name_layer.make_node,
            store.shard,
            self.total_shards,
            dir_id,
            _name(req),
            spec,
            now_ns(),
        )
        return {"attrs": _attrs(attrs)}

    async def op_name__list(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        after = req.str("after", "", max_len=1024)
        limit = req.int("limit", 1000, lo=1, hi=name_layer.MAX_PAGE)
        entries, cursor = store.read(name_layer.list_entries, _id(req, "dir"), after, limit)
        return {"entries": [[e.name, e.id, e.kind] for e in entries], "next": cursor}

    async def op_name__remove(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        child = await store.write(
            name_layer.remove,
            _id(req, "dir"),
            _name(req),
            _kind(req),
            req.int("expect_id", 0, hi=MAX_ID),
        )
        return {"id": child}

    async def op_name__rename(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        src_dir, dst_dir = _id(req, "src_dir"), _id(req, "dst_dir")
        if (
            shard_of(dst_dir, self.total_shards) != store.shard
            or shard_of(src_dir, self.total_shards) != store.shard
        ):
            raise InvalidArgument("name.rename: both directories must be in this shard")
        return await store.write(
            name_layer.rename_local,
            src_dir,
            _name(req, "src_name"),
            dst_dir,
            _name(req, "dst_name"),
            req.int("replace_dir", 0, hi=MAX_ID),
        )

    async def op_name__rename_prepare(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        dst_address = req.str("dst_address", max_len=300)
        sockets.parse_address(dst_address)
        return await store.write(
            name_layer.rename_prepare,
            _id(req, "src_dir"),
            _name(req, "src_name"),
            _id(req, "dst_dir"),
            _name(req, "dst_name"),
            dst_address,
            req.int("deadline_ns", hi=2**63 - 1),
        )

    async def op_name__rename_apply(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        return await store.write(
            name_layer.rename_apply,
            _id(req, "dst_dir"),
            _name(req, "dst_name"),
            _id(req, "id"),
            _kind(req),
            req.int("deadline_ns", hi=2**63 - 1),
            now_ns(),
            req.int("replace_dir", 0, hi=MAX_ID),
        )

    async def op_name__rename_finish(self, req: Request) -> None:
        store = self._store(req)
        await store.write(name_layer.rename_finish, _id(req, "intent"), req.bool("applied"))

    async def op_name__intents(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        return {"intents": store.read(name_layer.intents, req.int("before_ns", hi=2**63 - 1))}

    # --- File layer ---------------------------------------------------------------------------

    async def op_file__create(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        parent = _id(req, "parent")
        spec = {
            "kind": _kind(req),
            "mode": req.int("mode", 0o644, hi=MAX_MODE),
            "uid": req.int("uid", 0, hi=MAX_UGID),
            "gid": req.int("gid", 0, hi=MAX_UGID),
            "ec": req.str("ec", DEFAULT_POLICY.name, max_len=16),
            "chunk_size": req.int("chunk_size", DEFAULT_CHUNK_SIZE, lo=4096, hi=64 * 2**20),
            "parent": parent,
            "name": _name(req),
        }
        attrs, token = await store.write(
            file_layer.create, store.shard, self.total_shards, spec, now_ns(), self.lease_ns
        )
        return {"attrs": _attrs(attrs), "token": token}

    async def op_file__get(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        file_id = _id(req, "id")
        return {
            "attrs": _attrs(store.read(file_layer.get, file_id, now_ns())),
            "parent": store.read(file_layer.parent_of, file_id),
        }

    async def op_file__open(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        token = await store.write(
            file_layer.open_for_write,
            _id(req, "id"),
            req.bool("truncate", False),
            now_ns(),
            self.lease_ns,
        )
        return {"token": token}

    async def op_file__renew(self, req: Request) -> None:
        store = self._store(req)
        await store.write(
            file_layer.renew_lease,
            _id(req, "id"),
            req.int("token", hi=MAX_ID),
            now_ns(),
            self.lease_ns,
        )

    async def op_file__seal(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        attrs = await store.write(
            file_layer.seal,
            _id(req, "id"),
            req.int("token", hi=MAX_ID),
            req.int("size", hi=2**62),
            now_ns(),
        )
        return {"attrs": _attrs(attrs)}

    async def op_file__set_size(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        attrs = await store.write(
            file_layer.set_size,
            _id(req, "id"),
            req.int("token", hi=MAX_ID),
            req.int("size", hi=2**62),
            now_ns(),
        )
        return {"attrs": _attrs(attrs)}

    async def op_file__setattr(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        changes = {
            "mode": req.int("mode", None, hi=MAX_MODE),
            "uid": req.int("uid", None, hi=MAX_UGID),
            "gid": req.int("gid", None, hi=MAX_UGID),
            "atime_ns": req.int("atime_ns", None, hi=2**63 - 1),
            "mtime_ns": req.int("mtime_ns", None, hi=2**63 - 1),
            "ec": req.str("ec", None, max_len=16),
        }
        attrs = await store.write(file_layer.setattr_, _id(req, "id"), changes, now_ns())
        return {"attrs": _attrs(attrs)}

    async def op_file__link(self, req: Request) -> None:
        store = self._store(req)
        await store.write(file_layer.link, _id(req, "id"), _id(req, "parent"), _name(req))

    async def op_file__add_link(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        attrs = await store.write(file_layer.add_link, _id(req, "id"), now_ns())
        return {"attrs": _attrs(attrs)}

    async def op_file__readlink(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        return {"target": store.read(file_layer.readlink, _id(req, "id"))}

    async def op_file__unlink(self, req: Request) -> None:
        store = self._store(req)
        await store.write(file_layer.unlink, _id(req, "id"), now_ns())

    async def op_file__kill_dir(self, req: Request) -> None:
        store = self._store(req)
        await store.write(file_layer.kill_dir, _id(req, "id"))

    async def op_file__revive_dir(self, req: Request) -> None:
        store = self._store(req)
        await store.write(file_layer.revive_dir, _id(req, "id"))

    async def op_file__drop(self, req: Request) -> None:
        store = self._store(req)
        file_id = _id(req, "id")
        if file_id == ROOT_ID:
            raise InvalidArgument("the root directory cannot be removed")
        await store.write(file_layer.drop, file_id, now_ns())

    async def op_file__blocks(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        return {"blocks": [list(p) for p in store.read(file_layer.blocks, _id(req, "id"))]}

    async def op_file__getxattr(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        value = store.read(file_layer.getxattr, _id(req, "id"), req.str("name", max_len=255))
        return {"value": value}

    async def op_file__setxattr(self, req: Request) -> None:
        store = self._store(req)
        await store.write(
            file_layer.setxattr,
            _id(req, "id"),
            req.str("name", max_len=255),
            req.bytes("value", max_len=file_layer.MAX_XATTR_VALUE),
        )

    async def op_file__listxattr(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        return {"names": store.read(file_layer.listxattr, _id(req, "id"))}

    async def op_file__removexattr(self, req: Request) -> None:
        store = self._store(req)
        await store.write(file_layer.removexattr, _id(req, "id"), req.str("name", max_len=255))

    async def op_file__orphans(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        return {
            "orphans": store.read(
                file_layer.orphans,
                req.int("older_than_ns", hi=2**63 - 1),
                req.int("limit", 1000, lo=1, hi=10_000),
            )
        }

    async def op_file__collect_orphan(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        return {"deleted": await store.write(file_layer.collect_orphan, _id(req, "id"), now_ns())}

    async def op_file__gc_blocks(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        return {
            "block_ids": store.read(file_layer.gc_blocks, req.int("limit", 1000, lo=1, hi=10_000))
        }

    # --- Block layer --------------------------------------------------------------------------

    def _node_list(self, req: Request, field: str = "nodes") -> list[str]:
        from tectonic_py.core.ids import NODE_ID_RE

        nodes = req.list(field, max_len=256)
        if not all(isinstance(n, str) and NODE_ID_RE.match(n) for n in nodes):
            raise InvalidArgument(f"{req.op}: {field} must be node ids")
        return nodes

    async def op_block__allocate(self, req: Request) -> dict[str, Any]:
        """A block id and the capability to write its chunks, for the file's writer only.

        Token 0 (no writer) is refused: a capability is a licence to write chunks, never
        handed to a caller that holds no lease. The block's shard is not the file's, so
        whether a non-zero token is still the file's is checked when the block is committed
        (a fenced writer can only waste an allocation, which the GC reclaims)."""
        store = self._store(req)
        file_id = _id(req, "file_id")
        if req.int("token", 0, hi=MAX_ID) == 0:
            raise StaleWriterToken(f"block.allocate for file {file_id} without a writer token")
        nodes = self._node_list(req)
        block_id = await store.write(
            block_layer.allocate,
            store.shard,
            self.total_shards,
            file_id,
            req.str("ec", max_len=16),
            nodes,
            now_ns(),
        )
        cap = capability.issue(self.capability_key, block_id, nodes)
        return {"block_id": block_id, "capability": cap}

    async def op_block__grant(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        block_id = _id(req, "block_id")
        nodes = await store.write(block_layer.grant_more, block_id, self._node_list(req))
        return {
            "nodes": nodes,
            "capability": capability.issue(self.capability_key, block_id, nodes),
        }

    async def op_block__commit(self, req: Request) -> None:
        store = self._store(req)
        file_id = _id(req, "file_id")
        infos = [block_layer.info_from_wire(b) for b in req.list("blocks", max_len=10_000)]
        for info in infos:
            if shard_of(info.block_id, self.total_shards) != store.shard:
                raise WrongShard(f"block {info.block_id:016x} is not in shard {store.shard}")

        def commit_all(conn: Any) -> None:
            for info in infos:
                block_layer.commit(conn, info, file_id)

        await store.write(commit_all)

    async def op_block__locate(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        ids = req.list("ids", max_len=100_000)
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 < i <= MAX_ID for i in ids):
            raise InvalidArgument("block.locate: ids must be block ids")
        return {"blocks": [b.to_wire() for b in store.read(block_layer.locate, ids)]}

    async def op_block__by_node(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        chunks = store.read(
            block_layer.by_node,
            req.str("node_id", max_len=64),
            req.int("after", 0, hi=MAX_ID),
            req.int("limit", 10_000, lo=1, hi=100_000),
        )
        return {"chunks": [list(c) for c in chunks]}

    async def op_block__replace_chunk(self, req: Request) -> None:
        store = self._store(req)
        await store.write(
            block_layer.replace_chunk,
            _id(req, "block_id"),
            req.int("index", hi=255),
            req.str("old_node", max_len=64),
            req.str("new_node", max_len=64),
            req.int("checksum", hi=2**32 - 1),
        )

    async def op_block__report_bad_chunk(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        recorded = await store.write(
            block_layer.report_bad_chunk,
            _id(req, "block_id"),
            req.int("index", hi=255),
            req.str("node_id", max_len=64),
            req.str("reason", "corrupt", max_len=64),
            now_ns(),
        )
        return {"recorded": recorded}

    # --- Node registry ------------------------------------------------------------------------

    def _registry(self) -> Registry:
        return self.engine.node_registry()

    async def op_node__heartbeat(self, req: Request) -> None:
        registry = self._registry()
        await registry.heartbeat(
            {
                "node_id": req.str("node_id", max_len=64),
                "address": req.str("address", max_len=300),
                "failure_domain": req.str("failure_domain", max_len=128),
                "capacity": req.int("capacity", 0, hi=2**63 - 1),
                "free": req.int("free", 0, hi=2**63 - 1),
                "chunk_count": req.int("chunk_count", 0, hi=2**63 - 1),
                "queue_depth": req.int("queue_depth", 0, hi=2**31),
                "fs_id": req.str("fs_id", "", max_len=300),
                "fs_total": req.int("fs_total", 0, hi=2**63 - 1),
                "fs_free": req.int("fs_free", 0, hi=2**63 - 1),
            }
        )

    async def op_node__list(self, req: Request) -> dict[str, Any]:
        return {"nodes": [n.to_wire() for n in self._registry().nodes()]}

    async def op_server__stats(self, req: Request) -> dict[str, Any]:
        shards = {}
        files = 0
        for s, store in self.stores.items():
            count = store.read(file_layer.count_files)
            files += count
            shards[str(s)] = {
                "files": count,
                "batches": store.stats.batches,
                "mutations": store.stats.mutations,
                "largest_batch": store.stats.largest_batch,
            }
        return {"files": files, "shards": shards}

    async def op_batch(self, req: Request) -> dict[str, Any]:
        """Independent requests in one frame, run at once (module docstring): one frame and
        one pass of the RPC loop for many ranks' calls, and their mutations in the same
        group-commit transactions. An item's error is its own, never the batch's."""
        items = req.list("ops", max_len=MAX_BATCH_OPS)
        calls: list[tuple[Callable[[Request], Awaitable[Any]], Request]] = []
        for item in items:
            if (
                not isinstance(item, list)
                or len(item) != 2
                or not isinstance(item[0], str)
                or not isinstance(item[1], dict)
            ):
                raise InvalidArgument("batch: ops must be [op, fields] pairs")
            op, fields = item
            handler = self.rpc.handlers.get(op)
            if handler is None or not op.startswith(_BATCHABLE_PREFIXES):
                raise InvalidArgument(f"batch: {op!r} cannot be batched")
            calls.append((handler, Request(op, fields, None, req.peer)))
        results: list[dict[str, Any]] = [{} for _ in calls]

        async def run(i: int, handler: Callable[[Request], Awaitable[Any]], r: Request) -> None:
            try:
                reply = await handler(r)
                results[i] = {"f": reply or {}}
            except Exception as e:  # noqa: BLE001 (every item's error goes back as its own)
                header = error_to_header(0, e)
                results[i] = {"err": header["err"], "msg": header["msg"]}

        async with trio.open_nursery() as nursery:
            for i, (handler, r) in enumerate(calls):
                nursery.start_soon(run, i, handler, r)
        return {"results": results}

    async def op_server__backup(self, req: Request) -> dict[str, Any]:
        """An online snapshot of every hosted shard into ``dest`` on this server's host."""
        dest = Path(req.str("dest"))
        return await trio.to_thread.run_sync(
            backup.backup_shards,
            self.data_dir,
            sorted(self.stores),
            self.total_shards,
            dest,
            self.address,
        )

    async def op_server__owners(self, req: Request) -> dict[str, Any]:
        """Shard -> the address serving it (the engine's answer: under etcd every owned
        shard, under sqlite this server's): where a client goes after ``WrongShard``."""
        owners = await self.engine.owners()
        return {"owners": {str(s): a for s, a in owners.items()}}

    # --- recovery of cross-shard renames ------------------------------------------------------

    async def _recovery_loop(self) -> None:
        while True:
            try:
                await self.recover_intents()
            except TectonicError as e:
                log.warning("rename recovery pass failed: %s", e)
            await trio.sleep(self.recovery_interval_s)

    async def recover_intents(self, *, before_ns: int | None = None) -> int:
        """Finish or abort every intent whose deadline passed; returns how many were settled."""
        settled = 0
        cutoff = now_ns() if before_ns is None else before_ns
        for store in self.stores.values():
            for intent in store.read(name_layer.intents, cutoff):
                try:
                    applied = await self._dst_points_at_child(intent)
                except TectonicError as e:
                    log.warning(
                        "rename intent %d: destination unreachable (%s); later", intent["intent"], e
                    )
                    continue
                try:
                    await store.write(name_layer.rename_finish, intent["intent"], applied)
                except FileNotFound:
                    continue
                settled += 1
                log.info(
                    "rename intent %d %s",
                    intent["intent"],
                    "rolled forward" if applied else "rolled back",
                )
        return settled

    async def _dst_points_at_child(self, intent: dict[str, Any]) -> bool:
        dst_shard = shard_of(intent["dst_dir"], self.total_shards)
        local = self.stores.get(dst_shard)
        try:
            if local is not None:
                child, _ = local.read(name_layer.lookup, intent["dst_dir"], intent["dst_name"])
            else:
                host, port = sockets.parse_address(intent["dst_address"])
                with trio.fail_after(10):
                    async with rpc_client.open_connection(host, port, self.secret) as conn:
                        resp = await conn.call(
                            "name.lookup",
                            {
                                "shard": dst_shard,
                                "dir": intent["dst_dir"],
                                "name": intent["dst_name"],
                            },
                        )
                child = resp.fields["id"]
        except FileNotFound:
            return False
        except trio.TooSlowError:
            raise TectonicError("timed out asking the destination shard") from None
        return bool(child == intent["id"])


def parse_shard_list(text: str) -> list[int]:
    """'0-31' or '0,2,4' or '0-3,8' -> sorted shard numbers."""
    out: set[int] = set()
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                lo, hi = part.split("-", 1)
                out.update(range(int(lo), int(hi) + 1))
            elif part:
                out.add(int(part))
    except ValueError:
        raise InvalidArgument(f"bad shard list {text!r}: use e.g. 0-31 or 0,2,4") from None
    if not out:
        raise InvalidArgument("empty shard list")
    return sorted(out)
