"""The retry helper: what is retried, the pauses between tries, attempts and deadline."""

from __future__ import annotations

import functools

import pytest
import trio

from tectonic_py.core.errors import (
    Busy,
    ChunkNotFound,
    ShardUnavailable,
    TectonicError,
    Unavailable,
)
from tectonic_py.core.retry import RetryPolicy, is_retryable, retry, retrying

EXACT = {"jitter": 0.0}


class Flaky:
    """Fails with the given errors in order, then returns the count of calls."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls: list[float] = []

    async def __call__(self, *args: object) -> int:
        self.calls.append(trio.current_time())
        if self.errors:
            raise self.errors.pop(0)
        return len(self.calls)


def test_is_retryable_comes_from_the_error_class() -> None:
    assert is_retryable(Busy())
    assert is_retryable(Unavailable())
    assert is_retryable(ShardUnavailable())
    assert not is_retryable(ChunkNotFound())
    assert not is_retryable(TectonicError())
    assert not is_retryable(OSError("a raw socket error is the wire layer's to translate"))


async def test_retries_until_success_with_exponential_pauses(autojump_clock) -> None:
    fn = Flaky(Busy(), Busy(), Busy())
    policy = RetryPolicy(attempts=5, first_delay=0.1, multiplier=2.0, max_delay=10.0, **EXACT)
    assert await retry(fn, policy=policy) == 4
    gaps = [round(b - a, 6) for a, b in zip(fn.calls, fn.calls[1:], strict=False)]
    assert gaps == [0.1, 0.2, 0.4]


async def test_pauses_are_capped(autojump_clock) -> None:
    fn = Flaky(*[Busy() for _ in range(5)])
    policy = RetryPolicy(attempts=6, first_delay=0.1, multiplier=3.0, max_delay=0.5, **EXACT)
    await retry(fn, policy=policy)
    gaps = [round(b - a, 6) for a, b in zip(fn.calls, fn.calls[1:], strict=False)]
    assert gaps == [0.1, 0.3, 0.5, 0.5, 0.5]


def test_jitter_stays_within_its_band() -> None:
    policy = RetryPolicy(first_delay=1.0, max_delay=1.0, jitter=0.5)
    delays = [policy.delay(1) for _ in range(500)]
    assert all(0.5 <= d <= 1.5 for d in delays)
    assert max(delays) - min(delays) > 0.5  # it does spread


async def test_gives_up_after_attempts_with_the_last_error(autojump_clock) -> None:
    last = Unavailable("third")
    fn = Flaky(Unavailable("first"), Unavailable("second"), last, Unavailable("never seen"))
    with pytest.raises(Unavailable) as info:
        await retry(fn, policy=RetryPolicy(attempts=3))
    assert info.value is last and len(fn.calls) == 3


async def test_a_non_retryable_error_is_raised_at_once(autojump_clock) -> None:
    fn = Flaky(ChunkNotFound("gone"))
    with pytest.raises(ChunkNotFound):
        await retry(fn, policy=RetryPolicy(attempts=10))
    assert len(fn.calls) == 1


async def test_other_exceptions_are_never_retried(autojump_clock) -> None:
    fn = Flaky(KeyError("a bug"))
    with pytest.raises(KeyError):
        await retry(fn, policy=RetryPolicy(attempts=10))
    assert len(fn.calls) == 1


async def test_deadline_bounds_when_a_new_try_starts(autojump_clock) -> None:
    fn = Flaky(*[Busy() for _ in range(100)])
    policy = RetryPolicy(attempts=None, deadline=1.0, first_delay=0.1, max_delay=0.25, **EXACT)
    start = trio.current_time()
    with pytest.raises(Busy):
        await retry(fn, policy=policy)
    assert all(t - start <= 1.0 for t in fn.calls)
    # 0, 0.1, 0.3, 0.55, 0.8; the next pause would end at 1.05, past the deadline.
    assert len(fn.calls) == 5
    assert trio.current_time() - start == pytest.approx(0.8)


async def test_attempts_and_deadline_together_stop_at_the_first(autojump_clock) -> None:
    fn = Flaky(*[Busy() for _ in range(100)])
    with pytest.raises(Busy):
        await retry(fn, policy=RetryPolicy(attempts=3, deadline=100.0, **EXACT))
    assert len(fn.calls) == 3


async def test_when_narrows_what_is_retried(autojump_clock) -> None:
    def not_unavailable(e: TectonicError) -> bool:
        return not isinstance(e, Unavailable)

    fn = Flaky(Busy(), Unavailable("try another node"))
    with pytest.raises(Unavailable):
        await retry(fn, policy=RetryPolicy(attempts=10), when=not_unavailable)
    assert len(fn.calls) == 2


async def test_when_cannot_widen_what_is_retried(autojump_clock) -> None:
    fn = Flaky(ChunkNotFound())
    with pytest.raises(ChunkNotFound):
        await retry(fn, policy=RetryPolicy(attempts=10), when=lambda e: True)
    assert len(fn.calls) == 1


async def test_on_retry_is_told_each_retry(autojump_clock) -> None:
    seen: list[tuple[int, str, float]] = []
    fn = Flaky(Busy("a"), Busy("b"))
    policy = RetryPolicy(attempts=5, first_delay=0.01, **EXACT)
    await retry(fn, policy=policy, on_retry=lambda n, e, d: seen.append((n, e.message, d)))
    assert seen == [(1, "a", 0.01), (2, "b", 0.02)]


async def test_arguments_are_passed_on(autojump_clock) -> None:
    got: list[tuple[object, ...]] = []

    async def fn(a: int, b: str, *, c: float) -> str:
        got.append((a, b, c))
        if len(got) < 2:
            raise Busy()
        return b * a

    assert await retry(functools.partial(fn, c=1.5), 2, "x", policy=RetryPolicy(**EXACT)) == "xx"
    assert got == [(2, "x", 1.5), (2, "x", 1.5)]


async def test_decorator(autojump_clock) -> None:
    calls = 0

    @retrying(RetryPolicy(attempts=3, **EXACT))
    async def flaky(x: int, *, y: int) -> int:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise Unavailable()
        return x + y

    assert await flaky(1, y=2) == 3
    assert calls == 3
    assert flaky.__name__ == "flaky"


async def test_cancellation_during_a_pause_is_not_retried(autojump_clock) -> None:
    fn = Flaky(*[Busy() for _ in range(100)])
    with trio.move_on_after(0.5) as scope:
        await retry(fn, policy=RetryPolicy(attempts=None, deadline=60.0, first_delay=0.2, **EXACT))
    assert scope.cancelled_caught
    assert len(fn.calls) == 2  # at 0 and 0.2; the next pause (0.4) is cut by the scope


@pytest.mark.parametrize(
    "bad",
    [
        {"attempts": None},
        {"attempts": 0},
        {"deadline": -1.0},
        {"first_delay": 2.0, "max_delay": 1.0},
        {"multiplier": 0.5},
        {"jitter": 1.5},
    ],
)
def test_policy_rejects_nonsense(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**bad)  # type: ignore[arg-type]
