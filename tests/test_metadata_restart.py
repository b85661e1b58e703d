"""A metadata server that takes longer to come back than a few retries: the client's calls
wait out its restart up to the reconnect deadline (also those of a client that first tries
to reach it during the outage), and a server that stays down is said in bounded time, with
the op, the shard and the seconds waited."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import trio
from test_metadata_crash import REPO, SHARDS, list_all, spawn, stop, wait_ready

from metadata.client import RECONNECT_DEADLINE_S, MetadataClient, reconnect_policy
from tectonic_py.core.aio import open_service_nursery
from tectonic_py.core.cluster_file import ClusterConfig, MetadataServer
from tectonic_py.core.errors import ShardUnavailable, TectonicError
from tectonic_py.core.ids import ROOT_ID

# Longer than the 10 s the client used to wait: the restart the failing burst saw.
OUTAGE_S = 12.0


def _dead_address() -> str:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.slow
async def test_creates_wait_out_a_slow_restart(tmp_path, secret_file):
    """kill -9; 64 tasks of a client that knew the server, and a fresh client that first
    tries to reach it during the outage, create and close files; the server comes back
    ``OUTAGE_S`` later. Every create lands, once, with the client's default deadlines."""
    assert RECONNECT_DEADLINE_S > OUTAGE_S + 10  # a restart on a loaded host fits with room
    data, ready = tmp_path / "meta", tmp_path / "ready.json"
    proc = spawn(data, secret_file, ready, "127.0.0.1:0")
    try:
        address = await wait_ready(proc, ready)
        config = ClusterConfig(
            "restart", secret_file, SHARDS, [MetadataServer(address, list(range(SHARDS)))]
        )
        async with open_service_nursery() as nursery:
            client = MetadataClient(config, nursery=nursery)
            d = await client.mkdir(ROOT_ID, "step")
            os.kill(proc.pid, signal.SIGKILL)
            await trio.to_thread.run_sync(proc.wait)
            killed_at = trio.current_time()
            fresh = MetadataClient(config, nursery=nursery)  # has never reached any server
            closed: dict[str, int] = {}
            errors: list[str] = []

            async def rank(c: MetadataClient, name: str, size: int) -> None:
                try:
                    f, token = await c.create(d.id, name)
                    await c.close(f.id, token, size, [])
                except TectonicError as e:
                    errors.append(f"{name}: {type(e).__name__}: {e}")
                    return
                closed[name] = f.id

            with trio.fail_after(OUTAGE_S + 60):
                async with trio.open_nursery() as ranks:
                    for r in range(64):
                        ranks.start_soon(rank, client, f"rank_{r:02d}", r)
                    ranks.start_soon(rank, fresh, "fresh", 99)
                    await trio.sleep(OUTAGE_S)
                    assert closed == {} and errors == []  # all still waiting
                    proc = spawn(data, secret_file, ready, address)
                    assert await wait_ready(proc, ready) == address
            assert errors == []
            assert trio.current_time() - killed_at >= OUTAGE_S
            listed = await list_all(client, d.id)
            assert listed == closed and len(listed) == 65
            for name, fid in listed.items():
                attrs = await client.getattr(fid)
                assert attrs.sealed and attrs.size == (99 if name == "fresh" else int(name[5:]))
            await fresh.aclose()
            await client.aclose()
    finally:
        stop(proc)


async def test_a_server_that_stays_down_is_said_in_bounded_time(secret_file):
    """A client that has never reached the server gives up at its first-contact deadline;
    one that has, at its reconnect deadline; both name the op, the shard and the wait."""
    address = _dead_address()
    config = ClusterConfig("down", secret_file, SHARDS, [MetadataServer(address, [*range(SHARDS)])])
    async with open_service_nursery() as nursery:
        client = MetadataClient(
            config, nursery=nursery, reconnect_deadline=30.0, first_contact_deadline=1.0
        )
        started = time.monotonic()
        with pytest.raises(ShardUnavailable) as caught:
            await client.create(ROOT_ID, "x")
        waited = time.monotonic() - started
        # The last try starts before the deadline and no wait crosses it: giving up comes
        # at most one (jittered) longest wait before the deadline.
        policy = reconnect_policy(1.0)
        assert 1.0 - policy.max_delay * (1 + policy.jitter) <= waited < 10, waited
        message = str(caught.value)
        assert address in message, message
        # create's first call is its directory's policy (file.get) in the root's shard
        assert re.search(r"during file\.get \(shard \d+\) after waiting \d+\.\d s", message)
        await client.aclose()


def test_cli_against_a_dead_cluster_fails_within_its_connect_wait(tmp_path, secret_file):
    """``tectonic ls`` against a cluster that is down: one line, exit 1, within seconds of
    ``--connect-wait`` (an interactive command does not wait the data path's minute)."""
    config = ClusterConfig(
        "down", secret_file, SHARDS, [MetadataServer(_dead_address(), [*range(SHARDS)])]
    )
    config.write(tmp_path / "cluster.toml")
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "tectonic_py.cli.main", "ls", str(tmp_path / "cluster.toml")]
        + ["--connect-wait", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    took = time.monotonic() - started
    assert out.returncode == 1, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(r"after waiting [12]\.\d s", lines[0]), out.stderr
    assert took < 30, took
