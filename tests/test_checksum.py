"""CRC-32C helpers: segment CRCs and the whole CRC from one pass, CRC combination, and the
whole CRC from a carried segment table."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tectonic_py.core.checksum import (
    checksum,
    combine,
    pack_table,
    segment_checksums,
    unpack_table,
    whole_from_table,
)
from tectonic_py.core.errors import InvalidArgument


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=5000), segment=st.sampled_from([1, 7, 64, 512, 4096]))
def test_segment_checksums_match_separate_passes(data: bytes, segment: int) -> None:
    crcs, whole = segment_checksums(data, segment)
    assert whole == checksum(data)
    assert crcs == [checksum(data[i : i + segment]) for i in range(0, len(data), segment)]


def test_segment_checksums_of_a_chunk_sized_buffer() -> None:
    data = bytes(range(256)) * (4 * 4096 + 3)  # 4 MiB + 768 bytes: a short last segment
    crcs, whole = segment_checksums(memoryview(data), 65536)
    assert whole == checksum(data) and len(crcs) == 65
    assert crcs[-1] == checksum(data[64 * 65536 :])


@settings(max_examples=60, deadline=None)
@given(a=st.binary(max_size=300), b=st.binary(max_size=300))
def test_combine_is_the_crc_of_the_concatenation(a: bytes, b: bytes) -> None:
    assert combine(checksum(a), checksum(b), len(b)) == checksum(a + b)


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=5000), segment=st.sampled_from([7, 64, 512]))
def test_a_segment_table_gives_the_whole_crc_and_catches_a_wrong_tail(
    data: bytes, segment: int
) -> None:
    crcs, whole = segment_checksums(data, segment)
    assert pack_table(crcs) == b"".join(c.to_bytes(4, "big") for c in crcs)
    assert unpack_table(pack_table(crcs)) == crcs
    assert whole_from_table(crcs, data, segment) == whole
    assert whole_from_table([*crcs, 0], data, segment) is None  # one entry too many
    if len(data) % segment:
        assert whole_from_table([*crcs[:-1], crcs[-1] ^ 1], data, segment) is None


def test_a_table_that_is_not_whole_crcs_is_refused() -> None:
    with pytest.raises(InvalidArgument):
        unpack_table(b"\0" * 7)
