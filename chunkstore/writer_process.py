"""The writer process: the chunk store's puts and deletes (and gets), run off the daemon's GIL.

Why a process: the event loop thread is the stage every put passes through (it receives
each payload and answers each request), and with disk threads in the same process it shares
the GIL with them. Each put's Python around its system calls (the checksum, the header, the
rename, the directory fsync's bookkeeping) takes the GIL back several times; ``perf sched``
showed the event loop thread waiting for the GIL about as long as it ran, with a fifth of
both cores idle. Why *one* process with threads, not a process per write: eight writer
processes did the same work with twice the CPU (0.65 against 0.37 CPU-seconds per GiB, most
of it the interpreter running cold in eight separate address spaces), which on a two-core
machine ate the gain; one process with eight threads used 0.43. Prototypes of the three on
the project machine (1 GiB of 1 MiB puts, 16 in flight, interleaved rounds): threads in the
daemon 1,162 MB/s, eight processes 1,244, one process with eight threads 1,398. This module,
in ``bench_chunkstore``: 1 MiB puts at 0.58-0.79 of raw disk write (median 0.65 over 12 runs)
against 0.51-0.63 (median 0.59) with ``--disk-workers threads``; 4 MiB puts 0.84-1.04
against 0.80-0.90.

The payload is not copied. The RPC server receives every large payload into a
``SharedBuffers`` buffer (a file of a private tmpfs, or a memfd, each mapped shared;
``SpareBuffers(make=...)``); a job names the buffer and carries its descriptor
(SCM_RIGHTS), and the writer maps it the first time it sees it, so the O_DIRECT write reads
the very pages the socket wrote. The writer keeps its mappings of live buffers and drops
those the daemon has freed (the daemon says which, with its next job or, when idle, every
``FORGET_INTERVAL`` seconds).

Jobs travel over one SOCK_SEQPACKET socketpair: a message is a job, the answer one message
back (``pickle``: both ends are this program). All of the writer's threads read jobs from
the same socket, so a free thread takes the next job without any dispatcher. The daemon admits
at most ``threads`` jobs at once; the rest wait in order (the admission limit ``DiskWorkers``
was).

Gets can run here too (``read``, with ``read_threads``), on threads of their own that take
jobs from a second socketpair, so that reads and writes keep separate limits. A get whose
reply buffer is shared is read and verified into it by one of these threads, and the daemon
only sends it: handing each read to a thread of the daemon (``trio.to_thread``) costs the
disk its idle time between a read's completion and the next submission, about a third of
this VM's disk at 16 in flight, and the read thread's checksum shares the daemon's GIL with
the event loop. On the project machine 1 MiB gets went from a median of 1,193 to 1,360 MB/s
(16 in flight, 6 interleaved runs of 1 GiB); 4 MiB gets stayed at 1,670-1,680 MB/s. Answers
to both kinds come back over the first socketpair, whose end is what tells the daemon the
writer died.

Cancellation is that of ``DiskWorkers``: a job still waiting is dropped, one sent to the
writer is waited for, since a half-done disk operation cannot be abandoned safely.

A writer that dies (kill -9, a crash) fails the jobs it had with ``WriterLost`` (retryable:
each may or may not have happened, and puts and deletes are idempotent) and is restarted. A
writer whose daemon dies kills itself at once (it watches a pidfd of the daemon): it runs no
job that nobody waits for, and the chunk store's rename protocol makes that safe at any
instant.
"""

from __future__ import annotations

import array
import ctypes
import errno
import importlib
import logging
import mmap
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import outcome
import trio

