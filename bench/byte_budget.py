"""byte_budget: what each pass over a checkpoint's bytes costs, alone, per GiB written.

A GiB saved through the mount is touched by a fixed list of passes (docs/byte-budget.md):
the FUSE hop, the writer's copy into its block buffer, zfec's parity, the chunks' CRC-32C,
the AES-GCM tag of every frame on send and again on receive, the loopback socket (the kernel
copies in and out), the chunk store's segment CRCs and its pwrite + fsync. This script runs
each pass by itself, with the project's own functions, over the bytes one GiB of checkpoint
makes it touch (RS(6,3): 1.5 GiB of chunks), and prints CPU-seconds per GiB of checkpoint.
Their sum beside the end-to-end figure of ``bench.bench_save`` says what is left to cut.

``python -m bench.byte_budget [--mib 1024] [--json]``
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from bench.common import print_results, warm_memory
from tectonic_py.client.codec import encode_block
from tectonic_py.core.auth import _gmac
from tectonic_py.core.checksum import checksum, segment_checksums
from tectonic_py.core.ec_policy import ECPolicy

MiB = 1024 * 1024
GiB = 1024 * MiB
CHUNK = 4 * MiB
SEGMENT = 64 * 1024


def _cpu(fn: Callable[[], object]) -> float:
    """CPU-seconds of this process (all its threads) while ``fn`` runs."""
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def measure(total: int) -> dict[str, Any]:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    policy = ECPolicy.parse("rs-6-3")
    k, n = policy.k, policy.n
    block_len = k * CHUNK
    blocks = max(1, total // block_len)
    scale = GiB / (blocks * block_len)  # per GiB of checkpoint
    src = bytearray(os.urandom(block_len))
    buf = bytearray(block_len)
    encoded = encode_block(policy, src, CHUNK)
    chunks = [memoryview(c) for c in encoded.chunks]
    key = os.urandom(16)
    aead = AESGCM(key)
    head = b"\0" * 64
    out: dict[str, Any] = {}

    def per_gib(name: str, fn: Callable[[], object]) -> None:
        out[name] = round(_cpu(fn) * scale, 3)

    def copies() -> None:
        for _ in range(blocks):
            for off in range(0, block_len, MiB):  # the FUSE writes' 1 MiB pieces
                buf[off : off + MiB] = src[off : off + MiB]

    per_gib("writer copy into the block buffer (1 GiB)", copies)
    per_gib(
        "zfec parity + CRC-32C of n chunks (encode_block)",
        lambda: [encode_block(policy, src, CHUNK) for _ in range(blocks)],
    )
    per_gib(
        "CRC-32C of n chunks alone (1.5 GiB)",
        lambda: [checksum(c) for _ in range(blocks) for c in chunks],
    )
    per_gib(
        "AES-GCM tag of n chunks (1.5 GiB; paid on send and on receive)",
        lambda: [_gmac(aead, key, 1, head, c) for _ in range(blocks) for c in chunks],
    )
    per_gib(
        "store's segment CRCs of n chunks (1.5 GiB)",
        lambda: [segment_checksums(c, SEGMENT) for _ in range(blocks) for c in chunks],
    )
    out["loopback send + receive of n chunks (1.5 GiB, both ends)"] = round(
        _loopback(chunks, blocks) * scale, 3
    )
    warm_memory(min(6 * GiB, 4 * total))
    out["store pwrite + fsync of n chunks (1.5 GiB, over 9 files each block)"] = round(
        _disk(chunks, blocks) * scale, 3
    )
    out["sum of the passes"] = round(sum(v for name, v in out.items() if "alone" not in name), 3)
    out["chunks per GiB"] = round(blocks * n * scale, 1)
    return out


def _loopback(chunks: list[memoryview], blocks: int) -> float:
    a, b = _tcp_pair()
    total = sum(c.nbytes for c in chunks) * blocks

    def drain() -> None:
        sink = bytearray(CHUNK)
        view = memoryview(sink)
        got = 0
        while got < total:
            got += b.recv_into(view)

    t0 = time.process_time()
    reader = threading.Thread(target=drain)
    reader.start()
    for _ in range(blocks):
        for c in chunks:
            a.sendall(c)
    reader.join()
    used = time.process_time() - t0
    a.close()
    b.close()
    return used


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
    return a, b


def _disk(chunks: list[memoryview], blocks: int) -> float:
    with tempfile.TemporaryDirectory(prefix="byte-budget-") as d:
        t0 = time.process_time()
        for i in range(blocks):
            for j, c in enumerate(chunks):
                fd = os.open(os.path.join(d, f"{i}.{j}"), os.O_WRONLY | os.O_CREAT, 0o644)
                try:
                    os.pwrite(fd, c, 0)
                    os.fsync(fd)
                finally:
                    os.close(fd)
        return time.process_time() - t0


def _table(results: dict[str, Any]) -> str:
    lines = ["| pass | CPU-s per GiB of checkpoint |", "|---|---:|"]
    lines += [f"| {name} | {v} |" for name, v in results.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="checkpoint MiB (default 1024)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    print_results(measure(args.mib * MiB), args.json, _table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
