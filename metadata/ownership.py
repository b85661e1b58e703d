"""Which metadata server serves which shard, under the etcd engine: owner keys on leases.

A server holds one etcd lease (``ttl`` seconds, kept alive every ttl/3). It owns a shard
while the key ``P/owner/NNNNN`` exists with its lease; it gets the key with a transaction
that only succeeds if the key does not exist. When a server dies, its lease expires and its
owner keys vanish with it; another server's acquisition loop sees the shard unowned and
takes it (loading the shard's rows from etcd first).

Two servers never both commit: every batch a shard commits is fenced on the owner key's
create revision (metadata/etcd_engine.py). Reads are guarded by the lease itself: a server
serves only while ``valid()``, i.e. before the moment its last confirmed keep-alive (counted
from when it was sent) would let the lease lapse, less a margin. A server paused past its
lease (SIGSTOP, a stalled VM) thus refuses everything when it wakes, and gives all its shards
up once etcd tells it the lease is gone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable

import msgpack
import trio

from metadata.etcd_engine import owner_key
from tectonic_py.core.etcd_client import (
    BlockingKeepAlive,
    Compare,
    EtcdClient,
    delete_op,
    prefix_end,
    put_op,
)

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 3
MARGIN_S = 0.5


class Ownership:
    """This server's lease and its claims on shards."""

    def __init__(
        self,
        etcd: EtcdClient,
        prefix: str,
        address: str,
        *,
        ttl: int = DEFAULT_TTL_S,
        on_lost: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.etcd = etcd
        self.prefix = prefix
        self.address = address
        self.ttl = ttl
        self.lease = 0
        self._valid_until = -1.0
        self._on_lost = on_lost

    def valid(self) -> bool:
        return time.monotonic() < self._valid_until

    async def _grant(self) -> None:
        sent = time.monotonic()
        self.lease = await self.etcd.lease_grant(self.ttl)
        self._valid_until = sent + self.ttl - MARGIN_S
        log.info("metadata server %s holds etcd lease %x", self.address, self.lease)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Grant the lease, then keep it alive from a worker thread (``_keep_alive``); a
        lease that lapsed is replaced by a new one after every shard was given up."""
        await self._grant()
        task_status.started()
        while True:
            stop = threading.Event()
            try:
                await trio.to_thread.run_sync(
                    self._keep_alive, self.lease, stop, abandon_on_cancel=True
                )
            finally:
                stop.set()
            log.warning("etcd lease %x expired: giving up every shard", self.lease)
            self._valid_until = -1.0
            if self._on_lost is not None:
                await self._on_lost()
            await self._grant()

    def _keep_alive(self, lease: int, stop: threading.Event) -> None:
        """A keep-alive every ttl/3 until the lease is gone (then return) or ``stop``. Each
        extends validity from its own send time, so a late answer is still good."""
        sender = BlockingKeepAlive(self.etcd.endpoints, timeout=self.ttl / 3)
        try:
            while not stop.wait(self.ttl / 3):
                sent = time.monotonic()
                left = sender.send(lease)
                if left is None:
                    log.warning("etcd lease %x keep-alive: no member answered", lease)
                elif left > 0:
                    self._valid_until = max(self._valid_until, sent + left - MARGIN_S)
                else:
                    return
        finally:
            sender.close()

    async def acquire(self, shard: int) -> int | None:
        """Claim an unowned shard: the owner key's create revision (the fence of every
        commit), or None when another server owns it."""
        key = owner_key(self.prefix, shard)
        value = msgpack.packb({"address": self.address})
        result = await self.etcd.txn(
            [Compare(key, "CREATE", 0)], [put_op(key, value, lease=self.lease)]
        )
        return result.revision if result.succeeded else None

    async def owners(self) -> dict[int, str]:
        """Shard -> address of its owner, for every owned shard."""
        start = f"{self.prefix}/owner/".encode()
        kvs, _, _ = await self.etcd.range(start, prefix_end(start))
        return {
            int(kv.key[len(start) :]): msgpack.unpackb(kv.value)["address"]
            for kv in kvs
            if kv.lease
        }

    async def release(self, shard: int) -> None:
        """Give a shard up (only if this lease still holds it)."""
        key = owner_key(self.prefix, shard)
        await self.etcd.txn([Compare(key, "LEASE", self.lease)], [delete_op(key)])
