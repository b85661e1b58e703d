"""What a writer's growth costs its quota: claims taken ahead of the bytes.

A file in a quota realm (``Attrs.realm``) grows only by bytes its writer claimed of the
realm first (``quota.claim``, metadata/quota_layer.py): the claim is refused with
``QuotaExceeded`` (EDQUOT) before the bytes enter the writer's buffer, so what was written
before stays whole and readable, and the writer stays usable (the error is not sticky). The
writer claims ahead in steps of ``CLAIM_STEP`` so a large file costs one small metadata call
per step, not one per write; what it did not use is given back at close. Claims of a file
in a directory with a reservation draw from the reservation first (its writes cannot be
refused while it lasts), and from what ``fallocate`` set aside for the file before that.
A file outside every realm costs nothing here.
"""

from __future__ import annotations

import logging
from typing import Protocol

from tectonic_py.core.errors import TectonicError

log = logging.getLogger(__name__)

CLAIM_STEP = 8 * 1024 * 1024


class Claims(Protocol):
    """The write path's quota calls (``WritePath``)."""

    async def claim(
        self, realm: int, dir_id: int, file_id: int, need: int, want: int, prealloc: bool
    ) -> tuple[int, int]: ...

    async def unclaim(self, realm: int, file_id: int, nbytes: int, keep: bool) -> None: ...


class QuotaCharge:
    """One writer's account with its realm: ``top`` is the size its growth has been paid up
    to, ``claimed`` what it holds beyond that, ``set_aside`` the part of it that fallocate
    had held for the file (spent first; what is left of it goes back to the file, not to
    the realm)."""

    def __init__(self, claims: Claims, realm: int, file_id: int, size: int) -> None:
        self._claims = claims
        self.realm = realm
        self.file_id = file_id
        self.dir_id = 0  # the file's directory: its reservation is drawn from (0: unknown)
        self.top = size
        self.claimed = 0
        self.set_aside_left = 0

    async def grow(self, end: int) -> None:
        """Pay for the file growing to ``end`` bytes, or raise QuotaExceeded (nothing paid)."""
        if not self.realm or end <= self.top:
            return
        need = end - self.top
        if need > self.claimed:
            short = need - self.claimed
            granted, drawn = await self._claims.claim(
                self.realm, self.dir_id, self.file_id, short, max(short, CLAIM_STEP), False
            )
            self.claimed += granted
            self.set_aside_left += drawn
        self.claimed -= need
        self.set_aside_left = max(0, self.set_aside_left - need)
        self.top = end

    def shrink(self, size: int) -> None:
        """The file was cut to ``size``: the metadata gives back what it had counted."""
        self.top = min(self.top, size)

    async def set_aside(self, end: int) -> int:
        """fallocate KEEP_SIZE: hold the bytes up to ``end`` for this file, beyond its
        writer's life (the realm keeps them for PREALLOC_TTL); returns the bytes held."""
        if not self.realm or end <= self.top:
            return 0
        granted, _ = await self._claims.claim(
            self.realm, self.dir_id, self.file_id, end - self.top, end - self.top, True
        )
        return granted

    async def give_back(self) -> None:
        """At close: the claimed bytes the writer did not write go back to the realm."""
        left, self.claimed = self.claimed, 0
        kept, self.set_aside_left = min(left, self.set_aside_left), 0
        if not self.realm:
            return
        try:
            if left - kept > 0:
                await self._claims.unclaim(self.realm, self.file_id, left - kept, False)
            if kept > 0:
                await self._claims.unclaim(self.realm, self.file_id, kept, True)
        except TectonicError as e:  # the claim lapses at its expiry instead
            log.info("file %d: claimed quota not given back: %s", self.file_id, e)
