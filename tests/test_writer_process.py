"""chunkstore.writer_process: the chunk store's writer process, as a real process."""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
import zlib
from pathlib import Path

import pytest
import trio
from test_chunkstore import NODE, new_chunk, open_client, start_store
from wire_helpers import address_of, mapping_at, mappings, vma_fields

from chunkstore import huge_tmpfs, layout, reads, writer_process
from chunkstore.server import ChunkStoreServer
from chunkstore.writer_process import NotShared, SharedBuffers, WriterProcess
from tectonic_py.core import rpc_client
from tectonic_py.core.buffers import HUGE_PAGE
from tectonic_py.core.errors import InvalidArgument, Unavailable, WriterLost


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


RESERVED = 4  # huge pages a test reserves


@pytest.fixture
def reserved_huge_pages():
    """``RESERVED`` more huge pages in the host's pool (``vm.nr_hugepages``) for the test,
    given back after it; skipped where that cannot be done (not root, no hugetlb)."""
    path = Path("/proc/sys/vm/nr_hugepages")
    try:
        before = int(path.read_text())
        path.write_text(str(before + RESERVED))
    except (OSError, ValueError):
        pytest.skip("cannot reserve huge pages here")
    try:
        if int(path.read_text()) < before + RESERVED or not writer_process.hugetlb_available():
            pytest.skip("the kernel found no memory for huge pages")
        yield RESERVED
    finally:
        path.write_text(str(before))


def _page_kib(buf: object) -> int:
    return int(vma_fields(address_of(buf))["KernelPageSize"].split()[0])


