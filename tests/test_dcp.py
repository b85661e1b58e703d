"""torch.distributed.checkpoint through TectonicWriter / TectonicReader on a real cluster.

4 gloo ranks (processes forked from this one, which has torch imported already, on
127.0.0.1) save a state dict of DTensors sharded over them, plus a replicated tensor and
plain Python values, once with ``dcp.save`` and once with ``dcp.async_save``; 2 ranks load both back, resharded, and compare them bit for bit. In this
process: a checkpoint written here loads through DCP's own ``FileSystemReader`` once its
files are copied to local disk (the layout is DCP's), and a reader that loads one small
item of a checkpoint does not fetch the large one beside it.

Atomic commit under kill -9: 4 ranks save a step while one of them (a random rank, or the
coordinator, which commits) is killed at a random moment, and the job with it. Every step
then listed is whole (it loads bit for bit), ``latest`` names the newest one, and a step
that was cut off is absent, its files left only under a staging name.
"""

from __future__ import annotations

import datetime
import os
import random
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tectonic_py.client.sync_client import BlockingClient
from tectonic_py.launch.local_cluster import LocalCluster
from tectonic_py.native.dcp import TectonicReader, TectonicWriter, checkpoint_path

# dcp.save and dcp.load in one process (no_dist=True) warn that they assume so.
single_process = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

SAVE_RANKS = 4
LOAD_RANKS = 2


@pytest.fixture
def local_cluster(shared_local_cluster: LocalCluster) -> LocalCluster:
    """One cluster for the module: the kill -9 here is of ranks, never of a daemon."""
    return shared_local_cluster


def _full_tensors(seed: int) -> dict[str, Any]:
    """The global tensors of a step, the same in every process (a seeded generator)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(1024, 256, generator=g),  # 1 MiB: blocks of 384 KiB, shards of it
        "w2": torch.randn(333, 17, generator=g).to(torch.bfloat16),  # rows not divisible
        "emb": torch.randint(0, 1 << 40, (96, 130), generator=g),  # int64, sharded on dim 1
        "bias": torch.randn(1000, generator=g),  # replicated
    }


def _state_dict(mesh: Any, seed: int, *, empty: bool = False) -> dict[str, Any]:
    full = _full_tensors(seed)
    if empty:
        full = {k: torch.zeros_like(v) for k, v in full.items()}
    return {
        "model": {
            "w1": distribute_tensor(full["w1"], mesh, [Shard(0)]),
            "w2": distribute_tensor(full["w2"], mesh, [Shard(0)]),
            "emb": distribute_tensor(full["emb"], mesh, [Shard(1)]),
            "bias": distribute_tensor(full["bias"], mesh, [Replicate()]),
        },
        "extra": {"step": 0 if empty else seed, "note": "" if empty else f"step {seed}"},
    }


def _rank_main(rank: int, world: int, port: int, cluster_file: str, phase: str) -> None:
    """One rank: save steps 1 (dcp.save) and 2 (dcp.async_save), or load and check both."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        if phase == "save":
            dcp.save(
                _state_dict(mesh, 1),
                storage_writer=TectonicWriter(
                    "/ckpt/step_1", cluster=cluster_file, latest="latest"
                ),
            )
            future = dcp.async_save(
                _state_dict(mesh, 2),
                storage_writer=TectonicWriter(
                    "tectonic:///ckpt/step_2", cluster=cluster_file, latest="latest"
                ),
            )
            future.result()
            return
        for step in (1, 2):
            sd = _state_dict(mesh, step, empty=True)
            dcp.load(sd, storage_reader=TectonicReader(f"/ckpt/step_{step}", cluster=cluster_file))
            want = _full_tensors(step)
            for name, value in sd["model"].items():
                assert isinstance(value, DTensor)
                got = value.full_tensor()
                assert got.dtype == want[name].dtype
                assert torch.equal(got, want[name]), f"step {step}: {name} differs"
            assert sd["extra"] == {"step": step, "note": f"step {step}"}
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_ranks(world: int, cluster_file: Path, phase: str) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(
        _rank_main,
        args=(world, _free_port(), str(cluster_file), phase),
        nprocs=world,
        join=True,
        start_method="fork",
    )


