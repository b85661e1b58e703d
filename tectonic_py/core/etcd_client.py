"""A client of etcd v3 on trio, over etcd's JSON gateway (``/v3/...``, HTTP/1.1 keep-alive).

Why the gateway and httpx: the maintained Python etcd clients are gRPC-based and synchronous
or asyncio-only; the gateway is part of every etcd server, speaks the same v3 API (ranges,
transactions with compares on revisions, leases, members), and httpx runs on trio natively.
Keys and values travel base64-encoded, 64-bit numbers as decimal strings: the helpers here
hide both.

Failover: a request goes to the endpoint that answered last; a connection failure, a timeout
or an etcd error that says the member cannot serve now (no leader, leader changed, too many
requests, stopped) moves it to the next endpoint and is retried, through the one retry
helper, until ``deadline`` seconds have passed; then it raises ``Unavailable``. Every request
here is safe to repeat: reads; puts and deletes write the same thing twice; a transaction is
repeated only by callers whose transactions are idempotent under their own compares (the
metadata engine's fenced batches are). An etcd answer that refuses the request itself (a bad
request, a request too large) raises ``InvalidArgument`` at once.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Self

import httpx
import trio

from tectonic_py.core.errors import InvalidArgument, Unavailable
from tectonic_py.core.retry import RetryPolicy, retry

log = logging.getLogger(__name__)

DEFAULT_DEADLINE_S = 10.0
REQUEST_TIMEOUT_S = 5.0
PAGE = 1000
# etcd error texts that mean "this member cannot serve now; another may, or later".
_TRANSIENT = (
    "no leader",
    "leader changed",
    "too many requests",
    "server stopped",
    "request timed out",
    "timed out",
    "not capable",
    "unhealthy cluster",
    "raft: stopped",
)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def endpoint_urls(endpoints: Sequence[str]) -> list[str]:
    """Members as URLs: ``HOST:PORT`` is taken as plain HTTP."""
    return [e if "://" in e else f"http://{e}" for e in endpoints]


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's range_end)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def from_json(cls, kv: dict[str, Any]) -> KeyValue:
        return cls(
            _unb64(kv.get("key")),
            _unb64(kv.get("value")),
            int(kv.get("create_revision", 0)),
            int(kv.get("mod_revision", 0)),
            int(kv.get("version", 0)),
            int(kv.get("lease", 0)),
        )


@dataclass(frozen=True)
class Compare:
    """One compare of a transaction: ``target`` of ``key`` ``result`` ``value``.

    target: ``CREATE`` / ``MOD`` (revisions), ``VERSION``, ``VALUE`` or ``LEASE``; result:
    ``EQUAL``, ``NOT_EQUAL``, ``GREATER`` or ``LESS``. A key that does not exist has create
    revision, mod revision and version 0."""

    key: bytes
    target: str
    value: int | bytes
    result: str = "EQUAL"

    def to_json(self) -> dict[str, Any]:
        field = {
            "CREATE": "create_revision",
            "MOD": "mod_revision",
            "VERSION": "version",
            "VALUE": "value",
            "LEASE": "lease",
        }[self.target]
        value = _b64(self.value) if isinstance(self.value, bytes) else str(self.value)
        return {"key": _b64(self.key), "target": self.target, "result": self.result, field: value}


def put_op(key: bytes, value: bytes, *, lease: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        body["lease"] = str(lease)
    return {"request_put": body}


def delete_op(key: bytes, range_end: bytes | None = None) -> dict[str, Any]:
    body = {"key": _b64(key)}
    if range_end is not None:
        body["range_end"] = _b64(range_end)
    return {"request_delete_range": body}


def range_op(key: bytes, range_end: bytes | None = None) -> dict[str, Any]:
    body = {"key": _b64(key)}
    if range_end is not None:
        body["range_end"] = _b64(range_end)
    return {"request_range": body}


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int
    responses: list[dict[str, Any]]

    def ranges(self) -> list[list[KeyValue]]:
        """The key-values of each range in the branch that ran, in order."""
        return [
            [KeyValue.from_json(kv) for kv in r["response_range"].get("kvs", [])]
            for r in self.responses
            if "response_range" in r
        ]


class EtcdClient:
    """Pooled HTTP connections to the members of one etcd cluster."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        deadline: float = DEFAULT_DEADLINE_S,
        request_timeout: float = REQUEST_TIMEOUT_S,
        max_connections: int = 128,
    ) -> None:
        if not endpoints:
            raise InvalidArgument("etcd: no endpoints")
        self.endpoints = endpoint_urls(endpoints)
        self._current = 0
        self._policy = RetryPolicy(
            attempts=None, deadline=deadline, first_delay=0.05, max_delay=0.5
        )
        # A request waiting for a free connection is not an etcd failure: wait for one as
        # long as the whole deadline (etcd slow under load must not read as etcd down).
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(request_timeout, pool=deadline),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=32),
        )

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # --- plumbing --------------------------------------------------------------------------

    async def _once(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        index = self._current
        endpoint = self.endpoints[index]
        try:
            # Never cancelled mid-request: httpcore leaks a pooled connection for good when
            # a request is cancelled while the pool is contended (encode/httpcore#1093), and
            # enough of those leave every request waiting for a slot. The request is
            # bounded by its own timeout instead.
            with trio.CancelScope(shield=True):
                response = await self._http.post(f"{endpoint}{path}", json=body)
        except httpx.HTTPError as e:
            self._next_endpoint(index)
            raise Unavailable(f"etcd {endpoint}: {type(e).__name__}: {e}") from None
        try:
            answer: dict[str, Any] = response.json()
        except ValueError:
            self._next_endpoint(index)
            raise Unavailable(f"etcd {endpoint}: HTTP {response.status_code}, not JSON") from None
        if response.status_code == 200 and "error" not in answer:
            return answer
        message = str(answer.get("message") or answer.get("error") or response.status_code)
        if response.status_code >= 500 or any(t in message.lower() for t in _TRANSIENT):
            self._next_endpoint(index)
            raise Unavailable(f"etcd {endpoint}: {message}")
        raise InvalidArgument(f"etcd {endpoint}{path}: {message}")

    def _next_endpoint(self, failed: int) -> None:
        if self._current == failed:
            self._current = (failed + 1) % len(self.endpoints)

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One gateway request, failing over between members until the deadline."""
        try:
            return await retry(self._once, path, body, policy=self._policy)
        except Unavailable as e:
            raise Unavailable(f"etcd cluster unreachable: {e.message}") from None

    # --- keys ------------------------------------------------------------------------------

    async def get(self, key: bytes) -> KeyValue | None:
        kvs, _, _ = await self.range(key)
        return kvs[0] if kvs else None

    async def range(
        self, key: bytes, range_end: bytes | None = None, *, limit: int = 0, revision: int = 0
    ) -> tuple[list[KeyValue], bool, int]:
        """The key-values in [key, range_end), whether more follow, the store's revision."""
        body: dict[str, Any] = {"key": _b64(key)}
        if range_end is not None:
            body["range_end"] = _b64(range_end)
        if limit:
            body["limit"] = str(limit)
        if revision:
            body["revision"] = str(revision)
        answer = await self.call("/v3/kv/range", body)
        kvs = [KeyValue.from_json(kv) for kv in answer.get("kvs", [])]
        return kvs, bool(answer.get("more")), int(answer["header"]["revision"])

    async def scan(self, prefix: bytes, *, page: int = PAGE) -> AsyncIterator[KeyValue]:
        """Every key under ``prefix``, in key order, from one revision (a consistent view)."""
        end = prefix_end(prefix)
        start, revision = prefix, 0
        while True:
            kvs, more, rev = await self.range(start, end, limit=page, revision=revision)
            revision = revision or rev
            for kv in kvs:
                yield kv
            if not more or not kvs:
                return
            start = kvs[-1].key + b"\0"

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        answer = await self.call("/v3/kv/put", body)
        return int(answer["header"]["revision"])

    async def delete(self, key: bytes, range_end: bytes | None = None) -> int:
        body = {"key": _b64(key)}
        if range_end is not None:
            body["range_end"] = _b64(range_end)
        answer = await self.call("/v3/kv/deleterange", body)
        return int(answer.get("deleted", 0))

    async def txn(
        self,
        compare: Sequence[Compare],
        success: Sequence[dict[str, Any]],
        failure: Sequence[dict[str, Any]] = (),
    ) -> TxnResult:
        body = {
            "compare": [c.to_json() for c in compare],
            "success": list(success),
            "failure": list(failure),
        }
        answer = await self.call("/v3/kv/txn", body)
        return TxnResult(
            bool(answer.get("succeeded")),
            int(answer["header"]["revision"]),
            answer.get("responses", []),
        )

    # --- leases ----------------------------------------------------------------------------

    async def lease_grant(self, ttl: int) -> int:
        answer = await self.call("/v3/lease/grant", {"TTL": str(ttl)})
        return int(answer["ID"])

    async def lease_keepalive(self, lease: int) -> int:
        """Refresh a lease; returns its new TTL, 0 when it has expired (it is gone for good)."""
        answer = await self.call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(answer.get("result", {}).get("TTL", 0))

    async def lease_revoke(self, lease: int) -> None:
        try:
            await self.call("/v3/lease/revoke", {"ID": str(lease)})
        except InvalidArgument as e:
            if "not found" not in e.message:
                raise

    # --- members ---------------------------------------------------------------------------

    async def members(self) -> list[dict[str, Any]]:
        answer = await self.call("/v3/cluster/member/list", {})
        return list(answer.get("members", []))

    async def member_add(self, peer_url: str) -> dict[str, Any]:
        answer = await self.call("/v3/cluster/member/add", {"peerURLs": [peer_url]})
        return dict(answer["member"])

    async def member_remove(self, member_id: int) -> None:
        await self.call("/v3/cluster/member/remove", {"ID": str(member_id)})


class BlockingKeepAlive:
    """Lease keep-alives from a worker thread, with a blocking HTTP client of their own.

    Why not the event loop: a server's lease must not lapse because its event loop is
    saturated (a burst of thousands of requests on a shared machine delays every timer);
    a thread gets the interpreter every switch interval whatever the loop's backlog.
    ``send`` returns the lease's new TTL, 0 once it has expired, or None when no member
    answered within ``timeout``."""

    def __init__(self, endpoints: Sequence[str], timeout: float) -> None:
        self.endpoints = endpoint_urls(endpoints)
        self._current = 0
        self._http = httpx.Client(timeout=timeout)

    def send(self, lease: int) -> int | None:
        for attempt in range(len(self.endpoints)):
            endpoint = self.endpoints[(self._current + attempt) % len(self.endpoints)]
            try:
                r = self._http.post(f"{endpoint}/v3/lease/keepalive", json={"ID": str(lease)})
                answer = r.json()
            except (httpx.HTTPError, ValueError):
                continue
            if r.status_code == 200 and "error" not in answer:
                self._current = (self._current + attempt) % len(self.endpoints)
                return int(answer.get("result", {}).get("TTL", 0))
        return None

    def close(self) -> None:
        self._http.close()
