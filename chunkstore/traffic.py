"""Traffic classes: a chunk store admits puts and gets by weighted fair queueing across jobs.

Why here: a chunk store's disk is what a checkpoint burst queues for (the wire layer has
already taken the request's bytes into memory; a handler then waits for one of a few disk
slots). Whoever is first in that queue is served first, so one job's burst of thousands of
chunk puts would make another job's restore wait behind all of it. The queue is therefore
cut into one queue per traffic class, and a slot that frees goes to the class that deficit
round robin picks (Shreedhar and Varghese, SIGCOMM '95): each class with requests waiting
gets ``quantum x weight`` bytes of credit per round and is served while its credit covers
the request at its head. Under backlog every class gets a share of the bytes proportional
to its weight; a class with nothing waiting takes no turn, so its share goes to the others
(the scheduler is work-conserving); and every waiting class is served within a bounded
number of grants (no starvation), whatever the weights.

A class is a job (``job`` and ``weight`` of the client's cluster file, sent in the
handshake and covered by its MAC: core/auth.py), ``default`` for a client that names none,
or ``background`` for the maintenance daemon's repair, rebalance, GC and inventory traffic,
whatever job it names. The store's ``--job NAME=WEIGHT`` settings are authoritative for the
jobs they name (and set the weights of ``default`` and ``background``); a job they do not
name gets the weight its client declared, within 1..``MAX_WEIGHT``. At most ``MAX_JOBS``
job classes are kept (the metrics' label values stay bounded); later unnamed jobs share
``default``.

``rate``: optionally the admission is also paced to that many bytes per second (``--max-
write-rate``, ``--max-read-rate``): a store that must leave disk bandwidth to something else
shares what it allows by the same weights.
"""

from __future__ import annotations

import collections
import re
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import outcome
import trio

from tectonic_py.core import auth
from tectonic_py.core.errors import ConfigError

DEFAULT = "default"
BACKGROUND = "background"
RESERVED = (DEFAULT, BACKGROUND)
MAX_JOBS = 64
MAX_WEIGHT = 1000
QUANTUM = 1024 * 1024  # bytes of credit per unit of weight per round
JOB_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def parse_weights(specs: Iterable[str]) -> dict[str, int]:
    """``NAME=WEIGHT`` settings (``--job``) as a map; ConfigError for a bad one."""
    out: dict[str, int] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep or not JOB_RE.match(name):
            raise ConfigError(f"bad job {spec!r}: NAME=WEIGHT, NAME of letters, digits, '_.-'")
        try:
            weight = int(value)
        except ValueError:
            raise ConfigError(f"bad job weight in {spec!r}: an integer 1..{MAX_WEIGHT}") from None
        if not 1 <= weight <= MAX_WEIGHT:
            raise ConfigError(f"bad job weight in {spec!r}: an integer 1..{MAX_WEIGHT}")
        out[name] = weight
    return out


@dataclass
class TrafficPolicy:
    """The store's configured weights, and the classes it has met (bounded)."""

    weights: dict[str, int] = field(default_factory=dict)
    met: dict[str, int] = field(default_factory=dict)  # declared jobs, by first arrival

    def __post_init__(self) -> None:
        self.weights = {DEFAULT: 1, BACKGROUND: 1, **self.weights}

    def classify(self, role: str, job: str, declared: int) -> tuple[str, int]:
        """(class, weight) of a request from a connection of ``role`` that named ``job``
        with weight ``declared`` (0: none) in its handshake."""
        if role == auth.ROLE_MAINTENANCE:
            return BACKGROUND, self.weights[BACKGROUND]
        if not job or job in RESERVED:
            return DEFAULT, self.weights[DEFAULT]
        weight = self.weights.get(job)
        if weight is not None:
            return job, weight
        if job not in self.met:
            if len(self.met) >= MAX_JOBS:
                return DEFAULT, self.weights[DEFAULT]
            self.met[job] = 0
        weight = min(max(declared, 1), MAX_WEIGHT) if declared else self.weights[DEFAULT]
        self.met[job] = weight
        return job, weight

    def classes(self) -> dict[str, int]:
        """Every class known and its weight (the metrics' label values)."""
        return {**self.met, **self.weights}


