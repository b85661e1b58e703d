"""The on-disk format of one chunk, and the durable, atomic ways to write, read and check it.

A chunk file holds a small header, a table of per-segment CRCs, then the chunk's bytes.
Integers are big-endian; the version field comes first so a later format can be told apart
by reading two bytes::

    offset    size  field
    0         2     version        1 (packed) or 2 (aligned)
    2         6     magic          b"TCHUNK"
    8         8     length         L, bytes of chunk data
    16        4     checksum       crc32c of the whole chunk (what the client sent and the
                                   Block layer records)
    20        4     segment_size   S (65536)
    24        4     segments       N = ceil(L / S)
    28        4     header_crc     crc32c of bytes 0..27 followed by the segment table
    32        4*N   segment table  crc32c of each S-byte segment (the last may be shorter)
    32+4N     P     padding        zeros: none in version 1; up to the next multiple of
                                   4096 in version 2
    D         L     data           D = 32+4N+P (the data offset)

Version 2 is written for chunks whose length is a multiple of 4096 (every full chunk of a
block): the file is then a whole number of 4 KiB blocks, so a put writes it with one
O_DIRECT write and no ``ftruncate``, whose cut inside the last block made ext4 read that
block back from disk (a synchronous read per put) and dirty it for the fsync to write
again; it takes the same number of disk blocks as version 1. Other lengths get version 1.
Readers take both; the padding must be zeros.

Why segments: a ranged get of 4 KiB must not read and checksum a whole 4 MiB chunk, yet must
never return unverified bytes; it reads and verifies only the segments it touches. A whole
get checks the whole-chunk CRC in one pass, or, for a large chunk on a store run with
``--splice-gets``, is spliced from the page cache unverified for its reader to check
(``splice_chunk``). The header has its own CRC, so
a flipped bit in the length or the table is reported as corruption rather than misread.

Files live under ``<data_dir>/chunks/<2 hex chars>/<chunk id>`` (the first two characters of
the chunk id, which come from its random block id), so no directory holds millions of
entries, and a listing in chunk-id order can walk the shard directories in order.

Durability protocol of a write: the chunk is written to a file that is not a chunk, either
a spare file (``<data_dir>/spares/``, a deleted chunk's file kept for reuse, see
``chunkstore.spares``) or a new temporary name (``.tmp-...``, never a valid chunk id) in the
chunk's directory; it is made durable (one O_DIRECT ``pwritev2(RWF_DSYNC)`` when the file
is whole blocks and needs no cut, else a write, a cut to size and an fdatasync), renamed to
its final name, and the chunk's directory is fsynced. A crash leaves either no file under
the final name or a complete one; leftover temporary files are removed at startup
(``recover``), spares are kept. A delete unlinks the chunk or renames it into the spares,
then fsyncs its directory. Directory fsyncs are group-committed (``_DirSync``): renames in
one directory while another thread's fsync of it runs share the next one. Readers check
after reading that the chunk's name still names the file they read (``_still_named``),
since a deleted chunk's file may be reused.

CPU: a put arrives in a page-aligned buffer laid out as its own file image (``put_room``:
room for the header in front), one pass over the bytes gives the segment table and the
whole CRC, and the image is written with O_DIRECT, so the bytes are never copied into the
page cache; a whole-chunk get reads the file's image, header and all, with one O_DIRECT
read. Filesystems that refuse O_DIRECT get buffered I/O, the same format and the same
durability protocol. Short system calls that never wait for the disk keep the GIL
(``chunkstore.syscalls``), and so do CRCs of up to about 1 MiB: the worker threads that run
these functions share the GIL with the daemon's event loop, and every hand-off costs both.

All functions here do blocking disk I/O and are meant to run in ``trio.to_thread.run_sync``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import secrets
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from chunkstore import syscalls
from tectonic_py.core.checksum import KEEP_GIL_MAX, combine, segment_checksums
from tectonic_py.core.checksum import checksum as crc32c
from tectonic_py.core.errors import (
    ChecksumMismatch,
    ChunkConflict,
    ChunkCorrupt,
    ChunkNotFound,
    DiskFull,
    InvalidArgument,
)
from tectonic_py.core.ids import parse_chunk_id

log = logging.getLogger(__name__)

VERSION_PACKED = 1
VERSION_ALIGNED = 2
VERSIONS = (VERSION_PACKED, VERSION_ALIGNED)
MAGIC = b"TCHUNK"
SEGMENT_SIZE = 64 * 1024
HEADER = struct.Struct("!H6sQIIII")
HEADER_CRC_OFFSET = 28
TMP_PREFIX = ".tmp-"
MAX_CHUNK_ID_LEN = 24
_NOSPACE = (errno.ENOSPC, errno.EDQUOT)
DIRECT_ALIGN = 4096  # O_DIRECT alignment of memory, file offsets and lengths
DIRECT_MIN = 64 * 1024  # smaller chunks are read buffered (not worth a page-aligned buffer)
Buffer = bytes | bytearray | memoryview | mmap.mmap
T = TypeVar("T")


@dataclass(frozen=True)
class ChunkHeader:
    """The parsed, CRC-checked header of a chunk file."""

    length: int
    checksum: int
    segment_size: int
    segment_crcs: tuple[int, ...]
    version: int = VERSION_PACKED

    @property
    def data_offset(self) -> int:
        return _data_offset(self.version, len(self.segment_crcs))

    @property
    def file_size(self) -> int:
        return self.data_offset + self.length


def direct_span(nbytes: int) -> int:
    """``nbytes`` rounded up to whole O_DIRECT blocks: the buffer a whole-file O_DIRECT
    read of a file of that size needs, or the image a put writes."""
    return -(-nbytes // DIRECT_ALIGN) * DIRECT_ALIGN


def _data_offset(version: int, nseg: int) -> int:
    table_end = HEADER.size + 4 * nseg
    if version == VERSION_ALIGNED:
        return direct_span(table_end)
    return table_end


def segment_count(length: int, segment_size: int = SEGMENT_SIZE) -> int:
    return -(-length // segment_size)


def version_for(length: int) -> int:
    """The format a chunk of ``length`` bytes is written in (module docstring)."""
    return VERSION_ALIGNED if length and length % DIRECT_ALIGN == 0 else VERSION_PACKED


def data_offset_for(length: int) -> int:
    return _data_offset(version_for(length), segment_count(length))


def file_size_for(length: int) -> int:
    """Bytes a chunk of ``length`` bytes takes on disk (before filesystem rounding)."""
    return data_offset_for(length) + length


def length_from_file_size(size: int) -> int:
    """The length of a version-1 chunk file of ``size`` bytes (a listing's estimate for a
    file whose header cannot be read).

    With n segments the file holds 32 + 4n + L bytes, L in ((n-1)S, nS], so
    n = ceil((size - 32) / (S + 4)) exactly.
    """
    body = max(size - HEADER.size, 0)
    n = -(-body // (SEGMENT_SIZE + 4))
    return max(body - 4 * n, 0)


def lengths_from_file_size(size: int) -> tuple[int, ...]:
    """Every chunk length a file of ``size`` bytes can hold (one per format version that
    fits), so a get can tell from a stat alone whether it asks for the whole chunk.

    Why: the cluster client always sends the length it wants; a check that knew only
    version-1 sizes sent every whole-chunk get of a version-2 chunk down the buffered
    path (a page-cache copy, ~0.7 CPU-s/GiB more on the stores of a restore)."""
    out = [length_from_file_size(size)]
    pad_end = direct_span(HEADER.size + 4)
    # A chunk shorter than the file has no more segments, so no larger data offset, than
    # one as long as the file: a bound of one or two steps, not a walk over the file.
    last = _data_offset(VERSION_ALIGNED, segment_count(size))
    while pad_end <= last and pad_end < size:
        length = size - pad_end
        if version_for(length) == VERSION_ALIGNED and file_size_for(length) == size:
            out.append(length)
            break
        pad_end += DIRECT_ALIGN
    return tuple(out)


def encode_header(
    data: memoryview | bytes | bytearray,
    whole_crc: int,
    segment_crcs: Sequence[int] | None = None,
    version: int | None = None,
) -> bytes:
    """Everything in front of ``data`` in its chunk file (header, segment table, padding:
    ``data_offset_for(len(data))`` bytes), for data whose crc32c the caller already checked.

    ``segment_crcs``: the table, when the caller already has it (``write_chunk`` gets it in
    the same pass that checks the whole CRC); computed here otherwise. ``version``: the
    format (``version_for`` the length if None).
    """
    view = memoryview(data).cast("B")
    length = len(view)
    if segment_crcs is None:
        crcs = list(segment_checksums(view, SEGMENT_SIZE)[0])
    else:
        crcs = list(segment_crcs)
        if len(crcs) != segment_count(length):
            raise InvalidArgument(f"{len(crcs)} segment CRCs for {length} bytes")
    if version is None:
        version = version_for(length)
    table = struct.pack(f"!{len(crcs)}I", *crcs)
    head = HEADER.pack(version, MAGIC, length, whole_crc, SEGMENT_SIZE, len(crcs), 0)
    hcrc = crc32c(table, crc32c(head[:HEADER_CRC_OFFSET]))
    prefix = head[:HEADER_CRC_OFFSET] + struct.pack("!I", hcrc) + table
    return prefix + bytes(_data_offset(version, len(crcs)) - len(prefix))


def decode_header(buf: bytes, file_size: int | None = None) -> ChunkHeader:
    """Parse and check a header; ``buf`` must start at offset 0 and hold everything up to
    the data (``header_bytes_needed``).

    Raises ChunkCorrupt for anything that is not a well-formed version-1 or 2 header.
    """
    if len(buf) < HEADER.size:
        raise ChunkCorrupt("chunk file shorter than its header")
    version, magic, length, whole, seg_size, nseg, hcrc = HEADER.unpack_from(buf)
    if version not in VERSIONS or magic != MAGIC:
        raise ChunkCorrupt(f"not a chunk file (version {version}, magic {magic!r})")
    if seg_size != SEGMENT_SIZE or nseg != segment_count(length, seg_size):
        raise ChunkCorrupt("chunk header has an inconsistent segment table")
    end = HEADER.size + 4 * nseg
    if len(buf) < end:
        raise ChunkCorrupt("chunk file shorter than its segment table")
    table = buf[HEADER.size : end]
    if crc32c(table, crc32c(buf[:HEADER_CRC_OFFSET])) != hcrc:
        raise ChunkCorrupt("chunk header failed its checksum")
    header = ChunkHeader(length, whole, seg_size, struct.unpack(f"!{nseg}I", table), version)
    data_offset = header.data_offset
    if data_offset > end:
        if len(buf) < data_offset:
            raise ChunkCorrupt("chunk file shorter than its header's padding")
        if buf[end:data_offset] != _ZEROS[: data_offset - end]:
            raise ChunkCorrupt("chunk header padding is not zeros")
    if file_size is not None and file_size != header.file_size:
        raise ChunkCorrupt(f"chunk file is {file_size} bytes, header says {header.file_size}")
    return header


def header_bytes_needed(prefix: bytes | memoryview) -> int:
    """How many bytes from offset 0 ``decode_header`` needs, from the first 32 (or fewer,
    then 32: the caller finds the file too short)."""
    if len(prefix) < HEADER.size:
        return HEADER.size
    version, nseg = struct.unpack_from("!H", prefix)[0], struct.unpack_from("!I", prefix, 24)[0]
    return _data_offset(version if version in VERSIONS else VERSION_PACKED, nseg)


_ZEROS = bytes(2 * DIRECT_ALIGN)


# --- paths ----------------------------------------------------------------------------------


def validate_chunk_id(chunk_id: object) -> str:
    """Return ``chunk_id`` if it is exactly a chunk id, else InvalidArgument.

    Only ``<16 hex>.<index>`` passes (tectonic_py.core.ids), so no id can hold '/', '..', NUL or
    an absolute path, and none can name a temporary file.
    """
    if not isinstance(chunk_id, str) or len(chunk_id) > MAX_CHUNK_ID_LEN:
        raise InvalidArgument("invalid chunk id")
    try:
        parse_chunk_id(chunk_id)
    except ValueError as e:
        raise InvalidArgument(str(e)) from None
    return chunk_id


def chunks_root(data_dir: Path) -> Path:
    return data_dir / "chunks"


def shard_dir(data_dir: Path, chunk_id: str) -> Path:
    return chunks_root(data_dir) / chunk_id[:2]


def chunk_path(data_dir: Path, chunk_id: str) -> Path:
    """The file of a (validated) chunk id; checked again to lie inside the data directory."""
    path = shard_dir(data_dir, validate_chunk_id(chunk_id)) / chunk_id
    if path.parent.parent != chunks_root(data_dir):
        raise InvalidArgument("invalid chunk id")
    return path


def _fsync_dir(path: Path) -> None:
    fd = syscalls.open_existing(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        syscalls.close(fd)


class _DirSync:
    """Group commit of directory fsyncs: a rename is durable once an fsync of its directory
    *started after it* has finished, so puts (and deletes) that renamed in one directory
    while another thread's fsync of it ran share the next fsync instead of each waiting
    for its own (a directory fsync is a synchronous write and cache flush, about 1 ms on
    the project's disk under load). One thread syncs a directory at a time; the others wait
    for it. A failed fsync covers nobody: each waiter then tries its own and sees its error.

    Each directory has its own condition: puts spread over 256 shard directories, and one
    condition for all made every fsync wake every waiting thread, each to take the GIL and
    go back to sleep.
    """

    class _State:
        __slots__ = ("changed", "done", "requested", "running")

        def __init__(self, lock: threading.Lock) -> None:
            self.requested = 0  # renames announced
            self.done = 0  # renames known durable
            self.running = False
            self.changed = threading.Condition(lock)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dirs: dict[str, _DirSync._State] = {}

    def sync(self, path: Path) -> None:
        """Make every rename done in ``path`` before this call durable."""
        key = str(path)
        with self._lock:
            state = self._dirs.get(key)
            if state is None:
                state = self._dirs[key] = _DirSync._State(self._lock)
            state.requested += 1
            mine = state.requested
            while True:
                if state.done >= mine:
                    return
                if not state.running:
                    state.running = True
                    target = state.requested
                    break
                state.changed.wait()
        ok = False
        try:
            _fsync_dir(path)
            ok = True
        finally:
            with self._lock:
                state.running = False
                if ok:
                    state.done = max(state.done, target)
                state.changed.notify_all()


_dir_sync = _DirSync()


# --- write ----------------------------------------------------------------------------------


def put_room(length: int) -> tuple[int, int]:
    """Where a received payload of ``length`` bytes should sit in a page-aligned buffer so
    that the buffer is already the chunk file's image: (offset of the data = header size,
    buffer size = file size rounded up to ``DIRECT_ALIGN``). The RPC server receives a put
    into such a buffer (``rpc_server.RpcServer(payload_room=...)``) and ``write_chunk`` writes
    it with O_DIRECT, so the bytes never pass through the page cache."""
    offset = data_offset_for(length)
    return offset, direct_span(offset + length)


def _same_memory(a: memoryview, b: memoryview) -> bool:
    """True if the two (non-empty, writable) views start at the same address."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a)) == ctypes.addressof(
            ctypes.c_char.from_buffer(b)
        )
    except (TypeError, ValueError):
        return False


