"""Ceilings: the best this machine can do at each stage of the write and read paths.

A figure for tectonic-py means little alone: these machines are shared and noisy (runs vary
up to 2x, docs/ceilings.md), so every benchmark divides by a ceiling measured *in the
same run*. Each stage of the data path has its own ceiling here:

* raw disk: sequential write of 1 MiB buffers ending in fsync (what a chunk store's put
  costs at best), and a sequential read with the file's pages dropped first (cold cache);
  both again with O_DIRECT in 4 MiB requests (``disk_write_direct``, ``disk_read_direct``),
  the disk's speed without the page cache's: in a VM the buffered figures can be bound by
  the guest's CPU instead of the disk (see ``disk_read_direct``);
* zfec RS(k, m) encode and decode, 1 and 2 threads (zfec releases the GIL, so two threads
  should nearly double it), as MB/s of *data* and CPU-seconds per GiB;
* loopback TCP: blocking sockets (the kernel's ceiling), a trio stream using ``recv_into``,
  and our own wire protocol (``tectonic_py.core.rpc_server`` and ``rpc_client``) both ways,
  so its overhead is visible;
* msgpack: packing a header that holds 1 MiB of bytes, the copy the wire design avoids.

CPU-seconds per GiB are steadier than MB/s on a shared machine, so every function reports
both. Each function is reusable (returns a dict) and bounded by its size arguments;
``python -m bench.ceilings [--smoke] [--json]`` runs them all.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import secrets
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self

import msgpack
import trio
import zfec

from bench.common import print_results
from chunkstore.layout import direct_span
from tectonic_py.core import buffers, rpc_client, rpc_server
from tectonic_py.core.rpc_server import Request

log = logging.getLogger(__name__)

MiB = 1024 * 1024
GiB = 1024 * MiB


def _result(name: str, nbytes: int, seconds: float, cpu_s: float, **extra: Any) -> dict[str, Any]:
    """One figure in the shape every bench script uses: MB/s (10^6) and CPU-s per GiB."""
    seconds = max(seconds, 1e-9)
    return {
        "name": name,
        "bytes": nbytes,
        "seconds": round(seconds, 4),
        "mbps": round(nbytes / seconds / 1e6, 1),
        "cpu_s": round(cpu_s, 3),
        "cpu_s_per_gib": round(cpu_s / (nbytes / GiB), 3) if nbytes else None,
        **extra,
    }


class _Clock:
    """Wall time and this process's CPU time (all threads) over a with-block."""

    def __enter__(self) -> Self:
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.cpu = time.process_time() - self.c0


# --- disk -----------------------------------------------------------------------------------


def disk_write(directory: str | os.PathLike[str], size: int = GiB, block: int = MiB) -> dict:
    """Sequential write of ``size`` bytes in ``block`` pieces, fsync before the clock stops.

    The file is left in place for ``disk_read`` (the caller's directory is its to clean).
    """
    path = Path(directory) / "ceiling-disk.bin"
    buf = os.urandom(block)
    written = 0
    with _Clock() as clock:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            while written < size:
                n = min(block, size - written)
                written += os.write(fd, buf[:n] if n < block else buf)
            os.fsync(fd)
        finally:
            os.close(fd)
    return _result("disk_write_fsync", written, clock.seconds, clock.cpu, path=str(path))


