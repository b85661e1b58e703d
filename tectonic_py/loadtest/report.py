"""How a run is shown: a live progress bar while it runs (stderr), the summary table, the
creates table (per write step and overall), and the plot (throughput over time,
completion-time CDF) next to the JSON results."""

from __future__ import annotations

import logging
import os
from typing import Any

from tectonic_py.core.units import format_size

log = logging.getLogger(__name__)


class ProgressBar:
    """A rich progress bar on stderr, or nothing."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.progress: Any = None
        self.task: Any = None

    def start(self, label: str, total: int) -> None:
        if not self.enabled:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TimeElapsedColumn,
            TransferSpeedColumn,
        )

        self.progress = Progress(
            "[bold]{task.description}",
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=False,
        )
        self.progress.start()
        self.task = self.progress.add_task(label, total=total)

    def update(self, completed: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=completed)

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def summary_table(result: dict[str, Any]) -> Any:
    """The summary as a rich Table."""
    from rich.table import Table

    table = Table(title=f"tectonic loadtest: {result['ranks']} ranks, {result['mode']}")
    table.add_column("figure")
    table.add_column("value", justify="right")

    def row(name: str, value: str) -> None:
        table.add_row(name, value)

    row("errors", str(result["errors"]))
    row(
        "bytes written / verified",
        f"{format_size(result['bytes_written'])} / {format_size(result['bytes_verified'])}",
    )
    row("write GB/s (aggregate)", f"{result['write_gbps']:.3f}")
    row("read GB/s (aggregate)", f"{result['read_gbps']:.3f}")
    row("GPU pause (s, worst step)", f"{result['pause_s']:.3f}")
    row(
        "rank write p50/p90/p99/max (s)",
        "/".join(
            f"{result[k]:.3f}"
            for k in (
                "rank_write_p50_s",
                "rank_write_p90_s",
                "rank_write_p99_s",
                "rank_write_max_s",
            )
        ),
    )
    row("restore (s)", f"{result['restore_s']:.3f}")
    call = _call_label(result)
    row("files created (write bursts)", str(result.get("files_created", 0)))
    row("creates/s (files / burst wall time)", _num(result.get("creates_per_s"), 1))
    row(f"{call} ms p50/p99/max", _open_ms(result.get("open_ms")))
    row(f"share of rank time in {call}", _share(result.get("open_share")))
    row(
        "creates/s to the last create returned",
        _num(result.get("creates_per_s_until_last_open"), 0),
    )
    row("metadata ops", str(result["metadata_ops"]))
    for key in ("cpu_s_per_gib_write", "cpu_s_per_gib_read"):
        v = result[key]
        row(key.replace("_", " "), "-" if v is None else f"{v:.2f}")
    roles = result.get("cpu_s_by_role_write") or {}
    row("write CPU-s by role", ", ".join(f"{k} {v:.1f}" for k, v in roles.items()))
    for key, label in (
        ("cpu_ms_per_file", "CPU ms per file (less one stream's)"),
        ("cpu_ms_per_file_gross", "CPU ms per file (gross)"),
        ("chunk_puts_per_file", "chunk puts per file"),
    ):
        v = result.get(key)
        row(label, "-" if v is None else f"{v:.2f}")
    stream = result.get("baseline_stream")
    if stream:
        ratio = result.get("pause_over_stream")
        row(
            "one stream of the same bytes: s / CPU-s",
            f"{stream['seconds']:.3f} / {stream['cpu_s']:.2f}",
        )
        row("pause / stream time", "-" if ratio is None else f"{ratio:.2f}")
    batches = result.get("metadata_batches")
    if batches:
        mean = batches["mean_batch"]
        row(
            "metadata group commits: batches / mean / largest",
            f"{batches['batches']} / {'-' if mean is None else f'{mean:.1f}'}"
            f" / {batches['largest_batch']}",
        )
    coalesced = result.get("client_batches_write")
    if coalesced:
        mean = coalesced["mean"]
        row(
            "metadata calls coalesced (write): batches / calls / mean",
            f"{coalesced['batches']} / {coalesced['ops']} / {'-' if mean is None else f'{mean:.1f}'}",
        )
    conns = result.get("max_conns_per_store")
    if conns is not None:
        row("connections per store per worker (max)", str(conns))
    row(
        "peak RSS worker / watched",
        f"{format_size(result['worker_max_rss'])} / {format_size(result['watched_max_rss'])}",
    )
    return table


CALL_LABELS = {"open(O_CREAT|O_TRUNC)": "open()", "client.create": "client.create"}
CALL_NOTES = {
    "open(O_CREAT|O_TRUNC)": "open(O_CREAT|O_TRUNC) timed in each rank's thread, apart from "
    "write/fsync/close",
    "client.create": "no open() without a mount: the client's create call (resolve + metadata "
    "create) timed on the worker's trio loop",
}
MAX_STEP_ROWS = 20  # more steps: the first and last half of these, the rest in --json


def _call_label(result: dict[str, Any]) -> str:
    return CALL_LABELS.get(str(result.get("create_call")), "create")


def _num(v: float | None, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _share(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _open_ms(v: dict[str, float] | None) -> str:
    return "-" if v is None else "/".join(f"{v[k]:.2f}" for k in ("p50", "p99", "max"))


def creates_table(result: dict[str, Any]) -> Any:
    """Files created per write step and overall: creates/s over the burst's wall time, the
    create call's times and the share of the ranks' time spent inside it."""
    from rich.table import Table

    call = _call_label(result)
    table = Table(
        title=f"creates: {call} per write step",
        caption=CALL_NOTES.get(str(result.get("create_call")), ""),
    )
    for name in (
        "step",
        "files created",
        "wall s",
        "creates/s",
        f"{call} ms p50",
        "p99",
        "max",
        f"share in {call}",
    ):
        table.add_column(name, justify="right")

    def add(label: str, fig: dict[str, Any], seconds: float | None) -> None:
        ms = fig.get("open_ms")
        table.add_row(
            label,
            str(fig.get("files_created", 0)),
            _num(seconds, 3),
            _num(fig.get("creates_per_s"), 1),
            *(("-",) * 3 if ms is None else (f"{ms[k]:.2f}" for k in ("p50", "p99", "max"))),
            _share(fig.get("open_share")),
        )

    writes = [p for p in result.get("phases", []) if p.get("phase") == "write"]
    shown = writes
    if len(writes) > MAX_STEP_ROWS:
        half = MAX_STEP_ROWS // 2
        shown = writes[:half] + writes[-half:]
    for i, p in enumerate(shown):
        if len(shown) < len(writes) and i == MAX_STEP_ROWS // 2:
            table.add_row(f"({len(writes) - len(shown)} more in --json)", *([""] * 7))
        add(str(p["step"]), p, p.get("seconds"))
    add("all", result, sum(p["seconds"] for p in writes) if writes else None)
    return table


def _rate_series(points: list[tuple[float, int]]) -> tuple[list[float], list[float]]:
    """Cumulative (time, bytes) samples from many workers -> GB/s on an even grid."""
    if len(points) < 2:
        return [], []
    start, end = points[0][0], points[-1][0]
    width = max(0.05, (end - start) / 40)
    xs: list[float] = []
    ys: list[float] = []
    i, last_bytes, t = 0, points[0][1], start
    while t < end:
        t_next = t + width
        value = last_bytes
        while i < len(points) and points[i][0] <= t_next:
            value = points[i][1]
            i += 1
        xs.append(t_next)
        ys.append(max(0, value - last_bytes) / width / 1e9)
        last_bytes, t = value, t_next
    return xs, ys


def write_plot(result: dict[str, Any], path: str | os.PathLike[str]) -> bool:
    """Throughput over time (per phase) and the per-rank completion-time CDF, as a PNG.

    matplotlib is an optional extra (``tectonic-py[bench]``): without it there is no plot,
    False is returned and the caller says so in one line; the JSON holds the same series.
    """
    try:
        import matplotlib
    except ImportError:
        log.info("matplotlib is not installed: no plot")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    by_phase: dict[str, list[tuple[float, int]]] = {}
    for t, ph, b in result["timeline"]:
        by_phase.setdefault(ph, []).append((t, b))
    for ph, points in by_phase.items():
        xs, ys = _rate_series(sorted(points))
        if xs:
            ax1.plot(xs, ys, label=ph)
    ax1.set_xlabel("seconds since start")
    ax1.set_ylabel("GB/s")
    ax1.set_title("aggregate throughput over time")
    ax1.legend(fontsize="small")
    for phase in ("write", "read"):
        times = result["rank_times"][phase]
        if times:
            ys = [(i + 1) / len(times) for i in range(len(times))]
            ax2.plot(times, ys, label=phase)
    ax2.set_xlabel("seconds after burst start")
    ax2.set_ylabel("fraction of ranks done")
    ax2.set_title(f"per-rank completion CDF ({result['ranks']} ranks)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
