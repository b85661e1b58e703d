"""Striping maths: every file byte maps to exactly one block byte and one data-chunk byte."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tectonic_py.client.stripe import Layout, chunk_len_for, chunk_ranges
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import InvalidArgument

policies = st.sampled_from([ECPolicy(6, 3), ECPolicy(10, 4), ECPolicy(4, 2), ECPolicy(1, 2)])


@given(policies, st.integers(1, 64), st.integers(0, 5000), st.integers(0, 5000))
def test_pieces_tile_the_range(policy, chunk_size, offset, length):
    layout = Layout(policy, chunk_size)
    pieces = layout.pieces(offset, length)
    assert sum(p.length for p in pieces) == length
    pos = offset
    for p in pieces:
        assert p.length > 0
        assert 0 <= p.block_offset < layout.block_size
        assert p.block_offset + p.length <= layout.block_size
        assert layout.block_start(p.block_index) + p.block_offset == pos
        assert p.out_offset == pos - offset
        pos += p.length


@given(st.integers(1, 16), st.integers(0, 10_000))
def test_chunk_len_covers_data_with_under_k_pad(k, data_len):
    cl = chunk_len_for(data_len, k)
    assert k * cl >= data_len
    assert k * cl - data_len < k


@given(st.integers(1, 12), st.integers(1, 300), st.data())
def test_chunk_ranges_tile_block_range(k, chunk_len, data):
    total = k * chunk_len
    off = data.draw(st.integers(0, total))
    length = data.draw(st.integers(0, total - off))
    ranges = chunk_ranges(chunk_len, off, length, k)
    assert sum(r.length for r in ranges) == length
    pos = off
    for r in ranges:
        assert 0 <= r.chunk_index < k
        assert 0 <= r.chunk_offset and r.chunk_offset + r.length <= chunk_len
        assert r.chunk_index * chunk_len + r.chunk_offset == pos
        pos += r.length


def test_boundaries_at_k_times_c():
    layout = Layout(ECPolicy(6, 3), 4)
    bs = layout.block_size
    assert [p.block_index for p in layout.pieces(bs - 1, 2)] == [0, 1]
    assert layout.blocks_in(0) == 0
    assert layout.blocks_in(bs) == 1
    assert layout.blocks_in(bs + 1) == 2
    assert layout.block_data_len(1, bs + 1) == 1
    assert layout.block_data_len(2, bs + 1) == 0


def test_bad_inputs_are_refused():
    layout = Layout(ECPolicy(6, 3), 4)
    with pytest.raises(InvalidArgument):
        layout.pieces(-1, 3)
    with pytest.raises(InvalidArgument):
        chunk_ranges(4, 20, 5, 6)
    with pytest.raises(InvalidArgument):
        Layout(ECPolicy(6, 3), 0)
    with pytest.raises(InvalidArgument):
        chunk_len_for(-1, 3)
