"""Chunk store daemon in-process: round trips, corruption, bad input, disk full, heartbeat."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import msgpack
import pytest
import trio
from chunkstore_helpers import (
    NODE,
    KiB,
    MiB,
    cap_key,
    chunk_file,
    delete_cap,
    flip_byte,
    make_config,
    new_chunk,
    open_client,
    payload,
    start_store,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tmpfs_helpers import small_tmpfs
from wire_helpers import raw_authenticated, raw_session, sealed_frames

from chunkstore import layout, reads
from chunkstore.server import ChunkStoreServer, StoreConfig
from tectonic_py.core import buffers, capability, framing, ids, rpc_server
from tectonic_py.core.checksum import checksum as crc32c
from tectonic_py.core.checksum import pack_table, segment_checksums, whole_from_table
from tectonic_py.core.errors import (
    AuthError,
    BadCapability,
    ChecksumMismatch,
    ChunkConflict,
    ChunkCorrupt,
    ChunkNotFound,
    ConfigError,
    DiskFull,
    InvalidArgument,
    TectonicError,
    Unavailable,
)
from tectonic_py.core.rpc_server import Request


@pytest.fixture
async def store(nursery, tmp_path, secret):
    return await start_store(nursery, tmp_path / "data", secret)


@pytest.mark.parametrize(
    "size", [0, 1, layout.SEGMENT_SIZE - 1, layout.SEGMENT_SIZE, layout.SEGMENT_SIZE + 1, 4 * MiB]
)
async def test_put_get_range_stat_delete(store, secret, size):
    _, port = store
    await _round_trip(port, secret, size)


async def _round_trip(port: int, secret: bytes, size: int) -> None:
    cid, cap = new_chunk(secret)
    data = os.urandom(size)
    async with open_client(port, secret) as c:
        await c.put(cid, data, cap)
        assert bytes(await c.get(cid)) == data
        for off, n in [(0, 0), (0, 1), (size // 3, size // 2), (max(size - 5, 0), None), (size, 0)]:
            if off + (n or 0) <= size:
                want = data[off:] if n is None else data[off : off + n]
                assert bytes(await c.get(cid, off, n)) == want
        into = bytearray(size + 10)
        view = await c.get(cid, into=into)
        assert bytes(view) == data and (size == 0 or view.obj is into)
        st_ = await c.stat(cid)
        assert (st_.size, st_.checksum) == (size, crc32c(data))
        assert await c.list() == ([(cid, size)], None)
        stats = await c.node_stats()
        assert stats.chunk_count == 1 and stats.used == layout.file_size_for(size)
        assert await c.delete(cid, delete_cap(secret, cid)) is True
        assert await c.delete(cid, delete_cap(secret, cid)) is False
        with pytest.raises(ChunkNotFound):
            await c.get(cid)
        with pytest.raises(ChunkNotFound):
            await c.stat(cid)
        stats = await c.node_stats()
        assert stats.chunk_count == 0 and stats.used == 0


async def test_list_pages_in_id_order_across_shard_directories(store, secret):
    _, port = store
    async with open_client(port, secret) as c:
        want = []
        for i in range(40):
            cid, cap = new_chunk(secret, index=i % 3)
            await c.put(cid, payload(i), cap)
            want.append((cid, i))
        want.sort()
        page, nxt = await c.list("", 7)
        assert page == want[:7] and nxt == want[6][0]
        assert await c.list_all(page=7) == want
        assert await c.list_all(page=10000) == want
        with pytest.raises(InvalidArgument):
            await c.list("", 10001)
        with pytest.raises(InvalidArgument):
            await c.list("", 0)


async def test_put_is_idempotent_and_refuses_different_bytes(store, secret):
    server, port = store
    cid, cap = new_chunk(secret)
    async with open_client(port, secret) as c:
        await c.put(cid, b"hello world", cap)
        mtime = chunk_file(server, cid).stat().st_mtime_ns
        await c.put(cid, b"hello world", cap)  # the same again: a no-op
        assert chunk_file(server, cid).stat().st_mtime_ns == mtime
        with pytest.raises(ChunkConflict):
            await c.put(cid, b"hello WORLD", cap)
        with pytest.raises(ChunkConflict):
            await c.put(cid, b"hello world!", cap)
        assert bytes(await c.get(cid)) == b"hello world"
        assert (await c.node_stats()).chunk_count == 1


async def test_concurrent_puts_of_one_chunk_store_it_once(store, secret):
    server, port = store
    cid, cap = new_chunk(secret)
    data = os.urandom(3 * MiB)
    async with open_client(port, secret) as c:
        async with trio.open_nursery() as n:
            for _ in range(6):
                n.start_soon(c.put, cid, data, cap)
        assert bytes(await c.get(cid)) == data
        assert (await c.node_stats()).chunk_count == 1
    assert [p.name for p in chunk_file(server, cid).parent.iterdir()] == [cid]


async def test_bad_checksum_on_put_stores_nothing(store, secret):
    server, port = store
    cid, cap = new_chunk(secret)
    async with open_client(port, secret) as c:
        with pytest.raises(ChecksumMismatch):
            await c.put(cid, b"data", cap, checksum=crc32c(b"date"))
        with pytest.raises(ChunkNotFound):
            await c.stat(cid)
        assert (await c.node_stats()).chunk_count == 0
    assert not chunk_file(server, cid).parent.exists() or not any(
        chunk_file(server, cid).parent.iterdir()
    )


async def test_a_carried_segment_table_is_stored_and_checked_against_the_checksum(store, secret):
    """The writer sends the segment table it made while encoding; the store checks it
    against the whole CRC (and reads a short last segment) instead of reading the bytes.
    A table that does not fit is refused and stores nothing; a table that lies about a full
    segment consistently is the writer's bug, and reads of that segment say so."""
    server, port = store
    size = 3 * layout.SEGMENT_SIZE + 100
    data = os.urandom(size)
    crcs, whole = segment_checksums(data, layout.SEGMENT_SIZE)
    async with open_client(port, secret) as c:
        cid, cap = new_chunk(secret)
        await c.put(cid, data, cap, whole, pack_table(crcs))
        assert bytes(await c.get(cid)) == data
        assert reads.verify_chunk(chunk_file(server, cid))

        bad = [
            [*crcs, 0],  # one entry too many
            crcs[:-1],  # one too few
            [*crcs[:-1], crcs[-1] ^ 1],  # a wrong short tail: read and caught
            [crcs[0] ^ 1, *crcs[1:]],  # a wrong full segment: the whole CRC no longer fits
        ]
        for table in bad:
            cid, cap = new_chunk(secret)
            with pytest.raises(ChecksumMismatch):
                await c.put(cid, data, cap, whole, pack_table(table))
            assert not chunk_file(server, cid).exists()
        cid, cap = new_chunk(secret)
        with pytest.raises(InvalidArgument):
            await c.put(cid, data, cap, whole, b"\0" * 7)

        lie = [crcs[0], crcs[1] ^ 1, *crcs[2:]]
        consistent = whole_from_table(lie, data, layout.SEGMENT_SIZE)
        cid, cap = new_chunk(secret)
        await c.put(cid, data, cap, consistent, pack_table(lie))
        assert bytes(await c.get(cid, 0, 100)) == data[:100]
        with pytest.raises(ChunkCorrupt):
            await c.get(cid, layout.SEGMENT_SIZE + 5, 10)
        assert not reads.verify_chunk(chunk_file(server, cid))


