"""The cluster's own daemons, found so that a run counts their CPU without being told PIDs.

A per-file cost is only honest when it counts every process a file costs: the load-test
workers (the client library), and the metadata servers and chunk stores that serve them.
When the cluster runs on this machine their PIDs are found from what the run already knows:

* the addresses: the metadata servers from the cluster file, the chunk stores from the
  node registry (``node.list``);
* for each address on a loopback host, the process listening on that port: first the ready
  files of a local cluster's directory (``run/*.ready`` beside ``cluster.toml``, each
  ``{"address", "pid"}``), checked against the live process's listening sockets, then a scan
  of every process's sockets (``/proc``, through psutil) for the ports still unknown.

A daemon on another host, or one whose owner this user cannot see, is simply not counted;
``Daemons.missing`` lists such addresses, so the report says its CPU figure is partial.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tectonic_py.core.errors import TectonicError
from tectonic_py.core.sockets import parse_address

log = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")
ROLES = ("metadata", "chunkstore")


@dataclass
class Daemons:
    """The cluster's daemons on this machine: PIDs by role, and the addresses not found."""

    pids: dict[str, list[int]] = field(default_factory=lambda: {r: [] for r in ROLES})
    addresses: dict[str, list[str]] = field(default_factory=lambda: {r: [] for r in ROLES})
    missing: list[str] = field(default_factory=list)

    def all_pids(self) -> list[int]:
        return [p for role in ROLES for p in self.pids.get(role, [])]

    def describe(self) -> dict[str, Any]:
        return {"pids": self.pids, "addresses": self.addresses, "missing": self.missing}


def is_loopback(address: str) -> bool:
    host, _ = parse_address(address)
    return host in LOOPBACK_HOSTS or host.startswith("127.")


async def find_daemons(client: Any, cluster_file: str | None) -> Daemons:
    """The local daemons of the cluster ``client`` is connected to (module docstring)."""
    addresses: dict[str, list[str]] = {
        "metadata": [s.address for s in client.config.metadata_servers],
        "chunkstore": [],
    }
    try:
        addresses["chunkstore"] = [n.address for n in await client.meta.nodes() if n.address]
    except TectonicError as e:
        log.info("node list unavailable (%s): chunk stores' CPU not counted", e)
    ready = _ready_files(cluster_file)
    found = Daemons(addresses=addresses)
    unknown: dict[int, tuple[str, str]] = {}  # port -> (role, address)
    for role, addrs in addresses.items():
        for address in addrs:
            if not is_loopback(address):
                found.missing.append(address)
                continue
            pid = ready.get(address)
            if pid is not None and _listens(pid, parse_address(address)[1]):
                found.pids[role].append(pid)
            else:
                unknown[parse_address(address)[1]] = (role, address)
    if unknown:
        for port, pid in _listeners(set(unknown)).items():
            role, _ = unknown.pop(port)
            found.pids[role].append(pid)
        found.missing.extend(address for _, address in unknown.values())
    return found


def _ready_files(cluster_file: str | None) -> dict[str, int]:
    """address -> pid from the ready files of a local cluster's directory, if it is one."""
    if cluster_file is None:
        return {}
    out: dict[str, int] = {}
    for path in (Path(cluster_file).resolve().parent / "run").glob("*.ready"):
        try:
            info = json.loads(path.read_text())
            out[str(info["address"])] = int(info["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def _listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` (still) listens on TCP ``port``: a ready file outlives its
    daemon, and its PID may since have been reused."""
    import psutil

    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns)


def _listeners(ports: set[int]) -> dict[int, int]:
    """port -> pid of the process listening on each of ``ports`` (those found)."""
    import psutil

    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.Error as e:
        log.info("cannot list sockets (%s): some daemons' CPU not counted", e)
        return {}
    out: dict[int, int] = {}
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.pid and c.laddr and c.laddr.port in ports:
            out[c.laddr.port] = c.pid
    return out
