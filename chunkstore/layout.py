"""The on-disk format of one chunk: its byte table, sizes and where its file lives.

A chunk file holds a small header, a table of per-segment CRCs, then the chunk's bytes.
Integers are big-endian; the version field comes first so a later format can be told apart
by reading two bytes::

    offset    size  field
    0         2     version        1 (packed) or 2 (aligned)
    2         6     magic          b"TCHUNK"
    8         8     length         L, bytes of chunk data
    16        4     checksum       crc32c of the whole chunk (what the client sent and the
                                   Block layer records)
    20        4     segment_size   S (65536)
    24        4     segments       N = ceil(L / S)
    28        4     header_crc     crc32c of bytes 0..27 followed by the segment table
    32        4*N   segment table  crc32c of each S-byte segment (the last may be shorter)
    32+4N     P     padding        zeros: none in version 1; up to the next multiple of
                                   4096 in version 2
    D         L     data           D = 32+4N+P (the data offset)

Version 2 is written for chunks whose length is a multiple of 4096 (every full chunk of a
block): the file is then a whole number of 4 KiB blocks, so a put writes it with one
O_DIRECT write and no ``ftruncate``, whose cut inside the last block made ext4 read that
block back from disk (a synchronous read per put) and dirty it for the fsync to write
again; it takes the same number of disk blocks as version 1. Other lengths get version 1.
Readers take both; the padding must be zeros.

Why segments: a ranged get of 4 KiB must not read and checksum a whole 4 MiB chunk, yet must
never return unverified bytes; it reads and verifies only the segments it touches
(``chunkstore.reads``). The header has its own CRC, so a flipped bit in the length or the
table is reported as corruption rather than misread.

Files live under ``<data_dir>/chunks/<2 hex chars>/<chunk id>`` (the first two characters of
the chunk id, which come from its random block id), so no directory holds millions of
entries, and a listing in chunk-id order can walk the shard directories in order. How they
are written durably is ``chunkstore.writes``.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tectonic_py.core.checksum import SEGMENT_SIZE, pack_table, segment_checksums
from tectonic_py.core.checksum import checksum as crc32c
from tectonic_py.core.errors import ChunkCorrupt, InvalidArgument
from tectonic_py.core.ids import parse_chunk_id

VERSION_PACKED = 1
VERSION_ALIGNED = 2
VERSIONS = (VERSION_PACKED, VERSION_ALIGNED)
MAGIC = b"TCHUNK"
HEADER = struct.Struct("!H6sQIIII")
HEADER_CRC_OFFSET = 28
TMP_PREFIX = ".tmp-"
MAX_CHUNK_ID_LEN = 24
DIRECT_ALIGN = 4096  # O_DIRECT alignment of memory, file offsets and lengths
DIRECT_MIN = 64 * 1024  # smaller chunks are read buffered (not worth a page-aligned buffer)
Buffer = bytes | bytearray | memoryview | mmap.mmap
# Devices (st_dev) where O_DIRECT was refused (EINVAL: e.g. an older tmpfs): reads and
# writes there are buffered.
no_direct: set[int] = set()


@dataclass(frozen=True)
class ChunkHeader:
    """The parsed, CRC-checked header of a chunk file."""

    length: int
    checksum: int
    segment_size: int
    segment_crcs: tuple[int, ...]
    version: int = VERSION_PACKED

    @property
    def data_offset(self) -> int:
        return _data_offset(self.version, len(self.segment_crcs))

    @property
    def file_size(self) -> int:
        return self.data_offset + self.length


def direct_span(nbytes: int) -> int:
    """``nbytes`` rounded up to whole O_DIRECT blocks: the buffer a whole-file O_DIRECT
    read of a file of that size needs, or the image a put writes."""
    return -(-nbytes // DIRECT_ALIGN) * DIRECT_ALIGN


def _data_offset(version: int, nseg: int) -> int:
    table_end = HEADER.size + 4 * nseg
    if version == VERSION_ALIGNED:
        return direct_span(table_end)
    return table_end


def segment_count(length: int, segment_size: int = SEGMENT_SIZE) -> int:
    return -(-length // segment_size)


def version_for(length: int) -> int:
    """The format a chunk of ``length`` bytes is written in (module docstring)."""
    return VERSION_ALIGNED if length and length % DIRECT_ALIGN == 0 else VERSION_PACKED


def data_offset_for(length: int) -> int:
    return _data_offset(version_for(length), segment_count(length))


def file_size_for(length: int) -> int:
    """Bytes a chunk of ``length`` bytes takes on disk (before filesystem rounding)."""
    return data_offset_for(length) + length


def length_from_file_size(size: int) -> int:
    """The length of a version-1 chunk file of ``size`` bytes (a listing's estimate for a
    file whose header cannot be read).

    With n segments the file holds 32 + 4n + L bytes, L in ((n-1)S, nS], so
    n = ceil((size - 32) / (S + 4)) exactly.
    """
    body = max(size - HEADER.size, 0)
    n = -(-body // (SEGMENT_SIZE + 4))
    return max(body - 4 * n, 0)


def lengths_from_file_size(size: int) -> tuple[int, ...]:
    """Every chunk length a file of ``size`` bytes can hold (one per format version that
    fits), so a get can tell from a stat alone whether it asks for the whole chunk.

    Why: the cluster client always sends the length it wants; a check that knew only
    version-1 sizes sent every whole-chunk get of a version-2 chunk down the buffered
    path (a copy out of the page cache on every get of a restore)."""
    out = [length_from_file_size(size)]
    pad_end = direct_span(HEADER.size + 4)
    # A chunk shorter than the file has no more segments, so no larger data offset, than
    # one as long as the file: a bound of one or two steps, not a walk over the file.
    last = _data_offset(VERSION_ALIGNED, segment_count(size))
    while pad_end <= last and pad_end < size:
        length = size - pad_end
        if version_for(length) == VERSION_ALIGNED and file_size_for(length) == size:
            out.append(length)
            break
        pad_end += DIRECT_ALIGN
    return tuple(out)


def encode_header(
    data: memoryview | bytes | bytearray,
    whole_crc: int,
    segment_crcs: Sequence[int] | None = None,
    version: int | None = None,
) -> bytes:
    """Everything in front of ``data`` in its chunk file (header, segment table, padding:
    ``data_offset_for(len(data))`` bytes), for data whose crc32c the caller already checked.

    ``segment_crcs``: the table, when the caller already has it (``write_chunk`` gets it in
    the same pass that checks the whole CRC); computed here otherwise. ``version``: the
    format (``version_for`` the length if None).
    """
    view = memoryview(data).cast("B")
    length = len(view)
    if segment_crcs is None:
        crcs = list(segment_checksums(view, SEGMENT_SIZE)[0])
    else:
        crcs = list(segment_crcs)
        if len(crcs) != segment_count(length):
            raise InvalidArgument(f"{len(crcs)} segment CRCs for {length} bytes")
    if version is None:
        version = version_for(length)
    table = pack_table(crcs)
    head = HEADER.pack(version, MAGIC, length, whole_crc, SEGMENT_SIZE, len(crcs), 0)
    hcrc = crc32c(table, crc32c(head[:HEADER_CRC_OFFSET]))
    prefix = head[:HEADER_CRC_OFFSET] + struct.pack("!I", hcrc) + table
    return prefix + bytes(_data_offset(version, len(crcs)) - len(prefix))


def decode_header(buf: bytes, file_size: int | None = None) -> ChunkHeader:
    """Parse and check a header; ``buf`` must start at offset 0 and hold everything up to
    the data (``header_bytes_needed``).

    Raises ChunkCorrupt for anything that is not a well-formed version-1 or 2 header.
    """
    if len(buf) < HEADER.size:
        raise ChunkCorrupt("chunk file shorter than its header")
    version, magic, length, whole, seg_size, nseg, hcrc = HEADER.unpack_from(buf)
    if version not in VERSIONS or magic != MAGIC:
        raise ChunkCorrupt(f"not a chunk file (version {version}, magic {magic!r})")
    if seg_size != SEGMENT_SIZE or nseg != segment_count(length, seg_size):
        raise ChunkCorrupt("chunk header has an inconsistent segment table")
    end = HEADER.size + 4 * nseg
    if len(buf) < end:
        raise ChunkCorrupt("chunk file shorter than its segment table")
    table = buf[HEADER.size : end]
    if crc32c(table, crc32c(buf[:HEADER_CRC_OFFSET])) != hcrc:
        raise ChunkCorrupt("chunk header failed its checksum")
    header = ChunkHeader(length, whole, seg_size, struct.unpack(f"!{nseg}I", table), version)
    data_offset = header.data_offset
    if data_offset > end:
        if len(buf) < data_offset:
            raise ChunkCorrupt("chunk file shorter than its header's padding")
        if buf[end:data_offset] != _ZEROS[: data_offset - end]:
            raise ChunkCorrupt("chunk header padding is not zeros")
    if file_size is not None and file_size != header.file_size:
        raise ChunkCorrupt(f"chunk file is {file_size} bytes, header says {header.file_size}")
    return header


def header_bytes_needed(prefix: bytes | memoryview) -> int:
    """How many bytes from offset 0 ``decode_header`` needs, from the first 32 (or fewer,
    then 32: the caller finds the file too short)."""
    if len(prefix) < HEADER.size:
        return HEADER.size
    version, nseg = struct.unpack_from("!H", prefix)[0], struct.unpack_from("!I", prefix, 24)[0]
    return _data_offset(version if version in VERSIONS else VERSION_PACKED, nseg)


_ZEROS = bytes(2 * DIRECT_ALIGN)


def put_room(length: int) -> tuple[int, int]:
    """Where a received payload of ``length`` bytes should sit in a page-aligned buffer so
    that the buffer is already the chunk file's image: (offset of the data = header size,
    buffer size = file size rounded up to ``DIRECT_ALIGN``). The RPC server receives a put
    into such a buffer (``rpc_server.RpcServer(payload_room=...)``) and ``write_chunk`` writes
    it with O_DIRECT, so the bytes never pass through the page cache."""
    offset = data_offset_for(length)
    return offset, direct_span(offset + length)


# --- paths ----------------------------------------------------------------------------------


def validate_chunk_id(chunk_id: object) -> str:
    """Return ``chunk_id`` if it is exactly a chunk id, else InvalidArgument.

    Only ``<16 hex>.<index>`` passes (tectonic_py.core.ids), so no id can hold '/', '..', NUL or
    an absolute path, and none can name a temporary file.
    """
    if not isinstance(chunk_id, str) or len(chunk_id) > MAX_CHUNK_ID_LEN:
        raise InvalidArgument("invalid chunk id")
    try:
        parse_chunk_id(chunk_id)
    except ValueError as e:
        raise InvalidArgument(str(e)) from None
    return chunk_id


def chunks_root(data_dir: Path) -> Path:
    return data_dir / "chunks"


def shard_dir(data_dir: Path, chunk_id: str) -> Path:
    return chunks_root(data_dir) / chunk_id[:2]


def chunk_path(data_dir: Path, chunk_id: str) -> Path:
    """The file of a (validated) chunk id; checked again to lie inside the data directory."""
    path = shard_dir(data_dir, validate_chunk_id(chunk_id)) / chunk_id
    if path.parent.parent != chunks_root(data_dir):
        raise InvalidArgument("invalid chunk id")
    return path