def _maps_payload(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "tectonic-payload" in f.read()


async def test_results_and_exceptions_come_back_from_another_process(nursery) -> None:
    pool = WriterProcess("test", 2, SharedBuffers())
    await nursery.start(pool.serve)
    pid = await pool.run(os.getpid)
    assert pid != os.getpid() and pid == pool.pid
    with pytest.raises(FileNotFoundError) as e:
        await pool.run(os.stat, "/nonexistent/tectonic")
    assert e.value.filename == "/nonexistent/tectonic"
    with pytest.raises(InvalidArgument):
        await pool.run(layout.validate_chunk_id, "../escape")
    assert await pool.run(os.path.join, Path("/a"), "b") == "/a/b"


async def test_shared_buffers_go_by_reference_and_others_by_value(nursery) -> None:
    buffers = SharedBuffers()
    pool = WriterProcess("test", 1, buffers)
    await nursery.start(pool.serve)
    buf = buffers.new(1 << 20)
    view = memoryview(buf)
    view[:] = os.urandom(len(view))
    assert await pool.run(zlib.crc32, view[4096:]) == zlib.crc32(view[4096:])
    view[5000] ^= 0xFF  # the writer sees the same pages, not a copy made at its first use
    assert await pool.run(zlib.crc32, view[4096:]) == zlib.crc32(view[4096:])
    small = memoryview(bytearray(b"not shared"))
    assert await pool.run(zlib.crc32, small) == zlib.crc32(small)
    large = memoryview(bytearray(os.urandom(writer_process.MAX_INLINE + 1)))  # via a copy
    assert await pool.run(zlib.crc32, large) == zlib.crc32(large)
    del view
    assert len(buffers) == 1  # the copy was freed once its job was answered


async def test_the_writer_forgets_freed_buffers(nursery, monkeypatch) -> None:
    monkeypatch.setattr(writer_process, "FORGET_INTERVAL", 0.05)
    buffers = SharedBuffers()
    pool = WriterProcess("test", 1, buffers)
    await nursery.start(pool.serve)
    buf = buffers.new(256 * 1024)
    await pool.run(zlib.crc32, memoryview(buf))
    pid = pool.pid
    assert pid is not None and _maps_payload(pid)
    del buf
    gc.collect()
    assert len(buffers) == 0
    with trio.fail_after(10):
        while _maps_payload(pid):
            await trio.sleep(0.05)


async def test_jobs_run_on_the_writers_threads_at_once(nursery) -> None:
    pool = WriterProcess("test", 4, SharedBuffers())
    await nursery.start(pool.serve)
    await pool.run(os.getpid)
    start = time.monotonic()
    async with trio.open_nursery() as n:
        for _ in range(4):
            n.start_soon(pool.run, time.sleep, 1.0)
    # Four threads take 1 s, one after the other 4 s: the bound leaves a shared machine 2 s.
    assert time.monotonic() - start < 3.0


async def test_a_killed_writer_fails_its_jobs_and_is_restarted(nursery) -> None:
    pool = WriterProcess("test", 2, SharedBuffers())
    await nursery.start(pool.serve)
    first = await pool.run(os.getpid)
    lost: list[BaseException] = []

    async def slow() -> None:
        try:
            await pool.run(time.sleep, 30)
        except WriterLost as e:
            lost.append(e)

    async with trio.open_nursery() as n:
        n.start_soon(slow)
        n.start_soon(slow)
        with trio.fail_after(10):
            while pool.busy < 2:
                await trio.sleep(0.01)
        os.kill(first, signal.SIGKILL)
    assert len(lost) == 2 and all(e.retryable and "died" in str(e) for e in lost)
    with trio.fail_after(20):
        second = await pool.run(os.getpid)
    assert second != first and not _alive(first)
    assert pool.started == 2


async def test_a_writer_thread_that_fails_takes_the_writer_down_and_a_new_one_up(nursery) -> None:
    """A thread that dies (here: SystemExit, which is not an answer) must not leave its job's
    caller waiting forever: the writer exits, the job fails, and the next job gets a new one."""
    import sys

    pool = WriterProcess("test", 2, SharedBuffers())
    await nursery.start(pool.serve)
    first = await pool.run(os.getpid)
    with pytest.raises(WriterLost), trio.fail_after(20):
        await pool.run(sys.exit, 3)
    with trio.fail_after(20):
        assert await pool.run(os.getpid) != first


async def test_a_job_sent_to_the_writer_is_waited_for_when_cancelled(nursery) -> None:
    pool = WriterProcess("test", 1, SharedBuffers())
    await nursery.start(pool.serve)
    await pool.run(os.getpid)
    start = time.monotonic()
    with trio.move_on_after(0.05):
        await pool.run(time.sleep, 0.5)
    assert time.monotonic() - start >= 0.45  # a half-done disk job is not abandoned
    assert pool.busy == 0


async def test_jobs_beyond_the_threads_wait_in_order(nursery) -> None:
    pool = WriterProcess("test", 2, SharedBuffers())
    await nursery.start(pool.serve)
    started: list[int] = []

    async def one(i: int) -> None:
        started.append(i)
        await pool.run(time.sleep, 0.05)

    async with trio.open_nursery() as n:
        for i in range(10):
            n.start_soon(one, i)
            await trio.sleep(0.001)
        await trio.sleep(0.02)
        assert pool.busy == 2 and pool.queued == 8 and pool.sent == 4
    assert sorted(started) == list(range(10))


async def test_shutdown_finishes_the_jobs_and_reaps_the_writer() -> None:
    pool = WriterProcess("test", 3, SharedBuffers())
    results: list[float] = []

    async def one() -> None:
        results.append(await pool.run(time.sleep, 0.2) or 1.0)

    async with trio.open_nursery() as nursery:
        await nursery.start(pool.serve)
        async with trio.open_nursery() as jobs:
            for _ in range(3):
                jobs.start_soon(one)
            with trio.fail_after(10):
                while pool.busy < 3:
                    await trio.sleep(0.01)
            pid = pool.pid
            nursery.cancel_scope.cancel()  # serve ends while the jobs run
    assert results == [1.0] * 3
    assert pid is not None and not _alive(pid)
    with pytest.raises(Unavailable):
        await pool.run(os.getpid)


def test_the_writer_dies_with_its_daemon(tmp_path: Path) -> None:
    """kill -9 of the daemon: the kernel kills its writer too (no job runs for nobody)."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "daemon.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys, trio
            from chunkstore.writer_process import SharedBuffers, WriterProcess

            async def main():
                pool = WriterProcess("test", 1, SharedBuffers())
                async with trio.open_nursery() as n:
                    await n.start(pool.serve)
                    print(await pool.run(os.getpid), flush=True)
                    await trio.sleep_forever()

            trio.run(main)
            """
        )
    )
    root = str(Path(writer_process.__file__).resolve().parent.parent)
    daemon = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": root},
    )
    try:
        assert daemon.stdout is not None
        writer = int(daemon.stdout.readline())
        assert _alive(writer)
        daemon.kill()
        daemon.wait(10)
        deadline = time.monotonic() + 10
        while _alive(writer) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(writer)
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait(10)
        if daemon.stdout is not None:
            daemon.stdout.close()


