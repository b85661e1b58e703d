"""A load-test worker process: the ranks assigned to it, one trio task per rank.

Started by the coordinator as ``python -m tectonic_py.loadtest --worker SPEC``. It says
``ready``, then runs each phase command (``write`` or ``read`` of one step) from stdin: it
sleeps until the phase's start time (the barrier, so all ranks of all workers begin
together), runs every rank at once, streams ``progress`` (cumulative bytes) every
``PROGRESS_INTERVAL`` and ends the phase with ``done`` and every rank's ``RankResult``. On
``exit`` (or the end of stdin) it reports its own CPU and peak RSS as ``bye``.

A rank's failure is its result's ``error``, never the worker's: one slow or broken rank
must show up in the figures, not end the others.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

import trio

from tectonic_py.core.checksum import checksum
from tectonic_py.core.errors import TectonicError
from tectonic_py.loadtest.backends import ClientBackend, MountBackend
from tectonic_py.loadtest.config import (
    PIECE,
    PROGRESS_INTERVAL,
    LoadtestConfig,
    RankResult,
    rank_file,
    shard_size,
)
from tectonic_py.loadtest.data import ShardData
from tectonic_py.loadtest.lines import JsonLines, encode

log = logging.getLogger(__name__)


class _Out:
    """The worker's stdout: whole JSON lines, written under a lock."""

    def __init__(self) -> None:
        self.stream = trio.lowlevel.FdStream(os.dup(1))
        self.lock = trio.Lock()

    async def send(self, msg: dict[str, Any]) -> None:
        data = encode(msg)
        async with self.lock:
            await self.stream.send_all(data)


def _connections() -> dict[str, int]:
    """Established TCP connections of this process, counted by remote ``host:port``: the
    coordinator checks that every rank of a worker shares one connection per chunk store."""
    import psutil

    counts: dict[str, int] = {}
    try:
        conns = psutil.Process().net_connections(kind="tcp")
    except psutil.Error:
        return counts
    for c in conns:
        if c.status == psutil.CONN_ESTABLISHED and c.raddr:
            host = f"[{c.raddr.ip}]" if ":" in c.raddr.ip else c.raddr.ip
            key = f"{host}:{c.raddr.port}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def _meta_batches(backend: Any) -> dict[str, int]:
    """The metadata client's coalescing counters (batch requests, the calls they carried)
    so far; empty through a mount, whose client lives in the mount's process."""
    meta = getattr(getattr(backend, "client", None), "meta", None)
    stats = getattr(meta, "batch_stats", None)
    return dict(stats()) if stats is not None else {}


def _chunk_puts(backend: Any) -> int | None:
    """Chunk puts this process's client sent so far (stored chunks and hedges); None
    through a mount, whose client lives in the mount's process."""
    stats = getattr(getattr(backend, "client", None), "stats", None)
    if stats is None:
        return None
    return int(stats.chunks_written + stats.hedged_puts)