async def test_corrupt_data_is_detected_and_never_returned(store, secret):
    server, port = store
    cid, cap = new_chunk(secret)
    data = os.urandom(4 * layout.SEGMENT_SIZE)
    async with open_client(port, secret) as c:
        await c.put(cid, data, cap)
        path = chunk_file(server, cid)
        header = reads.read_header(path)
        flip_byte(path, header.data_offset + 2 * layout.SEGMENT_SIZE + 17)  # segment 2
        assert not reads.verify_chunk(path)
        with pytest.raises(ChunkCorrupt):
            await c.get(cid)
        with pytest.raises(ChunkCorrupt):
            await c.get(cid, 2 * layout.SEGMENT_SIZE + 10, 10)
        with pytest.raises(ChunkCorrupt):  # a range that straddles into the bad segment
            await c.get(cid, 2 * layout.SEGMENT_SIZE - 5, 10)
        # Ranges in intact segments are still served, verified.
        assert bytes(await c.get(cid, 10, 100)) == data[10:110]
        assert (
            bytes(await c.get(cid, 3 * layout.SEGMENT_SIZE, 4096))
            == data[3 * layout.SEGMENT_SIZE : 3 * layout.SEGMENT_SIZE + 4096]
        )
        # The buffers those refused reads filled were given back to the reply budget.
        await _reply_budget_back(server)
        # A retried put of the right bytes heals it.
        await c.put(cid, data, cap)
        assert reads.verify_chunk(path)
        assert bytes(await c.get(cid)) == data
        assert (await c.node_stats()).chunk_count == 1