async def test_a_chunk_store_whose_writer_is_killed_mid_put_loses_no_acknowledged_chunk(
    nursery, tmp_path: Path, secret: bytes
) -> None:
    """kill -9 of the writer process under puts: each put is acknowledged or fails with a
    retryable error; the retries succeed on the restarted writer; every chunk reads back."""
    from chunkstore.client import ChunkClient
    from tectonic_py.core import capability, ids, rpc_client
    from tectonic_py.core.checksum import checksum
    from tectonic_py.core.errors import TectonicError

    server, port = await start_store(nursery, tmp_path / "data", secret)
    assert isinstance(server._writers, WriterProcess)
    first = server._writers.pid
    assert first is not None
    block = ids.new_id()
    cap = capability.issue(secret, block, [NODE])
    chunks = {ids.chunk_id(block, i): os.urandom(256 * 1024 + i) for i in range(48)}
    failed: list[str] = []
    async with rpc_client.open_connection("127.0.0.1", port, secret) as conn:
        client = ChunkClient(conn)

        async def put(cid: str) -> None:
            try:
                await client.put(cid, chunks[cid], cap, checksum=checksum(chunks[cid]))
            except TectonicError as e:
                assert e.retryable, e
                failed.append(cid)

        async with trio.open_nursery() as n:
            for i, cid in enumerate(chunks):
                n.start_soon(put, cid)
                if i == 16:
                    with trio.fail_after(10):
                        while not server._writers.busy:
                            await trio.sleep(0.001)
                    os.kill(first, signal.SIGKILL)
        with trio.fail_after(30):
            while server._writers.pid in (None, first):
                await trio.sleep(0.05)
        assert failed, "the kill caught no put in flight"
        for cid in failed:
            await client.put(cid, chunks[cid], cap, checksum=checksum(chunks[cid]))
        for cid, data in chunks.items():
            assert bytes(await client.get(cid)) == data
    assert not _alive(first) and server._writers.started == 2


async def test_counts_follow_a_put_or_delete_whose_writer_died_after_its_rename(
    nursery, tmp_path: Path, secret: bytes, monkeypatch
) -> None:
    """Whether the writer died before or after the rename is read from the disk: a spare that
    became the chunk is counted as stored, a chunk that became the spare as deleted."""
    from chunkstore.client import ChunkClient
    from tectonic_py.core import capability, ids, rpc_client

    server, port = await start_store(nursery, tmp_path / "data", secret, spare_min=0)
    block = ids.new_id()
    cid = ids.chunk_id(block, 0)
    async with rpc_client.open_connection("127.0.0.1", port, secret) as conn:
        client = ChunkClient(conn)
        await client.put(cid, os.urandom(10_000), capability.issue(secret, block, [NODE]))
        path = layout.chunk_path(server.data_dir, cid)
        size = path.stat().st_size
        count, used, spares = server.chunk_count, server.used, server.spares.count

        async def died_after_rename(fn: object, data_dir: Path, chunk_id: str, spare: Path) -> None:
            layout.chunk_path(data_dir, chunk_id).rename(spare)
            raise WriterLost("test: the writer died after the delete's rename")

        with monkeypatch.context() as m:
            m.setattr(server._writers, "run", died_after_rename)
            with pytest.raises(WriterLost):
                await client.delete(cid)
        assert (server.chunk_count, server.used) == (count - 1, used - size)
        assert server.spares.count == spares + 1

    taken = server.spares.take(size)
    assert taken is not None
    await server._after_lost_put(cid, taken.path, size)  # died before its rename
    assert not taken.path.exists() and (server.chunk_count, server.used) == (count - 1, used - size)
    other = server.spares.new_path()
    other.write_bytes(b"x")
    other.rename(path)  # the put's rename happened, then its writer died
    await server._after_lost_put(cid, other, size)
    assert (server.chunk_count, server.used) == (count, used)