def drop_file_cache(path: str | os.PathLike[str]) -> None:
    """Drop one file's clean pages (POSIX_FADV_DONTNEED): a cold read without touching the
    whole machine's cache, which other processes share."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_read(directory: str | os.PathLike[str], size: int = GiB, block: int = MiB) -> dict:
    """Sequential read with a cold cache of the file ``disk_write`` left (written if absent)."""
    path = Path(directory) / "ceiling-disk.bin"
    if not path.exists() or path.stat().st_size < size:
        disk_write(directory, size, block)
    drop_file_cache(path)
    buf = bytearray(block)
    view = memoryview(buf)
    total = 0
    with _Clock() as clock, open(path, "rb", buffering=0) as f:
        while total < size:
            n = f.readinto(view[: min(block, size - total)])
            if not n:
                break
            total += n
    return _result("disk_read_cold", total, clock.seconds, clock.cpu)


DIRECT_BLOCK = 4 * MiB


@contextmanager
def _huge_view(n: int) -> Iterator[memoryview]:
    """A view of ``n`` bytes of a huge-page buffer (``buffers.huge_page_buffer``), as the chunk
    store reads and writes with O_DIRECT; unmapped on leaving."""
    buf = buffers.huge_page_buffer(n)
    whole = memoryview(buf)
    view = whole[:n]
    try:
        yield view
    finally:
        view.release()
        whole.release()
        buf.close()


def _in_threads(target: Callable[[], None], threads: int) -> None:
    """``target()`` on ``threads`` threads at once (at least one), until all return."""
    workers = [threading.Thread(target=target) for _ in range(max(threads, 1))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def _open_direct(path: Path, flags: int) -> tuple[int, bool]:
    """``path`` opened with O_DIRECT, or without where the filesystem refuses it (tmpfs);
    the descriptor and whether it is direct."""
    try:
        return os.open(path, flags | os.O_DIRECT, 0o600), True
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return os.open(path, flags, 0o600), False


def disk_write_direct(
    directory: str | os.PathLike[str], size: int = GiB, block: int = DIRECT_BLOCK
) -> dict:
    """``disk_write`` with O_DIRECT: ``size`` bytes (rounded up to whole 4 KiB blocks) in
    ``block`` pieces from a huge-page buffer, fsync before the clock stops.

    Why beside ``disk_write``: a buffered write first copies every byte into page-cache
    pages, which costs the writer's CPU; here the disk alone sets the pace, as it does for
    a chunk store's puts (O_DIRECT too, ``chunkstore.layout``). On this VM it ran 2.2-2.5
    GB/s where the buffered write ran 1.5-1.8.
    """
    path = Path(directory) / "ceiling-disk.bin"
    size = direct_span(size)
    written = 0
    with _huge_view(block) as view:
        view[:] = os.urandom(block)
        with _Clock() as clock:
            fd, direct = _open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                while written < size:
                    written += os.pwritev(fd, [view[: min(block, size - written)]], written)
                os.fsync(fd)
            finally:
                os.close(fd)
    return _result(
        "disk_write_direct_fsync", written, clock.seconds, clock.cpu, path=str(path), direct=direct
    )


def disk_read_direct(
    directory: str | os.PathLike[str], size: int = GiB, block: int = DIRECT_BLOCK
) -> dict:
    """Sequential O_DIRECT read, ``block`` at a time into a huge-page buffer, of the file
    ``disk_write`` or ``disk_write_direct`` left (written if absent).

    Why beside ``disk_read``: in this VM a buffered cold read is bimodal, 2.1-2.3 GB/s at
    0.08 CPU-s/GiB or 0.65-1.1 GB/s at 0.6-1.5 CPU-s/GiB, one run to the next. In the slow
    runs the reader is busy copying (``_copy_to_iter`` in ``perf``) out of the page cache's
    new pages, most likely for the way the host backs that guest memory (not shown). The
    same reads with O_DIRECT into a buffer used over and over ran 2.3-3.9 GB/s at
    0.01-0.06 CPU-s/GiB throughout: the disk's own speed, which is what a store's gets
    should be held to.
    """
    path = Path(directory) / "ceiling-disk.bin"
    if not path.exists() or path.stat().st_size < size:
        disk_write_direct(directory, size, block)
    drop_file_cache(path)
    total = 0
    with _huge_view(block) as view, _Clock() as clock:
        fd, direct = _open_direct(path, os.O_RDONLY)
        try:
            while total < size:
                n = os.preadv(fd, [view[: min(block, direct_span(size - total))]], total)
                if not n:
                    break
                total += n
        finally:
            os.close(fd)
    total = min(total, size)
    return _result("disk_read_direct", total, clock.seconds, clock.cpu, direct=direct)


def files_read_direct(paths: Sequence[str | os.PathLike[str]], threads: int) -> dict:
    """Whole reads of many small files, ``threads`` at once, each file in one O_DIRECT read
    (buffered where the filesystem refuses O_DIRECT, with its pages dropped first).

    Why next to ``disk_read``: that one is a single long sequential read whose readahead
    sends the disk few large requests; a chunk get is one ~1 MiB read of its own file, so a
    disk (or a virtual disk) that pays per request serves gets at its small-file speed, which
    can be half its sequential speed. Run on a chunk store's own chunk files, this is what
    its disk does for exactly the reads its gets make, with no daemon in the way. The reads
    go into huge-page buffers, as the chunk store's do (``buffers.huge_page_buffer``).
    """
    files = [Path(p) for p in paths]
    sizes = {path: path.stat().st_size for path in files}
    span = direct_span(max(sizes.values(), default=1))
    todo = iter(files)
    lock = threading.Lock()

    def reader() -> None:
        with _huge_view(span) as view:
            while True:
                with lock:
                    path = next(todo, None)
                if path is None:
                    return
                want = direct_span(sizes[path])
                fd, direct = _open_direct(path, os.O_RDONLY)
                try:
                    if not direct:
                        drop_file_cache(path)
                    got = 0
                    while got < sizes[path]:
                        n = os.preadv(fd, [view[got:want]], got)
                        if not n:
                            break
                        got += n
                finally:
                    os.close(fd)

    with _Clock() as clock:
        _in_threads(reader, threads)
    return _result(
        "files_read_direct", sum(sizes.values()), clock.seconds, clock.cpu, files=len(files)
    )


def files_write_direct(
    directory: str | os.PathLike[str], count: int, size: int, threads: int
) -> dict:
    """Put-shaped writes with no daemon in the way (the counterpart of ``files_read_direct``):
    ``count`` files of ``size`` bytes, ``threads`` at once, each a new temporary file written
    whole with O_DIRECT, its fsync, a rename to its final name and an fsync of the
    directory, as a chunk store's put does (``chunkstore/writes.py``). The files are removed
    after.

    Why beside ``disk_write_direct``: one long sequential write is the disk's best case,
    while a put is a chunk-sized write, a rename and two fsyncs, and what the journal commit
    of each rename costs is the disk's, not the store's.
    """
    root = Path(directory) / "ceiling-files"
    root.mkdir()
    span = direct_span(size)
    todo: list[int] = []
    lock = threading.Lock()

    def writer() -> None:
        with _huge_view(span) as view:
            view[:] = os.urandom(span)
            dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
            try:
                while True:
                    with lock:
                        if not todo:
                            return
                        i = todo.pop()
                    tmp = root / f"tmp-{i}"
                    fd, _ = _open_direct(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
                    try:
                        os.pwritev(fd, [view], 0)
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                    os.rename(tmp, root / f"chunk-{i}")
                    os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    try:
        todo[:] = range(count)
        with _Clock() as clock:
            _in_threads(writer, threads)
    finally:
        for path in root.iterdir():
            path.unlink()
        root.rmdir()
    return _result("files_write_direct", span * count, clock.seconds, clock.cpu, files=count)


# --- zfec -----------------------------------------------------------------------------------


def _zfec_run(
    name: str, work: Callable[[], None], data_bytes: int, rounds: int, threads: int
) -> dict:
    """Run ``work`` ``rounds`` times on each of ``threads`` worker threads at once."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(threads):

                async def worker() -> None:
                    for _ in range(rounds):
                        await trio.to_thread.run_sync(work)

                nursery.start_soon(worker)

    with _Clock() as clock:
        trio.run(main)
    total = data_bytes * rounds * threads
    return _result(name, total, clock.seconds, clock.cpu, threads=threads)