def _usage() -> tuple[float, int]:
    """CPU-seconds (user + system) and peak RSS in bytes of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024


class _Phase:
    """One phase (``write`` or ``read`` of one step) of this worker's ranks."""

    def __init__(
        self, cfg: LoadtestConfig, backend: Any, data: ShardData, cmd: dict[str, Any]
    ) -> None:
        self.cfg, self.backend, self.data = cfg, backend, data
        self.phase, self.step, self.t0 = cmd["cmd"], int(cmd["step"]), float(cmd["t0"])
        # read: the (size, crc32c) each rank must find, from the writers or the step's .metadata
        self.expected: dict[str, list[int]] = cmd.get("expected", {})
        self.done_bytes = 0
        self.results: list[RankResult] = []

    async def run(self, ranks: list[int], out: _Out) -> None:
        """Wait for the barrier, run every rank at once, report progress until all are done."""
        cpu0 = time.process_time()
        batches0 = _meta_batches(self.backend)
        puts0 = _chunk_puts(self.backend)
        await trio.sleep_until(trio.current_time() + max(0.0, self.t0 - time.time()))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._progress, out)
            async with trio.open_nursery() as ranks_nursery:
                for rank in ranks:
                    ranks_nursery.start_soon(self._one_rank, rank)
            nursery.cancel_scope.cancel()
        await out.send({"ev": "progress", "t": time.time(), "bytes": self.done_bytes})
        _, rss = _usage()
        batches = {k: v - batches0.get(k, 0) for k, v in _meta_batches(self.backend).items()}
        puts1 = _chunk_puts(self.backend)
        await out.send(
            {
                "ev": "done",
                "phase": self.phase,
                "step": self.step,
                "cpu_s": time.process_time() - cpu0,
                "rss": rss,
                "conns": _connections(),
                "meta_batches": batches,
                "chunk_puts": None if puts0 is None or puts1 is None else puts1 - puts0,
                "ranks": [asdict(r) for r in self.results],
            }
        )

    async def _progress(self, out: _Out) -> None:
        while True:
            await out.send({"ev": "progress", "t": time.time(), "bytes": self.done_bytes})
            await trio.sleep(PROGRESS_INTERVAL)

    async def _one_rank(self, rank: int) -> None:
        res = RankResult(rank, self.step, self.phase, shard_size(self.cfg, rank), 0.0, 0.0, 0)
        started = time.perf_counter()
        try:
            if self.phase == "write":
                await self._write(res)
            else:
                await self._read(res)
        except (TectonicError, OSError) as e:
            res.error = f"{type(e).__name__}: {e}"
        except Exception as e:  # a bug in a lower layer must show as an error, not a hang
            log.exception("rank %d %s failed", rank, self.phase)
            res.error = f"{type(e).__name__}: {e}"
        res.busy_s = time.perf_counter() - started
        res.t_done = time.time() - self.t0
        self.results.append(res)

    def _opened(self, res: RankResult) -> Any:
        """The backend's ``opened(seconds)``: when the open returned, and how long it took."""

        def opened(open_s: float) -> None:
            res.t_open = time.time() - self.t0
            res.open_s = open_s

        return opened

    async def _write(self, res: RankResult) -> None:
        """Write the rank's shard, keeping only its running checksum."""
        buf = bytearray(PIECE)
        crc = 0

        def gen() -> Iterable[memoryview]:
            nonlocal crc
            for piece in self.data.pieces(self.step, res.rank, res.size, buf):
                crc = checksum(piece, crc)
                yield piece
                self.done_bytes += len(piece)

        path = rank_file(self.cfg, self.step, res.rank)
        await self.backend.write_file(path, gen(), self._opened(res))
        res.crc = crc

    async def _read(self, res: RankResult) -> None:
        """Read the rank's shard back and check size and checksum against what was written."""
        want = self.expected.get(str(res.rank))
        want_size, want_crc = (want[0], want[1]) if want else (res.size, None)
        crc, got = 0, 0

        def sink(chunk: Any) -> None:
            nonlocal crc, got
            crc = checksum(chunk, crc)
            got += len(chunk)
            self.done_bytes += len(chunk)

        path = rank_file(self.cfg, self.step, res.rank)
        await self.backend.read_file(path, want_size, sink, self._opened(res))
        res.crc = crc
        if got != want_size:
            res.error = f"short read: {got} of {want_size} bytes"
        elif want_crc is None:
            res.error = "no checksum recorded for this shard"
        elif crc != want_crc:
            res.error = f"checksum mismatch: {crc:08x} != {want_crc:08x}"
        else:
            res.verified = got


async def _serve(cfg: LoadtestConfig, backend: Any, ranks: list[int]) -> None:
    data = ShardData(cfg.seed)
    out = _Out()
    commands = JsonLines(trio.lowlevel.FdStream(os.dup(0)))
    await out.send({"ev": "ready", "pid": os.getpid()})
    while True:
        cmd = await commands.next()
        if cmd is None or cmd["cmd"] == "exit":
            cpu_s, max_rss = _usage()
            await out.send({"ev": "bye", "cpu_s": cpu_s, "max_rss": max_rss})
            return
        await _Phase(cfg, backend, data, cmd).run(ranks, out)


async def worker_main(spec: dict[str, Any]) -> None:
    cfg = LoadtestConfig(**spec["cfg"])
    ranks: list[int] = spec["ranks"]
    if cfg.through_mount:
        limiter = trio.CapacityLimiter(max(1, len(ranks)) + 4)
        await _serve(cfg, MountBackend(cfg.through_mount, limiter), ranks)
        return
    from tectonic_py.client.tectonic_client import open_client

    assert cfg.cluster_file is not None
    async with open_client(cfg.cluster(), **cfg.client_options) as client:
        await _serve(cfg, ClientBackend(client), ranks)


def worker_entry(spec_json: str) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    trio.run(worker_main, json.loads(spec_json))
    return 0