from chunkstore import huge_tmpfs, layout, reads
from tectonic_py.core.aio import acquire_soon
from tectonic_py.core.buffers import HUGE_PAGE
from tectonic_py.core.errors import Busy, TectonicError, Unavailable, WriterLost
from tectonic_py.core.process_env import child_env

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_MESSAGE = 128 * 1024  # a job or an answer (jobs carry large payloads by reference)
MAX_INLINE = 64 * 1024  # larger non-shared buffers are copied into a shared one, not pickled
MAX_FDS = 8
FORGET_INTERVAL = 2.0  # seconds between "drop these buffers" messages to an idle writer
START_TIMEOUT = 30.0  # a job waits this long for a writer being (re)started, then Unavailable
STOP_TIMEOUT = 30.0  # at shutdown, the writer's jobs get this long, then it is killed
RESTART_DELAY = (0.1, 5.0)  # first and longest pause before restarting a writer that died
READY = b"ready"  # the writer's first message


class BufferTooSmall(Exception):
    """A read needs a buffer of ``need`` bytes, more than the one it was given."""

    def __init__(self, need: int) -> None:
        super().__init__(need)
        self.need = need


class NotShared(ValueError):
    """A read's buffer is not one the writer process maps: it would read into a copy."""


def read_chunk_into(
    data_dir: Path, chunk_id: str, offset: int, length: int | None, buf: memoryview
) -> tuple[layout.ChunkHeader, int, int, int]:
    """``reads.read_chunk`` into ``buf`` (a read thread's job): (header, where the bytes
    start in ``buf``, how many, their crc32c). BufferTooSmall if ``buf`` cannot hold the
    read; nothing is read then."""

    def alloc(n: int) -> memoryview:
        if n > buf.nbytes:
            raise BufferTooSmall(n)
        return buf

    header, data, crc = reads.read_chunk(data_dir, chunk_id, offset, length, alloc)
    with data:
        start = _address(data) - _address(buf) if data.nbytes else 0
        return header, start, data.nbytes, crc


class _Shared(NamedTuple):
    """A view of a shared buffer, as a job names it (its descriptor travels with the job)."""

    bid: int
    size: int  # the whole buffer's
    offset: int
    length: int
    fd_index: int  # of the buffer's descriptor among those of the job


def _address(buf: Any) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def hugetlb_available() -> bool:
    """True if a memfd of reserved huge pages (``vm.nr_hugepages``) can be made and mapped
    now. Mapping one reserves its pages, so this fails where none are free."""
    flag = getattr(os, "MFD_HUGETLB", 0)
    if not flag:
        return False
    try:
        fd, buf = _memfd_buffer(HUGE_PAGE, flag)
    except OSError:
        return False
    buf.close()
    os.close(fd)
    return True


def _memfd_buffer(size: int, flags: int = 0) -> tuple[int, mmap.mmap]:
    """A new memfd of ``size`` bytes and its shared mapping; nothing left open on failure."""
    fd = os.memfd_create("tectonic-payload", os.MFD_CLOEXEC | flags)
    try:
        os.ftruncate(fd, size)
        return fd, mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise


def _now_and_then(level: int, count: int, message: str, error: OSError) -> None:
    """Log ``message % (error, count)`` for the first of a kind of fallback and every
    thousandth after: a host short of something says so without a line per request."""
    if count == 1 or count % 1000 == 0:
        log.log(level, message, error, count)


