"""Coalescing of a process's metadata calls to one server into ``batch`` requests.

The ranks of one process (a load-test worker's hundreds, a mount's eight) call the same
servers at once. While ``MAX_BATCHES_IN_FLIGHT`` calls to a server are in flight, the next
calls of the write and read paths (``COALESCED_OPS``) wait in that server's queue and leave
together as one ``batch`` request when one returns: the server answers every item in one
frame and their mutations share its shards' transactions. Each item keeps its own result,
its own error and its own retries (the retries are the client's, metadata/client.py, around
``Coalescer.call``); a lost batch is a lost request for each item in it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

from metadata.api import OPS
from tectonic_py.core import rpc_client
from tectonic_py.core.errors import (
    ProtocolError,
    ShardUnavailable,
    TectonicError,
    Unavailable,
    error_from_code,
)

# Ops that coalesce into ``batch`` requests (the module docstring): the burst's reads and its
# small mutations, each answered quickly; never the maintenance ops with long replies.
COALESCED_OPS = OPS.names(lambda op: op.coalesce)
MAX_BATCHES_IN_FLIGHT = 2  # per server: calls (batches) out before the next ones queue
MAX_BATCH_OPS = 256  # items in one batch request (the server takes up to 512)
# A call whose lists (entries, blocks, ids) hold more than this goes alone: a batch of such
# calls, or of their replies, could pass a frame's header limit.
MAX_COALESCED_LIST = 4
_LONG_LISTS = ("entries", "blocks", "ids")


def coalesces(op: str, fields: dict[str, Any]) -> bool:
    """Whether a call waits in its server's queue rather than going alone."""
    if op not in COALESCED_OPS:
        return False
    return sum(len(fields.get(k, ())) for k in _LONG_LISTS) <= MAX_COALESCED_LIST


class Item:
    """One call waiting in a server's queue, and what became of it."""

    __slots__ = ("done", "error", "fields", "op", "result", "sent", "timeout")

    def __init__(self, op: str, fields: dict[str, Any], timeout: float) -> None:
        self.op = op
        self.fields = fields
        self.timeout = timeout
        self.sent = False  # it left this process (a mutation's outcome is then unknown)
        self.done = trio.Event()
        self.result: dict[str, Any] | None = None
        self.error: TectonicError | None = None


class Coalescer:
    """One server's queue of calls: at most ``MAX_BATCHES_IN_FLIGHT`` requests out, the
    calls made meanwhile sent together as one ``batch`` when one returns (the module
    docstring). The batches' sender tasks live in the client's nursery; a caller cancelled
    while its call is queued takes it out of the queue."""

    def __init__(
        self,
        address: str,
        connect: Callable[[str], Awaitable[rpc_client.Connection]],
        nursery: trio.Nursery,
    ) -> None:
        self.address = address
        self._connect = connect
        self._nursery = nursery
        self._queue: list[Item] = []
        self._in_flight = 0
        self.batches = 0  # batch requests sent (tests and the load test's report read it)
        self.batched_ops = 0

    async def call(self, item: Item) -> dict[str, Any]:
        if self._in_flight < MAX_BATCHES_IN_FLIGHT and not self._queue:
            self._in_flight += 1
            try:
                conn = await self._connect(self.address)
                item.sent = True
                return (await conn.call(item.op, item.fields)).fields
            finally:
                self._in_flight -= 1
                self._flush()
        self._queue.append(item)
        try:
            await item.done.wait()
        finally:
            if not item.done.is_set() and item in self._queue:
                self._queue.remove(item)
        if item.error is not None:
            raise item.error
        assert item.result is not None
        return item.result

    def _flush(self) -> None:
        while self._queue and self._in_flight < MAX_BATCHES_IN_FLIGHT:
            items, self._queue = self._queue[:MAX_BATCH_OPS], self._queue[MAX_BATCH_OPS:]
            try:
                self._nursery.start_soon(self._send, items)
            except RuntimeError:  # the client's nursery is closing: nothing more is sent
                for item in items:
                    item.error = ShardUnavailable("the metadata client is closed")
                    item.done.set()
                continue
            self._in_flight += 1

    async def _send(self, items: list[Item]) -> None:
        try:
            with trio.move_on_after(max(i.timeout for i in items)) as scope:
                await self._send_batch(items)
            if scope.cancelled_caught:
                error = ShardUnavailable(f"metadata server {self.address}: batch timed out")
                for item in items:
                    item.error = error
        except TectonicError as e:
            for item in items:
                item.error = e
        finally:
            for item in items:
                if item.result is None and item.error is None:
                    item.error = Unavailable(f"{self.address}: batch not answered")
                item.done.set()
            self._in_flight -= 1
            self._flush()

    async def _send_batch(self, items: list[Item]) -> None:
        conn = await self._connect(self.address)
        for item in items:
            item.sent = True
        if len(items) == 1:
            items[0].result = (await conn.call(items[0].op, items[0].fields)).fields
            return
        self.batches += 1
        self.batched_ops += len(items)
        r = await conn.call("batch", {"ops": [[i.op, i.fields] for i in items]})
        results = r.fields.get("results")
        if not isinstance(results, list) or len(results) != len(items):
            raise ProtocolError(f"{self.address}: a batch reply without one result per op")
        for item, res in zip(items, results, strict=True):
            if not isinstance(res, dict):
                raise ProtocolError(f"{self.address}: malformed batch result")
            if "err" in res:
                item.error = error_from_code(
                    str(res["err"]), f"{res.get('msg', '')} [{self.address}]"
                )
            else:
                fields = res.get("f")
                if not isinstance(fields, dict):
                    raise ProtocolError(f"{self.address}: malformed batch result")
                item.result = fields
