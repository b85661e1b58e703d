"""Reading chunk files: whole or ranged gets, their verification, scrub's check, listings.

No byte leaves here unverified: a whole read is checked against the whole-chunk CRC in one
pass, a ranged read against the CRCs of the segments it touches (``chunkstore.layout``).
A whole-chunk get reads the file's image, header and all, with one O_DIRECT read into a
page-aligned buffer; filesystems that refuse O_DIRECT are read buffered.

Readers check after reading that the chunk's name still names the file they read
(``_still_named``), since a put may replace a chunk's file (a corrupt one) while it is read.

All functions here do blocking disk I/O and are meant to run in ``trio.to_thread.run_sync``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import struct
from collections.abc import Callable
from pathlib import Path

from chunkstore.layout import (
    DIRECT_ALIGN,
    DIRECT_MIN,
    HEADER,
    MAGIC,
    VERSIONS,
    Buffer,
    ChunkHeader,
    chunk_path,
    chunks_root,
    decode_header,
    direct_span,
    header_bytes_needed,
    length_from_file_size,
    lengths_from_file_size,
    no_direct,
    segment_count,
    validate_chunk_id,
)
from tectonic_py.core.checksum import KEEP_GIL_MAX, combine
from tectonic_py.core.checksum import checksum as crc32c
from tectonic_py.core.errors import ChunkCorrupt, ChunkNotFound, InvalidArgument

log = logging.getLogger(__name__)


def _open(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ChunkNotFound(f"no chunk {path.name}") from None


def _read_header_fd(fd: int, name: str, size: int | None = None) -> ChunkHeader:
    if size is None:
        size = os.fstat(fd).st_size
    buf = os.pread(fd, DIRECT_ALIGN, 0)
    need = header_bytes_needed(buf)
    if len(buf) < need <= size:
        buf = os.pread(fd, need, 0)
    try:
        return decode_header(buf, size)
    except ChunkCorrupt as e:
        raise ChunkCorrupt(f"chunk {name}: {e}") from None


def read_header(path: Path) -> ChunkHeader:
    return stat_chunk(path)[0]


def stat_chunk(path: Path) -> tuple[ChunkHeader, os.stat_result]:
    """The header of the chunk file at ``path`` and the file's stat."""
    fd = _open(path)
    try:
        st = os.fstat(fd)
        try:
            header = _read_header_fd(fd, path.name, st.st_size)
        except ChunkCorrupt:
            _still_named(path, st)
            raise
        _still_named(path, st)
        return header, st
    finally:
        os.close(fd)


def _still_named(path: Path, st: os.stat_result) -> None:
    """ChunkNotFound unless ``path`` still names the file ``st`` describes, unchanged.

    Why: a delete may unlink, or a put replace, a chunk's file while a reader has it open,
    and the reader would still find bytes that pass every check. So a reader checks, after
    reading, that the chunk's name still leads to the same inode with the same ctime (a
    rename or a write changes it); then what it read was this chunk's file all along.
    """
    try:
        now = os.stat(path)
    except FileNotFoundError:
        raise ChunkNotFound(f"chunk {path.name} was deleted while being read") from None
    if (now.st_ino, now.st_dev, now.st_ctime_ns) != (st.st_ino, st.st_dev, st.st_ctime_ns):
        raise ChunkNotFound(f"chunk {path.name} was deleted or replaced while being read")


def _pread_into(fd: int, view: memoryview, offset: int, name: str) -> None:
    while view:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise ChunkCorrupt(f"chunk {name}: file ends early")
        view = view[n:]
        offset += n


def _set_direct(fd: int, on: bool) -> None:
    """Turn O_DIRECT on or off for a file opened read-only (EINVAL where the filesystem
    refuses it)."""
    fcntl.fcntl(fd, fcntl.F_SETFL, os.O_RDONLY | (os.O_DIRECT if on else 0))


def _aligned(view: memoryview) -> bool:
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view)) % DIRECT_ALIGN == 0
    except (TypeError, ValueError):
        return False


