"""Erasure coding of blocks with zfec, and chunk checksums, off the event loop.

zfec is systematic: of a block's n = k + m chunks, the first k are the block's own bytes cut
into k equal slices, so encoding produces only the m parity chunks and the data chunks are
memoryviews of the caller's block buffer (no copy). The CRC-32C of every chunk, and the table
of its 64 KiB segments' CRCs that the chunk store keeps on disk, are computed in the same
worker call and pass, while the data is hot in cache; the store takes the table from the put
(the frame's tag authenticates it with the bytes) instead of reading the chunk again. Replication (k = 1) skips zfec: every
"chunk" is the block itself.

zfec and crc32c release the GIL, so ``Codec`` runs them in ``trio.to_thread.run_sync`` under a
``CapacityLimiter`` sized to the cores: two blocks encode at once on a 2-core machine while the
event loop keeps sending. zfec allocates its parity outputs itself (its Python API has no
output-buffer argument); the large input buffers are reused by the client's buffer pool, where
most of the allocation cost of a block would otherwise be.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import trio
import zfec

from tectonic_py.core.checksum import SEGMENT_SIZE, checksum, pack_table, segment_checksums
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import InvalidArgument, QuorumLost

log = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview

_encoders: dict[tuple[int, int], zfec.Encoder] = {}
_decoders: dict[tuple[int, int], zfec.Decoder] = {}


def _encoder(policy: ECPolicy) -> zfec.Encoder:
    key = (policy.k, policy.n)
    enc = _encoders.get(key)
    if enc is None:
        enc = _encoders[key] = zfec.Encoder(policy.k, policy.n)
    return enc


def _decoder(policy: ECPolicy) -> zfec.Decoder:
    key = (policy.k, policy.n)
    dec = _decoders.get(key)
    if dec is None:
        dec = _decoders[key] = zfec.Decoder(policy.k, policy.n)
    return dec


@dataclass
class EncodedBlock:
    """The n chunks of a block (data chunks are views of the input), their CRC-32Cs and
    their segment tables (``checksum.pack_table``), made in the one pass that checksums."""

    chunks: list[Buffer]
    checksums: list[int]
    chunk_len: int
    tables: list[bytes]


def encode_block(policy: ECPolicy, block: Buffer, chunk_len: int) -> EncodedBlock:
    """Cut ``block`` (exactly ``k * chunk_len`` bytes, zero padded) into n checksummed chunks.

    Blocking; call it in a worker thread (``Codec.encode``).
    """
    view = memoryview(block).cast("B")
    k = policy.k
    if chunk_len < 1 or view.nbytes != k * chunk_len:
        raise InvalidArgument(f"block of {view.nbytes} bytes is not {k} chunks of {chunk_len}")
    data = tuple(view[i * chunk_len : (i + 1) * chunk_len] for i in range(k))
    if policy.replicated:
        crcs, crc = segment_checksums(view, SEGMENT_SIZE)
        table = pack_table(crcs)
        return EncodedBlock([view] * policy.n, [crc] * policy.n, chunk_len, [table] * policy.n)
    parity = _encoder(policy).encode(data, tuple(range(k, policy.n)))
    chunks: list[Buffer] = [*data, *parity]
    sums = [segment_checksums(c, SEGMENT_SIZE) for c in chunks]
    return EncodedBlock(
        chunks, [whole for _, whole in sums], chunk_len, [pack_table(t) for t, _ in sums]
    )


def decode_into(
    policy: ECPolicy,
    chunks: Mapping[int, Buffer],
    chunk_len: int,
    out: memoryview,
    in_place: AbstractSet[int] = frozenset(),
) -> None:
    """Rebuild the k data chunks of a block from any k of its chunks into ``out``.

    ``out`` is ``k * chunk_len`` bytes. ``in_place`` names data chunks that are already at
    their place in ``out`` (the reader receives data chunks straight into it), so only the
    others are written. Blocking; call it in a worker thread (``Codec.decode_into``).
    """
    k = policy.k
    if len(chunks) < k:
        raise QuorumLost(f"{len(chunks)} chunks left of a block that needs {k}")
    if out.nbytes != k * chunk_len:
        raise InvalidArgument(f"output of {out.nbytes} bytes is not {k} chunks of {chunk_len}")
    for idx, c in chunks.items():
        if not 0 <= idx < policy.n or memoryview(c).nbytes != chunk_len:
            raise InvalidArgument(f"chunk {idx} is not a chunk of {chunk_len} bytes of {policy}")
    todo = [i for i in range(k) if i not in in_place]
    if not todo:
        return
    if policy.replicated:
        out[:] = memoryview(next(iter(chunks.values()))).cast("B")
        return
    if all(i in chunks for i in todo):
        for i in todo:
            out[i * chunk_len : (i + 1) * chunk_len] = memoryview(chunks[i]).cast("B")
        return
    # Prefer data chunks (zfec passes them through), then the lowest parity chunks.
    use = sorted(chunks)[:k]
    recovered = _decoder(policy).decode(tuple(chunks[i] for i in use), tuple(use))
    for i in todo:
        out[i * chunk_len : (i + 1) * chunk_len] = memoryview(recovered[i]).cast("B")


def verify(data: Buffer, expected: int) -> bool:
    return checksum(data) == expected


class Codec:
    """zfec and CRC-32C in worker threads, at most ``threads`` at once."""

    def __init__(self, threads: int = 2) -> None:
        self.limiter = trio.CapacityLimiter(max(1, threads))

    async def encode(self, policy: ECPolicy, block: Buffer, chunk_len: int) -> EncodedBlock:
        return await trio.to_thread.run_sync(
            encode_block, policy, block, chunk_len, limiter=self.limiter
        )

    async def decode_into(
        self,
        policy: ECPolicy,
        chunks: Mapping[int, Buffer],
        chunk_len: int,
        out: memoryview,
        in_place: AbstractSet[int] = frozenset(),
    ) -> None:
        await trio.to_thread.run_sync(
            decode_into, policy, chunks, chunk_len, out, in_place, limiter=self.limiter
        )

    async def checksum(self, piece: Buffer) -> int:
        """CRC-32C of one piece (a chunk read from a store), on the codec's threads."""
        return (await self.checksums([piece]))[0]

    async def checksums(self, pieces: Sequence[Buffer]) -> list[int]:
        """CRC-32C of each piece in one worker call (small pieces are not worth a thread)."""
        total = sum(memoryview(p).nbytes for p in pieces)
        if total < 256 * 1024:
            return [checksum(p) for p in pieces]
        return await trio.to_thread.run_sync(
            lambda: [checksum(p) for p in pieces], limiter=self.limiter
        )
