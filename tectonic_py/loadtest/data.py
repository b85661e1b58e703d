"""The deterministic bytes of a rank's shard: a function of (seed, step, rank), so writers
keep only a checksum and the restore can check every byte against it.

Each 1 MiB piece is a 24-byte tag (seed, step, rank, piece) followed by a slice of a random
pool at an offset derived from the tag: a misplaced, stale or swapped piece changes the
checksum, and no two pieces of any rank or step are the same.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable

from tectonic_py.loadtest.config import PIECE, POOL_SIZE, TAG


class ShardData:
    """Generates the bytes of (seed, step, rank) piece by piece without keeping them.

    One random pool per process (from the seed); each piece is a 24-byte tag and a pool
    slice chosen by hashing the tag, so every piece of every rank and step differs.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        rng = random.Random(seed)
        pool = rng.randbytes(POOL_SIZE)
        self.pool = memoryview(pool + pool[:PIECE])  # a slice may wrap around

    def piece(self, step: int, rank: int, index: int, length: int, out: bytearray) -> memoryview:
        """Fill ``out`` with piece ``index`` (``length`` bytes) and return a view of it."""
        tag = TAG.pack(self.seed, step, rank, index)
        offset = int.from_bytes(hashlib.blake2b(tag, digest_size=8).digest(), "big") % POOL_SIZE
        view = memoryview(out)
        head = min(length, TAG.size)
        view[:head] = tag[:head]
        if length > head:
            view[head:length] = self.pool[offset : offset + length - head]
        return view[:length]

    def pieces(self, step: int, rank: int, size: int, out: bytearray) -> Iterable[memoryview]:
        for index in range(-(-size // PIECE)):
            yield self.piece(step, rank, index, min(PIECE, size - index * PIECE), out)
