"""What the MAC on every wire frame costs: CPU-s per GiB on put and get, with and without it.

Two workloads, each run twice in this process (both ends here, so the CPU counted is client
and server together; chunk store worker threads included):

* ``wire``: the RPC layer alone, 4 MiB payloads to a sink and from a source, 8 in flight on
  one connection (the protocol's whole cost);
* ``chunkstore``: a chunk store on a temporary directory and its client, 4 MiB chunks put
  (with fsync) and got back, 8 in flight (the data path the MAC sits on).

"without" replaces the tag computation and check with no-ops (the 16 tag bytes still travel),
so the difference is the MAC's CPU alone. Each is run ``--repeat`` times, interleaved, and the run with the least CPU is kept (other
load on the host only adds). Prints one row per workload and op, with the ratios::

    .venv/bin/python bench/bench_wire_mac.py [--size 1GiB] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import trio

from chunkstore.client import ChunkClient
from chunkstore.server import ChunkStoreServer, StoreConfig
from tectonic_py.core import auth, capability, framing, ids, rpc_client, rpc_server
from tectonic_py.core.checksum import checksum
from tectonic_py.core.rpc_server import Request
from tectonic_py.core.units import parse_size

MiB, GiB = 1024 * 1024, 1024 * 1024 * 1024
MESSAGE = 4 * MiB
INFLIGHT = 8


@contextlib.contextmanager
def mac_disabled() -> Iterator[None]:
    """Tags of zeros, never checked: the same frames and bytes, none of the MAC's work."""
    zero = bytes(framing.TAG_BYTES)

    async def skip_tag(self: auth.FrameCheck, sock: Any) -> None:
        await framing.drain(sock, framing.TAG_BYTES)

    saved = (auth._gmac, auth.FrameCheck.feed, auth.FrameCheck.verify)
    auth._gmac = lambda *_: zero  # type: ignore[assignment]
    auth.FrameCheck.feed = lambda self, piece: None  # type: ignore[method-assign]
    auth.FrameCheck.verify = skip_tag  # type: ignore[method-assign]
    try:
        yield
    finally:
        auth._gmac, auth.FrameCheck.feed, auth.FrameCheck.verify = saved  # type: ignore[method-assign]


async def _workers(count: int, one: Any) -> None:
    todo = iter(range(count))

    async def worker() -> None:
        for i in todo:
            await one(i)

    async with trio.open_nursery() as nursery:
        for _ in range(INFLIGHT):
            nursery.start_soon(worker)


def _timed(fn: Any, *args: Any) -> tuple[float, float]:
    """(wall s, CPU s of this process and its threads) of ``trio.run(fn, *args)``."""
    t0, c0 = time.perf_counter(), time.process_time()
    trio.run(fn, *args)
    return time.perf_counter() - t0, time.process_time() - c0


def wire_runs(total: int) -> dict[str, tuple[float, float]]:
    secret = secrets.token_hex(32).encode()
    source = os.urandom(MESSAGE)
    count = max(1, total // MESSAGE)

    async def sink(req: Request) -> dict[str, Any]:
        return {"n": len(req.require_payload())}

    async def serve_bytes(req: Request) -> tuple[dict[str, Any], bytes]:
        return {}, source

    async def main(put: bool) -> None:
        server = rpc_server.RpcServer("bench", secret, {"sink": sink, "source": serve_bytes})
        async with trio.open_nursery() as nursery:
            _, port = await nursery.start(server.serve, "127.0.0.1", 0)
            async with rpc_client.open_connection("127.0.0.1", port, secret) as conn:
                bufs = [bytearray(MESSAGE) for _ in range(INFLIGHT)]

                async def one(i: int) -> None:
                    if put:
                        await conn.call("sink", {}, source)
                    else:
                        await conn.call("source", {}, into=bufs[i % INFLIGHT])

                await _workers(count, one)
            nursery.cancel_scope.cancel()

    return {"put": _timed(main, True), "get": _timed(main, False)}


def chunkstore_runs(total: int, directory: str | None) -> dict[str, tuple[float, float]]:
    secret = secrets.token_hex(32).encode()
    data = os.urandom(MESSAGE)
    count = max(1, total // MESSAGE)
    with tempfile.TemporaryDirectory(prefix="bench-wire-mac-", dir=directory) as tmp:
        key = secrets.token_hex(32).encode()  # the capability key, apart from the secret
        config = StoreConfig(
            data_dir=Path(tmp) / "data",
            node_id="n1",
            failure_domain="r1",
            secret=secret,
            capability_key=key,
        )
        block = ids.new_id()
        cap = capability.issue(key, block, ["n1"])
        cids = [ids.chunk_id(block, i) for i in range(count)]
        crc = checksum(data)

        async def main(put: bool) -> None:
            server = ChunkStoreServer(config)
            async with trio.open_nursery() as nursery:
                _, port = await nursery.start(server.serve)
                async with rpc_client.open_connection("127.0.0.1", port, secret) as conn:
                    client = ChunkClient(conn)
                    bufs = [bytearray(MESSAGE) for _ in range(INFLIGHT)]

                    async def one(i: int) -> None:
                        if put:
                            await client.put(cids[i], data, cap, crc)
                        else:
                            await client.get(cids[i], into=bufs[i % INFLIGHT])

                    await _workers(count, one)
                nursery.cancel_scope.cancel()

        return {"put": _timed(main, True), "get": _timed(main, False)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=GiB, help="bytes per run")
    p.add_argument("--dir", default=None, help="where the chunk store's files go")
    p.add_argument("--repeat", type=int, default=3, help="runs of each; the least CPU counts")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    gib = max(1, args.size // MESSAGE) * MESSAGE / GiB
    rows: list[dict[str, Any]] = []
    for name, run in (("wire", lambda: wire_runs(args.size)),
                      ("chunkstore", lambda: chunkstore_runs(args.size, args.dir))):  # fmt: skip
        # Interleaved, and the run with the least CPU kept: other load on the host only adds.
        runs: dict[bool, list[dict[str, tuple[float, float]]]] = {False: [], True: []}
        for _ in range(args.repeat):
            with mac_disabled():
                runs[False].append(run())
            runs[True].append(run())
        without, with_mac = ({d: min((r[d] for r in runs[m]), key=lambda x: x[1])
                              for d in ("put", "get")} for m in (False, True))  # fmt: skip
        for direction in ("put", "get"):
            (w0, c0), (w1, c1) = without[direction], with_mac[direction]
            rows.append({
                "workload": name, "op": direction,
                "cpu_s_per_gib_without": round(c0 / gib, 3),
                "cpu_s_per_gib_with": round(c1 / gib, 3),
                "added_cpu_s_per_gib": round((c1 - c0) / gib, 3),
                "cpu_ratio": round(c1 / c0, 3),
                "gib_per_s_without": round(gib / w0, 2), "gib_per_s_with": round(gib / w1, 2),
            })  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'workload':11} {'op':4} {'CPU-s/GiB off':>14} {'on':>7} {'added':>7} {'ratio':>6}"
          f" {'GiB/s off':>10} {'on':>6}")  # fmt: skip
    for r in rows:
        print(f"{r['workload']:11} {r['op']:4} {r['cpu_s_per_gib_without']:14.3f}"
              f" {r['cpu_s_per_gib_with']:7.3f} {r['added_cpu_s_per_gib']:7.3f}"
              f" {r['cpu_ratio']:6.3f} {r['gib_per_s_without']:10.2f} {r['gib_per_s_with']:6.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