@pytest.mark.slow
def test_save_with_4_ranks_load_resharded_on_2(local_cluster: LocalCluster) -> None:
    _run_ranks(SAVE_RANKS, local_cluster.cluster_file, "save")
    with BlockingClient(local_cluster.cluster_file) as client:
        names = sorted(e.name for e in client.listdir("/ckpt/step_1"))
        assert ".metadata" in names
        assert [n for n in names if n.endswith(".distcp")]  # DCP's own file names
        assert not [n for n in names if n.endswith(".tmp")]
        assert ".metadata" in {e.name for e in client.listdir("/ckpt/step_2")}
        # Committed: no staging directory left, latest moved to the second step.
        assert sorted(e.name for e in client.listdir("/ckpt")) == ["latest", "step_1", "step_2"]
        assert client.run(client.client.readlink, "/ckpt/latest") == "step_2"
    _run_ranks(LOAD_RANKS, local_cluster.cluster_file, "load")


def _download(client: BlockingClient, remote: str, local: Path) -> None:
    local.mkdir(parents=True)
    for entry in client.listdir(remote):
        with client.open(f"{remote}/{entry.name}") as src:
            (local / entry.name).write_bytes(src.read())


@single_process
def test_a_checkpoint_loads_through_dcps_own_reader(
    local_cluster: LocalCluster, tmp_path: Path
) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    saved = {"a": torch.arange(100_000, dtype=torch.float64), "meta": {"epoch": 3}}
    with BlockingClient(local_cluster.cluster_file) as client:
        dcp.save(saved, storage_writer=TectonicWriter("/ck", client=client), no_dist=True)
        _download(client, "/ck", tmp_path / "local")
    loaded = {"a": torch.zeros(100_000, dtype=torch.float64), "meta": {"epoch": 0}}
    dcp.load(loaded, storage_reader=FileSystemReader(tmp_path / "local"), no_dist=True)
    assert torch.equal(loaded["a"], saved["a"])
    assert loaded["meta"] == {"epoch": 3}


@single_process
def test_a_reader_fetches_only_what_its_plan_needs(local_cluster: LocalCluster) -> None:
    big = torch.randn(1 << 20)  # 4 MiB: about 11 blocks of 384 KiB
    small = torch.arange(1000, dtype=torch.int32)
    with BlockingClient(local_cluster.cluster_file) as client:
        writer = TectonicWriter("/partial", client=client, thread_count=1)
        dcp.save({"big": big, "small": small}, storage_writer=writer, no_dist=True)
    # A fresh client: no block of the save is in its cache.
    with BlockingClient(local_cluster.cluster_file) as client:
        target = {"small": torch.zeros(1000, dtype=torch.int32)}
        dcp.load(target, storage_reader=TectonicReader("/partial", client=client), no_dist=True)
        stats = client.client.statistics()
        assert torch.equal(target["small"], small)
        assert stats.bytes_read < big.nbytes // 4, stats