# Devices (st_dev) where O_DIRECT was refused (EINVAL: e.g. an older tmpfs): buffered there.
_no_direct: set[int] = set()
# The device of each data directory, looked up once: a put should not pay a stat for it.
_devices: dict[Path, int] = {}


def _device(data_dir: Path) -> int:
    dev = _devices.get(data_dir)
    if dev is None:
        dev = _devices[data_dir] = os.stat(data_dir).st_dev
    return dev


def _open_target(target: Path, flags: int, create: bool) -> int:
    """Open the file a put writes: a new temporary file, or an existing spare (no
    O_CREAT, and no O_TRUNC either: the write and the ``ftruncate`` after it replace the
    contents, and the spare's blocks stay allocated for the write to reuse)."""
    flags |= os.O_WRONLY | os.O_CLOEXEC
    if create:
        return os.open(target, flags | os.O_CREAT | os.O_EXCL, 0o644)
    return syscalls.open_existing(target, flags)


def _write_direct(
    target: Path, image: memoryview, size: int, create: bool, dev: int, old_size: int | None
) -> bool:
    """Write ``image`` (page aligned, a multiple of DIRECT_ALIGN) to ``target`` with
    O_DIRECT, cut it to ``size`` bytes if needed and fdatasync it. False (and the file as it
    was) if the filesystem refuses O_DIRECT; OSError for real failures (ENOSPC).
    ``old_size``: the target's size before (0 for a new file; None if unknown).

    Why: a buffered write copies every byte into the page cache, the largest single CPU
    cost of a put (a chunk is not read again soon: it is a checkpoint's). fsync is still
    needed for the file's size and extents and the device's write cache.
    """
    if dev in _no_direct:
        return False
    try:
        fd = _open_target(target, os.O_DIRECT, create)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        _no_direct.add(dev)
        log.info("%s: no O_DIRECT on this filesystem; chunk writes are buffered", target.parent)
        if create:  # the kernel may have made the file before refusing the flag
            remove_quietly(target)
        return False
    global _dsync_writes
    cut = size != len(image) or old_size is None or old_size > size
    try:
        try:
            if cut or not _dsync_writes:
                _write_all(fd, [image])
                synced = False
            else:
                # Durable when it returns (RWF_DSYNC: an fdatasync of the range within the
                # same call): one system call that waits for the disk instead of two, and so
                # one hand-off of the GIL fewer per put.
                _pwrite_all(fd, image, os.RWF_DSYNC)
                synced = True
        except OSError as e:
            if e.errno == errno.EOPNOTSUPP and not cut and _dsync_writes:
                _dsync_writes = False  # an older kernel: write, then fdatasync
                _write_all(fd, [image])
                synced = False
            elif e.errno != errno.EINVAL:
                raise
            else:
                _no_direct.add(dev)
                log.info("%s: O_DIRECT write refused; chunk writes are buffered", target.parent)
                if create:
                    remove_quietly(target)
                return False
        if cut:
            # Not a GIL-keeping call: cutting inside the last block makes ext4 read that
            # block from disk to zero its tail (the O_DIRECT write left it out of the cache).
            os.ftruncate(fd, size)
        if not synced:
            # The data and what finds it (size, block map); a timestamp alone is not worth
            # a write of the inode per put.
            os.fdatasync(fd)
    finally:
        syscalls.close(fd)
    return True