async def _reply_budget_back(server: ChunkStoreServer) -> None:
    for _ in range(500):  # a reply's budget comes back right after its send
        if server.reply_bytes_held == 0:
            return
        await trio.sleep(0.01)
    raise AssertionError(f"{server.reply_bytes_held} reply bytes still held")


@pytest.mark.parametrize("damage", ["header", "table", "truncate", "extend", "empty"])
async def test_damaged_header_or_size_is_corrupt(store, secret, damage):
    server, port = store
    cid, cap = new_chunk(secret)
    data = os.urandom(200 * KiB)
    async with open_client(port, secret) as c:
        await c.put(cid, data, cap)
        path = chunk_file(server, cid)
        if damage == "header":
            flip_byte(path, 9)  # the length field
        elif damage == "table":
            flip_byte(path, layout.HEADER.size + 5)
        elif damage == "truncate":
            os.truncate(path, path.stat().st_size - 1)
        elif damage == "extend":
            with open(path, "ab") as f:
                f.write(b"x")
        else:
            os.truncate(path, 0)
        assert not reads.verify_chunk(path)
        with pytest.raises(ChunkCorrupt):
            await c.get(cid)
        with pytest.raises(ChunkCorrupt):
            await c.get(cid, 0, 10)
        with pytest.raises(ChunkCorrupt):
            await c.stat(cid)
        await c.put(cid, data, cap)
        assert bytes(await c.get(cid)) == data
        # (used bytes may drift by what was truncated behind the store's back; count may not)
        assert (await c.node_stats()).chunk_count == 1


BAD_IDS = [
    "../../etc/passwd",
    "/etc/passwd",
    "0123456789abcdef.0/../../x",
    "0123456789abcdef.0\x00",
    "a\x00b",
    "0123456789abcdef." + "9" * 5000,
    "x" * 100_000,
    "",
    ".",
    "..",
    "0123456789ABCDEF.0",
    "0123456789abcdef.256",
    "0123456789abcdef.01",
    ".tmp-0123456789abcdef.0-deadbeef",
    "0123456789abcde.0",
]


async def test_path_traversal_and_malformed_ids_are_refused(store, secret, tmp_path):
    server, port = store

    def files() -> set[Path]:
        return set(tmp_path.rglob("*"))

    before = files()
    cap = capability.issue(cap_key(secret), 0x0123456789ABCDEF, [NODE])
    async with open_client(port, secret) as c:
        for bad in BAD_IDS:
            with pytest.raises(InvalidArgument):
                await c.put(bad, b"evil", cap)
            with pytest.raises(InvalidArgument):
                await c.get(bad)
            with pytest.raises(InvalidArgument):
                await c.stat(bad)
            with pytest.raises(InvalidArgument):
                await c.delete(bad, cap)
        for field_value in [5, None, b"bytes", ["0123456789abcdef.0"]]:
            with pytest.raises(InvalidArgument):
                await c.conn.call("get", {"chunk_id": field_value})
        # The store still serves a good client on the same connection.
        cid, good_cap = new_chunk(secret)
        await c.put(cid, b"fine", good_cap)
        assert bytes(await c.get(cid)) == b"fine"
    assert files() - before <= {chunk_file(server, cid).parent, chunk_file(server, cid)}