@single_process
def test_a_reader_keeps_a_few_block_pieces_in_flight(
    local_cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Items spanning many blocks are fetched a block piece at a time, at most
    READ_PIECES_IN_FLIGHT at once, and come back whole (every rank of a job loads at once:
    all of a rank's items in flight queued the checkpoint on the stores)."""
    from tectonic_py.client.reader import FileReader
    from tectonic_py.native import dcp as tdcp

    saved = {f"t{i}": torch.randn(1 << 19) for i in range(4)}  # 2 MiB each: ~6 blocks
    with BlockingClient(local_cluster.cluster_file) as client:
        writer = TectonicWriter("/pieces", client=client, thread_count=2)
        dcp.save(saved, storage_writer=writer, no_dist=True)
    running, most, sizes = 0, 0, []
    pread_into = FileReader.pread_into

    async def counted(self: FileReader, offset: int, dest: memoryview) -> int:
        nonlocal running, most
        running += 1
        most = max(most, running)
        sizes.append((dest.nbytes, self.layout.block_size))
        try:
            return await pread_into(self, offset, dest)
        finally:
            running -= 1

    monkeypatch.setattr(FileReader, "pread_into", counted)
    with BlockingClient(local_cluster.cluster_file) as client:
        loaded = {k: torch.zeros_like(v) for k, v in saved.items()}
        dcp.load(loaded, storage_reader=TectonicReader("/pieces", client=client), no_dist=True)
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert 1 < most <= tdcp.READ_PIECES_IN_FLIGHT, most
    assert len(sizes) > len(saved) and all(n <= bs for n, bs in sizes), sizes


def test_checkpoint_ids() -> None:
    assert checkpoint_path("tectonic:///ckpt/step_1/") == "/ckpt/step_1"
    assert checkpoint_path("tectonic://ckpt//step_1") == "/ckpt/step_1"
    assert checkpoint_path(Path("/ckpt/step_1")) == "/ckpt/step_1"
    assert TectonicWriter.validate_checkpoint_id("tectonic:///ckpt")
    assert not TectonicReader.validate_checkpoint_id("/local/dir")


# --- kill -9 during a save: the step appears whole or not at all ------------------------------

KILL_ROOT = "/kill"


class _MarkedWriter(TectonicWriter):
    """The test's writer: touches ``publishing`` in the marker directory when the
    coordinator starts to publish (metadata file, sealed check, commit), so the test can
    aim a kill at the commit."""

    marker_dir = ""

    def _publish(self, name: str, blob: bytes) -> None:
        Path(self.marker_dir, "publishing").touch()
        super()._publish(name, blob)


def _kill_rank_main(
    rank: int, world: int, port: int, cluster_file: str, step: int, marks: str
) -> None:
    # The ranks a kill leaves fail on the dead peer: their tracebacks go to the marker dir.
    log = os.open(Path(marks, f"rank_{rank}.log"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(log, 2)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    try:
        mesh = init_device_mesh("cpu", (world,))
        state = _state_dict(mesh, step)
        dist.barrier()
        Path(marks, f"saving_{rank}").touch()
        writer = _MarkedWriter(f"{KILL_ROOT}/step_{step}", cluster=cluster_file, latest="latest")
        writer.marker_dir = marks
        dcp.save(state, storage_writer=writer)
        Path(marks, f"saved_{rank}").touch()
    finally:
        dist.destroy_process_group()
    os._exit(0)


def _start_job(cluster_file: Path, step: int, marks: Path) -> list[Any]:
    import multiprocessing

    marks.mkdir()
    ctx = multiprocessing.get_context("fork")
    port = _free_port()
    procs = [
        ctx.Process(
            target=_kill_rank_main,
            args=(r, SAVE_RANKS, port, str(cluster_file), step, str(marks)),
        )
        for r in range(SAVE_RANKS)
    ]
    for p in procs:
        p.start()
    return procs


def _wait_mark(path: Path, procs: list[Any]) -> float:
    deadline = time.monotonic() + 120
    while not path.exists():
        assert time.monotonic() < deadline, f"no {path.name} in 120 s"
        if not all(p.is_alive() for p in procs):
            break
        time.sleep(0.005)
    return time.monotonic()


def _kill_job(procs: list[Any], victim: int) -> None:
    """kill -9 the victim rank now; the others (which fail or hang on the dead peer) a
    few seconds later, as a scheduler ends a job that lost a rank."""
    if procs[victim].is_alive():
        os.kill(procs[victim].pid, signal.SIGKILL)
    deadline = time.monotonic() + 3
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join()


def _check_steps(cluster_file: Path) -> list[int]:
    """Every listed step loads whole; ``latest`` names the newest; the committed steps."""
    with BlockingClient(cluster_file) as client:
        names = [e.name for e in client.listdir(KILL_ROOT)]
        steps = sorted(
            int(n.removeprefix("step_")) for n in names if n.startswith("step_") and "." not in n
        )
        others = [n for n in names if n != "latest" and not n.startswith("step_")]
        assert not others, names
        assert all(".staging-" in n for n in names if n.startswith("step_") and "." in n), names
        assert client.run(client.client.readlink, f"{KILL_ROOT}/latest") == f"step_{steps[-1]}"
        for step in steps:
            full = _full_tensors(step)
            sd = {
                "model": {k: torch.zeros_like(v) for k, v in full.items()},
                "extra": {"step": 0, "note": ""},
            }
            reader = TectonicReader(f"{KILL_ROOT}/step_{step}", client=client)
            dcp.load(sd, storage_reader=reader, no_dist=True)
            for name, value in sd["model"].items():
                assert torch.equal(value, full[name]), f"step {step}: {name} differs"
            assert sd["extra"] == {"step": step, "note": f"step {step}"}
    return steps


@pytest.mark.slow
@single_process
def test_kill_9_during_a_save_never_shows_a_partial_step(
    local_cluster: LocalCluster, tmp_path: Path
) -> None:
    """Trials: a random rank killed at a random moment of the save; the coordinator killed
    at a random moment of its publishing (metadata file, sealed check, commit), within
    about twice the time publishing takes."""
    seed = int(os.environ.get("TEST_SEED", time.time()))
    rng = random.Random(seed)
    cluster_file = local_cluster.cluster_file
    procs = _start_job(cluster_file, 1, tmp_path / "m1")
    saving = _wait_mark(tmp_path / "m1" / "saving_0", procs)
    publishing = _wait_mark(tmp_path / "m1" / "publishing", procs)
    for p in procs:
        p.join()
    assert all(p.exitcode == 0 for p in procs)
    save_s = publishing - saving
    publish_s = max(0.05, time.monotonic() - publishing)
    assert _check_steps(cluster_file) == [1]
    committed = [1]
    trials = [("any", rng.randrange(SAVE_RANKS)), ("commit", 0)] * 2
    for step, (what, victim) in enumerate(trials, start=2):
        marks = tmp_path / f"m{step}"
        procs = _start_job(cluster_file, step, marks)
        if what == "any":
            at = _wait_mark(marks / f"saving_{victim}", procs) + rng.uniform(0, save_s * 1.2)
        else:
            at = _wait_mark(marks / "publishing", procs) + rng.uniform(0, publish_s * 2)
        time.sleep(max(0.0, at - time.monotonic()))
        _kill_job(procs, victim)
        steps = _check_steps(cluster_file)
        assert set(committed) <= set(steps) <= set(committed) | {step}, (seed, steps)
        committed = steps
        print(f"seed {seed} step {step}: rank {victim} killed ({what}); committed {steps}")


@single_process
def test_a_reserving_save_that_cannot_fit_fails_before_writing(local_cluster: LocalCluster) -> None:
    """``reserve=True``: the plan's size is reserved in the checkpoint's directory first;
    more than the quota (EDQUOT) or the cluster's free space (ENOSPC) fails the save
    before a file is written. One that fits saves and loads as any."""
    saved = {"w": torch.randn(1 << 20)}  # 4 MiB
    with BlockingClient(local_cluster.cluster_file) as client:
        client.mkdir("/dq")
        client.run(_set_quota, client, "/dq", 2 << 20)
        with pytest.raises(BaseException, match="cannot hold"):  # DCP wraps it
            dcp.save(
                saved,
                storage_writer=TectonicWriter("/dq/a", client=client, reserve=True),
                no_dist=True,
            )
        with pytest.raises(BaseException, match="cannot hold"):  # DCP wraps it
            dcp.save(
                saved,
                storage_writer=TectonicWriter("/b", client=client, reserve=1 << 50),
                no_dist=True,
            )
        # Nothing written: the staging directories the saves drew are empty.
        for parent in ("/dq", "/"):
            for e in client.listdir(parent):
                if ".staging-" in e.name:
                    assert client.listdir(f"{parent.rstrip('/')}/{e.name}") == []
        client.run(_set_quota, client, "/dq", 16 << 20)
        dcp.save(
            saved,
            storage_writer=TectonicWriter("/dq/c", client=client, reserve=True),
            no_dist=True,
        )
        loaded = {"w": torch.zeros(1 << 20)}
        dcp.load(loaded, storage_reader=TectonicReader("/dq/c", client=client), no_dist=True)
        assert torch.equal(loaded["w"], saved["w"])


async def _set_quota(client: BlockingClient, path: str, max_bytes: int) -> None:
    d = await client.client.stat(path)
    await client.client.meta.set_quota(d.id, max_bytes, 0)