# pwritev2(RWF_DSYNC) works (Linux 4.7+); cleared the first time the kernel says otherwise.
_dsync_writes = hasattr(os, "RWF_DSYNC")


def _pwrite_all(fd: int, view: memoryview, flags: int) -> None:
    offset = 0
    while offset < len(view):
        offset += os.pwritev(fd, [view[offset:]], offset, flags)


class Stored(NamedTuple):
    """What ``write_chunk`` changed on disk."""

    added_bytes: int  # file bytes added (the file's size, less a replaced file's)
    added_chunks: int  # 1 for a new chunk id, 0 for a no-op or a replaced corrupt file
    spare_used: bool  # the spare was written and renamed (False: it was not touched)


def write_chunk(
    data_dir: Path,
    chunk_id: str,
    data: memoryview | bytes | bytearray,
    checksum: int,
    image: memoryview | None = None,
    spare: Path | None = None,
    spare_size: int | None = None,
) -> Stored:
    """Store a chunk durably and atomically.

    ``image``: optionally, a page-aligned buffer laid out by ``put_room`` whose bytes from
    the header size on are ``data``; the header is written into its front and the whole
    is written with O_DIRECT (buffered when the filesystem refuses it).

    ``spare``: optionally, an existing file (``chunkstore.spares``) to write the chunk into
    instead of creating a temporary file; it is overwritten, cut to size if it was longer,
    fsynced and renamed to the chunk's name (``spare_size``: its size, if known). If this
    raises, the spare has been removed (whatever state it was left in, it must not be reused
    blindly); if it returns, ``spare_used`` says whether it was renamed (False: the chunk was
    already stored, the spare untouched).

    Checks the payload against ``checksum`` first (ChecksumMismatch: the bytes were damaged
    on the way). The same chunk again is a no-op (0, 0); different contents under the same id
    raise ChunkConflict. An existing file that fails its own checks is replaced, so a retried
    put heals a chunk damaged on disk. A full disk raises DiskFull and leaves no temporary
    file. The caller serialises writes of one chunk id.
    """
    try:
        return _write_chunk(data_dir, chunk_id, data, checksum, image, spare, spare_size)
    except BaseException:
        if spare is not None:
            remove_quietly(spare)
        raise


