"""A degraded range read: a lost data chunk's byte range rebuilt from the same range of k
other chunks, not from the whole block.

Why: zfec's Reed-Solomon code is bytewise (the bytes at one offset of the n chunks form one
codeword), so bytes ``[a, a + L)`` of any chunk follow from bytes ``[a, a + L)`` of any k
chunks. A small random read of a packed file whose data chunk sits on a dead store then costs
k ranges of its own length, where rebuilding the whole block fetched k whole chunks (all of a
24 MiB pack for a 64 KiB read). Only when fewer than k ranges come back good does the caller
fall back to the whole-block fetch (``BlockFetch``, with its hedging and its final verdict).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Set as AbstractSet

import trio

from tectonic_py.client.block_get import ChunkSource
from tectonic_py.client.stripe import ChunkRange
from tectonic_py.core.aio import open_service_nursery
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import TectonicError, Timeout
from tectonic_py.core.records import BlockInfo


async def rebuild_range(
    io: ChunkSource,
    info: BlockInfo,
    lost: ChunkRange,
    skip: AbstractSet[int],
    out: memoryview,
) -> bool:
    """Rebuild ``lost`` (a range of one data chunk) into its place in ``out`` from the same
    range of k other chunks; chunks in ``skip`` (failed or slow already) are not asked. False
    when fewer than k ranges could be read: the caller reads the whole block instead."""
    policy = ECPolicy.parse(info.ec)
    k = policy.k
    by_index = {pl.index: pl for pl in info.chunks}
    candidates = [i for i in sorted(by_index) if i != lost.chunk_index and i not in skip]
    if len(candidates) < k:
        return False
    view = io.node_view

    def avoided(i: int) -> bool:
        pl = by_index[i]
        return view.avoid(pl.node_id, io.address_of(pl))

    order = deque(sorted(candidates, key=avoided))  # stable: live nodes first, data first
    start, length = lost.chunk_offset, lost.length
    got: dict[int, memoryview] = {}
    results_send, results = trio.open_memory_channel[bool](len(order))

    async def fetch(i: int) -> None:
        pl = by_index[i]
        into = memoryview(bytearray(length))
        try:
            await io.get_into(info, pl, into, start, limit=io.slow_chunk_s)
        except Timeout:
            results_send.send_nowait(False)
            return
        except TectonicError as e:
            io.report_bad(info, pl, e)
            results_send.send_nowait(False)
            return
        got[i] = into
        results_send.send_nowait(True)

    async with open_service_nursery() as nursery:
        pending = 0
        while pending < k and order:
            nursery.start_soon(fetch, order.popleft())
            pending += 1
        while len(got) < k and pending:
            ok = await results.receive()
            pending -= 1
            if not ok and order:
                nursery.start_soon(fetch, order.popleft())
                pending += 1
        nursery.cancel_scope.cancel()
    if len(got) < k:
        return False
    chunks = dict(sorted(got.items())[:k])
    rebuilt = memoryview(bytearray(k * length))
    others = frozenset(range(k)) - {lost.chunk_index}
    async with io.reconstruct:
        await io.codec.decode_into(policy, chunks, length, rebuilt, in_place=others)
    i = lost.chunk_index
    out[lost.out_offset : lost.out_offset + length] = rebuilt[i * length : (i + 1) * length]
    io.stats.degraded_reads += 1
    io.stats.range_rebuilds += 1
    return True
