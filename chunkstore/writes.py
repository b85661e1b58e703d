"""The durable, atomic ways to write and delete a chunk file, and the startup recovery.

Durability protocol of a write: the chunk is written to a file that is not a chunk, a new
temporary name (``.tmp-...``, never a valid chunk id) in the chunk's directory; it is made
durable (one O_DIRECT ``pwritev2(RWF_DSYNC)`` when the file
is whole blocks and needs no cut, else a write, a cut to size and an fdatasync), renamed to
its final name, and the chunk's directory is fsynced. A crash leaves either no file under
the final name or a complete one; leftover temporary files are removed at startup
(``recover``), as is the ``spares/`` directory of older versions (deleted chunks' files
kept for reuse, which paid nothing end to end). A delete unlinks the chunk, then fsyncs its
directory, each put and delete its own fsync (grouping them, tried as
``_DirSync``, showed no gain end to end: docs/decisions/2026-12-03-spares-and-dir-sync.md).

CPU: a put arrives in a page-aligned buffer laid out as its own file image
(``layout.put_room``: room for the header in front), one pass over the bytes gives the
segment table and the whole CRC, and the image is written with O_DIRECT, so the bytes are
never copied into the page cache. Filesystems that refuse O_DIRECT get buffered I/O, the
same format and the same durability protocol.

All functions here do blocking disk I/O and are meant to run in ``trio.to_thread.run_sync``.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from chunkstore.layout import (
    SEGMENT_SIZE,
    TMP_PREFIX,
    chunk_path,
    chunks_root,
    encode_header,
    no_direct,
    put_room,
)
from chunkstore.reads import is_chunk, read_header, verify_chunk
from tectonic_py.core.checksum import segment_checksums, whole_from_table
from tectonic_py.core.errors import (
    ChecksumMismatch,
    ChunkConflict,
    ChunkCorrupt,
    ChunkNotFound,
    DiskFull,
)

log = logging.getLogger(__name__)

_NOSPACE = (errno.ENOSPC, errno.EDQUOT)
OLD_SPARES_DIR, OLD_SPARE_PREFIX = "spares", "spare-"  # ``_remove_old_spares``
T = TypeVar("T")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _same_memory(a: memoryview, b: memoryview) -> bool:
    """True if the two (non-empty, writable) views start at the same address."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a)) == ctypes.addressof(
            ctypes.c_char.from_buffer(b)
        )
    except (TypeError, ValueError):
        return False


# The device of each data directory, looked up once: a put should not pay a stat for it.
_devices: dict[Path, int] = {}


def _device(data_dir: Path) -> int:
    dev = _devices.get(data_dir)
    if dev is None:
        dev = _devices[data_dir] = os.stat(data_dir).st_dev
    return dev


def _open_target(target: Path, flags: int) -> int:
    """Create the new temporary file a put writes."""
    return os.open(target, flags | os.O_WRONLY | os.O_CLOEXEC | os.O_CREAT | os.O_EXCL, 0o644)


def _write_direct(target: Path, image: memoryview, size: int, dev: int) -> bool:
    """Write ``image`` (page aligned, a multiple of DIRECT_ALIGN) to the new file ``target``
    with O_DIRECT, cut it to ``size`` bytes if needed and fdatasync it. False (and no file)
    if the filesystem refuses O_DIRECT; OSError for real failures (ENOSPC).

    Why: a buffered write copies every byte into the page cache, the largest single CPU
    cost of a put (a chunk is not read again soon: it is a checkpoint's). fsync is still
    needed for the file's size and extents and the device's write cache.
    """
    if dev in no_direct:
        return False
    try:
        fd = _open_target(target, os.O_DIRECT)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        no_direct.add(dev)
        log.info("%s: no O_DIRECT on this filesystem; chunk writes are buffered", target.parent)
        remove_quietly(target)  # the kernel may have made the file before refusing the flag
        return False
    global _dsync_writes
    cut = size != len(image)
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
                no_direct.add(dev)
                log.info("%s: O_DIRECT write refused; chunk writes are buffered", target.parent)
                remove_quietly(target)
                return False
        if cut:
            # Cutting inside the last block makes ext4 read that block from disk to zero its
            # tail (the O_DIRECT write left it out of the cache).
            os.ftruncate(fd, size)
        if not synced:
            # The data and what finds it (size, block map); a timestamp alone is not worth
            # a write of the inode per put.
            os.fdatasync(fd)
    finally:
        os.close(fd)
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
    fsync_s: float = 0.0  # seconds the directory fsync took (the metrics' fsync histogram)
    written: bool = True  # False for the same chunk again (nothing written)