class SharedBuffers:
    """Makes the RPC server's large payload buffers (``SpareBuffers(make=...)``): a
    shared mapping of a file each (the descriptor travels with a job), so that the writer
    process can map the same pages. A buffer's file stays open while the buffer lives; when
    it is freed ``on_release`` hears of it, so that the writer drops its mapping.
    Event-loop thread only.

    Huge pages, so that the writer's O_DIRECT write of a 1 MiB chunk is one disk request
    instead of two or three (the block layer cuts a transfer from 4 KiB pages every 254
    pages), in this order of preference:

    * files of a private tmpfs mounted ``huge=within_size`` (``chunkstore.huge_tmpfs``):
      transparent huge pages with no host setting. Shared memory of the kernel's own mount
      (a memfd) gets none by default (``shmem_enabled=never``);
    * where that cannot be made and the host has reserved huge pages (``vm.nr_hugepages``),
      a buffer of whole huge pages is a hugetlb memfd; once the reservation is used up,
      buffers are ordinary memfds (as PostgreSQL's ``huge_pages = try``);
    * ordinary memfds.

    On the project machine either kind of huge page made 1 MiB puts 17-28% and 4 MiB puts
    33-77% faster than small pages.
    """

    def __init__(self, hugetlb: bool = True, tmpfs: bool = True) -> None:
        self._by_obj: dict[int, tuple[int, int, int]] = {}  # id(mmap) -> (bid, fd, size)
        self._next = 0
        self.on_release: Callable[[int], None] = lambda bid: None
        self.private = 0  # buffers made private for want of file descriptors
        self._tmpfs = huge_tmpfs.private_tmpfs() if tmpfs else None
        # whole-huge-page buffers try hugetlb (where no tmpfs of huge pages could be made)
        self._hugetlb = self._tmpfs is None and hugetlb and hugetlb_available()
        self.huge = self._tmpfs is not None or self._hugetlb  # sizes in whole huge pages
        self.hugetlb = 0  # buffers made of reserved huge pages
        self.hugetlb_short = 0  # whole-huge-page buffers made small: the reservation was used up
        self.tmpfs_short = 0  # buffers made memfds because the tmpfs refused a file

    @property
    def pages(self) -> str:
        """Where large payload buffers come from: ``thp-tmpfs``, ``hugetlb`` or ``small``."""
        return "thp-tmpfs" if self._tmpfs is not None else "hugetlb" if self._hugetlb else "small"

    def __len__(self) -> int:
        return len(self._by_obj)

    def new(self, size: int) -> mmap.mmap:
        """A shared buffer or, when the process is out of file descriptors (each shared
        buffer holds two: its file's and the mmap's own), a private one, which a job then
        copies into a shared buffer (``_marshal``) or refuses as ``Busy``. Receiving the
        payload never fails for want of a descriptor."""
        try:
            return self.new_shared(size)
        except OSError as e:
            if e.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            self.private += 1
            _now_and_then(
                logging.WARNING,
                self.private,
                "out of file descriptors for shared payload buffers (%s); %d payloads"
                " received into private ones",
                e,
            )
            return mmap.mmap(-1, size)

    def new_shared(self, size: int) -> mmap.mmap:
        """A buffer the writer process can map; OSError (EMFILE) when out of descriptors."""
        made = None
        try:
            if self._tmpfs is not None:
                made = huge_tmpfs.tmpfile_buffer(self._tmpfs, size)
            elif self._hugetlb and size % HUGE_PAGE == 0:
                made = _memfd_buffer(size, os.MFD_HUGETLB)
                self.hugetlb += 1
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                raise
            # The tmpfs is full (it may take half the memory) or refuses for a reason of its
            # own; the reservation is used up (ENOMEM), or the host will not give huge pages
            # after all: this buffer is an ordinary memfd, and the put goes on.
            if self._tmpfs is not None:
                self.tmpfs_short += 1
                _now_and_then(
                    logging.WARNING,
                    self.tmpfs_short,
                    "no file in the payload tmpfs (%s); %d payload buffers made memfds",
                    e,
                )
            else:
                self.hugetlb_short += 1
                _now_and_then(
                    logging.INFO,
                    self.hugetlb_short,
                    "no reserved huge page left (%s); %d payload buffers in small pages",
                    e,
                )
        fd, buf = made or _memfd_buffer(size)
        self._next += 1
        key = id(buf)
        self._by_obj[key] = (self._next, fd, size)
        weakref.finalize(buf, self._release, key)
        return buf

    def _release(self, key: int) -> None:
        bid, fd, _size = self._by_obj.pop(key)
        os.close(fd)
        self.on_release(bid)

    def locate(self, view: memoryview, fds: list[int]) -> _Shared | None:
        """Where ``view`` lies in a shared buffer, None if it is not in one. The buffer's
        descriptor is added to ``fds`` (once) and the answer names its index there."""
        base = view.obj
        if not isinstance(base, mmap.mmap) or not view.nbytes:
            return None
        entry = self._by_obj.get(id(base))
        if entry is None:
            return None
        bid, fd, size = entry
        if fd not in fds:
            fds.append(fd)
        return _Shared(bid, size, _address(view) - _address(base), view.nbytes, fds.index(fd))


