"""The metadata server daemon: hosts some logical shards and answers their RPCs.

One process hosts a set of logical shards (``--shards``), each a ``ShardStore`` (its own
SQLite file and group-committing writer). Every shard-scoped request names its ``shard``; a
server that does not host it answers ``WrongShard`` (the client's shard map is stale or
wrong). The server hosting ``REGISTRY_SHARD`` also serves the node registry
(``node.*``) and creates the root directory (``ROOT_ID``) in ``shard_of(ROOT_ID)`` on first
start when it hosts that shard.

Its ops, their fields, results, routes and the roles that may call them are declared once, in
metadata/api/ops.py (rendered in docs/operations-table.md): the dispatch table is made from
those declarations, every request's fields checked against them before its handler runs, and
a role's call of an op not declared for it refused before that.

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

import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import trio

from metadata import backup, block_layer, crash_points, file_layer, name_layer
from metadata.api import OPS
from metadata.checkpoint_ops import CheckpointOps
from metadata.compaction_ops import CompactionOps
from metadata.engine import Engine, EngineSettings, ShardPlan
from metadata.engines import open_engine
from metadata.maintenance_ops import MaintenanceOps
from metadata.metrics import MetadataMetrics
from metadata.quota_ops import QuotaOps
from metadata.registry import Registry, RemoteRegistry
from metadata.retention_ops import RetentionOps
from metadata.shard import ShardStore, now_ns
from metadata.sqlite_engine import SqliteSettings
from metadata.write_ops import WriteOps
from tectonic_py.core import capability, rpc_client, rpc_server, sockets
from tectonic_py.core.auth import (
    ROLE_ADMIN,
    ROLE_CLIENT,
    ROLE_MAINTENANCE,
    ROLE_NODE,
    Credential,
    Keyring,
)
from tectonic_py.core.cluster_file import DEFAULT_CHUNK_SIZE, REGISTRY_SHARD
from tectonic_py.core.ec_policy import DEFAULT_POLICY
from tectonic_py.core.errors import (
    ConfigError,
    FileNotFound,
    InvalidArgument,
    PermissionDenied,
    StaleWriterToken,
    TectonicError,
    WrongShard,
)
from tectonic_py.core.ids import ROOT_ID, shard_of
from tectonic_py.core.metrics_http import start_endpoint
from tectonic_py.core.ready_file import write_ready_file
from tectonic_py.core.records import (
    KIND_DIR,
    NODE_KINDS,
    Attrs,
)
from tectonic_py.core.rpc_server import Request, error_to_header

log = logging.getLogger(__name__)

LEASE_NS = 60 * 1_000_000_000
RECOVERY_INTERVAL_S = 5.0
_BATCHABLE_PREFIXES = ("name.", "file.", "block.")


def _attrs(attrs: Attrs) -> dict[str, Any]:
    """Attrs as a wire map; a shallow copy (``asdict`` deep-copies, a hot spot in profiles)."""
    return dict(attrs.__dict__)


class MetadataServer(
    MaintenanceOps, CheckpointOps, WriteOps, CompactionOps, QuotaOps, RetentionOps
):
    """Handlers over the hosted shards. Create, then ``await nursery.start(server.serve, ...)``.

    The ops of the background services come from ``MaintenanceOps``
    (metadata/maintenance_ops.py), those of checkpoints (durability, the atomic commit of a
    step) from ``CheckpointOps`` (metadata/checkpoint_ops.py), those of retention from
    ``RetentionOps`` (metadata/retention_ops.py)."""

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
        metrics_listen: str | None = None,
    ) -> None:
        """``engine``: the settings of the engine that keeps the shards (metadata/engine.py;
        sqlite's by default). Under etcd ``shards`` are the ones this server claims first,
        and it serves whatever it owns. ``metrics_listen``: the metrics endpoint's HOST:PORT."""
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
        self._remote_registry = RemoteRegistry(secret)
        if len(capability_key) < 16:
            raise ConfigError("the capability key must be at least 16 bytes")
        self.capability_key = capability_key  # signs capabilities; clients never hold it
        self.lease_ns = lease_ns
        self.recovery_interval_s = recovery_interval_s
        self.node_timeout = node_timeout
        self.measures = measures = MetadataMetrics(metrics_listen)
        self.metrics_address: str | None = None
        plan = ShardPlan(
            self.data_dir, sorted(set(shards)), total_shards, node_timeout, measures.commit_hook()
        )
        self.engine: Engine = open_engine(engine or SqliteSettings(), plan)
        measures.watch(lambda: len(self.stores), total_shards)
        self.address = ""
        self.rpc = rpc_server.RpcServer(
            f"metadata[{shards[0]}..]",
            Keyring.from_secret(secret),
            OPS.bind(self),
            roles=OPS.roles_by_op(),
            metrics=measures.rpc,
        )

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
                m = self.measures
                self.metrics_address = await start_endpoint(nursery, m.metrics, m.listen)
                self.engine.start(nursery)
                await self.ensure_root()
                h, p = await nursery.start(self.rpc.serve, host, port)
                self.address = f"{h}:{p}"
                await nursery.start(self.engine.run, self)
                nursery.start_soon(self._recovery_loop)
                if ready_file is not None:
                    write_ready_file(ready_file, address=self.address, metrics=self.metrics_address)
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
        return self.engine.check(req["shard"])

    # --- Name layer ---------------------------------------------------------------------------

    async def op_name__lookup(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        child, kind = store.read(name_layer.lookup, req["dir"], req["name"])
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
        await store.write(name_layer.insert, req["dir"], req["name"], req["id"], req["kind"])

    async def op_name__make_node(self, req: Request) -> dict[str, Any]:
        """A symlink or special file: record and entry in the directory's shard, at once."""
        store = self._store(req)
        dir_id = req["dir"]
        if shard_of(dir_id, self.total_shards) != store.shard:
            raise InvalidArgument("name.make_node: the directory is not in this shard")
        kind = req["kind"]
        if kind not in NODE_KINDS:
            raise InvalidArgument(f"name.make_node: {kind!r} is not a symlink or special file")
        spec = {
            "kind": kind,
            "mode": req["mode"],
            "uid": req["uid"],
            "gid": req["gid"],
            "ec": DEFAULT_POLICY.name,
            "chunk_size": DEFAULT_CHUNK_SIZE,
            "target": req["target"],
            "rdev": req["rdev"],
        }
        attrs = await store.write(
            name_layer.make_node,
            store.shard,
            self.total_shards,
            dir_id,
            req["name"],
            spec,
            now_ns(),
        )
        return {"attrs": _attrs(attrs)}

    async def op_name__list(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        after = req["after"]
        limit = req["limit"]
        entries, cursor = store.read(name_layer.list_entries, req["dir"], after, limit)
        return {"entries": [[e.name, e.id, e.kind] for e in entries], "next": cursor}

    async def op_name__remove(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        child = await store.write(
            name_layer.remove,
            req["dir"],
            req["name"],
            req["kind"],
            req["expect_id"],
        )
        return {"id": child}

    async def op_name__rename(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        src_dir, dst_dir = req["src_dir"], req["dst_dir"]
        if (
            shard_of(dst_dir, self.total_shards) != store.shard
            or shard_of(src_dir, self.total_shards) != store.shard
        ):
            raise InvalidArgument("name.rename: both directories must be in this shard")
        return await store.write(
            name_layer.rename_local,
            src_dir,
            req["src_name"],
            dst_dir,
            req["dst_name"],
            req["replace_dir"],
        )

    async def op_name__rename_prepare(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        dst_address = req["dst_address"]
        sockets.parse_address(dst_address)
        prepared: dict[str, Any] = await store.write(
            name_layer.rename_prepare,
            req["src_dir"],
            req["src_name"],
            req["dst_dir"],
            req["dst_name"],
            dst_address,
            req["deadline_ns"],
        )
        crash_points.reached("rename.after_prepare")
        return prepared

    async def op_name__rename_apply(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        applied: dict[str, Any] = await store.write(
            name_layer.rename_apply,
            req["dst_dir"],
            req["dst_name"],
            req["id"],
            req["kind"],
            req["deadline_ns"],
            now_ns(),
            req["replace_dir"],
        )
        crash_points.reached("rename.after_dst_insert")
        return applied

    async def op_name__rename_finish(self, req: Request) -> None:
        store = self._store(req)
        await store.write(name_layer.rename_finish, req["intent"], req["applied"])
        crash_points.reached("rename.after_finish")

    async def op_name__intents(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        return {"intents": store.read(name_layer.intents, req["before_ns"])}

    # --- File layer ---------------------------------------------------------------------------

    async def op_file__create(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        parent = req["parent"]
        spec = {
            "kind": req["kind"],
            "mode": req["mode"],
            "uid": req["uid"],
            "gid": req["gid"],
            "ec": req["ec"],
            "chunk_size": req["chunk_size"],
            "parent": parent,
            "name": req["name"],
            "realm": req["realm"],
            "realm_key": req["realm_key"],
        }
        attrs, token = await store.write(
            file_layer.create, store.shard, self.total_shards, spec, now_ns(), self.lease_ns
        )
        return {"attrs": _attrs(attrs), "token": token}

    async def op_file__get(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        file_id = req["id"]
        return {
            "attrs": _attrs(store.read(file_layer.get, file_id, now_ns())),
            "parent": store.read(file_layer.parent_of, file_id),
        }

    async def op_file__open(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        token = await store.write(
            file_layer.open_for_write,
            req["id"],
            req["truncate"],
            now_ns(),
            self.lease_ns,
        )
        return {"token": token}

    async def op_file__renew(self, req: Request) -> None:
        store = self._store(req)
        await store.write(
            file_layer.renew_lease,
            req["id"],
            req["token"],
            now_ns(),
            self.lease_ns,
        )

    async def op_file__seal(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        attrs = await store.write(
            file_layer.seal,
            req["id"],
            req["token"],
            req["size"],
            now_ns(),
        )
        return {"attrs": _attrs(attrs)}

    async def op_file__set_size(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        attrs = await store.write(
            file_layer.set_size,
            req["id"],
            req["token"],
            req["size"],
            now_ns(),
        )
        return {"attrs": _attrs(attrs)}

    async def op_file__setattr(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        changes = {
            "mode": req["mode"],
            "uid": req["uid"],
            "gid": req["gid"],
            "atime_ns": req["atime_ns"],
            "mtime_ns": req["mtime_ns"],
            "ec": req["ec"],
        }
        attrs = await store.write(file_layer.setattr_, req["id"], changes, now_ns())
        return {"attrs": _attrs(attrs)}

    async def op_file__link(self, req: Request) -> None:
        store = self._store(req)
        await store.write(file_layer.link, req["id"], req["parent"], req["name"])

    async def op_file__add_link(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        attrs = await store.write(file_layer.add_link, req["id"], now_ns())
        return {"attrs": _attrs(attrs)}

    async def op_file__readlink(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        return {"target": store.read(file_layer.readlink, req["id"])}

    async def op_file__unlink(self, req: Request) -> None:
        store = self._store(req)
        await store.write(file_layer.unlink, req["id"], now_ns())

    async def op_file__kill_dir(self, req: Request) -> None:
        store = self._store(req)
        await store.write(file_layer.kill_dir, req["id"])

    async def op_file__revive_dir(self, req: Request) -> None:
        store = self._store(req)
        await store.write(file_layer.revive_dir, req["id"])

    async def op_file__drop(self, req: Request) -> None:
        store = self._store(req)
        file_id = req["id"]
        if file_id == ROOT_ID:
            raise InvalidArgument("the root directory cannot be removed")
        # A client may drop only what no name reaches: a dead directory (rmdir's last step) or
        # an unnamed record (a create it could not finish); anything named is unlink's.
        only_unreachable = req.role == ROLE_CLIENT
        await store.write(file_layer.drop, file_id, now_ns(), only_unreachable)

    async def op_file__blocks(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        return store.read(file_layer.block_map, req["id"])

    async def op_file__getxattr(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        value = store.read(file_layer.getxattr, req["id"], req["name"])
        return {"value": value}

    async def op_file__setxattr(self, req: Request) -> None:
        store = self._store(req)
        await store.write(
            file_layer.setxattr,
            req["id"],
            req["name"],
            req["value"],
        )

    async def op_file__listxattr(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        return {"names": store.read(file_layer.listxattr, req["id"])}

    async def op_file__removexattr(self, req: Request) -> None:
        store = self._store(req)
        await store.write(file_layer.removexattr, req["id"], req["name"])

    async def op_file__orphans(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        return {
            "orphans": store.read(
                file_layer.orphans,
                req["older_than_ns"],
                req["limit"],
            )
        }

    async def op_file__collect_orphan(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        return {"deleted": await store.write(file_layer.collect_orphan, req["id"], now_ns())}

    async def op_file__gc_blocks(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        return {"block_ids": store.read(file_layer.gc_blocks, req["limit"])}

    # --- Block layer --------------------------------------------------------------------------

    async def op_block__allocate(self, req: Request) -> dict[str, Any]:
        """A block id and the capability to write its chunks, for the file's writer only.

        Token 0 (no writer) is refused: a capability is a licence to write chunks, never
        handed to a caller that holds no lease. The block's shard is not the file's, so
        whether a non-zero token is still the file's is checked when the block is committed
        (a fenced writer can only waste an allocation, which the GC reclaims). ``pack``: the
        block is a pack shared by files of this shard (block_layer.PACK_OWNER); the file is
        one of them, whose writer asks, or the maintenance daemon, which asks for a pack to
        move live extents into without any writer token (metadata/compaction_ops.py)."""
        store = self._store(req)
        file_id = req["file_id"]
        compaction = req["pack"] and req.role in (ROLE_MAINTENANCE, ROLE_ADMIN)
        if req["token"] == 0 and not compaction:
            raise StaleWriterToken(f"block.allocate for file {file_id} without a writer token")
        nodes = req["nodes"]
        block_id = await store.write(
            block_layer.allocate,
            store.shard,
            self.total_shards,
            block_layer.PACK_OWNER if req["pack"] else file_id,
            req["ec"],
            nodes,
            now_ns(),
        )
        cap = capability.issue(self.capability_key, block_id, nodes)
        return {"block_id": block_id, "capability": cap}

    async def op_block__grant(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        block_id = req["block_id"]
        nodes = await store.write(block_layer.grant_more, block_id, req["nodes"])
        return {
            "nodes": nodes,
            "capability": capability.issue(self.capability_key, block_id, nodes),
        }

    async def op_block__commit(self, req: Request) -> None:
        store = self._store(req)
        file_id = req["file_id"]
        infos = [block_layer.info_from_wire(b) for b in req["blocks"]]
        for info in infos:
            if shard_of(info.block_id, self.total_shards) != store.shard:
                raise WrongShard(f"block {info.block_id:016x} is not in shard {store.shard}")

        def commit_all(conn: Any) -> None:
            for info in infos:
                block_layer.commit(conn, info, file_id)

        await store.write(commit_all)

    async def op_block__locate(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        ids = req["ids"]
        return {"blocks": [b.to_wire() for b in store.read(block_layer.locate, ids)]}

    async def op_block__by_node(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        chunks = store.read(
            block_layer.by_node,
            req["node_id"],
            req["after"],
            req["limit"],
        )
        return {"chunks": [list(c) for c in chunks]}

    async def op_block__replace_chunk(self, req: Request) -> None:
        store = self._store(req)
        await store.write(
            block_layer.replace_chunk,
            req["block_id"],
            req["index"],
            req["old_node"],
            req["new_node"],
            req["checksum"],
        )

    async def op_block__report_bad_chunk(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        recorded = await store.write(
            block_layer.report_bad_chunk,
            req["block_id"],
            req["index"],
            req["node_id"],
            req["reason"],
            now_ns(),
        )
        return {"recorded": recorded}

    # --- Node registry ------------------------------------------------------------------------

    def _registry(self) -> Registry:
        return self.engine.node_registry()

    async def registered(self, node_id: str, hint: str = "") -> bool | None:
        """Whether the node registry knows ``node_id``: here, or asked of the server that
        holds it: the one the etcd engine's owners name, else ``hint`` (the caller's cluster
        file's registry address; the node handshake proves it is one of ours). None where
        none of them can tell."""
        if self.registry is not None:
            return self.registry.known(node_id)
        owner = (await self.engine.owners()).get(REGISTRY_SHARD, "")
        for address in dict.fromkeys(a for a in (owner, hint) if a and a != self.address):
            known = await self._remote_registry.knows(address, node_id)
            if known is not None:
                return known
        return None

    async def op_node__heartbeat(self, req: Request) -> None:
        registry = self._registry()
        await registry.heartbeat(
            {
                "node_id": req["node_id"],
                "address": req["address"],
                "failure_domain": req["failure_domain"],
                "capacity": req["capacity"],
                "free": req["free"],
                "chunk_count": req["chunk_count"],
                "queue_depth": req["queue_depth"],
                "fs_id": req["fs_id"],
                "fs_total": req["fs_total"],
                "fs_free": req["fs_free"],
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
        items = req["ops"]
        calls: list[tuple[Callable[[Request], Awaitable[Any]], Request]] = []
        refused: dict[int, PermissionDenied] = {}
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
            refusal = self.rpc.refusal(op, req.role, req.peer)
            if refusal is not None:
                refused[len(calls)] = refusal
            calls.append((handler, Request(op, fields, None, req.peer, role=req.role)))
        results: list[dict[str, Any]] = [{} for _ in calls]

        async def run(i: int, handler: Callable[[Request], Awaitable[Any]], r: Request) -> None:
            try:
                if i in refused:
                    raise refused[i]
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
        dest = Path(req["dest"])
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
                    node = Credential.from_secret(self.secret, ROLE_NODE)
                    async with rpc_client.open_connection(host, port, node) as conn:
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
