"""Bad chunks a reader found, reported to the metadata service so repair rewrites them.

A chunk store's scrub finds damaged chunks only when its pass reaches them (hours, on a full
store); a reader that just failed a chunk's checksum, or was told by the store that its copy
is corrupt or gone, knows now. The report (``block.report_bad_chunk``) is recorded in the
Block layer, and repair's next round treats the chunk as it treats one the scrub found bad.

A storm of reads of one damaged block must not become a storm of reports: each (block,
chunk, node) is reported once per client, at most ``RATE`` reports a second are sent, by one
background task, and reports beyond a short queue are dropped (the next reader, or the
scrub, reports them again). Sending never delays the read, which goes degraded meanwhile.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import trio

from tectonic_py.client.stats import ClientStats
from tectonic_py.core.errors import TectonicError

log = logging.getLogger(__name__)

Key = tuple[int, int, str]  # block id, chunk index, node id


class BadChunkReporter:
    """Deduplicated, rate-limited reports of bad chunks; the sender starts on first use in
    ``nursery`` and ends with it."""

    RATE = 10.0  # reports a second
    QUEUE = 64  # reports waiting to be sent; more are dropped
    REMEMBER = 10_000  # chunks remembered as reported

    def __init__(self, meta: Any, nursery: trio.Nursery, stats: ClientStats) -> None:
        self._meta = meta
        self._nursery = nursery
        self._stats = stats
        self._send, self._receive = trio.open_memory_channel[tuple[Key, str]](self.QUEUE)
        self._reported: OrderedDict[Key, None] = OrderedDict()
        self._running = False

    def report(self, block_id: int, index: int, node_id: str, reason: str) -> None:
        key = (block_id, index, node_id)
        if key in self._reported:
            self._stats.bad_chunk_reports_skipped += 1
            return
        try:
            self._send.send_nowait((key, reason))
        except trio.WouldBlock:
            self._stats.bad_chunk_reports_skipped += 1
            return
        self._reported[key] = None
        while len(self._reported) > self.REMEMBER:
            self._reported.popitem(last=False)
        if not self._running:
            self._running = True
            self._nursery.start_soon(self._run)

    async def _run(self) -> None:
        async for (block_id, index, node_id), reason in self._receive:
            try:
                await self._meta.report_bad_chunk(block_id, index, node_id, reason)
                self._stats.bad_chunk_reports += 1
            except TectonicError as e:
                log.info(
                    "report of chunk %d of block %016x on %s failed: %s",
                    index,
                    block_id,
                    node_id,
                    e,
                )
                self._reported.pop((block_id, index, node_id), None)  # a later read may retry
            except Exception:  # a bug: reports are a service to repair, never end the client
                log.exception("report of chunk %d of block %016x failed", index, block_id)
            await trio.sleep(1.0 / self.RATE)