class _Job:
    """A job sent to the writer, until its answer (or the writer's death) comes back."""

    __slots__ = ("result", "task")

    def __init__(self) -> None:
        self.result: outcome.Outcome[Any] | None = None
        self.task: trio.lowlevel.Task | None = None  # once it waits for the answer

    def finish(self, result: outcome.Outcome[Any]) -> None:
        self.result = result
        if self.task is not None:
            trio.lowlevel.reschedule(self.task)


class _Writer:
    """The daemon's end of one writer process."""

    def __init__(
        self, proc: trio.Process, sock: socket.socket, reads: socket.socket | None
    ) -> None:
        self.proc = proc
        self.raw = sock  # non-blocking: a send that fits goes without a scheduler pass
        self.sock = trio.socket.from_stdlib_socket(sock)
        self.read_raw = reads  # read jobs go here (their answers come back on ``sock``)
        self.read_sock = None if reads is None else trio.socket.from_stdlib_socket(reads)
        self.pending: dict[int, _Job] = {}  # jobs sent and not answered, by job id
        self.reads = 0  # of those, read jobs

    def close(self) -> None:
        self.sock.close()
        if self.read_sock is not None:
            self.read_sock.close()


class WriterProcess:
    """One writer process with ``threads`` threads running layout functions for trio tasks,
    at most ``threads`` at once, the rest waiting in arrival order. The same ``run`` and
    ``serve`` as ``DiskWorkers``; ``fn`` must be a module-level function (the writer imports
    it) and its arguments picklable, with memoryviews of ``buffers`` passed by reference.
    With ``read_threads``, ``read`` runs up to that many reads at once beside them."""

    def __init__(
        self, name: str, threads: int, buffers: SharedBuffers, read_threads: int = 0
    ) -> None:
        if threads < 1:
            raise ValueError(f"a writer process needs at least one thread, not {threads}")
        if read_threads < 0:
            raise ValueError(f"read_threads must be 0 or more, not {read_threads}")
        self.name = name
        self.threads = threads
        self.read_threads = read_threads
        self._read_slots = trio.Semaphore(read_threads)
        self.buffers = buffers
        buffers.on_release = self._forget_later
        # FIFO: the queue of jobs. Twice the threads: a job waits in the socket for each
        # running one, so a thread that finishes takes the next at once rather than after
        # the event loop has read its answer and sent another (7-10% of 1 MiB puts).
        self._slots = trio.Semaphore(2 * threads)
        self._writer: _Writer | None = None  # while one is up
        self._up = trio.Event()  # set while ``_writer`` is up (and at close)
        self._closing = trio.Event()
        self._forget: list[int] = []  # buffers freed since the last message to the writer
        self._next_job = 0
        self._closed = True
        self.started = 0  # writer processes started (restarts included)

    @property
    def sent(self) -> int:
        """Jobs other than reads sent to the writer and not answered yet."""
        writer = self._writer
        return len(writer.pending) - writer.reads if writer is not None else 0

    @property
    def reading(self) -> int:
        """Read jobs sent to the writer and not answered yet."""
        return self._writer.reads if self._writer is not None else 0

    @property
    def queued(self) -> int:
        """Jobs other than reads waiting for a thread (in the daemon or in the socket)."""
        return self._slots.statistics().tasks_waiting + max(self.sent - self.threads, 0)

    @property
    def busy(self) -> int:
        """Jobs other than reads a thread is running now (or is about to)."""
        return min(self.sent, self.threads)

    @property
    def pid(self) -> int | None:
        return self._writer.proc.pid if self._writer is not None else None

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled, restarting the writer when it dies; ``run`` works once this
        has started. On the way out the jobs sent are finished and the writer is reaped."""
        self._closed = False
        async with trio.open_nursery() as nursery:
            await nursery.start(self._supervise)
            task_status.started()
            try:
                while True:
                    await trio.sleep(FORGET_INTERVAL)
                    writer = self._writer
                    if self._forget and writer is not None and not writer.pending:
                        try:
                            await self._send(writer, None, [])
                        except OSError:
                            pass  # it died: its supervisor says so
            finally:
                self._closed = True
                self._closing.set()
                self._up.set()  # jobs waiting for a writer find it closed
                with trio.CancelScope(shield=True):
                    await self._stop()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the writer process; its result, or its exception re-raised."""
        return await self._run(fn, args, read=False)

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """``run`` on a read thread: up to ``read_threads`` at once, whatever the writes do.
        A memoryview argument must lie in a shared buffer, else NotShared before anything is
        sent: ``fn`` may write into it, where ``run`` would pass a copy of one that does not."""
        if not self.read_threads:
            raise ValueError(f"{self.name}: no read threads")
        return await self._run(fn, args, read=True)

    async def _run(self, fn: Callable[..., T], args: tuple[Any, ...], read: bool) -> T:
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._closed:
            raise Unavailable(f"{self.name}: shutting down")
        fds: list[int] = []
        keep: list[mmap.mmap] = []  # copies into shared buffers, alive until answered
        marshalled = tuple(self._marshal(a, fds, keep, read) for a in args)
        call = (fn.__module__, fn.__qualname__, marshalled)
        slots = self._read_slots if read else self._slots
        await acquire_soon(slots)  # (each pass through the scheduler delays the job)
        try:
            writer = self._writer
            if writer is None:
                with trio.move_on_after(START_TIMEOUT):
                    await self._up.wait()
                writer = self._writer
            if writer is None or self._closed:
                raise Unavailable(f"{self.name}: no writer process is running")
            result: outcome.Outcome[T] = await self._call(writer, call, fds, read)
            return result.unwrap()
        finally:
            slots.release()

    def _marshal(self, arg: Any, fds: list[int], keep: list[mmap.mmap], read: bool) -> Any:
        if not isinstance(arg, memoryview):
            return arg
        view = arg.cast("B") if arg.format != "B" or arg.ndim != 1 else arg
        shared = self.buffers.locate(view, fds)
        if shared is None and read:
            raise NotShared(f"{self.name}: a read's buffer must be shared")
        if shared is None:
            if view.nbytes <= MAX_INLINE:
                return bytes(view)
            try:
                keep.append(self.buffers.new_shared(view.nbytes))
            except OSError as e:
                if e.errno not in (errno.EMFILE, errno.ENFILE):
                    raise
                raise Busy(f"{self.name}: out of file descriptors for shared buffers") from None
            copy = memoryview(keep[-1])
            copy[:] = view
            shared = self.buffers.locate(copy, fds)
            copy.release()
            assert shared is not None
        return shared

    async def _call(
        self,
        writer: _Writer,
        call: tuple[str, str, tuple[Any, ...]],
        fds: list[int],
        read: bool,
    ) -> outcome.Outcome[Any]:
        """Send the job and wait for its answer, also when cancelled: a job sent is waited
        for (the answer, or the writer's death, reschedules this task)."""
        self._next_job += 1
        jid = self._next_job
        job = writer.pending[jid] = _Job()
        writer.reads += read
        try:
            try:
                await self._send(writer, (jid, call), fds, read)
            except BaseException as e:
                writer.pending.pop(jid, None)
                if isinstance(e, OSError):
                    raise WriterLost(f"{self.name}: the writer process took no job ({e})") from None
                raise
            if job.result is None:  # (it can only be there already if the send had to wait)
                job.task = trio.lowlevel.current_task()
                await trio.lowlevel.wait_task_rescheduled(
                    lambda _raise_cancel: trio.lowlevel.Abort.FAILED
                )
        finally:
            writer.reads -= read
        assert job.result is not None
        return job.result

    async def _send(
        self,
        writer: _Writer,
        job: tuple[int, tuple[str, str, tuple[Any, ...]]] | None,
        fds: list[int],
        read: bool = False,
    ) -> None:
        """Send a job (job id, call) with the descriptors of its shared buffers, or None: only
        the buffers to forget."""
        forget, self._forget = self._forget, []
        data = pickle.dumps((job, forget), protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > MAX_MESSAGE:
            raise TectonicError(f"{self.name}: a job of {len(data)} bytes is too large")
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        raw, sock = (writer.read_raw, writer.read_sock) if read else (writer.raw, writer.sock)
        assert raw is not None and sock is not None
        try:  # without a pass through trio's scheduler when there is room (the norm)
            raw.sendmsg([data], anc)
        except BlockingIOError:
            with trio.CancelScope(shield=True):  # (half a message cannot be taken back)
                await sock.sendmsg([data], anc)

    def _forget_later(self, bid: int) -> None:
        self._forget.append(bid)

    async def _supervise(self, *, task_status: trio.TaskStatus[None]) -> None:
        """Start the writer, read its answers, and start another when it dies, until
        ``serve`` ends. Shielded: answers are read until the last job sent has one."""
        delay = RESTART_DELAY[0]
        with trio.CancelScope(shield=True):
            writer = await self._start()  # (a writer that cannot start at all is an error)
            task_status.started()
            while True:
                self._writer = writer
                self._up.set()
                since = trio.current_time()
                why = await self._read_answers(writer)
                self._writer = None
                if not self._closed:
                    self._up = trio.Event()
                await self._reap(writer)
                self._fail_pending(writer, why)
                if self._closed:
                    return
                log.error(
                    "%s: writer process %d %s (exit status %s); restarting it",
                    self.name,
                    writer.proc.pid,
                    why,
                    writer.proc.returncode,
                )
                while True:
                    if trio.current_time() - since > 60:
                        delay = RESTART_DELAY[0]
                    with trio.move_on_after(delay):
                        await self._closing.wait()
                    delay = min(delay * 2, RESTART_DELAY[1])
                    if self._closed:
                        return
                    try:
                        writer = await self._start()
                        break
                    except OSError as e:
                        log.error("%s: cannot start a writer process (%s)", self.name, e)

    async def _start(self) -> _Writer:
        parents: list[socket.socket] = []
        children: list[socket.socket] = []
        try:
            for _ in range(2 if self.read_threads else 1):
                parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                parents.append(parent)
                children.append(child)
            argv = [sys.executable, "-m", __name__]
            argv += [str(children[0].fileno()), str(self.threads), str(os.getpid()), self.name]
            if self.read_threads:
                argv += [str(children[1].fileno()), str(self.read_threads)]
            proc = await trio.lowlevel.open_process(
                argv,
                pass_fds=[c.fileno() for c in children],
                stdin=subprocess.DEVNULL,
                env=child_env(),
            )
        except BaseException:
            for p in parents:
                p.close()
            raise
        finally:
            for c in children:
                c.close()
        for p in parents:
            p.setblocking(False)
        writer = _Writer(proc, parents[0], parents[1] if self.read_threads else None)
        # Wait for it to say it is ready (its imports done): its start-up costs the CPU of a
        # few puts, which belongs before the daemon says it serves, not inside the first
        # puts (nine chunk stores started together made a client's first write 20% slower).
        ready = b""
        with trio.move_on_after(START_TIMEOUT):
            try:
                ready = await writer.sock.recv(len(READY) + 1)
            except OSError:
                pass
        if ready != READY:
            writer.proc.kill()
            await self._reap(writer)
            raise OSError(
                f"{self.name}: writer process {proc.pid} did not start"
                f" (exit status {proc.returncode})"
            )
        self.started += 1
        log.info("%s: writer process %d started", self.name, proc.pid)
        return writer

    async def _read_answers(self, writer: _Writer) -> str:
        """Hand each answer to its job until the writer's end of the socket closes; why
        it ended.

        All the answers there are, then a wait: the jobs' tasks then wake in one pass of
        the scheduler and their replies leave in one ``writev`` (``rpc_server._Outbox``); read
        one per pass, as ``recv_into`` does, each reply went alone. (The answers waiting are
        bounded by the jobs sent, so this never starves the other tasks.)"""
        buf = bytearray(MAX_MESSAGE)
        while True:
            try:
                n = writer.raw.recv_into(buf)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(writer.raw)
                continue
            except OSError as e:
                return f"broke its socket ({e})"
            if not n:
                return "exited" if self._closed else "died"
            try:
                jid, ok, value = pickle.loads(memoryview(buf)[:n])
            except Exception:  # (a writer that says nonsense is not trusted further)
                log.exception("%s: unreadable answer from the writer process", self.name)
                writer.proc.kill()
                return "sent an unreadable answer"
            job = writer.pending.pop(jid, None)
            if job is not None:
                job.finish(outcome.Value(value) if ok else outcome.Error(value))

    def _fail_pending(self, writer: _Writer, why: str) -> None:
        pending, writer.pending = writer.pending, {}
        for job in pending.values():
            lost = WriterLost(
                f"{self.name}: writer process {writer.proc.pid} {why} during the job"
                f" (exit status {writer.proc.returncode})"
            )
            job.finish(outcome.Error(lost))

    async def _reap(self, writer: _Writer) -> None:
        writer.close()
        with trio.move_on_after(STOP_TIMEOUT):
            await writer.proc.wait()
        if writer.proc.returncode is None:
            log.error("%s: writer process %d did not exit; killed", self.name, writer.proc.pid)
            writer.proc.kill()
            await writer.proc.wait()

    async def _stop(self) -> None:
        """Wait for the jobs sent, then end the writer: it reads the end of its socket and
        exits (``_supervise`` reaps it, or kills it after ``STOP_TIMEOUT``)."""
        writer = self._writer
        if writer is None:
            return
        with trio.move_on_after(STOP_TIMEOUT):
            while writer.pending:  # (their callers wait for them, cancelled or not)
                await trio.sleep(0.005)
        for raw in (writer.raw, writer.read_raw):
            try:
                if raw is not None:
                    raw.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # (``_supervise`` reaps it, killing it if it does not exit)


# --- the writer process ---------------------------------------------------------------------


class _Mappings:
    """The writer's mappings of the daemon's shared buffers, by buffer id (ids are never
    reused, so a mapping is never stale)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._views: dict[int, memoryview] = {}

    def view(self, shared: _Shared, fd: int) -> memoryview:
        whole = self._views.get(shared.bid)
        if whole is None:
            with self._lock:
                whole = self._views.get(shared.bid)
                if whole is None:
                    whole = self._views[shared.bid] = memoryview(mmap.mmap(fd, shared.size))
        return whole[shared.offset : shared.offset + shared.length]

    def forget(self, bids: list[int]) -> None:
        with self._lock:
            for bid in bids:
                whole = self._views.pop(bid, None)
                if whole is None:
                    continue
                buf = whole.obj
                assert isinstance(buf, mmap.mmap)
                try:
                    whole.release()
                    buf.close()
                except BufferError:  # a view outlived its job: unmapped when it goes
                    pass


_functions: dict[tuple[str, str], Callable[..., Any]] = {}


def _resolve(module: str, qualname: str) -> Callable[..., Any]:
    fn = _functions.get((module, qualname))
    if fn is None:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        fn = _functions[(module, qualname)] = obj
    return fn


def _invoke(module: str, qualname: str, args: list[Any]) -> Any:
    return _resolve(module, qualname)(*args)


def _answer(jid: int, call: tuple[str, str, tuple[Any, ...]], views: list[memoryview]) -> bytes:
    module, qualname, raw = call
    shared = iter(views)
    args = [next(shared) if isinstance(a, _Shared) else a for a in raw]
    result = outcome.capture(_invoke, module, qualname, args)
    del args, shared
    if isinstance(result, outcome.Value):
        try:
            return pickle.dumps((jid, True, result.value), protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            error: BaseException = TectonicError(f"{qualname} returned what cannot be sent: {e}")
            return pickle.dumps((jid, False, error), protocol=pickle.HIGHEST_PROTOCOL)
    error = result.error
    if not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit: not the caller's
        raise error
    error.__traceback__ = None  # (its frames hold views of the shared buffers)
    try:  # the daemon re-raises it for the caller
        return pickle.dumps((jid, False, error), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError):
        return pickle.dumps((jid, False, TectonicError(f"{type(error).__name__}: {error}")))


def _thread(sock: socket.socket, answers: socket.socket, maps: _Mappings) -> None:
    """One thread of the writer. If it fails (a bug), the whole writer exits: the daemon
    then fails the jobs it had and starts another, where a silently dead thread would leave
    its job's caller waiting forever."""
    try:
        _serve_jobs(sock, answers, maps)
    except BaseException:
        log.exception("writer thread failed; the writer process exits")
        logging.shutdown()
        os._exit(70)


def _serve_jobs(sock: socket.socket, answers: socket.socket, maps: _Mappings) -> None:
    """Run jobs from ``sock``, answering on ``answers``, until the daemon ends them (or the
    socket breaks)."""
    buf = bytearray(MAX_MESSAGE)
    ancillary = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
    while True:
        try:
            n, anc, flags, _addr = sock.recvmsg_into([buf], ancillary)
        except OSError:
            return
        fds = array.array("i")
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        try:
            if not n:
                return
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise TectonicError(f"a job message was truncated (flags {flags:#x})")
            job, forget = pickle.loads(memoryview(buf)[:n])
            if forget:
                maps.forget(forget)
            if job is None:
                continue
            jid, call = job
            shared = [a for a in call[2] if isinstance(a, _Shared)]
            views = [maps.view(s, fds[s.fd_index]) for s in shared]
            answer = _answer(jid, call, views)
            for v in views:
                v.release()
            del views
        finally:
            for fd in fds:
                os.close(fd)
        try:
            answers.send(answer)
        except OSError:
            return


def _die_with(parent: int) -> None:
    """Be killed when the daemon process dies (a job nobody waits for is not worth running).

    Why not ``PR_SET_PDEATHSIG``: it fires when the *thread* that started this process ends,
    and trio starts processes from a worker thread of its cache, which ends after 10 s idle.
    With it, an idle chunk store's writer was killed ten seconds after each start (and
    restarted), failing a put in flight at that moment with ``WriterLost``. A pidfd of the
    daemon becomes readable when the whole process has gone.
    """
    try:
        pidfd = os.pidfd_open(parent)
    except OSError:  # gone already
        os._exit(0)
    if os.getppid() != parent:  # it died before the pidfd was opened (its pid may be reused)
        os._exit(0)

    def watch() -> None:
        select.select([pidfd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="daemon watch", daemon=True).start()


def main(argv: list[str]) -> None:
    """``python -m chunkstore.writer_process SOCKET_FD THREADS DAEMON_PID NAME
    [READ_SOCKET_FD READ_THREADS]``."""
    fd, threads, parent, name = int(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    read_fd, read_threads = (int(argv[4]), int(argv[5])) if len(argv) > 4 else (-1, 0)
    _die_with(parent)
    # Ctrl-C reaches the whole process group, and systemd signals the whole unit: the daemon
    # decides when its writer stops (after the jobs it sent), and it dies with the daemon.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s {name} [{os.getpid()}] %(name)s: %(message)s",
    )
    importlib.import_module("chunkstore.layout")  # what its jobs call, loaded before "ready"
    sock = socket.socket(fileno=fd)
    sock.send(READY)
    maps = _Mappings()
    workers = [
        threading.Thread(target=_thread, args=(sock, sock, maps), name=f"{name} {i}")
        for i in range(threads)
    ]
    if read_threads:
        reads = socket.socket(fileno=read_fd)
        workers += [
            threading.Thread(target=_thread, args=(reads, sock, maps), name=f"{name} read {i}")
            for i in range(read_threads)
        ]
    for t in workers:
        t.start()
    for t in workers:
        t.join()


if __name__ == "__main__":
    # Run the module's importable copy, whose classes are those pickle resolves jobs to.
    importlib.import_module("chunkstore.writer_process").main(sys.argv[1:])