async def test_out_of_file_descriptors_a_large_put_is_busy_and_the_store_serves_on(
    nursery, tmp_path: Path, secret: bytes, monkeypatch
) -> None:
    """Each shared buffer holds file descriptors. Without any to spare, a payload is still
    received (into a private buffer) and the put is refused as retryable Busy, not dropped
    with the connection, and the spare file it had taken goes back to the pool; small puts
    go on, and large ones work again once descriptors do."""
    import errno

    from chunkstore.client import ChunkClient
    from tectonic_py.core import capability, ids, rpc_client
    from tectonic_py.core.errors import Busy

    server, port = await start_store(nursery, tmp_path / "data", secret, spare_min=0)
    block = ids.new_id()
    cap = capability.issue(secret, block, [NODE])
    large, small = os.urandom(2 << 20), os.urandom(1000)

    def no_fds(*_args: object) -> int:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    async with rpc_client.open_connection("127.0.0.1", port, secret) as conn:
        client = ChunkClient(conn)
        await client.put(ids.chunk_id(block, 9), large[: 1 << 20], cap)  # (a smaller buffer)
        await client.delete(ids.chunk_id(block, 9))  # its file becomes a spare
        assert server.spares.count == 1
        with monkeypatch.context() as m:
            m.setattr(os, "memfd_create", no_fds)
            m.setattr(huge_tmpfs, "tmpfile_buffer", no_fds)
            with pytest.raises(Busy):
                await client.put(ids.chunk_id(block, 0), large, cap)
            assert server.spares.count == 1  # taken for the put, and given back
            assert len(list(server.spares.directory.iterdir())) == 1
            await client.put(ids.chunk_id(block, 1), small, cap)
        await client.put(ids.chunk_id(block, 0), large, cap)
        assert bytes(await client.get(ids.chunk_id(block, 0))) == large
        assert bytes(await client.get(ids.chunk_id(block, 1))) == small


def test_without_reserved_huge_pages_buffers_are_ordinary_memfds() -> None:
    buffers = SharedBuffers(hugetlb=False, tmpfs=False)
    assert not buffers.huge and buffers.pages == "small"
    buf = buffers.new(2 * HUGE_PAGE)
    buf[:] = b"x" * len(buf)
    assert _page_kib(buf) == 4 and buffers.hugetlb == buffers.hugetlb_short == 0