async def test_bad_ranges_are_refused(store, secret):
    _, port = store
    cid, cap = new_chunk(secret)
    async with open_client(port, secret) as c:
        await c.put(cid, b"0123456789", cap)
        for off, n in [
            (11, None),
            (11, 0),
            (5, 6),
            (0, 11),
            (-1, 2),
            (0, -1),
            (2**64 - 1, 1),
            (1, 2**63),
        ]:
            with pytest.raises(InvalidArgument):
                await c.get(cid, off, n)
        assert bytes(await c.get(cid, 10)) == b""


async def test_bad_capabilities_are_refused(store, secret):
    _, port = store
    block = ids.new_id()
    cid = ids.chunk_id(block, 2)
    key = cap_key(secret)
    good = capability.issue(key, block, ["other", NODE])
    bad_caps = [
        capability.issue(key, block + 1, [NODE]),  # another block
        capability.issue(key, block, ["node-2"]),  # another node
        capability.issue(key, block, [NODE], index=1),  # another chunk of the block
        capability.issue(b"not-the-capability-key-at-all!!", block, [NODE]),  # forged
        capability.issue(secret, block, [NODE]),  # signed with the secret every client holds
        capability.issue(key, block, [NODE], ttl_s=-10),  # expired
        capability.issue(key, block, [NODE], op="delete", index=2),  # a delete's
        good[:-1] + bytes([good[-1] ^ 1]),  # tampered
        b"",
    ]
    async with open_client(port, secret) as c:
        for cap in bad_caps:
            with pytest.raises(BadCapability):
                await c.put(cid, b"data", cap)
        with pytest.raises(InvalidArgument):
            await c.conn.call("put", {"chunk_id": cid, "checksum": crc32c(b"x")}, b"x")
        with pytest.raises(ChecksumMismatch):  # no payload: an empty chunk, checked as such
            await c.conn.call("put", {"chunk_id": cid, "checksum": 1, "cap": good})
        with pytest.raises(InvalidArgument):
            await c.put(cid, b"x", good, checksum=2**32)
        await c.put(cid, b"data", good)
        assert (await c.node_stats()).chunk_count == 1


async def test_a_client_with_the_cluster_secret_cannot_delete_a_chunk(store, secret):
    """Before: any peer holding the secret deleted any chunk. A delete now needs a delete
    capability for that chunk on this node, signed with the capability key."""
    server, port = store
    cid, cap = new_chunk(secret)
    block, index = ids.parse_chunk_id(cid)
    key = cap_key(secret)
    async with open_client(port, secret) as c:
        await c.put(cid, b"live data", cap)
        for bad in [
            b"",  # no capability
            capability.issue(secret, block, [NODE], op="delete", index=index),  # forged
            cap,  # the put capability, reused
            capability.issue(key, block, [NODE], index=index),  # a put one naming the chunk
            capability.issue(key, block, [NODE], op="delete", index=index + 1),  # other chunk
            capability.issue(key, block, ["node-2"], op="delete", index=index),  # other node
            capability.issue(key, block, [NODE], op="delete", index=index, ttl_s=-10),
        ]:
            with pytest.raises(BadCapability):
                await c.delete(cid, bad)
        with pytest.raises(BadCapability):
            await c.conn.call("delete", {"chunk_id": cid})
        assert bytes(await c.get(cid)) == b"live data"
        assert await c.delete(cid, delete_cap(secret, cid))
    assert not chunk_file(server, cid).exists()


async def test_wrong_secret_is_refused_and_store_keeps_serving(store, secret):
    _, port = store
    with pytest.raises(AuthError):
        async with open_client(port, b"y" * 32):
            pass
    async with open_client(port, secret) as c:
        assert (await c.node_stats()).node_id == NODE


async def _good_client_still_served(port: int, secret: bytes) -> None:
    cid, cap = new_chunk(secret)
    async with open_client(port, secret) as c:
        await c.put(cid, b"still here", cap)
        assert bytes(await c.get(cid)) == b"still here"


