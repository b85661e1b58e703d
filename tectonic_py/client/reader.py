"""FileReader: an open file being read, its block list fetched once.

``pread`` maps a range to blocks; a sequential or large read takes whole blocks through the
client's block cache (with readahead of ``readahead_blocks``), a small random one reads
just its bytes as ranges of data chunks (``BlockIO.read_range``).

A block the reader cannot read (``QuorumLost``) may have been superseded since the open: an
in-place write replaced it with a new version, and the GC collects a superseded block's
chunks after a short grace (``superseded_grace``) rather than an hour. So the reader then
fetches the file's block list again and, when that block changed, reads the new version
(what a local file system shows too: writes are visible to open readers). No reader has to
announce itself for the old version's space to come back.

A reader sees its client only through ``ReadPath`` (the block reads, the cache, the
readahead depth and a fresh block list), not the path API.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

from tectonic_py.client import patches
from tectonic_py.client.buffers import BlockCache
from tectonic_py.client.stripe import Layout
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import FileNotFound, InvalidArgument, QuorumLost
from tectonic_py.core.records import Attrs, BlockInfo

T = TypeVar("T")


class ReadPath(Protocol):
    """What a reader needs of its client: block reads through the cache, the readahead
    depth, and the file's block list fetched again (after a lost block)."""

    @property
    def cache(self) -> BlockCache: ...

    @property
    def readahead_blocks(self) -> int: ...

    async def file_blocks(self, file_id: int) -> tuple[Attrs, list[BlockInfo]]:
        """The file's attrs and its committed blocks, as of now."""
        ...

    async def read_part(
        self, info: BlockInfo, block_offset: int, length: int, *, view: bool = False
    ) -> bytes | bytearray | memoryview: ...

    async def read_range(self, info: BlockInfo, block_offset: int, out: memoryview) -> None: ...

    def prefetch(self, infos: Sequence[BlockInfo]) -> None: ...


