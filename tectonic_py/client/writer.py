"""FileWriter: an open file being written, holding its writer token.

Bytes go into the *open block*, a buffer of up to one block (k chunks of C bytes) taken
from the client-wide ``BufferPool``: it starts at ``FIRST_BUFFER`` and doubles as the block
fills, so a small file holds (and is charged) about its own size. When the open block is
full it is handed to a flush task in the client's nursery (``BlockIO.store_block``, then the
commit: Block layer, then File layer at its ``file_index``, with the writer token). Several
blocks are in flight at once inside the window, which keeps the cores busy (one encoding
while another's chunks are on the wire); a writer that outruns the cluster waits in
``write`` for a buffer, so nothing buffers without bound.

A committed block reopened for a write (``r+``, ``pwrite``) is loaded whole into the open
block, which remembers that committed version (its *base*) and the range of it that the
writes changed: when it is stored, ``BlockIO.store_block`` puts only the data chunks in that
range and the parity, and adopts the base's other chunks, so a 4 KiB write into a big block
costs one data chunk and m parity chunks, not the whole block.

A small open block made durable by ``fsync`` or ``close`` (a small file, or the tail of a
large one) is not stored alone: it is copied into a *pack* with other files' blocks
(client/packing.py), and the pack's one commit gives this file its extent, size and, for a
close, the seal. A block loaded from a pack is patched and stored anew (never a version that
adopts chunks: the pack's chunks hold other files' bytes).

A small change to a committed block made durable by ``fsync`` or ``close`` (a 4 KiB
``pwrite`` into a checkpoint, a SQLite commit, an fsync'd append) is not a new version of the
block at all: the changed range goes into a pack as a *patch* laid over the block
(client/patches.py, metadata/file_layer.py), costing its own bytes. The writer folds a
block's patches into a new version (the paths above) when the change is a large part of the
block or the block has ``MAX_PATCHES`` already.

``fsync`` flushes the open block, even a short one (committed at its index; when the writer
later fills it, the full block replaces it at the same index), and waits until every flush
task has committed. ``close`` stores the open block, waits for the flush tasks, and commits
that last block with the seal in one metadata call. Commits of one index are ordered by a
per-index generation, so an older, slower flush of a block never overwrites a newer one. A
writer whose token was stolen gets ``StaleWriterToken`` from its next commit, and from
every call after (errors are sticky).

A writer sees its client only through ``WritePath``: store a block, commit blocks, seal, and
the window and nursery it borrows, so it can be read (and tested) without the path API and
the client's modules need not import each other in a circle.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Awaitable, Sequence
from typing import Protocol, TypeVar

import trio

from tectonic_py.client import patches
from tectonic_py.client.block_io import BlockWrite
from tectonic_py.client.buffers import BufferPool
from tectonic_py.client.packing import Packer
from tectonic_py.client.quota_charge import QuotaCharge
from tectonic_py.client.stripe import Layout
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import InvalidArgument, TectonicError
from tectonic_py.core.records import MAX_PATCHES, Attrs, BlockInfo, Patch

log = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview

LEASE_RENEW_S = 15.0  # well inside the metadata server's writer lease (60 s by default)
# The open block's buffer starts at this size (plus room for the encode's padding) and
# doubles as writes fill it, up to a whole block: a small file is charged to the window what
# it holds, so a burst of small files is not held to a few whole-block buffers at a time.
FIRST_BUFFER = 1024 * 1024
BUFFER_PAD = 4096  # >= k - 1: chunk_len_for pads data_len up to a multiple of k
GROW_WAIT_S = 0.5  # a growing writer waits this long for room, then takes it over the window

T = TypeVar("T")


class WritePath(Protocol):
    """What a writer needs of its client: the window its buffers come from, the nursery its
    flush tasks run in, and the block and metadata calls of one file's writes."""

    @property
    def buffers(self) -> BufferPool: ...

    @property
    def nursery(self) -> trio.Nursery: ...

    @property
    def packer(self) -> Packer | None:
        """Where small blocks go to be stored with other files' (None: never packed)."""
        ...

    async def store_block(self, block: BlockWrite) -> BlockInfo:
        """Make one block durable on chunk stores (not yet part of the file)."""
        ...

    async def read_block(self, info: BlockInfo) -> memoryview:
        """A committed block, for read-modify-write and reading back (a view: copy it)."""
        ...

    async def commit_blocks(self, file_id: int, token: int, blocks: Sequence[BlockInfo]) -> None:
        """Put stored blocks into the file at their indexes, under the writer token."""
        ...

    async def set_size(self, file_id: int, token: int, size: int) -> Attrs:
        """Set the file's size (fsync, truncate)."""
        ...

    async def seal(self, file_id: int, token: int, size: int, blocks: Sequence[BlockInfo]) -> Attrs:
        """Commit the last blocks, seal the file and release the token: one transaction."""
        ...

    async def renew_lease(self, file_id: int, token: int) -> None:
        """Keep the writer token's lease alive."""
        ...

    async def created(self) -> None:
        """Return once the file exists at its shard (a create answered before it was sent,
        tectonic_py/client/async_creates.py); raise what that create met."""
        ...

    def superseded(self, old: BlockInfo) -> None:
        """A newer version of ``old`` is committed: no reader should get it from a cache."""
        ...

    async def claim(
        self, realm: int, dir_id: int, file_id: int, need: int, want: int, prealloc: bool
    ) -> tuple[int, int]:
        """Bytes of the quota realm the file may grow by, and how many of them fallocate had
        set aside for it (client/quota_charge.py)."""
        ...

    async def unclaim(self, realm: int, file_id: int, nbytes: int, keep: bool) -> None:
        """Give claimed bytes back (``keep``: to the file's set-aside bytes)."""
        ...