def zfec_encode(
    k: int = 6, m: int = 3, block_bytes: int = 64 * MiB, threads: int = 1, rounds: int = 3
) -> dict:
    """RS(k, m) encode of ``block_bytes`` of data into m parity chunks; MB/s of input data."""
    chunk = block_bytes // k
    encoder = zfec.Encoder(k, k + m)
    data = tuple(os.urandom(chunk) for _ in range(k))
    parity_ids = tuple(range(k, k + m))
    return _zfec_run(
        f"zfec_encode_rs{k}_{m}_t{threads}",
        lambda: encoder.encode(data, parity_ids),
        chunk * k,
        rounds,
        threads,
    )


def zfec_decode(
    k: int = 6, m: int = 3, block_bytes: int = 64 * MiB, threads: int = 1, rounds: int = 3
) -> dict:
    """RS(k, m) decode with m data chunks lost (the worst degraded read); MB/s of data."""
    chunk = block_bytes // k
    encoder = zfec.Encoder(k, k + m)
    decoder = zfec.Decoder(k, k + m)
    data = [os.urandom(chunk) for _ in range(k)]
    parity = encoder.encode(tuple(data), tuple(range(k, k + m)))
    lost = min(m, k)
    blocks = tuple(data[lost:] + list(parity[:lost]))
    nums = tuple(list(range(lost, k)) + list(range(k, k + lost)))
    decoded = decoder.decode(blocks, nums)
    if b"".join(bytes(b) for b in decoded) != b"".join(data):
        raise AssertionError("zfec decode returned wrong bytes")
    return _zfec_run(
        f"zfec_decode_rs{k}_{m}_t{threads}",
        lambda: decoder.decode(blocks, nums),
        chunk * k,
        rounds,
        threads,
    )


