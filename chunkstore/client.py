"""The one typed client of the chunk store: ``ChunkClient`` (calls on one connection) and
``ChunkPool`` (persistent connections keyed by address, each behind a ``ChunkClient``).

The data path, repair and the CLI all go through it, so that field names and the end-to-end
check of returned bytes live in one place: every ``get`` verifies the bytes it received, so a
chunk is checked from disk to the caller's buffer. A ranged get is checked against the CRC
the store computed from verified disk data (ChecksumMismatch, retryable, if the bytes were
damaged on the way); the store reads and checks every chunk itself, answering ChunkCorrupt
for a damaged copy on disk. A caller that knows the CRC a chunk must have (the Block
layer's) passes it as ``expected``: a store whose own copy differs from it holds the wrong
bytes (ChunkCorrupt).
"""

from __future__ import annotations

import builtins
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from chunkstore.layout import file_size_for
from tectonic_py.core import framing, rpc_client, sockets
from tectonic_py.core.auth import Credential
from tectonic_py.core.checksum import KEEP_GIL_MAX
from tectonic_py.core.checksum import checksum as crc32c
from tectonic_py.core.errors import ChecksumMismatch, ChunkCorrupt, TectonicError, Unavailable

log = logging.getLogger(__name__)

__all__ = ["ChunkClient", "ChunkPool", "ChunkStat", "NodeStats", "Reachability", "file_size_for"]

# Up to this, computing a CRC in the event loop, holding the GIL, is cheaper than a thread
# hop and the GIL hand-offs that come with it.
_INLINE_CRC = KEEP_GIL_MAX

Crc = Callable[[bytes | bytearray | memoryview], Awaitable[int]]


@dataclass(frozen=True)
class ChunkStat:
    size: int
    checksum: int
    mtime: float


@dataclass(frozen=True)
class NodeStats:
    node_id: str
    failure_domain: str
    capacity: int
    free: int
    used: int
    chunk_count: int
    queue_depth: int
    bytes_in: int
    bytes_out: int


async def _crc(data: bytes | bytearray | memoryview) -> int:
    if memoryview(data).nbytes <= _INLINE_CRC:
        return crc32c(data, keep_gil=True)
    return await trio.to_thread.run_sync(crc32c, data)


