"""Fault injection across the whole cluster: a write/read cycle of ``TECTONIC_CHAOS_BYTES``
(256MiB by default; ``1GiB`` for the full run) while a seeded helper kills -9 and restarts
chunk stores, stops (SIGSTOP) and resumes them, kills -9 and restarts a metadata server, and
deletes and corrupts chunk files on disk (``TECTONIC_CHAOS_SEED`` replays a run; the seed is
logged).

The damage is bounded so that the data stays recoverable, which is the point: at most one
chunk store is out of service at a time, and at most one chunk file is damaged per block,
only in blocks committed with all n chunks; with RS(4,2) no block then has more than m = 2
chunks unavailable at once, even one committed short while a store was out.

Then the chaos stops, repair settles, and the checks: every file whose close returned reads
back bit-exact (nothing acknowledged is lost); every chunk of every block of those files is
fetched and verified (what ``get`` can read, chunk by chunk); and ``tectonic status`` and
``tectonic repair --status`` report exactly that (no degraded blocks left)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

from chunkstore import layout as chunk_layout
from tectonic_py.client.tectonic_client import TectonicClient, open_client
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import TectonicError
from tectonic_py.core.ids import chunk_id
from tectonic_py.core.records import BlockInfo
from tectonic_py.core.units import parse_size
from tectonic_py.launch.local_cluster import LocalCluster

pytestmark = pytest.mark.slow

log = logging.getLogger(__name__)

MiB = 1024 * 1024
EC = "rs-4-2"
STORES = 8  # n = 6: two spare failure domains, so a lost chunk always has somewhere to go
CHUNK = 256 * 1024  # blocks of 1 MiB of data
FILE_SIZE = 8 * MiB
WRITERS = 3
META_EVERY_S = 10.0  # between a metadata server's return and the next kill
TUNING = {"write_hedge_s": 0.5, "read_hedge_s": 0.5, "slow_chunk_s": 2.0, "chunk_timeout": 5.0}


def _chaos_bytes() -> int:
    return parse_size(os.environ.get("TECTONIC_CHAOS_BYTES", "256MiB"))


def _data(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with LocalCluster(
        tmp_path / "c",
        chunkstores=STORES,
        metadata_servers=2,
        shards=8,
        ec=EC,
        chunk_size=CHUNK,
        heartbeat_interval=0.3,
        node_timeout=2.0,
        chunkstore_args=["--scrub-interval", "3", "--scrub-rate", "256MiB"],
        maintenance=True,
        maintenance_args=[
            *("--interval", "0.5", "--sweep-interval", "2", "--inventory-interval", "3"),
            *("--grace", "60", "--bandwidth", "256MiB", "--no-rebalance"),
        ],
    ) as c:
        yield c


@dataclass
class Acked:
    """Files whose close returned (path -> size, sha256) and the blocks committed for them."""

    files: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    blocks: list[BlockInfo] = field(default_factory=list)
    write_failures: list[str] = field(default_factory=list)
    read_failures: list[str] = field(default_factory=list)


class Chaos:
    """The fault-injecting helper: one action every few hundred milliseconds, seeded.

    A chunk store out of service (killed or stopped) and a metadata server killed each run
    in a task of their own that brings them back after a second or three; at most one of
    each at a time. Chunk files are damaged only in blocks of acknowledged files committed
    with all n chunks, one per block ever (see the module docstring for why that bounds
    the damage)."""

    def __init__(self, cluster: LocalCluster, acked: Acked, rng: random.Random) -> None:
        self.cluster = cluster
        self.acked = acked
        self.rng = rng
        self.n = ECPolicy.parse(EC).n
        self.events: list[str] = []
        self.store_out: int | None = None
        self.meta_out = False
        self.meta_next = 0.0
        self.damaged: set[int] = set()
        self.stopped_pid: int | None = None

    def note(self, what: str) -> None:
        self.events.append(f"{trio.current_time():.1f} {what}")
        log.info("chaos: %s", what)

    async def run(self, nursery: trio.Nursery, stop: trio.Event) -> None:
        actions = [self._store, self._store, self._meta, self._delete, self._corrupt]
        while not stop.is_set():
            with trio.move_on_after(self.rng.uniform(0.2, 0.8)):
                await stop.wait()
            if not stop.is_set():
                await self.rng.choice(actions)(nursery)

    async def _store(self, nursery: trio.Nursery) -> None:
        if self.store_out is not None:
            return
        i = self.rng.randrange(STORES)
        self.store_out = i
        nursery.start_soon(self._store_outage, i, self.rng.random() < 0.5, self.rng.uniform(1, 3))

    async def _store_outage(self, i: int, stop: bool, seconds: float) -> None:
        pid = self.cluster.chunkstore_pids()[i]
        assert pid is not None
        try:
            if stop:
                self.note(f"SIGSTOP cs{i} for {seconds:.1f}s")
                self.stopped_pid = pid
                os.kill(pid, signal.SIGSTOP)
                await trio.sleep(seconds)
                os.kill(pid, signal.SIGCONT)
                self.stopped_pid = None
            else:
                self.note(f"kill -9 cs{i} for {seconds:.1f}s")
                self.cluster.kill_chunkstore(i)
                await trio.sleep(seconds)
                await trio.to_thread.run_sync(self.cluster.start_chunkstore, i)
            self.note(f"cs{i} back")
        finally:
            self.store_out = None

    async def _meta(self, nursery: trio.Nursery) -> None:
        # Rarer than the rest: while a metadata server is out, writes to its shards fail
        # (not acknowledged) and the workload needs time in between to make progress.
        if self.meta_out or trio.current_time() < self.meta_next:
            return
        self.meta_out = True
        nursery.start_soon(self._meta_outage, self.rng.randrange(2), self.rng.uniform(0.5, 2))

    async def _meta_outage(self, i: int, seconds: float) -> None:
        try:
            self.note(f"kill -9 metadata server {i} for {seconds:.1f}s")
            self.cluster.kill_metadata(i)
            await trio.sleep(seconds)
            await trio.to_thread.run_sync(self.cluster.start_metadata, i)
            self.note(f"metadata server {i} back")
        finally:
            self.meta_out = False
            self.meta_next = trio.current_time() + META_EVERY_S

    def _victim(self) -> Path | None:
        """A chunk file of a full, undamaged block of an acknowledged file, if one is left."""
        full = [b for b in self.acked.blocks if len(b.chunks) == self.n]
        candidates = [b for b in full if b.block_id not in self.damaged]
        if not candidates:
            return None
        block = self.rng.choice(candidates)
        pl = self.rng.choice(block.chunks)
        self.damaged.add(block.block_id)
        store = self.cluster.chunkstore_dir(int(pl.node_id.removeprefix("cs")))
        path = chunk_layout.chunk_path(store, chunk_id(block.block_id, pl.index))
        return path if path.exists() else None

    async def _delete(self, nursery: trio.Nursery) -> None:
        path = self._victim()
        if path is not None:
            path.unlink(missing_ok=True)
            self.note(f"deleted {path.parent.parent.parent.name}/{path.name}")

    async def _corrupt(self, nursery: trio.Nursery) -> None:
        path = self._victim()
        if path is None:
            return
        raw = bytearray(path.read_bytes())
        raw[-1 - self.rng.randrange(min(len(raw) // 2, CHUNK))] ^= 0xFF
        path.write_bytes(raw)
        self.note(f"corrupted {path.parent.parent.parent.name}/{path.name}")

    def resume_all(self) -> None:
        """SIGCONT a store left stopped (a test failing mid-outage must not leave it so)."""
        if self.stopped_pid is not None:
            os.kill(self.stopped_pid, signal.SIGCONT)


async def _write_one(client: TectonicClient, path: str, seed: int, acked: Acked) -> None:
    data = _data(seed, FILE_SIZE)
    try:
        w = await client.create(path)
    except TectonicError as e:
        acked.write_failures.append(f"{path}: create: {e}")
        return
    try:
        for off in range(0, len(data), 3 * MiB):
            await w.write(data[off : off + 3 * MiB])
        attrs = await w.close()
    except TectonicError as e:
        acked.write_failures.append(f"{path}: {e}")
        await w.abort()
        return
    acked.files[path] = (len(data), hashlib.sha256(data).digest())
    for _ in range(20):  # the blocks, for the helper to damage; a metadata outage is brief
        try:
            acked.blocks.extend(await client.meta.block_list(attrs.id))
            return
        except TectonicError:
            await trio.sleep(0.5)


async def _read_check(client: TectonicClient, path: str, acked: Acked) -> bool:
    """Read ``path`` back; False on an error (a metadata server may be out). Wrong bytes are
    never tolerated: they fail the test at once."""
    size, digest = acked.files[path]
    try:
        r = await client.open_read(path)
        try:
            data = await r.read()
        finally:
            await r.aclose()
    except TectonicError as e:
        acked.read_failures.append(f"{path}: {e}")
        return False
    assert len(data) == size and hashlib.sha256(data).digest() == digest, f"{path} differs"
    return True


async def _workload(client: TectonicClient, acked: Acked, total: int, rng: random.Random) -> None:
    """WRITERS tasks write files until ``total`` bytes are acknowledged (or too many writes
    failed); after each acknowledged file, a random earlier one is read back."""
    names = iter(range(10**6))
    most_failures = 2 * total // FILE_SIZE + 50

    async def writer() -> None:
        while len(acked.files) * FILE_SIZE < total and len(acked.write_failures) < most_failures:
            i = next(names)
            await _write_one(client, f"/chaos/f{i:05d}", i, acked)
            if acked.files:
                await _read_check(client, rng.choice(sorted(acked.files)), acked)

    async with trio.open_nursery() as nursery:
        for _ in range(WRITERS):
            nursery.start_soon(writer)


async def _tectonic(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "tectonic_py.cli.main", *args]
    return await trio.to_thread.run_sync(
        lambda: subprocess.run(argv, check=False, capture_output=True, text=True, timeout=120)
    )


async def _repair_status(cluster: LocalCluster) -> dict[str, Any]:
    out = await _tectonic("repair", str(cluster.cluster_file), "--status", "--json")
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


async def _settle(cluster: LocalCluster, timeout: float = 120.0) -> dict[str, Any]:
    """Ask for an inventory pass now, then wait until repair reports no degraded block (a
    bound on background work, not a timing assertion); the last status either way."""
    out = await _tectonic("repair", str(cluster.cluster_file), "--inventory")
    assert out.returncode == 0, out.stderr
    with trio.move_on_after(timeout):
        while True:
            status = await _repair_status(cluster)
            if status["degraded"] == 0 and not status["nodes_down"]:
                return status
            await trio.sleep(1.0)
    return await _repair_status(cluster)


async def _chunk_truth(client: TectonicClient, files: dict[str, tuple[int, bytes]]) -> list[str]:
    """Every chunk of every block of ``files`` fetched and verified against the Block layer's
    CRC: the blocks with fewer than n good chunks, with why."""
    addresses = {n.node_id: n.address for n in await client.meta.nodes()}
    bad: list[str] = []
    limiter = trio.CapacityLimiter(16)

    async def check(info: BlockInfo) -> None:
        n = ECPolicy.parse(info.ec).n
        good = 0
        for pl in info.chunks:
            cid = chunk_id(info.block_id, pl.index)
            try:
                async with limiter:
                    c = await client.pool.client(addresses.get(pl.node_id, ""))
                    await c.get(cid, 0, info.chunk_len, expected=pl.checksum)
                good += 1
            except TectonicError as e:
                bad.append(f"{cid} on {pl.node_id}: {e}")
        if good < n:
            bad.append(f"block {info.block_id:016x}: {good} of {n} chunks good")

    async with trio.open_nursery() as nursery:
        for path in files:
            for info in await client.meta.block_list((await client.stat(path)).id):
                nursery.start_soon(check, info)
    return bad


async def test_chaos_write_read_cycle(cluster, caplog):
    caplog.set_level(logging.CRITICAL, logger="tectonic_py")
    seed = int(os.environ.get("TECTONIC_CHAOS_SEED", random.randrange(2**32)))
    log.warning("chaos seed %d (TECTONIC_CHAOS_SEED=%d replays it)", seed, seed)
    print(f"chaos seed {seed}")
    rng = random.Random(seed)
    acked = Acked()
    chaos = Chaos(cluster, acked, random.Random(rng.random()))
    total = _chaos_bytes()
    t0 = trio.current_time()
    try:
        async with open_client(cluster.cluster_file, **TUNING) as client:
            await client.mkdir("/chaos")
            stop = trio.Event()
            with trio.fail_after(600):  # a bound on a hang, not a timing assertion
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(chaos.run, nursery, stop)
                    await _workload(client, acked, total, random.Random(rng.random()))
                    stop.set()
    finally:
        chaos.resume_all()
    t1 = trio.current_time()
    for i in range(STORES):
        await trio.to_thread.run_sync(cluster.start_chunkstore, i)
    for i in range(2):
        await trio.to_thread.run_sync(cluster.start_metadata, i)
    summary = (
        f"seed {seed}: {trio.current_time() - t0:.0f}s of chaos, {len(acked.files)} files acknowledged, {len(acked.write_failures)} writes"
        f" and {len(acked.read_failures)} reads failed (e.g. {acked.write_failures[:3]},"
        f" {acked.read_failures[:3]}); chaos: {chaos.events}"
    )
    print(f"{summary}\nevery daemon up again in {trio.current_time() - t1:.1f}s")
    assert len(acked.files) * FILE_SIZE >= total, summary
    await _check_after_chaos(cluster, acked, summary)


async def _check_after_chaos(cluster: LocalCluster, acked: Acked, summary: str) -> None:
    t0 = trio.current_time()
    async with open_client(cluster.cluster_file, **TUNING) as client:
        for path in sorted(acked.files):  # nothing acknowledged is lost, even before repair
            with trio.fail_after(60):
                assert await _read_check(client, path, acked), f"{path}: {acked.read_failures}"
    t1 = trio.current_time()
    repair = await _settle(cluster)
    print(f"read back in {t1 - t0:.1f}s, repair settled in {trio.current_time() - t1:.1f}s")
    t2 = trio.current_time()
    async with open_client(cluster.cluster_file, **TUNING) as client:
        truth = await _chunk_truth(client, acked.files)
        t3 = trio.current_time()
        out = await _tectonic("status", str(cluster.cluster_file), "--json")
        status = json.loads(out.stdout)
        t4 = trio.current_time()
        for path in sorted(acked.files):
            assert await _read_check(client, path, acked), path
        assert client.stats.degraded_reads == 0, client.stats.bad_chunks
    print(
        f"every chunk checked in {t3 - t2:.1f}s, status in {t4 - t3:.1f}s,"
        f" read again in {trio.current_time() - t4:.1f}s"
    )
    context = f"{summary}\nrepair: {repair}\nstatus: {status}\nchunks: {truth[:20]}"
    assert status["degraded_blocks"] == [], context
    assert repair["degraded"] == 0 and repair["lost"] == 0, context
    assert truth == [], context
    assert out.returncode == 0, context
    path = min(acked.files)
    local = cluster.root / "got"
    got = await _tectonic("get", "-q", str(cluster.cluster_file), path, str(local))
    assert got.returncode == 0, got.stderr
    assert hashlib.sha256(local.read_bytes()).digest() == acked.files[path][1]
