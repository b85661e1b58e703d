"""End-to-end chunk checksums: CRC-32C (hardware accelerated by the crc32c package).

The client computes a chunk's checksum right after encoding, the chunk store verifies it on
put and on every read from disk, and the Block layer records it, so a chunk is checked at
every hop from the writer's memory to the reader's. crc32c releases the GIL on large buffers,
so these calls run in worker threads alongside zfec.

``segment_checksums`` gives the CRCs of fixed-size segments *and* the CRC of the whole in one
pass over the bytes: the whole-buffer CRC is combined from the segment CRCs (the
CRC of A||B is a linear function of crc(A), xor crc(B)) instead of being computed by a
second pass. The chunk store needs both for every put, and the CRC instruction, not memory,
bounds their speed, so a second pass would cost as much again.
"""

from __future__ import annotations

import mmap
import struct

from crc32c import crc32c as _crc32c

from tectonic_py.core.errors import InvalidArgument

_MASK = 0xFFFFFFFF

# The chunk file's segment: a ranged read checks only the segments it touches. The writer
# computes the table in its encoding pass and sends it with the put (``pack_table``), so the
# store does not read the chunk's bytes again to make it.
SEGMENT_SIZE = 64 * 1024

# Up to this many bytes, a CRC computed while holding the GIL (about 50 microseconds per MiB)
# costs the other threads less than the GIL hand-offs of releasing it; callers that share
# the GIL with busy threads (the chunk store's event loop and disk threads) pass
# ``keep_gil=`` on that bound.
KEEP_GIL_MAX = 1024 * 1024 + 64 * 1024


def _gil_release_mode(keep_gil: bool) -> int:
    return 0 if keep_gil else -1  # crc32c: 0 never releases; -1 releases for large buffers


def checksum(
    data: bytes | bytearray | memoryview | mmap.mmap, value: int = 0, *, keep_gil: bool = False
) -> int:
    """CRC-32C of ``data``, continuing from ``value`` (for streaming over pieces).

    ``keep_gil``: do not release the GIL even for a large buffer (see ``segment_checksums``)."""
    return _crc32c(data, value, gil_release_mode=_gil_release_mode(keep_gil))


class _Shift:
    """The linear map crc(A) -> crc(A || zeros(n)) xor crc(zeros(n)), as four byte tables.

    Appending ``n`` bytes multiplies the CRC register by x^(8n) modulo the polynomial, a
    GF(2)-linear map of the 32-bit value; the CRC's pre- and post-inversion cancel out of
    crc(A||B) = shift_n(crc(A)) ^ crc(B) (as in zlib's crc32_combine). The map's image of
    each of the 32 unit vectors is found with crc32c itself over n zero bytes, and the
    tables make applying it four lookups.
    """

    def __init__(self, n: int) -> None:
        zeros = bytes(n)
        # The bare register update over n zero bytes: crc32c inverts on the way in and out.
        basis = [(~_crc32c(zeros, ~(1 << i) & _MASK)) & _MASK for i in range(32)]
        self.tables: list[list[int]] = []
        for byte in range(4):
            table = [0] * 256
            for b in range(1, 256):
                low = b & -b
                table[b] = table[b ^ low] ^ basis[8 * byte + low.bit_length() - 1]
            self.tables.append(table)

    def __call__(self, crc: int) -> int:
        t0, t1, t2, t3 = self.tables
        return t0[crc & 0xFF] ^ t1[(crc >> 8) & 0xFF] ^ t2[(crc >> 16) & 0xFF] ^ t3[crc >> 24]


_shifts: dict[int, _Shift] = {}


def _shift(n: int) -> _Shift:
    shift = _shifts.get(n)
    if shift is None:
        shift = _Shift(n)
        if len(_shifts) < 64:  # a few fixed segment sizes in practice; never unbounded
            _shifts[n] = shift
    return shift


def _of_full_segments(crcs: list[int], segment_size: int) -> int:
    """The CRC-32C of consecutive ``segment_size``-byte segments from their CRCs."""
    shift = _shift(segment_size)
    whole = 0
    for c in crcs:
        whole = shift(whole) ^ c
    return whole


def pack_table(crcs: list[int]) -> bytes:
    """A segment table on the wire and on disk: big-endian 32-bit CRCs."""
    return struct.pack(f"!{len(crcs)}I", *crcs)


def unpack_table(raw: bytes) -> list[int]:
    if len(raw) % 4:
        raise InvalidArgument(f"a segment table of {len(raw)} bytes is not 4-byte CRCs")
    return list(struct.unpack(f"!{len(raw) // 4}I", raw))


def whole_from_table(
    crcs: list[int], data: bytes | bytearray | memoryview, segment_size: int = SEGMENT_SIZE
) -> int | None:
    """The CRC-32C of ``data`` from a table of its segments' CRCs, reading only a short last
    segment (which it checks against the table's last entry); None when the table does not
    fit ``data``'s length or its last entry is wrong.

    Why trust the full segments' entries unread: the table came in the same authenticated
    frame as the bytes, computed by the writer over those very bytes."""
    view = memoryview(data).cast("B")
    full, tail = divmod(len(view), segment_size)
    if len(crcs) != full + (1 if tail else 0):
        return None
    whole = _of_full_segments(crcs[:full], segment_size)
    if tail:
        piece = view[full * segment_size :]
        if _crc32c(piece) != crcs[full]:
            return None
        whole = _crc32c(piece, whole)
    return whole


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC-32C of A||B from crc(A), crc(B) and len(B), without touching the bytes.

    Each distinct ``len_b`` builds (and caches) a table once, so it suits the few fixed
    segment sizes of a chunk format, not arbitrary lengths.
    """
    if len_b == 0:
        return crc_a
    return _shift(len_b)(crc_a) ^ crc_b


def segment_checksums(
    data: bytes | bytearray | memoryview, segment_size: int, *, keep_gil: bool = False
) -> tuple[list[int], int]:
    """(CRC-32C of each ``segment_size`` piece of ``data`` (the last may be shorter), CRC-32C
    of all of ``data``), reading every byte once.

    ``keep_gil``: do not release the GIL for each segment. crc32c releases it for pieces of
    32 KiB and more, and with 64 KiB segments that is 16 hand-offs per MiB, each a context
    switch when other threads wait for the GIL (the chunk store's put path); a segment takes
    about 3 microseconds, so holding the GIL costs other threads less than giving it away."""
    view = memoryview(data).cast("B")
    length = len(view)
    full = length - length % segment_size
    mode = _gil_release_mode(keep_gil)
    crcs = [
        _crc32c(view[i : i + segment_size], 0, gil_release_mode=mode)
        for i in range(0, full, segment_size)
    ]
    whole = _of_full_segments(crcs, segment_size)
    if full < length:
        # The short tail: a second pass over < segment_size bytes beats a table for an
        # arbitrary length.
        tail = view[full:]
        crcs.append(_crc32c(tail))
        whole = _crc32c(tail, whole)
    return crcs, whole
