"""The coordinator: starts the worker processes, runs the bursts step by step, and always
stops what it started.

A step is: make the step's directory, a ``write`` phase (every rank at once, after a
barrier), the step's ``.metadata`` index (written by the coordinator once every rank has
closed, as DCP's rank 0 does after its gather), then, with ``keep_last``, the removal of the
steps that fell out of the window: through the client library by the cluster's own retention
(the run directory gets a policy, ``tectonic retention set``, and the coordinator runs its
pass after each step, as the maintenance daemon does after a commit: one transaction renames
the old steps out of sight, metadata/retention_ops.py); through a mount by removing the tree. After the last step the ``read`` phase restores it and
every rank checks its bytes against the index.

A barrier starts each phase: the coordinator sends every worker a start time a little in the
future (wall clock, one machine), so all ranks begin together and a worker that is late is
charged to the pause, as a slow node would be.

With ``baseline_stream``, after the last write burst one more worker writes the same total
bytes as one file (``tectonic put``'s path through the client library), measured as a phase
of its own: the burst's per-file cost and its pause are reported beside that stream.

CPU: each phase samples the local cluster's daemons (``loadtest.daemons``) and the watched
PIDs by role, before and after; a write phase also samples the metadata shards' group-commit
counters (``server.stats``).

Bounded: ``max_seconds`` stops the run (workers killed by PID, the run reported as failed)
if the storage hangs, and what was written is removed unless ``keep`` (also after a stop).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import asdict, dataclass, replace
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
from tectonic_py.loadtest.daemons import Daemons, find_daemons
from tectonic_py.loadtest.lines import JsonLines, encode
from tectonic_py.loadtest.metrics import (
    CpuMeter,
    Recorder,
    phase_figures,
    shard_delta,
    shard_totals,
)
from tectonic_py.loadtest.report import ProgressBar

log = logging.getLogger(__name__)

CLEANUP_TIMEOUT_S = 120
# The group-commit counters are a figure, asked of every metadata server around a write
# phase: a server killed during the burst would hold them up for the client's whole
# reconnect deadline (60 s), so past this they are left out, as on any other failure.
SHARD_STATS_WAIT_S = 10.0


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
    async with open_client(cfg.cluster()) as client:
        daemons = await find_daemons(client, cfg.cluster_file) if cfg.daemon_cpu else Daemons()
        return await _Run(cfg, ClientBackend(client), progress, daemons, client.meta).run()


class _Run:
    """One run: its workers, what it measured, and the backend for the coordinator's own
    metadata work (directories, the ``.metadata`` index, deletes)."""

    def __init__(
        self,
        cfg: LoadtestConfig,
        backend: Any,
        show_progress: bool,
        daemons: Daemons | None = None,
        meta: Any = None,
    ) -> None:
        self.cfg = cfg
        self.backend = backend
        self.meta = meta  # the metadata client, for ``server.stats`` (None through a mount)
        self.run_dir_id: int | None = None  # the run directory, once it has its policy
        n = cfg.worker_count()
        self.assignment = [list(range(i, cfg.ranks, n)) for i in range(n)]
        self.shard_bytes = sum(shard_size(cfg, r) for r in range(cfg.ranks))
        self.workers: list[_Worker] = []
        self.rec = Recorder(cfg)
        daemons = daemons or Daemons()
        self.rec.daemons = daemons.describe()
        self.store_addresses = set(daemons.addresses.get("chunkstore", []))
        own = set(daemons.all_pids())
        self.meters = {role: CpuMeter(pids) for role, pids in daemons.pids.items()}
        self.meters["watched"] = CpuMeter(p for p in cfg.watch_pids if p not in own)
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
            watched_max_rss=max(m.max_rss() for m in self.meters.values()),
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
            if cfg.baseline_stream:
                await self._baseline_stream()
        if cfg.restore or cfg.verify_only:
            files = index.get("files", {})
            expected = {int(r): [f["size"], f["crc32c"]] for r, f in files.items()}
            await self._phase("read", cfg.steps, expected)
        await self._stop_workers()

    async def _write_step(self, step: int) -> dict[str, Any]:
        """One checkpoint: the burst, its index, and the removal of the step now too old."""
        cfg = self.cfg
        await self._metadata(self.backend.makedirs, step_dir(cfg, step))
        if cfg.reserve:  # fails here, before the burst, when the step cannot fit
            await self._metadata(
                self.backend.reserve, step_dir(cfg, step), self.shard_bytes, cfg.max_seconds
            )
        if cfg.keep_last and self.meta is not None and self.run_dir_id is None:
            attrs = await self.backend.client.stat(cfg.run_dir)
            await self.meta.set_retention(attrs.id, cfg.keep_last, cfg.run_dir)
            self.run_dir_id = attrs.id
        await self._phase("write", step)
        if cfg.reserve:
            await self._metadata(self.backend.release, step_dir(cfg, step))
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
            t = time.perf_counter()
            if self.run_dir_id is not None:
                names = await self.meta.apply_retention(self.run_dir_id)
                gone = sorted(int(n.rsplit("_", 1)[1]) for n in names)
            else:
                gone = [step - cfg.keep_last]
                await self.backend.remove_tree(step_dir(cfg, gone[0]))
            self.rec.delete_seconds += time.perf_counter() - t
            self.rec.deleted_steps.extend(gone)
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
        stats0 = await self._shard_stats() if phase == "write" else None
        figures, results = await self._measured(self.workers, phase, step, expected)
        if stats0 is not None:
            stats1 = await self._shard_stats()
            if stats1 is not None:
                delta = shard_delta(stats0, stats1)
                figures["shard_stats"] = delta
                self.rec.shard_stats.append({"step": step, **delta})
        self.rec.add_phase(figures, results)

    async def _measured(
        self,
        workers: list[_Worker],
        phase: str,
        step: int,
        expected: dict[int, list[int]] | None = None,
    ) -> tuple[dict[str, Any], list[RankResult]]:
        """One phase on ``workers``: its figures (CPU of every process by role included)."""
        t0 = time.time() + START_DELAY
        cpu0 = {role: m.sample() for role, m in self.meters.items()}
        own0 = time.process_time()
        self.bar.start(f"{phase} step {step}", sum(sum(map(self._size, w.ranks)) for w in workers))
        for w in workers:
            w.bytes_done = 0
            cmd: dict[str, Any] = {"cmd": phase, "step": step, "t0": t0}
            if phase == "read":
                wanted = expected or {}
                cmd["expected"] = {str(r): wanted[r] for r in w.ranks if r in wanted}
            await w.send(cmd)
        done = await self._collect(workers, f"{phase}:{step}")
        self.bar.stop()
        cpu = {role: m.sample() - cpu0[role] for role, m in self.meters.items()}
        cpu["coordinator"] = time.process_time() - own0
        results = [RankResult(**r) for m in done for r in m["ranks"]]
        for w, m in zip(workers, done, strict=True):
            w.max_rss = max(w.max_rss, int(m["rss"]))
            for address, n in m.get("conns", {}).items():
                if address in self.store_addresses:
                    self.rec.store_conns[address] = max(self.rec.store_conns.get(address, 0), n)
        return phase_figures(phase, step, t0, results, done, cpu), results

    def _size(self, rank: int) -> int:
        return shard_size(self.cfg, rank)

    async def _shard_stats(self) -> dict[str, int] | None:
        """The metadata shards' group-commit counters summed (None if unavailable)."""
        if self.meta is None:
            return None
        try:
            with trio.fail_after(SHARD_STATS_WAIT_S):
                return shard_totals(await self.meta.server_stats())
        except trio.TooSlowError:
            log.warning(
                "server.stats: a metadata server did not answer in %g s: no group-commit figures",
                SHARD_STATS_WAIT_S,
            )
            return None
        except TectonicError as e:  # a figure missing, not an error of the checkpoint
            log.warning("server.stats failed (%s): no group-commit figures", e)
            return None

    async def _baseline_stream(self) -> None:
        """The same bytes as the last burst, written as one file by one more worker, in a
        phase of its own (so its CPU is counted as the burst's is), then removed."""
        cfg = replace(
            self.cfg,
            ranks=1,
            size_dist="fixed",
            shard_size=self.shard_bytes,
            run_dir=f"{self.cfg.run_dir}/baseline-stream",
        )
        await self._metadata(self.backend.makedirs, step_dir(cfg, 1))
        worker = await self._spawn(cfg, len(self.workers), [0])
        await self._ready([worker])
        try:
            figures, results = await self._measured([worker], "write", 1)
            await self._stop([worker])
        finally:
            with trio.CancelScope(shield=True):
                await self._kill([worker])
        errors = [r.error for r in results if r.error]
        self.rec.errors.extend(f"baseline stream: {e}" for e in errors)
        self.rec.baseline = {
            "bytes": figures["bytes"],
            "seconds": figures["seconds"],
            "gbps": figures["gbps"],
            "cpu_s": figures["cpu_s"],
            "cpu_s_by_role": figures["cpu_s_by_role"],
            "errors": len(errors),
        }
        await self.backend.remove_tree(cfg.run_dir)

    async def _collect(self, workers: list[_Worker], label: str) -> list[dict[str, Any]]:
        """Every worker's ``done`` message (in worker order), recording progress meanwhile."""
        done: dict[int, dict[str, Any]] = {}

        async def listen(w: _Worker) -> None:
            while True:
                msg = await w.lines.next()
                if msg is None:
                    raise ConfigError(f"loadtest worker {w.index} (pid {w.pid}) died")
                if msg["ev"] == "progress":
                    w.bytes_done = int(msg["bytes"])
                    agg = sum(x.bytes_done for x in workers)
                    self.rec.timeline.append((float(msg["t"]), label, agg))
                    self.bar.update(agg)
                elif msg["ev"] == "done":
                    done[w.index] = msg
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._sample_watched)
            async with trio.open_nursery() as listeners:
                for w in workers:
                    listeners.start_soon(listen, w)
            nursery.cancel_scope.cancel()
        return [done[w.index] for w in workers]

    async def _sample_watched(self) -> None:
        """Keep the watched processes' peak RSS current during a phase."""
        while True:
            for meter in self.meters.values():
                meter.sample()
            await trio.sleep(0.5)

    # --- workers -----------------------------------------------------------------------------

    async def _start_workers(self) -> None:
        for i, ranks in enumerate(self.assignment):
            self.workers.append(await self._spawn(self.cfg, i, ranks))
        await self._ready(self.workers)

    async def _spawn(self, cfg: LoadtestConfig, index: int, ranks: list[int]) -> _Worker:
        spec_cfg = asdict(cfg)
        spec_cfg["watch_pids"] = []
        spec = json.dumps({"cfg": spec_cfg, "ranks": ranks})
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "tectonic_py.loadtest", "--worker", spec],
            stdin=-1,
            stdout=-1,
            env=child_env(),
        )
        assert proc.stdout is not None and proc.stdin is not None
        return _Worker(index, ranks, proc, JsonLines(proc.stdout))

    @staticmethod
    async def _ready(workers: list[_Worker]) -> None:
        for w in workers:
            msg = await w.lines.next()
            if msg is None or msg.get("ev") != "ready":
                raise ConfigError(f"loadtest worker {w.index} failed to start (see its stderr)")
            w.pid = int(msg["pid"])

    async def _stop_workers(self) -> None:
        await self._stop(self.workers)

    @staticmethod
    async def _stop(workers: list[_Worker]) -> None:
        """Ask every worker to exit; keep its own CPU and peak RSS report."""
        for w in workers:
            await w.send({"cmd": "exit"})
        for w in workers:
            msg = await w.expect("bye")
            if msg is not None:
                w.cpu_s = float(msg["cpu_s"])
                w.max_rss = max(w.max_rss, int(msg["max_rss"]))
            await w.proc.wait()

    async def _kill_workers(self) -> None:
        await self._kill(self.workers)

    @staticmethod
    async def _kill(workers: list[_Worker]) -> None:
        for w in workers:
            if w.proc.returncode is None:
                w.proc.kill()  # only our own worker, by its PID
                await w.proc.wait()

    async def _cleanup(self) -> None:
        if self.cfg.keep or self.cfg.verify_only:
            return
        with trio.move_on_after(CLEANUP_TIMEOUT_S):
            try:
                if self.run_dir_id is not None:
                    await self.meta.remove_retention(self.run_dir_id)
                await self.backend.remove_tree(self.cfg.run_dir)
            except (TectonicError, OSError) as e:
                self.rec.errors.append(f"cleanup of {self.cfg.run_dir} failed: {e}")


def _leaves(group: BaseException) -> list[BaseException]:
    if isinstance(group, BaseExceptionGroup):
        return [leaf for e in group.exceptions for leaf in _leaves(e)]
    return [group]
