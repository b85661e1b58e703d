"""A reader that finds a chunk corrupt reports it to the metadata service, and repair's next
round rewrites that chunk without waiting for the chunk store's scrub; the reports are
deduplicated and rate limited so that a storm of reads does not flood the service."""

from __future__ import annotations

from typing import Any

import trio
from maintenance_helpers import data_of, make_cluster, open_inspector, put, read, wait_for

from chunkstore import layout as chunk_layout
from tectonic_py.client.bad_chunks import BadChunkReporter
from tectonic_py.client.stats import ClientStats
from tectonic_py.client.tectonic_client import open_client
from tectonic_py.core.errors import Unavailable
from tectonic_py.core.ids import chunk_id
from tectonic_py.maintenance.repair import Repairer


async def _reported(m: Any) -> set[tuple[int, int, str]]:
    return await Repairer(m).reported_chunks()


async def test_corrupt_chunk_a_reader_finds_is_rewritten_by_the_next_repair_round(tmp_path):
    # No maintenance process and no scrub: only the reader's report can bring repair here.
    cluster = make_cluster(tmp_path / "c", maintenance=False, chunkstore_args=["--scrub-rate", "0"])
    try:
        cluster.start()
        data = data_of(150_000, seed=5)
        async with open_client(cluster.cluster_file) as client:
            fid = await put(client, "/f", data)
            info = (await client.meta.block_list(fid))[0]
        victim = next(c for c in info.chunks if c.index == 1)  # a data chunk
        store = int(victim.node_id.removeprefix("cs"))
        path = chunk_layout.chunk_path(
            cluster.chunkstore_dir(store), chunk_id(info.block_id, victim.index)
        )
        raw = bytearray(path.read_bytes())
        raw[-100] ^= 0xFF
        path.write_bytes(raw)

        async with open_client(cluster.cluster_file) as reader:
            assert await read(reader, "/f") == data  # degraded, but right
            assert reader.stats.corrupt_chunks == 1
            await wait_for("the report to be sent", lambda: _sent(reader.stats), timeout=30)
            assert await read(reader, "/f") == data  # a second read reports nothing new
            assert reader.stats.bad_chunk_reports == 1

        async with open_inspector(cluster) as m:
            assert (info.block_id, 1, victim.node_id) in await _reported(m)
            nodes = await m.nodes()
            scrub = await m.node_call(nodes[victim.node_id], "scrub_report")
            assert scrub["bad"] == []  # the scrub found nothing: the report did it
            await Repairer(m).round()
            moved = (await m.meta.locate_blocks([info.block_id]))[0]
            now = next(c for c in moved.chunks if c.index == 1)
            assert now.node_id != victim.node_id and now.checksum == victim.checksum
            assert not await _reported(m)  # the record went with the chunk's move
            old = await m.node_call(nodes[victim.node_id], "list", after="", limit=10_000)
            assert chunk_id(info.block_id, 1) not in {c for c, _ in old["chunks"]}

        async with open_client(cluster.cluster_file) as fresh:
            assert await read(fresh, "/f") == data
            assert fresh.stats.corrupt_chunks == 0 and fresh.stats.degraded_reads == 0
    finally:
        cluster.stop()


async def _sent(stats: ClientStats) -> bool:
    return stats.bad_chunk_reports >= 1


class _Meta:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[int, int, str, str]] = []
        self.fail = fail

    async def report_bad_chunk(self, block_id: int, index: int, node_id: str, reason: str) -> bool:
        self.calls.append((block_id, index, node_id, reason))
        if self.fail:
            raise Unavailable("metadata server down")
        return True


async def test_reports_are_deduplicated_and_rate_limited(autojump_clock):
    meta, stats = _Meta(), ClientStats()
    async with trio.open_nursery() as nursery:
        reporter = BadChunkReporter(meta, nursery, stats)
        for _ in range(100):
            reporter.report(7, 1, "cs3", "corrupt")  # one bad chunk read 100 times
        for b in range(1000):
            reporter.report(100 + b, 0, "cs1", "corrupt")  # a storm of distinct ones
        start = trio.current_time()
        await trio.sleep(1.0)
        assert len(meta.calls) <= reporter.RATE + 1  # paced, not all at once
        await trio.sleep(60)
        nursery.cancel_scope.cancel()
    assert meta.calls.count((7, 1, "cs3", "corrupt")) == 1
    assert len(meta.calls) == reporter.QUEUE  # the rest were dropped, not queued without bound
    assert stats.bad_chunk_reports == reporter.QUEUE
    assert stats.bad_chunk_reports_skipped == 99 + 1001 - reporter.QUEUE
    assert trio.current_time() - start >= (reporter.QUEUE - 1) / reporter.RATE


async def test_a_failed_report_may_be_sent_again(autojump_clock):
    meta, stats = _Meta(fail=True), ClientStats()
    async with trio.open_nursery() as nursery:
        reporter = BadChunkReporter(meta, nursery, stats)
        reporter.report(7, 1, "cs3", "corrupt")
        await trio.sleep(1)
        reporter.report(7, 1, "cs3", "corrupt")
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    assert len(meta.calls) == 2 and stats.bad_chunk_reports == 0
