"""Chunk files on disk: the format, reads and their checks, the durable write protocol."""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import pytest
from chunkstore_helpers import (
    MiB,
    flip_byte,
    new_chunk,
    payload,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkstore import layout, reads, writes
from tectonic_py.core import buffers, ids
from tectonic_py.core.checksum import checksum as crc32c
from tectonic_py.core.errors import (
    ChunkCorrupt,
    ChunkNotFound,
    InvalidArgument,
)


def test_a_repeated_put_makes_the_chunks_name_durable(tmp_path, monkeypatch):
    """A retry of a put whose daemon died after its rename but before the directory fsync
    finds the file there; it must not be acknowledged before the name is durable."""
    data_dir = tmp_path / "d"
    writes.recover(data_dir)
    cid, _ = new_chunk(b"s" * 32)
    data = b"retried after a crash"
    writes.write_chunk(data_dir, cid, data, crc32c(data))
    synced: list[Path] = []
    monkeypatch.setattr(writes, "_fsync_dir", synced.append)
    assert writes.write_chunk(data_dir, cid, data, crc32c(data)) == writes.Stored(
        0, 0, written=False
    )
    assert synced == [layout.chunk_path(data_dir, cid).parent]


def test_a_repeated_delete_makes_the_removal_durable(tmp_path, monkeypatch):
    """The twin: a retried delete finds the chunk gone, perhaps not durably yet."""
    data_dir = tmp_path / "d"
    writes.recover(data_dir)
    cid, _ = new_chunk(b"s" * 32)
    data = b"deleted before a crash"
    writes.write_chunk(data_dir, cid, data, crc32c(data))
    assert writes.delete_chunk(data_dir, cid) == layout.file_size_for(len(data))
    synced: list[Path] = []
    monkeypatch.setattr(writes, "_fsync_dir", synced.append)
    assert writes.delete_chunk(data_dir, cid) is None
    assert synced == [layout.chunk_path(data_dir, cid).parent]
    monkeypatch.undo()
    shutil.rmtree(layout.chunk_path(data_dir, cid).parent)  # no shard directory at all
    assert writes.delete_chunk(data_dir, cid) is None


async def test_ranged_get_reads_only_the_segments_it_touches(tmp_path, secret, monkeypatch):
    data_dir = tmp_path / "d"
    cid, _ = new_chunk(secret)
    data = os.urandom(4 * MiB)
    writes.recover(data_dir)
    writes.write_chunk(data_dir, cid, data, crc32c(data))
    preads: list[int] = []
    real = os.preadv

    def counting(fd, bufs, offset):
        n = real(fd, bufs, offset)
        preads.append(n)
        return n

    monkeypatch.setattr(os, "preadv", counting)
    _, out, crc = reads.read_chunk(data_dir, cid, 1 * MiB + 100, 4096)
    assert bytes(out) == data[MiB + 100 : MiB + 100 + 4096] and crc == crc32c(out)
    assert sum(preads) == layout.SEGMENT_SIZE


def _packed_size(n: int) -> int:
    return layout.HEADER.size + 4 * layout.segment_count(n) + n


def test_layout_header_round_trip_both_versions():
    for n in [0, 1, 4095, 4096, 65536, 65537, 200_000, 4 * MiB, 4 * MiB + 1, 64 * MiB]:
        data = memoryview(bytearray(n))
        head = layout.encode_header(data, crc32c(data))
        version = struct.unpack_from("!H", head)[0]
        assert version == (2 if n and n % 4096 == 0 else 1) == layout.version_for(n)
        assert len(head) == layout.data_offset_for(n) == layout.file_size_for(n) - n
        h = layout.decode_header(head, len(head) + n)
        assert (h.length, h.version, h.data_offset) == (n, version, len(head))
        if version == 2:  # whole 4 KiB blocks, and no more of them than version 1 takes
            assert layout.file_size_for(n) % 4096 == 0
            assert layout.file_size_for(n) // 4096 == -(-_packed_size(n) // 4096)
        else:
            assert layout.file_size_for(n) == _packed_size(n)
            assert layout.length_from_file_size(layout.file_size_for(n)) == n
        with pytest.raises(ChunkCorrupt):
            layout.decode_header(head, len(head) + n + 1)
        with pytest.raises(ChunkCorrupt):
            layout.decode_header(b"\x00\x03" + head[2:])
    # Either version decodes whatever the length (readers take both).
    data = os.urandom(8192)
    packed = layout.encode_header(data, crc32c(data), version=1)
    assert layout.decode_header(packed, len(packed) + 8192).data_offset == 32 + 4
    # Padding of version 2 must be zeros, and must be there.
    aligned = layout.encode_header(data, crc32c(data))
    with pytest.raises(ChunkCorrupt, match="padding"):
        layout.decode_header(aligned[:100] + b"\x01" + aligned[101:])
    with pytest.raises(ChunkCorrupt, match="padding"):
        layout.decode_header(aligned[:100])


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 70 * MiB))
def test_file_size_inversion_property(n):
    """A version-1 file's size gives its length (the listing's estimate for a bad header)."""
    assert layout.length_from_file_size(_packed_size(n)) == n


