"""The coordinator: starts the worker processes, runs the bursts step by step, and always
stops what it started.

A step is: make the step's directory, a ``write`` phase (every rank at once, after a
barrier), the step's ``.metadata`` index (written by the coordinator once every rank has
closed, as DCP's rank 0 does after its gather), then, with ``keep_last``, the removal of the
step that fell out of the window. After the last step the ``read`` phase restores it and
every rank checks its bytes against the index.

A barrier starts each phase: the coordinator sends every worker a start time a little in the
future (wall clock, one machine), so all ranks begin together and a worker that is late is
charged to the pause, as a slow node would be.

Bounded: ``max_seconds`` stops the run (workers killed by PID, the run reported as failed)
if the storage hangs, and what was written is removed unless ``keep`` (also after a stop).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import trio

from tectonic_py.core.errors import ConfigError, TectonicError
from tectonic_py.core.process_env import child_env
from tectonic_py.loadtest.backends import ClientBackend, MountBackend
from tectonic_py.loadtest.config import (
    START_DELAY,
    LoadtestConfig,
    RankResult,
    shard_size,
    step_dir,
)
from tectonic_py.loadtest.lines import JsonLines, encode
from tectonic_py.loadtest.metrics import CpuMeter, Recorder, phase_figures
from tectonic_py.loadtest.report import ProgressBar

CLEANUP_TIMEOUT_S = 120


@dataclass
class _Worker:
    index: int
    ranks: list[int]
    proc: Any
    lines: JsonLines
    pid: int = 0
    bytes_done: int = 0
    cpu_s: float = 0.0
    max_rss: int = 0

    async def send(self, cmd: dict[str, Any]) -> None:
        await self.proc.stdin.send_all(encode(cmd))

    async def expect(self, event: str) -> dict[str, Any] | None:
        """Skip messages until ``event`` (None if the worker's stdout ended first)."""
        msg = await self.lines.next()
        while msg is not None and msg.get("ev") != event:
            msg = await self.lines.next()
        return msg


async def run_loadtest(cfg: LoadtestConfig, *, progress: bool = False) -> dict[str, Any]:
    """Run the whole load test and return its results (the ``--json`` object)."""
    cfg.validate()
    if cfg.through_mount:
        return await _Run(
            cfg, MountBackend(cfg.through_mount, trio.CapacityLimiter(8)), progress
        ).run()
    from tectonic_py.client.tectonic_client import open_client

    assert cfg.cluster_file is not None
    async with open_client(cfg.cluster_file) as client:
        return await _Run(cfg, ClientBackend(client), progress).run()


class _Run:
    """One run: its workers, what it measured, and the backend for the coordinator's own
    metadata work (directories, the ``.metadata`` index, deletes)."""

    def __init__(self, cfg: LoadtestConfig, backend: Any, show_progress: bool) -> None:
        self.cfg = cfg
        self.backend = backend
        n = cfg.worker_count()
        self.assignment = [list(range(i, cfg.ranks, n)) for i in range(n)]
        self.shard_bytes = sum(shard_size(cfg, r) for r in range(cfg.ranks))
        self.workers: list[_Worker] = []
        self.rec = Recorder(cfg)
        self.watch = CpuMeter(cfg.watch_pids)
        self.bar = ProgressBar(show_progress)

    async def run(self) -> dict[str, Any]:
        try:
            with trio.move_on_after(self.cfg.max_seconds) as scope:
                try:
                    await self._body()
                except* (TectonicError, OSError) as group:
                    self.rec.errors.extend(f"{type(e).__name__}: {e}" for e in _leaves(group))
            if scope.cancelled_caught:
                self.rec.timed_out = True
                self.rec.errors.append(f"stopped after --max-seconds {self.cfg.max_seconds}")
        finally:
            self.bar.stop()
            with trio.CancelScope(shield=True):
                await self._kill_workers()
                await self._cleanup()
        return self.rec.result(
            processes=len(self.assignment),
            worker_max_rss=max((w.max_rss for w in self.workers), default=0),
            watched_max_rss=self.watch.max_rss(),
        )

    async def _body(self) -> None:
        cfg = self.cfg
        await self._start_workers()
        index: dict[str, Any] = {}
        if cfg.verify_only:
            raw = await self._metadata(self.backend.read_small, self._index_path(cfg.steps))
            index = json.loads(raw)
        else:
            for step in range(1, cfg.steps + 1):
                index = await self._write_step(step)
        if cfg.restore or cfg.verify_only:
            files = index.get("files", {})
            expected = {int(r): [f["size"], f["crc32c"]] for r, f in files.items()}
            await self._phase("read", cfg.steps, expected)
        await self._stop_workers()

    async def _write_step(self, step: int) -> dict[str, Any]:
        """One checkpoint: the burst, its index, and the removal of the step now too old."""
        cfg = self.cfg
        await self._metadata(self.backend.makedirs, step_dir(cfg, step))
        await self._phase("write", step)
        index = {
            "step": step,
            "ranks": cfg.ranks,
            "seed": cfg.seed,
            "files": self.rec.written(step),
        }
        await self._metadata(
            self.backend.write_small, self._index_path(step), json.dumps(index).encode()
        )
        if cfg.keep_last and step > cfg.keep_last:
            old = step - cfg.keep_last
            t = time.perf_counter()
            await self.backend.remove_tree(step_dir(cfg, old))
            self.rec.delete_seconds += time.perf_counter() - t
            self.rec.deleted_steps.append(old)
        return index

    def _index_path(self, step: int) -> str:
        return f"{step_dir(self.cfg, step)}/.metadata"

    async def _metadata(self, fn: Any, *args: Any) -> Any:
        """A metadata call of the coordinator's own, counted and timed."""
        t = time.perf_counter()
        result = await fn(*args)
        self.rec.meta_seconds += time.perf_counter() - t
        self.rec.meta_ops += 1
        return result

    # --- phases ------------------------------------------------------------------------------

    async def _phase(
        self, phase: str, step: int, expected: dict[int, list[int]] | None = None
    ) -> None:
        """Send the phase to every worker with one start time, collect every rank's result."""
        t0 = time.time() + START_DELAY
        watch_cpu0 = self.watch.sample()
        self.bar.start(f"{phase} step {step}", self.shard_bytes)
        for w in self.workers:
            w.bytes_done = 0
            cmd: dict[str, Any] = {"cmd": phase, "step": step, "t0": t0}
            if phase == "read":
                wanted = expected or {}
                cmd["expected"] = {str(r): wanted[r] for r in w.ranks if r in wanted}
            await w.send(cmd)
        done = await self._collect(f"{phase}:{step}")
        self.bar.stop()
        results = [RankResult(**r) for m in done for r in m["ranks"]]
        for w, m in zip(self.workers, done, strict=True):
            w.max_rss = max(w.max_rss, int(m["rss"]))
        watched = self.watch.sample() - watch_cpu0
        self.rec.add_phase(phase_figures(phase, step, t0, results, done, watched), results)

    async def _collect(self, label: str) -> list[dict[str, Any]]:
        """Every worker's ``done`` message (in worker order), recording progress meanwhile."""
        done: dict[int, dict[str, Any]] = {}

        async def listen(w: _Worker) -> None:
            while True:
                msg = await w.lines.next()
                if msg is None:
                    raise ConfigError(f"loadtest worker {w.index} (pid {w.pid}) died")
                if msg["ev"] == "progress":
                    w.bytes_done = int(msg["bytes"])
                    agg = sum(x.bytes_done for x in self.workers)
                    self.rec.timeline.append((float(msg["t"]), label, agg))
                    self.bar.update(agg)
                elif msg["ev"] == "done":
                    done[w.index] = msg
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._sample_watched)
            async with trio.open_nursery() as listeners:
                for w in self.workers:
                    listeners.start_soon(listen, w)
            nursery.cancel_scope.cancel()
        return [done[w.index] for w in self.workers]

    async def _sample_watched(self) -> None:
        """Keep the watched processes' peak RSS current during a phase."""
        while True:
            self.watch.sample()
            await trio.sleep(0.5)

    # --- workers -----------------------------------------------------------------------------

    async def _start_workers(self) -> None:
        spec_cfg = asdict(self.cfg)
        spec_cfg["watch_pids"] = []
        for i, ranks in enumerate(self.assignment):
            spec = json.dumps({"cfg": spec_cfg, "ranks": ranks})
            proc = await trio.lowlevel.open_process(
                [sys.executable, "-m", "tectonic_py.loadtest", "--worker", spec],
                stdin=-1,
                stdout=-1,
                env=child_env(),
            )
            assert proc.stdout is not None and proc.stdin is not None
            self.workers.append(_Worker(i, ranks, proc, JsonLines(proc.stdout)))
        for w in self.workers:
            msg = await w.lines.next()
            if msg is None or msg.get("ev") != "ready":
                raise ConfigError(f"loadtest worker {w.index} failed to start (see its stderr)")
            w.pid = int(msg["pid"])

    async def _stop_workers(self) -> None:
        """Ask every worker to exit; keep its own CPU and peak RSS report."""
        for w in self.workers:
            await w.send({"cmd": "exit"})
        for w in self.workers:
            msg = await w.expect("bye")
            if msg is not None:
                w.cpu_s = float(msg["cpu_s"])
                w.max_rss = max(w.max_rss, int(msg["max_rss"]))
            await w.proc.wait()

    async def _kill_workers(self) -> None:
        for w in self.workers:
            if w.proc.returncode is None:
                w.proc.kill()  # only our own worker, by its PID
                await w.proc.wait()

    async def _cleanup(self) -> None:
        if self.cfg.keep or self.cfg.verify_only:
            return
        with trio.move_on_after(CLEANUP_TIMEOUT_S):
            try:
                await self.backend.remove_tree(self.cfg.run_dir)
            except (TectonicError, OSError) as e:
                self.rec.errors.append(f"cleanup of {self.cfg.run_dir} failed: {e}")


def _leaves(group: BaseException) -> list[BaseException]:
    if isinstance(group, BaseExceptionGroup):
        return [leaf for e in group.exceptions for leaf in _leaves(e)]
    return [group]
