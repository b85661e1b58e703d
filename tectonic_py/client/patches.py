"""A file's block read back with the patches laid over it (copy-on-write small writes).

A small in-place write is stored as an extent of a pack laid over the block
(metadata/file_layer.py, ``add_patch``), so what a file holds in a block is the block's own
bytes, then each patch, oldest first. The reader (the FUSE layer, the library) and the
writer (read-modify-write, reading back its own writes) lay them with this one function, so
they cannot disagree about the order, the clipping, or the zeros between a block's own end
and a patch that reaches past it (an append made durable as a patch).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from tectonic_py.core.records import BlockInfo, Patch

ReadInto = Callable[[BlockInfo, int, memoryview], Awaitable[None]]
"""``read_into(block, at, out)``: bytes ``[at, at + len(out))`` of ``block`` into ``out``."""


async def fill(info: BlockInfo, block_offset: int, dest: memoryview, read_into: ReadInto) -> None:
    """``dest`` gets the file's bytes ``[block_offset, block_offset + len(dest))`` of block
    ``info``: its own bytes (zeros past them), then its patches over them."""
    n = dest.nbytes
    end = block_offset + n
    own = max(0, min(n, info.base_len - block_offset))
    if own and not _covered(info.patches, block_offset, block_offset + own):
        await read_into(info, info.ext_off + block_offset, dest[:own])
    if own < n:
        dest[own:] = bytes(n - own)
    for p in info.patches:
        lo, hi = max(block_offset, p.at), min(end, p.at + p.length)
        if lo < hi:
            out = dest[lo - block_offset : hi - block_offset]
            await read_into(p.source, p.source.ext_off + lo - p.at, out)


def _covered(patches: tuple[Patch, ...], lo: int, hi: int) -> bool:
    """Whether one patch covers ``[lo, hi)`` whole: the block's own bytes there are not read
    (a page read again after it was rewritten)."""
    return any(p.at <= lo and hi <= p.at + p.length for p in patches)


def laid(old: tuple[Patch, ...], new: Patch) -> tuple[Patch, ...]:
    """The patches after ``new`` is laid over ``old``: those it covers whole go, as the File
    layer drops them in the same commit."""
    kept = tuple(p for p in old if not (new.at <= p.at and p.at + p.length <= new.at + new.length))
    return (*kept, new)
