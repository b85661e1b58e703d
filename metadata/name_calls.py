"""The metadata client's Name layer calls: lookups, listings, and the namespace's changes.

Routing: a Name entry lives in ``shard_of(dir_id)``. New directories go to a shard picked at
random (spreading a burst of mkdirs from a thousand ranks over every server); that shard
draws the id (so ids need no central counter). A new file goes to its directory's shard.

Sequencing across shards (what a crash in the middle leaves):

* create (a file): one transaction in the directory's shard (``name.create``: the record, its
  id drawn to hash there, and the Name entry; metadata/write_ops.py). Nothing to undo.
* mkdir: File record (unnamed) in a shard drawn at random, so directories spread over every
  server -> Name entry -> link (marks it named). Crash: an unnamed record, found by
  ``file.orphans``.
* unlink: one transaction in the directory's shard when the file's record is there (a file
  created in that directory: ``name.unlink``). Else Name entry removed -> File record
  unlinked in its own shard (blocks queued for GC). Crash between: a named record no entry
  reaches, kept (never a dangling name).
* rmdir: directory killed in its own shard (emptiness checked atomically, creates refused) ->
  Name entry removed -> record dropped. Crash: a dead, empty directory still listed; rmdir
  again completes it.
* rename: one transaction when both directories share a shard; else the intent protocol of
  metadata/name_layer.py (both names briefly visible, never neither).
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import trio

from metadata.file_calls import FileCalls
from metadata.routing import Router
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import (
    CrossRealm,
    DanglingName,
    DirectoryNotEmpty,
    FileExists,
    FileNotFound,
    InvalidArgument,
    IsADirectory,
    NotADirectory,
    ShardUnavailable,
    TectonicError,
)
from tectonic_py.core.ids import ROOT_ID, new_id
from tectonic_py.core.records import (
    KIND_DIR,
    KIND_FILE,
    KIND_SYMLINK,
    Attrs,
    DirEntry,
    validate_name,
)

log = logging.getLogger(__name__)

RENAME_DEADLINE_S = 30.0


class NameCalls:
    """Name layer calls (with the File layer records of new entries)."""

    def __init__(self, router: Router, files: FileCalls) -> None:
        self._r = router
        self._files = files
        self._rng = random.Random()

    async def _in(
        self,
        dir_id: int,
        op: str,
        fields: dict[str, Any],
        *,
        repeat: bool = False,
        trace: dict[str, bool] | None = None,
    ) -> dict[str, Any]:
        """``op`` in the directory's shard (``repeat``, ``trace``: as for ``call_shard``)."""
        return await self._r.call_shard(
            self._r.shard_of(dir_id), op, fields, repeat=repeat, trace=trace
        )

    async def lookup(self, dir_id: int, name: str) -> Attrs:
        """Attrs of the child ``name`` of ``dir_id``; FileNotFound if absent."""
        validate_name(name)
        r = await self._in(dir_id, "name.lookup", {"dir": dir_id, "name": name})
        return await self._entry_attrs(dir_id, name, r)

    async def _entry_attrs(self, dir_id: int, name: str, r: dict[str, Any]) -> Attrs:
        """The attrs of the record a ``name.lookup`` reply names. A record found missing is
        either a race (an unlink or rename of the name since it was read: FileNotFound) or
        a dangling name (the name is still there: ``DanglingName``, so that only this name
        fails and the caller can still remove it); the name is read once more to tell."""
        if "attrs" in r:
            return Attrs.from_wire(r["attrs"])
        try:
            return await self._files.getattr(r["id"])
        except FileNotFound:
            pass
        again = await self._in(dir_id, "name.lookup", {"dir": dir_id, "name": name})
        if "attrs" in again:
            return Attrs.from_wire(again["attrs"])
        try:
            return await self._files.getattr(again["id"])
        except FileNotFound:
            if again["id"] != r["id"]:
                raise
        raise DanglingName(
            f"{name!r} in directory {dir_id} names record {r['id']}, which is gone"
            " (remove the name with rm)",
            file_id=r["id"],
            kind=r["kind"],
        )

    async def resolve(self, path: str) -> Attrs:
        """Walk an absolute path ('/a/b') from the root directory."""
        if not path.startswith("/"):
            raise InvalidArgument(f"not an absolute path: {path!r}")
        parts = [p for p in path.split("/") if p]
        if not parts:
            return await self._files.getattr(ROOT_ID)
        current, kind, parent, r = ROOT_ID, KIND_DIR, ROOT_ID, {}
        for part in parts:
            # Directories on the way need only their id and kind, which name.lookup gives.
            if kind != KIND_DIR:
                raise NotADirectory(f"{part!r}: a component before it is not a directory")
            validate_name(part)
            parent = current
            r = await self._in(current, "name.lookup", {"dir": current, "name": part})
            current, kind = r["id"], r["kind"]
        found = await self._entry_attrs(parent, parts[-1], r)
        self._files.note_policy(found)
        return found

    async def _new_record(
        self, dir_id: int, name: str, kind: str, mode: int, uid: int, gid: int, ec: str | None
    ) -> tuple[Attrs, int]:
        """File record in a random shard, then the Name entry; undo the record on failure."""
        validate_name(name)
        dir_ec, chunk_size = await self._files.policy(dir_id)
        realm, realm_key = await self._files.realm(dir_id)
        await self.count_entry(dir_id)
        policy = ECPolicy.parse(ec or dir_ec).name
        shard = self._rng.randrange(self._r.config.shards)
        r = await self._r.call_shard(
            shard,
            "file.create",
            {
                "kind": kind,
                "mode": mode,
                "uid": uid,
                "gid": gid,
                "ec": policy,
                "chunk_size": chunk_size,
                "parent": dir_id,
                "name": name,
                "realm": realm,
                "realm_key": realm_key,
            },
        )
        attrs = Attrs.from_wire(r["attrs"])
        try:
            await self._insert_name(dir_id, name, attrs.id, kind)
        except ShardUnavailable:
            # The name may have landed: the orphan GC finds out and names or drops the record.
            log.info("record %d left for orphan GC: its name's outcome is unknown", attrs.id)
            raise
        except TectonicError:
            try:
                await self._r.call_shard(shard, "file.drop", {"id": attrs.id})
            except TectonicError as e:
                log.info("record %d left for orphan GC: %s", attrs.id, e)
            raise
        return attrs, r["token"]

    async def count_entry(self, dir_id: int) -> None:
        """A new entry of ``dir_id`` counts toward its quota's files: claimed before it is
        made (QuotaExceeded, EDQUOT, when the quota is full; metadata/quota_layer.py)."""
        realm, _ = await self._files.realm(dir_id)
        if realm:
            await self._r.call_shard(
                self._r.shard_of(realm), "quota.claim", {"realm": realm, "need": 0, "files": 1}
            )

    async def _insert_name(self, dir_id: int, name: str, child: int, kind: str) -> None:
        """A new record's ``name.insert``, sent again after a lost reply (a server killed
        under it): ``child`` was drawn just now, so a FileExists whose entry names it is the
        first try's, landed."""
        try:
            await self._in(
                dir_id,
                "name.insert",
                {"dir": dir_id, "name": name, "id": child, "kind": kind},
                repeat=True,
            )
        except FileExists:
            try:
                r = await self._in(dir_id, "name.lookup", {"dir": dir_id, "name": name})
            except FileNotFound:
                raise FileExists(f"{name!r} exists in directory {dir_id}") from None
            if r["id"] != child:
                raise

    async def mkdir(
        self, dir_id: int, name: str, *, mode: int = 0o755, uid: int = 0, gid: int = 0
    ) -> Attrs:
        """New directory; inherits the parent's EC policy. FileExists if the name is taken."""
        attrs, _ = await self._new_record(dir_id, name, KIND_DIR, mode, uid, gid, None)
        await self._r.call_shard(
            self._r.shard_of(attrs.id),
            "file.link",
            {"id": attrs.id, "parent": dir_id, "name": name},
        )
        return attrs

    async def create(
        self,
        dir_id: int,
        name: str,
        *,
        mode: int = 0o644,
        uid: int = 0,
        gid: int = 0,
        exclusive: bool = True,
        ec: str | None = None,
    ) -> tuple[Attrs, int]:
        """Create a file and take its writer token: ``(attrs, token)``.

        The EC policy is ``ec`` or the directory's. With ``exclusive=False`` an existing file
        of that name is opened for writing and truncated to zero (O_CREAT|O_TRUNC) instead.
        """
        validate_name(name)
        dir_ec, chunk_size = await self._files.policy(dir_id)
        fields: dict[str, Any] = {
            "dir": dir_id,
            "name": name,
            "mode": mode,
            "uid": uid,
            "gid": gid,
            "ec": ECPolicy.parse(ec or dir_ec).name,
            "chunk_size": chunk_size,
            # Drawn here so that a create sent again after a lost reply (a server killed
            # under it) is answered with the file its first try made, not FileExists.
            "token": new_id(),
        }
        await self.count_entry(dir_id)
        for _ in range(3):
            try:
                r = await self._in(dir_id, "name.create", fields, repeat=True)
                return Attrs.from_wire(r["attrs"]), int(r["token"])
            except FileExists:
                if exclusive:
                    raise
            try:
                existing = await self.lookup(dir_id, name)
            except FileNotFound:
                continue  # removed since: create it again
            if existing.is_dir:
                raise IsADirectory(f"{name!r} is a directory")
            token = await self._files.open_for_write(existing.id, truncate=True)
            return await self._files.getattr(existing.id), token
        raise FileExists(f"{name!r} keeps appearing and disappearing; giving up")

    async def delegate(self, shard: int, count: int) -> tuple[list[int], int]:
        """``count`` file ids of ``shard`` reserved for this caller's creates, and the
        deadline (ns, the server's clock) until which they stay reserved."""
        r = await self._r.call_shard(shard, "name.delegate", {"count": count})
        return [int(i) for i in r["ids"]], int(r["expires_ns"])

    async def create_delegated(
        self,
        dir_id: int,
        name: str,
        *,
        file_id: int,
        token: int,
        mode: int,
        uid: int,
        gid: int,
        ec: str,
        chunk_size: int,
        replace: bool,
    ) -> Attrs:
        """The create a mount answered before sending it (``file_id`` from ``delegate``,
        ``token`` drawn by it): sent again after a lost reply, since a repeat finds the
        record of its id. With ``replace``, a file of that name made meanwhile by another
        mount loses the name (the create is its O_TRUNC rewrite); it is released here when
        its record is elsewhere."""
        validate_name(name)
        fields: dict[str, Any] = {
            "dir": dir_id,
            "name": name,
            "mode": mode,
            "uid": uid,
            "gid": gid,
            "ec": ec,
            "chunk_size": chunk_size,
            "token": token,
            "id": file_id,
            "replace": replace,
        }
        r = await self._in(dir_id, "name.create", fields, repeat=True)
        if r.get("victim_id"):
            await self._release(int(r["victim_id"]), str(r["victim_kind"]))
        return Attrs.from_wire(r["attrs"])

    async def symlink(
        self, dir_id: int, name: str, target: bytes, *, uid: int = 0, gid: int = 0
    ) -> Attrs:
        """A symbolic link ``name`` in ``dir_id`` pointing at ``target`` (bytes, kept as
        given: the kernel resolves it, never the metadata service). One transaction in the
        directory's shard; FileExists if the name is taken."""
        return await self.mknod(dir_id, name, KIND_SYMLINK, target=target, uid=uid, gid=gid)

    async def mknod(
        self,
        dir_id: int,
        name: str,
        kind: str,
        *,
        mode: int = 0o777,
        rdev: int = 0,
        target: bytes = b"",
        uid: int = 0,
        gid: int = 0,
    ) -> Attrs:
        """A metadata-only record (``NODE_KINDS``: a symlink, FIFO, socket or device) with
        its name, made at once in the directory's shard."""
        validate_name(name)
        await self.count_entry(dir_id)
        r = await self._in(
            dir_id,
            "name.make_node",
            {
                "dir": dir_id,
                "name": name,
                "kind": kind,
                "mode": mode,
                "uid": uid,
                "gid": gid,
                "target": bytes(target),
                "rdev": rdev,
            },
        )
        return Attrs.from_wire(r["attrs"])

    async def link(self, file_id: int, dir_id: int, name: str) -> Attrs:
        """A hard link: ``name`` in ``dir_id`` also names ``file_id``. The link count goes
        up first and the name second (a crash between leaves the file kept, not a name
        that outlives its file); a name that is taken undoes the count."""
        validate_name(name)
        target = await self._files.getattr(file_id)
        if target.realm_key != (await self._files.realm(dir_id))[1]:
            raise CrossRealm("a hard link between quota realms: copy instead")
        r = await self._r.call_shard(self._r.shard_of(file_id), "file.add_link", {"id": file_id})
        attrs = Attrs.from_wire(r["attrs"])
        try:
            # Not sent again after a lost reply, unlike a new record's name: a FileExists
            # naming this file could be the first try's or a name that was there before.
            await self._in(
                dir_id,
                "name.insert",
                {"dir": dir_id, "name": name, "id": file_id, "kind": attrs.kind},
            )
        except ShardUnavailable:
            # The name may have landed: a count too high keeps the file, one too low loses it.
            log.warning("file %d keeps a link count its name may not have", file_id)
            raise
        except TectonicError:
            with trio.CancelScope(shield=True):
                await self._release(file_id, attrs.kind)
            raise
        return attrs

    async def readdir(
        self, dir_id: int, after: str = "", limit: int = 1000
    ) -> tuple[list[DirEntry], str | None]:
        """One page of entries sorted by name, strictly after ``after``; next cursor or None."""
        r = await self._in(dir_id, "name.list", {"dir": dir_id, "after": after, "limit": limit})
        entries = [DirEntry(name=n, id=i, kind=k) for n, i, k in r["entries"]]
        return entries, r["next"]

    async def unlink(self, dir_id: int, name: str) -> int:
        """Remove a file's name; its blocks are queued for GC. Returns the file's id (0 when
        a try whose reply was lost did it: the id went with the reply).

        ``name.unlink`` is sent again after a lost reply (a server killed under it). A
        repeat's FileNotFound is the first try's work: the name, and with it the link of a
        record in the directory's shard (where a file created there lives), went in one
        transaction. A record elsewhere (a hard link's, a file renamed in) is then left
        linked, kept rather than lost."""
        validate_name(name)
        trace: dict[str, bool] = {}
        try:
            r = await self._in(
                dir_id, "name.unlink", {"dir": dir_id, "name": name}, repeat=True, trace=trace
            )
        except FileNotFound:
            if not trace.get("lost"):
                raise
            log.info("unlink of %r in %d: a try whose reply was lost did it", name, dir_id)
            return 0
        file_id: int = r["id"]
        if not r["released"]:
            await self._release(file_id, KIND_FILE)
        return file_id

    async def _release(self, file_id: int, kind: str) -> None:
        """The last name of a record is gone: unlink the file or drop the dead directory. If
        its shard cannot be reached the record is left for the GC, never surfaced as an error:
        the name is already gone and that is what the caller asked for."""
        op = "file.drop" if kind == KIND_DIR else "file.unlink"
        try:
            await self._r.call_shard(self._r.shard_of(file_id), op, {"id": file_id})
        except TectonicError as e:
            log.warning("record %d left for GC after its name was removed: %s", file_id, e)

    async def rmdir(self, dir_id: int, name: str) -> None:
        validate_name(name)
        r = await self._in(dir_id, "name.lookup", {"dir": dir_id, "name": name})
        child, kind = r["id"], r["kind"]
        if kind != KIND_DIR:
            raise NotADirectory(f"{name!r} is not a directory")
        try:
            await self._r.call_shard(
                self._r.shard_of(child), "file.kill_dir", {"id": child}, repeat=True
            )
        except FileNotFound:
            pass  # killed by an rmdir that did not finish (or by a try sent again): complete it
        trace: dict[str, bool] = {}
        try:
            await self._in(
                dir_id,
                "name.remove",
                {"dir": dir_id, "name": name, "kind": KIND_DIR, "expect_id": child},
                repeat=True,
                trace=trace,
            )
        except FileNotFound:
            if not trace.get("lost"):
                raise  # "name" names another directory now, or nothing
            # A try whose reply was lost removed the name of the directory killed above.
        self._files.forget_policy(child)
        await self._release(child, KIND_DIR)

    async def rename(self, src_dir: int, src_name: str, dst_dir: int, dst_name: str) -> None:
        """Atomic within one directory, also over an existing file; crash-safe across."""
        validate_name(src_name)
        validate_name(dst_name)
        if src_dir != dst_dir:
            await self._check_same_realm(src_dir, src_name, dst_dir)
            await self._check_not_into_itself(src_dir, src_name, dst_dir)
        try:
            result = await self._rename_once(src_dir, src_name, dst_dir, dst_name, 0)
        except DirectoryNotEmpty:
            # The destination is a directory. Replace it only if it is empty, and kill it
            # first (atomically with the emptiness check, in its own shard) so that no create
            # can slip into it between the check and the replace.
            victim = await self.lookup(dst_dir, dst_name)
            await self._r.call_shard(
                self._r.shard_of(victim.id), "file.kill_dir", {"id": victim.id}
            )
            try:
                result = await self._rename_once(src_dir, src_name, dst_dir, dst_name, victim.id)
            except BaseException:
                with trio.CancelScope(shield=True):
                    try:
                        await self._r.call_shard(
                            self._r.shard_of(victim.id), "file.revive_dir", {"id": victim.id}
                        )
                    except TectonicError as e:
                        log.warning(
                            "directory %d left dead after a failed rename: %s", victim.id, e
                        )
                raise
        if result["victim_id"]:
            await self._release(result["victim_id"], result["victim_kind"])
        child = result["id"]
        try:
            await self._r.call_shard(
                self._r.shard_of(child),
                "file.link",
                {"id": child, "parent": dst_dir, "name": dst_name},
            )
        except TectonicError as e:
            log.info("rename: could not refresh the name hint of %d: %s", child, e)

    async def _check_same_realm(self, src_dir: int, src_name: str, dst_dir: int) -> None:
        """A record stays in the quota realm its usage is counted in (CephFS refuses such
        renames alike): a move between realms, or of a quota directory into one, is
        ``CrossRealm`` (EXDEV: mv copies and deletes). Read through the directories' cached
        attributes, so a quota set elsewhere in the last DIR_POLICY_TTL_S may be missed."""
        src_realm = await self._files.realm(src_dir)
        dst_realm = await self._files.realm(dst_dir)
        if src_realm[1] != dst_realm[1]:
            raise CrossRealm(
                f"rename between quota realms (directory {src_realm[0] or 'none'} and"
                f" {dst_realm[0] or 'none'}): copy and delete instead"
            )
        if dst_realm[0]:
            moving = await self.lookup(src_dir, src_name)
            if moving.is_dir and moving.realm == moving.id:
                raise CrossRealm("a directory with a quota cannot move into another quota")

    async def _check_not_into_itself(self, src_dir: int, src_name: str, dst_dir: int) -> None:
        """Moving a directory below itself would cut a loop out of the tree: walk up from the
        destination by the directories' parent pointers. Best effort under concurrent moves
        of the same directories (no cluster-wide rename lock), exact otherwise."""
        moving = await self.lookup(src_dir, src_name)
        if not moving.is_dir:
            return
        current = dst_dir
        for _ in range(4096):
            if current == moving.id:
                raise InvalidArgument("cannot move a directory below itself")
            if current == ROOT_ID:
                return
            current = await self._files.parent(current)
        raise InvalidArgument("directory tree deeper than 4096 levels")

    async def _rename_once(
        self, src_dir: int, src_name: str, dst_dir: int, dst_name: str, replace_dir: int
    ) -> dict[str, Any]:
        src_shard, dst_shard = self._r.shard_of(src_dir), self._r.shard_of(dst_dir)
        if src_shard == dst_shard:
            return await self._r.call_shard(
                src_shard,
                "name.rename",
                {
                    "src_dir": src_dir,
                    "src_name": src_name,
                    "dst_dir": dst_dir,
                    "dst_name": dst_name,
                    "replace_dir": replace_dir,
                },
            )
        deadline = time.time_ns() + int(RENAME_DEADLINE_S * 1e9)
        prep = await self._r.call_shard(
            src_shard,
            "name.rename_prepare",
            {
                "src_dir": src_dir,
                "src_name": src_name,
                "dst_dir": dst_dir,
                "dst_name": dst_name,
                "dst_address": self._r.address_of(dst_shard),
                "deadline_ns": deadline,
            },
        )
        try:
            applied = await self._r.call_shard(
                dst_shard,
                "name.rename_apply",
                {
                    "dst_dir": dst_dir,
                    "dst_name": dst_name,
                    "id": prep["id"],
                    "kind": prep["kind"],
                    "deadline_ns": deadline,
                    "replace_dir": replace_dir,
                },
            )
        except ShardUnavailable:
            raise  # the intent stays; the recovery pass settles it after the deadline
        except TectonicError:
            await self._finish(src_shard, prep["intent"], applied=False)
            raise
        await self._finish(src_shard, prep["intent"], applied=True)
        return {"id": prep["id"], "kind": prep["kind"], **applied}

    async def _finish(self, shard: int, intent: int, *, applied: bool) -> None:
        await self._r.call_shard(
            shard, "name.rename_finish", {"intent": intent, "applied": applied}
        )
