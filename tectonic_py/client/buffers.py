"""The client's two memory budgets: ``BufferPool`` (the writers' window of block buffers) and
``BlockCache`` (the readers' cached blocks and fetches in flight).

Both keep a few released buffers for reuse: a fresh buffer of a block (tens of MiB) costs a
memset and thousands of page faults, a measurable share of the data path's CPU, and both
stay within their capacity plus those spares.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import trio

from tectonic_py.client.stats import ClientStats
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.records import BlockInfo


class Holder(Protocol):
    """A writer holding a buffer of the window in its open block, as the pool sees it: when
    it last wrote, and whether a spill of its open block is already under way."""

    last_write: float
    spilling: bool

    async def spill_open(self) -> None:
        """Flush the open block and give its buffer back."""
        ...


class BufferPool:
    """The client-wide memory window: block buffers, reused, at most ``capacity`` bytes.

    A buffer is charged ``charge`` bytes (its size plus the parity zfec will allocate for it)
    from ``acquire`` to ``release``. Released buffers are kept for reuse (a large allocation
    is costly) while the window has room for them, and two once no buffer is charged, so
    the pool's memory stays within the capacity plus two buffers; spares of other sizes
    are dropped to make room.

    Idle writers are spilled: a writer's open block holds a buffer between writes, so a
    program that writes many files round-robin from one thread could hold the whole window
    in half-filled blocks while it waits for a buffer for the next file, forever. A waiter
    that has waited ``SPILL_AFTER_S`` asks every writer idle that long to flush its open
    block (committed as a short block; the writer reloads it when it writes again).
    """

    SPILL_AFTER_S = 1.0

    def __init__(self, capacity: int, stats: ClientStats) -> None:
        self.capacity = capacity
        self._stats = stats
        self._charged = 0
        self._spare: dict[int, list[bytearray]] = {}
        self._spare_bytes = 0
        self._lot = trio.lowlevel.ParkingLot()
        self.holders: set[Holder] = set()
        # Set by the client: starts the task that flushes a holder's open block.
        self.spill: Callable[[Holder], None] | None = None

    @property
    def charged(self) -> int:
        return self._charged

    async def acquire(self, size: int, charge: int, *, wait: bool = True) -> bytearray:
        """A buffer of ``size`` bytes, charged ``charge``; ``wait=False`` takes it even over
        the capacity (a writer growing the buffer it holds, see ``FileWriter._ensure``)."""
        charge = min(max(charge, size), self.capacity)
        if wait and self._charged + charge > self.capacity:
            self._stats.buffer_waits += 1
            while self._charged + charge > self.capacity:
                with trio.move_on_after(self.SPILL_AFTER_S / 2):
                    await self._lot.park()
                self._spill_idle()
        self._charged += charge
        spares = self._spare.get(size)
        if spares:
            self._spare_bytes -= size
            return spares.pop()
        while self._spare_bytes and self._charged + self._spare_bytes > self.capacity:
            self._drop_one_spare()
        return bytearray(size)

    def release(self, buf: bytearray, charge: int) -> None:
        charge = min(max(charge, len(buf)), self.capacity)
        self._charged -= charge
        # While writers are busy, keep every released buffer the window has room for: the
        # flushes of a full window end together, and a buffer freed then is a fresh one
        # (memset and page faults) for the next block. Idle, keep two.
        keep = self.capacity - self._charged if self._charged else 2 * len(buf)
        if self._spare_bytes + len(buf) <= keep:
            self._spare.setdefault(len(buf), []).append(buf)
            self._spare_bytes += len(buf)
        if not self._charged:
            while self._spare_bytes > 2 * len(buf):
                self._drop_one_spare()
        self._lot.unpark_all()

    def _spill_idle(self) -> None:
        if self.spill is None:
            return
        now = time.monotonic()
        for writer in list(self.holders):
            if now - writer.last_write >= self.SPILL_AFTER_S and not writer.spilling:
                writer.spilling = True
                self._stats.spills += 1
                self.spill(writer)

    def _drop_one_spare(self) -> None:
        for size, bufs in self._spare.items():
            if bufs:
                bufs.pop()
                self._spare_bytes -= size
                return


class BlockCache:
    """The readers' memory budget: whole blocks cached (keyed by block id, blocks are
    immutable) *and* the buffers of block fetches in flight, at most ``capacity`` bytes.

    Why fetches count: many readers each fetching a block (plus readahead) would otherwise
    hold buffers the cache never sees, without bound. A fetch ``reserve``s its buffer first;
    a reader that gets no room reads the bytes it asked for straight from the chunk stores (a
    range read into its own buffer) instead of a whole block.

    Admission: a fetched block is *pinned* (a reader is about to consume it) until that
    reader has read to its end (``done``) or nobody touched it for ``GRACE_S``. Reservations
    (readahead, a reader's next block) evict only unpinned blocks, least recently used first,
    so one reader's readahead never evicts the block another reader is in the middle of
    (readers evicting each other's blocks would fetch every block many times over).

    Evicted blocks' buffers are kept (a few) and handed to the next block fetch (see the
    module docstring). Safe because every user of ``get``/``read_block`` copies out of the
    view before its next ``await`` (developer note: keep it that way).
    """

    KEEP_FREE = 2
    GRACE_S = 5.0

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[int, memoryview] = OrderedDict()
        self._pinned: dict[int, float] = {}  # block id -> last access
        self._bytes = 0  # cached blocks' buffers plus reservations of fetches in flight
        self._free: list[bytearray] = []

    @property
    def used(self) -> int:
        return self._bytes

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._blocks

    def get(self, block_id: int) -> memoryview | None:
        data = self._blocks.get(block_id)
        if data is not None:
            self._blocks.move_to_end(block_id)
            if block_id in self._pinned:
                self._pinned[block_id] = time.monotonic()
        return data

    def reserve(self, size: int, *, force: bool = False) -> bool:
        """Room for a fetch buffer of ``size`` bytes, evicting unpinned blocks (any block
        when ``force``d, and then even over capacity: a caller that must have the whole
        block, such as a degraded fallback). False, and nothing reserved, when no room."""
        now = time.monotonic()
        if self._bytes + size > self.capacity:
            for bid in list(self._blocks):
                if self._bytes + size <= self.capacity:
                    break
                touched = self._pinned.get(bid)
                if force or touched is None or now - touched >= self.GRACE_S:
                    self.discard(bid)
        if self._bytes + size > self.capacity and not force:
            return False
        self._bytes += size
        return True

    def unreserve(self, size: int) -> None:
        self._bytes -= size

    def put(self, block_id: int, data: memoryview, *, reserved: int = 0) -> None:
        """Cache a fetched block (pinned), turning its fetch's reservation into its entry."""
        self._bytes -= reserved
        size = buffer_size(data)
        if size > self.capacity:
            return
        self.discard(block_id)
        self._blocks[block_id] = data
        self._pinned[block_id] = time.monotonic()
        self._bytes += size
        while self._bytes > self.capacity and len(self._blocks) > 1:
            self.discard(next(iter(self._blocks)))

    def done(self, block_id: int) -> None:
        """A reader has read to the end of this block: it may be evicted first."""
        self._pinned.pop(block_id, None)

    def discard(self, block_id: int) -> None:
        old = self._blocks.pop(block_id, None)
        self._pinned.pop(block_id, None)
        if old is not None:
            self._bytes -= buffer_size(old)
            self._recycle(old)

    def _recycle(self, view: memoryview) -> None:
        buf = view.obj
        if isinstance(buf, bytearray) and len(self._free) < self.KEEP_FREE:
            self._free.append(buf)

    def take(self, size: int) -> bytearray:
        """A buffer of exactly ``size`` bytes for a block fetch (contents undefined)."""
        for i, buf in enumerate(self._free):
            if len(buf) == size:
                return self._free.pop(i)
        self._free.clear()  # wrong sizes: do not keep memory outside the budget
        return bytearray(size)


def block_buffer_size(info: BlockInfo) -> int:
    """The fetch buffer of a block: its k data chunks."""
    return ECPolicy.parse(info.ec).k * info.chunk_len


def buffer_size(view: memoryview) -> int:
    """Bytes a cached view keeps alive: its whole underlying buffer."""
    obj = view.obj
    return len(obj) if isinstance(obj, bytearray) else view.nbytes
