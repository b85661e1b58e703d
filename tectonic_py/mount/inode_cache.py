"""The FUSE layer's bookkeeping: kernel lookup counts and the open file table.

The metadata service is the source of truth for every inode; this module only keeps what the
*kernel* and the *open file descriptors* of this mount need locally:

* **Lookup counts.** Every reply that hands the kernel an inode (lookup, create, mkdir, and
  each readdirplus entry the kernel accepts) adds one; ``forget`` takes them away. A count is
  dropped at zero. Nothing is freed remotely on forget (the metadata service owns inode
  lifetimes); the count is kept so that state for an inode never outlives the kernel's use of
  it and so that a wrong count shows up in tests instead of as a leak.

* **Replaced files the kernel still holds.** A rename over a file frees its record at once,
  but the kernel may have resolved the name to that inode just before (a path walk racing
  ``os.replace``) and send OPEN for it after. On a local filesystem such an open gets the
  old file; here a reader of the old file, located before the rename, is kept for the
  inode (``keep``) and each such open reads through a copy of it, until the kernel's last
  FORGET of the inode drops it. Its blocks last as an open handle's do: the GC's grace.

* **Directory attributes.** A directory's attrs, read at most ``attr_timeout`` ago, answer
  its GETATTR. The kernel drops its own copy after every create or unlink in the directory
  and asks again before the next path walk through it (to check its mode), so without this a
  burst of creates costs a round trip each for the directory's attrs. This mount's own
  changes in the directory stamp its mtime and ctime here as the shard does; another
  mount's show within ``attr_timeout``, as any attribute does.

* **Open files.** One ``OpenFile`` per inode with at least one open handle. All handles of an
  inode that write share ONE ``FileWriter``: the kernel gives dup'd descriptors and the several
  ``open`` calls of numpy/torch/DCP one inode, and a second writer would steal the writer token
  from the first and fence it off. Reads of an inode with a live writer go through the
  writer's ``pread`` (read-your-writes); other reads use a ``FileReader`` per handle, opened at
  ``open`` so that an unlinked file stays readable until its last handle is released.

Invariants (no await may split these; the table is only touched from the trio thread):
``OpenFile.handles`` holds exactly the fhs in ``InodeCache.handles`` that point at it;
``OpenFile.write_handles`` counts those with ``writable``; an ``OpenFile`` leaves the table
after its last handle is released *and* its writer is closed (``drop_if_idle``): an open that
races with the sealing release of the same inode finds the OpenFile, waits on its lock, and
only then takes a new writer token (it would otherwise fence off the seal).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from tectonic_py.core.records import Attrs

log = logging.getLogger(__name__)

MAX_DIR_ATTRS = 4096  # directories whose attrs are held


@dataclass(eq=False)
class OpenFile:
    """State shared by every open handle of one inode."""

    inode: int
    # Last known attrs while a writer is open (getattr then needs no round trip); None for
    # an inode only open for reading (its getattr goes to the metadata service).
    attrs: Attrs | None = None
    # The shared FileWriter (tectonic_py.client.writer) while any handle writes, else None.
    writer: Any = None
    write_handles: int = 0
    handles: set[int] = field(default_factory=set)
    # Serialises taking, truncating and closing the writer: two concurrent opens must not
    # both call open_writer (the second would fence the first off).
    lock: trio.Lock = field(default_factory=trio.Lock)
    # Writes and truncates so far, and how many of them the last successful fsync covered:
    # flush skips its round trip when nothing changed since.
    write_seq: int = 0
    synced_seq: int = 0
    # The first write-path failure. Sticky: later writes, flushes and fsyncs report it, and
    # the file is never sealed (sealing would make lost data look complete).
    error: BaseException | None = None
    # atime/mtime a program set explicitly (utimensat, cp -a) since its last write: the
    # metadata service stamps mtime on every commit and on the seal, so these are applied
    # again after each durability point.
    times: dict[str, int] = field(default_factory=dict)
    # Set while release seals the writer: reads then wait for the seal and use a reader.
    closing: bool = False


@dataclass(eq=False)
class Handle:
    """One kernel file handle (one ``struct file``: shared by dup'd descriptors)."""

    fh: int
    ofile: OpenFile
    readable: bool
    writable: bool
    # A FileReader of the sealed file (tectonic_py.client.reader); None while reads use the writer.
    reader: Any = None


@dataclass(eq=False)
class DirHandle:
    """An open directory: the name cursor of each readdir offset handed to the kernel.

    readdir offsets must survive creations and removals between calls, so an offset maps to
    the *name* of the last entry returned, and the next page starts strictly after it.
    """

    fh: int
    inode: int
    cursors: dict[int, str] = field(default_factory=dict)
    next_offset: int = 3  # 1 and 2 are "." and ".."


class InodeCache:
    """Lookup counts plus the table of open file and directory handles."""

    def __init__(self) -> None:
        self.lookups: dict[int, int] = {}
        self.open_files: dict[int, OpenFile] = {}
        self.handles: dict[int, Handle] = {}
        self.dir_handles: dict[int, DirHandle] = {}
        self.kept: dict[int, Any] = {}  # inode -> FileReader of a replaced file still held
        self._dirs: dict[int, tuple[float, Attrs]] = {}
        self._next_fh = 1

    # --- lookup counts -------------------------------------------------------------------

    def remember(self, inode: int, count: int = 1) -> None:
        """The kernel now holds ``count`` more references to ``inode``."""
        self.lookups[inode] = self.lookups.get(inode, 0) + count

    def forget(self, inode: int, count: int) -> bool:
        """Drop ``count`` kernel references; True when none remain.

        A forget for more references than we counted means our bookkeeping is wrong: log it
        and clamp at zero rather than raise (a forget handler must never fail).
        """
        have = self.lookups.get(inode, 0)
        if count > have:
            log.error("forget(%d, %d) but only %d lookups were counted", inode, count, have)
        left = max(have - count, 0)
        if left:
            self.lookups[inode] = left
            return False
        self.lookups.pop(inode, None)
        return True

    def lookup_count(self, inode: int) -> int:
        return self.lookups.get(inode, 0)

    def keep(self, inode: int, reader: Any) -> Any:
        """Keep ``reader`` for a replaced file while the kernel holds ``inode``; returns a
        reader to close (the one it replaces, or ``reader`` itself if nothing holds it)."""
        if not self.lookups.get(inode):
            return reader
        old = self.kept.get(inode)
        self.kept[inode] = reader
        return old

    def unkeep(self, inode: int) -> Any:
        """The kept reader of ``inode`` (None if none), out of the table: the kernel forgot
        it."""
        return self.kept.pop(inode, None)

    # --- open files ----------------------------------------------------------------------

    def _new_fh(self) -> int:
        fh = self._next_fh
        self._next_fh += 1
        return fh

    def open_file(self, inode: int) -> OpenFile:
        """The OpenFile of ``inode``, made if none is open."""
        ofile = self.open_files.get(inode)
        if ofile is None:
            ofile = OpenFile(inode=inode)
            self.open_files[inode] = ofile
        return ofile

    def add_handle(self, ofile: OpenFile, *, readable: bool, writable: bool) -> Handle:
        """A new handle on ``ofile``. The caller has already set up the writer if needed."""
        handle = Handle(fh=self._new_fh(), ofile=ofile, readable=readable, writable=writable)
        self.handles[handle.fh] = handle
        ofile.handles.add(handle.fh)
        if writable:
            ofile.write_handles += 1
        return handle

    def drop_if_idle(self, ofile: OpenFile) -> bool:
        """Drop ``ofile`` once it has no handle and no writer (after the last release, or an
        open that failed half-way). True if it was dropped."""
        if ofile.handles or ofile.writer is not None or ofile.lock.locked():
            return False
        if self.open_files.get(ofile.inode) is ofile:
            del self.open_files[ofile.inode]
        return True

    def handle(self, fh: int) -> Handle:
        """The handle ``fh``; KeyError for a handle the kernel never got from us."""
        return self.handles[fh]

    def remove_handle(self, fh: int) -> tuple[Handle, bool, bool]:
        """Take ``fh`` out of the table: ``(handle, last_writer, last_handle)``.

        ``last_writer``: this was the inode's last writable handle, so its writer must be
        sealed. ``last_handle``: no handle of the inode is left; the caller drops the OpenFile
        with ``drop_if_idle`` once the writer is closed.
        """
        handle = self.handles.pop(fh)
        ofile = handle.ofile
        ofile.handles.discard(fh)
        last_writer = False
        if handle.writable:
            ofile.write_handles -= 1
            last_writer = ofile.write_handles == 0
        return handle, last_writer, not ofile.handles

    def writing(self, inode: int) -> OpenFile | None:
        """The OpenFile of ``inode`` if it has a live writer (its size is the writer's)."""
        ofile = self.open_files.get(inode)
        if ofile is not None and ofile.writer is not None:
            return ofile
        return None

    # --- directories ----------------------------------------------------------------------

    def note_dir(self, attrs: Attrs) -> None:
        """A directory's attrs as the metadata service just gave them."""
        self._dirs.pop(attrs.id, None)
        self._dirs[attrs.id] = (time.monotonic(), attrs)
        while len(self._dirs) > MAX_DIR_ATTRS:
            del self._dirs[next(iter(self._dirs))]

    def dir_attrs(self, inode: int, max_age: float) -> Attrs | None:
        """The directory's attrs if read less than ``max_age`` seconds ago."""
        held = self._dirs.get(inode)
        if held is None or time.monotonic() - held[0] > max_age:
            return None
        return held[1]

    def dir_changed(self, inode: int, links: int = 0) -> None:
        """This mount changed the directory's entries (``links``: subdirectories made or
        removed): its times move to now, as the shard stamps them."""
        held = self._dirs.get(inode)
        if held is not None:
            now = time.time_ns()
            attrs = dataclasses.replace(
                held[1], mtime_ns=now, ctime_ns=now, nlink=max(2, held[1].nlink + links)
            )
            self._dirs[inode] = (held[0], attrs)

    def forget_dir(self, inode: int) -> None:
        self._dirs.pop(inode, None)

    def open_dir(self, inode: int) -> DirHandle:
        dh = DirHandle(fh=self._new_fh(), inode=inode)
        self.dir_handles[dh.fh] = dh
        return dh

    def dir_handle(self, fh: int) -> DirHandle:
        return self.dir_handles[fh]

    def close_dir(self, fh: int) -> None:
        self.dir_handles.pop(fh, None)
