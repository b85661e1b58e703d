"""``tectonic loadtest``: a training job's checkpoint burst, measured as the GPUs feel it.

Llama 3's checkpoints were "highly bursty": every rank saves its shard at the same moment,
the storage is saturated for a short time, and the GPUs idle until the *last* rank's close
returns. So the figure that matters is the **GPU pause** (burst start to the last close),
next to aggregate write/read GB/s, the per-rank completion times (p50/p90/p99/max),
metadata operations per second, errors (must be zero) and bytes verified on restore.

How a run goes:

* R ranks are spread over P worker processes (``python -m tectonic_py.loadtest --worker``),
  each running many trio tasks, one per rank. Every worker opens one client (client-library
  mode) or does real file I/O on a mount (``--through-mount``: blocking calls in
  ``trio.to_thread``, one thread per rank, an fsync before each close as
  torch.distributed.checkpoint does).
* Each step is a directory laid out as torch.distributed.checkpoint writes it:
  ``step_000001/__<rank>_0.distcp`` per rank plus ``.metadata`` written by the coordinator
  once every rank has closed (DCP's rank 0 does the same after its gather).
* A barrier starts each burst: the coordinator sends every worker a start time a little in
  the future (wall clock, one machine), so all ranks begin together and a worker that is
  late is charged to the pause, as a slow node would be.
* A rank's bytes are a deterministic function of (seed, step, rank): 1 MiB pieces, each a
  16-byte tag (seed, step, rank, piece) followed by a slice of a random pool at an offset
  derived from the tag. Writers keep only the crc32c; on restore every rank reads its
  shard back and every byte is checked against it (a misplaced, stale or swapped piece
  changes the checksum).
* Optionally old steps are deleted (``--keep-last N``), as trainers do, then the restore
  reads the last step. Everything written is removed at the end unless ``--keep``.

Bounded: sizes come from the arguments, and ``--max-seconds`` stops the run (workers killed
by PID, the run reported as failed) if the storage hangs.

Output: a live progress bar (stderr), a summary table, ``--json`` (one object on stdout with
at least errors, ranks, write_gbps, read_gbps, pause_s, bytes_verified), and
``loadtest-<ranks>.json`` + ``.png`` (throughput over time, completion-time CDF) in
``--results-dir``.

CPU-seconds are counted for all processes together: the workers (their own rusage), the
coordinator, and any ``--watch-pids`` (the cluster's daemons, or a peer filesystem's), per
GiB written and read. Peak RSS of workers and watched processes shows memory stays bounded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import random
import re
import resource
import shutil
import struct
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import trio

from tectonic_py.core.checksum import checksum
from tectonic_py.core.errors import ConfigError, TectonicError
from tectonic_py.core.process_env import child_env

log = logging.getLogger(__name__)

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
PIECE = MiB  # the unit of generated data and of each write call
POOL_SIZE = 8 * MiB
TAG = struct.Struct("!QIIQ")  # seed, step, rank, piece: 24 bytes
START_DELAY = 0.5  # seconds from "go" to the barrier time: enough for every worker to hear it
PROGRESS_INTERVAL = 0.2

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'4MiB' / '4M' -> 4*2**20, '1MB' -> 10**6, '123' -> 123. Binary by default; an explicit
    'B' without 'i' (MB, GB) is decimal, as the issue writes 1 MB to 4 GB."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ConfigError(f"bad size {text!r}: use e.g. 1048576, 4MiB, 1MB, 2GiB")
    number, unit, binary = float(m.group(1)), m.group(2).lower(), m.group(3)
    decimal = not binary and text.strip().lower().endswith("b") and unit != ""
    base = 1000 if decimal else 1024
    power = " kmgt".index(unit) if unit else 0
    return int(number * base**power)


# --- the deterministic data ------------------------------------------------------------------


class ShardData:
    """Generates the bytes of (seed, step, rank) piece by piece without keeping them.

    One random pool per process (from the seed); each piece is a 24-byte tag and a pool
    slice chosen by hashing the tag, so every piece of every rank and step differs.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        rng = random.Random(seed)
        pool = rng.randbytes(POOL_SIZE)
        self.pool = memoryview(pool + pool[:PIECE])  # a slice may wrap around

    def piece(self, step: int, rank: int, index: int, length: int, out: bytearray) -> memoryview:
        """Fill ``out`` with piece ``index`` (``length`` bytes) and return a view of it."""
        tag = TAG.pack(self.seed, step, rank, index)
        offset = int.from_bytes(hashlib.blake2b(tag, digest_size=8).digest(), "big") % POOL_SIZE
        view = memoryview(out)
        head = min(length, TAG.size)
        view[:head] = tag[:head]
        if length > head:
            view[head:length] = self.pool[offset : offset + length - head]
        return view[:length]

    def pieces(self, step: int, rank: int, size: int, out: bytearray) -> Iterable[memoryview]:
        for index in range(-(-size // PIECE)):
            yield self.piece(step, rank, index, min(PIECE, size - index * PIECE), out)


def shard_size(cfg: LoadtestConfig, rank: int) -> int:
    """A rank's shard size: fixed, or drawn once per rank (the same every step, as a model's
    shards are) from ``size_dist`` between ``min_size`` and ``max_size``."""
    if cfg.size_dist == "fixed":
        return cfg.shard_size
    rng = random.Random(f"{cfg.seed}/{rank}")
    lo, hi = cfg.min_size, max(cfg.min_size, cfg.max_size)
    if cfg.size_dist == "uniform":
        return rng.randint(lo, hi)
    return int(math.exp(rng.uniform(math.log(lo), math.log(hi))))  # loguniform


def step_dir(cfg: LoadtestConfig, step: int) -> str:
    return f"{cfg.run_dir}/step_{step:06d}"


def rank_file(cfg: LoadtestConfig, step: int, rank: int) -> str:
    return f"{step_dir(cfg, step)}/__{rank}_0.distcp"


# --- configuration and results ------------------------------------------------------------


@dataclass
class LoadtestConfig:
    cluster_file: str | None = None
    through_mount: str | None = None
    ranks: int = 64
    processes: int = 0  # 0: chosen from ranks
    size_dist: str = "fixed"  # fixed | uniform | loguniform
    shard_size: int = 16 * MiB
    min_size: int = 1_000_000
    max_size: int = 64 * MiB
    steps: int = 1
    keep_last: int = 0  # 0: keep all steps
    restore: bool = True
    seed: int = 1
    run_dir: str = ""
    max_seconds: float = 600.0
    keep: bool = False
    verify_only: bool = False  # read and verify step ``steps`` of an existing run (its .metadata)
    client_options: dict[str, Any] = field(default_factory=dict)  # open_client(**tuning)
    watch_pids: list[int] = field(default_factory=list)

    def validate(self) -> None:
        if (self.cluster_file is None) == (self.through_mount is None):
            raise ConfigError("give a CLUSTER_FILE or --through-mount MOUNTPOINT (one of them)")
        if self.through_mount is not None and not os.path.isdir(self.through_mount):
            raise ConfigError(f"--through-mount {self.through_mount!r} is not a directory")
        if self.cluster_file is not None and not os.path.exists(self.cluster_file):
            raise ConfigError(f"cluster file {self.cluster_file!r} not found")
        if not 1 <= self.ranks <= 65536:
            raise ConfigError("--ranks must be 1..65536")
        if not 0 <= self.processes <= 256:
            raise ConfigError("--processes must be 0 (auto) .. 256")
        if self.size_dist not in ("fixed", "uniform", "loguniform"):
            raise ConfigError("--size-dist must be fixed, uniform or loguniform")
        if not 1 <= self.shard_size <= 64 * GiB:
            raise ConfigError("--shard-size must be 1 byte .. 64 GiB")
        if not 1 <= self.min_size <= self.max_size <= 64 * GiB:
            raise ConfigError("need 1 <= --min-size <= --max-size <= 64 GiB")
        if not 1 <= self.steps <= 10000:
            raise ConfigError("--steps must be 1..10000")
        if self.keep_last < 0:
            raise ConfigError("--keep-last must be >= 0")
        if not 0 < self.max_seconds <= 86400:
            raise ConfigError("--max-seconds must be in (0, 86400]")
        if not 0 <= self.seed < 2**63:
            raise ConfigError("--seed must be 0 .. 2**63-1")
        if self.client_options:
            if self.through_mount:
                raise ConfigError("--client-opt applies to the client library, not a mount")
            import inspect

            from tectonic_py.client.tectonic_client import TectonicClient

            known = set(inspect.signature(TectonicClient.__init__).parameters) - {
                "self",
                "config",
                "meta",
                "nursery",
            }
            unknown = set(self.client_options) - known
            if unknown:
                raise ConfigError(
                    f"unknown --client-opt {sorted(unknown)}; known: {', '.join(sorted(known))}"
                )
        if not self.run_dir.startswith("/") or "//" in self.run_dir or ".." in self.run_dir:
            raise ConfigError("the run directory must be an absolute path without '..'")

    def worker_count(self) -> int:
        if self.processes:
            return min(self.processes, self.ranks)
        if self.through_mount:
            return min(self.ranks, 16)
        return max(1, min(self.ranks // 64, 8)) if self.ranks >= 64 else 1


@dataclass
class RankResult:
    rank: int
    step: int
    phase: str  # write | read
    size: int
    t_open: float  # seconds after the burst start when create/open returned
    t_done: float  # ... when close (write) or the last read (read) returned
    crc: int
    error: str | None = None
    verified: int = 0


# --- backends: the tectonic client library, or plain file I/O on a mount ---------------------


class ClientBackend:
    """Ranks through the client library: one client per worker process, shared by its ranks."""

    def __init__(self, client: Any) -> None:
        self.client = client

    async def makedirs(self, path: str) -> None:
        await self.client.mkdir(path, parents=True)

    async def write_file(self, path: str, pieces: Iterable[memoryview], opened: Any) -> None:
        w = await self.client.create(path)
        opened()
        try:
            for piece in pieces:
                await w.write(piece)
        except BaseException:
            await _abort(w)
            raise
        await w.close()

    async def read_file(self, path: str, size: int, sink: Any, opened: Any) -> None:
        r = await self.client.open_read(path)
        opened()
        try:
            offset = 0
            while offset < size:
                data = await r.pread(offset, min(PIECE, size - offset))
                if not data:
                    break
                sink(data)
                offset += len(data)
        finally:
            await _close_reader(r)

    async def remove_tree(self, path: str) -> None:
        try:
            entries = await self.client.listdir(path)
        except TectonicError as e:
            if getattr(e, "code", "") == "enoent":
                return
            raise
        for entry in entries:
            child = f"{path}/{getattr(entry, 'name', entry)}"
            st = entry if hasattr(entry, "kind") else await self.client.stat(child)
            if _is_dir(st):
                await self.remove_tree(child)
            else:
                await self.client.unlink(child)
        await self.client.rmdir(path)

    async def read_small(self, path: str) -> bytes:
        r = await self.client.open_read(path)
        try:
            return bytes(await r.read())
        finally:
            await _close_reader(r)

    async def write_small(self, path: str, data: bytes) -> None:
        w = await self.client.create(path)
        await w.write(data)
        await w.close()


def _is_dir(st: Any) -> bool:
    kind = getattr(st, "kind", None)
    if kind is not None:
        return str(getattr(kind, "value", kind)).lower() in ("dir", "directory", "d")
    mode = getattr(st, "mode", None) or getattr(st, "st_mode", None)
    if mode is not None:
        import stat as _stat

        return _stat.S_ISDIR(mode)
    return bool(getattr(st, "is_dir", False))


async def _abort(writer: Any) -> None:
    for name in ("abort", "aclose"):
        fn = getattr(writer, name, None)
        if fn is not None:
            with trio.CancelScope(shield=True):
                try:
                    await fn()
                except TectonicError as e:  # the write's own error is the one reported
                    log.debug("abort after a failed write: %s", e)
            return


async def _close_reader(reader: Any) -> None:
    for name in ("close", "aclose"):
        fn = getattr(reader, name, None)
        if fn is not None:
            result = fn()
            if hasattr(result, "__await__"):
                await result
            return


class MountBackend:
    """Ranks doing real file I/O on a mount: open/write/fsync/close as torch.distributed.checkpoint
    does, each blocking call in a worker thread (one per rank, so ranks overlap)."""

    def __init__(self, root: str, limiter: trio.CapacityLimiter) -> None:
        self.root = root
        self.limiter = limiter

    def _path(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    async def makedirs(self, path: str) -> None:
        await self._run(lambda: os.makedirs(self._path(path), exist_ok=True))

    async def write_file(self, path: str, pieces: Iterable[memoryview], opened: Any) -> None:
        fd = await self._run(
            os.open, self._path(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644
        )
        opened()
        try:
            for piece in pieces:
                view = piece
                while view:
                    n = await self._run(os.write, fd, view)
                    view = view[n:]
            await self._run(os.fsync, fd)
        finally:
            await self._run(os.close, fd)

    async def read_file(self, path: str, size: int, sink: Any, opened: Any) -> None:
        fd = await self._run(os.open, self._path(path), os.O_RDONLY | os.O_CLOEXEC)
        opened()
        # A restore follows a restart: drop what the page cache kept from the write, so the
        # read reaches the filesystem (as the client-library mode always does).
        await self._run(os.posix_fadvise, fd, 0, 0, os.POSIX_FADV_DONTNEED)
        buf = bytearray(PIECE)
        view = memoryview(buf)
        try:
            offset = 0
            while offset < size:
                n = await self._run(os.preadv, fd, [view[: min(PIECE, size - offset)]], offset)
                if not n:
                    break
                sink(view[:n])
                offset += n
        finally:
            await self._run(os.close, fd)

    async def remove_tree(self, path: str) -> None:
        await self._run(lambda: shutil.rmtree(self._path(path), ignore_errors=True))

    async def read_small(self, path: str) -> bytes:
        def read() -> bytes:
            with open(self._path(path), "rb") as f:
                return f.read()

        return bytes(await self._run(read))

    async def write_small(self, path: str, data: bytes) -> None:
        """Write then rename, as DCP writes ``.metadata`` (``.metadata.tmp`` then rename)."""

        def write() -> None:
            target = self._path(path)
            tmp = target + ".tmp"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, target)

        await self._run(write)


# --- the worker process --------------------------------------------------------------------


class _Lines:
    """Newline-delimited JSON over a trio stream."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.buf = bytearray()

    async def next(self) -> dict[str, Any] | None:
        while True:
            i = self.buf.find(b"\n")
            if i >= 0:
                line = bytes(self.buf[:i])
                del self.buf[: i + 1]
                return dict(json.loads(line))
            chunk = await self.stream.receive_some(1 << 20)
            if not chunk:
                return None
            self.buf += chunk


class _Out:
    """The worker's stdout: whole JSON lines, written under a lock."""

    def __init__(self) -> None:
        self.stream = trio.lowlevel.FdStream(os.dup(1))
        self.lock = trio.Lock()

    async def send(self, msg: dict[str, Any]) -> None:
        data = (json.dumps(msg, separators=(",", ":")) + "\n").encode()
        async with self.lock:
            await self.stream.send_all(data)


async def _worker_main(spec: dict[str, Any]) -> None:
    cfg = LoadtestConfig(**spec["cfg"])
    ranks: list[int] = spec["ranks"]
    data = ShardData(cfg.seed)
    out = _Out()
    commands = _Lines(trio.lowlevel.FdStream(os.dup(0)))

    async def serve(backend: Any) -> None:
        await out.send({"ev": "ready", "pid": os.getpid()})
        while True:
            cmd = await commands.next()
            if cmd is None or cmd["cmd"] == "exit":
                usage = resource.getrusage(resource.RUSAGE_SELF)
                await out.send(
                    {
                        "ev": "bye",
                        "cpu_s": usage.ru_utime + usage.ru_stime,
                        "max_rss": usage.ru_maxrss * 1024,
                    }
                )
                return
            await _run_phase(cfg, backend, data, ranks, cmd, out)

    if cfg.through_mount:
        limiter = trio.CapacityLimiter(max(1, len(ranks)) + 4)
        await serve(MountBackend(cfg.through_mount, limiter))
    else:
        from tectonic_py.client.tectonic_client import open_client

        assert cfg.cluster_file is not None
        async with open_client(cfg.cluster_file, **cfg.client_options) as client:
            await serve(ClientBackend(client))


async def _run_phase(
    cfg: LoadtestConfig,
    backend: Any,
    data: ShardData,
    ranks: list[int],
    cmd: dict[str, Any],
    out: _Out,
) -> None:
    phase, step, t0 = cmd["cmd"], int(cmd["step"]), float(cmd["t0"])
    # read: the (size, crc32c) each rank must find, from the writers or the step's .metadata
    expected: dict[str, list[int]] = cmd.get("expected", {})
    cpu0 = time.process_time()
    done_bytes = [0]
    results: list[RankResult] = []

    async def one_rank(rank: int) -> None:
        size = shard_size(cfg, rank)
        res = RankResult(rank, step, phase, size, 0.0, 0.0, 0)

        def opened() -> None:
            res.t_open = time.time() - t0

        try:
            if phase == "write":
                buf = bytearray(PIECE)
                crc = 0

                def gen() -> Iterable[memoryview]:
                    nonlocal crc
                    for piece in data.pieces(step, rank, size, buf):
                        crc = checksum(piece, crc)
                        yield piece
                        done_bytes[0] += len(piece)

                await backend.write_file(rank_file(cfg, step, rank), gen(), opened)
                res.crc = crc
            else:
                want = expected.get(str(rank))
                want_size, want_crc = (want[0], want[1]) if want else (size, None)
                got = [0, 0]

                def sink(chunk: Any) -> None:
                    got[0] = checksum(chunk, got[0])
                    got[1] += len(chunk)
                    done_bytes[0] += len(chunk)

                await backend.read_file(rank_file(cfg, step, rank), want_size, sink, opened)
                res.crc = got[0]
                if got[1] != want_size:
                    res.error = f"short read: {got[1]} of {want_size} bytes"
                elif want_crc is None:
                    res.error = "no checksum recorded for this shard"
                elif got[0] != want_crc:
                    res.error = f"checksum mismatch: {got[0]:08x} != {want_crc:08x}"
                else:
                    res.verified = got[1]
        except (TectonicError, OSError) as e:
            res.error = f"{type(e).__name__}: {e}"
        except Exception as e:  # a bug in a lower layer must show as an error, not a hang
            log.exception("rank %d %s failed", rank, phase)
            res.error = f"{type(e).__name__}: {e}"
        res.t_done = time.time() - t0
        results.append(res)

    async def progress() -> None:
        while True:
            await out.send({"ev": "progress", "t": time.time(), "bytes": done_bytes[0]})
            await trio.sleep(PROGRESS_INTERVAL)

    await trio.sleep_until(trio.current_time() + max(0.0, t0 - time.time()))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(progress)
        async with trio.open_nursery() as ranks_nursery:
            for rank in ranks:
                ranks_nursery.start_soon(one_rank, rank)
        nursery.cancel_scope.cancel()
    await out.send({"ev": "progress", "t": time.time(), "bytes": done_bytes[0]})
    usage = resource.getrusage(resource.RUSAGE_SELF)
    await out.send(
        {
            "ev": "done",
            "phase": phase,
            "step": step,
            "cpu_s": time.process_time() - cpu0,
            "rss": usage.ru_maxrss * 1024,
            "ranks": [asdict(r) for r in results],
        }
    )


def worker_entry(spec_json: str) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    trio.run(_worker_main, json.loads(spec_json))
    return 0


# --- the coordinator -----------------------------------------------------------------------


@dataclass
class _Worker:
    index: int
    ranks: list[int]
    proc: Any
    lines: _Lines
    pid: int = 0
    bytes_done: int = 0
    cpu_s: float = 0.0
    max_rss: int = 0


class CpuMeter:
    """CPU-seconds and peak RSS of a set of processes (psutil), sampled over time; processes
    that vanish keep their last reading, so a daemon that dies is not subtracted."""

    def __init__(self, pids: Iterable[int]) -> None:
        import psutil

        self.procs: dict[int, Any] = {}
        self.last: dict[int, float] = {}
        self.peak_rss: dict[int, int] = {}
        for pid in pids:
            try:
                self.procs[pid] = psutil.Process(pid)
            except psutil.Error:
                continue
        self.sample()
        self.first = dict(self.last)

    def used(self) -> float:
        """CPU-s the set spent since this meter was made."""
        return self.sample() - sum(self.first.values())

    def sample(self) -> float:
        """Total CPU-s of the set now (latest readings)."""
        import psutil

        for pid, p in self.procs.items():
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    self.last[pid] = t.user + t.system
                    rss = p.memory_info().rss
                self.peak_rss[pid] = max(self.peak_rss.get(pid, 0), rss)
            except psutil.Error:
                pass
        return sum(self.last.values())

    def max_rss(self) -> int:
        return max(self.peak_rss.values(), default=0)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def run_loadtest(cfg: LoadtestConfig, *, progress: bool = False) -> dict[str, Any]:
    """Run the whole load test and return its results (the ``--json`` object)."""
    cfg.validate()
    if cfg.through_mount:
        limiter = trio.CapacityLimiter(8)
        meta_backend: Any = MountBackend(cfg.through_mount, limiter)
        return await _coordinate(cfg, meta_backend, progress)
    from tectonic_py.client.tectonic_client import open_client

    assert cfg.cluster_file is not None
    async with open_client(cfg.cluster_file) as client:
        return await _coordinate(cfg, ClientBackend(client), progress)


async def _coordinate(cfg: LoadtestConfig, backend: Any, show_progress: bool) -> dict[str, Any]:
    n = cfg.worker_count()
    assignment = [list(range(i, cfg.ranks, n)) for i in range(n)]
    ranks_total = cfg.ranks
    shard_bytes = sum(shard_size(cfg, r) for r in range(cfg.ranks))
    watch = CpuMeter(cfg.watch_pids)
    own0 = time.process_time()
    timeline: list[tuple[float, str, int]] = []  # (wall time, phase, cumulative bytes of phase)
    phases: list[dict[str, Any]] = []
    rank_results: list[RankResult] = []
    errors: list[str] = []
    workers: list[_Worker] = []
    meta_ops = 0
    meta_seconds = 0.0
    deleted_steps: list[int] = []
    timed_out = False
    run_t0 = time.time()
    bar = _ProgressBar(show_progress)

    async def start_workers() -> None:
        spec_cfg = asdict(cfg)
        spec_cfg["watch_pids"] = []
        for i, ranks in enumerate(assignment):
            spec = json.dumps({"cfg": spec_cfg, "ranks": ranks})
            proc = await trio.lowlevel.open_process(
                [sys.executable, "-m", "tectonic_py.loadtest", "--worker", spec],
                stdin=-1,
                stdout=-1,
                env=child_env(),
            )
            assert proc.stdout is not None and proc.stdin is not None
            workers.append(_Worker(i, ranks, proc, _Lines(proc.stdout)))
        for w in workers:
            msg = await w.lines.next()
            if msg is None or msg.get("ev") != "ready":
                raise ConfigError(f"loadtest worker {w.index} failed to start (see its stderr)")
            w.pid = int(msg["pid"])

    async def send_all(cmd: dict[str, Any]) -> None:
        data = (json.dumps(cmd) + "\n").encode()
        for w in workers:
            await w.proc.stdin.send_all(data)

    async def run_phase(
        phase: str, step: int, expected: dict[int, list[int]] | None = None
    ) -> dict[str, Any]:
        expected = expected or {}
        total = shard_bytes
        t0 = time.time() + START_DELAY
        watch_cpu0 = watch.sample()
        for w in workers:
            w.bytes_done = 0
        bar.start(f"{phase} step {step}", total)
        for w in workers:
            cmd: dict[str, Any] = {"cmd": phase, "step": step, "t0": t0}
            if phase == "read":
                cmd["expected"] = {str(r): expected[r] for r in w.ranks if r in expected}
            await w.proc.stdin.send_all((json.dumps(cmd) + "\n").encode())
        done: dict[int, dict[str, Any]] = {}

        async def listen(w: _Worker) -> None:
            while True:
                msg = await w.lines.next()
                if msg is None:
                    raise ConfigError(f"loadtest worker {w.index} (pid {w.pid}) died")
                if msg["ev"] == "progress":
                    w.bytes_done = int(msg["bytes"])
                    agg = sum(x.bytes_done for x in workers)
                    timeline.append((float(msg["t"]), f"{phase}:{step}", agg))
                    bar.update(agg)
                elif msg["ev"] == "done":
                    done[w.index] = msg
                    return

        async def sampler() -> None:
            while True:
                watch.sample()
                await trio.sleep(0.5)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sampler)
            async with trio.open_nursery() as listeners:
                for w in workers:
                    listeners.start_soon(listen, w)
            nursery.cancel_scope.cancel()
        bar.stop()
        watch_cpu = watch.sample() - watch_cpu0
        results = [RankResult(**r) for m in done.values() for r in m["ranks"]]
        rank_results.extend(results)
        for r in results:
            if r.error:
                errors.append(f"step {r.step} rank {r.rank} {r.phase}: {r.error}")
        times = [r.t_done for r in results]
        opens = [r.t_open for r in results if not r.error]
        moved = sum(r.size for r in results if not r.error)
        pause = max(times, default=0.0)
        worker_cpu = sum(float(m["cpu_s"]) for m in done.values())
        for w in workers:
            w.max_rss = max(w.max_rss, int(done[w.index]["rss"]))
        return {
            "phase": phase,
            "step": step,
            "t0": t0,
            "ranks": len(results),
            "bytes": moved,
            "seconds": pause,
            "gbps": moved / pause / 1e9 if pause > 0 else 0.0,
            "p50": _percentile(times, 0.5),
            "p90": _percentile(times, 0.9),
            "p99": _percentile(times, 0.99),
            "max": pause,
            "open_p50": _percentile(opens, 0.5),
            "open_max": max(opens, default=0.0),
            "opens_per_s": len(opens) / max(opens) if opens and max(opens) > 0 else 0.0,
            "worker_cpu_s": worker_cpu,
            "watched_cpu_s": watch_cpu,
            "errors": sum(1 for r in results if r.error),
            "verified": sum(r.verified for r in results),
        }

    async def metadata(fn: Any, *args: Any) -> Any:
        nonlocal meta_ops, meta_seconds
        t = time.perf_counter()
        result = await fn(*args)
        meta_seconds += time.perf_counter() - t
        meta_ops += 1
        return result

    async def body() -> None:
        await start_workers()
        index: dict[str, Any] = {}
        if cfg.verify_only:
            raw = await metadata(backend.read_small, f"{step_dir(cfg, cfg.steps)}/.metadata")
            index = json.loads(raw)
        for step in range(1, 0 if cfg.verify_only else cfg.steps + 1):
            await metadata(backend.makedirs, step_dir(cfg, step))
            phases.append(await run_phase("write", step))
            index = {
                "step": step,
                "ranks": cfg.ranks,
                "seed": cfg.seed,
                "files": {
                    str(r.rank): {"size": r.size, "crc32c": r.crc}
                    for r in rank_results
                    if r.step == step and r.phase == "write" and not r.error
                },
            }
            await metadata(
                backend.write_small, f"{step_dir(cfg, step)}/.metadata", json.dumps(index).encode()
            )
            if cfg.keep_last and step > cfg.keep_last:
                old = step - cfg.keep_last
                t = time.perf_counter()
                await backend.remove_tree(step_dir(cfg, old))
                meta_seconds_delete.append(time.perf_counter() - t)
                deleted_steps.append(old)
        if cfg.restore or cfg.verify_only:
            expected = {int(r): [f["size"], f["crc32c"]] for r, f in index.get("files", {}).items()}
            phases.append(await run_phase("read", cfg.steps, expected))
        await send_all({"cmd": "exit"})
        for w in workers:
            msg = await w.lines.next()
            while msg is not None and msg.get("ev") != "bye":
                msg = await w.lines.next()
            if msg is not None:
                w.cpu_s = float(msg["cpu_s"])
                w.max_rss = max(w.max_rss, int(msg["max_rss"]))
            await w.proc.wait()

    meta_seconds_delete: list[float] = []
    try:
        with trio.move_on_after(cfg.max_seconds) as scope:
            try:
                await body()
            except* (TectonicError, OSError) as group:
                errors.extend(f"{type(e).__name__}: {e}" for e in _leaves(group))
        if scope.cancelled_caught:
            timed_out = True
            errors.append(f"stopped after --max-seconds {cfg.max_seconds}")
    finally:
        bar.stop()
        with trio.CancelScope(shield=True):
            for w in workers:
                if w.proc.returncode is None:
                    w.proc.kill()  # only our own worker, by its PID
                    await w.proc.wait()
            if not (cfg.keep or cfg.verify_only):
                with trio.move_on_after(120):
                    try:
                        await backend.remove_tree(cfg.run_dir)
                    except (TectonicError, OSError) as e:
                        errors.append(f"cleanup of {cfg.run_dir} failed: {e}")

    writes = [p for p in phases if p["phase"] == "write"]
    reads = [p for p in phases if p["phase"] == "read"]
    written = sum(p["bytes"] for p in writes)
    read = sum(p["bytes"] for p in reads)
    all_write_times = [r.t_done for r in rank_results if r.phase == "write"]
    creates = sum(p["ranks"] for p in writes)
    create_seconds = sum(p["open_max"] for p in writes)
    write_cpu = sum(p["worker_cpu_s"] + p["watched_cpu_s"] for p in writes)
    read_cpu = sum(p["worker_cpu_s"] + p["watched_cpu_s"] for p in reads)
    result: dict[str, Any] = {
        "mode": "mount" if cfg.through_mount else "client",
        "target": cfg.through_mount or cfg.cluster_file,
        "ranks": ranks_total,
        "processes": n,
        "steps": cfg.steps,
        "size_dist": cfg.size_dist,
        "shard_bytes_per_step": shard_bytes,
        "errors": len(errors),
        "error_samples": errors[:10],
        "timed_out": timed_out,
        "bytes_written": written,
        "bytes_read": read,
        "bytes_verified": sum(p["verified"] for p in reads),
        "write_gbps": _gbps(writes),
        "read_gbps": _gbps(reads),
        "pause_s": max((p["seconds"] for p in writes), default=0.0),
        "pause_s_per_step": [round(p["seconds"], 4) for p in writes],
        "restore_s": max((p["seconds"] for p in reads), default=0.0),
        "rank_write_p50_s": _percentile(all_write_times, 0.5),
        "rank_write_p90_s": _percentile(all_write_times, 0.9),
        "rank_write_p99_s": _percentile(all_write_times, 0.99),
        "rank_write_max_s": max(all_write_times, default=0.0),
        "metadata_ops": meta_ops + creates + sum(p["ranks"] for p in reads),
        "creates_per_s": creates / create_seconds if create_seconds > 0 else 0.0,
        "deleted_steps": deleted_steps,
        "delete_seconds": round(sum(meta_seconds_delete), 4),
        "cpu_s_write": write_cpu,
        "cpu_s_read": read_cpu,
        "cpu_s_per_gib_write": write_cpu / (written / GiB) if written else None,
        "cpu_s_per_gib_read": read_cpu / (read / GiB) if read else None,
        "coordinator_cpu_s": time.process_time() - own0,
        "worker_max_rss": max((w.max_rss for w in workers), default=0),
        "watched_max_rss": watch.max_rss(),
        "wall_s": time.time() - run_t0,
        "phases": phases,
        "timeline": [(round(t - run_t0, 4), ph, b) for t, ph, b in timeline],
        "rank_times": {
            "write": sorted(all_write_times),
            "read": sorted(r.t_done for r in rank_results if r.phase == "read"),
        },
    }
    return result


def _leaves(group: BaseException) -> list[BaseException]:
    if isinstance(group, BaseExceptionGroup):
        return [leaf for e in group.exceptions for leaf in _leaves(e)]
    return [group]


def _gbps(phases: list[dict[str, Any]]) -> float:
    """Aggregate GB/s over bursts: bytes moved over the sum of their pauses."""
    seconds = sum(p["seconds"] for p in phases)
    return sum(p["bytes"] for p in phases) / seconds / 1e9 if seconds > 0 else 0.0


class _ProgressBar:
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


# --- reporting -----------------------------------------------------------------------------


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
        f"{_h(result['bytes_written'])} / {_h(result['bytes_verified'])}",
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
    row("creates/s during burst", f"{result['creates_per_s']:.0f}")
    row("metadata ops", str(result["metadata_ops"]))
    for key in ("cpu_s_per_gib_write", "cpu_s_per_gib_read"):
        v = result[key]
        row(key.replace("_", " "), "-" if v is None else f"{v:.2f}")
    row(
        "peak RSS worker / watched",
        f"{_h(result['worker_max_rss'])} / {_h(result['watched_max_rss'])}",
    )
    return table


def _h(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


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


def write_plot(result: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Throughput over time (per phase) and the per-rank completion-time CDF."""
    import matplotlib

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


# --- CLI -------------------------------------------------------------------------------------


def _size_arg(text: str) -> int:
    """argparse type for sizes: a bad one is a usage error (one line), not a traceback."""
    try:
        return parse_size(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _pids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad PID list {text!r}") from None


def _client_options(items: list[str]) -> dict[str, Any]:
    """KEY=VALUE pairs -> keyword arguments (ints and floats converted)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise ConfigError(f"--client-opt {item!r}: expected KEY=VALUE")
        parsed: Any = value
        for conv in (int, float):
            try:
                parsed = conv(value)
                break
            except ValueError:
                continue
        out[key] = parsed
    return out


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "loadtest",
        help="simulate a training job's checkpoint burst and restore",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("cluster_file", nargs="?", help="cluster.toml (omit with --through-mount)")
    p.add_argument("--through-mount", metavar="MOUNTPOINT", help="real file I/O on a mount")
    p.add_argument("--ranks", type=int, default=64, help="ranks saving at once (default 64)")
    p.add_argument("--processes", type=int, default=0, help="worker processes (0: auto)")
    p.add_argument(
        "--shard-size",
        type=_size_arg,
        default=16 * MiB,
        help="fixed shard size, e.g. 16MiB, 1MB (default 16MiB)",
    )
    p.add_argument(
        "--size-dist",
        choices=["fixed", "uniform", "loguniform"],
        default="fixed",
        help="shard sizes: fixed (--shard-size) or drawn between --min-size and --max-size",
    )
    p.add_argument("--min-size", type=_size_arg, default=1_000_000, help="default 1MB")
    p.add_argument("--max-size", type=_size_arg, default=64 * MiB, help="default 64MiB")
    p.add_argument("--steps", type=int, default=1, help="checkpoint steps in a row")
    p.add_argument("--keep-last", type=int, default=0, help="delete older steps (0: keep all)")
    p.add_argument("--no-restore", action="store_true", help="skip the restore (read) phase")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dir", help="run directory in the filesystem (default /loadtest-<time>)")
    p.add_argument("--max-seconds", type=float, default=600.0, help="stop after this long")
    p.add_argument("--keep", action="store_true", help="do not delete what was written")
    p.add_argument(
        "--verify-only",
        action="store_true",
        help="write nothing: restore and verify step --steps of the run in --dir (kept earlier)",
    )
    p.add_argument("--watch-pids", type=_pids, default=[], help="PIDs whose CPU/RSS to count")
    p.add_argument(
        "--client-opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a tuning keyword of open_client for the workers (e.g. slow_chunk_s=60); repeatable",
    )
    p.add_argument("--results-dir", default="loadtest-results", help="JSON + PNG go here")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=main)


def config_from_args(args: argparse.Namespace) -> LoadtestConfig:
    if args.verify_only and not args.dir:
        raise ConfigError("--verify-only needs the --dir of a run kept with --keep")
    run_dir = args.dir or f"/loadtest-{int(time.time())}-{os.getpid()}"
    return LoadtestConfig(
        cluster_file=args.cluster_file,
        through_mount=args.through_mount,
        ranks=args.ranks,
        processes=args.processes,
        size_dist=args.size_dist,
        shard_size=args.shard_size,
        min_size=args.min_size,
        max_size=args.max_size,
        steps=args.steps,
        keep_last=args.keep_last,
        restore=not args.no_restore,
        seed=args.seed,
        run_dir=run_dir,
        max_seconds=args.max_seconds,
        keep=args.keep,
        verify_only=args.verify_only,
        client_options=_client_options(args.client_opt),
        watch_pids=list(args.watch_pids),
    )


def main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    cfg.validate()
    show = not args.no_progress and sys.stderr.isatty()
    result = trio.run(lambda: run_loadtest(cfg, progress=show))
    os.makedirs(args.results_dir, exist_ok=True)
    stem = Path(args.results_dir) / f"loadtest-{result['mode']}-{cfg.ranks}"
    with open(f"{stem}.json", "w") as f:
        json.dump(result, f)
    if not args.no_plot:
        write_plot(result, f"{stem}.png")
    from rich.console import Console

    console = Console(stderr=args.json)
    console.print(summary_table(result))
    if result["error_samples"]:
        console.print("[red]errors:[/red]", *result["error_samples"], sep="\n  ")
    if args.json:
        slim = {k: v for k, v in result.items() if k not in ("timeline", "rank_times")}
        print(json.dumps(slim))
    return 0 if result["errors"] == 0 else 3


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(worker_entry(sys.argv[2]))
    print("usage: tectonic loadtest ... (this module's --worker mode is internal)", file=sys.stderr)
    sys.exit(2)
