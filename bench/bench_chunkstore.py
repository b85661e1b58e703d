"""Chunk store put/get throughput over loopback, as a ratio to the same disk measured in the run.

Run: ``.venv/bin/python bench/bench_chunkstore.py [--smoke] [--dir DIR] [--total-mib N]
[--repeat R] [--sizes 1,4]``.

What it does, in one run on one disk:

1. ceilings (``bench.ceilings``): the disk's sequential write ending in fsync and its
   sequential read with the file's pages dropped first (cold), each done two ways, buffered
   in 1 MiB pieces and O_DIRECT in 4 MiB requests, measured just before and just after
   every case; the case is compared with the highest of the four. Why both ways: in this VM
   the buffered figures are at times bound by the guest's CPU, not the disk (a cold
   buffered read ran 0.65-1.1 GB/s in some runs and 2.1-2.3 in others, while O_DIRECT read
   2.3-3.9 throughout; ``ceilings.disk_read_direct``), and a ceiling that is low for a
   reason of its own would flatter the ratio. Why before and after: the disk's speed swings
   by 2-3x within minutes;
2. starts ``tectonic chunkstore`` as a separate process on 127.0.0.1 with its data directory
   on the same disk, so the daemon and this client each have their own interpreter;
3. for each size (``--sizes``, 1 MiB and 4 MiB): puts ``--total-mib`` of chunks with 16
   requests in flight (each put is acknowledged only after fsync of the chunk and its
   directory), writes as many files of the chunks' size straight to disk the way puts do
   (``files MB/s`` of puts: O_DIRECT write of a new file, fsync, rename, fsync of the
   directory, 16 at once, no daemon; ``ceilings.files_write_direct``), drops the chunk
   files' pages, then gets them all back (verified, cold) with 16 in flight, reads the same
   chunk files straight from disk (``files MB/s`` of gets: one O_DIRECT read per file, 16
   at once, no daemon; ``ceilings.files_read_direct``), and deletes them. ``--sizes 1``
   measures a store that sees one chunk size, as a cluster's stores mostly do (a block's
   chunks are all ``C`` bytes).

It prints MB/s (10^6 bytes), the ratio to the matching disk ceiling (put / raw write, get /
raw read; target >= 0.7 for both), the four ceilings it was the highest of, and CPU-seconds per GiB of the client and the daemon,
which are steadier than MB/s on a shared machine.
Nothing here is asserted: the test suite only runs ``--smoke`` so this script cannot rot.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import trio

from bench.ceilings import (
    disk_read,
    disk_read_direct,
    disk_write,
    disk_write_direct,
    drop_file_cache,
    files_read_direct,
    files_write_direct,
)
from bench.common import process_cpu
from chunkstore import layout
from chunkstore.client import ChunkClient
from tectonic_py.core import capability, ids, rpc_client
from tectonic_py.core.checksum import checksum

MiB = 1024 * 1024
GiB = 1024 * MiB
NODE = "bench-node"


def start_daemon(
    data_dir: Path, secret_file: Path, extra: list[str] | None = None
) -> tuple[subprocess.Popen[bytes], int]:
    ready = data_dir.parent / "ready.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tectonic_py.cli.main",
            "chunkstore",
            "--data-dir",
            str(data_dir),
            "--listen",
            "127.0.0.1:0",
            "--node-id",
            NODE,
            "--failure-domain",
            "bench",
            "--secret-file",
            str(secret_file),
            "--capability-key-file",
            str(secret_file.with_name("capability_key")),
            "--ready-file",
            str(ready),
            *(extra or []),
        ],
        cwd=REPO,
    )
    for _ in range(600):
        if ready.exists():
            return proc, int(json.loads(ready.read_text())["address"].rsplit(":", 1)[1])
        if proc.poll() is not None:
            raise SystemExit(f"chunk store exited with {proc.returncode}")
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    raise SystemExit("chunk store did not become ready")


async def run_case(
    port: int,
    secret: bytes,
    key: bytes,
    daemon_pid: int,
    data_dir: Path,
    raw_dir: Path,
    chunk: int,
    total: int,
    inflight: int,
) -> list[dict[str, Any]]:
    count = max(total // chunk, 1)
    data = os.urandom(chunk)
    crc = checksum(data)
    chunk_ids, caps = _chunk_ids(key, count)
    results = []
    async with rpc_client.open_connection("127.0.0.1", port, secret) as conn:
        client = ChunkClient(conn)

        async def run(op: str) -> dict[str, Any]:
            queue = iter(chunk_ids)
            bufs = [bytearray(chunk) for _ in range(inflight)]

            async def worker(buf: bytearray) -> None:
                for cid in queue:
                    if op == "put":
                        await client.put(cid, data, caps[cid], checksum=crc)
                    else:
                        view = await client.get(cid, into=buf)
                        assert len(view) == chunk

            c0, d0, t0 = time.process_time(), process_cpu(daemon_pid), time.perf_counter()
            async with trio.open_nursery() as n:
                for buf in bufs:
                    n.start_soon(worker, buf)
            seconds = time.perf_counter() - t0
            client_cpu, daemon_cpu = time.process_time() - c0, process_cpu(daemon_pid) - d0
            nbytes = chunk * count
            return {
                "op": op,
                "chunk_mib": chunk / MiB,
                "chunks": count,
                "bytes": nbytes,
                "seconds": seconds,
                "mbps": nbytes / seconds / 1e6,
                "client_cpu_s_per_gib": client_cpu / (nbytes / GiB),
                "daemon_cpu_s_per_gib": daemon_cpu / (nbytes / GiB),
            }

        results.append(await run("put"))
        # What the disk does for the writes puts make, as many at once, with no daemon
        # (``ceilings.files_write_direct``): the store's puts against the disk's own speed.
        files = files_write_direct(raw_dir, count, layout.file_size_for(chunk), inflight)
        results[-1]["files_mbps"] = files["mbps"]
        results[-1]["files_ratio"] = results[-1]["mbps"] / files["mbps"]
        chunk_files = list((data_dir / "chunks").rglob("*.*"))
        for path in chunk_files:
            drop_file_cache(path)
        results.append(await run("get"))
        # The same files read straight from disk, the same number at once: the disk's own
        # speed for the reads gets make (``ceilings.files_read_direct``).
        files = files_read_direct(chunk_files, inflight)
        results[-1]["files_mbps"] = files["mbps"]
        results[-1]["files_ratio"] = results[-1]["mbps"] / files["mbps"]
        await _delete_all(client, key, chunk_ids)
    return results


def _chunk_ids(key: bytes, count: int) -> tuple[list[str], dict[str, bytes]]:
    """``count`` chunk ids with their put capabilities. One block per chunk would need a token
    each; indexes 0..255 of a few blocks keep the ids realistic (one block's chunks) while
    covering many chunks."""
    chunk_ids: list[str] = []
    caps: dict[str, bytes] = {}
    for i in range(count):
        if i % 256 == 0:
            block = ids.new_id()
            cap = capability.issue(key, block, [NODE])
        cid = ids.chunk_id(block, i % 256)
        chunk_ids.append(cid)
        caps[cid] = cap
    return chunk_ids, caps


async def _delete_all(client: ChunkClient, key: bytes, chunk_ids: list[str]) -> None:
    """Empty the store for the next case, each delete with its own capability."""
    async with trio.open_nursery() as n:
        for cid in chunk_ids:
            block_id, index = ids.parse_chunk_id(cid)
            dcap = capability.issue(key, block_id, [NODE], op="delete", index=index)
            n.start_soon(client.delete, cid, dcap)


def _ceilings(raw_dir: Path, total: int) -> dict[str, dict[str, float]]:
    """The raw disk's fsync'ed sequential write and cold read speeds (MB/s), by op, each
    buffered and O_DIRECT (``bench.ceilings``)."""
    buffered_w = disk_write(raw_dir, total)
    buffered_r = disk_read(raw_dir, total)
    os.unlink(buffered_w["path"])
    direct_w = disk_write_direct(raw_dir, total)
    direct_r = disk_read_direct(raw_dir, total)
    os.unlink(direct_w["path"])
    return {
        "put": {"buffered": buffered_w["mbps"], "direct": direct_w["mbps"]},
        "get": {"buffered": buffered_r["mbps"], "direct": direct_r["mbps"]},
    }


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks it runs")
    parser.add_argument("--dir", type=Path, help="scratch directory on the disk to measure")
    parser.add_argument("--total-mib", type=int, default=512, help="MiB per case")
    parser.add_argument("--inflight", type=int, default=16)
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="rounds; the median ratio is kept (round 0 creates the store's files, later"
        " rounds reuse them, as a store that rotates checkpoints does)",
    )
    parser.add_argument(
        "--sizes",
        default="1,4",
        help="chunk sizes in MiB, comma-separated (the cases of a round, in order, on one store)",
    )
    parser.add_argument("--json", action="store_true", help="print results as JSON too")
    return parser.parse_args()


def _key_file(path: Path) -> bytes:
    """A fresh random key written 0600 (the daemons refuse key files others can read)."""
    key = secrets.token_hex(32).encode()
    path.write_bytes(key)
    path.chmod(0o600)
    return key


def _measure(args: argparse.Namespace, scratch: Path, total: int) -> list[dict[str, Any]]:
    """Every round of every case against one daemon, each case bracketed by ceilings.

    The machine is shared and its disk's speed swings by 2-3x within minutes: each case is
    bracketed by ceilings measured on the same disk just before and just after it, buffered
    and O_DIRECT, and compared with the highest, so that a ceiling that dipped at the wrong
    moment cannot flatter the ratio. One case's "after" is the next one's "before".
    """
    sizes = [int(x) * MiB for x in args.sizes.split(",")]
    secret = _key_file(scratch / "secret")
    key = _key_file(scratch / "capability_key")  # the capability key: daemon and bench only
    data_dir, raw_dir = scratch / "data", scratch / "raw"
    raw_dir.mkdir()
    proc = None
    rows: list[dict[str, Any]] = []
    try:
        proc, port = start_daemon(data_dir, scratch / "secret")
        disk_write(raw_dir, min(total, 64 * MiB))  # warm-up: first writes pay page-cache setup
        before = _ceilings(raw_dir, total)
        for rnd in range(args.repeat):
            for size in sizes:
                case = trio.run(
                    run_case, port, secret, key, proc.pid, data_dir, raw_dir, size,
                    max(total, size), args.inflight,
                )  # fmt: skip
                after = _ceilings(raw_dir, total)
                for r in case:
                    r["round"] = rnd
                    r["ceilings_mbps"] = {
                        way: [before[r["op"]][way], after[r["op"]][way]]
                        for way in ("buffered", "direct")
                    }
                    r["ceiling_mbps"] = max(max(v) for v in r["ceilings_mbps"].values())
                    r["ratio"] = r["mbps"] / r["ceiling_mbps"]
                rows += case
                before = after
    finally:
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(30)
    return rows


def _print_rows(args: argparse.Namespace, total: int, rows: list[dict[str, Any]]) -> None:
    print(
        f"chunk store over loopback, {args.inflight} requests in flight,"
        f" {total // MiB} MiB per case{' (smoke)' if args.smoke else ''};"
        f" ceiling = raw disk write+fsync (put) or cold read (get), the highest of four:"
        f" buffered and O_DIRECT, each measured just before and just after the case"
    )
    print(
        f"{'rnd':>3} {'op':<4} {'chunk':>6} {'MB/s':>8} {'ceiling':>8} {'ratio':>6}"
        f" {'buffered b/a':>13} {'direct b/a':>11} {'client CPU-s/GiB':>17}"
        f" {'daemon CPU-s/GiB':>17}"
        f" {'files MB/s':>10} {'/files':>6}"
    )
    for r in rows:
        buffered, direct = (
            "/".join(f"{v:.0f}" for v in r["ceilings_mbps"][way]) for way in ("buffered", "direct")
        )
        print(
            f"{r['round']:>3} {r['op']:<4} {r['chunk_mib']:>4.0f}Mi {r['mbps']:>8.0f}"
            f" {r['ceiling_mbps']:>8.0f} {r['ratio']:>6.2f} {buffered:>13} {direct:>11}"
            f" {r['client_cpu_s_per_gib']:>17.2f} {r['daemon_cpu_s_per_gib']:>17.2f}"
            + (
                f" {r['files_mbps']:>10.0f} {r['files_ratio']:>6.2f}"
                if "files_mbps" in r
                else f" {'-':>10} {'-':>6}"
            )
        )


def _print_medians(sizes: list[int], rows: list[dict[str, Any]]) -> None:
    def median(key: str, op: str, size: int) -> float:
        return statistics.median(
            r[key] for r in rows if r["op"] == op and r["chunk_mib"] == size / MiB
        )

    print("median ratio over rounds (target >= 0.70):")
    for op in ("put", "get"):
        for size in sizes:
            print(f"  {op} {size // MiB} MiB: {median('ratio', op, size):.2f}")
    print("as a ratio to the same writes and reads straight to and from disk (files MB/s:")
    print("put-shaped writes and whole-file O_DIRECT reads of chunk-sized files, as many at")
    print("once as requests in flight, no daemon; no target, for context):")
    for op in ("put", "get"):
        for size in sizes:
            print(f"  {op} {size // MiB} MiB: {median('files_ratio', op, size):.2f}")


def main() -> int:
    args = _parse_args()
    total = (8 if args.smoke else args.total_mib) * MiB
    scratch = Path(tempfile.mkdtemp(prefix="bench-chunkstore-", dir=args.dir))
    try:
        rows = _measure(args, scratch, total)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    _print_rows(args, total, rows)
    _print_medians([int(x) * MiB for x in args.sizes.split(",")], rows)
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