def test_listing_reports_lengths_of_both_versions(tmp_path):
    data_dir = tmp_path / "d"
    writes.recover(data_dir)
    lengths = {}
    for n in [1, 4096, 8192, 65536, 100_000, MiB]:
        cid, _ = new_chunk(b"s" * 32)
        data = payload(n, n)
        writes.write_chunk(data_dir, cid, data, crc32c(data))
        lengths[cid] = n
        path = layout.chunk_path(data_dir, cid)
        assert path.stat().st_size == layout.file_size_for(n)
        assert bytes(reads.read_chunk(data_dir, cid)[1]) == data
    listed, nxt = reads.list_chunks(data_dir, "", 100)
    assert dict(listed) == lengths and nxt is None


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    size=st.integers(0, 5 * layout.SEGMENT_SIZE + 3),
    seed=st.integers(0, 250),
    ranges=st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), min_size=1, max_size=4),
    flip=st.one_of(st.none(), st.floats(0, 1)),
)
def test_layout_ranges_and_corruption_property(tmp_path_factory, size, seed, ranges, flip):
    """Any range reads back exactly; after any one flipped byte, no read returns bad bytes."""
    data_dir = tmp_path_factory.getbasetemp() / "layout-property"
    if not data_dir.exists():  # one store for all examples: recover() makes 256 directories
        writes.recover(data_dir)
    cid = ids.chunk_id(ids.new_id(), 0)
    data = payload(size, seed)
    writes.write_chunk(data_dir, cid, data, crc32c(data))
    path = layout.chunk_path(data_dir, cid)
    bad = None
    if flip is not None:
        bad = min(int(flip * path.stat().st_size), path.stat().st_size - 1)
        flip_byte(path, bad)
    header_len = layout.file_size_for(size) - size
    for a, b in [(0.0, 1.0), *ranges]:
        off = int(min(a, b) * size)
        n = int(max(a, b) * size) - off
        try:
            _, out, crc = reads.read_chunk(data_dir, cid, off, n)
        except ChunkCorrupt:
            assert bad is not None  # only damage is ever reported as damage
            continue
        # Whatever is returned is exactly the stored bytes, with their CRC.
        assert bytes(out) == data[off : off + n] and crc == crc32c(out)
        if bad is not None and bad < header_len:
            raise AssertionError("a damaged header went unnoticed")
    assert reads.verify_chunk(path) is (bad is None)


