"""Packs: the small blocks of many files coded and stored together as one block.

A checkpoint of many small shards used to cost each file a block of its own: n fsync'd chunk
puts and a block commit per file, whatever its size. Here the open block of a file that is
small when it is made durable (the whole of a small file, the tail of a large one) is copied
into the client's open *pack* for its shard and scheme, with the other files' blocks that
arrive meanwhile. A pack is stored at once when no other pack of its shard and scheme is
being stored (a lone file, or ``tar -x`` of one file after another, waits for nothing), else
when it is full or ``delay_s`` after it was opened: a burst of ranks fills whole packs while
the previous ones are on the wire, as group commit does. One encode, one set of n chunk puts
and one metadata transaction (``file.commit_pack``: the block, each file's extent, size and,
for a close, its seal) serve every file in a pack. A file's fsync or close
returns when its pack is committed, so durability is what it was (the pack's write quorum,
k+1 chunks by default).

At most ``max_packs`` packs are open or being stored at once per client. A writer that finds
none free waits for a store to finish, and the writers that wait together then share the
next pack: the busier the cluster, the fuller the packs. The pack buffers are the packer's
own, reused from pack to pack (a fresh block-sized buffer per pack costs its page faults,
and drew the window's spare buffers away from the writers), and not charged to the window:
writers waiting for a pack hold their own buffers there, so a pack that waited for room in
the window could wait for ever. Their memory is bounded by ``max_packs`` blocks, with the
parity of those being encoded.

Files of one shard share a pack (a directory's files all live in its shard, see
metadata/write_ops.py), so the files of one step directory share packs, and deleting the step
frees them whole. The File layer counts a pack's extents; the GC frees it with the last.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace

import trio

from tectonic_py.client.block_io import BlockWrite
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import TectonicError, Unavailable
from tectonic_py.core.records import Attrs, BlockInfo, PackedExtent

log = logging.getLogger(__name__)

MAX_PACK_FILES = 4096  # the metadata service's bound on the files of one pack commit
PAD = 4096  # >= k - 1: the encode pads the data up to a multiple of k
JOIN_S = 0.0005  # what a pack opened with no other being stored waits for writers woken with it

StoreBlock = Callable[[BlockWrite], Awaitable[BlockInfo]]
CommitPack = Callable[[BlockInfo, Sequence[PackedExtent]], Awaitable[list[Attrs | TectonicError]]]


@dataclass(frozen=True)
class PackTuning:
    """``delay_s``: how long an open pack waits for more files; ``max_packs``: packs open or
    being stored at once; ``limit``: the largest block packed, as a fraction of a block."""

    delay_s: float = 0.005
    max_packs: int = 4
    limit: float = 0.5


@dataclass
class _Pack:
    key: tuple[int, str, int]
    policy: ECPolicy
    capacity: int
    buf: bytearray
    used: int = 0
    files: list[PackedExtent] = field(default_factory=list)
    results: list[Attrs | TectonicError] = field(default_factory=list)
    info: BlockInfo | None = None
    full: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)

    def fits(self, n: int) -> bool:
        return self.used + n <= self.capacity and len(self.files) < MAX_PACK_FILES


class Ticket:
    """One file's place in a pack: ``result`` waits for the pack's commit."""

    def __init__(self, pack: _Pack, slot: int) -> None:
        self._pack, self._slot = pack, slot

    async def result(self) -> tuple[Attrs, BlockInfo]:
        """The file's attrs after the commit and its block (the pack, with the extent);
        raises what the store or this file's commit met."""
        pack = self._pack
        await pack.done.wait()
        outcome = pack.results[self._slot]
        if isinstance(outcome, TectonicError):
            raise outcome
        assert pack.info is not None
        f = pack.files[self._slot]
        return outcome, replace(pack.info, file_index=f.index, ext_off=f.offset, ext_len=f.length)