def _write_chunk(
    data_dir: Path,
    chunk_id: str,
    data: memoryview | bytes | bytearray,
    checksum: int,
    image: memoryview | None,
    spare: Path | None,
    spare_size: int | None,
) -> Stored:
    view = memoryview(data).cast("B")
    # One pass gives the segment table and the whole CRC (checksum.segment_checksums).
    segment_crcs, whole = segment_checksums(view, SEGMENT_SIZE, keep_gil=True)
    if whole != checksum:
        raise ChecksumMismatch(
            f"chunk {chunk_id}: payload crc32c {whole:08x} != sent checksum {checksum:08x}"
        )
    path = chunk_path(data_dir, chunk_id)
    old_size: int | None = None
    if syscalls.exists(path):  # (the common answer, no, without a stat or a GIL round trip)
        try:
            old_size = os.stat(path).st_size
        except FileNotFoundError:
            pass
    existing: ChunkHeader | None = None
    if old_size is not None:
        try:
            existing = read_header(path)
        except ChunkNotFound:
            old_size = None
        except ChunkCorrupt as e:
            log.warning(
                "chunk %s on disk is corrupt (%s); replacing it with the new put", chunk_id, e
            )
    if existing is not None:
        if existing.length != len(view) or existing.checksum != whole:
            raise ChunkConflict(
                f"chunk {chunk_id} exists with length {existing.length}"
                f" crc {existing.checksum:08x},"
                f" put has length {len(view)} crc {whole:08x}"
            )
        if verify_chunk(path):
            # The same put again: perhaps the retry of one whose daemon was killed between
            # its rename and the directory fsync, so the name may not be durable yet.
            _dir_sync.sync(path.parent)
            return Stored(0, 0, False)
        log.warning("chunk %s on disk fails its checksum; replacing it with the new put", chunk_id)
    header = encode_header(view, whole, segment_crcs)
    directory = path.parent
    if spare is not None:
        target = spare
    else:
        target = directory / f"{TMP_PREFIX}{chunk_id}-{secrets.token_hex(4)}"
    size = len(header) + len(view)
    if image is not None:
        image = memoryview(image).cast("B")
        if (len(header), len(image)) != put_room(len(view)) or not _same_memory(
            image[len(header) : size], view
        ):
            image = None
        else:
            image[: len(header)] = header
            image[size:] = bytes(len(image) - size)  # no stale bytes past the end on disk
    create = spare is None
    before = 0 if create else spare_size
    try:
        # (A new file can fail for want of its shard directory; a spare, not.)
        dev = _device(data_dir)
        direct = image is not None and _in_shard_dir(
            directory, lambda: create, _write_direct, target, image, size, create, dev, before
        )
        if not direct:
            fd = _in_shard_dir(directory, lambda: create, _open_target, target, 0, create)
            try:
                _write_all(fd, [header, view])
                os.ftruncate(fd, size)  # a spare may have been longer
                os.fdatasync(fd)
            finally:
                syscalls.close(fd)
        _in_shard_dir(directory, target.exists, syscalls.rename, target, path)
        _dir_sync.sync(directory)
    except OSError as e:
        remove_quietly(target)
        if e.errno in _NOSPACE:
            raise DiskFull(f"no space on disk for chunk {chunk_id} ({len(view)} bytes)") from None
        raise
    return Stored(size - (old_size or 0), 1 if old_size is None else 0, spare is not None)