@pytest.mark.parametrize("length", [1, 4095, 65536, 4 * MiB, 4 * MiB + 777])
def test_put_written_from_its_file_image_with_o_direct(tmp_path, monkeypatch, length):
    data_dir = tmp_path / "d"
    writes.recover(data_dir)
    data = os.urandom(length)
    offset, size = layout.put_room(length)
    buf = buffers.SpareBuffers(0).take(max(size, buffers.SpareBuffers.MIN_SIZE))
    image = memoryview(buf)[:size]
    image[:] = b"\xee" * size  # stale bytes around the payload must not reach the file
    image[offset : offset + length] = data
    direct: list[bool] = []
    real = writes._write_direct
    monkeypatch.setattr(writes, "_write_direct", lambda *a: direct.append(real(*a)) or direct[-1])
    cid, _ = new_chunk(b"s" * 32)
    assert writes.write_chunk(data_dir, cid, image[offset : offset + length], crc32c(data), image)
    path = layout.chunk_path(data_dir, cid)
    assert path.stat().st_size == layout.file_size_for(length)
    assert reads.verify_chunk(path)
    assert bytes(reads.read_chunk(data_dir, cid)[1]) == data
    assert direct in ([True], [False])  # False only where the filesystem refuses O_DIRECT
    # An image that does not hold the payload at its place is not used: buffered write.
    other = os.urandom(length)
    cid2, _ = new_chunk(b"s" * 32)
    direct.clear()
    writes.write_chunk(data_dir, cid2, other, crc32c(other), image)
    assert direct == [] and bytes(reads.read_chunk(data_dir, cid2)[1]) == other


def _chunk_in_a_removed_shard_dir(data_dir: Path) -> str:
    """A new chunk id whose shard directory is empty, after removing that directory."""
    while True:
        cid, _ = new_chunk(b"s" * 32)
        shard = layout.chunk_path(data_dir, cid).parent
        if not any(shard.iterdir()):
            shard.rmdir()
            return cid


def test_a_put_remakes_a_shard_directory_removed_under_the_store(tmp_path):
    """New file by O_DIRECT image, new file buffered: each finds the chunk's shard directory
    gone, makes it again and stores the chunk."""
    data_dir = tmp_path / "d"
    writes.recover(data_dir)
    length = 8192
    data = payload(length, 7)
    offset, size = layout.put_room(length)
    image = memoryview(buffers.SpareBuffers(0).take(buffers.SpareBuffers.MIN_SIZE))[:size]
    image[offset : offset + length] = data
    for kw in ({"image": image}, {}):
        cid = _chunk_in_a_removed_shard_dir(data_dir)
        stored = writes.write_chunk(data_dir, cid, data, crc32c(data), **kw)
        assert stored.added_chunks == 1
        assert bytes(reads.read_chunk(data_dir, cid)[1]) == data


def test_recover_removes_the_spare_files_of_older_versions(tmp_path):
    data_dir = tmp_path / "d"
    spares = data_dir / "spares"
    spares.mkdir(parents=True)
    (spares / "spare-0").write_bytes(b"x" * 4096)
    (spares / "spare-1").write_bytes(b"")
    assert writes.recover(data_dir).temp_files_removed == 2
    assert not spares.exists()