class FileWriter:
    """An open file being written; holds the writer token (see the module docstring)."""

    def __init__(
        self, write_path: WritePath, attrs: Attrs, token: int, blocks: dict[int, BlockInfo]
    ) -> None:
        self.write_path = write_path
        self.attrs = attrs
        self.file_id = attrs.id
        self.token = token
        self.policy = ECPolicy.parse(attrs.ec)
        self.layout = Layout(self.policy, attrs.chunk_size)
        self.size = attrs.size
        # Quota: growth is claimed of the file's realm before it is buffered.
        self.quota = QuotaCharge(write_path, attrs.realm, attrs.id, attrs.size)
        self._lock = trio.Lock()
        self._committed = blocks
        self._open_index: int | None = None
        self._open_buf: bytearray | None = None
        self._open_len = 0
        self._dirty = False
        # The committed version the open block was loaded from, and the range [lo, hi) of
        # the block that writes changed since (module docstring).
        self._open_base: BlockInfo | None = None
        # The committed version the open block holds (whole, an extent or patched): what a
        # small change to it is laid over as a patch.
        self._open_loaded: BlockInfo | None = None
        self._dirty_lo = 0
        self._dirty_hi = 0
        self._gen = itertools.count(1)
        self._committed_gen: dict[int, int] = {}
        self._commit_locks: dict[int, trio.Lock] = {}
        self._inflight: dict[int, int] = {}
        self._idle = trio.lowlevel.ParkingLot()
        self._synced_size = self.size
        self._stamped = False  # a commit since the last fsync stamped the file's mtime
        self._error: TectonicError | None = None
        self._aborted = False
        self._closed = False
        self._final: Attrs | None = None
        self._renewed = time.monotonic()
        self.last_write = time.monotonic()
        self.spilling = False

    # --- public ------------------------------------------------------------------------------

    async def write(self, data: Buffer) -> int:
        """Append at the current end of the file: the fast path."""
        async with self._lock:
            return await self._pwrite(data, self.size)

    async def pwrite(self, data: Buffer, offset: int) -> int:
        """Write anywhere: the open block is patched, committed blocks are rewritten
        (read-modify-write at the same index), a write past the end leaves a hole."""
        async with self._lock:
            return await self._pwrite(data, offset)

    async def pread(self, offset: int, length: int) -> bytes:
        """Read back what this writer wrote: buffered bytes and committed blocks."""
        async with self._lock:
            return await self._pread(offset, length)

    async def truncate(self, size: int) -> None:
        """Shrink (later bytes are dropped) or grow sparse (the new bytes read as zeros)."""
        async with self._lock:
            await self._truncate(size)

    async def fallocate(self, offset: int, length: int, *, keep_size: bool = False) -> None:
        """fallocate(2), modes 0 and KEEP_SIZE: the range's bytes are claimed of the quota
        (EDQUOT if they do not fit); mode 0 also grows the file to cover the range (the
        new bytes read as zeros, a hole until written), KEEP_SIZE sets them aside for the
        file's later writes without changing its size."""
        if offset < 0 or length <= 0:
            raise InvalidArgument(f"bad fallocate range {offset}+{length}")
        async with self._lock:
            self._check()
            end = offset + length
            if keep_size:
                await self.quota.set_aside(end)
            elif end > self.size:
                await self._truncate(end)

    async def fsync(self) -> None:
        """Return when every byte written so far is durable and committed."""
        async with self._lock:
            await self._fsync()

    async def close(self) -> Attrs:
        """fsync, then seal the file and release the writer token. Idempotent."""
        async with self._lock:
            try:
                return await self._close()
            finally:
                await self.quota.give_back()

    def committed_blocks(self) -> dict[int, BlockInfo]:
        """The committed blocks by index (after ``close``: every block of the sealed file)."""
        return dict(self._committed)

    async def abort(self) -> None:
        """Drop buffered bytes; the file keeps its last committed state."""
        self._aborted = True
        self._closed = True
        async with self._lock:
            self._release_open()
            await self.quota.give_back()

    # --- internals ---------------------------------------------------------------------------

    async def spill_open(self) -> None:
        """Flush the open block of an idle writer to give its buffer back (BufferPool)."""
        try:
            async with self._lock:
                if self._open_buf is not None and not self._closed:
                    await self._flush_open()
        finally:
            self.spilling = False

    async def _pwrite(self, data: Buffer, offset: int) -> int:
        self._check()
        self.last_write = time.monotonic()
        if offset < 0:
            raise InvalidArgument(f"negative write offset {offset}")
        view = memoryview(data).cast("B")
        if not view.nbytes:
            return 0
        await self.quota.grow(offset + view.nbytes)  # EDQUOT before a byte is taken
        layout = self.layout
        for piece in layout.pieces(offset, view.nbytes):
            if piece.block_index != self._open_index:
                await self._switch_open(piece.block_index)
            bo, n = piece.block_offset, piece.length
            await self._ensure(bo + n)
            buf = self._open_buf
            assert buf is not None
            self._mark_dirty(min(bo, self._open_len), bo + n)
            if bo > self._open_len:
                buf[self._open_len : bo] = bytes(bo - self._open_len)
            buf[bo : bo + n] = view[piece.out_offset : piece.out_offset + n]
            self._open_len = max(self._open_len, bo + n)
            self._dirty = True
            self.size = max(self.size, layout.block_start(piece.block_index) + bo + n)
            if bo + n == layout.block_size:
                await self._flush_open()
            self._check()
        return view.nbytes

    async def _pread(self, offset: int, length: int) -> bytes:
        self._check()
        if offset < 0 or length < 0:
            raise InvalidArgument(f"bad read range {offset}+{length}")
        length = max(0, min(length, self.size - offset))
        out = bytearray(length)
        view = memoryview(out)
        for piece in self.layout.pieces(offset, length):
            dst = view[piece.out_offset : piece.out_offset + piece.length]
            if piece.block_index == self._open_index:
                assert self._open_buf is not None
                avail = max(0, min(piece.length, self._open_len - piece.block_offset))
                dst[:avail] = memoryview(self._open_buf)[
                    piece.block_offset : piece.block_offset + avail
                ]
                continue
            await self._wait_index(piece.block_index)
            self._check()
            info = self._committed.get(piece.block_index)
            if info is None:
                continue
            avail = max(0, min(piece.length, info.file_len - piece.block_offset))
            if avail:
                await patches.fill(info, piece.block_offset, dst[:avail], self._read_into)
        return bytes(out)

    async def _read_into(self, info: BlockInfo, at: int, out: memoryview) -> None:
        data = await self.write_path.read_block(info)
        out[:] = data[at : at + out.nbytes]

    async def _truncate(self, size: int) -> None:
        self._check()
        if size < 0:
            raise InvalidArgument(f"negative size {size}")
        await self.quota.grow(size)
        await self._flush_open()
        await self._drain()
        self._check()
        layout = self.layout
        await self._meta_call(self.write_path.set_size(self.file_id, self.token, size))
        if size < self.size:
            for index in [i for i in self._committed if layout.block_start(i) >= size]:
                del self._committed[index]
            self.size = size
            bi = layout.block_of(size)
            info = self._committed.get(bi)
            if info is not None and layout.block_start(bi) + info.file_len > size:
                # Cut the block that straddles the new end, so that growing the file later
                # shows zeros there rather than the old bytes.
                await self._switch_open(bi)
                self._open_base = None  # cut short: a new block, not a new version
                self._open_loaded = None
                self._dirty = True
        self.size = size
        self._synced_size = size
        self.quota.shrink(size)

    async def _fsync(self) -> None:
        self._check()
        await self._meta_call(self.write_path.created())
        patch = self._patchable()
        if patch or self._packable():
            await self._drain()
            self._check()
            await self._pack(seal=False, patch=patch)
            self._synced_size = self.size
            self._stamped = False
            return
        if self._dirty and self._open_buf is not None and self._open_index is not None:
            index, n = self._open_index, self._open_len
            gen = next(self._gen)
            self._begin(index)
            try:
                info = await self.write_path.store_block(self._block(index, self._open_buf, n))
                await self._commit(index, gen, info)
                if self._committed.get(index) is info:
                    self._open_base = info  # later writes to the open block change this one
                    self._open_loaded = info
            except TectonicError as e:
                self._fail(e)
            finally:
                self._end(index)
            self._dirty = False
        await self._drain()
        self._check()
        if self.size != self._synced_size or self._stamped:
            # Also after commits at an unchanged size: its reply is the file's attrs as the
            # last stamp left them, so ``attrs`` shows at fsync (and close) the mtime the
            # file keeps (the seal stamps none).
            self.attrs = await self._meta_call(
                self.write_path.set_size(self.file_id, self.token, self.size)
            )
            self._synced_size = self.size
            self._stamped = False

    async def _close(self) -> Attrs:
        if self._final is not None:
            return self._final
        try:
            self._check()  # a sticky error: nothing more is stored
            await self._meta_call(self.write_path.created())
            patch = self._patchable()
            if patch or self._packable():
                await self._drain()
                self._check()
                self._final = await self._pack(seal=True, patch=patch)
                return self._final
            last = await self._store_open()
            await self._drain()
            self._check()
            # The open block is committed by the seal's own call: one transaction in the
            # file's shard (no flush task of its index is left after the drain, so its
            # generation is the newest).
            blocks = [last[1]] if last is not None else []
            self._final = await self._meta_call(
                self.write_path.seal(self.file_id, self.token, self.size, blocks)
            )
            if last is not None:
                self._note_committed(last[0], last[1])
            self.attrs = self._final
            return self._final
        finally:
            self._release_open()
            self._closed = True

    def _patchable(self) -> bool:
        """Whether the change to the open block goes into a pack as a patch over the
        committed version it holds: a change small beside the block (else the block is
        stored anew, folding its patches) to a block with room for one more patch."""
        packer = self.write_path.packer
        loaded, index = self._open_loaded, self._open_index
        if packer is None or not self._dirty or self._open_buf is None or loaded is None:
            return False
        if index is None or self._committed.get(index) is not loaded:
            return False
        span = self._dirty_hi - self._dirty_lo
        if span <= 0 or len(loaded.patches) >= MAX_PATCHES - 1:
            return False
        return span <= packer.limit(self.policy, self.attrs.chunk_size) and 2 * span <= max(
            self._open_len, loaded.file_len
        )

    def _packable(self) -> bool:
        """Whether the open block goes into a pack when it is made durable: dirty, small,
        and not a version of a committed block that could adopt its chunks."""
        packer = self.write_path.packer
        if packer is None or not self._dirty or self._open_buf is None:
            return False
        if self._open_index is None or self._open_base is not None or not self._open_len:
            return False
        return self._open_len <= packer.limit(self.policy, self.attrs.chunk_size)

    async def _pack(self, *, seal: bool, patch: bool, size: int | None = None) -> Attrs:
        """Store the open block in a pack and commit it there, with the file's size (and
        for a close the seal): one commit for every file of the pack. Only the changed
        range when it is a patch (``patch``: ``_patchable`` said so). ``size``: the size to commit, when not
        the writer's own (a patch made on the way to another block leaves it as it is)."""
        packer = self.write_path.packer
        assert packer is not None and self._open_buf is not None and self._open_index is not None
        index, gen = self._open_index, next(self._gen)
        loaded = self._open_loaded if patch else None
        lo, hi = (self._dirty_lo, self._dirty_hi) if loaded is not None else (0, self._open_len)
        view = memoryview(self._open_buf)[lo:hi]
        try:
            ticket = await packer.add(
                self.file_id,
                self.token,
                self.policy,
                self.attrs.chunk_size,
                index,
                view,
                self.size if size is None else size,
                seal=seal,
                at=lo if loaded is not None else -1,
            )
        finally:
            view.release()
        self._dirty = False
        self._dirty_lo = self._dirty_hi = 0
        if seal:
            self._release_open()  # the pack holds a copy: the window gets the buffer back
        attrs, info = await self._meta_call(ticket.result())
        if loaded is not None:
            laid = Patch(lo, hi - lo, info)
            info = dataclasses.replace(loaded, patches=patches.laid(loaded.patches, laid))
        self._note_committed(gen, info)
        if not seal:
            self._open_loaded = info  # the next small change is laid over this version
        self.attrs = attrs
        return attrs

    async def _store_open(self) -> tuple[int, BlockInfo] | None:
        """Store the dirty open block without committing it: its generation and record."""
        if not self._dirty or self._open_buf is None or self._open_index is None:
            return None
        index, n = self._open_index, self._open_len
        gen = next(self._gen)
        try:
            info = await self.write_path.store_block(self._block(index, self._open_buf, n))
        except TectonicError as e:
            self._fail(e)
            raise
        self._dirty = False
        return gen, info

    def _mark_dirty(self, lo: int, hi: int) -> None:
        if self._dirty_hi <= self._dirty_lo:
            self._dirty_lo, self._dirty_hi = lo, hi
        else:
            self._dirty_lo, self._dirty_hi = min(self._dirty_lo, lo), max(self._dirty_hi, hi)

    def _take_dirty(self) -> tuple[BlockInfo | None, tuple[int, int] | None]:
        """The open block's base and changed range, for ``store_block``; resets the range."""
        base, dirty = self._open_base, (self._dirty_lo, self._dirty_hi)
        self._dirty_lo = self._dirty_hi = 0
        return base, dirty if base is not None else None

    def _block(self, index: int, buf: bytearray, n: int) -> BlockWrite:
        """The open block, for ``store_block``, with what changed of its base; resets that."""
        base, dirty = self._take_dirty()
        return BlockWrite(
            self.file_id, self.token, self.policy, index, memoryview(buf), n, base, dirty
        )

    def _check(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise InvalidArgument(f"file {self.file_id} is closed for writing")

    def _fail(self, error: TectonicError) -> None:
        if self._error is None:
            self._error = error
            log.info("writer of file %d failed: %s", self.file_id, error)

    async def _meta_call(self, coro: Awaitable[T]) -> T:
        try:
            return await coro
        except TectonicError as e:
            self._fail(e)
            raise

    def _charge(self, buf: bytearray) -> int:
        """What a buffer costs the window: its bytes and the parity zfec makes of them."""
        return len(buf) * self.policy.n // self.policy.k

    def _buffer_size(self, need: int) -> int:
        """The buffer for ``need`` bytes of the open block and its encode's padding."""
        full = self.layout.block_size
        size = FIRST_BUFFER
        while size + BUFFER_PAD < need + self.policy.k and size + BUFFER_PAD < full:
            size *= 2
        return min(size + BUFFER_PAD, full)

    async def _ensure(self, need: int) -> None:
        """Grow the open block's buffer to hold ``need`` bytes (copying what it holds).

        The writer already holds a buffer while it waits for the bigger one, and a writer
        waiting for room cannot be spilled (it holds its lock), so after ``GROW_WAIT_S`` the
        buffer is taken over the window: writers that all wait to grow never deadlock, and
        the window is exceeded by at most what they grow by."""
        buf = self._open_buf
        assert buf is not None
        if len(buf) >= min(need + self.policy.k, self.layout.block_size):
            return
        size = self._buffer_size(need)
        pool = self.write_path.buffers
        new: bytearray | None = None
        with trio.move_on_after(GROW_WAIT_S):
            new = await pool.acquire(size, size * self.policy.n // self.policy.k)
        if new is None:
            new = await pool.acquire(size, size * self.policy.n // self.policy.k, wait=False)
        new[: self._open_len] = memoryview(buf)[: self._open_len]
        pool.release(buf, self._charge(buf))
        self._open_buf = new

    def _release_open(self) -> None:
        self.write_path.buffers.holders.discard(self)
        if self._open_buf is not None:
            self.write_path.buffers.release(self._open_buf, self._charge(self._open_buf))
        self._open_buf = None
        self._open_index = None
        self._open_len = 0
        self._dirty = False
        self._open_base = None
        self._open_loaded = None
        self._dirty_lo = self._dirty_hi = 0

    async def _switch_open(self, index: int) -> None:
        """Make block ``index`` the open block, loading what it already holds."""
        await self._flush_open()
        valid = self.layout.block_data_len(index, self.size)
        # Past the first block a file is large: its next block starts whole, not doubling
        # up from FIRST_BUFFER (a copy of about 31 MiB per 24 MiB block).
        size = self._buffer_size(self.layout.block_size if index else max(valid, 0))
        buf = await self.write_path.buffers.acquire(size, size * self.policy.n // self.policy.k)
        self._open_buf, self._open_index, self._open_len, self._dirty = buf, index, 0, False
        self._open_base, self._open_loaded, self._dirty_lo, self._dirty_hi = None, None, 0, 0
        self.write_path.buffers.holders.add(self)
        if valid <= 0:
            return
        await self._wait_index(index)
        self._check()
        info = self._committed.get(index)
        have = 0
        if info is not None:
            have = min(info.file_len, valid)
            await patches.fill(info, 0, memoryview(buf)[:have], self._read_into)
            self._open_loaded = info
            if have == info.data_len == valid and not info.packed:
                self._open_base = info
        buf[have:valid] = bytes(valid - have)
        self._open_len = valid

    async def _flush_open(self) -> None:
        """Hand the open block to a background flush task (or drop it if clean). A small
        change inside the committed size is laid as a patch first, at once (a random page
        write moving on to another block, a page that straddles two blocks): a patch costs
        its bytes where a new version of the block costs 1 + m chunks."""
        if (
            self._open_index is not None
            and self._patchable()
            and self.layout.block_start(self._open_index) + self._dirty_hi <= self._synced_size
        ):
            await self._pack(seal=False, patch=True, size=self._synced_size)
        buf, index, n, dirty = self._open_buf, self._open_index, self._open_len, self._dirty
        base, changed = self._take_dirty()
        self._open_buf, self._open_index, self._open_len, self._dirty = None, None, 0, False
        self._open_base = self._open_loaded = None
        self.write_path.buffers.holders.discard(self)
        if buf is None:
            return
        if not dirty or n == 0 or index is None:
            self.write_path.buffers.release(buf, self._charge(buf))
            return
        gen = next(self._gen)
        self._begin(index)
        block = BlockWrite(
            self.file_id, self.token, self.policy, index, memoryview(buf), n, base, changed
        )
        self.write_path.nursery.start_soon(self._flush_task, block, buf, gen)
        now = time.monotonic()
        if now - self._renewed > LEASE_RENEW_S:
            self._renewed = now
            self.write_path.nursery.start_soon(self._renew_lease)

    async def _renew_lease(self) -> None:
        """Keep the writer token's lease alive during a long write (GC recovers files whose
        writer's lease ran out); a stolen token shows up here as StaleWriterToken."""
        try:
            await self.write_path.renew_lease(self.file_id, self.token)
        except TectonicError as e:
            self._fail(e)

    async def _flush_task(self, block: BlockWrite, buf: bytearray, gen: int) -> None:
        """Store and commit one block handed off by ``_flush_open``; ``buf`` (which ``block``
        views) goes back to the window at the end."""
        index = block.file_index
        try:
            info = await self.write_path.store_block(block)
            await self._commit(index, gen, info)
        except TectonicError as e:
            self._fail(e)
        except Exception as e:  # a bug: keep the client alive, fail this writer loudly
            log.exception("flush of block %d of file %d failed", index, self.file_id)
            self._fail(TectonicError(f"internal error flushing block {index}: {e!r}"))
        finally:
            self.write_path.buffers.release(buf, self._charge(buf))
            self._end(index)

    async def _commit(self, index: int, gen: int, info: BlockInfo) -> None:
        lock = self._commit_locks.setdefault(index, trio.Lock())
        async with lock:
            if self._aborted or self._error is not None:
                return
            if gen < self._committed_gen.get(index, 0):
                return  # a newer version of this block is already committed
            await self.write_path.commit_blocks(self.file_id, self.token, [info])
            self._stamped = True
            self._note_committed(gen, info)

    def _note_committed(self, gen: int, info: BlockInfo) -> None:
        index = info.file_index
        self._committed_gen[index] = gen
        old = self._committed.get(index)
        if old is not None and old.block_id != info.block_id:
            self.write_path.superseded(old)
        self._committed[index] = info

    def _begin(self, index: int) -> None:
        self._inflight[index] = self._inflight.get(index, 0) + 1

    def _end(self, index: int) -> None:
        left = self._inflight[index] - 1
        if left:
            self._inflight[index] = left
        else:
            del self._inflight[index]
        self._idle.unpark_all()

    async def _wait_index(self, index: int) -> None:
        while index in self._inflight:
            await self._idle.park()

    async def _drain(self) -> None:
        while self._inflight:
            await self._idle.park()
