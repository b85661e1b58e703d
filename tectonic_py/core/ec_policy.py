"""Erasure-coding policies: how a block is cut into chunks and how many may be lost.

``rs-K-M`` is Reed-Solomon with K data and M parity chunks (zfec k=K, n=K+M); ``r3`` is
plain three-way replication, which is zfec with k=1, n=3 (each "chunk" is the whole block).
A policy is a directory attribute inherited by the files created in it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tectonic_py.core.errors import InvalidArgument

_RS = re.compile(r"\Ars-(\d{1,2})-(\d{1,2})\Z")
_R = re.compile(r"\Ar(\d)\Z")


@dataclass(frozen=True)
class ECPolicy:
    k: int
    m: int

    @property
    def n(self) -> int:
        return self.k + self.m

    @property
    def replicated(self) -> bool:
        return self.k == 1

    @property
    def name(self) -> str:
        return f"r{self.n}" if self.k == 1 else f"rs-{self.k}-{self.m}"

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, text: str) -> ECPolicy:
        if not isinstance(text, str):
            raise InvalidArgument(f"EC policy must be a string, not {type(text).__name__}")
        t = text.strip().lower()
        if mt := _RS.match(t):
            k, m = int(mt.group(1)), int(mt.group(2))
            if not (1 <= k <= 32 and 1 <= m <= 16):
                raise InvalidArgument(f"EC policy {text!r}: need 1<=k<=32 and 1<=m<=16")
            return cls(k, m)
        if mt := _R.match(t):
            copies = int(mt.group(1))
            if not 2 <= copies <= 5:
                raise InvalidArgument(f"EC policy {text!r}: replication needs 2..5 copies")
            return cls(1, copies - 1)
        raise InvalidArgument(
            f"unknown EC policy {text!r}: use rs-K-M (e.g. rs-6-3, rs-10-4, rs-4-2) or r3"
        )


DEFAULT_POLICY = ECPolicy(6, 3)
