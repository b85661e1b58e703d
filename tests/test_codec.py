"""zfec coding: any k of n chunks rebuild the block; checksums match; bad shapes are refused."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tectonic_py.client.codec import Codec, decode_into, encode_block
from tectonic_py.client.stripe import chunk_len_for
from tectonic_py.core.checksum import checksum
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import InvalidArgument, QuorumLost

policies = st.sampled_from([ECPolicy(6, 3), ECPolicy(10, 4), ECPolicy(4, 2), ECPolicy(1, 2)])


def _padded(data: bytes, k: int) -> tuple[bytearray, int]:
    cl = max(1, chunk_len_for(len(data), k))
    buf = bytearray(k * cl)
    buf[: len(data)] = data
    return buf, cl


@settings(max_examples=60, deadline=None)
@given(policies, st.binary(min_size=0, max_size=3000), st.data())
def test_any_k_chunks_rebuild_the_block(policy, data, draw):
    buf, cl = _padded(data, policy.k)
    enc = encode_block(policy, buf, cl)
    assert len(enc.chunks) == policy.n
    for c, crc in zip(enc.chunks, enc.checksums):
        assert len(memoryview(c)) == cl and checksum(c) == crc
    # Data chunks are views of the block (systematic code, no copy).
    assert b"".join(bytes(c) for c in enc.chunks[: policy.k]) == bytes(buf)
    keep = draw.draw(st.permutations(range(policy.n)))[: policy.k]
    out = memoryview(bytearray(policy.k * cl))
    decode_into(policy, {i: bytes(enc.chunks[i]) for i in keep}, cl, out)
    assert bytes(out[: len(data)]) == data


@settings(max_examples=60, deadline=None)
@given(policies, st.binary(min_size=1, max_size=3000), st.data())
def test_a_range_of_a_lost_chunk_follows_from_the_same_range_of_k_others(policy, data, draw):
    """What a degraded range read relies on (client/range_rebuild.py): the code is bytewise,
    so bytes [a, a + L) of k chunks rebuild bytes [a, a + L) of the lost one."""
    buf, cl = _padded(data, policy.k)
    enc = encode_block(policy, buf, cl)
    lost = draw.draw(st.integers(0, policy.k - 1))
    a = draw.draw(st.integers(0, cl - 1))
    n = draw.draw(st.integers(1, cl - a))
    others = [i for i in draw.draw(st.permutations(range(policy.n))) if i != lost][: policy.k]
    pieces = {i: bytes(memoryview(enc.chunks[i])[a : a + n]) for i in others}
    out = memoryview(bytearray(policy.k * n))
    in_place = frozenset(range(policy.k)) - {lost}
    decode_into(policy, pieces, n, out, in_place)
    assert bytes(out[lost * n : (lost + 1) * n]) == bytes(buf[lost * cl + a : lost * cl + a + n])


def test_every_loss_pattern_rs_4_2():
    policy = ECPolicy(4, 2)
    buf, cl = _padded(bytes(range(256)) * 3, 4)
    enc = encode_block(policy, buf, cl)
    for keep in itertools.combinations(range(6), 4):
        out = memoryview(bytearray(4 * cl))
        decode_into(policy, {i: enc.chunks[i] for i in keep}, cl, out)
        assert bytes(out) == bytes(buf)


def test_in_place_chunks_are_not_rewritten():
    policy = ECPolicy(6, 3)
    buf, cl = _padded(b"x" * 600, 6)
    enc = encode_block(policy, buf, cl)
    out = memoryview(bytearray(6 * cl))
    out[0:cl] = enc.chunks[0]
    chunks = {0: out[0:cl], **{i: enc.chunks[i] for i in (2, 3, 4, 5, 8)}}
    decode_into(policy, chunks, cl, out, in_place={0})
    assert bytes(out) == bytes(buf)


def test_too_few_chunks_is_quorum_lost():
    policy = ECPolicy(6, 3)
    buf, cl = _padded(b"y" * 60, 6)
    enc = encode_block(policy, buf, cl)
    with pytest.raises(QuorumLost):
        decode_into(policy, {i: enc.chunks[i] for i in range(5)}, cl, memoryview(bytearray(60)))


def test_bad_shapes_are_refused():
    policy = ECPolicy(6, 3)
    with pytest.raises(InvalidArgument):
        encode_block(policy, bytearray(61), 10)
    buf, cl = _padded(b"z" * 60, 6)
    enc = encode_block(policy, buf, cl)
    chunks = {i: enc.chunks[i] for i in range(6)}
    chunks[1] = b"short"
    with pytest.raises(InvalidArgument):
        decode_into(policy, chunks, cl, memoryview(bytearray(60)))


async def test_codec_runs_in_threads():
    codec = Codec(threads=2)
    policy = ECPolicy(6, 3)
    buf, cl = _padded(bytes(range(256)) * 1000, 6)
    enc = await codec.encode(policy, buf, cl)
    out = memoryview(bytearray(len(buf)))
    await codec.decode_into(policy, {i: enc.chunks[i] for i in range(3, 9)}, cl, out)
    assert bytes(out) == bytes(buf)
    assert await codec.checksums([buf, b"abc"]) == [checksum(buf), checksum(b"abc")]
