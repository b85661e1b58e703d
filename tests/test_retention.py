"""Retention on the server (``tectonic retention``, metadata/retention_ops.py): the maintenance
daemon keeps the newest N committed steps and every step a ``latest`` link names, never a
staging directory nor other entries; bad input is one line and changes nothing; and, by
hypothesis over sequences of commit / kill -9 of maintenance or of a metadata server /
restart, the newest committed step and the ``latest`` target always read back bit-exact and
no step visible under its name is ever missing a file.

One cluster for the module (2 metadata servers, 9 stores, a maintenance process running
only retention, rounds every 0.2 s); the crash test kills and restarts its daemons."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator

import pytest
import trio
from cluster_fixtures import suite_cluster
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metadata.retention_ops import TOMB_PREFIX, step_key
from tectonic_py.cli.main import main
from tectonic_py.client.tectonic_client import TectonicClient, open_client
from tectonic_py.core.errors import FileNotFound
from tectonic_py.core.records import KIND_DIR
from tectonic_py.launch.local_cluster import LocalCluster

FILES = 3  # files per step


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("retention") / "cluster"
    args = ["--interval", "1", "--retention-interval", "0.2", "--services", "retention"]
    with suite_cluster(root, node_timeout=5.0, maintenance=True, maintenance_args=args) as c:
        yield c


def _data(step: int, i: int) -> bytes:
    seed = hashlib.sha256(f"step {step} file {i}".encode()).digest()
    return seed * (200 + 37 * ((step + i) % 5))


async def _write(client: TectonicClient, path: str, data: bytes) -> None:
    w = await client.create(path)
    await w.write(data)
    await w.close()


async def _read(client: TectonicClient, path: str) -> bytes:
    r = await client.open_read(path)
    return await r.pread(0, 1 << 20)


async def _commit(client: TectonicClient, base: str, step: int, latest: str = "latest") -> None:
    """A step as a training job writes it: files under a staging directory, then the
    atomic commit with ``latest``."""
    staging = f"step_{step}.staging-{step:x}"
    await client.mkdir(f"{base}/{staging}", parents=True)
    for i in range(FILES):
        await _write(client, f"{base}/{staging}/rank_{i}", _data(step, i))
    parent = await client.stat(base)
    await client.meta.commit_step(parent.id, staging, f"step_{step}", latest=latest)


async def _steps(client: TectonicClient, base: str) -> list[str]:
    entries = await client.listdir(base)
    return sorted(
        (e.name for e in entries if e.kind == KIND_DIR and step_key(e.name)),
        key=lambda n: step_key(n) or (0, n),
    )


async def _check_whole(client: TectonicClient, base: str, name: str) -> None:
    """Every file of the step, bit-exact, and nothing else: a step visible under its name
    is never a half step. A step retired while it is read is gone from its name by then
    (it was renamed before anything in it was removed): that is asked again."""
    step = int(name.rsplit("_", 1)[1])
    try:
        got = sorted(e.name for e in await client.listdir(f"{base}/{name}"))
        assert got == [f"rank_{i}" for i in range(FILES)], (name, got)
        for i in range(FILES):
            assert await _read(client, f"{base}/{name}/rank_{i}") == _data(step, i), (name, i)
    except FileNotFound:
        assert name not in await _steps(client, base), f"{name} is visible but not whole"


async def _wait_for(client: TectonicClient, base: str, want: list[str]) -> list[str]:
    """Bounded wait until the steps are ``want`` and no tomb is left (what a retention
    round leaves); the steps found."""
    with trio.move_on_after(60):
        while True:
            names = [e.name for e in await client.listdir(base)]
            steps = await _steps(client, base)
            if steps == want and not any(n.startswith(TOMB_PREFIX) for n in names):
                return steps
            await trio.sleep(0.1)
    return await _steps(client, base)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_keeps_newest_and_latest_never_staging(cluster: LocalCluster, capsys) -> None:
    cf = str(cluster.client_file)

    async def setup() -> None:
        async with open_client(cluster.client_file) as client:
            for step in (1, 2, 3):
                await _commit(client, "/ck", step)
            await client.mkdir("/ck/logs")  # no step number: not a step
            await client.mkdir("/ck/step_0.staging-dead")  # never committed: not a step
            await client.mkdir("/ck/.hidden_1")

    trio.run(setup)
    assert _cli(capsys, "retention", "set", cf, "/ck/", "--keep-last", "2")[0] == 0
    code, out, _ = _cli(capsys, "retention", "get", cf, "/ck")
    assert (code, out.strip()) == (0, "/ck\tkeep-last 2")

    async def check() -> None:
        async with open_client(cluster.client_file) as client:
            assert await _wait_for(client, "/ck", ["step_2", "step_3"]) == ["step_2", "step_3"]
            # latest pointed back at an old step keeps it past the newest two
            await client.unlink("/ck/latest")
            await client.symlink("step_2", "/ck/latest")
            await _commit(client, "/ck", 4, latest="")
            await _commit(client, "/ck", 5, latest="")
            want = ["step_2", "step_4", "step_5"]
            assert await _wait_for(client, "/ck", want) == want
            for name in want:
                await _check_whole(client, "/ck", name)
            names = sorted(e.name for e in await client.listdir("/ck"))
            assert {"logs", "step_0.staging-dead", ".hidden_1", "latest"} <= set(names)

    trio.run(check)
    code, out, _ = _cli(capsys, "retention", "ls", cf)
    assert code == 0 and "/ck\tkeep-last 2" in out
    assert _cli(capsys, "retention", "rm", cf, "/ck")[0] == 0
    assert _cli(capsys, "retention", "ls", cf)[1] == ""


@pytest.mark.parametrize(
    "argv, says",
    [
        (["set", "/", "--keep-last", "3"], "retention on / is refused"),
        (["set", "/bad", "--keep-last", "0"], "--keep-last must be 1.."),
        (["set", "/bad", "--keep-last", "-2"], "--keep-last must be 1.."),
        (["set", "/bad/nope", "--keep-last", "2"], "/bad/nope: no such directory"),
        (["set", "/bad/file", "--keep-last", "2"], "/bad/file: not a directory"),
        (["set", "/bad"], "retention set needs --keep-last N"),
        (["get", "/nowhere"], "/nowhere: no such directory"),
        (["rm", "/bad"], "/bad: no retention policy to remove"),
    ],
)
def test_bad_input_is_one_line_and_changes_nothing(cluster, capsys, argv, says) -> None:
    async def setup() -> None:
        async with open_client(cluster.client_file) as client:
            await client.mkdir("/bad", parents=True)
            await _write(client, "/bad/file", b"x")

    trio.run(setup)
    cf = str(cluster.client_file)
    code, out, err = _cli(capsys, "retention", argv[0], cf, *argv[1:])
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and says in err, err
    assert _cli(capsys, "retention", "get", cf, "/bad")[1] == "/bad\tno retention policy\n"


# --- crashes ------------------------------------------------------------------------------

# A kill comes a drawn moment after the op before it: after a commit, often mid-delete.
op_st = st.one_of(
    st.tuples(st.just("commit"), st.just(0)),
    st.tuples(st.just("kill maintenance"), st.just(0)),
    st.tuples(st.just("kill metadata"), st.integers(0, 1)),
)


@settings(
    max_examples=3,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(st.lists(st.tuples(op_st, st.floats(0, 0.5)), min_size=2, max_size=5), st.integers(1, 2))
def test_crashes_never_leave_a_half_step(cluster, ops, keep) -> None:
    """Commits, and kills -9 of the maintenance daemon or of a metadata server a drawn
    moment after the op before (mid-delete, often), each restarted: after every step of the
    sequence the newest committed step and the ``latest`` target read back bit-exact, every
    step visible under its name is whole, and in the end the policy holds and no tomb is
    left."""
    base = f"/crash-{time.monotonic_ns()}"
    state = {"step": 0}

    async def setup() -> None:
        async with open_client(cluster.client_file) as client:
            await _commit(client, base, 1)
            state["step"] = 1
            d = await client.stat(base)
            await client.meta.set_retention(d.id, keep, base)

    async def commit() -> None:
        async with open_client(cluster.client_file) as client:
            state["step"] += 1
            await _commit(client, base, state["step"])

    async def check() -> None:
        async with open_client(cluster.client_file) as client:
            steps = await _steps(client, base)
            newest = f"step_{state['step']}"
            assert steps and steps[-1] == newest, steps
            assert await client.readlink(f"{base}/latest") == newest
            for name in steps:
                await _check_whole(client, base, name)

    trio.run(setup)
    for (op, server), delay in ops:
        if op == "commit":
            trio.run(commit)
        else:
            time.sleep(delay)
            if op == "kill maintenance":
                cluster.kill_maintenance()
                cluster.start_maintenance()
            else:
                cluster.kill_metadata(server)
                cluster.start_metadata(server)
        trio.run(check)

    async def settled() -> None:
        async with open_client(cluster.client_file) as client:
            want = [f"step_{s}" for s in range(max(1, state["step"] - keep + 1), state["step"] + 1)]
            assert await _wait_for(client, base, want) == want
            for name in want:
                await _check_whole(client, base, name)

    trio.run(settled)
