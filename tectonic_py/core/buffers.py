"""Payload buffers: reused large buffers and huge-page memory for O_DIRECT.

``SpareBuffers`` is the pool the RPC server receives large request payloads into (and the
chunk store its replies); ``huge_page_buffer`` makes memory whose pages suit an O_DIRECT
transfer.
"""

from __future__ import annotations

import mmap

from tectonic_py.core.framing import Buffer, MiB

HUGE_PAGE = 2 * MiB  # a transparent huge page on x86-64


def whole_huge_pages(n: int) -> int:
    """``n`` rounded up to a whole number of ``HUGE_PAGE``."""
    return -(-n // HUGE_PAGE) * HUGE_PAGE


def huge_page_buffer(used: int) -> mmap.mmap:
    """Private anonymous memory for ``used`` bytes, ``whole_huge_pages(used)`` long, advised
    for transparent huge pages where ``used`` fills more than half a huge page: a 4 MiB
    chunk and its 4 KiB header take two huge pages and one small one, not three huge ones,
    each of which the kernel zeroes whole when it is first touched.

    Why: an O_DIRECT transfer into 4 KiB pages is cut into a device request per 254 pages
    (the queue's segment limit), at least two for a 1 MiB chunk and its header, and a
    virtio disk pays per request. A buffer in 2 MiB pages is one segment per page, so one
    request up to the queue's ``max_sectors_kb``. The memory must be private:
    ``mmap(-1, n)`` is shared, and shared anonymous memory is shmem, which the default
    ``shmem_enabled=never`` keeps in small pages. The kernel aligns anonymous mappings of
    whole huge pages to a huge page, and where THP is off the buffer is an ordinary one."""
    buf = mmap.mmap(-1, whole_huge_pages(used), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    huge = used // HUGE_PAGE * HUGE_PAGE
    if used - huge > HUGE_PAGE // 2:
        huge += HUGE_PAGE
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE, 0, huge)
    return buf


def _unshared(buf: mmap.mmap) -> bool:
    """True when no memoryview (or slice of one) of ``buf`` is alive.

    An mmap refuses to resize while any buffer is exported from it, and every view and
    slice of a view holds one export, so a resize to its own size (a no-op ``mremap``)
    succeeds exactly when nobody else can still read or write the bytes.
    """
    try:
        buf.resize(len(buf))
    except BufferError:
        return False
    return True


def _anonymous(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size)


class SpareBuffers:
    """Large payload buffers, reused instead of allocated per request or reply.

    A fresh 4 MiB buffer costs a memset and a thousand page faults (and an munmap when
    freed), a large share of the CPU of a chunk store's put or get. Buffers of at
    least ``MIN_SIZE`` are anonymous mmaps (page aligned, so they also suit O_DIRECT), their
    sizes rounded up (``size_class``) so that chunks of nearby lengths share them; the user
    takes a view of the first ``n`` bytes. At most ``keep`` bytes of spares are kept; when a
    buffer comes back to a full pool, spares of other sizes are dropped (the longest unused
    first) to make room, because the sizes in use change with the workload (1 MiB chunks
    after 4 MiB ones): a pool full of the old size would make every new request pay for a
    fresh buffer. A buffer is handed out
    again only when no view of it is alive (``_unshared``), so bytes a handler, a reply or a
    worker thread still refers to are never overwritten. One given back while a view lives (a
    worker thread that has delivered its result but not yet dropped its frame) waits in
    ``_pending`` and is checked again at the next ``take``. Event-loop thread only.
    """

    MIN_SIZE = 64 * 1024

    def __init__(self, keep: int, *, huge: bool = False) -> None:
        """``huge``: the buffers are for O_DIRECT transfers, so those over half a huge page
        are whole huge pages (``huge_page_buffer``), which spends up to twice the memory on
        them."""
        self.keep = keep
        self._huge = huge
        self._free: dict[int, list[mmap.mmap]] = {}
        self._pending: list[mmap.mmap] = []
        self._bytes = 0  # free and pending
        self.reused = 0

    def size_class(self, n: int) -> int:
        """The size of the buffer ``take(n)`` gives: ``n`` rounded up to one of eight steps
        per power of two (at most 1/8 more), or to whole huge pages for a ``huge`` pool."""
        if n < self.MIN_SIZE:
            return n
        if self._huge and n > HUGE_PAGE // 2:
            return whole_huge_pages(n)
        step = max(4096, 1 << ((n - 1).bit_length() - 4))
        return -(-n // step) * step

    def take(self, n: int) -> bytearray | mmap.mmap:
        """A buffer of at least ``n`` bytes (contents undefined); give it back when done."""
        if n < self.MIN_SIZE:
            return bytearray(n)
        if self._pending:
            waiting, self._pending = self._pending, []
            for buf in waiting:
                if _unshared(buf):
                    self._free.setdefault(len(buf), []).append(buf)
                else:
                    self._pending.append(buf)
        size = self.size_class(n)
        free = self._free.get(size)
        if free:
            self._bytes -= size
            self.reused += 1
            return free.pop()
        return huge_page_buffer(n) if self._huge and n > HUGE_PAGE // 2 else _anonymous(size)

    def give_back(self, buf: Buffer) -> None:
        """Keep ``buf`` for reuse if there is room (reused once no view of it is alive)."""
        if not isinstance(buf, mmap.mmap) or len(buf) > self.keep:
            return
        if self._bytes + len(buf) > self.keep:
            self._drop_other_sizes(len(buf), self._bytes + len(buf) - self.keep)
            if self._bytes + len(buf) > self.keep:
                return
        if _unshared(buf):
            bufs = self._free.pop(len(buf), [])
            bufs.append(buf)
            self._free[len(buf)] = bufs  # to the end: this size was used last
        else:
            self._pending.append(buf)
        self._bytes += len(buf)

    def _drop_other_sizes(self, size: int, need: int) -> None:
        """Free at least ``need`` bytes of idle spares whose size is not ``size``, the size
        class given back least recently first (dict order: a size's list is re-inserted at
        the end whenever a buffer of it is kept)."""
        for other in [s for s in self._free if s != size]:
            bufs = self._free[other]
            while bufs and need > 0:
                bufs.pop().close()
                self._bytes -= other
                need -= other
            if not bufs:
                del self._free[other]
            if need <= 0:
                return
