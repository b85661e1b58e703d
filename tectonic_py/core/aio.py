"""Small trio helpers shared by daemons and the client.

``acquire_soon`` takes a lock or limiter without a pass through trio's scheduler when it is
free: on the chunk store every pass costs the event loop thread CPU and an epoll_wait that
hands the GIL to the disk threads, and the request yields soon anyway.

``open_service_nursery`` is a nursery for objects that own background tasks (connection
receivers, pools, flushers): those tasks never raise on purpose, so any exception leaving it
comes from the body. trio wraps even a single exception in an ExceptionGroup; public client
APIs must not leak groups, so a group of exactly one exception is unwrapped here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio


@asynccontextmanager
async def open_service_nursery() -> AsyncIterator[trio.Nursery]:
    try:
        async with trio.open_nursery() as nursery:
            yield nursery
    except BaseExceptionGroup as group:
        inner = _single(group)
        if inner is None:
            raise
        raise inner from None


async def acquire_soon(lock: trio.Lock | trio.CapacityLimiter | trio.Semaphore) -> None:
    """``await lock.acquire()``, without yielding when the lock is free."""
    try:
        lock.acquire_nowait()
    except trio.WouldBlock:
        await lock.acquire()


def _single(group: BaseExceptionGroup) -> BaseException | None:
    while isinstance(group, BaseExceptionGroup):
        if len(group.exceptions) != 1:
            return None
        group = group.exceptions[0]  # type: ignore[assignment]
    return group