def _in_shard_dir(
    directory: Path, dir_may_be_missing: Callable[[], bool], fn: Callable[..., T], *args: Any
) -> T:
    """``fn(*args)``, made once more after recreating the chunk's shard directory when it
    raised FileNotFoundError and ``dir_may_be_missing()`` says the directory can be why
    (``recover`` makes them all; this heals one removed while the store runs)."""
    try:
        return fn(*args)
    except FileNotFoundError:
        if not dir_may_be_missing():
            raise
        _heal_shard_dir(directory)
        return fn(*args)


def _heal_shard_dir(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    _fsync_dir(directory.parent)


def _write_all(fd: int, pieces: list[memoryview | bytes]) -> None:
    views = [memoryview(p).cast("B") for p in pieces]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def remove_quietly(path: Path) -> None:
    """Unlink ``path``; already gone is fine, any other failure is logged, never raised
    (cleanup of temporary and spare files must not fail the operation it follows)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("could not remove %s: %s", path, e)


def delete_chunk(data_dir: Path, chunk_id: str, spare: Path | None = None) -> int | None:
    """Remove a chunk durably; its file size if it existed, else None.

    ``spare``: a new name in the spares directory (``chunkstore.spares``) to rename the
    chunk's file to instead of unlinking it, so that a later put reuses the inode and its
    blocks. Either way the chunk's name is gone, durably, when this returns.
    """
    path = chunk_path(data_dir, chunk_id)
    try:
        size = os.stat(path).st_size
        if spare is None:
            os.unlink(path)
        else:
            try:
                syscalls.rename(path, spare)
            except FileNotFoundError:
                if not os.path.exists(path):
                    raise
                spare.parent.mkdir(parents=True, exist_ok=True)  # heal a removed spares dir
                syscalls.rename(path, spare)
    except FileNotFoundError:
        # Already gone: perhaps the retry of a delete whose daemon was killed between the
        # unlink or rename and the directory fsync, so the removal may not be durable yet
        # (the twin of a repeated put in ``_write_chunk``).
        try:
            _dir_sync.sync(path.parent)
        except FileNotFoundError:  # no shard directory: the chunk was never there
            pass
        return None
    _dir_sync.sync(path.parent)
    return size


# --- read and verify ------------------------------------------------------------------------


def _open(path: Path) -> int:
    try:
        return syscalls.open_existing(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ChunkNotFound(f"no chunk {path.name}") from None


def _read_header_fd(fd: int, name: str, size: int | None = None) -> ChunkHeader:
    if size is None:
        size = syscalls.fstat(fd).size
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


def stat_chunk(path: Path) -> tuple[ChunkHeader, syscalls.Stat]:
    """The header of the chunk file at ``path`` and the file's stat."""
    fd = _open(path)
    try:
        st = syscalls.fstat(fd)
        try:
            header = _read_header_fd(fd, path.name, st.size)
        except ChunkCorrupt:
            _still_named(path, st)
            raise
        _still_named(path, st)
        return header, st
    finally:
        syscalls.close(fd)


def _still_named(path: Path, st: syscalls.Stat) -> None:
    """ChunkNotFound unless ``path`` still names the file ``st`` describes, unchanged.

    Why: a delete may rename a chunk's file into the spares (``chunkstore.spares``) while a
    reader has it open, and a put may then overwrite it with another chunk, header and all,
    whose bytes would pass every check. So a reader checks, after reading, that the chunk's
    name still leads to the same inode with the same ctime (a rename or a write changes it);
    then what it read was this chunk's file all along.
    """
    try:
        now = syscalls.stat(path)
    except FileNotFoundError:
        raise ChunkNotFound(f"chunk {path.name} was deleted while being read") from None
    if (now.ino, now.dev, now.ctime_ns) != (st.ino, st.dev, st.ctime_ns):
        raise ChunkNotFound(f"chunk {path.name} was deleted or replaced while being read")


def _pread_into(fd: int, view: memoryview, offset: int, name: str) -> None:
    while view:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise ChunkCorrupt(f"chunk {name}: file ends early")
        view = view[n:]
        offset += n


def _aligned(view: memoryview) -> bool:
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view)) % DIRECT_ALIGN == 0
    except (TypeError, ValueError):
        return False