async def _send_and_drain(sock: trio.socket.SocketType, data: bytes, half_close: bool) -> None:
    try:
        await framing.send_all(sock, data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    with trio.move_on_after(3):
        try:
            while await sock.recv(65536):
                pass
        except OSError:
            pass
    sock.close()


def _put_frame(secret: bytes, plen_claimed: int, body: bytes) -> bytes:
    block = ids.new_id()
    header = msgpack.packb(
        {
            "op": "put",
            "rid": 1,
            "f": {
                "chunk_id": ids.chunk_id(block, 0),
                "checksum": 0,
                "cap": capability.issue(cap_key(secret), block, [NODE]),
            },
        },
        use_bin_type=True,
    )
    return framing.PREFIX.pack(1, 0, 0, len(header), plen_claimed) + header + body


async def test_truncated_and_oversized_frames(store, secret):
    server, port = store
    frames = [
        _put_frame(secret, 1000, b"x" * 10),  # payload cut short, then EOF
        _put_frame(secret, 2**31, b""),  # payload length over the limit
        framing.PREFIX.pack(1, 0, 0, 2**30, 0),  # header length over the limit
        framing.PREFIX.pack(1, 0, 0, 40, 0) + b"\x83",  # header cut short
        framing.PREFIX.pack(1, 0, 0, 10, 0)[:6],  # prefix cut short
    ]
    for frame in frames:
        sock = await raw_authenticated(port, secret)
        await _send_and_drain(sock, frame, half_close=True)
        await _good_client_still_served(port, secret)
    assert server.chunk_count == len(frames)  # only the good clients' chunks
    assert not list(server.data_dir.rglob(".tmp-*"))


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    garbage=st.one_of(
        st.binary(min_size=1, max_size=400),
        st.builds(
            lambda h, p: framing.PREFIX.pack(1, 0, 0, len(h), p) + h,
            st.binary(min_size=1, max_size=200),
            st.integers(0, 2**32 - 1),
        ),
        st.builds(
            lambda f: framing.pack_frame({"op": "put", "rid": 7, "f": f}, 0),
            st.dictionaries(
                st.sampled_from(["chunk_id", "checksum", "cap", "x"]),
                st.one_of(
                    st.integers(-(2**63), 2**64 - 1),
                    st.text(max_size=40),
                    st.binary(max_size=40),
                    st.none(),
                ),
            ),
        ),
    ),
    authenticate=st.booleans(),
)
def test_garbage_never_hurts_the_store(tmp_path_factory, secret, garbage, authenticate):
    data_dir = tmp_path_factory.mktemp("garbage")

    async def main():
        async with trio.open_nursery() as nursery:
            server = ChunkStoreServer(make_config(data_dir, secret))
            server.rpc.limits = framing.Limits(auth_timeout=1, max_payload=64 * MiB)
            _, port = await nursery.start(server.serve)
            if authenticate:
                sock = await raw_authenticated(port, secret)
            else:
                sock = trio.socket.socket()
                await sock.connect(("127.0.0.1", port))
            await _send_and_drain(sock, garbage, half_close=True)
            await _good_client_still_served(port, secret)
            assert not list(data_dir.rglob(".tmp-*"))
            nursery.cancel_scope.cancel()

    trio.run(main)


async def test_capacity_limit_refuses_puts_before_writing(nursery, tmp_path, secret):
    _server, port = await start_store(nursery, tmp_path / "d", secret, capacity=3 * MiB)
    async with open_client(port, secret) as c:
        stored = []
        with pytest.raises(DiskFull):
            for i in range(10):
                cid, cap = new_chunk(secret)
                await c.put(cid, payload(MiB, i), cap)
                stored.append((cid, i))
        assert len(stored) == 2
        stats = await c.node_stats()
        assert stats.capacity == 3 * MiB and stats.free < MiB and stats.chunk_count == 2
        await c.delete(stored[0][0], delete_cap(secret, stored[0][0]))
        cid, cap = new_chunk(secret)
        await c.put(cid, payload(MiB, 9), cap)
        assert bytes(await c.get(stored[1][0])) == payload(MiB, stored[1][1])


@pytest.fixture
def small_fs(tmp_path):
    """A real 3 MiB filesystem (tmpfs) so ENOSPC comes from the kernel."""
    yield from small_tmpfs(tmp_path, "3m")


