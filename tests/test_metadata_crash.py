"""kill -9 a metadata server during a stream of creates: nothing acknowledged is lost, nothing
half-done is visible, and the orphans a crash leaves are collected. A server restarted within
the client's reconnect deadline is waited for: calls made meanwhile succeed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from metadata.client import MetadataClient
from tectonic_py.core.aio import open_service_nursery
from tectonic_py.core.cluster_file import ClusterConfig, MetadataServer
from tectonic_py.core.errors import ShardUnavailable, TectonicError
from tectonic_py.core.ids import ROOT_ID

SHARDS = 8
REPO = Path(__file__).resolve().parent.parent


def key_file(secret_file: Path) -> Path:
    """The metadata server's capability key file, beside the secret (0600)."""
    path = secret_file.with_name("capability_key")
    if not path.exists():
        path.write_bytes(os.urandom(16).hex().encode())
        path.chmod(0o600)
    return path


def spawn(data: Path, secret_file: Path, ready: Path, listen: str) -> subprocess.Popen:
    ready.unlink(missing_ok=True)
    log = open(data.parent / "meta.log", "ab")  # noqa: SIM115 (the child owns it)
    try:
        return _popen(data, secret_file, ready, listen, log)
    finally:
        log.close()


def _popen(data: Path, secret_file: Path, ready: Path, listen: str, log) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tectonic_py.cli.main",
            "metadata",
            "--data-dir",
            str(data),
            "--listen",
            listen,
            "--shards",
            f"0-{SHARDS - 1}",
            "--total-shards",
            str(SHARDS),
            "--secret-file",
            str(secret_file),
            "--capability-key-file",
            str(key_file(secret_file)),
            "--ready-file",
            str(ready),
            "--writer-lease",
            "0",
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=log,
    )


async def wait_ready(proc: subprocess.Popen, ready: Path) -> str:
    for _ in range(600):
        if ready.exists():
            return json.loads(ready.read_text())["address"]
        if proc.poll() is not None:
            log = (ready.parent / "meta.log").read_text()[-2000:]
            raise AssertionError(f"metadata server exited: {log}")
        await trio.sleep(0.05)
    raise AssertionError("metadata server did not become ready")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait()


async def list_all(client: MetadataClient, dir_id: int) -> dict[str, int]:
    out: dict[str, int] = {}
    after = ""
    for _ in range(10_000):
        page, cursor = await client.readdir(dir_id, after=after, limit=500)
        out.update({e.name: e.id for e in page})
        if cursor is None:
            return out
        after = cursor
    raise AssertionError("listing did not end")


@pytest.mark.slow
async def test_kill9_during_creates_loses_nothing_acknowledged(tmp_path, secret_file):
    data, ready = tmp_path / "meta", tmp_path / "ready.json"
    proc = spawn(data, secret_file, ready, "127.0.0.1:0")
    try:
        address = await wait_ready(proc, ready)
        config = ClusterConfig(
            "crash", secret_file, SHARDS, [MetadataServer(address, list(range(SHARDS)))]
        )
        created: dict[str, int] = {}
        sealed: dict[str, int] = {}
        async with open_service_nursery() as nursery:
            # A short reconnect deadline: calls to the dead server fail while it is down.
            client = MetadataClient(config, nursery=nursery, reconnect_deadline=0.2)
            d = await client.mkdir(ROOT_ID, "step_100")
            enough = trio.Event()

            async def writer(rank: int) -> None:
                for i in range(10_000):
                    name = f"rank_{rank:03d}_{i:05d}"
                    try:
                        f, token = await client.create(d.id, name)
                        created[name] = f.id
                        await client.seal(f.id, token, rank + i)
                        sealed[name] = rank + i
                    except (ShardUnavailable, TectonicError):
                        return
                    if len(created) >= 300:
                        enough.set()

            async with trio.open_nursery() as writers:
                for rank in range(40):
                    writers.start_soon(writer, rank)
                await enough.wait()
                os.kill(proc.pid, signal.SIGKILL)  # mid-stream: requests are in flight
            proc.wait()
            assert len(created) >= 300
            # While the server is down, calls fail with a clear, retryable error.
            with pytest.raises(ShardUnavailable):
                await client.getattr(ROOT_ID)

            proc = spawn(data, secret_file, ready, address)  # same port: the cluster file names it
            assert await wait_ready(proc, ready) == address
            # The same client reconnects by itself.
            listed = await list_all(client, d.id)
            # Every acknowledged create is present, with the same file id.
            for name, fid in created.items():
                assert listed.get(name) == fid, f"acknowledged create {name} lost"
            # Every acknowledged seal is durable.
            for name, size in sealed.items():
                attrs = await client.getattr(created[name])
                assert attrs.sealed and attrs.size == size
            # Nothing half-done is visible: every listed name reaches a record.
            for name, fid in listed.items():
                assert (await client.getattr(fid)).id == fid
            # Records without a name (a create cut between its two steps) are collected;
            # records that are named are kept and marked so.
            await client.collect_orphans(0)
            for shard in range(SHARDS):
                r = await client.call_shard(
                    shard, "file.orphans", {"older_than_ns": 2**62, "limit": 10_000}
                )
                assert r["orphans"] == []
            assert await list_all(client, d.id) == listed
            for fid in listed.values():
                await client.getattr(fid)
            await client.aclose()
    finally:
        stop(proc)