def _read_whole_direct(
    fd: int, st: os.stat_result, alloc: Callable[[int], Buffer], name: str
) -> tuple[ChunkHeader, memoryview, int] | None:
    """A whole chunk read, header and all, by one O_DIRECT read of its file into a
    page-aligned buffer from ``alloc``: (header, data (a view of the buffer), crc). None
    where the chunk is small, the buffer is not aligned or the filesystem refuses O_DIRECT
    (the caller reads buffered); the fd is as it was then.

    Why: a buffered read copies the whole chunk out of the page cache, a large share of a
    get's CPU, and a restore reads each chunk once. Reading the header from the same buffer
    leaves one system call that waits for the disk.
    The kernel writes back any dirty pages of the range first, so a file written buffered
    reads the same.
    """
    size = st.st_size
    if size < HEADER.size + DIRECT_MIN or st.st_dev in no_direct:
        return None
    span = direct_span(size)
    buf = memoryview(alloc(span))[:span]
    if not _aligned(buf):
        return None
    try:
        _set_direct(fd, True)
        got = 0
        while got < size:
            # Whole blocks at aligned offsets; the kernel stops at the end of the file.
            n = os.preadv(fd, [buf[got:]], got)
            if n == 0:
                raise ChunkCorrupt(f"chunk {name}: file ends early")
            got += n
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        no_direct.add(st.st_dev)
        log.info("no O_DIRECT reads on device %d; chunk reads are buffered", st.st_dev)
        _set_direct(fd, False)
        return None
    try:
        header = decode_header(bytes(buf[: min(header_bytes_needed(buf), size)]), size)
    except ChunkCorrupt as e:
        raise ChunkCorrupt(f"chunk {name}: {e}") from None
    data = buf[header.data_offset : size]
    crc = crc32c(data, keep_gil=len(data) <= KEEP_GIL_MAX)
    if crc != header.checksum:
        raise ChunkCorrupt(f"chunk {name} failed its checksum")
    return header, data, crc


def read_chunk(
    data_dir: Path,
    chunk_id: str,
    offset: int = 0,
    length: int | None = None,
    alloc: Callable[[int], Buffer] = bytearray,
) -> tuple[ChunkHeader, memoryview, int]:
    """Read verified bytes of a chunk: (header, bytes, crc32c of those bytes).

    A whole read is checked against the whole-chunk CRC; a ranged read reads and checks
    only the segments it overlaps. Either way, bytes that fail raise ChunkCorrupt and are
    never returned. The bytes are a view of one buffer read straight from the file, made by
    ``alloc``, which may give more than it was asked for (the daemon's allocator charges
    it to a memory budget and reuses buffers).
    """
    path = chunk_path(data_dir, chunk_id)
    fd = _open(path)
    try:
        st = os.fstat(fd)
        try:
            result = None
            if offset == 0 and (length is None or length in lengths_from_file_size(st.st_size)):
                result = _read_whole_direct(fd, st, alloc, chunk_id)
                if result is not None and length not in (None, result[0].length):
                    # The size fits both formats and the header says it is the other one:
                    # this is a ranged read after all (or past the end), done buffered.
                    _set_direct(fd, False)
                    result = None
            if result is None:
                result = _read_open_chunk(fd, st.st_size, chunk_id, offset, length, alloc)
        except ChunkCorrupt:
            _still_named(path, st)  # bad bytes of a file that is no longer this chunk's
            raise
        _still_named(path, st)
        return result
    finally:
        os.close(fd)


def _read_open_chunk(
    fd: int,
    size: int,
    chunk_id: str,
    offset: int,
    length: int | None,
    alloc: Callable[[int], Buffer],
) -> tuple[ChunkHeader, memoryview, int]:
    header = _read_header_fd(fd, chunk_id, size)
    if offset > header.length:
        raise InvalidArgument(f"offset {offset} past the end of chunk {chunk_id} ({header.length})")
    if length is None:
        length = header.length - offset
    if offset + length > header.length:
        raise InvalidArgument(
            f"range {offset}+{length} past the end of chunk {chunk_id} ({header.length})"
        )
    if offset == 0 and length == header.length:
        buf = memoryview(alloc(length))[:length]
        _pread_into(fd, buf, header.data_offset, chunk_id)
        crc = crc32c(buf)
        if crc != header.checksum:
            raise ChunkCorrupt(f"chunk {chunk_id} failed its checksum")
        return header, buf, crc
    seg = header.segment_size
    first = offset // seg
    last = segment_count(offset + length, seg) if length else first
    start = first * seg
    span = min(last * seg, header.length) - start
    buf = memoryview(alloc(span))[:span]
    _pread_into(fd, buf, header.data_offset + start, chunk_id)
    for i in range(first, last):
        lo = i * seg - start
        if crc32c(buf[lo : lo + seg]) != header.segment_crcs[i]:
            raise ChunkCorrupt(f"chunk {chunk_id} failed its checksum in segment {i}")
    out = buf[offset - start : offset - start + length]
    return header, out, crc32c(out)


