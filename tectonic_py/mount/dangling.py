"""Dangling names: entries whose file record is gone or cannot be read.

An admin's ``file.drop`` of a named file, or a damaged shard, leaves a name that points at
nothing. One such name must never fail its whole directory, and the user must be able to
remove it. So the mount lists it and answers its lookup with a placeholder (the entry's
kind, no permission bits, nothing cached: ``attr_timeout`` and ``entry_timeout`` 0), which
is what lets the kernel pass an ``unlink`` of it on; the inode's own getattr and open answer
EIO (``DanglingName``), as a damaged inode of a local filesystem does.

Each one is logged once, when first met, and not again for every request that touches it
(``ls -l`` of a directory asks several times per entry); the handlers' error boundary logs
``DanglingName`` at debug level for that reason.
"""

from __future__ import annotations

import logging
import stat

import pyfuse3

from tectonic_py.core.errors import DanglingName, FileNotFound
from tectonic_py.core.records import KIND_DIR, KIND_FILE

log = logging.getLogger(__name__)

MAX_REMEMBERED = 4096  # dangling ids whose log line was written; older ones may log again

_IFMT = {KIND_DIR: stat.S_IFDIR, KIND_FILE: stat.S_IFREG}


class DanglingNames:
    """The dangling records this mount has met, by file id."""

    def __init__(self) -> None:
        self._known: dict[int, str] = {}

    def note(self, error: DanglingName) -> None:
        """A dangling name was met: log it the first time."""
        if error.file_id in self._known:
            return
        self._known[error.file_id] = str(error)
        while len(self._known) > MAX_REMEMBERED:
            del self._known[next(iter(self._known))]
        log.error("dangling name: %s; it answers EIO until it is removed", error)

    def error_for(self, file_id: int) -> DanglingName | None:
        """The error a known dangling record's own getattr or open answers, else None."""
        message = self._known.get(file_id)
        if message is None:
            return None
        return DanglingName(message, file_id=file_id)

    def check(self, file_id: int, error: FileNotFound) -> None:
        """Raise ``DanglingName`` (EIO) instead of ``error`` for a known dangling record."""
        dangling = self.error_for(file_id)
        if dangling is not None:
            raise dangling from error

    def removed(self, file_id: int) -> None:
        """Its name was unlinked: nothing dangles any more."""
        self._known.pop(file_id, None)


def placeholder(error: DanglingName) -> pyfuse3.EntryAttributes:
    """The entry a dangling name is listed and looked up with: its inode number and kind,
    no permission bits, and nothing the kernel may cache, so that every stat and open of it
    reaches the mount (and answers EIO) while an unlink can still name it."""
    e = pyfuse3.EntryAttributes()
    e.st_ino = error.file_id
    e.generation = 0
    e.entry_timeout = 0
    e.attr_timeout = 0
    e.st_mode = _IFMT.get(error.kind, stat.S_IFREG)
    e.st_nlink = 1
    return e
