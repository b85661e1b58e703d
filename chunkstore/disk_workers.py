"""A fixed pool of disk worker threads fed by a queue: the chunk store's puts and deletes.

Why not ``trio.to_thread.run_sync`` per put: each call wakes a parked thread (a futex wake,
which on a VM is an inter-processor interrupt paid on the event loop thread), passes twice
through trio's scheduler and renames the OS thread twice. Here a worker that finishes a job
takes the next queued one without parking, so under load (more puts admitted than workers,
the case that matters) the event loop wakes nobody: it appends to a deque. Results go back
the same way: jobs that finish while a delivery to the event loop is pending ride along with
it (puts that finish together cost the event loop one wake-up).

The threads are still trio's: each is one long ``trio.to_thread.run_sync`` call owned by a
task of ``serve``'s nursery, so the pool lives and dies with the daemon's nursery. The queue
is the admission limit as well: at most ``workers`` jobs run at once, the rest wait in order.

Cancellation is that of ``trio.to_thread.run_sync(..., abandon_on_cancel=False)``: a job
still queued is dropped and the caller gets ``Cancelled``; a running one is waited for, since
a half-done disk operation cannot be abandoned safely.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

from tectonic_py.core.errors import Unavailable

T = TypeVar("T")


class _Job:
    __slots__ = ("args", "fn", "started", "task")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], task: trio.lowlevel.Task):
        self.fn = fn
        self.args = args
        self.task = task
        self.started = False  # taken by a thread (under the pool's lock)


class DiskWorkers:
    """``workers`` threads running blocking functions for trio tasks, in arrival order."""

    def __init__(self, name: str, workers: int) -> None:
        if workers < 1:
            raise ValueError("a worker pool needs at least one thread")
        self.name = name
        self.workers = workers
        self._cv = threading.Condition(threading.Lock())
        self._jobs: collections.deque[_Job] = collections.deque()
        self._idle = 0  # threads parked in _cv.wait()
        self._running = 0  # jobs taken by a thread and not finished
        self._closed = True
        self._token: trio.lowlevel.TrioToken | None = None
        self._done: list[tuple[_Job, outcome.Outcome[Any]]] = []  # finished, not yet delivered

    @property
    def queued(self) -> int:
        """Jobs waiting for a thread."""
        return len(self._jobs)

    @property
    def idle(self) -> int:
        """Threads started and waiting for a job."""
        return self._idle

    @property
    def busy(self) -> int:
        """Jobs a thread is running now."""
        return self._running

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the threads until cancelled; ``run`` works once this has started."""
        self._token = trio.lowlevel.current_trio_token()
        self._closed = False
        # The threads' own limiter: they hold it for their whole life, and taking trio's
        # default one (40 threads) would starve every other to_thread call of the process.
        limiter = trio.CapacityLimiter(self.workers)
        async with trio.open_nursery() as nursery:
            for i in range(self.workers):
                nursery.start_soon(self._thread, i, limiter)
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._close()  # threads finish what is queued, then return

    async def _thread(self, index: int, limiter: trio.CapacityLimiter) -> None:
        await trio.to_thread.run_sync(
            self._work, thread_name=f"{self.name} {index}", limiter=limiter
        )

    def _close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on one of the threads; its result, or its exception re-raised."""
        await trio.lowlevel.checkpoint_if_cancelled()
        job = _Job(fn, args, trio.lowlevel.current_task())
        with self._cv:
            if self._closed:
                raise Unavailable(f"{self.name}: shutting down")
            self._jobs.append(job)
            if self._idle:
                self._cv.notify()

        def abort(_raise_cancel: Any) -> trio.lowlevel.Abort:
            with self._cv:
                if not job.started:
                    self._jobs.remove(job)
                    return trio.lowlevel.Abort.SUCCEEDED
            return trio.lowlevel.Abort.FAILED  # running: _deliver reschedules us when done

        result: outcome.Outcome[T] = await trio.lowlevel.wait_task_rescheduled(abort)
        return result.unwrap()

    def _work(self) -> None:
        """One thread: take jobs until the pool is closed and the queue is empty."""
        assert self._token is not None
        token = self._token
        cv = self._cv
        jobs = self._jobs
        while True:
            with cv:
                while not jobs:
                    if self._closed:
                        return
                    self._idle += 1
                    try:
                        cv.wait()
                    finally:
                        self._idle -= 1
                job = jobs.popleft()
                job.started = True
                self._running += 1
            result = outcome.capture(job.fn, *job.args)
            job.fn = job.args = None  # type: ignore[assignment]  # drop the payload early
            with cv:
                self._running -= 1
                self._done.append((job, result))
                first = len(self._done) == 1
            if first:  # else a delivery is already on its way and takes this one too
                try:
                    token.run_sync_soon(self._deliver)
                except trio.RunFinishedError:
                    pass
            # An idle thread must not keep its last job alive while it waits for the next:
            # the result (a chunk's bytes, say) and the caller's task would live on in it.
            del job, result

    def _deliver(self) -> None:
        """Event loop: wake the callers of every job finished since the last delivery (one
        wake-up of the event loop thread for puts whose directory fsync ended together)."""
        with self._cv:
            done, self._done = self._done, []
        for job, result in done:
            trio.lowlevel.reschedule(job.task, outcome.Value(result))