async def test_real_disk_full_is_a_clear_error_and_the_store_stays_up(small_fs, secret):
    async with trio.open_nursery() as nursery:
        _server, port = await start_store(nursery, small_fs / "data", secret)
        async with open_client(port, secret) as c:
            stored = []
            with pytest.raises(DiskFull):
                for i in range(10):
                    cid, cap = new_chunk(secret)
                    await c.put(cid, payload(MiB, i), cap)
                    stored.append((cid, i))
            assert 1 <= len(stored) < 3
            assert not list(small_fs.rglob(".tmp-*"))  # the failed put left nothing
            assert (await c.node_stats()).chunk_count == len(stored)
            for cid, i in stored:
                assert bytes(await c.get(cid)) == payload(MiB, i)
            await c.delete(stored[0][0], delete_cap(secret, stored[0][0]))
            cid, cap = new_chunk(secret)
            await c.put(cid, payload(MiB, 42), cap)
            assert bytes(await c.get(cid)) == payload(MiB, 42)
        nursery.cancel_scope.cancel()


async def test_concurrent_puts_on_a_filling_disk_lose_no_acknowledged_chunk(small_fs, secret):
    """Thirty puts at once on a 3 MiB filesystem: those that do not fit get DiskFull (no
    other error), no partial file is left, and every acknowledged chunk reads back whole,
    also after a restart of the store on the same directory."""
    acked: dict[str, int] = {}
    refused: list[BaseException] = []

    async def one(c, i):
        cid, cap = new_chunk(secret)
        try:
            await c.put(cid, payload(200 * 1024 + i, i), cap)
        except DiskFull as e:
            refused.append(e)
            return
        acked[cid] = i

    async with trio.open_nursery() as nursery:
        _server, port = await start_store(nursery, small_fs / "data", secret)
        async with open_client(port, secret) as c, trio.open_nursery() as puts:
            for i in range(30):
                puts.start_soon(one, c, i)
        nursery.cancel_scope.cancel()
    assert acked and refused and len(acked) + len(refused) == 30
    assert not list(small_fs.rglob(".tmp-*"))
    async with trio.open_nursery() as nursery:
        _server, port = await start_store(nursery, small_fs / "data", secret)
        async with open_client(port, secret) as c:
            assert set(dict(await c.list_all())) == set(acked)
            for cid, i in acked.items():
                assert bytes(await c.get(cid)) == payload(200 * 1024 + i, i)
        nursery.cancel_scope.cancel()


async def test_put_queue_full_gives_busy_and_loses_nothing(nursery, tmp_path, secret):
    server, port = await start_store(
        nursery,
        tmp_path / "d",
        secret,
        payload_budget=MiB,
        max_payload_waiters=2,
        max_concurrent_writes=1,
    )
    results: dict[str, object] = {}

    async def one(i):
        # One connection each: a connection's reader waits for budget before reading on, so
        # only many connections can fill the wait queue.
        cid, cap = new_chunk(secret)
        async with open_client(port, secret) as c:
            try:
                await c.put(cid, payload(512 * KiB, i), cap)
                results[cid] = i
            except TectonicError as e:
                assert e.retryable, e
                results[cid] = e

    async with trio.open_nursery() as n:
        for i in range(30):
            n.start_soon(one, i)
    async with open_client(port, secret) as c:
        ok = {cid: i for cid, i in results.items() if isinstance(i, int)}
        assert ok and len(ok) < 30  # some queued and succeeded, some were told "busy"
        listed = dict(await c.list_all())
        assert set(listed) == set(ok)
        for cid, i in ok.items():
            assert bytes(await c.get(cid)) == payload(512 * KiB, i)
        stats = await c.node_stats()
        assert stats.queue_depth == 0 and stats.chunk_count == len(ok)
    assert server.rpc.stats.busy_refusals == 30 - len(ok)