def _read_whole_direct(
    fd: int, st: syscalls.Stat, alloc: Callable[[int], Buffer], name: str
) -> tuple[ChunkHeader, memoryview, int] | None:
    """A whole chunk read, header and all, by one O_DIRECT read of its file into a
    page-aligned buffer from ``alloc``: (header, data (a view of the buffer), crc). None
    where the chunk is small, the buffer is not aligned or the filesystem refuses O_DIRECT
    (the caller reads buffered); the fd is as it was then.

    Why: a buffered read copies the whole chunk out of the page cache, a third of a get's
    CPU, and a restore reads each chunk once. Reading the header from the same buffer
    leaves one system call that waits for the disk, the only one that releases the GIL.
    The kernel writes back any dirty pages of the range first, so a file written buffered
    reads the same.
    """
    size = st.size
    if size < HEADER.size + DIRECT_MIN or st.dev in _no_direct:
        return None
    span = direct_span(size)
    buf = memoryview(alloc(span))[:span]
    if not _aligned(buf):
        return None
    try:
        syscalls.set_direct(fd, True)
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
        _no_direct.add(st.dev)
        log.info("no O_DIRECT reads on device %d; chunk reads are buffered", st.dev)
        syscalls.set_direct(fd, False)
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
        st = syscalls.fstat(fd)
        try:
            result = None
            if offset == 0 and (length is None or length in lengths_from_file_size(st.size)):
                result = _read_whole_direct(fd, st, alloc, chunk_id)
                if result is not None and length not in (None, result[0].length):
                    # The size fits both formats and the header says it is the other one:
                    # this is a ranged read after all (or past the end), done buffered.
                    syscalls.set_direct(fd, False)
                    result = None
            if result is None:
                result = _read_open_chunk(fd, st.size, chunk_id, offset, length, alloc)
        except ChunkCorrupt:
            _still_named(path, st)  # bad bytes of a file that is no longer this chunk's
            raise
        _still_named(path, st)
        return result
    finally:
        syscalls.close(fd)


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


