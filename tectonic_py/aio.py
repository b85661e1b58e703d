"""Small trio helpers shared by daemons and the client.

``open_service_nursery`` is a nursery for objects that own background tasks (connection
receivers, pools, flushers): those tasks never raise on purpose, so any exception leaving it
comes from the body. trio wraps even a single exception in an ExceptionGroup; public client
APIs must not leak groups (STYLE.md), so a group of exactly one exception is unwrapped here.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator

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


def _single(group: BaseExceptionGroup) -> BaseException | None:
    while isinstance(group, BaseExceptionGroup):
        if len(group.exceptions) != 1:
            return None
        group = group.exceptions[0]  # type: ignore[assignment]
    return group