# --- loopback TCP ---------------------------------------------------------------------------


def tcp_raw(total: int = GiB, message: int = MiB) -> dict:
    """One stream over blocking sockets: the kernel's loopback ceiling.

    The receiver runs in a trio worker thread (the only threads we allow) while this thread
    sends; CPU is both ends together.
    """
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    received = [0]

    def receive() -> None:
        conn, _ = listener.accept()
        buf = memoryview(bytearray(message))
        with conn:
            while True:
                n = conn.recv_into(buf)
                if not n:
                    break
                received[0] += n

    def send() -> None:
        payload = os.urandom(message)
        with socket.create_connection(("127.0.0.1", port)) as s:
            sent = 0
            while sent < total:
                n = min(message, total - sent)
                s.sendall(payload[:n] if n < message else payload)
                sent += n

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, receive)
            await trio.to_thread.run_sync(send)

    try:
        with _Clock() as clock:
            trio.run(main)
    finally:
        listener.close()
    return _result("tcp_raw_blocking", received[0], clock.seconds, clock.cpu)


def tcp_trio(total: int = GiB, message: int = MiB) -> dict:
    """One stream between two trio tasks, receiving with ``recv_into`` into an owned buffer."""
    received = [0]

    async def main() -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        done = trio.Event()

        async def handler(stream: trio.SocketStream) -> None:
            buf = memoryview(bytearray(message))
            sock = stream.socket
            while True:
                n = await sock.recv_into(buf)
                if not n:
                    break
                received[0] += n
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, handler, listeners)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            payload = os.urandom(message)
            sent = 0
            while sent < total:
                n = min(message, total - sent)
                await stream.send_all(payload[:n] if n < message else payload)
                sent += n
            await stream.aclose()
            await done.wait()
            nursery.cancel_scope.cancel()

    with _Clock() as clock:
        trio.run(main)
    return _result("tcp_trio_recv_into", received[0], clock.seconds, clock.cpu)