async def test_reserved_huge_pages_back_whole_huge_page_buffers_until_used_up(
    nursery, reserved_huge_pages: int
) -> None:
    """Where the host has reserved huge pages, a buffer of whole huge pages is a hugetlb
    memfd the writer process maps too; once the reservation is used up, buffers are ordinary
    memfds again and nothing fails. (Where a private tmpfs can be made, it comes first.)"""
    buffers = SharedBuffers(tmpfs=False)
    assert buffers.huge and buffers.pages == "hugetlb"
    pool = WriterProcess("test", 1, buffers)
    await nursery.start(pool.serve)
    bufs = [buffers.new(HUGE_PAGE) for _ in range(reserved_huge_pages + 1)]
    for buf in bufs:
        memoryview(buf)[:] = os.urandom(len(buf))
        assert await pool.run(zlib.crc32, memoryview(buf)[4096:]) == zlib.crc32(buf[4096:])
    assert [_page_kib(buf) for buf in bufs] == [2048] * reserved_huge_pages + [4]
    assert buffers.hugetlb == reserved_huge_pages and buffers.hugetlb_short == 1
    assert buffers.new(HUGE_PAGE // 2) is not None  # not whole pages: never tried
    assert buffers.hugetlb_short == 1


async def _round_trip(port: int, secret: bytes, sizes: list[int]) -> None:
    """Put chunks of ``sizes`` bytes to the store on ``port``, then get each back whole."""
    chunks = [(*new_chunk(secret), os.urandom(n)) for n in sizes]
    async with open_client(port, secret) as client:
        for cid, cap, data in chunks:
            await client.put(cid, data, cap)
        for cid, _cap, data in chunks:
            assert bytes(await client.get(cid)) == data


async def test_a_chunk_store_puts_from_reserved_huge_pages(
    nursery, tmp_path: Path, secret: bytes, reserved_huge_pages: int
) -> None:
    server, port = await start_store(nursery, tmp_path / "data", secret, payload_tmpfs=False)
    await _round_trip(port, secret, [1 << 20, 1000, 3 << 20])
    stats = await server.node_stats()
    assert stats["hugetlb_buffers"] >= 1


def test_a_host_that_refuses_huge_pages_after_all_gets_small_ones(monkeypatch) -> None:
    """Whatever the hugetlb memfd fails with (EPERM from a sandbox, ENOMEM), the buffer is
    made in small pages; only running out of descriptors is the caller's to handle."""
    import errno

    real = os.memfd_create
    refusal = [errno.EPERM]

    def memfd_create(name: str, flags: int = 0) -> int:
        if flags & os.MFD_HUGETLB:
            raise OSError(refusal[0], os.strerror(refusal[0]))
        return real(name, flags)

    monkeypatch.setattr(writer_process, "hugetlb_available", lambda: True)  # found at start
    buffers = SharedBuffers(tmpfs=False)
    monkeypatch.setattr(os, "memfd_create", memfd_create)
    buf = buffers.new(HUGE_PAGE)
    buf[:] = b"x" * len(buf)
    assert _page_kib(buf) == 4 and buffers.hugetlb == 0 and buffers.hugetlb_short == 1
    refusal[0] = errno.EMFILE
    assert buffers.new(HUGE_PAGE) is not None and buffers.private == 1


# --- a private tmpfs of huge pages (chunkstore.huge_tmpfs) ------------------------------------


@pytest.fixture
def payload_tmpfs() -> int:
    root = huge_tmpfs.private_tmpfs()
    if root is None:
        pytest.skip("no private tmpfs can be made here (no mount or user namespace)")
    return root


def _pmd_mapped_kib(smaps_block: dict[str, str]) -> int:
    return int(smaps_block.get("ShmemPmdMapped", "0 kB").split()[0])


def _mount_table() -> str:
    with open("/proc/self/mountinfo") as f:
        return f.read()


def _mapping_name(buf: object) -> str:
    found = mapping_at(address_of(buf))
    assert found is not None, "buffer not mapped"
    return found.name


async def test_payload_buffers_are_huge_pages_of_a_tmpfs_no_one_else_sees(
    nursery, payload_tmpfs: int
) -> None:
    """By default a buffer is a file of the daemon's own tmpfs of huge pages: transparent
    huge pages in this process and in the writer process, the same pages in both, and no
    mount on this host's mount table."""
    buffers = SharedBuffers(hugetlb=False)
    assert buffers.pages == "thp-tmpfs" and buffers.huge
    pool = WriterProcess("test", 1, buffers)
    await nursery.start(pool.serve)
    buf = buffers.new(2 * HUGE_PAGE)
    memoryview(buf)[:] = os.urandom(len(buf))
    assert _pmd_mapped_kib(vma_fields(address_of(buf))) == 4096
    name = _mapping_name(buf)
    assert "tectonic-payload" in name and name.endswith("(deleted)")
    assert await pool.run(zlib.crc32, memoryview(buf)) == zlib.crc32(buf)  # (maps it there)
    assert pool.pid is not None
    there = [m for m in mappings(pool.pid) if m.name == name]
    assert len(there) == 1, there
    assert _pmd_mapped_kib(there[0].fields) == 4096
    assert "tectonic-payload" not in _mount_table()


_AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def test_a_daemon_that_is_not_root_gets_its_tmpfs_through_a_user_namespace() -> None:
    """The helper's other path: an unprivileged daemon (uid nobody here) gets a tmpfs of
    huge pages too, through a user namespace of the helper's own, and may make files in it."""
    import shutil
    import subprocess
    import tempfile
    import textwrap

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root (to become nobody) and setpriv")
    probe = subprocess.run(
        [*_AS_NOBODY, "unshare", "--user", "--map-current-user", "true"],
        capture_output=True,
        check=False,
    )
    if probe.returncode != 0:
        pytest.skip("unprivileged user namespaces are off here")
    # The module needs only the standard library and tectonic_py.core.process_env: a copy of
    # those that nobody can read will do (the checkout itself may be closed to nobody).
    repo = Path(huge_tmpfs.__file__).resolve().parent.parent
    home = Path(tempfile.mkdtemp(prefix="tectonic-nobody-"))
    try:
        home.chmod(0o755)
        for module in (
            "chunkstore/__init__.py",
            "chunkstore/huge_tmpfs.py",
            "tectonic_py/__init__.py",
            "tectonic_py/process_env.py",
        ):
            (home / module).parent.mkdir(mode=0o755, exist_ok=True)
            shutil.copy(repo / module, home / module)
            (home / module).chmod(0o644)
        script = textwrap.dedent(
            r"""
            import re
            from chunkstore import huge_tmpfs
            root = huge_tmpfs.open_private_tmpfs()
            fd, buf = huge_tmpfs.tmpfile_buffer(root, 4 << 20)
            buf[:] = b"x" * len(buf)
            smaps = open("/proc/self/smaps").read()
            for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", smaps):
                if "tectonic-payload" in block.split("\n")[0]:
                    print(re.search(r"ShmemPmdMapped:\s+(\d+) kB", block).group(1))
            """
        )
        done = subprocess.run(
            [*_AS_NOBODY, "/usr/bin/python3", "-c", script],
            cwd=home,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["4096"]
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_where_no_tmpfs_can_be_made_the_helper_says_why(monkeypatch) -> None:
    refuse = "import sys; print('unshare: Operation not permitted', file=sys.stderr); sys.exit(1)"
    monkeypatch.setattr(huge_tmpfs, "helper_command", lambda: [sys.executable, "-c", refuse])
    with pytest.raises(OSError, match=r"exit status 1\): unshare: Operation not permitted"):
        huge_tmpfs.open_private_tmpfs()


def test_without_a_tmpfs_buffers_are_memfds(monkeypatch) -> None:
    monkeypatch.setattr(huge_tmpfs, "private_tmpfs", lambda: None)
    buffers = SharedBuffers(hugetlb=False)
    assert buffers.pages == "small" and not buffers.huge
    buf = buffers.new(HUGE_PAGE)
    assert "memfd:tectonic-payload" in _mapping_name(buf)


def test_a_tmpfs_that_refuses_a_file_gives_a_memfd_instead(monkeypatch, payload_tmpfs) -> None:
    """A full tmpfs (it may hold half the memory) costs the buffer its huge pages, not the
    put; running out of descriptors is still the caller's to handle (a private buffer)."""
    import errno

    refusal = [errno.ENOSPC]

    def refuse(*_args: object) -> None:
        raise OSError(refusal[0], os.strerror(refusal[0]))

    buffers = SharedBuffers(hugetlb=False)
    monkeypatch.setattr(huge_tmpfs, "tmpfile_buffer", refuse)
    buf = buffers.new(HUGE_PAGE)
    assert "memfd:tectonic-payload" in _mapping_name(buf) and buffers.tmpfs_short == 1
    refusal[0] = errno.EMFILE
    assert buffers.new(HUGE_PAGE) is not None and buffers.private == 1


async def test_a_chunk_store_puts_from_its_tmpfs_of_huge_pages(
    nursery, tmp_path: Path, secret: bytes, payload_tmpfs: int
) -> None:
    server, port = await start_store(nursery, tmp_path / "data", secret)
    await _round_trip(port, secret, [1 << 20, 1000, 4 << 20])
    stats = await server.node_stats()
    assert stats["payload_pages"] == "thp-tmpfs" and stats["hugetlb_buffers"] == 0


async def test_gets_and_puts_share_the_tmpfs_buffers(
    nursery, tmp_path: Path, secret: bytes, payload_tmpfs: int
) -> None:
    """A buffer a put gave back serves the next get of that size, instead of each kind
    freeing huge pages that the other then faults in afresh; with memfds for puts, gets
    keep their own pool of private huge pages."""
    from chunkstore.client import ChunkClient
    from tectonic_py.core import capability, ids

    server, port = await start_store(nursery, tmp_path / "data", secret)
    other, _ = await start_store(nursery, tmp_path / "other", secret, payload_tmpfs=False)
    assert server._replies is not None and other._replies is not None
    assert server._replies.spares is server.rpc.buffers
    assert other._replies.spares is not other.rpc.buffers
    block = ids.new_id()
    cap = capability.issue(secret, block, [NODE])
    chunk = os.urandom(1 << 20)
    async with rpc_client.open_connection("127.0.0.1", port, secret) as conn:
        client = ChunkClient(conn)
        await client.put(ids.chunk_id(block, 0), chunk, cap)
        reused = server.rpc.buffers.reused
        assert bytes(await client.get(ids.chunk_id(block, 0))) == chunk
        assert server.rpc.buffers.reused == reused + 1


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's reaper may take its time)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_writer_outlives_the_thread_that_started_it_and_dies_with_its_daemon(
    tmp_path: Path,
) -> None:
    """trio starts processes from a worker thread that ends when idle; the writer must not
    die with that thread (PR_SET_PDEATHSIG did that: an idle store lost its writer every ten
    seconds), only with its daemon."""
    import subprocess
    import textwrap

    script = tmp_path / "daemon.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, socket, subprocess, sys, threading, time
            from chunkstore.writer_process import READY
            parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            started = []
            def start():  # as trio's worker thread: it ends once the writer is up
                started.append(subprocess.Popen(
                    [sys.executable, "-m", "chunkstore.writer_process", str(child.fileno()),
                     "1", str(os.getpid()), "test"],
                    pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL))
                assert parent.recv(64) == READY
            starter = threading.Thread(target=start)
            starter.start()
            starter.join()
            print(started[0].pid, flush=True)
            time.sleep(120)
            """
        )
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    daemon = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, env=env, text=True
    )
    writer = None
    try:
        assert daemon.stdout is not None
        writer = int(daemon.stdout.readline())
        time.sleep(1.0)
        assert _running(writer)
        daemon.kill()
        daemon.wait()
        deadline = time.monotonic() + 10
        while _running(writer) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(writer)
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        if daemon.stdout is not None:
            daemon.stdout.close()
        if writer is not None and _running(writer):
            os.kill(writer, signal.SIGKILL)


# --- gets on the writer's read threads -------------------------------------------------------


async def test_reads_have_threads_and_a_limit_of_their_own(nursery) -> None:
    buffers = SharedBuffers()
    pool = WriterProcess("test", 1, buffers, read_threads=2)
    await nursery.start(pool.serve)
    async with trio.open_nursery() as n:
        n.start_soon(pool.run, time.sleep, 3.0)
        with trio.fail_after(10):
            while pool.busy < 1:
                await trio.sleep(0.01)
        # The one write thread is busy: a read goes on a thread of its own, not after it.
        assert await pool.read(os.getpid) == pool.pid
        assert pool.busy == 1 and pool.sent == 1 and pool.reading == 0
        seen: list[int] = []
        async with trio.open_nursery() as reads:
            for _ in range(3):
                reads.start_soon(pool.read, time.sleep, 0.3)
            while pool.reading or not seen:
                seen.append(pool.reading)
                await trio.sleep(0.01)
        assert max(seen) == 2  # three reads, two read threads
        assert pool.busy == 1
        n.cancel_scope.cancel()
    with pytest.raises(NotShared, match="shared"):  # where ``fn`` would write into a copy
        await pool.read(zlib.crc32, memoryview(bytearray(10)))
    assert await pool.read(zlib.crc32, memoryview(buffers.new(4096))) == zlib.crc32(bytes(4096))


async def test_a_pool_without_read_threads_takes_no_read(nursery) -> None:
    pool = WriterProcess("test", 1, SharedBuffers())
    await nursery.start(pool.serve)
    with pytest.raises(ValueError, match="no read threads"):
        await pool.read(os.getpid)


def test_thread_counts_are_checked() -> None:
    with pytest.raises(ValueError, match="at least one thread, not 0"):
        WriterProcess("test", 0, SharedBuffers())
    with pytest.raises(ValueError, match="read_threads must be 0 or more, not -1"):
        WriterProcess("test", 1, SharedBuffers(), read_threads=-1)


@pytest.fixture
def daemon_reads(monkeypatch) -> list[int]:
    """Counts the chunk reads this process (the daemon) does itself, in its threads."""
    calls: list[int] = []
    real = reads.read_chunk

    def read_chunk(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(reads, "read_chunk", read_chunk)
    return calls


async def test_whole_gets_are_read_by_the_writers_read_threads(
    nursery, tmp_path: Path, secret: bytes, payload_tmpfs: int, daemon_reads: list[int]
) -> None:
    """A get from a chunk's start is read into its reply buffer by the writer process once
    the daemon knows what buffer a chunk takes; a ranged get, a first get and a chunk larger
    than the buffer are read in the daemon's threads. Errors come back as themselves."""
    from test_chunkstore import flip_byte

    from tectonic_py.core.errors import ChunkCorrupt, ChunkNotFound

    server, port = await start_store(nursery, tmp_path / "data", secret)
    assert isinstance(server._writers, WriterProcess)
    assert server._writers.read_threads == server.config.max_concurrent_reads
    sizes = [1 << 20, 1000, 4 << 20]
    data = [os.urandom(n) for n in sizes]
    chunks = [new_chunk(secret) for _ in sizes]
    cids = [cid for cid, _cap in chunks]
    async with open_client(port, secret) as client:
        for (cid, cap), chunk in zip(chunks, data):
            await client.put(cid, chunk, cap)

        async def get(i: int, *range_: int) -> int:
            got = await client.get(cids[i], *range_)
            want = data[i][range_[0] : range_[0] + range_[1]] if range_ else data[i]
            assert bytes(got) == want
            return len(daemon_reads)

        assert await get(0) == 1  # the first: no buffer size known yet
        assert await get(0) == 1
        assert await get(0, 0, 4096) == 1  # from the start: the same read, cut short
        assert await get(0, 100, 4096) == 2  # ranged
        assert await get(1) == 2  # fits the 1 MiB chunk's buffer
        assert await get(2) == 3  # larger than the small chunk's buffer: read again here
        assert await get(2) == 3
        with pytest.raises(ChunkNotFound):
            await client.get(new_chunk(secret)[0])
        path = layout.chunk_path(server.data_dir, cids[2])
        flip_byte(path, reads.read_header(path).data_offset + 12345)
        with pytest.raises(ChunkCorrupt):
            await client.get(cids[2])
        assert len(daemon_reads) == 3
        # Every reply buffer went back to the budget, those of the errors too.
        assert server.reply_bytes_held == 0
    stats = await server.node_stats()
    assert (stats["gets_by_writer"], stats["gets_by_daemon"]) == (4, 3)


async def _store_with_a_chunk(
    nursery, tmp_path: Path, secret: bytes
) -> tuple[ChunkStoreServer, int, str, bytes]:
    """A store holding a 1 MiB chunk, got back once: the gets after know its buffer size, so
    they go to the writer's read threads."""
    server, port = await start_store(nursery, tmp_path / "data", secret)
    assert isinstance(server._writers, WriterProcess)
    cid, cap = new_chunk(secret)
    chunk = os.urandom(1 << 20)
    async with open_client(port, secret) as client:
        await client.put(cid, chunk, cap)
        assert bytes(await client.get(cid)) == chunk
    return server, port, cid, chunk


async def test_a_get_whose_writer_dies_is_read_again_in_a_thread(
    nursery, tmp_path: Path, secret: bytes, payload_tmpfs: int, daemon_reads: list[int]
) -> None:
    server, port, cid, chunk = await _store_with_a_chunk(nursery, tmp_path, secret)
    assert isinstance(server._writers, WriterProcess)
    assert len(daemon_reads) == 1
    async with open_client(port, secret) as client:
        first = server._writers.pid
        assert first is not None
        os.kill(first, signal.SIGSTOP)  # the read job waits in the writer's socket
        got: list[bytes] = []

        async def get() -> None:
            got.append(bytes(await client.get(cid)))

        async with trio.open_nursery() as n:
            n.start_soon(get)
            with trio.fail_after(10):
                while not server._writers.reading:
                    await trio.sleep(0.005)
            os.kill(first, signal.SIGKILL)
        assert got == [chunk] and len(daemon_reads) == 2
        with trio.fail_after(30):
            while server._writers.pid in (None, first):
                await trio.sleep(0.05)
        assert bytes(await client.get(cid)) == chunk
        assert len(daemon_reads) == 2  # the new writer reads again


async def test_a_get_cancelled_while_the_writer_reads_it_gives_its_buffer_back(
    nursery, tmp_path: Path, secret: bytes, payload_tmpfs: int
) -> None:
    """The client goes away while its get is in the writer: the read is waited for (a job
    sent cannot be taken back), then its buffer and budget are returned, and the store
    serves on."""
    server, port, cid, chunk = await _store_with_a_chunk(nursery, tmp_path, secret)
    assert isinstance(server._writers, WriterProcess)
    pid = server._writers.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        async with open_client(port, secret) as client, trio.open_nursery() as n:
            n.start_soon(client.get, cid)
            with trio.fail_after(10):
                while not server._writers.reading:
                    await trio.sleep(0.005)
            n.cancel_scope.cancel()
        assert server.reply_bytes_held > 0  # held while the writer still has the job
    finally:
        os.kill(pid, signal.SIGCONT)
    with trio.fail_after(10):
        while server._writers.reading or server.reply_bytes_held:
            await trio.sleep(0.01)
    async with open_client(port, secret) as client:
        assert bytes(await client.get(cid)) == chunk
    assert server._writers.pid == pid and server.reply_bytes_held == 0