async def test_get_replies_in_memory_are_bounded_by_the_reply_budget(nursery, tmp_path, secret):
    server, port = await start_store(nursery, tmp_path / "d", secret, reply_budget=MiB)
    cid, cap = new_chunk(secret)
    # A reply holds the chunk's whole file image (read with O_DIRECT: header and data, in
    # whole pages), so a chunk a little under the budget is one reply's worth.
    data = os.urandom(MiB - 64 * 1024)
    async with open_client(port, secret) as c:
        await c.put(cid, data, cap)
    # A reader that asks for 48 MiB of replies and never reads them.
    stalled, session = await raw_session(port, secret)
    frames = sealed_frames(
        session, [{"op": "get", "rid": rid, "f": {"chunk_id": cid}} for rid in range(1, 49)]
    )
    await framing.send_all(stalled, frames)
    for _ in range(500):  # bounded: until the store is stuck sending to it
        if server._replies.waiting:
            break
        await trio.sleep(0.01)
    assert server._replies.waiting and server._replies.peak <= MiB
    got: list[bytes] = []
    async with open_client(port, secret) as c:
        async with trio.open_nursery() as n:

            async def good_get():
                got.append(bytes(await c.get(cid)))

            n.start_soon(good_get)
            await trio.sleep(0.2)
            assert not got  # it waits for memory; it does not fail
            stalled.close()  # the slow reader goes away and its replies' memory comes back
        assert got == [data]
    assert server._replies.peak <= MiB
    while server.reply_bytes_held:
        await trio.sleep(0.01)


async def test_restart_recovers_counts_and_removes_partial_files(tmp_path, secret):
    data_dir = tmp_path / "d"
    chunks = {}
    async with trio.open_nursery() as nursery:
        server, port = await start_store(nursery, data_dir, secret)
        async with open_client(port, secret) as c:
            for i in range(5):
                cid, cap = new_chunk(secret)
                await c.put(cid, payload(1000 * i, i), cap)
                chunks[cid] = i
        nursery.cancel_scope.cancel()
    some = next(iter(chunks))
    leftover = layout.chunk_path(data_dir, some).parent / f".tmp-{some}-0badf00d"
    leftover.write_bytes(b"half a chunk")
    async with trio.open_nursery() as nursery:
        server, port = await start_store(nursery, data_dir, secret)
        assert not leftover.exists()
        assert server.chunk_count == 5
        assert server.used == sum(layout.file_size_for(1000 * i) for i in chunks.values())
        async with open_client(port, secret) as c:
            for cid, i in chunks.items():
                assert bytes(await c.get(cid)) == payload(1000 * i, i)
        nursery.cancel_scope.cancel()


async def test_second_store_on_the_same_directory_is_refused(store, secret):
    server, _ = store
    with pytest.raises(ConfigError, match="in use"):
        await ChunkStoreServer(make_config(server.data_dir, secret)).serve()


def test_config_is_validated(tmp_path, secret):
    for kw in [
        {"node_id": "../x"},
        {"failure_domain": ""},
        {"capacity": 0},
        {"heartbeat_interval": 0},
        {"registry": "nohost"},
        {"payload_budget": 10},
        {"reply_budget": 10},
        {"max_concurrent_writes": 0},
        {"capability_key": b"short"},
    ]:
        base = {
            "data_dir": tmp_path,
            "node_id": NODE,
            "failure_domain": "r",
            "secret": secret,
            "capability_key": cap_key(secret),
        }
        base.update(kw)
        with pytest.raises(ConfigError):
            StoreConfig(**base)


async def test_ready_file_without_registry(nursery, tmp_path, secret):
    ready = tmp_path / "ready.json"
    _server, port = await start_store(nursery, tmp_path / "d", secret, ready_file=ready)
    info = json.loads(ready.read_text())
    assert info == {"address": f"127.0.0.1:{port}", "pid": os.getpid()}


async def test_heartbeat_registers_and_ready_file_waits_for_acceptance(nursery, tmp_path, secret):
    beats: list[dict] = []
    refuse = 3

    async def heartbeat(req: Request):
        nonlocal refuse
        if refuse:
            refuse -= 1
            raise Unavailable("registry still starting")
        beats.append(dict(req.fields))
        return {}

    registry = rpc_server.RpcServer("registry", secret, {"node.heartbeat": heartbeat})
    _, rport = await nursery.start(registry.serve, "127.0.0.1", 0)
    ready = tmp_path / "ready.json"
    _server, port = await start_store(
        nursery,
        tmp_path / "d",
        secret,
        registry=f"127.0.0.1:{rport}",
        heartbeat_interval=0.02,
        ready_file=ready,
        capacity=10 * MiB,
    )
    assert not ready.exists()
    while len(beats) < 2:
        assert not ready.exists() or beats
        await trio.sleep(0.01)
    assert json.loads(ready.read_text())["address"] == f"127.0.0.1:{port}"
    fs = {k: beats[0][k] for k in ("fs_id", "fs_total", "fs_free")}  # the store's filesystem
    assert beats[0] == {
        "node_id": NODE,
        "address": f"127.0.0.1:{port}",
        "failure_domain": "rack-1",
        "capacity": 10 * MiB,
        "free": 10 * MiB,
        "chunk_count": 0,
        "queue_depth": 0,
        **fs,
    }
    assert fs["fs_id"] and fs["fs_total"] >= fs["fs_free"] > 0
    async with open_client(port, secret) as c:
        cid, cap = new_chunk(secret)
        await c.put(cid, b"x" * 1000, cap)
    n = len(beats)
    while len(beats) < n + 2:
        await trio.sleep(0.01)
    assert beats[-1]["chunk_count"] == 1


