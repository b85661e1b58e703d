"""The metadata client's calls for checkpoints: a file's durability, a step's atomic commit.

``CheckpointCalls`` is a part of ``MetadataClient`` (metadata/client.py): it holds the
client's router (metadata/routing.py) and the Name layer calls (metadata/name_calls.py).

Durability (``durability``): ``file.get`` and ``file.blocks`` in the file's shard, one
``block.durability`` per block shard holding some of its blocks (all of them in one call,
concurrently), and the registry's node list for which stores are up; the words and their
rules are in ``tectonic_py.core.durability``.

Commit (``commit_step``): the sealed check first, then ``name.commit`` (one transaction in
the parent's shard: metadata/checkpoint_ops.py). The check walks the staging tree level by
level, every directory of a level listed at once, and asks ``file.states`` once per shard
for the records found (a step's rank files share their directory's shard: one call). It
refuses the commit if any file is not sealed. Why a check before the transaction is enough:
a sealed file's bytes and blocks do not change; only a new writer could unseal it, and the
writers of a step have all closed (DCP commits after every rank's ``write_data`` returned;
a user of ``tectonic commit`` commits after the job's writers finished), so nothing the
check saw sealed changes before the commit lands. The check guards against committing a
step some writer has not finished (a rank still writing, or one that died before its
close), which would make a partial step visible.

Staging directories (``staging_dirs``, ``tree_state``, ``remove_tree``) are for the GC of
dead jobs' staging directories (tectonic_py/maintenance/gc.py).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from metadata.name_calls import NameCalls
from metadata.routing import Router, gather
from tectonic_py.core import durability as dur
from tectonic_py.core.durability import ChunkState
from tectonic_py.core.errors import (
    FileNotFound,
    InvalidArgument,
    IsADirectory,
    NotADirectory,
    TectonicError,
)
from tectonic_py.core.records import KIND_DIR, Attrs, DirEntry, validate_name

STAGING_MARK = ".staging-"  # <step>.staging-<id>: the GC knows such a directory by its name
REMOVING = ".removing"  # a staging directory the GC is removing
STATES_PAGE = 10_000
LEVEL_WIDTH = 64  # directories of one level listed at once


@dataclass
class TreeState:
    """What the walk of a staging tree found: files (and other records, not directories),
    those not sealed (path, "writing" or "unsealed"), the newest change, the directories."""

    files: int = 0
    unsealed: list[tuple[str, str]] = field(default_factory=list)
    newest_ns: int = 0
    dirs: int = 1


log = logging.getLogger(__name__)


class CheckpointCalls:
    """The calls of checkpoints (the module docstring), over the router and the Name layer
    calls a commit and the removal of a staging tree are made of."""

    def __init__(self, router: Router, names: NameCalls) -> None:
        self._r = router
        self._names = names

    async def chunk_states(self, file_id: int) -> list[ChunkState]:
        """The Block layer's record of every committed block of a file (its chunks and the
        chunks reported bad), one call per block shard."""
        r = await self._r.call_shard(self._r.shard_of(file_id), "file.blocks", {"id": file_id})
        by_shard: dict[int, list[int]] = {}
        for entry in r["blocks"]:
            block_id = entry[1]
            by_shard.setdefault(self._r.shard_of(int(block_id)), []).append(int(block_id))

        def job(shard: int, ids: list[int]) -> Callable[[], Awaitable[dict[str, Any]]]:
            return lambda: self._r.call_shard(shard, "block.durability", {"ids": ids})

        replies = await gather([job(s, ids) for s, ids in by_shard.items()])
        return [ChunkState.from_wire(b) for reply in replies for b in reply["blocks"]]

    async def durability(self, file_id: int, attrs: Attrs | None = None) -> str:
        """One of ``tectonic_py.core.durability.WORDS`` for a file (``attrs``: its attributes
        if the caller has them fresh, saving one call)."""
        if attrs is None:
            r = await self._r.call_shard(self._r.shard_of(file_id), "file.get", {"id": file_id})
            attrs = Attrs.from_wire(r["attrs"])
        if attrs.is_dir:
            raise IsADirectory(f"{file_id} is a directory: only files have a durability")
        if not attrs.sealed:
            return dur.WRITING if attrs.writer else dur.UNSEALED
        states = await self.chunk_states(file_id)
        if not states:
            return dur.FULL
        nodes = (await self._r.call_registry("node.list"))["nodes"]
        up = {n["node_id"] for n in nodes if n.get("state") == "up"}
        return dur.classify(states, up)

    # --- the atomic commit of a checkpoint step -------------------------------------------

    async def _list_all(self, dir_id: int) -> list[DirEntry]:
        out: list[DirEntry] = []
        after = ""
        while True:
            page, nxt = await self._names.readdir(dir_id, after, 10_000)
            out.extend(page)
            if nxt is None or not page:
                return out
            after = nxt

    async def _states(self, ids: list[int]) -> list[list[Any]]:
        by_shard: dict[int, list[int]] = {}
        for i in ids:
            by_shard.setdefault(self._r.shard_of(i), []).append(i)

        def job(shard: int, page: list[int]) -> Callable[[], Awaitable[dict[str, Any]]]:
            return lambda: self._r.call_shard(shard, "file.states", {"ids": page})

        jobs = [
            job(s, group[i : i + STATES_PAGE])
            for s, group in by_shard.items()
            for i in range(0, len(group), STATES_PAGE)
        ]
        return [st for reply in await gather(jobs) for st in reply["states"]]

    async def tree_state(self, dir_id: int, path: str = "") -> TreeState:
        """Walk a directory tree (the module docstring): its files' seal states and the
        newest change of any record in it (directories included)."""
        out = TreeState()
        level: list[tuple[int, str]] = [(dir_id, path)]
        names: dict[int, str] = {}
        while level:
            listed: list[list[DirEntry]] = []
            for i in range(0, len(level), LEVEL_WIDTH):
                part = level[i : i + LEVEL_WIDTH]
                listed += await gather([functools.partial(self._list_all, d) for d, _ in part])
            nxt: list[tuple[int, str]] = []
            for (_, base), entries in zip(level, listed):
                for e in entries:
                    names[e.id] = f"{base}/{e.name}"
                    if e.kind == KIND_DIR:
                        nxt.append((e.id, names[e.id]))
            level = nxt
            out.dirs += len(nxt)
        for fid, kind, sealed, writer, changed in await self._states(list(names) + [dir_id]):
            out.newest_ns = max(out.newest_ns, int(changed))
            if kind == KIND_DIR:
                continue
            out.files += 1
            if not sealed:
                out.unsealed.append((names.get(fid, str(fid)), "writing" if writer else "unsealed"))
        return out

    async def commit_step(
        self,
        dir_id: int,
        staging: str,
        final: str,
        *,
        latest: str = "",
        replace: bool = False,
    ) -> dict[str, Any]:
        """Make the staging directory ``staging`` of ``dir_id`` the step ``final``, with
        ``latest`` (if given) a symbolic link to it, in one transaction, once every file
        under it is sealed (InvalidArgument naming the first files that are not).
        ``replace``: an existing ``final`` is moved aside under a staging name (the GC
        collects it) instead of refusing. Returns ``{"id", "files", "dirs", "retired"}``."""
        for name in (staging, final, *([latest] if latest else [])):
            validate_name(name)
        attrs = await self._names.lookup(dir_id, staging)
        if not attrs.is_dir:
            raise NotADirectory(f"{staging!r} is not a directory")
        state = await self.tree_state(attrs.id, staging)
        if state.unsealed:
            shown = ", ".join(f"{p} ({why})" for p, why in state.unsealed[:5])
            more = len(state.unsealed) - 5
            raise InvalidArgument(
                f"{len(state.unsealed)} of {state.files} files under {staging!r} are not"
                f" sealed: {shown}{f' and {more} more' if more > 0 else ''}; not committed"
            )
        retire = f"{final}{STAGING_MARK}replaced-{attrs.id:016x}" if replace else ""
        r = await self._r.call_shard(
            self._r.shard_of(dir_id),
            "name.commit",
            {
                "dir": dir_id,
                "staging": staging,
                "final": final,
                "replace": replace,
                "retire": retire,
                "latest": latest,
            },
        )
        await self._after_commit(dir_id, final, int(r["id"]), int(r["old_latest"]))
        await self._end_reservation(attrs)
        return {"id": r["id"], "files": state.files, "dirs": state.dirs, "retired": r["retired"]}

    async def _after_commit(self, dir_id: int, final: str, child: int, old_latest: int) -> None:
        """Best effort, after the commit: the step's name hint (as rename refreshes it) and
        the old ``latest`` link's record when it lived in another shard (a crash before
        this leaves a record no name reaches: kept, as an interrupted unlink's is)."""
        try:
            await self._r.call_shard(
                self._r.shard_of(child), "file.link", {"id": child, "parent": dir_id, "name": final}
            )
            if old_latest:
                await self._r.call_shard(
                    self._r.shard_of(old_latest), "file.unlink", {"id": old_latest}
                )
        except TectonicError as e:
            log.info("commit of %r: after-commit bookkeeping failed: %s", final, e)

    async def _end_reservation(self, step: Attrs) -> None:
        """A step's reservation (``tectonic reserve`` of its staging directory, the DCP
        writer's) ends at its commit: the raw space at the registry, the quota's in the
        realm's shard. Best effort: one left behind lapses at its TTL."""
        try:
            await self._r.call_registry("space.release", {"dir": step.id})
            if step.realm:
                await self._r.call_shard(
                    self._r.shard_of(step.realm),
                    "quota.release",
                    {"realm": step.realm, "dir": step.id},
                )
        except TectonicError as e:
            log.info("commit of %d: its reservation is left to lapse: %s", step.id, e)

    # --- staging directories of dead jobs (for the GC) --------------------------------------

    async def staging_dirs(self, shards: int) -> list[tuple[int, str, int]]:
        """(parent id, name, directory id) of every staging directory, one scan per shard."""

        def job(shard: int) -> Callable[[], Awaitable[list[tuple[int, str, int]]]]:
            async def run() -> list[tuple[int, str, int]]:
                out: list[tuple[int, str, int]] = []
                after: list[Any] | None = [0, ""]
                while after is not None:
                    r = await self._r.call_shard(
                        shard, "name.staging", {"after": after, "limit": 1000}
                    )
                    out += [(int(d), str(n), int(c)) for d, n, c in r["entries"]]
                    after = r["next"]
                return out

            return run

        return [e for part in await gather([job(s) for s in range(shards)]) for e in part]

    async def remove_tree(self, dir_id: int, name: str, expect_id: int) -> int:
        """Remove the directory ``name`` of ``dir_id`` and everything under it, if it is
        still ``expect_id``; returns how many entries went. It is first renamed aside (one
        transaction, in its parent's shard), so a commit of it that comes after finds no
        staging directory instead of committing a tree being emptied; the new name keeps
        the staging mark, so a removal cut short is taken up by the next sweep."""
        try:
            attrs = await self._names.lookup(dir_id, name)
        except FileNotFound:
            return 0
        if attrs.id != expect_id or not attrs.is_dir:
            return 0
        tomb = name if name.endswith(REMOVING) else f"{name}{REMOVING}"
        if tomb != name:
            await self._names.rename(dir_id, name, dir_id, tomb)
        removed = await self._empty_dir(attrs.id)
        await self._names.rmdir(dir_id, tomb)
        return removed + 1

    async def _empty_dir(self, dir_id: int) -> int:
        removed = 0
        for e in await self._list_all(dir_id):
            try:
                if e.kind == KIND_DIR:
                    removed += await self._empty_dir(e.id)
                    await self._names.rmdir(dir_id, e.name)
                else:
                    await self._names.unlink(dir_id, e.name)
            except FileNotFound:
                continue
            removed += 1
        return removed
