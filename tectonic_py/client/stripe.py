"""Striping maths: file offsets -> blocks -> byte ranges of data chunks.

A file is a sequence of blocks; block ``b`` covers file bytes ``[b * B, b * B + data_len)``
where ``B = k * C`` (k data chunks of C bytes, the file's chunk size). Every block but the
file's last (and a block cut short by an fsync or a sparse write) is full. A short block of
``data_len`` bytes has chunks of ``chunk_len = ceil(data_len / k)`` bytes: the data is padded
with zeros to ``k * chunk_len`` for zfec and the true length is kept in the Block layer.

Because zfec is systematic, data chunk ``i`` of a block is the contiguous slice
``[i * chunk_len, (i + 1) * chunk_len)`` of the (padded) block. A read of file bytes therefore
maps to byte ranges of data chunks with no decoding at all: that is the read fast path.

This module is pure arithmetic (no I/O) so that hypothesis can check it exhaustively.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import InvalidArgument


@dataclass(frozen=True)
class BlockPiece:
    """The part of a file range that falls in one block."""

    block_index: int
    block_offset: int  # offset of the piece inside the block's data
    length: int
    out_offset: int  # where the piece goes in the caller's buffer


@dataclass(frozen=True)
class ChunkRange:
    """A byte range of one data chunk, and where it lands in the caller's buffer."""

    chunk_index: int
    chunk_offset: int
    length: int
    out_offset: int


def chunk_len_for(data_len: int, k: int) -> int:
    """Padded length of each chunk of a block holding ``data_len`` bytes (0 for an empty one)."""
    if data_len < 0 or k < 1:
        raise InvalidArgument(f"bad block shape: data_len={data_len} k={k}")
    return -(-data_len // k)


@dataclass(frozen=True)
class Layout:
    """How one file is cut into blocks and chunks: its EC policy and chunk size C."""

    policy: ECPolicy
    chunk_size: int

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise InvalidArgument(f"chunk size must be positive, not {self.chunk_size}")

    @property
    def k(self) -> int:
        return self.policy.k

    @property
    def block_size(self) -> int:
        """Data bytes in a full block (``k * C``)."""
        return self.policy.k * self.chunk_size

    def block_start(self, block_index: int) -> int:
        return block_index * self.block_size

    def block_of(self, offset: int) -> int:
        return offset // self.block_size

    def blocks_in(self, size: int) -> int:
        """How many blocks a file of ``size`` bytes spans."""
        return -(-size // self.block_size)

    def block_data_len(self, block_index: int, size: int) -> int:
        """Data bytes of block ``block_index`` in a dense file of ``size`` bytes."""
        return max(0, min(self.block_size, size - self.block_start(block_index)))

    def pieces(self, offset: int, length: int) -> list[BlockPiece]:
        """Split the file range ``[offset, offset + length)`` at block boundaries."""
        if offset < 0 or length < 0:
            raise InvalidArgument(f"bad range: offset={offset} length={length}")
        return [BlockPiece(*piece) for piece in _split_at(self.block_size, offset, length)]


def chunk_ranges(chunk_len: int, block_offset: int, length: int, k: int) -> list[ChunkRange]:
    """Data-chunk byte ranges holding block bytes ``[block_offset, block_offset + length)``.

    ``chunk_len`` is the block's (padded) chunk length; the range must lie inside the
    block's ``k * chunk_len`` bytes.
    """
    if chunk_len < 1 or block_offset < 0 or length < 0 or block_offset + length > k * chunk_len:
        raise InvalidArgument(
            f"range {block_offset}+{length} outside a block of {k} x {chunk_len} bytes"
        )
    return [ChunkRange(*piece) for piece in _split_at(chunk_len, block_offset, length)]


def _split_at(unit: int, start: int, length: int) -> Iterator[tuple[int, int, int, int]]:
    """Cut ``[start, start + length)`` at multiples of ``unit``: for each piece, ``(unit
    index, offset inside the unit, length, offset from start)``. File ranges cut at blocks
    and block ranges cut at data chunks are the same arithmetic at two sizes."""
    pos, end = start, start + length
    while pos < end:
        i = pos // unit
        inner = pos - i * unit
        n = min(unit - inner, end - pos)
        yield i, inner, n, pos - start
        pos += n