@pytest.mark.slow
async def test_calls_ride_out_a_metadata_server_restart(tmp_path, secret_file):
    """kill -9, restart 1.5 s later on the same address: a client that keeps reading across
    the restart, and mutations started while the server is down, all succeed once it is
    back, none fails while it is away."""
    data, ready = tmp_path / "meta", tmp_path / "ready.json"
    proc = spawn(data, secret_file, ready, "127.0.0.1:0")
    try:
        address = await wait_ready(proc, ready)
        config = ClusterConfig(
            "restart", secret_file, SHARDS, [MetadataServer(address, list(range(SHARDS)))]
        )
        async with open_service_nursery() as nursery:
            # A deadline above the default: a loaded test machine starts a server slowly.
            client = MetadataClient(config, nursery=nursery, reconnect_deadline=30.0)
            d = await client.mkdir(ROOT_ID, "ckpt")
            reads = 0
            back = trio.Event()

            async def keep_reading() -> None:
                nonlocal reads
                while not back.is_set():
                    assert (await client.getattr(d.id)).id == d.id
                    reads += 1
                    await trio.sleep(0.02)

            async def mutate(rank: int) -> tuple[int, int]:
                f, token = await client.create(d.id, f"rank_{rank}")
                await client.seal(f.id, token, rank)
                return f.id, rank

            done: dict[int, tuple[int, int]] = {}

            async def mutate_into(rank: int) -> None:
                done[rank] = await mutate(rank)

            async with trio.open_nursery() as callers:
                callers.start_soon(keep_reading)
                await trio.sleep(0.2)
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                killed_at = trio.current_time()
                await trio.sleep(0.2)  # the pooled connections see the close
                for rank in range(8):  # none of these can leave until the server is back
                    callers.start_soon(mutate_into, rank)
                await trio.sleep(1.3)
                proc = spawn(data, secret_file, ready, address)
                assert await wait_ready(proc, ready) == address
                while len(done) < 8:
                    await trio.sleep(0.02)
                back.set()
            assert trio.current_time() - killed_at >= 1.5
            assert reads > 0
            for rank, (fid, size) in done.items():
                attrs = await client.lookup(d.id, f"rank_{rank}")
                assert attrs.id == fid and attrs.sealed and attrs.size == size
            await client.aclose()
    finally:
        stop(proc)


def test_cli_refuses_bad_settings_with_one_line(tmp_path, secret_file):
    cases = [
        (["--shards", "0-3", "--total-shards", "2"], "outside"),
        (["--shards", "x", "--total-shards", "2"], "bad shard list"),
        (["--shards", "0", "--total-shards", "0"], "at least 1"),
        (
            ["--shards", "0", "--total-shards", "1", "--secret-file", str(tmp_path / "none")],
            "secret file",
        ),
    ]
    for extra, message in cases:
        args = [
            "--data-dir",
            str(tmp_path / "d"),
            "--secret-file",
            str(secret_file),
            "--capability-key-file",
            str(key_file(secret_file)),
            *extra,
        ]
        out = subprocess.run(
            [sys.executable, "-m", "tectonic_py.cli.main", "metadata", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert out.returncode == 1, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], out.stderr
