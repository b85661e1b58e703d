"""Spare chunk files: inodes kept ready so that a put never has to create one.

Why: on a busy ext4 disk, creating a file (``open(O_CREAT)``) is the largest single CPU
cost of a 1 MiB put: the inode allocator walks the group's bitmap and, for every free inode
that was recently deleted, reads its inode table block (``recently_deleted``), so after a
round of deletes each create costs more CPU than the rest of the put. Checkpoint stores delete as much as they write (checkpoint N is written, N-2
dropped), so a delete renames the chunk's file into ``<data dir>/spares/`` instead of
unlinking it, and a later put overwrites that file (O_DIRECT, the blocks are often already
allocated; ``take`` says which spare suits a size), fsyncs it and renames it to its chunk
name. The put path then pays neither inode creation nor the block freeing of an unlink.
When no spare suits, a put creates a temporary file; a background task (``run``)
creates empty spares, at a bounded rate and only while no put is in flight, so that a fresh
store has some too.

Crash safety is that of ``chunkstore.writes``: a spare only ever becomes a chunk by one
``rename`` after its new contents are fsynced, and a chunk only becomes a spare by one
``rename`` followed by an fsync of its shard directory, so a crash leaves every chunk id
either whole or absent; whatever a spare holds (a deleted chunk's bytes, half of a put that
failed) is never served, because only names under ``chunks/`` are chunks. ``recover`` keeps
the spares it finds, within the bounds below. A reader that opened a chunk before its
delete could see the file reused; ``reads.read_chunk`` checks after reading that the chunk's
name still names the file it read (``ChunkNotFound`` otherwise).

Bounds and accounting: at most ``max_files`` spares and ``max_bytes`` of their sizes; a
delete past either unlinks. Spare bytes are not ``used`` (no chunk is in them) but they do
hold disk: the server counts ``used + spare bytes + reserved`` against ``--capacity`` and
trims spares (unlinks them) to make room before it refuses a put, and trims them all and
retries once when the filesystem itself says ENOSPC. The free space it reports includes
spare bytes, since any put can have them at once.

Event-loop thread only, except ``scan`` (startup, in ``recover``'s thread).
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from chunkstore.writes import remove_quietly

log = logging.getLogger(__name__)

SPARES_DIR = "spares"
SPARE_PREFIX = "spare-"
TOPUP_BATCH = 16  # empty spares created per worker-thread call
TOPUP_PAUSE = 0.02  # seconds between batches: at most 800 creates/s, never a burst


@dataclass(frozen=True)
class Spare:
    """One spare file: its path and its size on disk when it was put in the pool."""

    path: Path
    size: int


class SpareFiles:
    """The pool of spare chunk files of one data directory (see the module docstring)."""

    def __init__(self, data_dir: Path, max_files: int, max_bytes: int, min_files: int = 0) -> None:
        self.directory = Path(data_dir) / SPARES_DIR
        self.max_files = max_files
        self.max_bytes = max_bytes
        self.min_files = min(min_files, max_files)
        self._by_size: dict[int, list[Path]] = {}
        self.count = 0
        self.bytes = 0
        self.reused = 0  # puts that wrote into a spare
        self.recycled = 0  # deletes that kept their file as a spare
        self.created = 0  # empty spares made by the top-up task
        self._prefix = f"{SPARE_PREFIX}{secrets.token_hex(4)}-"
        self._serial = 0
        self._taken = trio.Event()

    # --- startup ---------------------------------------------------------------------------

    def scan(self) -> int:
        """Blocking: make the directory and take in the spares a previous run left, within
        the bounds (the rest, and anything that is not a spare, are removed). Returns how
        many files were removed."""
        self.directory.mkdir(parents=True, exist_ok=True)
        removed = 0
        for entry in sorted(os.scandir(self.directory), key=lambda e: e.name):
            keep = entry.name.startswith(SPARE_PREFIX) and entry.is_file(follow_symlinks=False)
            if keep:
                size = entry.stat(follow_symlinks=False).st_size
                keep = self.count < self.max_files and self.bytes + size <= self.max_bytes
            if keep:
                self._add(Path(entry.path), size)
                continue
            try:
                if entry.is_dir(follow_symlinks=False):
                    continue  # not ours to remove; never used as a spare
                os.unlink(entry.path)
                removed += 1
            except FileNotFoundError:
                pass
        return removed

    # --- pool ------------------------------------------------------------------------------

    def _add(self, path: Path, size: int) -> None:
        self._by_size.setdefault(size, []).append(path)
        self.count += 1
        self.bytes += size

    def _pop(self, size: int) -> Path:
        """One spare of ``size`` bytes out of the pool (``_add`` in reverse)."""
        paths = self._by_size[size]
        path = paths.pop()
        if not paths:
            del self._by_size[size]
        self.count -= 1
        self.bytes -= size
        return path

    def take(self, size: int) -> Spare | None:
        """A spare for a chunk file of ``size`` bytes, out of the pool, or None (the put
        creates a file): one of exactly that size if any (nothing to allocate or free), else
        an empty one (made for this), else, only while the pool is full, the largest smaller
        one (it grows) or failing that the smallest larger one (it is cut).

        Why a spare of another size waits while the pool has room: it is the file a later
        chunk of *its* size would reuse: a store that sees two sizes (1 MiB, then 4 MiB
        chunks) would otherwise grow the small spares into large ones, and every later round
        of small puts would create those files again. Growing or cutting still beats
        creating once the pool is full (a full pool of another size drains instead of
        turning every delete into an unlink). Cutting is the last choice: it frees blocks,
        a metadata change the put's fdatasync must wait for; a same-size spare is the
        cheapest put of all, then growing a smaller one, then a new file."""
        if not self.count:
            return None
        if size in self._by_size:
            best = size
        else:
            full = self.count >= self.max_files or self.bytes >= self.max_bytes
            smaller = [s for s in self._by_size if s < size and (full or s == 0)]
            if smaller:
                best = max(smaller)
            elif full:
                best = min(self._by_size)
            else:
                return None
        path = self._pop(best)
        self.reused += 1
        self._taken.set()
        return Spare(path, best)

    def give_back(self, spare: Spare) -> None:
        """A spare ``take`` handed out that the put did not touch (the chunk was already
        stored, or the put failed before writing). Always taken back, so the bounds may be
        exceeded by the puts in flight, briefly, never by more."""
        self.reused -= 1
        self._add(spare.path, spare.size)

    def has_room(self) -> bool:
        """Whether a deleted chunk's file may become a spare (its size is known only once
        it is renamed; ``trim_to_bounds`` after ``kept`` removes what did not fit)."""
        return self.count < self.max_files and self.bytes < self.max_bytes

    def new_path(self) -> Path:
        """A name no spare has (a per-process random prefix and a counter)."""
        self._serial += 1
        return self.directory / f"{self._prefix}{self._serial:x}"

    def kept(self, path: Path, size: int) -> None:
        """A delete renamed a chunk's file to ``path`` (from ``new_path``)."""
        self.recycled += 1
        self._add(path, size)

    async def trim(self, nbytes: int | None = None) -> int:
        """Unlink spares, the largest first, until at least ``nbytes`` of them are freed
        (all if None): disk space for puts that cannot use them, or a store near its
        capacity. Returns the bytes freed."""
        victims: list[Path] = []
        freed = 0
        for size in sorted(self._by_size, reverse=True):
            while size in self._by_size and (nbytes is None or freed < nbytes):
                victims.append(self._pop(size))
                freed += size
        await _unlink_in_thread(victims)
        return freed

    async def trim_to_bounds(self) -> None:
        """Unlink spares past ``max_files`` or ``max_bytes`` (deletes that ran at the same
        time may each have kept one when only one more fitted)."""
        if self.bytes > self.max_bytes:
            await self.trim(self.bytes - self.max_bytes)
        victims: list[Path] = []
        while self.count > self.max_files:
            victims.append(self._pop(min(self._by_size)))
        await _unlink_in_thread(victims)

    # --- top-up ------------------------------------------------------------------------------

    async def run(self, idle: Callable[[], bool]) -> None:
        """Keep at least ``min_files`` spares: create empty ones in a worker thread, a batch
        at a time, paced, and only while ``idle()`` (no put in flight), so the creates never
        compete with the puts they are meant to spare. Runs until cancelled."""
        while self.min_files > 0:
            if self.count >= self.min_files:
                self._taken = trio.Event()
                await self._taken.wait()
                continue
            if not idle():
                await trio.sleep(TOPUP_PAUSE)
                continue
            want = min(TOPUP_BATCH, self.min_files - self.count)
            paths = [self.new_path() for _ in range(want)]
            made = await trio.to_thread.run_sync(_create_empty, paths)
            for path in made:
                self._add(path, 0)
            self.created += len(made)
            if len(made) < len(paths):
                await trio.sleep(1.0)  # disk full or the directory is gone: try again later
            await trio.sleep(TOPUP_PAUSE)

    def stats(self) -> dict[str, int]:
        return {
            "spare_files": self.count,
            "spare_bytes": self.bytes,
            "spares_reused": self.reused,
            "spares_recycled": self.recycled,
            "spares_created": self.created,
        }


def _create_empty(paths: list[Path]) -> list[Path]:
    """Create empty spare files (no fsync: a spare lost in a crash is only one fewer)."""
    made = []
    for path in paths:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.ENOENT):
                log.warning("cannot create spare %s: %s", path, e)
            break
        os.close(fd)
        made.append(path)
    return made


async def _unlink_in_thread(paths: list[Path]) -> None:
    if paths:
        await trio.to_thread.run_sync(_unlink_all, paths)


def _unlink_all(paths: list[Path]) -> None:
    for path in paths:
        remove_quietly(path)
