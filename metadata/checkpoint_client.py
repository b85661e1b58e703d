"""The metadata client's calls for checkpoints: a file's durability, a step's atomic commit.

``CheckpointCalls`` is a mixin of ``MetadataClient`` (metadata/client.py), which provides
the routing (``_shard``, ``_registry``, ``_gather``, ``_of``).

Durability (``durability``): ``file.get`` and ``file.blocks`` in the file's shard, one
``block.durability`` per block shard holding some of its blocks (all of them in one call,
concurrently), and the registry's node list for which stores are up; the words and their
rules are in ``tectonic_py.core.durability``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from tectonic_py.core import durability as dur
from tectonic_py.core.durability import ChunkState
from tectonic_py.core.errors import IsADirectory
from tectonic_py.core.records import Attrs

T = TypeVar("T")


class CheckpointCalls:
    """Mixin of ``MetadataClient`` (see the module docstring)."""

    async def _shard(self, shard: int, op: str, **fields: Any) -> dict[str, Any]:
        raise NotImplementedError  # provided by MetadataClient

    async def _registry(self, op: str, **fields: Any) -> dict[str, Any]:
        raise NotImplementedError  # provided by MetadataClient

    async def _gather(self, jobs: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
        raise NotImplementedError  # provided by MetadataClient

    def _of(self, key: int) -> int:
        raise NotImplementedError  # provided by MetadataClient

    async def chunk_states(self, file_id: int) -> list[ChunkState]:
        """The Block layer's record of every committed block of a file (its chunks and the
        chunks reported bad), one call per block shard."""
        r = await self._shard(self._of(file_id), "file.blocks", id=file_id)
        by_shard: dict[int, list[int]] = {}
        for _, block_id in r["blocks"]:
            by_shard.setdefault(self._of(int(block_id)), []).append(int(block_id))

        def job(shard: int, ids: list[int]) -> Callable[[], Awaitable[dict[str, Any]]]:
            return lambda: self._shard(shard, "block.durability", ids=ids)

        replies = await self._gather([job(s, ids) for s, ids in by_shard.items()])
        return [ChunkState.from_wire(b) for reply in replies for b in reply["blocks"]]

    async def durability(self, file_id: int, attrs: Attrs | None = None) -> str:
        """One of ``tectonic_py.core.durability.WORDS`` for a file (``attrs``: its attributes
        if the caller has them fresh, saving one call)."""
        if attrs is None:
            r = await self._shard(self._of(file_id), "file.get", id=file_id)
            attrs = Attrs.from_wire(r["attrs"])
        if attrs.is_dir:
            raise IsADirectory(f"{file_id} is a directory: only files have a durability")
        if not attrs.sealed:
            return dur.WRITING if attrs.writer else dur.UNSEALED
        states = await self.chunk_states(file_id)
        if not states:
            return dur.FULL
        nodes = (await self._registry("node.list"))["nodes"]
        up = {n["node_id"] for n in nodes if n.get("state") == "up"}
        return dur.classify(states, up)
