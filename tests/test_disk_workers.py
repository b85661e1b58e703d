"""chunkstore.disk_workers: the chunk store's pool of disk threads, on real threads."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import trio

from chunkstore.disk_workers import DiskWorkers
from tectonic_py.core.errors import ChunkCorrupt, Unavailable


async def test_results_and_exceptions_come_back_to_the_caller() -> None:
    pool = DiskWorkers("test", 2)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.serve)
        assert await pool.run(lambda a, b: a + b, 2, 3) == 5
        assert await pool.run(threading.get_ident) != threading.get_ident()

        def fail() -> None:
            raise ChunkCorrupt("bad bytes")

        with pytest.raises(ChunkCorrupt, match="bad bytes"):
            await pool.run(fail)
        assert pool.busy == 0 and pool.queued == 0
        nursery.cancel_scope.cancel()


async def test_an_idle_thread_keeps_nothing_of_its_last_job() -> None:
    class Result:
        pass

    pool = DiskWorkers("test", 1)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.serve)
        result = await pool.run(Result)
        gone = weakref.ref(result)
        del result
        with trio.fail_after(10):
            while pool.idle < pool.workers:  # the thread is back, waiting for a job
                await trio.sleep(0.01)
        # (trio's run loop holds the last value it sent a task until the next checkpoint)
        await trio.lowlevel.checkpoint()
        gc.collect()
        assert gone() is None
        nursery.cancel_scope.cancel()


async def test_the_pool_leaves_trios_default_thread_limiter_alone() -> None:
    limit = trio.to_thread.current_default_thread_limiter().total_tokens
    pool = DiskWorkers("test", limit + 2)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.serve)
        with trio.fail_after(10):
            while pool.idle < pool.workers:  # every thread started and parked
                await trio.sleep(0.01)
            assert await trio.to_thread.run_sync(lambda: 7) == 7
            assert await pool.run(lambda: 8) == 8
        nursery.cancel_scope.cancel()


async def test_at_most_workers_run_at_once_and_the_rest_wait() -> None:
    pool = DiskWorkers("test", 3)
    gate = threading.Event()
    running = 0
    peak = 0
    lock = threading.Lock()

    def job(i: int) -> int:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        gate.wait(10)
        with lock:
            running -= 1
        return i * i

    results: dict[int, int] = {}

    async def call(i: int) -> None:
        results[i] = await pool.run(job, i)

    async with trio.open_nursery() as nursery:
        await nursery.start(pool.serve)
        async with trio.open_nursery() as callers:
            for i in range(12):
                callers.start_soon(call, i)
            with trio.fail_after(10):
                while pool.busy < 3:
                    await trio.sleep(0.005)
            assert pool.queued == 9
            gate.set()
        nursery.cancel_scope.cancel()
    assert results == {i: i * i for i in range(12)}
    assert peak == 3


async def test_queued_jobs_start_in_arrival_order() -> None:
    pool = DiskWorkers("test", 1)
    order: list[int] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.serve)
        async with trio.open_nursery() as callers:
            for i in range(20):
                callers.start_soon(pool.run, order.append, i)
                await trio.lowlevel.checkpoint()  # each caller enqueues before the next starts
        nursery.cancel_scope.cancel()
    assert order == list(range(20))


async def test_cancel_drops_a_queued_job_and_waits_for_a_running_one() -> None:
    pool = DiskWorkers("test", 1)
    release = threading.Event()
    ran: list[str] = []

    def blocker() -> str:
        release.wait(10)
        ran.append("blocker")
        return "done"

    def queued() -> None:
        ran.append("queued")

    async with trio.open_nursery() as nursery:
        await nursery.start(pool.serve)
        outcome: dict[str, object] = {}

        async def run_blocker() -> None:
            with trio.CancelScope() as scope:
                outcome["blocker_scope"] = scope
                outcome["blocker"] = await pool.run(blocker)

        nursery.start_soon(run_blocker)
        with trio.fail_after(10):
            while pool.busy < 1:
                await trio.sleep(0.005)
        with trio.move_on_after(0.05) as waited:
            await pool.run(queued)
        assert waited.cancelled_caught and pool.queued == 0

        # Cancelling the caller of a running job does not abandon it: it waits, and the
        # result still arrives.
        outcome["blocker_scope"].cancel()  # type: ignore[attr-defined]
        await trio.sleep(0.05)
        assert "blocker" not in outcome
        release.set()
        with trio.fail_after(5):
            while pool.busy:
                await trio.sleep(0.01)
        await trio.sleep(0.01)
        assert outcome["blocker"] == "done"
        nursery.cancel_scope.cancel()
    assert ran == ["blocker"]  # the cancelled queued job never ran


async def test_shutdown_finishes_running_work_and_refuses_new() -> None:
    pool = DiskWorkers("test", 2)
    finished = threading.Event()

    def slow() -> None:
        time.sleep(0.1)
        finished.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(pool.serve)
        nursery.start_soon(pool.run, slow)
        with trio.fail_after(10):
            while pool.busy < 1:
                await trio.sleep(0.005)
        nursery.cancel_scope.cancel()
    assert finished.is_set()  # the nursery waited for the thread's job
    with pytest.raises(Unavailable):
        await pool.run(lambda: None)
    with pytest.raises(ValueError):
        DiskWorkers("test", 0)