# A whole get of a chunk at least this large is spliced (``splice_chunk``); smaller ones cost
# more in pipes and system calls than the copy and the CRC they save.
SPLICE_MIN = 256 * 1024
# Bytes per pipe: Linux's default ``fs.pipe-max-size``, the most a process may ask for
# without privileges (a 4 MiB chunk takes four pipes).
PIPE_BYTES = 1 << 20
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


class Spliced(NamedTuple):
    """A whole chunk's bytes held in pipes by reference: (read end, bytes in it) in order."""

    header: ChunkHeader
    pipes: list[tuple[int, int]]


def splice_chunk(data_dir: Path, chunk_id: str, length: int | None, limit: int) -> Spliced | None:
    """Move a whole chunk's bytes into pipes without copying them (``splice(2)`` from the page
    cache), for the daemon to splice on into the client's socket; its header is checked, its
    bytes are not. None where the chunk is smaller than SPLICE_MIN or larger than ``limit``
    (the reply budget the caller holds), ``length`` is not the chunk's, or the kernel will
    not give pipes of that size: the caller then reads it verified (``read_chunk``).

    Why unverified: a get's reader checks the bytes against ``header.checksum`` anyway (the
    checksum the put was checked against, end to end), and asks again for a verified read
    when they fail (``ChunkClient.get``), which tells corruption on disk (ChunkCorrupt) from
    damage in transit. Not checking them here leaves the daemon neither the CRC nor the copy
    into and out of a buffer: against one store on 2 cores, 1 MiB gets ran 14-24% faster and
    4 MiB ones 31%, at 10-25% less CPU per byte. But every get then fills new page-cache
    pages for its reader to copy out of, and on a VM whose host backs new guest memory
    slowly that copy made a 9-store cluster's reads 9-33% slower in some runs (20-52%
    faster in others; docs/operations.md), where O_DIRECT into reused buffers never pays
    it: so the store does this only with ``--splice-gets``. The chunk's file is checked to
    still be this chunk's after the splice (``_still_named``), so a delete racing the read
    is ChunkNotFound as usual.
    """
    path = chunk_path(data_dir, chunk_id)
    fd = _open(path)
    pipes: list[tuple[int, int]] = []
    try:
        st = syscalls.fstat(fd)
        if st.size < SPLICE_MIN:
            return None
        header = _read_header_fd(fd, chunk_id, st.size)
        if header.length > limit or length not in (None, header.length):
            return None
        pos, end = header.data_offset, header.file_size
        while pos < end:
            # A pipe holds page-sized slots, one per page a piece touches: the first piece
            # (the data follows the header) ends on a page boundary, the others start on one.
            skew = pos % mmap.PAGESIZE
            piece = min(end - pos, PIPE_BYTES - skew)
            r, w = os.pipe2(os.O_CLOEXEC)
            pipes.append((r, piece))
            try:
                try:
                    fcntl.fcntl(w, _F_SETPIPE_SZ, skew + piece)
                except OSError as e:  # the user's pipe budget (fs.pipe-user-pages-soft) is spent
                    if e.errno not in (errno.EPERM, errno.ENOMEM, errno.EBUSY):
                        raise
                    return None
                stop = pos + piece
                while pos < stop:
                    try:  # (the disk may block it, a full pipe never does)
                        n = os.splice(fd, w, stop - pos, offset_src=pos, flags=os.SPLICE_F_NONBLOCK)
                    except BlockingIOError:  # more slots taken than pages: not expected
                        return None
                    except OSError as e:  # a filesystem that cannot splice
                        if e.errno != errno.EINVAL:
                            raise
                        return None
                    if n == 0:
                        raise ChunkCorrupt(f"chunk {chunk_id}: file ends early")
                    pos += n
            finally:
                os.close(w)
        _still_named(path, st)
        spliced, pipes = Spliced(header, pipes), []
        return spliced
    finally:
        syscalls.close(fd)
        for r, _ in pipes:
            os.close(r)