@pytest.mark.parametrize("asked", ["none", "exact"])
@pytest.mark.parametrize("length", [64 * 1024, 4 * MiB, 4 * MiB + 777])
def test_whole_get_read_with_o_direct_into_an_aligned_buffer(tmp_path, monkeypatch, length, asked):
    data_dir = tmp_path / "d"
    writes.recover(data_dir)
    data = os.urandom(length)
    cid, _ = new_chunk(b"s" * 32)
    writes.write_chunk(data_dir, cid, data, crc32c(data))  # buffered: dirty pages, then O_DIRECT
    used: list[bool] = []
    real = reads._read_whole_direct

    def spy(*args):
        view = real(*args)
        used.append(view is not None)
        return view

    monkeypatch.setattr(reads, "_read_whole_direct", spy)
    spares = buffers.SpareBuffers(0)
    # The cluster client always sends the length (version 2 chunks too: 4 MiB).
    want = None if asked == "none" else length
    header, out, crc = reads.read_chunk(data_dir, cid, 0, want, alloc=spares.take)
    assert bytes(out) == data and crc == crc32c(data) and header.length == length
    assert used[0] or layout.chunk_path(data_dir, cid).stat().st_dev in layout.no_direct
    # A flipped byte on disk is caught on the O_DIRECT path too.
    path = layout.chunk_path(data_dir, cid)
    with open(path, "r+b") as f:
        f.seek(header.data_offset + length // 2)
        f.write(bytes([data[length // 2] ^ 1]))
    with pytest.raises(ChunkCorrupt):
        reads.read_chunk(data_dir, cid, alloc=spares.take)


def test_a_file_size_both_formats_fit_is_read_as_what_its_header_says(tmp_path):
    """8192 bytes is a version-2 chunk of 4096 or a version-1 chunk of 8156: a get at 0 of
    the other format's length is a ranged read (or past the end), never the whole chunk."""
    data_dir = tmp_path / "d"
    writes.recover(data_dir)
    assert set(layout.lengths_from_file_size(8192)) == {4096, 8156}
    v2, _ = new_chunk(b"s" * 32)
    small = payload(4096, 2)
    writes.write_chunk(data_dir, v2, small, crc32c(small))
    v1, _ = new_chunk(b"s" * 32)
    big = payload(8156, 1)
    writes.write_chunk(data_dir, v1, big, crc32c(big))
    for cid in (v1, v2):
        assert layout.chunk_path(data_dir, cid).stat().st_size == 8192
    header, out, crc = reads.read_chunk(data_dir, v1, 0, 4096)
    assert header.length == 8156 and bytes(out) == big[:4096] and crc == crc32c(big[:4096])
    with pytest.raises(InvalidArgument):
        reads.read_chunk(data_dir, v2, 0, 8156)
    assert bytes(reads.read_chunk(data_dir, v2, 0, 4096)[1]) == small


def _delete_and_put_another(data_dir: Path, deleted: str, other: str, data: bytes) -> None:
    """A delete of ``deleted`` and a put of ``other`` (once), while a reader has the deleted
    chunk's file open."""
    if not layout.chunk_path(data_dir, deleted).exists():
        return
    assert writes.delete_chunk(data_dir, deleted)
    assert writes.write_chunk(data_dir, other, data, crc32c(data)).added_chunks == 1


@pytest.mark.parametrize("when", ["before_header", "before_data"])
def test_a_read_racing_a_delete_says_not_found(tmp_path, monkeypatch, when):
    data_dir = tmp_path / "d"
    writes.recover(data_dir)
    a, _ = new_chunk(b"s" * 32)
    b, _ = new_chunk(b"s" * 32)
    data_a, data_b = payload(200_000, 1), payload(200_000, 2)
    writes.write_chunk(data_dir, a, data_a, crc32c(data_a))
    if when == "before_header":
        # The reader has opened a's file; then it is deleted (and b put) before the read:
        # a's bytes, which pass every checksum, from a file no name leads to any more.
        real = reads._read_open_chunk

        def racing(fd, *args):
            _delete_and_put_another(data_dir, a, b, data_b)
            return real(fd, *args)

        monkeypatch.setattr(reads, "_read_open_chunk", racing)
        alloc = bytearray
    else:
        # a's header was read, then a is deleted: what the reader got must say "not
        # found", not "corrupt" or a's bytes: nothing is wrong with any stored chunk.
        def alloc(n):
            _delete_and_put_another(data_dir, a, b, data_b)
            return bytearray(n)

    with pytest.raises(ChunkNotFound):
        reads.read_chunk(data_dir, a, alloc=alloc)
    with pytest.raises(ChunkNotFound):
        reads.read_chunk(data_dir, a)
    assert bytes(reads.read_chunk(data_dir, b)[1]) == data_b


def test_verify_of_a_chunk_deleted_meanwhile_is_not_found(tmp_path, monkeypatch):
    data_dir = tmp_path / "d"
    writes.recover(data_dir)
    a, _ = new_chunk(b"s" * 32)
    b, _ = new_chunk(b"s" * 32)
    data = payload(100_000, 4)
    writes.write_chunk(data_dir, a, data, crc32c(data))
    real = reads._verify_open_chunk

    def racing(fd, *args):
        _delete_and_put_another(data_dir, a, b, payload(100_000, 5))
        return real(fd, *args)

    monkeypatch.setattr(reads, "_verify_open_chunk", racing)
    with pytest.raises(ChunkNotFound):  # scrub then forgets it instead of reporting it bad
        reads.verify_chunk(layout.chunk_path(data_dir, a))
