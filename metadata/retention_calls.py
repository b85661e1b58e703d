"""The metadata client's calls of retention policies (metadata/retention_ops.py), typed, and
the retention pass over one directory (``apply_retention``).

A policy lives in its directory's shard, so each call about one directory is one call there;
``retention_policies`` asks every shard (the maintenance daemon's rounds and ``tectonic
retention ls``).

The pass (the maintenance daemon's, after each commit; the load test's, after each step):
read the targets of the directory's symbolic links (a ``latest`` link names a step to keep),
ask the directory's shard to retire the steps past the newest N in one transaction
(``retention.retire``: renamed to hidden tombs), then empty and remove each tomb, those a
pass cut short included. Two passes at once are harmless: the transaction picks each step
once, and a tomb the other pass removed first is skipped.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from metadata.checkpoint_client import CheckpointCalls
from metadata.file_calls import FileCalls
from metadata.name_calls import NameCalls
from metadata.routing import Router, gather
from tectonic_py.core.errors import FileNotFound
from tectonic_py.core.records import KIND_SYMLINK

MAX_PROTECT = 1024  # link target components sent with one retire


class RetentionCalls:
    """Calls of retention, over the router."""

    def __init__(
        self, router: Router, names: NameCalls, files: FileCalls, checkpoints: CheckpointCalls
    ) -> None:
        self._r = router
        self._names = names
        self._files = files
        self._checkpoints = checkpoints

    async def _at(self, dir_id: int, op: str, fields: dict[str, Any]) -> dict[str, Any]:
        return await self._r.call_shard(self._r.shard_of(dir_id), op, {"dir": dir_id, **fields})

    async def set_retention(self, dir_id: int, keep_last: int, path: str = "") -> None:
        """Keep the newest ``keep_last`` committed steps of the directory (``path`` is how
        listings name it)."""
        await self._at(dir_id, "retention.set", {"keep_last": keep_last, "path": path})

    async def retention_of(self, dir_id: int) -> int:
        """The directory's ``keep_last``, 0 if it has no policy."""
        return int((await self._at(dir_id, "retention.get", {}))["keep_last"])

    async def remove_retention(self, dir_id: int) -> bool:
        """Drop the directory's policy; whether it had one."""
        return bool((await self._at(dir_id, "retention.remove", {}))["existed"])

    async def retention_policies(self, shards: int) -> list[tuple[int, int, str]]:
        """(directory id, keep_last, path) of every policy, one call per shard."""

        def job(shard: int) -> Callable[[], Awaitable[dict[str, Any]]]:
            return lambda: self._r.call_shard(shard, "retention.list", {})

        replies = await gather([job(s) for s in range(shards)])
        return [(int(d), int(k), str(p)) for r in replies for d, k, p in r["policies"]]

    async def retire_steps(self, dir_id: int, protect: list[str]) -> dict[str, Any]:
        """The retention pass's one transaction over a directory (``retention.retire``)."""
        return await self._at(dir_id, "retention.retire", {"protect": protect})

    async def apply_retention(self, dir_id: int) -> list[str]:
        """One retention pass over the directory (module docstring); the names of the
        steps it retired. FileNotFound if the directory is gone (its policy goes too)."""
        r = await self.retire_steps(dir_id, await self._linked(dir_id))
        if r["dropped"]:
            raise FileNotFound(f"directory {dir_id} is gone; its retention policy with it")
        for tomb, child in r["tombs"]:
            try:
                await self._checkpoints.remove_tree(dir_id, str(tomb), int(child))
            except FileNotFound:
                pass  # another pass removed it first
        return [str(name) for name, _, _ in r["retired"]]

    async def _linked(self, dir_id: int) -> list[str]:
        """The path components of the targets of the directory's symbolic links. The server
        reads those whose records it holds itself; this covers links moved in from a
        directory of another shard."""
        names: set[str] = set()
        after = ""
        while True:
            page, nxt = await self._names.readdir(dir_id, after, 1000)
            for e in page:
                if e.kind == KIND_SYMLINK:
                    try:
                        target = await self._files.readlink(e.id)
                    except FileNotFound:
                        continue
                    names.update(target.decode("utf-8", "replace").split("/"))
            if nxt is None or not page:
                return sorted(n for n in names if n not in ("", ".", ".."))[:MAX_PROTECT]
            after = nxt
