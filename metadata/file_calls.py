"""The metadata client's File layer calls: attributes, the write path, a file's blocks.

Routing: every call goes to ``shard_of(file_id)``.

commit_blocks / close: a writer's blocks are allocated in its file's shard
(metadata/block_calls.py), so the Block layer commit, the File layer append (and for
``close`` the seal) are one transaction there (``file.commit``, ``file.close``). Blocks in
other shards are committed there first. Crash: a committed block no file references (GC),
never a file pointing at an uncommitted block.

Directory policies (EC scheme and chunk size that new files inherit) are cached for
``DIR_POLICY_TTL_S``: a policy change reaches other clients' new files within that time.
The cache is filled from every directory's attributes this client reads.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from metadata.block_calls import BlockCalls
from metadata.routing import Router, gather
from tectonic_py.core.errors import FileSealed, NotADirectory, TectonicError, error_from_code
from tectonic_py.core.ids import ROOT_ID
from tectonic_py.core.records import Attrs, BlockInfo, PackedExtent, Patch

DIR_POLICY_TTL_S = 2.0


class FileCalls:
    """File layer calls, and the cache of directories' policies."""

    def __init__(self, router: Router, blocks: BlockCalls) -> None:
        self._r = router
        self._blocks = blocks
        self._dir_policy: dict[int, tuple[float, str, int, int, int]] = {}

    async def _at(self, file_id: int, op: str, fields: dict[str, Any]) -> dict[str, Any]:
        return await self._r.call_shard(self._r.shard_of(file_id), op, {"id": file_id, **fields})

    # --- attributes, and the policies directories give new files ---------------------------

    async def getattr(self, file_id: int) -> Attrs:
        r = await self._at(file_id, "file.get", {})
        attrs = Attrs.from_wire(r["attrs"])
        self.note_policy(attrs)
        return attrs

    def note_policy(self, attrs: Attrs) -> None:
        """Remember a directory's policy, read with its attributes (module docstring)."""
        if attrs.is_dir:
            self._dir_policy[attrs.id] = (
                time.monotonic() + DIR_POLICY_TTL_S,
                attrs.ec,
                attrs.chunk_size,
                attrs.realm,
                attrs.realm_key,
            )

    def forget_policy(self, dir_id: int) -> None:
        """The directory changed or went: its policy is read afresh next time."""
        self._dir_policy.pop(dir_id, None)

    async def policy(self, dir_id: int) -> tuple[str, int]:
        """(EC scheme, chunk size) new files of ``dir_id`` inherit."""
        cached = self._dir_policy.get(dir_id)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1], self._chunk_size(dir_id, cached[2])
        attrs = await self.getattr(dir_id)
        if not attrs.is_dir:
            raise NotADirectory(f"{dir_id} is not a directory")
        return attrs.ec, self._chunk_size(dir_id, attrs.chunk_size)

    async def realm(self, dir_id: int) -> tuple[int, int]:
        """(realm, key) new entries of ``dir_id`` count toward ((0, 0): no quota); cached
        as the policy is, so a new quota reaches this client's creates within the TTL."""
        cached = self._dir_policy.get(dir_id)
        if cached is not None and cached[0] > time.monotonic():
            return cached[3], cached[4]
        attrs = await self.getattr(dir_id)
        if not attrs.is_dir:
            raise NotADirectory(f"{dir_id} is not a directory")
        return attrs.realm, attrs.realm_key

    def _chunk_size(self, dir_id: int, recorded: int) -> int:
        """The root directory is made by the server, which has no cluster file: its files
        and subdirectories take the cluster file's ``chunk_size``; others inherit theirs."""
        return self._r.config.chunk_size if dir_id == ROOT_ID else recorded

    async def parent(self, dir_id: int) -> int:
        """A directory's parent (exact: every rename of a directory refreshes it)."""
        r = await self._at(dir_id, "file.get", {})
        return int(r["parent"])

    async def readlink(self, file_id: int) -> bytes:
        """A symbolic link's target."""
        r = await self._at(file_id, "file.readlink", {})
        return bytes(r["target"])

    async def setattr(
        self,
        file_id: int,
        *,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        atime_ns: int | None = None,
        mtime_ns: int | None = None,
        ec: str | None = None,
    ) -> Attrs:
        """Change attributes; ``ec`` on a directory sets the policy new files inherit."""
        changes: dict[str, Any] = {
            "mode": mode,
            "uid": uid,
            "gid": gid,
            "atime_ns": atime_ns,
            "mtime_ns": mtime_ns,
            "ec": ec,
        }
        r = await self._at(
            file_id, "file.setattr", {k: v for k, v in changes.items() if v is not None}
        )
        self.forget_policy(file_id)
        return Attrs.from_wire(r["attrs"])

    async def getxattr(self, file_id: int, name: str) -> bytes:
        r = await self._at(file_id, "file.getxattr", {"name": name})
        return bytes(r["value"])

    async def setxattr(self, file_id: int, name: str, value: bytes) -> None:
        await self._at(file_id, "file.setxattr", {"name": name, "value": bytes(value)})

    async def listxattr(self, file_id: int) -> list[str]:
        r = await self._at(file_id, "file.listxattr", {})
        return list(r["names"])

    async def removexattr(self, file_id: int, name: str) -> None:
        await self._at(file_id, "file.removexattr", {"name": name})

    # --- the write path ----------------------------------------------------------------------

    async def open_for_write(self, file_id: int, *, truncate: bool = False) -> int:
        """Take (steal) the writer token; unseals the file. Returns the new token."""
        r = await self._at(file_id, "file.open", {"truncate": truncate})
        return int(r["token"])

    async def renew_lease(self, file_id: int, token: int) -> None:
        await self._at(file_id, "file.renew", {"token": token})

    async def _commit_elsewhere(self, file_id: int, blocks: Sequence[BlockInfo]) -> list[Any]:
        """Commit the blocks that are not in the file's shard in their own shards (blocks
        allocated before co-location); returns the wire records of the rest."""
        home = self._r.shard_of(file_id)
        by_shard: dict[int, list[dict[str, Any]]] = {}
        for b in blocks:
            by_shard.setdefault(self._r.shard_of(b.block_id), []).append(b.to_wire())

        def job(shard: int, items: list[dict[str, Any]]) -> Callable[[], Awaitable[Any]]:
            return lambda: self._r.call_shard(
                shard, "block.commit", {"file_id": file_id, "blocks": items}
            )

        await gather([job(s, items) for s, items in by_shard.items() if s != home])
        return by_shard.get(home, [])

    async def commit_blocks(self, file_id: int, token: int, blocks: Sequence[BlockInfo]) -> None:
        """Commit blocks (Block layer) and put them at their ``file_index`` in the file.

        A block at an index that already has one replaces it (the old block is queued for
        GC). StaleWriterToken if another writer took the file since ``token`` was issued.
        """
        if not blocks:
            return
        local = await self._commit_elsewhere(file_id, blocks)
        await self._at(
            file_id,
            "file.commit",
            {
                "token": token,
                "entries": [[b.file_index, b.block_id] for b in blocks],
                "blocks": local,
            },
        )

    async def close(
        self, file_id: int, token: int, size: int, blocks: Sequence[BlockInfo]
    ) -> Attrs:
        """Commit a writer's last blocks, set the final size, release the writer token and
        seal the file: one transaction in the file's shard (``file.close``).

        Sent again after a lost reply; a repeat that finds the file sealed checks that the
        seal was this one (the size, and these blocks at their indexes) and returns it."""
        local = await self._commit_elsewhere(file_id, blocks)
        shard = self._r.shard_of(file_id)
        fields: dict[str, Any] = {
            "id": file_id,
            "token": token,
            "size": size,
            "entries": [[b.file_index, b.block_id] for b in blocks],
            "blocks": local,
        }
        try:
            r = await self._r.call_shard(shard, "file.close", fields, repeat=True)
        except FileSealed:
            attrs = await self.getattr(file_id)
            have = {
                (int(e[0]), int(e[1]))
                for e in (await self._r.call_shard(shard, "file.blocks", {"id": file_id}))["blocks"]
            }
            if attrs.size != size or not {(b.file_index, b.block_id) for b in blocks} <= have:
                raise
            return attrs
        return Attrs.from_wire(r["attrs"])

    async def commit_pack(
        self, pack: BlockInfo, files: Sequence[PackedExtent]
    ) -> list[Attrs | TectonicError]:
        """Commit a pack block and its files' extents (each with its size, and the seal for
        a close) in one transaction of the pack's shard, where every file must live
        (``file.commit_pack``). Each file's outcome is its own: attrs or the error it met.
        Sent again after a lost reply: a repeat finds its commits and seals done."""
        r = await self._r.call_shard(
            self._r.shard_of(pack.block_id),
            "file.commit_pack",
            {"block": pack.to_wire(), "files": [f.to_wire() for f in files]},
        )
        out: list[Attrs | TectonicError] = []
        for item in r["results"]:
            if "err" in item:
                out.append(error_from_code(str(item["err"]), str(item.get("msg", ""))))
            else:
                out.append(Attrs.from_wire(item["attrs"]))
        return out

    async def seal(self, file_id: int, token: int, size: int) -> Attrs:
        """Set the final size, release the writer token and seal the file."""
        r = await self._at(file_id, "file.seal", {"token": token, "size": size})
        return Attrs.from_wire(r["attrs"])

    async def set_size(self, file_id: int, token: int, size: int) -> Attrs:
        """Change the size of a file being written (truncate or grow sparse); blocks wholly
        past the new size are dropped and queued for GC."""
        r = await self._at(file_id, "file.set_size", {"token": token, "size": size})
        return Attrs.from_wire(r["attrs"])

    # --- the read path -----------------------------------------------------------------------

    async def block_list(self, file_id: int) -> list[BlockInfo]:
        """Every committed block of the file, sorted by file_index, with chunk placements
        (addresses filled in from the registry)."""
        r = await self._at(file_id, "file.blocks", {})
        rows = [(*map(int, e), 0, 0)[:4] for e in r["blocks"]]  # (index, id, offset, length)
        patch_rows = [tuple(map(int, p)) for p in r.get("patches", [])]
        ids = list(dict.fromkeys([e[1] for e in rows] + [p[3] for p in patch_rows]))
        located = dict(zip(ids, await self._blocks.locate_blocks(ids)))
        patches: dict[int, list[Patch]] = {}
        for index, at, length, block_id, offset in patch_rows:
            source = dataclasses.replace(located[block_id], ext_off=offset, ext_len=length)
            patches.setdefault(index, []).append(Patch(at, length, source))
        out = []
        for index, block_id, offset, length in rows:
            # A copy per entry: one pack block may hold several of the file's extents.
            out.append(
                dataclasses.replace(
                    located[block_id],
                    file_index=index,
                    ext_off=offset,
                    ext_len=length,
                    patches=tuple(patches.get(index, ())),
                )
            )
        return sorted(out, key=lambda i: i.file_index)
