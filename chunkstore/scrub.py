"""Scrub: the chunk store re-reads every chunk it holds and verifies its checksums.

Silent corruption (a flipped bit on disk, a torn sector) is found by a read only; a chunk that
nobody reads for months would otherwise be found bad exactly when it is needed for a degraded
read. So each chunk store walks its chunks in id order, a pass at a time, re-reading the
header, every segment CRC and the whole-chunk CRC (``reads.verify_chunk``), in a worker
thread, paced to ``rate`` bytes per second so that scrub never competes seriously with
checkpoint writes. A new pass starts at most every ``interval`` seconds.

Bad chunks are kept in memory (``bad``) and reported through the ``scrub_report`` op; the
repair service (``tectonic_py.maintenance.repair``) polls it, rebuilds each bad chunk from k
good ones onto another node, points the Block layer at the new copy and then deletes the bad
one here, which drops it from the report (``forget``). The set is not persisted: after a
restart the next pass finds the same chunks again, and until then a read of a bad chunk
fails its checksum anyway (``ChunkCorrupt``) and is served degraded.

Why not delete or quarantine a bad chunk at once: deleting would leave the Block layer naming
a chunk that is gone, which repair handles just as well, but a chunk with a bad segment may
still have good ranges a degraded reader can use; the copy is only removed once a good one
exists elsewhere.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio

from chunkstore import layout, reads
from tectonic_py.core.errors import ChunkNotFound, TectonicError

log = logging.getLogger(__name__)

PAGE = 1000


@dataclass
class ScrubStats:
    passes: int = 0
    chunks_checked: int = 0
    bytes_checked: int = 0
    bad_found: int = 0
    pass_started: float = 0.0
    last_pass_s: float = 0.0


@dataclass
class Scrubber:
    """The scrub loop of one chunk store (``run``) and its report of bad chunks."""

    data_dir: Path
    rate: float  # bytes per second; <= 0 disables the loop
    interval: float  # minimum seconds between the starts of two passes
    bad: dict[str, str] = field(default_factory=dict)  # chunk id -> why
    stats: ScrubStats = field(default_factory=ScrubStats)

    def forget(self, chunk_id: str) -> None:
        """The chunk was deleted (repaired elsewhere): it is no longer this node's problem."""
        self.bad.pop(chunk_id, None)

    def report(self) -> dict[str, object]:
        return {
            "bad": [[c, why] for c, why in sorted(self.bad.items())],
            "passes": self.stats.passes,
            "chunks_checked": self.stats.chunks_checked,
            "bytes_checked": self.stats.bytes_checked,
            "bad_found": self.stats.bad_found,
            "last_pass_s": self.stats.last_pass_s,
        }

    def _check(self, chunk_id: str) -> tuple[bool | None, int]:
        """(whole?, bytes read); None if the chunk vanished (deleted meanwhile)."""
        path = layout.chunk_path(self.data_dir, chunk_id)
        try:
            size = path.stat().st_size
            return reads.verify_chunk(path), size
        except (FileNotFoundError, ChunkNotFound):
            return None, 0
        except TectonicError:
            return False, 0
        except OSError as e:
            log.warning("scrub: cannot read %s: %s", chunk_id, e)
            return False, 0

    async def scrub_pass(self) -> int:
        """Verify every chunk once, paced to ``rate``; returns how many bad chunks it found."""
        self.stats.pass_started = time.monotonic()
        found = 0
        still_bad: set[str] = set()
        after: str | None = ""
        budget_start = trio.current_time()
        spent = 0
        while after is not None:
            chunks, after = await trio.to_thread.run_sync(
                reads.list_chunks, self.data_dir, after, PAGE
            )
            for chunk_id, _length in chunks:
                ok, nbytes = await trio.to_thread.run_sync(self._check, chunk_id)
                if ok is None:
                    self.bad.pop(chunk_id, None)
                    continue
                self.stats.chunks_checked += 1
                self.stats.bytes_checked += nbytes
                if ok:
                    self.bad.pop(chunk_id, None)
                else:
                    still_bad.add(chunk_id)
                    if chunk_id not in self.bad:
                        self.bad[chunk_id] = "checksum"
                        self.stats.bad_found += 1
                        found += 1
                        log.warning("scrub: chunk %s failed its checksum", chunk_id)
                spent += nbytes
                if self.rate > 0:
                    ahead = spent / self.rate - (trio.current_time() - budget_start)
                    if ahead > 0:
                        await trio.sleep(ahead)
                else:
                    await trio.lowlevel.checkpoint()
        # Deleted by any means since it was found (repaired elsewhere): no longer reported.
        self.bad = {c: why for c, why in self.bad.items() if c in still_bad}
        self.stats.passes += 1
        self.stats.last_pass_s = time.monotonic() - self.stats.pass_started
        return found

    async def run(self) -> None:
        """Scrub forever: a pass, then wait out the rest of ``interval``."""
        if self.rate <= 0:
            return
        while True:
            started = time.monotonic()
            await self.scrub_pass()
            await trio.sleep(max(0.0, self.interval - (time.monotonic() - started)))