def write_chunk(
    data_dir: Path,
    chunk_id: str,
    data: memoryview | bytes | bytearray,
    checksum: int,
    image: memoryview | None = None,
    segment_crcs: list[int] | None = None,
) -> Stored:
    """Store a chunk durably and atomically.

    ``image``: optionally, a page-aligned buffer laid out by ``put_room`` whose bytes from
    the header size on are ``data``; the header is written into its front and the whole
    is written with O_DIRECT (buffered when the filesystem refuses it).

    Checks the payload against ``checksum`` first (ChecksumMismatch: the bytes were damaged
    on the way). ``segment_crcs``: the segment table the writer sent with the payload, in
    the same authenticated frame; it is checked against ``checksum`` without a pass over
    the bytes (``checksum.whole_from_table``), else one pass computes both. The same chunk
    again is a no-op (0, 0); different contents under the same id raise ChunkConflict. An existing file that fails its own checks is replaced, so a retried
    put heals a chunk damaged on disk. A full disk raises DiskFull and leaves no temporary
    file. The caller serialises writes of one chunk id.
    """
    view = memoryview(data).cast("B")
    if segment_crcs is not None:
        carried = whole_from_table(segment_crcs, view)
        if carried is None:
            raise ChecksumMismatch(f"chunk {chunk_id}: its segment table does not fit its bytes")
        whole = carried
    else:
        # One pass gives the segment table and the whole CRC (checksum.segment_checksums).
        segment_crcs, whole = segment_checksums(view, SEGMENT_SIZE, keep_gil=True)
    if whole != checksum:
        raise ChecksumMismatch(
            f"chunk {chunk_id}: payload crc32c {whole:08x} != sent checksum {checksum:08x}"
        )
    path = chunk_path(data_dir, chunk_id)
    old_size, stored = _existing(path, chunk_id, len(view), whole)
    if stored:
        return Stored(0, 0, written=False)
    header = encode_header(view, whole, segment_crcs)
    directory = path.parent
    target = directory / f"{TMP_PREFIX}{chunk_id}-{secrets.token_hex(4)}"
    size = len(header) + len(view)
    image = _file_image(image, header, view)
    try:
        # (A new file can fail for want of its shard directory.)
        dev = _device(data_dir)
        direct = image is not None and _in_shard_dir(
            directory, lambda: True, _write_direct, target, image, size, dev
        )
        if not direct:
            fd = _in_shard_dir(directory, lambda: True, _open_target, target, 0)
            try:
                _write_all(fd, [header, view])
                os.fdatasync(fd)
            finally:
                os.close(fd)
        _in_shard_dir(directory, target.exists, os.rename, target, path)
        synced = time.perf_counter()
        _fsync_dir(directory)
        fsync_s = time.perf_counter() - synced
    except OSError as e:
        remove_quietly(target)
        if e.errno in _NOSPACE:
            raise DiskFull(f"no space on disk for chunk {chunk_id} ({len(view)} bytes)") from None
        raise
    return Stored(size - (old_size or 0), 1 if old_size is None else 0, fsync_s)


def _existing(path: Path, chunk_id: str, length: int, whole: int) -> tuple[int | None, bool]:
    """What lies under the chunk's name already: (its file size, or None for no file;
    whether it is this very chunk, whole, so that the put is a no-op). ChunkConflict for
    another chunk's bytes under the id; a file that fails its own checks is to be replaced.
    """
    try:
        old_size: int | None = os.stat(path).st_size
    except FileNotFoundError:
        return None, False
    try:
        existing = read_header(path)
    except ChunkNotFound:
        return None, False
    except ChunkCorrupt as e:
        log.warning("chunk %s on disk is corrupt (%s); replacing it with the new put", chunk_id, e)
        return old_size, False
    if existing.length != length or existing.checksum != whole:
        raise ChunkConflict(
            f"chunk {chunk_id} exists with length {existing.length}"
            f" crc {existing.checksum:08x}, put has length {length} crc {whole:08x}"
        )
    if verify_chunk(path):
        # The same put again: perhaps the retry of one whose daemon was killed between
        # its rename and the directory fsync, so the name may not be durable yet.
        _fsync_dir(path.parent)
        return old_size, True
    log.warning("chunk %s on disk fails its checksum; replacing it with the new put", chunk_id)
    return old_size, False


def _file_image(image: memoryview | None, header: bytes, view: memoryview) -> memoryview | None:
    """``image`` with the header written into its front and zeros after the data, when it
    is the ``put_room`` buffer that ``view`` lies in; else None (the write is buffered)."""
    if image is None:
        return None
    image = memoryview(image).cast("B")
    size = len(header) + len(view)
    if (len(header), len(image)) != put_room(len(view)) or not _same_memory(
        image[len(header) : size], view
    ):
        return None
    image[: len(header)] = header
    image[size:] = bytes(len(image) - size)  # no stale bytes past the end on disk
    return image


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
    (cleanup of temporary files must not fail the operation it follows)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("could not remove %s: %s", path, e)


def delete_chunk(data_dir: Path, chunk_id: str) -> int | None:
    """Remove a chunk durably; its file size if it existed, else None. The chunk's name is
    gone, durably, when this returns."""
    path = chunk_path(data_dir, chunk_id)
    try:
        size = os.stat(path).st_size
        os.unlink(path)
    except FileNotFoundError:
        # Already gone: perhaps the retry of a delete whose daemon was killed between the
        # unlink and the directory fsync, so the removal may not be durable yet
        # (the twin of a repeated put in ``_write_chunk``).
        try:
            _fsync_dir(path.parent)
        except FileNotFoundError:  # no shard directory: the chunk was never there
            pass
        return None
    _fsync_dir(path.parent)
    return size


# --- recovery -------------------------------------------------------------------------------


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
            elif is_chunk(entry.name) and entry.is_file(follow_symlinks=False):
                count += 1
                used += entry.stat().st_size
        if dirty:
            _fsync_dir(Path(shard.path))
    if removed:
        log.info("removed %d partial chunk files left by a crash", removed)
    removed += _remove_old_spares(data_dir)
    return ScanResult(count, used, removed)


def _remove_old_spares(data_dir: Path) -> int:
    """Older versions kept deleted chunks' files in ``spares/`` for puts to reuse; nothing
    reuses them now, so their space comes back. Only their own files are removed."""
    spares = data_dir / OLD_SPARES_DIR
    if not spares.is_dir():
        return 0
    removed = 0
    for entry in os.scandir(spares):
        if entry.name.startswith(OLD_SPARE_PREFIX) and entry.is_file(follow_symlinks=False):
            remove_quietly(Path(entry.path))
            removed += 1
    try:
        spares.rmdir()
    except OSError:  # something that is not ours is left in it
        pass
    if removed:
        log.info("removed %d spare files an older version kept", removed)
    return removed
