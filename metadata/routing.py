"""What the metadata client's calls need of its router: a key's shard, and routed calls.

``MetadataClient`` (metadata/client.py) is the router: connections, retries, coalescing and
the following of moved shards. The calls of each layer live in modules of their own
(metadata/name_calls.py, file_calls.py, block_calls.py, checkpoint_client.py,
server_calls.py, maintenance_calls.py); each holds a ``Router`` rather than the client, so
it sees only these few methods, and nothing of the client's plumbing reaches into it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

import trio

from tectonic_py.core.cluster_file import ClusterConfig
from tectonic_py.core.errors import TectonicError

T = TypeVar("T")


class Router(Protocol):
    """Routes a call to the server that serves its shard (``MetadataClient``)."""

    @property
    def config(self) -> ClusterConfig: ...

    def shard_of(self, key: int) -> int:
        """The shard of an id: a Name entry's is its directory's, a record's its own."""
        ...

    def address_of(self, shard: int) -> str:
        """The address of the server serving ``shard``, as far as this client knows."""
        ...

    async def call_shard(
        self,
        shard: int,
        op: str,
        fields: dict[str, Any],
        *,
        repeat: bool = False,
        trace: dict[str, bool] | None = None,
    ) -> dict[str, Any]:
        """``op`` on ``shard``'s server, retried as is safe (``repeat``: the caller reads
        a repeated mutation's outcome; ``trace["lost"]``: a try left and got no answer)."""
        ...

    async def call_registry(self, op: str, fields: dict[str, Any] | None = None) -> dict[str, Any]:
        """``op`` on the server of the node registry (``REGISTRY_SHARD``)."""
        ...

    async def call_server(
        self, address: str, op: str, fields: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """``op`` on one server, by address (the ``server.*`` ops)."""
        ...


async def gather(jobs: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run jobs concurrently; raise the first domain error (never an exception group)."""
    results: list[Any] = [None] * len(jobs)
    errors: list[TectonicError] = []

    async def run(i: int, job: Callable[[], Awaitable[T]]) -> None:
        try:
            results[i] = await job()
        except TectonicError as e:
            errors.append(e)

    async with trio.open_nursery() as nursery:
        for i, job in enumerate(jobs):
            nursery.start_soon(run, i, job)
    if errors:
        raise errors[0]
    return results