def tcp_wire(total: int = GiB, message: int = MiB, inflight: int = 8) -> dict[str, dict]:
    """Our wire protocol on one connection, both ways, ``inflight`` requests outstanding.

    ``wire_put``: payloads client -> server (a chunk put); ``wire_get``: payloads server ->
    client received ``into`` a preallocated buffer (a chunk get). Both ends in this process,
    so CPU-s per GiB is the protocol's whole cost on this host.
    """
    secret = secrets.token_hex(32).encode()
    source = os.urandom(message)
    out: dict[str, dict] = {}

    async def sink(req: Request) -> dict:
        return {"n": len(req.require_payload())}

    async def serve_bytes(req: Request) -> tuple[dict, bytes]:
        n = req.int("n", hi=message)
        return {}, source[:n] if n < message else source

    async def run_direction(conn: rpc_client.Connection, put: bool) -> int:
        moved = [0]
        count = max(1, -(-total // message))
        todo = iter(range(count))

        async def one_worker() -> None:
            into = bytearray(message)
            for _ in todo:
                if put:
                    resp = await conn.call("sink", {}, source)
                    moved[0] += resp.fields["n"]
                else:
                    resp = await conn.call("source", {"n": message}, into=into)
                    moved[0] += 0 if resp.payload is None else len(resp.payload)

        async with trio.open_nursery() as nursery:
            for _ in range(inflight):
                nursery.start_soon(one_worker)
        return moved[0]

    async def main() -> None:
        server = rpc_server.RpcServer("ceiling", secret, {"sink": sink, "source": serve_bytes})
        async with trio.open_nursery() as nursery:
            _, port = await nursery.start(server.serve, "127.0.0.1", 0)
            async with rpc_client.open_connection("127.0.0.1", port, secret) as conn:
                for name, put in (("wire_put", True), ("wire_get", False)):
                    with _Clock() as clock:
                        moved = await run_direction(conn, put)
                    out[name] = _result(name, moved, clock.seconds, clock.cpu, inflight=inflight)
            nursery.cancel_scope.cancel()

    trio.run(main)
    return out


# --- msgpack --------------------------------------------------------------------------------


def msgpack_baseline(payload: int = MiB, rounds: int = 200) -> dict:
    """Cost of carrying ``payload`` bytes *inside* a msgpack header (a full copy each way):
    the reason chunk payloads travel raw after the header."""
    message = {"op": "put", "rid": 1, "f": {"chunk_id": "x" * 32, "data": os.urandom(payload)}}
    packed = msgpack.packb(message, use_bin_type=True)
    t0 = time.perf_counter()
    for _ in range(rounds):
        msgpack.packb(message, use_bin_type=True)
    pack_s = (time.perf_counter() - t0) / rounds
    t0 = time.perf_counter()
    for _ in range(rounds):
        msgpack.unpackb(packed, raw=False)
    unpack_s = (time.perf_counter() - t0) / rounds
    return {
        "name": "msgpack_1mib",
        "payload": payload,
        "pack_us": round(pack_s * 1e6, 1),
        "unpack_us": round(unpack_s * 1e6, 1),
        "pack_mbps": round(payload / pack_s / 1e6, 1),
        "unpack_mbps": round(payload / unpack_s / 1e6, 1),
    }


# --- all of them ----------------------------------------------------------------------------


def measure_all(directory: str | os.PathLike[str], *, smoke: bool = False) -> dict[str, dict]:
    """Every ceiling, keyed by name. ``smoke``: tiny sizes, seconds in all (for the tests)."""
    disk = 32 * MiB if smoke else GiB
    block = 6 * MiB if smoke else 64 * MiB
    rounds = 1 if smoke else 3
    tcp = 32 * MiB if smoke else GiB
    out: dict[str, dict] = {}

    def add(result: dict) -> None:
        out[result["name"]] = result
        log.info("%s: %s", result["name"], result)

    add(disk_write(directory, disk))
    add(disk_read(directory, disk))
    add(disk_write_direct(directory, disk))
    add(disk_read_direct(directory, disk))
    (Path(directory) / "ceiling-disk.bin").unlink(missing_ok=True)
    for threads in (1, 2):
        add(zfec_encode(6, 3, block, threads, rounds))
        add(zfec_decode(6, 3, block, threads, rounds))
    add(tcp_raw(tcp))
    add(tcp_trio(tcp))
    for result in tcp_wire(tcp).values():
        add(result)
    add(msgpack_baseline(rounds=20 if smoke else 200))
    return out


def format_table(results: dict[str, dict]) -> str:
    """A Markdown table of the ceilings (MB/s and CPU-s per GiB)."""
    lines = ["| ceiling | MB/s | CPU-s/GiB |", "|---|---:|---:|"]
    for name, r in results.items():
        if "mbps" in r:
            lines.append(f"| {name} | {r['mbps']:,.0f} | {r['cpu_s_per_gib']} |")
        else:
            lines.append(
                f"| {name} pack / unpack | {r['pack_mbps']:,.0f} / {r['unpack_mbps']:,.0f} "
                f"({r['pack_us']} / {r['unpack_us']} µs) | |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="directory on the disk to measure (default: a tmp dir)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: a quick check")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="ceilings-") as tmp:
        results = measure_all(tmp, smoke=args.smoke)
    print_results(results, args.json, format_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
