"""The chunk store daemon: a flat store of chunks on one node's disk, served over the wire.

It knows nothing of files or blocks. Ops (docs/INTERFACES.md): ``put``, ``get`` (whole or a
byte range), ``delete``, ``stat``, ``list`` (paged), ``node_stats``; the on-disk format and
its durability protocol are in ``chunkstore.layout`` and ``chunkstore.writes``.

Admission control, so that a checkpoint burst from thousands of writers queues instead of
crashing the node:

* the wire layer bounds request payload bytes held in memory (``payload_budget``) and the
  number of requests waiting for that budget (``max_payload_waiters``); past that a put gets
  the retryable ``Busy`` and its bytes are drained, not kept;
* at most ``max_concurrent_writes`` puts and deletes touch the disk at once, on the threads
  of a ``DiskWorkers`` pool (``chunkstore.disk_workers``), and at most
  ``max_concurrent_reads`` gets, each in a worker thread (``trio.to_thread.run_sync``); the
  rest wait, and their count is the ``queue_depth`` placement uses to favour idle nodes.
  They wait in one queue per traffic class (a job, ``default`` or ``background``) and are
  admitted by weighted fair queueing (``chunkstore.traffic``): under backlog each job gets
  its weight's share of the store, and repair cannot crowd out a restore nor one job's
  burst another's. Puts are admitted up to twice the disk threads, so a thread that
  finishes takes the next put without waking the event loop (``DiskWorkers``); the order
  past that short FIFO is the fair queue's;
* get replies read from disk and not yet sent are bounded too (``reply_budget``): a restore
  burst, or readers slower than the disk, make further gets wait instead of holding a chunk
  per request in memory;
* a put is refused with ``DiskFull`` before any byte is written when it would take the node
  past ``--capacity``; a real ENOSPC gives the same error and the daemon keeps serving.

A put creates its chunk's file and a delete unlinks it: keeping deleted chunks' files for
later puts to overwrite (spare files) was measured end to end and paid nothing
(docs/decisions/2026-12-03-spares-and-dir-sync.md). Chunks and puts in flight together stay
within ``--capacity``.

Puts of one chunk id are serialised (``_ChunkLocks``), which makes the exists-check and the
rename of ``writes.write_chunk`` one step as far as this process can see; a lock file in the
data directory keeps a second daemon off the same directory.

Membership: with a registry configured, the daemon calls ``node.heartbeat`` every interval
and writes its ready file after the first heartbeat the registry accepted; a registry that is
down is logged once and retried every interval.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from chunkstore import layout, reads, writes
from chunkstore.disk_workers import DiskWorkers
from chunkstore.metrics import StoreMetrics
from chunkstore.scrub import Scrubber
from chunkstore.traffic import FairAdmission, TrafficPolicy
from tectonic_py.core import auth, buffers, capability, framing, rpc_client, rpc_server, sockets
from tectonic_py.core.aio import acquire_soon
from tectonic_py.core.checksum import unpack_table
from tectonic_py.core.errors import (
    ConfigError,
    DiskFull,
    TectonicError,
    WrongShard,
)
from tectonic_py.core.framing import Buffer
from tectonic_py.core.ids import NODE_ID_RE, parse_chunk_id
from tectonic_py.core.metrics import Metrics
from tectonic_py.core.metrics_http import parse_listen, start_endpoint
from tectonic_py.core.ready_file import write_ready_file
from tectonic_py.core.rpc_server import Request

log = logging.getLogger(__name__)

MiB = 1024 * 1024
MAX_CHUNK = 64 * MiB

# Who may call what (core/auth.py roles). A client writes and reads chunks, with capabilities
# for its puts; deleting, listing and inspecting a store are the maintenance daemon's and the
# operator's: a GPU node's key cannot delete a chunk even with a delete capability in hand.
_DATA = frozenset({auth.ROLE_CLIENT, auth.ROLE_MAINTENANCE, auth.ROLE_ADMIN})
_UPKEEP = frozenset({auth.ROLE_MAINTENANCE, auth.ROLE_ADMIN})
OP_ROLES: dict[str, frozenset[str]] = {
    "put": _DATA,
    "get": _DATA,
    "delete": _UPKEEP,
    "stat": _UPKEEP,
    "list": _UPKEEP,
    "node_stats": _UPKEEP,
    "scrub_report": _UPKEEP,
}
LIST_LIMIT = 10_000


@dataclass
class StoreConfig:
    """Everything one chunk store daemon needs (the CLI flags of ``tectonic chunkstore``)."""

    data_dir: Path
    node_id: str
    failure_domain: str
    secret: bytes
    capability_key: bytes  # checks puts' and deletes' capabilities (core/capability.py)
    host: str = "127.0.0.1"
    port: int = 0
    capacity: int | None = None
    registry: str | None = None
    heartbeat_interval: float = 1.0
    ready_file: Path | None = None
    max_concurrent_writes: int = 8
    max_concurrent_reads: int = 16
    payload_budget: int = 256 * MiB
    max_payload_waiters: int = 1024
    reply_budget: int = 256 * MiB
    scrub_rate: float = 0.0  # bytes/s re-verified by scrub (chunkstore/scrub.py); 0: off
    scrub_interval: float = 3600.0  # seconds between the starts of two scrub passes
    metrics_listen: str | None = None  # HOST:PORT of the metrics endpoint; None: no metrics
    jobs: dict[str, int] = field(default_factory=dict)  # traffic class weights (--job)
    max_write_rate: float | None = None  # bytes/s of puts admitted (None: no pacing)
    max_read_rate: float | None = None  # bytes/s of gets admitted
    limits: framing.Limits = field(init=False)

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        if not NODE_ID_RE.match(self.node_id):
            raise ConfigError(f"bad node id {self.node_id!r}: letters, digits, '_.-', <= 64")
        if not self.failure_domain or len(self.failure_domain) > 255:
            raise ConfigError("failure domain must be 1..255 characters")
        if len(self.capability_key) < 16:
            raise ConfigError("the capability key must be at least 16 bytes")
        if self.capacity is not None and self.capacity <= 0:
            raise ConfigError("capacity must be positive")
        if not self.heartbeat_interval > 0:
            raise ConfigError("heartbeat interval must be positive")
        if self.max_concurrent_writes < 1 or self.max_concurrent_reads < 1:
            raise ConfigError("concurrency limits must be at least 1")
        if self.payload_budget < MiB:
            raise ConfigError("payload budget must be at least 1 MiB")
        if self.reply_budget < MiB:
            raise ConfigError("reply budget must be at least 1 MiB")
        if self.max_payload_waiters < 0:
            raise ConfigError("max payload waiters must be >= 0")
        for registry in registries(self.registry):
            sockets.parse_address(registry)
        if self.metrics_listen is not None:
            parse_listen(self.metrics_listen)
        for rate in (self.max_write_rate, self.max_read_rate):
            if rate is not None and not rate > 0:
                raise ConfigError("a rate must be positive")
        self.limits = framing.Limits(
            max_payload=MAX_CHUNK,
            payload_budget=self.payload_budget,
            max_payload_waiters=self.max_payload_waiters,
        )


class _ChunkLocks:
    """One lock per chunk id being written or deleted, dropped when nobody holds it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[trio.Lock, int]] = {}

    @asynccontextmanager
    async def hold(self, chunk_id: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(chunk_id, (None, 0))
        if lock is None:
            lock = trio.Lock()
        self._locks[chunk_id] = (lock, users + 1)
        try:
            await acquire_soon(lock)
            try:
                yield
            finally:
                lock.release()
        finally:
            lock, users = self._locks[chunk_id]
            if users == 1:
                del self._locks[chunk_id]
            else:
                self._locks[chunk_id] = (lock, users - 1)


class _ReplyBudget:
    """Bytes of get replies held in memory: read from disk, verified, not yet sent.

    Without it a restore burst (thousands of readers, or readers slower than the disk) could
    hold a chunk per request in memory. Acquired from the worker thread that reads (through
    ``trio.from_thread``), together with a buffer from ``spares``; both are given back by the
    wire layer once the reply is sent or dropped (the handler's third reply item), and the
    buffer is reused for a later get (a fresh one costs a memset and page faults per get).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held = 0
        self.peak = 0
        self.waiting = 0
        self._lot = trio.lowlevel.ParkingLot()
        self.spares = buffers.SpareBuffers(min(capacity // 4, 80 * MiB), huge=True)

    async def acquire(self, n: int) -> None:
        # A request larger than the whole budget still runs, alone.
        self.waiting += 1
        try:
            while self.held and self.held + n > self.capacity:
                await self._lot.park()
        finally:
            self.waiting -= 1
        self.held += n
        self.peak = max(self.peak, self.held)

    async def take(self, n: int, taken: list[tuple[Buffer, int]]) -> Buffer:
        """Event loop: wait for budget, then a buffer of at least ``n`` bytes. It goes into
        ``taken``; ``give_back(taken)`` returns budget and buffers. The budget is charged
        the buffer's whole size, which for O_DIRECT reads into huge pages can be twice
        ``n``: the bound is on memory, not on bytes asked for."""
        size = self.spares.size_class(n)
        await self.acquire(size)
        buf = self.spares.take(n)
        taken.append((buf, size))
        return buf

    def alloc(self, n: int, taken: list[tuple[Buffer, int]]) -> Buffer:
        """``take`` from a worker thread."""
        return trio.from_thread.run(self.take, n, taken)

    def give_back(self, taken: list[tuple[Buffer, int]]) -> None:
        """Return the budget of ``taken`` at once; keep the buffers no view refers to."""
        while taken:
            buf, n = taken.pop()
            self.held -= n
            self.spares.give_back(buf)
        self._lot.unpark_all()


class ChunkStoreServer:
    """One node's chunk store: the data directory, its accounting and the RPC handlers."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.data_dir = config.data_dir
        self._writers = DiskWorkers(
            f"chunkstore[{config.node_id}] writer", config.max_concurrent_writes
        )
        self.metrics = Metrics(enabled=config.metrics_listen is not None)
        self._metrics = StoreMetrics(self.metrics)
        self.metrics_address: str | None = None
        self.rpc = rpc_server.RpcServer(
            f"chunkstore[{config.node_id}]",
            config.secret,
            {
                "put": self._put,
                "get": self._get,
                "delete": self._delete,
                "stat": self._stat,
                "list": self._list,
                "node_stats": self._node_stats,
                "scrub_report": self._scrub_report,
            },
            config.limits,
            payload_room={"put": layout.put_room},
            roles=OP_ROLES,
            metrics=self._metrics.rpc,
        )
        self.traffic = TrafficPolicy(dict(config.jobs))
        self.write_queue = FairAdmission(
            2 * config.max_concurrent_writes, rate=config.max_write_rate
        )
        self.read_queue = FairAdmission(config.max_concurrent_reads, rate=config.max_read_rate)
        self._locks = _ChunkLocks()
        self.chunk_count = 0
        self.used = 0
        self._reserved = 0
        self._outstanding = 0
        self.address: str | None = None
        self.heartbeats_accepted = 0
        self._lock_fd: int | None = None
        self._replies: _ReplyBudget | None = None
        self.scrubber = Scrubber(self.data_dir, config.scrub_rate, config.scrub_interval)
        self._whole_span = 0  # buffer size of the last whole get (``_get``)
        self.put_bytes = 0  # chunk bytes stored and returned, for the metrics
        self.get_bytes = 0
        self.disk_capacity = self.disk_free = 0  # as of the last node_stats
        self._metrics.watch(self, self.node_stats)

    # --- lifecycle ---------------------------------------------------------------------------

    async def serve(
        self, *, task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Open the data directory, recover, listen; ``started((host, port))`` after bind."""
        self._replies = _ReplyBudget(self.config.reply_budget)
        await trio.to_thread.run_sync(self._open_data_dir)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self._writers.serve)
                nursery.start_soon(self.write_queue.pace)
                nursery.start_soon(self.read_queue.pace)
                listen = self.config.metrics_listen
                self.metrics_address = await start_endpoint(nursery, self.metrics, listen)
                host, port = await nursery.start(self.rpc.serve, self.config.host, self.config.port)
                first = next(iter(registries(self.config.registry)), None)
                self.address = _advertised_address(host, port, first)
                log.info(
                    "chunk store %s serving %s on %s",
                    self.config.node_id,
                    self.data_dir,
                    self.address,
                )
                nursery.start_soon(self.scrubber.run)
                if self.config.registry is not None:
                    nursery.start_soon(self._heartbeat_loop)
                elif self.config.ready_file is not None:
                    await trio.to_thread.run_sync(self._write_ready_file)
                task_status.started((host, port))
        finally:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def _open_data_dir(self) -> None:
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.data_dir / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise ConfigError(f"cannot open data directory {self.data_dir}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(f"data directory {self.data_dir} is in use by another chunk store")
        self._lock_fd = fd
        scan = writes.recover(self.data_dir)
        self.chunk_count, self.used = scan.chunk_count, scan.used_bytes
        log.info(
            "%s: %d chunks, %d bytes; %d partial files removed",
            self.data_dir,
            scan.chunk_count,
            scan.used_bytes,
            scan.temp_files_removed,
        )

    def _write_ready_file(self) -> None:
        assert self.config.ready_file is not None and self.address is not None
        write_ready_file(self.config.ready_file, address=self.address, metrics=self.metrics_address)

    # --- accounting --------------------------------------------------------------------------

    def _disk(self) -> tuple[int, int]:
        """(capacity, free) as the registry should see them: the configured capacity bounds
        both, and the filesystem's own free space bounds free."""
        st = os.statvfs(self.data_dir)
        fs_total, fs_free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        fs_free -= self._reserved
        if self.config.capacity is None:
            return fs_total, max(fs_free, 0)
        free = self.config.capacity - self.used - self._reserved
        return self.config.capacity, max(min(free, fs_free), 0)

    async def _reserve(self, chunk_id: str, need: int) -> None:
        """Hold ``need`` bytes of the configured capacity for a put, or DiskFull before any
        byte is written. Chunks and puts in flight together stay within capacity."""
        cap = self.config.capacity
        if cap is not None and self.used + self._reserved + need > cap:
            raise DiskFull(
                f"{self.config.node_id}: no room for chunk {chunk_id} ({need} bytes;"
                f" {cap - self.used - self._reserved} of {cap} free)"
            )
        self._reserved += need

    @property
    def queue_depth(self) -> int:
        """Requests admitted and not yet done with the disk, plus puts waiting for memory."""
        return self._outstanding + self.rpc.stats.payload_waiters

    def traffic_stats(self) -> dict[str, Any]:
        """Per traffic class: weights, and per kind (put, get) what waits and what was
        admitted (the metrics)."""
        return {
            "weights": self.traffic.classes(),
            "put": self.write_queue.stats,
            "get": self.read_queue.stats,
        }

    def _class(self, req: Request) -> tuple[str, int]:
        return self.traffic.classify(req.role, req.job, req.weight)

    @property
    def reply_bytes_held(self) -> int:
        return 0 if self._replies is None else self._replies.held

    # --- handlers ----------------------------------------------------------------------------

    @staticmethod
    def _chunk_id(req: Request) -> str:
        return layout.validate_chunk_id(req.str("chunk_id", max_len=layout.MAX_CHUNK_ID_LEN))

    async def _put(self, req: Request) -> dict[str, Any]:
        chunk_id = self._chunk_id(req)
        checksum = req.int("checksum", hi=2**32 - 1)
        table = req.bytes("segments", None, max_len=4 * layout.segment_count(MAX_CHUNK))
        cap = req.bytes("cap", max_len=capability.MAX_TOKEN)
        block_id, index = parse_chunk_id(chunk_id)
        capability.verify(
            self.config.capability_key, cap, block_id, self.config.node_id, index=index
        )
        # A zero-length chunk is legal (a short block's padding); the wire sends no payload.
        data = req.payload if req.payload is not None else memoryview(b"")
        need = layout.file_size_for(len(data))
        await self._reserve(chunk_id, need)
        self._outstanding += 1
        try:
            async with (
                self.write_queue.slot(*self._class(req), len(data)),
                self._locks.hold(chunk_id),
            ):
                stored = await self._writers.run(
                    writes.write_chunk,
                    self.data_dir,
                    chunk_id,
                    data,
                    checksum,
                    req.buffer,
                    None if table is None else unpack_table(table),
                )
        finally:
            self._outstanding -= 1
            self._reserved -= need
        self.used += stored.added_bytes
        self.chunk_count += stored.added_chunks
        if stored.written:
            self.put_bytes += len(data)
            self._metrics.fsync.observe(stored.fsync_s)
        return {}

    async def _get(self, req: Request) -> tuple[dict[str, Any], memoryview, Callable[[], None]]:
        chunk_id = self._chunk_id(req)
        offset = req.int("offset", 0, hi=MAX_CHUNK)
        length = req.int("length", None, hi=MAX_CHUNK)
        # What the get will read, for its class's share: the chunk size a whole get read
        # last (unknown until the file is opened).
        cost = length if length is not None else (self._whole_span or layout.SEGMENT_SIZE)
        self._outstanding += 1
        try:
            async with self.read_queue.slot(*self._class(req), cost):
                assert self._replies is not None
                replies = self._replies
                taken: list[tuple[Buffer, int]] = []
                if offset:
                    guess = 0
                elif length is None:
                    guess = self._whole_span
                else:  # what a read of ``length`` bytes from the start takes, at most: of a
                    # whole chunk of that length, or of the segments of a longer one's prefix
                    guess = max(
                        layout.direct_span(layout.file_size_for(length)),
                        layout.segment_count(length) * layout.SEGMENT_SIZE,
                    )
                ready: list[Buffer] = []
                try:
                    if guess:
                        # The buffer the read will ask for, most likely, taken here: the
                        # worker thread then does not come back to the event loop for it.
                        ready.append(await replies.take(guess, taken))

                    def alloc(n: int) -> Buffer:
                        if ready and n <= guess:
                            return ready.pop()
                        return replies.alloc(n, taken)

                    header, data, crc = await trio.to_thread.run_sync(
                        reads.read_chunk, self.data_dir, chunk_id, offset, length, alloc
                    )
                except BaseException:
                    replies.give_back(taken)
                    raise
                if length is None and not offset:
                    self._whole_span = layout.direct_span(header.file_size)
        finally:
            self._outstanding -= 1
        fields = {"size": header.length, "checksum": header.checksum, "range_checksum": crc}
        self.get_bytes += len(data)
        return fields, data, lambda: replies.give_back(taken)

    async def _delete(self, req: Request) -> dict[str, Any]:
        """Remove a chunk, with a delete capability for it: the metadata service grants one
        only for a chunk the Block layer no longer needs on this node, so holding the
        cluster secret is not enough to destroy data."""
        chunk_id = self._chunk_id(req)
        cap = req.bytes("cap", b"", max_len=capability.MAX_TOKEN)
        block_id, index = parse_chunk_id(chunk_id)
        capability.verify(
            self.config.capability_key, cap, block_id, self.config.node_id, op="delete", index=index
        )
        self._outstanding += 1
        try:
            async with (
                self.write_queue.slot(*self._class(req), layout.SEGMENT_SIZE),
                self._locks.hold(chunk_id),
            ):
                size = await self._writers.run(writes.delete_chunk, self.data_dir, chunk_id)
                if size is not None:
                    self.used -= size
                    self.chunk_count -= 1
        finally:
            self._outstanding -= 1
        self.scrubber.forget(chunk_id)
        return {"existed": size is not None}

    async def _scrub_report(self, req: Request) -> dict[str, Any]:
        return self.scrubber.report()

    async def _stat(self, req: Request) -> dict[str, Any]:
        chunk_id = self._chunk_id(req)

        def stat() -> dict[str, Any]:
            header, st = reads.stat_chunk(layout.chunk_path(self.data_dir, chunk_id))
            return {"size": header.length, "checksum": header.checksum, "mtime": st.st_mtime}

        async with self.read_queue.slot(*self._class(req), layout.SEGMENT_SIZE):
            return await trio.to_thread.run_sync(stat)

    async def _list(self, req: Request) -> dict[str, Any]:
        after = req.str("after", "", max_len=layout.MAX_CHUNK_ID_LEN)
        limit = req.int("limit", 1000, lo=1, hi=LIST_LIMIT)
        async with self.read_queue.slot(*self._class(req), layout.SEGMENT_SIZE):
            chunks, nxt = await trio.to_thread.run_sync(
                reads.list_chunk_entries, self.data_dir, after, limit
            )
        if req.bool("checksums", False):
            return {"chunks": [[c, n, crc] for c, n, crc in chunks], "next": nxt}
        return {"chunks": [[c, n] for c, n, _ in chunks], "next": nxt}

    async def _node_stats(self, req: Request) -> dict[str, Any]:
        return await self.node_stats()

    def _filesystem(self) -> dict[str, Any]:
        """The filesystem under the data directory, so that the registry's df counts stores
        that share one (several stores on one disk, as a test cluster has) once: its id
        (host and f_fsid) and its own size and free space."""
        st = os.statvfs(self.data_dir)
        return {
            "fs_id": f"{socket.gethostname()}:{st.f_fsid:x}",
            "fs_total": st.f_blocks * st.f_frsize,
            "fs_free": st.f_bavail * st.f_frsize,
        }

    def scrub_progress(self) -> dict[str, float]:
        s = self.scrubber.stats
        return {
            "passes": s.passes,
            "chunks_checked": s.chunks_checked,
            "bytes_checked": s.bytes_checked,
            "bad_found": s.bad_found,
            "last_pass_s": s.last_pass_s,
        }

    async def node_stats(self) -> dict[str, Any]:
        capacity, free = await trio.to_thread.run_sync(self._disk)
        self.disk_capacity, self.disk_free = capacity, free
        fs = await trio.to_thread.run_sync(self._filesystem)
        return {
            "node_id": self.config.node_id,
            "failure_domain": self.config.failure_domain,
            "capacity": capacity,
            "free": free,
            **fs,
            "used": self.used,
            "chunk_count": self.chunk_count,
            "queue_depth": self.queue_depth,
            "bytes_in": self.rpc.stats.bytes_in,
            "bytes_out": self.rpc.stats.bytes_out,
        }

    # --- membership --------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        """Heartbeat the registry forever; ready file after the first accepted heartbeat.

        Several candidates (etcd engine: the registry moves with its shard) are heartbeated
        side by side, so one that is cut off or dead delays nothing; those that are not the
        registry now refuse with ``WrongShard``, which costs them nothing and is not logged."""
        assert self.config.registry is not None
        candidates = registries(self.config.registry)
        async with trio.open_nursery() as nursery:
            for registry in candidates:
                nursery.start_soon(self._heartbeat_to, registry, len(candidates) > 1)

    async def _heartbeat_to(self, registry: str, one_of_many: bool) -> None:
        host, port = sockets.parse_address(registry)
        down_logged = False
        async with trio.open_nursery() as nursery:
            conn: rpc_client.Connection | None = None
            while True:
                try:
                    if conn is None or conn.broken is not None:
                        if conn is not None:
                            await conn.aclose()
                        conn = None
                        conn = await rpc_client.Connection.connect(
                            host,
                            port,
                            auth.Credential.from_secret(self.config.secret, auth.ROLE_NODE),
                            nursery=nursery,
                            limits=self.config.limits,
                        )
                    stats = await self.node_stats()
                    with trio.fail_after(max(self.config.heartbeat_interval * 5, 5.0)):
                        await conn.call(
                            "node.heartbeat",
                            {
                                "node_id": self.config.node_id,
                                "address": self.address,
                                "failure_domain": self.config.failure_domain,
                                "capacity": stats["capacity"],
                                "free": stats["free"],
                                "chunk_count": stats["chunk_count"],
                                "queue_depth": stats["queue_depth"],
                                "fs_id": stats["fs_id"],
                                "fs_total": stats["fs_total"],
                                "fs_free": stats["fs_free"],
                            },
                        )
                except (TectonicError, trio.TooSlowError) as e:
                    if one_of_many and isinstance(e, WrongShard):
                        pass  # not the registry now
                    elif not down_logged:
                        log.warning(
                            "%s: heartbeat to registry %s failed (%s); retrying every %ss",
                            self.config.node_id,
                            registry,
                            e,
                            self.config.heartbeat_interval,
                        )
                        down_logged = True
                    if isinstance(e, trio.TooSlowError) and conn is not None:
                        await conn.aclose()
                        conn = None
                else:
                    if down_logged:
                        log.info(
                            "%s: registry %s reachable again",
                            self.config.node_id,
                            registry,
                        )
                        down_logged = False
                    self.heartbeats_accepted += 1
                    if self.heartbeats_accepted == 1 and self.config.ready_file is not None:
                        await trio.to_thread.run_sync(self._write_ready_file)
                await trio.sleep(self.config.heartbeat_interval)


def registries(setting: str | None) -> list[str]:
    """``--registry``: one metadata server, or (etcd engine) every metadata server,
    comma-separated; heartbeats go to the one that answers as the registry."""
    return [r.strip() for r in (setting or "").split(",") if r.strip()]


def _advertised_address(host: str, port: int, registry: str | None) -> str:
    """The address clients should use. A wildcard listen (0.0.0.0, ::) is no address to
    dial, so the node advertises the local IP it uses to reach the registry (a UDP
    ``connect`` picks it from the routing table without sending anything)."""
    if host not in ("0.0.0.0", "::"):
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if registry is None:
        return f"127.0.0.1:{port}" if host == "0.0.0.0" else f"[::1]:{port}"
    rhost, rport = sockets.parse_address(registry)
    family = socket.AF_INET6 if ":" in rhost else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((rhost, rport))
            local = probe.getsockname()[0]
    except OSError as e:
        raise ConfigError(f"cannot find a route to the registry {registry}: {e}") from None
    return f"[{local}]:{port}" if ":" in local else f"{local}:{port}"


async def serve(
    config: StoreConfig,
    *,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a chunk store until cancelled: ``addr = await nursery.start(serve, config)``."""
    await ChunkStoreServer(config).serve(task_status=task_status)