class ChunkClient:
    """Calls on one chunk store; shares ``conn`` (many calls may be in flight at once).

    ``on_lost(address)`` is told when a call fails because the connection died (not a busy
    store), so a pool can stop sending there; ``crc`` computes checksums (a caller may run
    them on its own worker threads). ``last_answer`` is when the store last replied to
    anything on ``conn`` (trio clock; the handshake counts): a store that is slow still
    answers something now and then, a stopped one nothing."""

    def __init__(
        self,
        conn: rpc_client.Connection,
        *,
        on_lost: Callable[[str], None] | None = None,
        crc: Crc | None = None,
    ) -> None:
        self.conn = conn
        self._on_lost = on_lost
        self._crc = crc or _crc
        self.last_answer = trio.current_time()

    @property
    def address(self) -> str:
        return self.conn.address

    async def call(
        self,
        op: str,
        fields: dict[str, Any] | None = None,
        payload: framing.Buffer | None = None,
        *,
        into: bytearray | memoryview | None = None,
    ) -> rpc_client.Response:
        """One request as it is on the wire, for ops with no typed method (``scrub_report``)."""
        try:
            resp = await self.conn.call(op, fields or {}, payload, into=into)
        except Unavailable:
            if self.conn.broken is not None and self._on_lost is not None:
                self._on_lost(self.conn.address)
            raise
        except TectonicError:
            self.last_answer = trio.current_time()  # an error reply is an answer
            raise
        self.last_answer = trio.current_time()
        return resp

    async def put(
        self,
        chunk_id: str,
        data: framing.Buffer,
        cap: bytes,
        checksum: int | None = None,
        segments: bytes | None = None,
    ) -> None:
        """Store a chunk durably; returns once it is on the store's disk.

        ``checksum`` is the chunk's crc32c (computed here if not given); ``segments`` its
        segment table (``checksum.pack_table``) when the caller has it, which spares the
        store a pass over the bytes. Raises ChunkConflict
        if other bytes are stored under the id, Busy (retryable) when the store is at its
        admission limit, DiskFull, BadCapability, ChecksumMismatch.
        """
        if checksum is None:
            checksum = await self._crc(memoryview(data))
        fields: dict[str, object] = {"chunk_id": chunk_id, "checksum": checksum, "cap": cap}
        if segments is not None:
            fields["segments"] = segments
        await self.call("put", fields, data)

    async def get(
        self,
        chunk_id: str,
        offset: int = 0,
        length: int | None = None,
        *,
        into: bytearray | memoryview | None = None,
        expected: int | None = None,
    ) -> memoryview:
        """Verified bytes of a chunk (``length`` None: to its end); a view of ``into`` when a
        buffer large enough is given. ChunkCorrupt if the store's copy is damaged, or holds
        fewer bytes than ``length``; ChecksumMismatch if they were damaged on the way.

        The store checks every get against the chunk's CRCs before sending it.
        ``expected``: the CRC the bytes must have, checked instead of the store's;
        ChunkCorrupt when the store's own record of the chunk disagrees with it."""
        fields: dict[str, object] = {"chunk_id": chunk_id, "offset": offset}
        if length is not None:
            fields["length"] = length
        resp = await self.call("get", fields, into=into)
        data = resp.payload if resp.payload is not None else memoryview(b"")
        if length is not None and data.nbytes != length:
            raise ChunkCorrupt(
                f"chunk {chunk_id} on {self.address}: {data.nbytes} bytes where {length} expected"
            )
        want = expected if expected is not None else resp.fields.get("range_checksum")
        got = await self._crc(data)
        if got == want:
            return data
        if expected is not None and resp.fields.get("checksum") != expected:
            raise ChunkCorrupt(
                f"chunk {chunk_id} on {self.address} is stored under crc"
                f" {resp.fields.get('checksum')}, not the {expected:08x} recorded for it"
            )
        raise ChecksumMismatch(
            f"chunk {chunk_id} bytes {offset}+{data.nbytes} damaged in transit from"
            f" {self.address} (crc {got:08x} != {want})"
        )

    async def delete(self, chunk_id: str, cap: bytes) -> bool:
        """Remove a chunk; True if it existed. ``cap``: a delete capability for this chunk on
        this node, from the metadata service's ``block.caps`` (BadCapability without one)."""
        resp = await self.call("delete", {"chunk_id": chunk_id, "cap": cap})
        return bool(resp.fields["existed"])

    async def stat(self, chunk_id: str) -> ChunkStat:
        f = (await self.call("stat", {"chunk_id": chunk_id})).fields
        return ChunkStat(int(f["size"]), int(f["checksum"]), float(f["mtime"]))

    async def list(
        self, after: str = "", limit: int = 1000
    ) -> tuple[builtins.list[tuple[str, int]], str | None]:
        """One page of (chunk_id, size) in id order and the ``after`` of the next page."""
        f = (await self.call("list", {"after": after, "limit": limit})).fields
        return [(str(c), int(n)) for c, n in f["chunks"]], f["next"]

    async def list_all(self, page: int = 1000) -> builtins.list[tuple[str, int]]:
        """Every chunk on the store, page by page."""
        out: builtins.list[tuple[str, int]] = []
        after: str | None = ""
        while after is not None:
            chunks, after = await self.list(after, page)
            out.extend(chunks)
        return out

    async def node_stats(self) -> NodeStats:
        f = (await self.call("node_stats")).fields
        return NodeStats(**{k: f[k] for k in NodeStats.__dataclass_fields__})


class Reachability(Protocol):
    """What a pool asks before connecting and tells when a store could not be reached (the
    data-path client's view of down nodes)."""

    def backing_off(self, address: str) -> bool: ...

    def failed(self, address: str) -> None: ...


