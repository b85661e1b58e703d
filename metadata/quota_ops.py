"""Metadata ops of directory quotas, claims, reservations and the folding of usage.

``QuotaOps`` is a mixin of ``MetadataServer``, as ``MaintenanceOps`` is: each ``op_*`` method
is one op of metadata/api/ops.py, one transaction in one shard over metadata/quota_layer.py
(which says what is counted where and why a crash never makes usage drift). The raw-space
reservations (``space.*``) are the registry's: only its server knows the live chunk stores'
free space.
"""

from __future__ import annotations

from typing import Any

from metadata import quota_layer
from metadata.server_calls import capacity_of
from metadata.shard import now_ns
from tectonic_py.core.errors import InvalidArgument
from tectonic_py.core.rpc_server import Request


class QuotaOps:
    """The ``quota.*`` and ``space.*`` handlers of ``MetadataServer``."""

    def _store(self, req: Request) -> Any:  # provided by MetadataServer
        raise NotImplementedError

    def _registry(self) -> Any:  # provided by MetadataServer
        raise NotImplementedError

    async def op_quota__set(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        return await store.write(  # type: ignore[no-any-return]
            quota_layer.set_quota, req["dir"], req["max_bytes"], req["max_files"], req["realm_key"]
        )

    async def op_quota__get(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        return {"quota": store.read(quota_layer.get_quota, req["dir"], now_ns())}

    async def op_quota__list(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        return {"quotas": store.read(quota_layer.list_quotas, now_ns())}

    async def op_quota__remove(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        return {"realm_key": await store.write(quota_layer.remove_quota, req["dir"])}

    async def op_quota__adopt(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        if bool(req["realm"]) != bool(req["realm_key"]):
            raise InvalidArgument("quota.adopt: a realm and its key, or neither")
        kind = await store.write(quota_layer.adopt, req["id"], req["realm"], req["realm_key"])
        return {"kind": kind}

    async def op_quota__claim(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        granted, from_prealloc = await store.write(
            quota_layer.claim,
            req["realm"],
            req["dir"],
            req["file"],
            req["need"],
            req["want"],
            req["files"],
            req["prealloc"],
            now_ns(),
        )
        return {"granted": granted, "prealloc": from_prealloc}

    async def op_quota__unclaim(self, req: Request) -> None:
        store = self._store(req)
        await store.write(quota_layer.unclaim, req["realm"], req["file"], req["bytes"], req["keep"])

    async def op_quota__reserve(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        now = now_ns()
        return await store.write(  # type: ignore[no-any-return]
            quota_layer.reserve, req["realm"], req["dir"], req["bytes"], now + req["ttl_ns"], now
        )

    async def op_quota__release(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        return {"left": await store.write(quota_layer.release, req["realm"], req["dir"])}

    async def op_quota__pending(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        return {"pages": store.read(quota_layer.pending, req["limit"])}

    async def op_quota__fold(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        outcome, last = await store.write(
            quota_layer.fold,
            req["realm"],
            req["realm_key"],
            req["src_shard"],
            req["first"],
            req["upto"],
            req["bytes"],
            req["files"],
            [list(g) for g in req["grown"]],
        )
        return {"outcome": outcome, "last_seq": last}

    async def op_quota__ack(self, req: Request) -> None:
        store = self._store(req)
        await store.write(quota_layer.ack, req["realm"], req["realm_key"], req["upto"])

    async def op_quota__recount(self, req: Request) -> dict[str, Any]:
        store = self._store(req)
        return {**store.read(quota_layer.recount), "quotas": store.read(quota_layer.quota_keys)}

    async def op_space__reserve(self, req: Request) -> dict[str, Any]:
        registry = self._registry()
        _, free = capacity_of([n for n in registry.nodes() if n.state == "up"])
        now = now_ns()
        left = await registry.store.write(
            quota_layer.space_reserve, req["dir"], req["raw_bytes"], free, now + req["ttl_ns"], now
        )
        return {"free": left}

    async def op_space__release(self, req: Request) -> None:
        registry = self._registry()
        await registry.store.write(quota_layer.space_release, req["dir"])
