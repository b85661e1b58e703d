"""Which chunk stores the client plans around: the registry's down marks and the stores this
client itself just failed to reach."""

from __future__ import annotations

import logging
import math
from typing import Any

import trio

from tectonic_py.core.errors import TectonicError

log = logging.getLogger(__name__)


class NodeView:
    """The client's view of which chunk stores to avoid: the registry's "down" marks, and
    nodes this client itself just failed to reach (backing off).

    Why: without it, after a host's link is cut every block read would first try the dead
    node and wait out a connect timeout. With this view a block whose data chunk sits on a
    down node goes straight to a degraded read, and a node that just failed costs one timeout
    per client, not one per block. The registry is asked
    (``node.list``) at most every ``REFRESH_S``, and only when something suggests the view
    is stale (a chunk request failed or went slow, a block was placed, a file opened), never
    per request.
    """

    REFRESH_S = 1.5

    def __init__(self, meta: Any, nursery: trio.Nursery, backoff_s: float) -> None:
        self._meta = meta
        self._nursery = nursery
        self.backoff_s = backoff_s
        self.down: set[str] = set()  # node ids the registry marks down
        self._failed: dict[str, float] = {}  # address -> back off until (trio clock)
        self._refreshed = -math.inf
        self._refreshing = False

    def backing_off(self, address: str) -> bool:
        until = self._failed.get(address)
        if until is None:
            return False
        if trio.current_time() < until:
            return True
        del self._failed[address]
        return False

    def avoid(self, node_id: str, address: str) -> bool:
        """Whether a chunk on this node should be fetched or sent elsewhere if possible."""
        return node_id in self.down or bool(address and self.backing_off(address))

    def failed(self, address: str) -> None:
        """This client could not reach ``address`` (connect refused or timed out, connection
        lost): avoid it for ``backoff_s`` and ask the registry what it knows."""
        if address not in self._failed:
            log.info("chunk store %s unreachable; avoiding it for %.1fs", address, self.backoff_s)
        self._failed[address] = trio.current_time() + self.backoff_s
        self.refresh_soon()

    def stale(self) -> bool:
        return not self._refreshing and trio.current_time() - self._refreshed >= self.REFRESH_S

    def refresh_soon(self) -> None:
        """Refresh in the background (rate limited): callers never wait for the registry."""
        if self.stale():
            self._refreshing = True
            self._nursery.start_soon(self._refresh)

    async def refresh(self) -> None:
        """Refresh now if the view is older than ``REFRESH_S`` (opening a file for reading)."""
        if self.stale():
            self._refreshing = True
            await self._refresh()

    async def _refresh(self) -> None:
        try:
            nodes = await self._meta.nodes()
        except TectonicError as e:
            log.info("node list unavailable (%s); keeping the last view", e)
        else:
            down = {n.node_id for n in nodes if n.state != "up"}
            if down != self.down:
                log.info("chunk stores marked down by the registry: %s", sorted(down) or "none")
            self.down = down
        finally:
            self._refreshed = trio.current_time()
            self._refreshing = False
