"""The metrics of an RPC server (``tectonic_py.core.rpc_server``): every op's answers by
result and its duration, observed at the one point every request passes (the handler table,
so the items of a metadata ``batch`` count as the ops they are), and the server's own
``ServerStats`` (connections, bytes, admission refusals) read at scrape time.

``result`` is ``ok`` or the error's wire code (``TectonicError.code``: a fixed set), and
``internal`` for a bug; ``op`` is one of the server's declared ops. Both are bounded.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Protocol

import trio
from prometheus_client.core import Metric

from tectonic_py.core.errors import TectonicError
from tectonic_py.core.metrics import Metrics, counter, gauge

Handler = Callable[[Any], Awaitable[Any]]


class _Stats(Protocol):
    """What this module reads of ``rpc_server.ServerStats``."""

    connections: int
    requests_in_flight: int
    payload_bytes_held: int
    payload_waiters: int
    bytes_in: int
    bytes_out: int
    auth_failures: int
    protocol_errors: int
    busy_refusals: int


def result_of(exc: BaseException) -> str:
    """The ``result`` label of a failed op (its wire code: the same set the wire carries)."""
    return exc.code if isinstance(exc, TectonicError) else "internal"


class RpcMetrics:
    """Per-op counts and latencies of one server, named ``{prefix}_operations_total`` and
    ``{prefix}_operation_duration_seconds``."""

    def __init__(self, metrics: Metrics, prefix: str, what: str) -> None:
        self.metrics = metrics
        self.prefix = prefix
        self.what = what
        self.ops = metrics.counter(
            f"{prefix}_operations_total",
            f"{what} requests answered, by op and result (ok, or the error's wire code)",
            ["op", "result"],
        )
        self.duration = metrics.histogram(
            f"{prefix}_operation_duration_seconds",
            f"Seconds a {what} handler took to answer, by op (queueing for admission"
            " included, sending the reply not)",
            ["op"],
        )

    def wrap_all(self, handlers: Mapping[str, Handler]) -> dict[str, Handler]:
        """The table with every handler timed and counted; unchanged when metrics are off."""
        if not self.metrics.enabled:
            return dict(handlers)
        return {op: self._wrap(op, h) for op, h in handlers.items()}

    def _wrap(self, op: str, handler: Handler) -> Handler:
        ok = self.ops.labels(op, "ok")
        seconds = self.duration.labels(op)
        ops = self.ops

        async def timed(request: Any) -> Any:
            start = time.perf_counter()
            try:
                reply = await handler(request)
            except trio.Cancelled:
                raise
            except BaseException as e:
                seconds.observe(time.perf_counter() - start)
                ops.labels(op, result_of(e)).inc()
                raise
            seconds.observe(time.perf_counter() - start)
            ok.inc()
            return reply

        return timed

    def watch(self, stats: _Stats) -> None:
        """The server's ``ServerStats`` as families, read at each scrape."""
        p, what = self.prefix, self.what

        def collect() -> Iterable[Metric]:
            yield gauge(f"{p}_connections", f"Open connections to the {what}", stats.connections)
            yield gauge(
                f"{p}_requests_in_flight",
                f"Requests the {what} is handling now",
                stats.requests_in_flight,
            )
            yield gauge(
                f"{p}_payload_held_bytes",
                f"Bytes of request payloads the {what} holds in memory (its payload budget)",
                stats.payload_bytes_held,
            )
            yield gauge(
                f"{p}_payload_waiters",
                f"Requests waiting for the {what}'s payload budget",
                stats.payload_waiters,
            )
            yield counter(
                f"{p}_received_bytes_total",
                f"Bytes of requests the {what} received (frames)",
                stats.bytes_in,
            )
            yield counter(
                f"{p}_sent_bytes_total", f"Bytes of replies the {what} sent", stats.bytes_out
            )
            yield counter(
                f"{p}_admission_refusals_total",
                f"Requests the {what} refused with busy: payload budget and queue full",
                stats.busy_refusals,
            )
            yield counter(
                f"{p}_auth_failures_total",
                f"Connections to the {what} that failed the handshake",
                stats.auth_failures,
            )
            yield counter(
                f"{p}_protocol_errors_total",
                f"Connections the {what} closed for a frame it could not trust",
                stats.protocol_errors,
            )

        self.metrics.collector(collect)
