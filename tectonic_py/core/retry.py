"""The one retry helper: what is retried, how long to wait between tries, when to give up.

What is retryable is decided here, in ``is_retryable``, from the error class alone:
``TectonicError.retryable`` (busy, a node that is restarting, a connection the wire layer
lost, which it raises as ``Unavailable``). Everything else, a bug included, fails at once.
A caller may narrow that with ``when`` ("``Unavailable`` is not retried on this node: try
another", "a mutation that may have reached the server is not repeated"), never widen it.

How long: ``RetryPolicy`` bounds the tries by a count, a deadline, or both, and waits an
exponentially growing, capped, jittered delay between them, so that a thousand clients
refused together do not come back together. The deadline is on trio's clock (tests use
``trio.testing.MockClock``) and bounds when a new try may start: a try already running is
not cut short (wrap the call in ``trio.fail_after`` for that).

``on_retry`` is told about each retry before its pause, for logging or counting; by default
the retry is logged at debug level.

Usage::

    await retry(conn.call, "get", fields, policy=RetryPolicy(attempts=4))

    @retrying(RetryPolicy(deadline=30.0), when=lambda e: not isinstance(e, Unavailable))
    async def put(...): ...
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import trio

from tectonic_py.core.errors import TectonicError

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

RetryHook = Callable[[int, TectonicError, float], None]
"""``(attempt, error, delay)``: try number ``attempt`` (1 = the first) failed with
``error``; the next try starts after ``delay`` seconds."""

_rng = random.Random()


def is_retryable(error: BaseException) -> bool:
    """True when the same request may succeed later unchanged: the one place that says so."""
    return isinstance(error, TectonicError) and error.retryable


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry.

    * ``attempts``: tries in all, the first one included (``None``: bounded by the deadline
      alone).
    * ``deadline``: seconds after the first try starts past which no new try starts (``None``:
      bounded by ``attempts`` alone). A pause that would end past it is not taken.
    * delay before retry ``n`` (1 = the first retry): ``min(first_delay * multiplier **
      (n - 1), max_delay)``, scaled by a factor drawn from ``[1 - jitter, 1 + jitter]``.
    """

    attempts: int | None = 4
    deadline: float | None = None
    first_delay: float = 0.05
    max_delay: float = 1.0
    multiplier: float = 2.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.attempts is None and self.deadline is None:
            raise ValueError("a retry policy needs attempts, a deadline, or both")
        if self.attempts is not None and self.attempts < 1:
            raise ValueError(f"attempts must be at least 1, not {self.attempts}")
        if self.deadline is not None and self.deadline < 0:
            raise ValueError(f"deadline must be >= 0, not {self.deadline}")
        if not (0 <= self.first_delay <= self.max_delay and self.multiplier >= 1):
            raise ValueError("need 0 <= first_delay <= max_delay and multiplier >= 1")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter must be within [0, 1], not {self.jitter}")

    def delay(self, retry_number: int) -> float:
        """The pause before retry ``retry_number`` (1 = the first retry), jitter included."""
        base = min(self.first_delay * self.multiplier ** (retry_number - 1), self.max_delay)
        if not self.jitter:
            return base
        return base * (1.0 - self.jitter + 2.0 * self.jitter * _rng.random())


def _log_retry(attempt: int, error: TectonicError, delay: float) -> None:
    log.debug("try %d failed (%s); retrying in %.3fs", attempt, error.message, delay)


async def retry(
    fn: Callable[..., Awaitable[T]],
    *args: Any,
    policy: RetryPolicy | None = None,
    when: Callable[[TectonicError], bool] | None = None,
    on_retry: RetryHook | None = None,
) -> T:
    """``await fn(*args)``, retried under ``policy`` (default ``RetryPolicy()``).

    ``when`` may refuse to retry an error that ``is_retryable`` allows; ``on_retry`` is told
    of each retry (default: a debug log line). Keyword arguments for ``fn``: bind them with
    ``functools.partial``.

    Error handling: an error that is not retried, or the last one once the policy is spent,
    propagates unchanged. Cancellation is never retried.
    """
    return await _retry(fn, args, policy or RetryPolicy(), when, on_retry or _log_retry)


async def _retry(
    fn: Callable[..., Awaitable[T]],
    args: tuple[object, ...],
    policy: RetryPolicy,
    when: Callable[[TectonicError], bool] | None,
    on_retry: RetryHook,
) -> T:
    give_up_at = None if policy.deadline is None else trio.current_time() + policy.deadline
    attempt = 0
    while True:
        attempt += 1
        try:
            return await fn(*args)
        except TectonicError as e:
            if not is_retryable(e) or (when is not None and not when(e)):
                raise
            if policy.attempts is not None and attempt >= policy.attempts:
                raise
            delay = policy.delay(attempt)
            if give_up_at is not None and trio.current_time() + delay > give_up_at:
                raise
            on_retry(attempt, e, delay)
        await trio.sleep(delay)


def retrying(
    policy: RetryPolicy | None = None,
    *,
    when: Callable[[TectonicError], bool] | None = None,
    on_retry: RetryHook | None = None,
) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Awaitable[T]]]:
    """Decorator form of ``retry``: every call of the decorated function is retried."""
    chosen = policy or RetryPolicy()
    hook = on_retry or _log_retry

    def decorate(fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
        @functools.wraps(fn)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
            return await _retry(functools.partial(fn, *args, **kwargs), (), chosen, when, hook)

        return wrapper

    return decorate
