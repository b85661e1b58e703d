"""deploy/netns.sh: a cluster whose every daemon is a "host" (its own network namespace and
address on a bridge), with the client in the root namespace. Shows that the cluster works
across hosts, and keeps serving reads and writes when one host's link is cut.

Needs root and ``ip netns``; skipped with the reason where they are not permitted. Runs of
this test on one machine take turns through a lock file, because they would share the
bridge's address range; the script removes everything it made, even after a failure.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from test_cli_cluster import client, wait_for_status

pytestmark = [pytest.mark.netns, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "deploy" / "netns.sh"
LOCK = Path("/tmp/tectonic-netns-test.lock")


def netns(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root for ip netns, veth and bridges"
    probe = f"tectoprobe{os.getpid()}"
    made = subprocess.run(
        ["ip", "netns", "add", probe], capture_output=True, text=True, check=False
    )
    if made.returncode != 0:
        return f"ip netns add is not permitted here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def _free_subnet() -> str:
    used = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=False).stdout
    for third in range(200, 250):
        subnet = f"10.213.{third}"
        if f" {subnet}." not in used:
            return subnet
    pytest.fail("no free 10.213.X.0/24 for the test bridge")


@pytest.fixture
def netns_lock() -> Iterator[None]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    with open(LOCK, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _netns_inode(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def test_cluster_across_namespaces_survives_a_cut_host(netns_lock: None, tmp_path: Path) -> None:
    root = tmp_path / "ns"
    prefix = f"t{os.getpid() % 100000}"
    subnet = _free_subnet()
    data = os.urandom(4 * 4 * 1024 * 1024 + 4321)  # one full rs-4-2 block and a short one
    local = tmp_path / "payload.bin"
    local.write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    cluster = root / "cluster.toml"
    pids: list[int] = []
    try:
        up = netns(
            "up", str(root), "--chunkstores", "7", "--ec", "rs-4-2", "--shards", "8",
            "--subnet", subnet, "--prefix", prefix, "--node-timeout", "2",
            "--rate", "500mbit",
        )  # fmt: skip
        assert up.returncode == 0, up.stderr
        state = (root / "netns.state").read_text().split("\n")
        pids = [int(line.split()[1]) for line in state if line.startswith("pid ")]
        assert len(pids) == 8
        # every daemon in its own namespace, none in ours
        inodes = {_netns_inode(pid) for pid in pids}
        assert len(inodes) == 8 and _netns_inode(os.getpid()) not in inodes
        assert f'address = "{subnet}.10:7100"' in cluster.read_text()

        client("put", cluster, "/across.bin", local)
        assert client("get", cluster, "/across.bin") == digest
        _, st = wait_for_status(cluster, lambda s: len(s["nodes"]) == 7, "7 nodes")
        assert {n["address"] for n in st["nodes"]} == {f"{subnet}.{100 + i}:7200" for i in range(7)}

        # host cs2 loses its link: the registry marks it down, reads rebuild its chunks
        cut = netns("cut", str(root), "cs2")
        assert cut.returncode == 0, cut.stderr
        _, st = wait_for_status(
            cluster,
            lambda s: any(n["node_id"] == "cs2" and n["state"] == "down" for n in s["nodes"]),
            "cs2 down",
        )
        assert all(b["missing"] == ["cs2"] and b["readable"] for b in st["degraded_blocks"])
        assert client("get", cluster, "/across.bin") == digest
        # new writes go to the six hosts still reachable
        client("put", cluster, "/after-cut.bin", local)
        assert client("get", cluster, "/after-cut.bin") == digest

        heal = netns("heal", str(root), "cs2")
        assert heal.returncode == 0, heal.stderr
        wait_for_status(cluster, lambda s: all(n["state"] == "up" for n in s["nodes"]), "all up")
    finally:
        down = netns("down", str(root))
    assert down.returncode == 0, down.stderr
    assert not (root / "netns.state").exists()
    namespaces = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, check=False
    ).stdout
    assert f"{prefix}-" not in namespaces
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False).stdout
    assert f"{prefix}-" not in links
    for pid in pids:
        for _ in range(50):
            if not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie":
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"daemon {pid} still runs after down")


def test_script_refuses_bad_options_without_making_anything(
    netns_lock: None, tmp_path: Path
) -> None:
    for args, needle in [
        (["--subnet", "192.168.1"], "--subnet"),
        (["--prefix", "Bad-Prefix"], "--prefix"),
        (["--chunkstores", "0"], "--chunkstores"),
        (["--bogus"], "unknown option"),
    ]:
        proc = netns("up", str(tmp_path / "x"), *args)
        assert proc.returncode != 0
        assert needle in proc.stderr
        assert not (tmp_path / "x" / "netns.state").exists()
    proc = netns("cut", str(tmp_path / "x"), "cs0")
    assert proc.returncode != 0 and "no cluster recorded" in proc.stderr


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd-server is not installed")
def test_metadata_on_etcd_survives_the_loss_of_a_metadata_host_and_an_etcd_host(
    netns_lock: None, tmp_path: Path
) -> None:
    """Three etcd members and two metadata servers, each its own host: cut the host of the
    metadata server that owns the registry and the root, and one etcd host; the namespace
    is still all there and writable through the survivor."""
    root = tmp_path / "ns"
    prefix = f"e{os.getpid() % 100000}"
    subnet = _free_subnet()
    local = tmp_path / "payload.bin"
    local.write_bytes(os.urandom(300_000))
    digest = hashlib.sha256(local.read_bytes()).hexdigest()
    cluster = root / "cluster.toml"
    try:
        up = netns(
            "up", str(root), "--chunkstores", "4", "--ec", "rs-2-1", "--shards", "8",
            "--metadata-servers", "2", "--metadata-engine", "etcd", "--subnet", subnet,
            "--prefix", prefix, "--node-timeout", "3",
        )  # fmt: skip
        assert up.returncode == 0, up.stderr
        text = cluster.read_text()
        assert 'kind = "etcd"' in text and f"{subnet}.52:2379" in text
        client("put", cluster, "/before.bin", local)

        assert netns("cut", str(root), "md0").returncode == 0
        assert netns("cut", str(root), "et0").returncode == 0
        deadline = time.monotonic() + 60
        while True:
            try:
                client("put", cluster, "/after.bin", local)
                break
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        assert client("get", cluster, "/before.bin") == digest
        assert client("get", cluster, "/after.bin") == digest
    finally:
        down = netns("down", str(root))
    assert down.returncode == 0, down.stderr