def verify_chunk(path: Path) -> bool:
    """True if the chunk file at ``path`` is whole: header, every segment and the chunk CRC.

    The reusable check for scrub. A missing file is ChunkNotFound, not False, and so is a
    file deleted (and perhaps reused) while it was being checked.
    """
    fd = _open(path)
    try:
        st = syscalls.fstat(fd)
        whole = _verify_open_chunk(fd, st.size, path.name)
        _still_named(path, st)
        return whole
    finally:
        syscalls.close(fd)


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


# --- listing and recovery -------------------------------------------------------------------


def list_chunks(data_dir: Path, after: str, limit: int) -> tuple[list[tuple[str, int]], str | None]:
    """Chunk ids greater than ``after`` in order, with their lengths, at most ``limit``.

    Walks the shard directories in order from ``after``'s, so a page costs a directory or
    two, not a scan of the whole store, and a 32-byte read per chunk for its length.
    ``next`` is the last id returned when more may follow.
    """
    root = chunks_root(data_dir)
    try:
        shards = sorted(d for d in os.listdir(root) if len(d) == 2 and d >= after[:2])
    except FileNotFoundError:
        return [], None
    out: list[tuple[str, int]] = []
    for shard in shards:
        try:
            entries = sorted(
                (e.name, e)
                for e in os.scandir(root / shard)
                if e.name > after and _is_chunk(e.name)
            )
        except FileNotFoundError:
            continue
        for name, entry in entries:
            try:
                length = _listed_length(Path(entry.path))
            except FileNotFoundError:
                continue
            out.append((name, length))
            if len(out) >= limit:
                return out, name
    return out, None


def _listed_length(path: Path) -> int:
    """A chunk's length from its header (the file size alone cannot tell the version), or
    an estimate from its size when the header is unreadable (scrub will report it)."""
    try:
        fd = _open(path)
    except ChunkNotFound:
        raise FileNotFoundError(path) from None
    try:
        head = os.pread(fd, HEADER.size, 0)
        if len(head) == HEADER.size:
            version, magic, length = struct.unpack_from("!H6sQ", head)
            if version in VERSIONS and magic == MAGIC:
                return int(length)
        return length_from_file_size(syscalls.fstat(fd).size)
    finally:
        syscalls.close(fd)


def _is_chunk(name: str) -> bool:
    try:
        validate_chunk_id(name)
    except InvalidArgument:
        return False
    return True


@dataclass
class ScanResult:
    chunk_count: int
    used_bytes: int
    temp_files_removed: int


def recover(data_dir: Path) -> ScanResult:
    """Startup pass: remove temporary files a crash left behind and count what is stored.

    A scan of directory entries with one stat each; fast enough for the chunk counts of one
    node (a persisted index would have to be kept crash-consistent itself).
    """
    root = chunks_root(data_dir)
    root.mkdir(parents=True, exist_ok=True)
    # Every shard directory exists (and is durable) before the first put, so a put never
    # has to make one durable too.
    missing = [root / f"{i:02x}" for i in range(256) if not (root / f"{i:02x}").is_dir()]
    for d in missing:
        d.mkdir(exist_ok=True)
    if missing:
        _fsync_dir(root)
        _fsync_dir(data_dir)
    count = used = removed = 0
    for shard in os.scandir(root):
        if not shard.is_dir(follow_symlinks=False):
            continue
        dirty = False
        for entry in os.scandir(shard.path):
            if entry.name.startswith(TMP_PREFIX):
                remove_quietly(Path(entry.path))
                removed += 1
                dirty = True
            elif _is_chunk(entry.name) and entry.is_file(follow_symlinks=False):
                count += 1
                used += entry.stat().st_size
        if dirty:
            _fsync_dir(Path(shard.path))
    if removed:
        log.info("removed %d partial chunk files left by a crash", removed)
    return ScanResult(count, used, removed)
