"""A process's metrics: its own prometheus_client registry and the families its parts
declare on it (names and units: docs/metrics.md; the exposition is served by
``tectonic_py.core.metrics_http``).

Why a registry per ``Metrics`` rather than prometheus_client's global one: the tests run
several daemons in one process, and each endpoint must show its own process's numbers only.

Why ``Metrics.off()``: a process started without ``--metrics-listen`` should pay nothing,
not even a lock per observation; its families are null objects and its collectors are never
called, so ``bench/bench_metrics.py`` compares instrumented against untouched code paths.

Counters that a part keeps anyway (the client's ``ClientStats``, the RPC server's
``ServerStats``, the maintenance ``Counters``) are not counted twice: a collector reads them
when Prometheus scrapes (``Metrics.collector``), so the hot path does no extra work. Only
latencies, which need buckets, are observed as they happen. A gauge that needs I/O to be
true (disk free, degraded blocks) is refreshed by an ``on_scrape`` hook just before the
exposition is made, so it is as fresh as the scrape.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import trio
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest

log = logging.getLogger(__name__)

PREFIX = "tectonic_"

# Seconds: from a loopback RPC (sub-millisecond) to a stalled disk or a hedged chunk.
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

# How long the ``on_scrape`` hooks may take before the exposition goes out without them.
REFRESH_TIMEOUT_S = 5.0


class _Null:
    """Stands in for every family of a process without metrics: each call does nothing."""

    def labels(self, *args: Any, **kwargs: Any) -> _Null:
        return self

    def inc(self, amount: float = 1) -> None:
        pass

    def dec(self, amount: float = 1) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def observe(self, value: float) -> None:
        pass


_NULL = _Null()

Collect = Callable[[], Iterable[Metric]]


class _Collector:
    """A custom collector over a callable (prometheus_client calls ``collect`` per scrape)."""

    def __init__(self, collect: Collect) -> None:
        self._collect = collect

    def collect(self) -> Iterable[Metric]:
        return self._collect()

    def describe(self) -> Iterable[Metric]:
        return ()  # (no collect at registration: what it reads may not exist yet)


class Metrics:
    """One process's (or, in tests, one daemon object's) metric families."""

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled
        if enabled:
            # (process-wide in prometheus_client: ``_created`` series are noise to a scraper)
            disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        self._hooks: list[Callable[[], Awaitable[object]]] = []

    @classmethod
    def off(cls) -> Metrics:
        return cls(enabled=False)

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        if not self.enabled:
            return cast(Counter, _NULL)
        return Counter(name, doc, list(labels), registry=self.registry)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        if not self.enabled:
            return cast(Gauge, _NULL)
        return Gauge(name, doc, list(labels), registry=self.registry)

    def histogram(
        self,
        name: str,
        doc: str,
        labels: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> Histogram:
        if not self.enabled:
            return cast(Histogram, _NULL)
        return Histogram(name, doc, list(labels), registry=self.registry, buckets=buckets)

    def collector(self, collect: Collect) -> None:
        """Families made at scrape time from counters kept elsewhere."""
        if self.enabled:
            self.registry.register(_Collector(collect))

    def on_scrape(self, hook: Callable[[], Awaitable[object]]) -> None:
        """An async refresh run before each exposition (bounded by REFRESH_TIMEOUT_S)."""
        if self.enabled:
            self._hooks.append(hook)

    async def refresh(self) -> None:
        """Run the scrape hooks side by side; one that fails or is slow leaves its gauges
        as they were, logged, rather than failing the whole scrape."""

        async def one(hook: Callable[[], Awaitable[object]]) -> None:
            try:
                await hook()
            except Exception:
                log.warning("metrics: a scrape hook failed", exc_info=True)

        with trio.move_on_after(REFRESH_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                for hook in self._hooks:
                    nursery.start_soon(one, hook)

    def exposition(self) -> bytes:
        """The text format (0.0.4) of every family, as Prometheus scrapes it."""
        return generate_latest(self.registry)


def counter(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> Metric:
    """A counter family of one sample, for collectors (``name`` ends in ``_total``)."""
    family = CounterMetricFamily(name, doc, labels=list(labels or {}))
    family.add_metric(list((labels or {}).values()), value)
    return family


def gauge(name: str, doc: str, value: float) -> Metric:
    """A gauge family of one sample, for collectors."""
    return GaugeMetricFamily(name, doc, value=value)


def labelled_counter(name: str, doc: str, label: str, values: Mapping[str, float]) -> Metric:
    """A counter family with one label, a sample per value of it."""
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([key], value)
    return family
