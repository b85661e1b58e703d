"""The FUSE layer's metrics (docs/metrics.md): every kernel request by op, its errors by op
and errno name, its duration, and the bytes ``read`` and ``write`` moved. Observed in
``errno_map.fuse_op``, the one wrapper every handler passes, so a handler added later is
counted without a line of its own. Labels are bounded: ``op`` is a handler's name,
``errno`` a name from the errno table.
"""

from __future__ import annotations

import errno as errnos
import time
from typing import Any

from tectonic_py.core.metrics import Metrics

PREFIX = "tectonic_fuse"


class FuseMetrics:
    """Families of one mount on its process's registry (beside its client's)."""

    def __init__(self, metrics: Metrics) -> None:
        self.ops = metrics.counter(
            f"{PREFIX}_operations_total", "FUSE requests answered, by op", ["op"]
        )
        self.errors = metrics.counter(
            f"{PREFIX}_errors_total",
            "FUSE requests answered with an error, by op and errno (ENOENT of a lookup is an"
            " answer, not a fault)",
            ["op", "errno"],
        )
        self.duration = metrics.histogram(
            f"{PREFIX}_operation_duration_seconds",
            "Seconds a FUSE request took in the mount, by op",
            ["op"],
        )
        self.bytes = metrics.counter(
            f"{PREFIX}_bytes_total", "Bytes moved by FUSE read and write requests, by op", ["op"]
        )
        self._children: dict[str, tuple[Any, Any, Any]] = {}

    def _of(self, op: str) -> tuple[Any, Any, Any]:
        children = self._children.get(op)
        if children is None:
            children = (self.ops.labels(op), self.duration.labels(op), self.bytes.labels(op))
            self._children[op] = children
        return children

    def done(self, op: str, started: float, result: Any) -> None:
        ops, seconds, moved = self._of(op)
        ops.inc()
        seconds.observe(time.perf_counter() - started)
        if op == "write" and isinstance(result, int):
            moved.inc(result)
        elif op == "read" and result is not None:
            moved.inc(len(result))

    def failed(self, op: str, started: float, code: int) -> None:
        ops, seconds, _ = self._of(op)
        ops.inc()
        seconds.observe(time.perf_counter() - started)
        self.errors.labels(op, errnos.errorcode.get(code, "other")).inc()
