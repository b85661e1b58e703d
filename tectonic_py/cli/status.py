"""``tectonic status CLUSTER_FILE``: what an operator needs to see before and after a fault.

It shows the chunk stores as the node registry knows them (up/down, failure domain,
capacity, free space, chunk count, load), the metadata servers and the shards each hosts,
and the blocks that are degraded: blocks with fewer than k+m good chunks. A chunk is not
good when its node is down (found from the Block layer's reverse index of every down node,
``blocks_on_node``), when the Block layer records it as bad (a reader found it corrupt, the
inventory found it gone from its store or replaced, it was never stored: a block committed
short) or when an up store's scrub reports it; repair sees the same
(``tectonic_py.maintenance.repair``). No block is scanned that is not suspect, so the cost
grows with what is broken, not with the cluster. A block with fewer than k good chunks
cannot be read until a node comes back, so it is reported as ``lost``.

What status cannot see without walking the namespace (a file whose block record is gone, a
chunk pointed at a store that lacks it until the next inventory pass) it takes from the last
``tectonic fsck``, whose summary and age it shows (``last_fsck``; fsck_summary.py says why
status does not walk). Data lost at the last fsck makes the exit code 3 as well. The exit code is 3 when the cluster cannot serve everything (a block
is lost, or a metadata server is down: its shards' names and files are unreachable), so
scripts can alert on it; 1 is an error of the command itself (one line on stderr), 2 a usage
error (argparse).

Repair rebuilds a lost chunk on a node in a failure domain its block does not use yet, so a
layout needs more failure domains with live chunk stores than the k+m chunks of a block:
with exactly k+m, the next lost store leaves its chunks nowhere to go; with fewer, lost
chunks cannot be rebuilt at all. ``warnings`` says so (the exit code stays 0: every block is
still readable), naming the policy and what to add.

With a metadata server down, the degraded blocks of down chunk stores may be unknowable
(the reverse index is spread over every shard): ``degraded_blocks`` is then null and
``degraded_error`` says why, rather than a short list that would look complete.

A chunk that is missing or corrupt on a live node shows once something found it: a reader,
the scrub, or the inventory pass of ``tectonic maintenance`` (or ``tectonic repair
--inventory`` now).

``--json`` prints one object::

    {"cluster": str, "nodes": [{node_id, address, failure_domain, state, capacity, free,
      chunk_count, queue_depth, last_seen}],
     "metadata_servers": [{address, shards, state, error}],
     "degraded_blocks": [{block_id, ec, live, total, k, missing: [node_id or "unplaced"],
       readable}] or null,
     "degraded_error": null or str, "warnings": [str],
     "last_fsck": null or {checked_at, age_s, path, severity, counts, lost_files, lost_paths},
     "metrics": [{process, url}]}

``metrics`` lists the Prometheus endpoints the cluster directory records (``metrics.json``
and ``monitoring/targets.d``, written by ``tectonic cluster up``; tectonic_py/launch/
monitoring.py), empty for a cluster without them.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import trio

from metadata.client import MetadataClient
from tectonic_py.cli.common import EXIT_UNHEALTHY, add_cluster_file
from tectonic_py.core import cluster_file
from tectonic_py.core.aio import open_service_nursery
from tectonic_py.core.auth import Credential
from tectonic_py.core.cluster_file import ClusterConfig
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import TectonicError, Timeout, Unavailable
from tectonic_py.core.ids import ROOT_ID
from tectonic_py.core.records import NodeInfo
from tectonic_py.core.rpc_client import open_connection
from tectonic_py.core.sockets import parse_address
from tectonic_py.launch.monitoring import read_endpoints
from tectonic_py.maintenance import fsck_summary
from tectonic_py.maintenance.repair import Repairer
from tectonic_py.maintenance.runtime import Maintenance, MaintenanceSettings

log = logging.getLogger(__name__)

# a store that does not answer for its scrub report is skipped, not waited for
_SCRUB_REPORT_TIMEOUT_S = 3.0


async def probe_metadata_server(address: str, secret: bytes | Credential) -> str | None:
    """None if the server completes the authenticated handshake, else why not (one line)."""
    host, port = parse_address(address)
    try:
        async with open_connection(host, port, secret):
            return None
    except TectonicError as e:
        return str(e)


async def degraded_blocks(m: Maintenance, nodes: list[NodeInfo]) -> list[dict[str, Any]]:
    """Blocks with fewer than k+m good chunks, with how many are still good (``live``) and
    where the others were (``missing``: a node id, or "unplaced" for a chunk never stored)."""
    by_id = {n.node_id: n for n in nodes}
    repairer = Repairer(m)
    bad = await repairer.bad_chunks(by_id, scrub_timeout=_SCRUB_REPORT_TIMEOUT_S)
    work = await repairer.find_work(by_id, bad, full_scan=False)
    out = []
    for w in sorted(work, key=lambda w: w.info.block_id):
        policy = ECPolicy.parse(w.info.ec)
        placed = {c.index: c.node_id for c in w.info.chunks}
        out.append(
            {
                "block_id": w.info.block_id,
                "ec": w.info.ec,
                "live": len(w.live),
                "total": policy.n,
                "k": policy.k,
                "missing": sorted(placed.get(i) or "unplaced" for i in w.missing),
                "readable": len(w.live) >= policy.k,
            }
        )
    return out


async def gather(config: ClusterConfig) -> dict[str, Any]:
    """The whole status as one JSON-ready object. Unavailable if the registry is unreachable:
    without it nothing about the nodes is known, and a half-empty table would mislead."""
    secret = config.credential()
    servers: list[dict[str, Any]] = [
        {"address": s.address, "shards": sorted(s.shards), "state": "up", "error": None}
        for s in config.metadata_servers
    ]

    async def probe(entry: dict[str, Any]) -> None:
        error = await probe_metadata_server(entry["address"], secret)
        if error is not None:
            entry["state"], entry["error"] = "down", error

    async with trio.open_nursery() as nursery:
        for entry in servers:
            nursery.start_soon(probe, entry)
    registry = config.registry_address
    if any(s["address"] == registry and s["state"] != "up" for s in servers):
        raise Unavailable(f"cannot reach the node registry (metadata server {registry})")

    async with open_service_nursery() as nursery:
        # A server the probe found down is reported as such, not waited for.
        client = MetadataClient(
            config, nursery=nursery, reconnect_deadline=0, first_contact_deadline=0.2
        )
        m = Maintenance(config, MaintenanceSettings(), client, nursery)
        try:
            nodes = sorted(await client.nodes(), key=lambda n: n.node_id)
            degraded: list[dict[str, Any]] | None = None
            degraded_error = None
            try:
                degraded = await degraded_blocks(m, nodes)
            except TectonicError as e:
                degraded_error = str(e)
            try:
                last_fsck = await fsck_summary.last(client)
            except TectonicError as e:  # the root's shard is down: shown as a server down
                log.debug("last fsck unknown: %s", e)
                last_fsck = None
            policies = {config.default_ec, *(b["ec"] for b in degraded or [])}
            try:
                policies.add((await client.getattr(ROOT_ID)).ec)
            except TectonicError as e:  # the root's shard is down: shown as a server down
                log.debug("root policy unknown: %s", e)
        finally:
            with trio.CancelScope(shield=True):
                await m.pool.aclose()
                await client.aclose()
    return {
        "cluster": config.name,
        "nodes": [asdict(n) for n in nodes],
        "metadata_servers": servers,
        "degraded_blocks": degraded,
        "degraded_error": degraded_error,
        "last_fsck": last_fsck,
        "warnings": layout_warnings(nodes, policies),
    }


def layout_warnings(nodes: list[NodeInfo], policies: set[str]) -> list[str]:
    """Why repair could not restore a lost store's chunks in this layout, if it could not:
    for the widest policy in use, compare its k+m with the failure domains that have a live
    chunk store."""
    if not policies or not nodes:
        return []
    widest = max((ECPolicy.parse(p) for p in policies), key=lambda p: p.n)
    domains = {node.failure_domain for node in nodes if node.state == "up"}
    n = widest.n
    add = n + 1 - len(domains)
    if add <= 0:
        return []
    how = (
        f"add chunk stores in {add} more failure domain{'s' if add > 1 else ''} "
        "(a local cluster: `tectonic cluster up --dir DIR --chunkstores N`)"
    )
    if len(domains) == n:
        text = (
            f"{len(domains)} failure domains have a live chunk store, no more than the {n} "
            f"chunks of a {widest} block: if a store is lost, repair has no failure domain to "
            f"rebuild its chunks in; {how}"
        )
    else:
        text = (
            f"only {len(domains)} failure domains have a live chunk store, fewer than the {n} "
            f"chunks of a {widest} block: lost chunks cannot be rebuilt in failure domains of "
            f"their own until stores come back; {how}"
        )
    return [text]


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def render(status: dict[str, Any]) -> None:
    """Readable tables (rich); colours only where stdout is a terminal."""
    from rich.console import Console
    from rich.table import Table

    # a pipe or a log gets whole rows, not rows wrapped at rich's default of 80 columns
    console = Console() if sys.stdout.isatty() else Console(width=200)
    nodes = status["nodes"]
    up = sum(1 for n in nodes if n["state"] == "up")
    table = Table(title=f"cluster {status['cluster']}: {up} of {len(nodes)} chunk stores up")
    for col in ("node", "address", "failure domain", "state"):
        table.add_column(col)
    for col in ("capacity", "free", "used", "chunks", "load"):
        table.add_column(col, justify="right")
    for n in nodes:
        used = 1 - n["free"] / n["capacity"] if n["capacity"] else 0.0
        state = "[green]up[/]" if n["state"] == "up" else "[bold red]down[/]"
        table.add_row(
            n["node_id"],
            n["address"],
            n["failure_domain"],
            state,
            _size(n["capacity"]),
            _size(n["free"]),
            f"{used:.0%}",
            str(n["chunk_count"]),
            str(n["queue_depth"]),
        )
    console.print(table)

    meta = Table(title="metadata servers")
    for col in ("address", "shards", "state"):
        meta.add_column(col)
    for s in status["metadata_servers"]:
        shards = s["shards"]
        span = f"{len(shards)} ({shards[0]}-{shards[-1]})" if shards else "0"
        state = "[green]up[/]" if s["state"] == "up" else f"[bold red]down[/] {s['error']}"
        meta.add_row(s["address"], span, state)
    console.print(meta)

    for warning in status["warnings"]:
        console.print(f"[bold yellow]warning:[/] {warning}")
    console.print(fsck_summary.describe(status.get("last_fsck")), highlight=False)
    if status.get("metrics"):
        console.print(f"metrics: {len(status['metrics'])} endpoints (tectonic stats; --json)")
    degraded = status["degraded_blocks"]
    if degraded is None:
        console.print(f"[bold red]degraded blocks unknown:[/] {status['degraded_error']}")
        return
    if not degraded:
        console.print("no degraded blocks")
        return
    lost = [b for b in degraded if not b["readable"]]
    blocks = Table(title=f"{len(degraded)} degraded blocks, {len(lost)} unreadable")
    for col in ("block", "ec", "good chunks", "missing on"):
        blocks.add_column(col)
    for b in degraded[:50]:
        live = f"{b['live']}/{b['total']}" + ("" if b["readable"] else " [bold red]lost[/]")
        blocks.add_row(f"{b['block_id']:016x}", b["ec"], live, ", ".join(b["missing"]))
    console.print(blocks)
    if len(degraded) > 50:
        console.print(f"... and {len(degraded) - 50} more (--json lists all)")


def cmd_status(args: argparse.Namespace) -> int:
    config = cluster_file.load(args.cluster_file)

    async def run() -> dict[str, Any]:
        try:
            with trio.fail_after(args.timeout):
                return await gather(config)
        except trio.TooSlowError:
            raise Timeout(
                f"no complete answer from the cluster within {args.timeout:g} s"
            ) from None

    status = trio.run(run)
    status["metrics"] = read_endpoints(Path(args.cluster_file).resolve().parent)
    if args.json:
        json.dump(status, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        render(status)
    return 0 if healthy(status) else EXIT_UNHEALTHY


def healthy(status: dict[str, Any]) -> bool:
    """Every metadata server up, every block readable and no data lost at the last fsck:
    degraded blocks are listed, but a block with k good chunks still serves every read
    while repair restores the rest."""
    degraded = status["degraded_blocks"]
    return (
        degraded is not None
        and all(b["readable"] for b in degraded)
        and all(s["state"] == "up" for s in status["metadata_servers"])
        and not fsck_summary.says_lost(status.get("last_fsck"))
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "status",
        help="nodes, metadata servers and degraded blocks of a cluster",
        description="Show chunk stores (up/down, failure domain, capacity, free, chunks, load), "
        "metadata servers and their shards, and blocks with fewer than k+m good chunks (a "
        "down node, or a chunk found corrupt, missing or never stored); "
        "warns when a lost store's chunks could not be repaired. Exit code 3 if a metadata "
        "server is down, some block has fewer than k live chunks (unreadable) or the last "
        "fsck found data lost (status shows its summary and age; it walks nothing itself), "
        "1 if the cluster cannot be asked at all.",
    )
    add_cluster_file(p)
    p.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    p.add_argument("--timeout", type=float, default=15.0, help="seconds to wait for the cluster")
    p.set_defaults(func=cmd_status)