class Drr:
    """Deficit round robin over per-class FIFO queues: pure, no I/O, no clock.

    ``push`` queues an item with its cost (bytes); ``pop`` returns the next item to serve,
    or None when nothing waits. ``remove`` takes back an item no longer wanted (a request
    cancelled while it waited)."""

    def __init__(self, quantum: int = QUANTUM) -> None:
        if quantum < 1:
            raise ValueError("quantum must be positive")
        self.quantum = quantum
        self._queues: dict[str, collections.deque[tuple[Any, int]]] = {}
        self._weights: dict[str, int] = {}
        self._deficit: dict[str, int] = {}
        self._active: collections.deque[str] = collections.deque()  # classes with items
        self._credited = False  # the class at the front got its quantum on this visit
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def queued(self, cls: str) -> int:
        q = self._queues.get(cls)
        return 0 if q is None else len(q)

    def push(self, cls: str, weight: int, item: Any, cost: int) -> None:
        if weight < 1:
            raise ValueError("weight must be at least 1")
        q = self._queues.get(cls)
        if q is None:
            q = self._queues[cls] = collections.deque()
        if not q:
            self._active.append(cls)
            self._deficit[cls] = 0
        self._weights[cls] = weight
        q.append((item, max(cost, 0)))
        self._count += 1

    def remove(self, cls: str, item: Any) -> bool:
        """Take ``item`` out of its queue; False if it is not queued."""
        q = self._queues.get(cls)
        if not q:
            return False
        for i, (queued, _) in enumerate(q):
            if queued is item:
                del q[i]
                break
        else:
            return False
        self._count -= 1
        if not q:
            self._retire(cls)
        return True

    def _retire(self, cls: str) -> None:
        """``cls`` has nothing queued: it leaves the round and keeps no credit (a class
        that was idle cannot save up turns)."""
        if self._active and self._active[0] == cls:
            self._active.popleft()
            self._credited = False
        else:
            self._active.remove(cls)
        self._deficit[cls] = 0

    def pop(self) -> Any | None:
        while self._active:
            cls = self._active[0]
            q = self._queues[cls]
            if not self._credited:
                self._deficit[cls] += self.quantum * self._weights[cls]
                self._credited = True
            item, cost = q[0]
            if cost <= self._deficit[cls]:
                self._deficit[cls] -= cost
                q.popleft()
                self._count -= 1
                if not q:
                    self._retire(cls)
                return item
            self._active.rotate(-1)  # its credit does not cover its head: next class
            self._credited = False
        return None


class _Waiter:
    __slots__ = ("cls", "cost", "granted", "task")

    def __init__(self, cls: str, cost: int, task: trio.lowlevel.Task) -> None:
        self.cls = cls
        self.cost = cost
        self.task = task
        self.granted = False


@dataclass
class ClassStats:
    """Per class: requests waiting now, requests and bytes gone to the disk so far."""

    queued: int = 0
    served: int = 0
    served_bytes: int = 0


class FairAdmission:
    """At most ``slots`` requests at once; the rest wait and are admitted in DRR order.

    ``async with admission.slot(cls, weight, cost):`` waits for a slot. A request that
    finds a slot free and nobody waiting goes at once (no scheduler work on an idle store).
    With a ``rate``, a request is also admitted no sooner than the rate allows after the one
    before, and ``pace`` (a task of the server's nursery) admits the waiting ones as their
    times come: the wait is in the fair queue, never in a slot already granted, so the order
    of the bytes that go to the disk is the queue's.
    """

    def __init__(self, slots: int, *, quantum: int = QUANTUM, rate: float | None = None) -> None:
        if slots < 1:
            raise ValueError("an admission needs at least one slot")
        if rate is not None and not rate > 0:
            raise ConfigError("a rate must be positive")
        self.slots = slots
        self.rate = rate
        self.busy = 0
        self._drr = Drr(quantum)
        self.stats: dict[str, ClassStats] = collections.defaultdict(ClassStats)
        self._next_start = 0.0  # pacing: when the next request may be admitted
        self._kick = trio.Event()  # pacing: a waiter came or a slot freed

    @property
    def waiting(self) -> int:
        return len(self._drr)

    def _due(self) -> bool:
        return self.rate is None or trio.current_time() >= self._next_start

    def _admit(self, cls: str, cost: int) -> None:
        self.busy += 1
        st = self.stats[cls]
        st.served += 1
        st.served_bytes += cost
        if self.rate is not None:
            self._next_start = max(trio.current_time(), self._next_start) + cost / self.rate

    @asynccontextmanager
    async def slot(self, cls: str, weight: int, cost: int) -> AsyncIterator[None]:
        await trio.lowlevel.checkpoint_if_cancelled()
        if self.busy < self.slots and not self._drr and self._due():
            self._admit(cls, cost)
        else:
            await self._wait(cls, weight, cost)
        try:
            yield
        finally:
            self.busy -= 1
            self._grant()

    async def _wait(self, cls: str, weight: int, cost: int) -> None:
        waiter = _Waiter(cls, cost, trio.lowlevel.current_task())
        self._drr.push(cls, weight, waiter, cost)
        self.stats[cls].queued += 1
        self._kick.set()

        def abort(_: Any) -> trio.lowlevel.Abort:
            if waiter.granted:
                return trio.lowlevel.Abort.FAILED  # already rescheduled with its slot
            self._drr.remove(cls, waiter)
            self.stats[cls].queued -= 1
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    def _grant(self) -> None:
        while self.busy < self.slots and self._due():
            waiter = self._drr.pop()
            if waiter is None:
                return
            waiter.granted = True
            self.stats[waiter.cls].queued -= 1
            self._admit(waiter.cls, waiter.cost)
            trio.lowlevel.reschedule(waiter.task, outcome.Value(None))
        self._kick.set()

    async def pace(self) -> None:
        """With a rate: admit waiting requests as their times come (run until cancelled)."""
        if self.rate is None:
            return
        while True:
            if self._drr and self.busy < self.slots:
                await trio.sleep_until(self._next_start)
                self._grant()
            else:
                self._kick = trio.Event()
                await self._kick.wait()
