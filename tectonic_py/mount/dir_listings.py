"""The mount's negative entries: recent listings of directories, to answer "absent" locally.

Every ``open(path, "wb")`` of a new name starts with a LOOKUP of that name, made under the
kernel's lock of the directory. Without knowing the name is absent, the mount asks the
metadata service, and the step directory's creates queue for that round trip one by one.
A listing of the directory, read once after a missed lookup and held for
``negative_timeout`` seconds, answers those lookups at once.

What that costs, and what it never does (the same trade as JuiceFS's negative entry cache
and as the kernel's own ``entry_timeout`` for names that exist):

* Another mount's new name may be answered as absent for up to ``negative_timeout`` by a
  mount that listed the directory before the name was made. An open without ``O_CREAT``
  then fails with ENOENT, as it would have a moment earlier. An ``O_CREAT|O_TRUNC`` open
  makes a file of this mount's, which takes the name over at the shard: the two writers are
  serialized as the later one's rewrite (tectonic_py/client/async_creates.py). Readdir,
  rename and ``tectonic commit`` always ask the metadata service, and the names a readdir
  returns join the listing.
* This mount's own creates, removals and renames change its listings at once, also those
  made while a listing is being read, so the mount never answers absent for a name it made.
* A name that the listing holds is always looked up at the service: an entry that another
  mount removed is found gone there.
* Directories with more than ``max_names`` entries are not listed: their lookups go to the
  service, as with ``negative_timeout`` 0, which turns the cache off.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import trio

from tectonic_py.core.errors import TectonicError

log = logging.getLogger(__name__)

DEFAULT_NEGATIVE_TIMEOUT_S = 1.0
MAX_NAMES = 16_384  # a directory with more entries is not listed
MAX_LISTINGS = 64  # directories whose listings are held at once
PAGE = 4096


@dataclass
class _Listing:
    names: set[str]
    read_at: float  # monotonic time the read began: the listing is as old as that


class DirListings:
    """Short-lived listings of directories, kept current by the mount's own changes."""

    def __init__(
        self,
        meta: Any,
        nursery: trio.Nursery,
        *,
        timeout: float = DEFAULT_NEGATIVE_TIMEOUT_S,
        max_names: int = MAX_NAMES,
    ) -> None:
        self.meta = meta
        self.nursery = nursery
        self.timeout = max(0.0, timeout)
        self.max_names = max_names
        self._listings: OrderedDict[int, _Listing] = OrderedDict()
        # Directories being read, with this mount's changes made meanwhile (name, present).
        self._reading: dict[int, list[tuple[str, bool]]] = {}
        self._too_big: dict[int, float] = {}  # directory -> when it was found too big
        self.hits = 0
        self.reads = 0

    def absent(self, dir_id: int, name: str) -> bool:
        """True only if a listing younger than the timeout says ``name`` is not there."""
        return self.absent_for(dir_id, name) > 0

    def absent_for(self, dir_id: int, name: str) -> float:
        """How many more seconds a listing says ``name`` is not in ``dir_id`` (0: it may
        be there; ask the service). The kernel may keep the negative entry that long."""
        listing = self._listings.get(dir_id)
        if listing is None:
            return 0.0
        left = self.timeout - (time.monotonic() - listing.read_at)
        if left <= 0:
            del self._listings[dir_id]
            return 0.0
        if name in listing.names:
            return 0.0
        self.hits += 1
        return left

    def missed(self, dir_id: int) -> None:
        """The service said a name is absent in ``dir_id``: read its listing, so that the
        next absent names need no round trip."""
        if self.timeout <= 0 or dir_id in self._reading:
            return
        big = self._too_big.get(dir_id)
        if big is not None and time.monotonic() - big < 10 * self.timeout:
            return
        listing = self._listings.get(dir_id)
        if listing is not None and time.monotonic() - listing.read_at < self.timeout / 2:
            return
        self._reading[dir_id] = []
        self.nursery.start_soon(self._read, dir_id)

    async def _read(self, dir_id: int) -> None:
        started = time.monotonic()
        names: set[str] | None = set()
        try:
            after = ""
            while names is not None:
                entries, cursor = await self.meta.readdir(dir_id, after, PAGE)
                names.update(e.name for e in entries)
                if len(names) > self.max_names:
                    self._too_big[dir_id] = time.monotonic()
                    names = None
                elif cursor is None or not entries:
                    break
                else:
                    after = cursor
        except TectonicError as e:
            log.debug("listing of directory %d not read: %s", dir_id, e)
            names = None
        finally:
            changes = self._reading.pop(dir_id, [])
        if names is None:
            self._listings.pop(dir_id, None)
            return
        for name, present in changes:
            if present:
                names.add(name)
            else:
                names.discard(name)
        self.reads += 1
        self._listings[dir_id] = _Listing(names, started)
        self._listings.move_to_end(dir_id)
        while len(self._listings) > MAX_LISTINGS:
            self._listings.popitem(last=False)

    def added(self, dir_id: int, name: str) -> None:
        """This mount made ``name`` in ``dir_id`` (a create, mkdir, link, rename's target)."""
        self._change(dir_id, name, True)

    def removed(self, dir_id: int, name: str) -> None:
        """This mount removed ``name`` from ``dir_id`` (unlink, rmdir, rename's source)."""
        self._change(dir_id, name, False)

    def _change(self, dir_id: int, name: str, present: bool) -> None:
        listing = self._listings.get(dir_id)
        if listing is not None:
            if present:
                listing.names.add(name)
            else:
                listing.names.discard(name)
        reading = self._reading.get(dir_id)
        if reading is not None:
            reading.append((name, present))

    def seen(self, dir_id: int, names: list[str]) -> None:
        """A readdir page of ``dir_id`` from the service: its names exist (so ``ls`` and
        then ``open`` of another mount's new file finds it)."""
        for name in names:
            self._change(dir_id, name, True)

    def forget(self, dir_id: int) -> None:
        """The directory went (rmdir): its listing with it."""
        self._listings.pop(dir_id, None)