class Packer:
    """The client's open packs, one per (shard, scheme, chunk size) (module docstring)."""

    def __init__(
        self,
        store_block: StoreBlock,
        commit_pack: CommitPack,
        shard_of: Callable[[int], int],
        nursery: trio.Nursery,
        tuning: PackTuning,
    ) -> None:
        self._store_block = store_block
        self._commit_pack = commit_pack
        self._shard_of = shard_of
        self._nursery = nursery
        self.tuning = tuning
        self._open: dict[tuple[int, str, int], _Pack] = {}
        self._opening: dict[tuple[int, str, int], trio.Event] = {}
        self._slots = trio.Semaphore(max(1, tuning.max_packs))
        self._storing: dict[tuple[int, str, int], int] = {}
        self._spare: dict[int, list[bytearray]] = {}
        self.packs_stored = 0
        self.files_packed = 0

    def limit(self, policy: ECPolicy, chunk_size: int) -> int:
        """The largest block (in bytes) of a file with this scheme that goes into a pack."""
        if self.tuning.limit <= 0:
            return 0
        return int(policy.k * chunk_size * min(self.tuning.limit, 1.0))

    async def add(
        self,
        file_id: int,
        token: int,
        policy: ECPolicy,
        chunk_size: int,
        index: int,
        data: memoryview,
        size: int,
        *,
        seal: bool,
        at: int = -1,
    ) -> Ticket:
        """Copy one file's block ``index`` (``data``) into an open pack, or with ``at`` a
        patch over bytes ``[at, at + len(data))`` of it; the ticket's ``result`` returns
        when the pack holding it is committed. The caller may reuse ``data``'s buffer at
        once."""
        n = data.nbytes
        key = (self._shard_of(file_id), policy.name, chunk_size)
        while True:
            pack = self._open.get(key)
            if pack is not None and pack.fits(n):
                break
            if pack is not None:
                self._close(pack)  # full for this file: store it now, open the next
            opening = self._opening.get(key)
            if opening is not None:
                await opening.wait()
                continue
            pack = await self._open_pack(key, policy, chunk_size)
            break
        slot = len(pack.files)
        pack.buf[pack.used : pack.used + n] = data
        pack.files.append(PackedExtent(file_id, token, index, pack.used, n, size, seal, at))
        pack.used += n
        if not pack.fits(1):
            self._close(pack)
        return Ticket(pack, slot)

    async def _open_pack(
        self, key: tuple[int, str, int], policy: ECPolicy, chunk_size: int
    ) -> _Pack:
        event = self._opening[key] = trio.Event()
        try:
            await self._slots.acquire()
            capacity = policy.k * chunk_size
            size = capacity + PAD
            spares = self._spare.get(size)
            buf = spares.pop() if spares else bytearray(size)
            pack = _Pack(key, policy, capacity, buf)
            self._open[key] = pack
            self._nursery.start_soon(self._run, pack)
            return pack
        finally:
            del self._opening[key]
            event.set()

    def _give_back(self, buf: bytearray) -> None:
        """Keep a pack buffer for the next pack: at most ``max_packs`` in all, of the sizes
        used last (a client's files nearly always have one scheme and chunk size)."""
        self._spare.setdefault(len(buf), []).append(buf)
        while sum(len(v) for v in self._spare.values()) > self.tuning.max_packs:
            sizes = sorted(self._spare, key=lambda size: size == len(buf))  # others first
            self._spare[sizes[0]].pop()
            self._spare = {size: v for size, v in self._spare.items() if v}

    def _close(self, pack: _Pack) -> None:
        """No more files join ``pack``; its store starts now (``_run``)."""
        if self._open.get(pack.key) is pack:
            del self._open[pack.key]
        pack.full.set()

    async def _run(self, pack: _Pack) -> None:
        """Store and commit the pack: at once when no other pack of its key is being
        stored (a lone file waits for nothing), else when it is full or ``delay_s`` has
        passed, so that the files arriving meanwhile share it."""
        key = pack.key
        try:
            if self._storing.get(key, 0):
                with trio.move_on_after(self.tuning.delay_s):
                    await pack.full.wait()
            else:
                await trio.sleep(JOIN_S)  # writers woken with this pack's opening join it
            self._close(pack)
            self._storing[key] = self._storing.get(key, 0) + 1
            try:
                pack.results = await self._store(pack)
            finally:
                left = self._storing[key] - 1
                if left:
                    self._storing[key] = left
                else:
                    del self._storing[key]
        finally:
            if len(pack.results) != len(pack.files):  # cancelled: the client is closing
                pack.results = [Unavailable("the client closed before the pack was stored")] * len(
                    pack.files
                )
            self._give_back(pack.buf)
            self._slots.release()
            pack.done.set()

    async def _store(self, pack: _Pack) -> list[Attrs | TectonicError]:
        first = pack.files[0]
        try:
            pack.info = await self._store_block(
                BlockWrite(
                    first.file_id,
                    first.token,
                    pack.policy,
                    0,
                    memoryview(pack.buf),
                    pack.used,
                    pack=True,
                )
            )
            results = await self._commit_pack(pack.info, pack.files)
        except TectonicError as e:
            log.info("pack of %d files (%d bytes) failed: %s", len(pack.files), pack.used, e)
            return [e] * len(pack.files)
        except Exception as e:  # a bug: fail these files loudly, keep the client alive
            log.exception("pack of %d files failed", len(pack.files))
            return [TectonicError(f"internal error storing a pack: {e!r}")] * len(pack.files)
        self.packs_stored += 1
        self.files_packed += len(pack.files)
        return results
