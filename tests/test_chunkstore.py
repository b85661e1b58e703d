"""Chunk store daemon in-process: round trips, corruption, bad input, disk full, heartbeat."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
from contextlib import asynccontextmanager
from pathlib import Path

import msgpack
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tmpfs_helpers import small_tmpfs
from wire_helpers import raw_authenticated

from chunkstore import layout, reads, writes
from chunkstore.client import ChunkClient
from chunkstore.server import ChunkStoreServer, StoreConfig
from chunkstore.spares import Spare, SpareFiles
from tectonic_py.core import buffers, capability, framing, ids, rpc_client, rpc_server
from tectonic_py.core.checksum import checksum as crc32c
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

NODE = "node-1"
KiB, MiB = 1024, 1024 * 1024


def make_config(data_dir: Path, secret: bytes, **kw) -> StoreConfig:
    return StoreConfig(
        data_dir=data_dir, node_id=NODE, failure_domain="rack-1", secret=secret, **kw
    )


async def start_store(nursery, data_dir: Path, secret: bytes, **kw) -> tuple[ChunkStoreServer, int]:
    server = ChunkStoreServer(make_config(data_dir, secret, **kw))
    _, port = await nursery.start(server.serve)
    return server, port


@asynccontextmanager
async def open_client(port: int, secret: bytes):
    async with rpc_client.open_connection("127.0.0.1", port, secret) as conn:
        yield ChunkClient(conn)


def new_chunk(secret: bytes, index: int = 0, node: str = NODE) -> tuple[str, bytes]:
    block = ids.new_id()
    return ids.chunk_id(block, index), capability.issue(secret, block, [node])


def payload(n: int, seed: int = 0) -> bytes:
    return (bytes(range(251)) * (n // 251 + 2))[seed % 251 :][:n]


@pytest.fixture
async def store(nursery, tmp_path, secret):
    return await start_store(nursery, tmp_path / "data", secret)


def chunk_file(server: ChunkStoreServer, chunk_id: str) -> Path:
    return layout.chunk_path(server.data_dir, chunk_id)


# --- round trips ----------------------------------------------------------------------------


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
        assert await c.delete(cid) is True
        assert await c.delete(cid) is False
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


def test_a_repeated_put_makes_the_chunks_name_durable(tmp_path, monkeypatch):
    """A retry of a put whose daemon died after its rename but before the directory fsync
    finds the file there; it must not be acknowledged before the name is durable."""
    data_dir = tmp_path / "d"
    writes.recover(data_dir)
    cid, _ = new_chunk(b"s" * 32)
    data = b"retried after a crash"
    writes.write_chunk(data_dir, cid, data, crc32c(data))
    synced: list[Path] = []

    class Recorder:
        def sync(self, path: Path) -> None:
            synced.append(path)

    monkeypatch.setattr(writes, "_dir_sync", Recorder())
    assert writes.write_chunk(data_dir, cid, data, crc32c(data)) == writes.Stored(0, 0, False)
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

    class Recorder:
        def sync(self, path: Path) -> None:
            synced.append(path)

    monkeypatch.setattr(writes, "_dir_sync", Recorder())
    assert writes.delete_chunk(data_dir, cid) is None
    assert synced == [layout.chunk_path(data_dir, cid).parent]
    monkeypatch.undo()
    shutil.rmtree(layout.chunk_path(data_dir, cid).parent)  # no shard directory at all
    assert writes.delete_chunk(data_dir, cid) is None


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


# --- corruption -----------------------------------------------------------------------------


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


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


# --- bad input ------------------------------------------------------------------------------

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
    spares = server.spares.directory

    def files() -> set[Path]:
        # Spare files come and go in the background (chunkstore/spares.py); never chunks.
        return {p for p in tmp_path.rglob("*") if spares not in (p, *p.parents)}

    before = files()
    cap = capability.issue(secret, 0x0123456789ABCDEF, [NODE])
    async with open_client(port, secret) as c:
        for bad in BAD_IDS:
            with pytest.raises(InvalidArgument):
                await c.put(bad, b"evil", cap)
            with pytest.raises(InvalidArgument):
                await c.get(bad)
            with pytest.raises(InvalidArgument):
                await c.stat(bad)
            with pytest.raises(InvalidArgument):
                await c.delete(bad)
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
    good = capability.issue(secret, block, ["other", NODE])
    bad_caps = [
        capability.issue(secret, block + 1, [NODE]),  # another block
        capability.issue(secret, block, ["node-2"]),  # another node
        capability.issue(b"not-the-cluster-secret-at-all!!", block, [NODE]),  # forged
        capability.issue(secret, block, [NODE], ttl_s=-10),  # expired
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
                "cap": capability.issue(secret, block, [NODE]),
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


# --- capacity, disk full, admission ---------------------------------------------------------


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
        await c.delete(stored[0][0])
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
            await c.delete(stored[0][0])
            cid, cap = new_chunk(secret)
            await c.put(cid, payload(MiB, 42), cap)
            assert bytes(await c.get(cid)) == payload(MiB, 42)
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
    stalled = await raw_authenticated(port, secret)
    frames = b"".join(
        framing.pack_frame({"op": "get", "rid": rid, "f": {"chunk_id": cid}}, 0)
        for rid in range(1, 49)
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


# --- lifecycle: restart, data directory lock, heartbeat, ready file -------------------------


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
        {"spare_files": -1},
        {"spare_bytes": -1},
        {"spare_min": -1},
    ]:
        base = {"data_dir": tmp_path, "node_id": NODE, "failure_domain": "r", "secret": secret}
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
    assert beats[0] == {
        "node_id": NODE,
        "address": f"127.0.0.1:{port}",
        "failure_domain": "rack-1",
        "capacity": 10 * MiB,
        "free": 10 * MiB,
        "chunk_count": 0,
        "queue_depth": 0,
    }
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
    """New file by O_DIRECT image, new file buffered, spare renamed: each finds the chunk's
    shard directory gone, makes it again and stores the chunk."""
    data_dir = tmp_path / "d"
    writes.recover(data_dir)
    length = 8192
    data = payload(length, 7)
    offset, size = layout.put_room(length)
    image = memoryview(buffers.SpareBuffers(0).take(buffers.SpareBuffers.MIN_SIZE))[:size]
    image[offset : offset + length] = data
    spare = data_dir / "spares" / "spare-test"
    spare.parent.mkdir(exist_ok=True)
    spare.write_bytes(b"old")
    for kw in ({"image": image}, {}, {"spare": spare, "spare_size": 3}):
        cid = _chunk_in_a_removed_shard_dir(data_dir)
        stored = writes.write_chunk(data_dir, cid, data, crc32c(data), **kw)
        assert stored.added_chunks == 1 and stored.spare_used == ("spare" in kw)
        assert bytes(reads.read_chunk(data_dir, cid)[1]) == data
    assert not spare.exists()


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


# --- spare files: deletes keep their inodes for later puts (chunkstore/spares.py) -----------


async def test_delete_keeps_the_file_as_a_spare_and_a_put_reuses_it(nursery, tmp_path, secret):
    server, port = await start_store(nursery, tmp_path / "d", secret, spare_min=0)
    async with open_client(port, secret) as c:
        a, cap_a = new_chunk(secret)
        await c.put(a, payload(MiB, 1), cap_a)
        inode = chunk_file(server, a).stat().st_ino
        assert await c.delete(a)
        assert server.spares.count == 1 and server.used == 0 and server.chunk_count == 0
        (spare,) = server.spares.directory.iterdir()
        assert spare.stat().st_ino == inode and not chunk_file(server, a).exists()
        for op in (c.get, c.stat):
            with pytest.raises(ChunkNotFound):  # deleted means gone under its id
                await op(a)
        assert a not in dict(await c.list_all())
        stats = (await c.node_stats()).free
        b, cap_b = new_chunk(secret)
        await c.put(b, payload(MiB, 2), cap_b)  # same size: the spare's inode and blocks
        assert chunk_file(server, b).stat().st_ino == inode
        assert server.spares.count == 0 and not list(server.spares.directory.iterdir())
        assert bytes(await c.get(b)) == payload(MiB, 2)
        assert (await c.node_stats()).free <= stats
        # While the pool has room, a chunk of another size neither grows nor cuts it: a
        # new file each, and the spare waits for a chunk of its size.
        assert await c.delete(b)
        for size, seed in ((3 * MiB + 5, 3), (1000, 4)):
            other, cap_o = new_chunk(secret)
            await c.put(other, payload(size, seed), cap_o)
            assert chunk_file(server, other).stat().st_ino != inode and server.spares.count == 1
            assert bytes(await c.get(other)) == payload(size, seed)
        with pytest.raises(ChunkNotFound):
            await c.get(a)
    assert server.spares.reused == 1 and server.spares.recycled == 2


async def test_a_full_pool_cuts_larger_spares_and_grows_smaller_ones(nursery, tmp_path, secret):
    server, port = await start_store(nursery, tmp_path / "d", secret, spare_min=0, spare_files=1)
    async with open_client(port, secret) as c:
        big, cap = new_chunk(secret)
        await c.put(big, payload(MiB, 1), cap)
        inode = chunk_file(server, big).stat().st_ino
        assert await c.delete(big) and server.spares.count == 1
        small, cap = new_chunk(secret)
        await c.put(small, payload(1000, 2), cap)
        stat = chunk_file(server, small).stat()
        assert stat.st_ino == inode and stat.st_size == layout.file_size_for(1000)
        assert bytes(await c.get(small)) == payload(1000, 2)
        assert server.spares.count == 0
        # And a full pool's smaller spare grows for a larger chunk.
        assert await c.delete(small) and server.spares.count == 1
        large, cap = new_chunk(secret)
        await c.put(large, payload(3 * MiB + 5, 3), cap)
        stat = chunk_file(server, large).stat()
        assert stat.st_ino == inode and stat.st_size == layout.file_size_for(3 * MiB + 5)
        assert bytes(await c.get(large)) == payload(3 * MiB + 5, 3)


def test_spare_choice_exact_then_empty_then_other_sizes_only_when_full(tmp_path):
    pool = SpareFiles(tmp_path, max_files=3, max_bytes=10**9)
    for name, size in (("e", 0), ("a", 100), ("b", 400)):
        pool._add(tmp_path / name, size)
    assert pool.take(100) == Spare(tmp_path / "a", 100)  # exact
    assert pool.take(300) == Spare(tmp_path / "e", 0)  # an empty one grows
    assert pool.take(200) is None  # only a larger one: make a new file
    pool._add(tmp_path / "f", 100)
    assert pool.take(200) is None  # nor a smaller one while the pool has room
    pool._add(tmp_path / "c", 50)
    assert pool.take(200) == Spare(tmp_path / "f", 100)  # full: the largest smaller grows
    pool._add(tmp_path / "d", 60)
    assert pool.take(10) == Spare(tmp_path / "c", 50)  # full, none smaller: smallest larger
    assert pool.take(10) is None and pool.count == 2


async def test_spares_are_bounded_in_files_and_bytes(nursery, tmp_path, secret):
    server, port = await start_store(
        nursery, tmp_path / "d", secret, spare_min=0, spare_files=3, spare_bytes=5 * 100_000
    )
    async with open_client(port, secret) as c:
        cids = []
        for i in range(6):
            cid, cap = new_chunk(secret)
            await c.put(cid, payload(100_000 + 1000 * i, i), cap)
            cids.append(cid)
        async with trio.open_nursery() as n:  # at once: each may think one more fits
            for cid in cids:
                n.start_soon(c.delete, cid)
        files = list(server.spares.directory.iterdir())
        assert len(files) == server.spares.count <= 3
        assert sum(f.stat().st_size for f in files) == server.spares.bytes <= 5 * 100_000
        assert server.used == 0 and server.chunk_count == 0
    # spare_files=0: a delete unlinks, as without spares.
    server2, port2 = await start_store(nursery, tmp_path / "d2", secret, spare_min=0, spare_files=0)
    async with open_client(port2, secret) as c:
        cid, cap = new_chunk(secret)
        await c.put(cid, b"x" * 5000, cap)
        await c.delete(cid)
        assert not list(server2.spares.directory.iterdir())


async def test_restart_keeps_spares_within_bounds_and_removes_strays(tmp_path, secret):
    data_dir = tmp_path / "d"
    async with trio.open_nursery() as nursery:
        server, port = await start_store(nursery, data_dir, secret, spare_min=0)
        async with open_client(port, secret) as c:
            cids = []
            for i in range(4):
                cid, cap = new_chunk(secret)
                await c.put(cid, payload(1000 * (i + 1), i), cap)
                cids.append(cid)
            for cid in cids:
                await c.delete(cid)
        nursery.cancel_scope.cancel()
    spares_dir = server.spares.directory
    (spares_dir / "not-a-spare").write_bytes(b"junk")
    async with trio.open_nursery() as nursery:
        server, port = await start_store(nursery, data_dir, secret, spare_min=0, spare_files=3)
        names = sorted(p.name for p in spares_dir.iterdir())
        assert len(names) == server.spares.count == 3 and "not-a-spare" not in names
        assert server.spares.bytes == sum((spares_dir / n).stat().st_size for n in names)
        assert server.chunk_count == 0 and server.used == 0
        async with open_client(port, secret) as c:
            cid, cap = new_chunk(secret)
            await c.put(cid, payload(2000, 9), cap)  # an exact-size spare from before
            assert bytes(await c.get(cid)) == payload(2000, 9)
            assert server.spares.count == 2
        nursery.cancel_scope.cancel()


async def test_idle_store_keeps_empty_spares_ready(nursery, tmp_path, secret):
    server, port = await start_store(nursery, tmp_path / "d", secret, spare_min=5)
    with trio.fail_after(30):
        while server.spares.count < 5:
            await trio.sleep(0.01)
    files = list(server.spares.directory.iterdir())
    assert len(files) == 5 and all(f.stat().st_size == 0 for f in files)
    async with open_client(port, secret) as c:
        cid, cap = new_chunk(secret)
        await c.put(cid, payload(70_000, 3), cap)
        assert bytes(await c.get(cid)) == payload(70_000, 3)
    assert server.spares.reused == 1
    with trio.fail_after(30):  # topped up again once the store is idle
        while server.spares.count < 5:
            await trio.sleep(0.01)
    assert server.spares.created == 6


def _reuse_for_another_chunk(data_dir: Path, deleted: str, other: str, data: bytes) -> None:
    """What a delete of ``deleted`` and a put of ``other`` into its spare file do (once)."""
    if not layout.chunk_path(data_dir, deleted).exists():
        return
    spare = data_dir / "spares" / "spare-test"
    spare.parent.mkdir(exist_ok=True)
    assert writes.delete_chunk(data_dir, deleted, spare)
    stored = writes.write_chunk(data_dir, other, data, crc32c(data), spare=spare)
    assert stored.spare_used


@pytest.mark.parametrize("when", ["before_header", "before_data"])
def test_a_read_racing_delete_and_reuse_never_returns_another_chunks_bytes(
    tmp_path, monkeypatch, when
):
    data_dir = tmp_path / "d"
    writes.recover(data_dir)
    a, _ = new_chunk(b"s" * 32)
    b, _ = new_chunk(b"s" * 32)
    data_a, data_b = payload(200_000, 1), payload(200_000, 2)
    writes.write_chunk(data_dir, a, data_a, crc32c(data_a))
    if when == "before_header":
        # The reader has opened a's file; then it is deleted, reused for b, and read: b's
        # header and b's bytes, which pass every checksum.
        real = reads._read_open_chunk

        def racing(fd, *args):
            _reuse_for_another_chunk(data_dir, a, b, data_b)
            return real(fd, *args)

        monkeypatch.setattr(reads, "_read_open_chunk", racing)
        alloc = bytearray
    else:
        # a's header was read; the data read finds b's bytes (a checksum failure, which must
        # say "not found", not "corrupt": nothing is wrong with any stored chunk).
        def alloc(n):
            _reuse_for_another_chunk(data_dir, a, b, data_b)
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
        _reuse_for_another_chunk(data_dir, a, b, payload(100_000, 5))
        return real(fd, *args)

    monkeypatch.setattr(reads, "_verify_open_chunk", racing)
    with pytest.raises(ChunkNotFound):  # scrub then forgets it instead of reporting it bad
        reads.verify_chunk(layout.chunk_path(data_dir, a))


async def _put_three_delete_two(c, server, secret):
    """Three 1 MiB chunks stored, the first two deleted into spares: (the three ids, node
    stats while all three were stored)."""
    stored = []
    for i in range(3):
        cid, cap = new_chunk(secret)
        await c.put(cid, payload(MiB, i), cap)
        stored.append(cid)
    full = await c.node_stats()
    for cid in stored[:2]:
        await c.delete(cid)
    assert server.spares.count == 2
    return stored, full


async def test_capacity_counts_spares_and_trims_them_to_make_room(nursery, tmp_path, secret):
    cap_bytes = 3 * MiB + 64 * KiB
    server, port = await start_store(
        nursery, tmp_path / "d", secret, capacity=cap_bytes, spare_min=0
    )
    async with open_client(port, secret) as c:
        _, full = await _put_three_delete_two(c, server, secret)
        stats = await c.node_stats()
        # Spares are free space to the cluster: any put may have them.
        assert stats.free == full.free + 2 * layout.file_size_for(MiB)
        # A put that needs more than the spares' neighbours leave: spares are unlinked.
        big, cap = new_chunk(secret)
        await c.put(big, payload(2 * MiB, 7), cap)
        assert server.used + server.spares.bytes <= cap_bytes
        assert len(list(server.spares.directory.iterdir())) == server.spares.count
        assert bytes(await c.get(big)) == payload(2 * MiB, 7)
        with pytest.raises(DiskFull):
            cid, cap = new_chunk(secret)
            await c.put(cid, payload(MiB, 8), cap)
        assert server.used + server.spares.bytes <= cap_bytes


@pytest.fixture
def small_fs_4m(tmp_path):
    yield from small_tmpfs(tmp_path, "4m")


async def test_real_disk_full_unlinks_spares_and_retries(small_fs_4m, secret):
    async with trio.open_nursery() as nursery:
        server, port = await start_store(nursery, small_fs_4m / "data", secret, spare_min=0)
        async with open_client(port, secret) as c:
            cids, _ = await _put_three_delete_two(c, server, secret)
            # 2.5 MiB fits only once both spares are gone: the first write (into a grown
            # spare) hits ENOSPC, the spares are unlinked and the put is tried again.
            big, cap = new_chunk(secret)
            await c.put(big, payload(5 * MiB // 2, 5), cap)
            assert bytes(await c.get(big)) == payload(5 * MiB // 2, 5)
            assert bytes(await c.get(cids[2])) == payload(MiB, 2)
            assert server.spares.count == 0 and not list(server.spares.directory.iterdir())
            assert not list(small_fs_4m.rglob(".tmp-*"))
            with pytest.raises(DiskFull):
                cid, cap = new_chunk(secret)
                await c.put(cid, payload(MiB, 6), cap)
            assert (await c.node_stats()).chunk_count == 2
        nursery.cancel_scope.cancel()


# --- directory fsync group commit -----------------------------------------------------------


def _run_dir_syncs(monkeypatch, tmp_path, fail_first: bool) -> tuple[list, list]:
    """8 threads call _DirSync.sync on one directory; fsyncs are slow and recorded."""
    import threading
    import time

    syncs: list[tuple[float, float, bool]] = []  # (start, end, ok) of each real fsync
    calls: list[tuple[float, float, BaseException | None]] = []
    lock = threading.Lock()

    def slow_fsync(path):
        start = time.monotonic()
        time.sleep(0.02)
        with lock:
            ok = not (fail_first and not syncs)
            syncs.append((start, time.monotonic(), ok))
        if not ok:
            raise OSError(5, "Input/output error")

    monkeypatch.setattr(writes, "_fsync_dir", slow_fsync)
    group = writes._DirSync()

    def caller(i):
        time.sleep(0.005 * i)
        t = time.monotonic()
        err = None
        try:
            group.sync(tmp_path)
        except OSError as e:
            err = e
        with lock:
            calls.append((t, time.monotonic(), err))

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return syncs, calls


@pytest.mark.parametrize("fail_first", [False, True])
def test_directory_fsyncs_are_shared_and_never_cover_a_later_rename(
    monkeypatch, tmp_path, fail_first
):
    syncs, calls = _run_dir_syncs(monkeypatch, tmp_path, fail_first)
    assert len(calls) == 8 and len(syncs) < 8  # shared
    failed = [c for c in calls if c[2] is not None]
    assert len(failed) == (1 if fail_first else 0)  # only the thread whose fsync failed
    for called, returned, err in calls:
        if err is None:  # covered by a successful fsync that started after the call
            assert any(ok and s >= called and e <= returned for s, e, ok in syncs)


def test_a_directory_fsync_wakes_only_the_threads_waiting_for_that_directory(monkeypatch, tmp_path):
    """Puts spread over 256 shard directories: one thread's fsync of its directory must not
    wake (and send after the GIL) every thread waiting for another directory's."""
    import threading
    import time

    waits = {"a": 0}
    a_started = threading.Event()
    plain_condition = threading.Condition

    class CountingCondition(plain_condition):
        def wait(self, timeout=None):
            if threading.current_thread().name == "waiter-a":
                waits["a"] += 1
            return super().wait(timeout)

    def fsync(path):
        if path.name == "a":
            a_started.set()
            time.sleep(0.3)

    monkeypatch.setattr(writes.threading, "Condition", CountingCondition)
    monkeypatch.setattr(writes, "_fsync_dir", fsync)
    group = writes._DirSync()
    a, b = tmp_path / "a", tmp_path / "b"
    first_a = threading.Thread(target=group.sync, args=(a,))
    first_a.start()
    assert a_started.wait(10)
    waiter = threading.Thread(target=group.sync, args=(a,), name="waiter-a")
    waiter.start()  # waits for the running fsync of a, then runs its own
    deadline = time.monotonic() + 10
    while not waits["a"] and time.monotonic() < deadline:
        time.sleep(0.001)
    for _ in range(20):
        group.sync(b)  # twenty fsyncs of b complete meanwhile
        time.sleep(0.002)
    first_a.join(10)
    waiter.join(10)
    assert not waiter.is_alive()
    assert waits["a"] <= 2  # woken by a's fsync, not by b's