class FileReader:
    """An open file being read: its block list fetched once, readahead for sequential reads.

    Sequential detection keeps a few *streams* (the ends of recent runs of reads): a read
    that starts within one block of a stream's end continues it. One "last end" is not
    enough: torch.load reads the zip's tail, then jumps back, and the kernel's readahead sends
    FUSE reads slightly out of order; each such read would drop the reader out of sequential
    mode into a round trip per kernel read.
    """

    STREAMS = 4

    def __init__(self, client: ReadPath, attrs: Attrs, blocks: dict[int, BlockInfo]) -> None:
        self.client = client
        self.attrs = attrs
        self.file_id = attrs.id
        self.size = attrs.size
        self.layout = Layout(ECPolicy.parse(attrs.ec), attrs.chunk_size)
        self._blocks = blocks
        self._pos = 0
        # Ends of recent sequential runs, most recent last; a file is usually read from 0.
        self._streams: list[int] = [0]

    def _sequential(self, offset: int, length: int) -> bool:
        """Whether this read continues a recent run (and record it as that run's end)."""
        slack = self.layout.block_size
        for i, end in enumerate(self._streams):
            if end - slack <= offset <= end + slack:
                del self._streams[i]
                self._streams.append(max(end, offset + length))
                return True
        self._streams.append(offset + length)
        del self._streams[: -self.STREAMS]
        return False

    async def pread(self, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)``, short at EOF, zeros in holes."""
        data = await self._pread(offset, length, view=False)
        assert isinstance(data, bytes)
        return data

    async def pread_view(self, offset: int, length: int) -> bytes | bytearray | memoryview:
        """``pread`` for a caller that uses the bytes before its next ``await`` and never
        keeps them (the FUSE layer): they may be a view of a cached block, saving a copy
        (``TectonicClient.read_part``)."""
        return await self._pread(offset, length, view=True)

    async def _relocated(self, offset: int, length: int) -> bool:
        """Fetch the block list again after a block of ``[offset, offset + length)`` could
        not be read; True if one of those blocks is another version now (module docstring)."""
        try:
            attrs, blocks = await self.client.file_blocks(self.file_id)
        except FileNotFound:
            return False
        fresh = {b.file_index: b for b in blocks}
        first, last = (
            self.layout.block_of(offset),
            self.layout.block_of(offset + max(length, 1) - 1),
        )
        changed = any(
            _version(self._blocks.get(i)) != _version(fresh.get(i)) for i in range(first, last + 1)
        )
        self.attrs, self.size, self._blocks = attrs, attrs.size, fresh
        return changed

    async def _relocating(self, offset: int, length: int, read: Callable[[], Awaitable[T]]) -> T:
        """``read()``, once more if it lost a block that is another version now."""
        try:
            return await read()
        except QuorumLost:
            if not await self._relocated(offset, length):
                raise
        return await read()

    async def _pread(
        self, offset: int, length: int, *, view: bool
    ) -> bytes | bytearray | memoryview:
        return await self._relocating(
            offset, length, lambda: self._pread_once(offset, length, view=view)
        )

    async def _pread_once(
        self, offset: int, length: int, *, view: bool
    ) -> bytes | bytearray | memoryview:
        if offset < 0 or length < 0:
            raise InvalidArgument(f"bad read range {offset}+{length}")
        length = max(0, min(length, self.size - offset))
        sequential = self._sequential(offset, length)
        pieces = self.layout.pieces(offset, length)
        if len(pieces) == 1 and (sequential or length >= self.layout.block_size // 2):
            # The common sequential case: one copy from the cached block (none for a view).
            piece = pieces[0]
            info = self._blocks.get(piece.block_index)
            if (
                info is not None
                and not info.patches
                and piece.block_offset + piece.length <= info.file_len
            ):
                self._readahead(sequential, offset, length)
                data = await self.client.read_part(
                    info, info.ext_off + piece.block_offset, piece.length, view=view
                )
                self._done_with(info, piece.block_offset + piece.length)
                return data
        out = bytearray(length)
        await self._fill(offset, memoryview(out), sequential)
        return out if view else bytes(out)

    async def pread_into(self, offset: int, dest: memoryview) -> int:
        """Read ``[offset, offset + len(dest))`` into ``dest``; the count, short at EOF.

        Why: a caller with its own buffer (``BufferedReader.readinto`` under torch.load
        through ``tectonic_py.connect``) gets the bytes in one copy from the cached blocks,
        where ``pread`` would make three (into a block-spanning buffer, into bytes, into
        ``dest``).
        """
        if offset < 0:
            raise InvalidArgument(f"bad read offset {offset}")
        dest = memoryview(dest).cast("B")
        length = max(0, min(dest.nbytes, self.size - offset))
        sequential = self._sequential(offset, length)

        async def fill() -> int:
            n = max(0, min(length, self.size - offset))  # the size may change on a relocate
            await self._fill(offset, dest[:n], sequential)
            return n

        return await self._relocating(offset, length, fill)

    async def _fill(self, offset: int, dest: memoryview, sequential: bool) -> None:
        """``dest`` gets the file's bytes from ``offset`` (zeros in holes), which lie inside
        the file; whole blocks for a sequential or large read, else ranges."""
        length = dest.nbytes
        bs = self.layout.block_size
        for piece in self.layout.pieces(offset, length):
            dst = dest[piece.out_offset : piece.out_offset + piece.length]
            info = self._blocks.get(piece.block_index)
            avail = 0
            if info is not None:
                avail = max(0, min(piece.length, info.file_len - piece.block_offset))
            if avail < piece.length:
                dst[avail:] = bytes(piece.length - avail)  # a hole, or past a short block
            if not avail:
                continue
            assert info is not None
            at = info.ext_off + piece.block_offset
            whole = sequential or avail >= bs // 2
            if info.patches:
                read = self._read_part if whole else self.client.read_range
                await patches.fill(info, piece.block_offset, dst[:avail], read)
                if whole:
                    self._done_with(info, piece.block_offset + avail)
            elif whole:
                dst[:avail] = await self.client.read_part(info, at, avail, view=True)
                self._done_with(info, piece.block_offset + avail)
            else:
                await self.client.read_range(info, at, dst[:avail])
        self._readahead(sequential, offset, length)

    async def _read_part(self, info: BlockInfo, at: int, out: memoryview) -> None:
        """``out`` gets bytes of ``info`` from its block in the cache (fetched whole)."""
        out[:] = await self.client.read_part(info, at, out.nbytes, view=True)

    def _done_with(self, info: BlockInfo, end: int) -> None:
        """A read reached the end of the file's part of a block: the cache may let it go
        first. Not a pack: the other files in it are likely read next (a restore)."""
        if end == info.file_len and not info.packed:
            self.client.cache.done(info.block_id)

    def _readahead(self, sequential: bool, offset: int, length: int) -> None:
        if sequential and length and self.client.readahead_blocks:
            last = self.layout.block_of(offset + length - 1)
            ahead = [
                self._blocks[i]
                for i in range(last + 1, last + 1 + self.client.readahead_blocks)
                if i in self._blocks
            ]
            self.client.prefetch(ahead)

    async def read(self, n: int = -1) -> bytes:
        """Sequential read from the current position, with readahead."""
        if n < 0:
            n = max(0, self.size - self._pos)
        data = await self.pread(self._pos, n)
        self._pos += len(data)
        return data

    def seek(self, pos: int) -> None:
        if pos < 0:
            raise InvalidArgument(f"negative position {pos}")
        self._pos = pos

    def tell(self) -> int:
        return self._pos

    def located(self) -> dict[int, BlockInfo]:
        """The block map this reader reads by (a copy), for another reader of it."""
        return dict(self._blocks)

    async def aclose(self) -> None:
        self._blocks = {}


# --- helpers -----------------------------------------------------------------------------------


def _version(info: BlockInfo | None) -> tuple[int, ...] | None:
    """What tells two versions of a file's block apart: its block and the packs of its
    patches (a reader whose patch's pack is gone finds the fold or the newer patch)."""
    if info is None:
        return None
    return (info.block_id, *(p.source.block_id for p in info.patches))
