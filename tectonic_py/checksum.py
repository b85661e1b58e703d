"""End-to-end chunk checksums: CRC-32C (hardware accelerated by the crc32c package).

The client computes a chunk's checksum right after encoding, the chunk store verifies it on
put and on every read from disk, and the Block layer records it, so a chunk is checked at
every hop from the writer's memory to the reader's. crc32c releases the GIL on large buffers,
so these calls run in worker threads alongside zfec.
"""

from __future__ import annotations

from crc32c import crc32c as _crc32c


def checksum(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC-32C of ``data``, continuing from ``value`` (for streaming over pieces)."""
    return _crc32c(data, value)