class ChunkPool:
    """Persistent connections to chunk stores, one per address, each behind a ``ChunkClient``.

    Connections are opened on first use and replaced when broken; their receiver tasks live
    in ``nursery``. A connection multiplexes many requests, so one connection per node
    carries every block's chunk for that node. With a ``reachability`` view, an address it
    says is backing off is refused at once (Unavailable), before any connect, so the tasks
    queued behind a failed connect do not each try (and time out) again. ``attempts`` counts
    the requests (and connects) sent to each address.
    """

    def __init__(
        self,
        secret: bytes | Credential,
        nursery: trio.Nursery,
        *,
        reachability: Reachability | None = None,
        attempts: dict[str, int] | None = None,
        connect_timeout: float = 3.0,
        crc: Crc | None = None,
    ) -> None:
        self._secret = secret
        self._nursery = nursery
        self._view = reachability
        self.attempts: dict[str, int] = attempts if attempts is not None else {}
        self.connect_timeout = connect_timeout
        self._crc = crc
        self._clients: dict[str, list[ChunkClient]] = {}
        self._locks: dict[str, trio.Lock] = {}

    async def client(self, address: str) -> ChunkClient:
        """A client on a live connection to ``address``, for one request (counted)."""
        client, connected = await self._get(address)
        if not connected:
            self._attempt(address)  # a connect already counted as this request's attempt
        return client

    async def call(
        self,
        address: str,
        op: str,
        fields: dict[str, Any],
        payload: framing.Buffer | None = None,
        *,
        into: memoryview | None = None,
    ) -> rpc_client.Response:
        """One request as it is on the wire (``ChunkClient.call``) to ``address``."""
        return await (await self.client(address)).call(op, fields, payload, into=into)

    async def aclose(self) -> None:
        for clients in self._clients.values():
            for c in clients:
                with trio.CancelScope(shield=True):
                    await c.conn.aclose()
        self._clients.clear()

    def silent_for(self, address: str) -> float:
        """Seconds since a connection to ``address`` last got any reply (0 with none open)."""
        clients = [c for c in self._clients.get(address, []) if c.conn.broken is None]
        if not clients:
            return 0.0
        return trio.current_time() - max(c.last_answer for c in clients)

    def drop(self, address: str) -> None:
        """Close every connection to ``address`` now, failing the calls on them (Unavailable).

        For a store that stopped answering (SIGSTOP, a hung disk): its connections are open
        but nothing comes back, so every request sent on them would wait as long as it stays
        stopped. Dropping them makes those requests fail at once (their callers go
        elsewhere), and a reply sent after the store resumes can only reach a closed socket.
        """
        for c in self._clients.pop(address, []):
            self._nursery.start_soon(c.conn.aclose)

    def _check_backoff(self, address: str) -> None:
        if self._view is not None and self._view.backing_off(address):
            raise Unavailable(f"chunk store {address} was unreachable moments ago (backing off)")

    def _attempt(self, address: str) -> None:
        self.attempts[address] = self.attempts.get(address, 0) + 1

    async def _get(self, address: str) -> tuple[ChunkClient, bool]:
        """A client of a live connection to ``address``, and whether a connect was attempted
        for it."""
        if not address:
            raise Unavailable("chunk store address unknown (node not registered)")
        clients = self._clients.setdefault(address, [])
        clients[:] = [c for c in clients if c.conn.broken is None]
        if clients:
            return clients[-1], False
        self._check_backoff(address)
        lock = self._locks.setdefault(address, trio.Lock())
        async with lock:
            clients[:] = [c for c in clients if c.conn.broken is None]
            if clients:
                return clients[-1], False
            self._check_backoff(address)
            self._attempt(address)
            conn = await self._connect(address)
            on_lost = self._view.failed if self._view is not None else None
            clients.append(ChunkClient(conn, on_lost=on_lost, crc=self._crc))
            return clients[-1], True

    async def _connect(self, address: str) -> rpc_client.Connection:
        """Connect within ``connect_timeout``: a cut link blackholes SYNs (no RST comes
        back), and the kernel's own retries would take minutes."""
        host, port = sockets.parse_address(address)
        try:
            with trio.move_on_after(self.connect_timeout) as scope:
                return await rpc_client.Connection.connect(
                    host, port, self._secret, nursery=self._nursery
                )
            assert scope.cancelled_caught
            raise Unavailable(f"cannot connect to {address}: no answer in {self.connect_timeout}s")
        except Unavailable:
            if self._view is not None:
                self._view.failed(address)
            raise
