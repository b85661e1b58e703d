"""Reading through a cut host: a deploy/netns.sh cluster (every daemon its own "host"), a
40 MB file put, then ``tectonic get`` timed healthy (the ceiling of this run) and after one
chunk store's link is cut and the registry marks it down. Prints both and their ratio.

    sudo .venv/bin/python bench/bench_netns_cut.py [--client-tree DIR] [--mb 40]

``--client-tree`` runs the client (``tectonic get``) from another source tree (e.g. an
older commit unpacked with ``git archive``), so the same run measures before and after;
the daemons always come from this tree. Needs root and ``ip netns`` (as tests/test_netns.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "deploy" / "netns.sh"


def netns(*args: str) -> None:
    proc = subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=300, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"netns.sh {args[0]} failed: {proc.stderr.strip()}")


def cli(tree: Path, *args: str) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree))
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "tectonic_py.cli.main", *args],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    took = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"tectonic {args[0]} failed: {proc.stderr.strip()}")
    return took


def wait_down(tree: Path, cluster: Path, node: str) -> None:
    for _ in range(120):
        proc = subprocess.run(
            [sys.executable, "-m", "tectonic_py.cli.main", "status", "--json", str(cluster)],
            env=dict(os.environ, PYTHONPATH=str(REPO)),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        try:
            nodes = json.loads(proc.stdout)["nodes"]
        except (ValueError, KeyError):
            nodes = []
        if any(n["node_id"] == node and n["state"] == "down" for n in nodes):
            return
        time.sleep(0.5)
    raise SystemExit(f"{node} never marked down")


# A long-lived client (a mount, a trainer): connections to every store are open when the link
# is cut, so the dead store is a blackhole for requests on them, not a refused connect.
LONG_LIVED = """
import sys, time, subprocess, trio
from tectonic_py.client.tectonic_client import open_client
cluster, script, root, node = sys.argv[1:5]

async def main():
    async with open_client(cluster) as c:
        t0 = time.monotonic(); await (await c.open_read("/warm.bin")).read()
        healthy = time.monotonic() - t0
        subprocess.run(["bash", script, "cut", root, node], check=True, capture_output=True)
        for _ in range(240):
            if any(n.node_id == node and n.state == "down" for n in await c.meta.nodes()):
                break
            await trio.sleep(0.25)
        t0 = time.monotonic(); data = await (await c.open_read("/cut.bin")).read()
        print(healthy, time.monotonic() - t0, len(data))

trio.run(main)
"""


def long_lived(tree: Path, cluster: Path, root: Path) -> tuple[float, float]:
    proc = subprocess.run(
        [sys.executable, "-c", LONG_LIVED, str(cluster), str(SCRIPT), str(root), "cs2"],
        env=dict(os.environ, PYTHONPATH=str(tree)),
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"long-lived client failed: {proc.stderr.strip()[-2000:]}")
    healthy, cut, _n = proc.stdout.split()
    return float(healthy), float(cut)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--client-tree", type=Path, default=REPO)
    ap.add_argument("--mb", type=int, default=40)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    tree = args.client_tree.resolve()
    with tempfile.TemporaryDirectory(prefix="netns-cut-") as tmp:
        root = Path(tmp) / "ns"
        data = os.urandom(args.mb * 1000 * 1000)
        local = Path(tmp) / "payload.bin"
        local.write_bytes(data)
        digest = hashlib.sha256(data).hexdigest()
        cluster = root / "cluster.toml"
        got = Path(tmp) / "got.bin"
        try:
            netns(
                "up",
                str(root),
                "--chunkstores",
                "7",
                "--ec",
                "rs-4-2",
                "--shards",
                "8",
                "--subnet",
                "10.213.240",
                "--prefix",
                "tbench",
                "--node-timeout",
                "2",
                "--rate",
                "500mbit",
            )
            cli(REPO, "put", "-q", str(cluster), str(local), "/cut.bin")
            cli(REPO, "put", "-q", str(cluster), str(local), "/warm.bin")
            ll_healthy, ll_cut = long_lived(tree, cluster, root)
            netns("heal", str(root), "cs2")
            for _ in range(120):
                proc = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "tectonic_py.cli.main",
                        "status",
                        "--json",
                        str(cluster),
                    ],
                    capture_output=True,
                    text=True,
                    env=dict(os.environ, PYTHONPATH=str(REPO)),
                    timeout=60,
                    check=False,
                )
                if '"down"' not in proc.stdout:
                    break
                time.sleep(0.5)
            healthy = [
                cli(tree, "get", "-q", str(cluster), "/cut.bin", str(got)) for _ in range(args.runs)
            ]
            netns("cut", str(root), "cs2")
            wait_down(tree, cluster, "cs2")
            cut = []
            for _ in range(args.runs):
                cut.append(cli(tree, "get", "-q", str(cluster), "/cut.bin", str(got)))
                if hashlib.sha256(got.read_bytes()).hexdigest() != digest:
                    raise SystemExit("read through the cut host returned wrong bytes")
        finally:
            netns("down", str(root))
    best_h, best_c = min(healthy), min(cut)
    print(
        f"client tree {tree}: {args.mb} MB get, healthy {', '.join(f'{t:.2f}' for t in healthy)} s;"
        f" cs2 cut and down {', '.join(f'{t:.2f}' for t in cut)} s;"
        f" cut/healthy (best) {best_c / best_h:.2f}x"
    )
    print(
        f"long-lived client (connections open at the cut): healthy {ll_healthy:.2f} s,"
        f" cs2 cut and down {ll_cut:.2f} s; cut/healthy {ll_cut / ll_healthy:.2f}x"
    )


if __name__ == "__main__":
    main()