def verify_chunk(path: Path) -> bool:
    """True if the chunk file at ``path`` is whole: header, every segment and the chunk CRC.

    The reusable check for scrub. A missing file is ChunkNotFound, not False, and so is a
    file deleted (and perhaps reused) while it was being checked.
    """
    fd = _open(path)
    try:
        st = os.fstat(fd)
        whole = _verify_open_chunk(fd, st.st_size, path.name)
        _still_named(path, st)
        return whole
    finally:
        os.close(fd)


def _verify_open_chunk(fd: int, size: int, name: str) -> bool:
    try:
        header = _read_header_fd(fd, name, size)
    except ChunkCorrupt:
        return False
    buf = memoryview(bytearray(min(header.length, 16 * header.segment_size)))
    pos, whole, i = 0, 0, 0
    while pos < header.length:
        view = buf[: min(len(buf), header.length - pos)]
        try:
            _pread_into(fd, view, header.data_offset + pos, name)
        except ChunkCorrupt:
            return False
        for lo in range(0, len(view), header.segment_size):
            piece = view[lo : lo + header.segment_size]
            crc = crc32c(piece)
            if crc != header.segment_crcs[i]:
                return False
            # Full segments combine from their CRCs (no second pass); the short last one
            # is streamed (a table per odd length would not pay).
            if len(piece) == header.segment_size:
                whole = combine(whole, crc, len(piece))
            else:
                whole = crc32c(piece, whole)
            i += 1
        pos += len(view)
    return whole == header.checksum


# --- listing --------------------------------------------------------------------------------


def list_chunks(data_dir: Path, after: str, limit: int) -> tuple[list[tuple[str, int]], str | None]:
    """Chunk ids greater than ``after`` in order, with their lengths, at most ``limit``.
    ``next`` is the last id returned when more may follow."""
    entries, nxt = list_chunk_entries(data_dir, after, limit)
    return [(name, length) for name, length, _ in entries], nxt


def list_chunk_entries(
    data_dir: Path, after: str, limit: int
) -> tuple[list[tuple[str, int, int]], str | None]:
    """(chunk id, length, checksum) of the chunks after ``after``, as ``list_chunks``; the
    checksum is the header's (-1 when the header is unreadable: scrub will report it).

    Walks the shard directories in order from ``after``'s, so a page costs a directory or
    two, not a scan of the whole store, and a 32-byte read per chunk for its header. The
    checksum lets the inventory tell a chunk from another chunk's file copied over it, which
    every check of the file alone passes.
    """
    root = chunks_root(data_dir)
    try:
        shards = sorted(d for d in os.listdir(root) if len(d) == 2 and d >= after[:2])
    except FileNotFoundError:
        return [], None
    out: list[tuple[str, int, int]] = []
    for shard in shards:
        try:
            entries = sorted(
                (e.name, e) for e in os.scandir(root / shard) if e.name > after and is_chunk(e.name)
            )
        except FileNotFoundError:
            continue
        for name, entry in entries:
            try:
                length, crc = _listed_header(Path(entry.path))
            except FileNotFoundError:
                continue
            out.append((name, length, crc))
            if len(out) >= limit:
                return out, name
    return out, None


def _listed_header(path: Path) -> tuple[int, int]:
    """A chunk's length and checksum from its header (the file size alone cannot tell the
    version), or an estimate of the length from its size and checksum -1 when the header is
    unreadable (scrub will report it)."""
    try:
        fd = _open(path)
    except ChunkNotFound:
        raise FileNotFoundError(path) from None
    try:
        head = os.pread(fd, HEADER.size, 0)
        if len(head) == HEADER.size:
            version, magic, length, crc = struct.unpack_from("!H6sQI", head)
            if version in VERSIONS and magic == MAGIC:
                return int(length), int(crc)
        return length_from_file_size(os.fstat(fd).st_size), -1
    finally:
        os.close(fd)


def is_chunk(name: str) -> bool:
    try:
        validate_chunk_id(name)
    except InvalidArgument:
        return False
    return True
