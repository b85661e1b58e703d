"""Writer semantics against a model: random pwrite/write/truncate/fsync/pread sequences on a
real cluster must read back exactly what a bytearray model of the file holds, both through
the open writer (read-your-writes) and through a fresh reader after close."""

from __future__ import annotations

import hashlib
import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

BLOCK = 6 * 64 * 1024  # RS(6,3) with the fixture's 64 KiB chunks

_names = itertools.count()

offsets = st.one_of(
    st.integers(0, 3 * BLOCK),
    st.sampled_from([0, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK - 3, 64 * 1024 - 1]),
)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.integers(1, BLOCK + 10)),
        st.tuples(st.just("pwrite"), offsets, st.integers(1, BLOCK // 2)),
        st.tuples(st.just("truncate"), offsets),
        st.tuples(st.just("fsync")),
        st.tuples(st.just("pread"), offsets, st.integers(0, BLOCK)),
    ),
    min_size=1,
    max_size=8,
)


def _bytes(n: int, tag: int) -> bytes:
    seed = hashlib.sha256(tag.to_bytes(8, "big")).digest()
    return (seed * (n // 32 + 1))[:n]


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops)
async def test_writer_matches_a_bytearray_model(client, sequence):
    name = f"/m{next(_names)}"
    w = await client.create(name)
    assert w.layout.block_size == BLOCK
    model = bytearray()
    for step, op in enumerate(sequence):
        kind = op[0]
        if kind == "write":
            data = _bytes(op[1], step)
            await w.write(data)
            model += data
        elif kind == "pwrite":
            off, data = op[1], _bytes(op[2], step)
            await w.pwrite(data, off)
            if off > len(model):
                model += bytes(off - len(model))
            model[off : off + len(data)] = data
        elif kind == "truncate":
            await w.truncate(op[1])
            if op[1] < len(model):
                del model[op[1] :]
            else:
                model += bytes(op[1] - len(model))
        elif kind == "fsync":
            await w.fsync()
        else:
            off, n = op[1], op[2]
            assert await w.pread(off, n) == bytes(model[off : off + n])
        assert w.size == len(model)
    attrs = await w.close()
    assert attrs.size == len(model)
    r = await client.open_read(name)
    assert await r.read() == bytes(model)
