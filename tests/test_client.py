"""The data-path client against a real local cluster: round trips for every EC policy at the
block boundaries, POSIX-ish writer semantics, bad inputs, and the blocking wrapper."""

from __future__ import annotations

import hashlib
import os

import pytest
import trio
from cluster_fixtures import TEST_CHUNK_SIZE

from tectonic_py.client.tectonic_client import TectonicClient, open_client
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import (
    FileExists,
    FileNotFound,
    InvalidArgument,
    InvalidName,
    StaleWriterToken,
)
from tectonic_py.launch.local_cluster import LocalCluster


@pytest.fixture
def local_cluster(shared_local_cluster: LocalCluster) -> LocalCluster:
    """One cluster for the module: no test here kills, stops or reconfigures a daemon (the
    one that needs 14 chunk stores starts its own)."""
    return shared_local_cluster


def _data(n: int, seed: int = 0) -> bytes:
    block = hashlib.sha256(f"{seed}".encode()).digest() * 2048  # 64 KiB, not all equal
    reps = -(-n // len(block)) if n else 0
    return (block * reps)[:n]


async def _put(client: TectonicClient, path: str, data: bytes, ec: str | None = None) -> None:
    w = await client.create(path, ec=ec)
    # Uneven write sizes, so writes straddle block boundaries.
    pos, step = 0, 1_000_003
    while pos < len(data):
        await w.write(data[pos : pos + step])
        pos += step
    attrs = await w.close()
    assert attrs.size == len(data) and attrs.sealed


async def test_round_trips_every_policy_at_block_boundaries(tmp_path):
    # RS(10,4) needs 14 chunk stores in distinct failure domains.
    with LocalCluster(
        tmp_path / "c14",
        chunkstores=14,
        metadata_servers=1,
        shards=8,
        chunk_size=TEST_CHUNK_SIZE,
        heartbeat_interval=0.5,
    ) as cluster:
        async with open_client(cluster.cluster_file) as client:
            await _round_trips(client)


async def _round_trips(client: TectonicClient) -> None:
    for ec in ["rs-6-3", "rs-10-4", "rs-4-2", "r3"]:
        await client.mkdir(f"/{ec}")
        probe = await client.create(f"/{ec}/probe", ec=ec)
        await probe.close()
        attrs = await client.stat(f"/{ec}/probe")
        assert attrs.ec == ec
        block = ECPolicy.parse(ec).k * attrs.chunk_size
        for size in [0, 1, block - 1, block, block + 1, 3 * block + 12345]:
            data = _data(size, seed=size)
            await _put(client, f"/{ec}/f{size}", data, ec=ec)
            r = await client.open_read(f"/{ec}/f{size}")
            assert r.size == size
            # Random access: the systematic fast path (data-chunk ranges, no decoding).
            for off, n in [(size // 2, 4097), (max(0, size - 3), 100), (size + 5, 9), (7, 10)]:
                assert await r.pread(off, n) == data[off : off + n]
            await r.aclose()
            r = await client.open_read(f"/{ec}/f{size}")
            assert await r.read() == data
            assert await r.read() == b""
            await r.aclose()
    assert client.stats.degraded_reads == 0
    assert client.stats.range_reads > 0


async def test_pwrite_holes_truncate_and_read_your_writes(client):
    w = await client.create("/f")
    block = w.layout.block_size
    base = _data(2 * block + 100, seed=1)
    await w.write(base)
    assert await w.pread(block - 5, 10) == base[block - 5 : block + 5]
    # Overwrite inside an already-committed block (read-modify-write at the same index).
    await w.fsync()
    await w.pwrite(b"X" * 10, 5)
    expect = bytearray(base)
    expect[5:15] = b"X" * 10
    # A write past the end leaves a hole of zeros.
    await w.pwrite(b"tail", len(expect) + 1000)
    expect += bytes(1000) + b"tail"
    assert await w.pread(0, len(expect) + 10) == bytes(expect)
    await w.fsync()
    assert await w.pread(0, len(expect)) == bytes(expect)
    # Shrink into the middle of block 1, then grow sparse: the cut bytes read as zeros.
    await w.truncate(block + 7)
    await w.truncate(block + 20)
    expect = expect[: block + 7] + bytes(13)
    assert w.size == block + 20
    attrs = await w.close()
    assert attrs.size == block + 20
    assert await w.close() == attrs  # idempotent
    r = await client.open_read("/f")
    assert await r.read() == bytes(expect)
    # pread_into (what BufferedReader.readinto uses): into a dirty buffer, across the block
    # boundary and past EOF; the hole must come back as zeros, not as the buffer's old bytes.
    for offset, room in ((0, len(expect) + 50), (block - 3, 30), (block + 5, 40), (10, 0)):
        dest = bytearray(b"\xee" * room)
        n = await r.pread_into(offset, memoryview(dest))
        assert n == max(0, min(room, len(expect) - offset))
        assert dest[:n] == expect[offset : offset + n] and dest[n:] == b"\xee" * (room - n)
    assert await r.pread_view(block + 1, 19) == expect[block + 1 : block + 20]


async def test_fsync_of_a_short_block_then_append(client):
    w = await client.create("/log")
    await w.write(b"a" * 1000)
    await w.fsync()
    # After fsync another reader sees the committed bytes.
    st = await client.stat("/log")
    assert st.size == 1000
    await w.write(b"b" * 1000)
    await w.close()
    r = await client.open_read("/log")
    assert await r.read() == b"a" * 1000 + b"b" * 1000


async def test_reopen_and_append(client):
    await _put(client, "/g", b"hello ")
    st = await client.stat("/g")
    w = await client.open_writer(st.id, truncate=False)
    await w.write(b"world")
    await w.close()
    r = await client.open_reader(st.id)
    assert await r.read() == b"hello world"


async def test_second_writer_fences_the_first(client):
    block_data = _data(300_000, seed=7)
    w1 = await client.create("/ckpt")
    await w1.write(block_data)
    w2 = await client.open_writer(w1.file_id, truncate=True)
    await w2.write(b"second writer")
    with pytest.raises(StaleWriterToken):
        await w1.write(_data(w1.layout.block_size, seed=8))
        await w1.fsync()
    with pytest.raises(StaleWriterToken):
        await w1.close()
    await w2.close()
    r = await client.open_read("/ckpt")
    assert await r.read() == b"second writer"


async def test_namespace_operations(client):
    await client.mkdir("/a/b/c", parents=True)
    await client.mkdir("/a/b/c", parents=True)  # exists: fine with parents
    with pytest.raises(FileExists):
        await client.mkdir("/a")
    await _put(client, "/a/b/c/x.tmp", b"payload")
    await client.rename("/a/b/c/x.tmp", "/a/b/c/x")
    assert [e.name for e in await client.listdir("/a/b/c")] == ["x"]
    assert (await client.stat("/a/b/c/x")).size == 7
    await client.unlink("/a/b/c/x")
    with pytest.raises(FileNotFound):
        await client.stat("/a/b/c/x")
    with pytest.raises(FileNotFound):
        await client.open_read("/nope")
    await client.rmdir("/a/b/c")


async def test_bad_inputs_get_clear_errors_and_lose_nothing(client):
    with pytest.raises(InvalidName):
        await client.create("relative/path")
    with pytest.raises(InvalidName):
        await client.stat("/a/../b")
    with pytest.raises(InvalidArgument):
        await client.create("/x", ec="rs-99-1")
    w = await client.create("/ok")
    await w.write(b"keep")
    with pytest.raises(InvalidArgument):
        await w.pwrite(b"x", -1)
    with pytest.raises(InvalidArgument):
        await w.pread(-1, 5)
    with pytest.raises(InvalidArgument):
        await w.truncate(-3)
    await w.close()
    with pytest.raises(InvalidArgument):
        await w.write(b"after close")
    r = await client.open_read("/ok")
    with pytest.raises(InvalidArgument):
        await r.pread(-1, 1)
    assert await r.read() == b"keep"


async def test_abort_keeps_last_committed_state(client):
    await _put(client, "/h", b"v1")
    st = await client.stat("/h")
    w = await client.open_writer(st.id, truncate=False)
    await w.pwrite(b"XX", 0)
    await w.abort()
    r = await client.open_read("/h")
    assert await r.read() == b"v1"


async def test_concurrent_writers_share_the_window(local_cluster):
    # A window of 2 blocks for 8 concurrent writers: they queue for buffers, none fails.
    async with open_client(local_cluster.cluster_file, window_bytes=60 << 20) as client:

        async def one(i: int) -> None:
            await _put(client, f"/w{i}", _data(5_000_000, seed=i))

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(one, i)
        for i in range(8):
            r = await client.open_read(f"/w{i}")
            assert await r.read() == _data(5_000_000, seed=i)
        assert client.buffers.charged == 0


def test_blocking_connect_with_torch(local_cluster):
    torch = pytest.importorskip("torch", reason="needs torch (deploy/install.sh installs it)")

    import tectonic_py

    state = {"w": torch.arange(300_000, dtype=torch.float32), "step": 10}
    with tectonic_py.connect(local_cluster.cluster_file) as fs:
        fs.mkdir("/ckpt")
        with fs.open("/ckpt/rank_0.pt", "wb") as f:
            torch.save(state, f)
        assert fs.stat("/ckpt/rank_0.pt").size > 1_200_000
        with fs.open("/ckpt/rank_0.pt", "rb") as f:
            loaded = torch.load(f)
        assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 10
        with pytest.raises(FileExists):
            fs.open("/ckpt/rank_0.pt", "xb")
        assert [e.name for e in fs.listdir("/ckpt")] == ["rank_0.pt"]
        data = os.urandom(1000)
        with fs.open("/ckpt/raw", "wb") as f:
            f.write(data)
        with fs.open("/ckpt/raw", "rb") as f:
            f.seek(10)
            assert f.read(20) == data[10:30]


async def test_round_robin_writes_to_many_files_from_one_task(local_cluster):
    """One task writing 12 files in turn, with a window of 4 blocks: idle writers' open blocks
    are spilled so the next file gets a buffer (without spilling this would hang forever)."""
    async with open_client(local_cluster.cluster_file, window_bytes=4 * 9 * 64 * 1024) as client:
        writers = [await client.create(f"/rr{i}") for i in range(12)]
        piece = 100_000
        with trio.fail_after(120):  # a bound on a hang, not a timing assertion
            for rnd in range(3):
                for i, w in enumerate(writers):
                    await w.write(_data(piece, seed=100 * rnd + i))
            for w in writers:
                await w.close()
        assert client.stats.spills > 0
        for i in range(12):
            r = await client.open_read(f"/rr{i}")
            expect = b"".join(_data(piece, seed=100 * rnd + i) for rnd in range(3))
            assert await r.read() == expect
        assert client.buffers.charged == 0