async def test_heartbeat_survives_registry_down(nursery, tmp_path, secret):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead_port = s.getsockname()[1]
    s.close()
    ready = tmp_path / "ready.json"
    server, port = await start_store(
        nursery,
        tmp_path / "d",
        secret,
        registry=f"127.0.0.1:{dead_port}",
        heartbeat_interval=0.02,
        ready_file=ready,
    )
    await trio.sleep(0.2)  # several failed heartbeats
    assert not ready.exists() and server.heartbeats_accepted == 0
    async with open_client(port, secret) as c:  # serving all the while
        assert (await c.node_stats()).node_id == NODE


async def test_heartbeat_registers_with_the_real_metadata_registry(tmp_path, secret_file):
    from metadata_fixtures import open_meta_cluster

    secret = secret_file.read_bytes().strip()
    async with open_meta_cluster(tmp_path / "meta", secret_file, servers=1, shards=4) as mc:
        registry = mc.config.metadata_servers[0].address
        async with trio.open_nursery() as nursery:
            ready = tmp_path / "ready.json"
            _server, port = await start_store(
                nursery,
                tmp_path / "d",
                secret,
                registry=registry,
                heartbeat_interval=0.05,
                ready_file=ready,
                capacity=64 * MiB,
            )
            for _ in range(400):  # bounded: 20 s
                if ready.exists():
                    break
                await trio.sleep(0.05)
            assert ready.exists()
            nodes = {n.node_id: n for n in await mc.client.nodes()}
            node = nodes[NODE]
            assert (node.address, node.failure_domain, node.state) == (
                f"127.0.0.1:{port}",
                "rack-1",
                "up",
            )
            assert node.capacity == 64 * MiB
            nursery.cancel_scope.cancel()


def test_advertised_address_for_wildcard_listen():
    from chunkstore.server import _advertised_address

    assert _advertised_address("10.1.2.3", 7200, None) == "10.1.2.3:7200"
    assert _advertised_address("::1", 7200, None) == "[::1]:7200"
    assert _advertised_address("0.0.0.0", 7200, None) == "127.0.0.1:7200"
    assert _advertised_address("0.0.0.0", 7200, "127.0.0.1:7100") == "127.0.0.1:7200"


async def test_get_reply_buffers_are_reused_and_their_budget_returned(nursery, tmp_path, secret):
    server, port = await start_store(nursery, tmp_path / "d", secret)
    chunks = []
    async with open_client(port, secret) as c:
        for i in range(3):
            cid, cap = new_chunk(secret)
            await c.put(cid, payload(MiB, i), cap)
            chunks.append((cid, i))

        for _ in range(3):
            for cid, i in chunks:
                assert bytes(await c.get(cid)) == payload(MiB, i)
                await _reply_budget_back(server)
                assert bytes(await c.get(cid, 70_000, 300_000)) == payload(MiB, i)[70_000:370_000]
                await _reply_budget_back(server)
    # 18 gets of two buffer sizes, each buffer back before the next get: all but the first
    # of each size can reuse one (a few may find theirs still viewed by a worker thread).
    assert server._replies.spares.reused >= 12
    # A whole get reads into whole huge pages (one disk request per chunk, buffers.HUGE_PAGE).
    assert all(size % buffers.HUGE_PAGE == 0 for size in server._replies.spares._free if size > MiB)
    assert any(size > MiB for size in server._replies.spares._free)
