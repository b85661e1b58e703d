"""The metadata client's quota calls: quotas, claims, reservations, folding and recounts.

What is counted where, and why usage never drifts, is metadata/quota_layer.py. Here are the
sequences that span shards:

* ``set_quota``: ``quota.set`` in the directory's shard, then a walk of the tree below
  attaching every record (``quota.adopt`` in each record's shard). A directory
  is attached before it is listed, so a create landing in it meanwhile takes the realm
  itself; one that landed before is in the listing. A quota found below (nesting) undoes
  the whole set. A crash mid-walk leaves part of the tree counted: ``set`` again walks
  it again (adopt is idempotent).
* ``remove_quota``: the walk detaching every record first, then ``quota.remove``: a crash
  between leaves the quota in place, and ``rm`` again finishes.
* ``reserve``: the raw space at the registry first (``space.reserve``: ENOSPC), then the
  quota (``quota.reserve``: EDQUOT; the raw hold is given back). A crash between leaves a
  raw hold that lapses at its TTL.
* ``settle``: every shard's pending deltas folded into their realms (``quota.pending`` ->
  ``quota.fold`` -> ``quota.ack``), what the maintenance daemon runs every few seconds.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from typing import Any

from metadata.file_calls import FileCalls
from metadata.name_calls import NameCalls
from metadata.routing import Router, gather
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import (
    FileNotFound,
    InvalidArgument,
    NotADirectory,
    QuotaExceeded,
)
from tectonic_py.core.ids import new_id
from tectonic_py.core.records import KIND_DIR

PENDING_PAGE = 1000
MAX_TTL_S = 30 * 86400


class QuotaCalls:
    """Quota, claim and reservation calls (module docstring)."""

    def __init__(self, router: Router, names: NameCalls, files: FileCalls) -> None:
        self._r = router
        self._names = names
        self._files = files

    async def _dir(self, dir_id: int) -> Any:
        attrs = await self._files.getattr(dir_id)
        if attrs.kind != KIND_DIR:
            raise NotADirectory(
                f"a quota or reservation is on a directory; {dir_id} is a {attrs.kind}"
            )
        return attrs

    async def _adopt_tree(self, dir_id: int, realm: int, key: int) -> int:
        count = 0
        async for child, _kind in self._tree_adopting(dir_id, realm, key):
            count += 1 if child else 0
        return count

    async def _tree_adopting(
        self, dir_id: int, realm: int, key: int
    ) -> AsyncIterator[tuple[int, str]]:
        """Attach each record below (a directory before it is listed: module docstring)."""
        stack = [dir_id]
        while stack:
            current = stack.pop()
            after = ""
            while True:
                try:
                    entries, nxt = await self._names.readdir(current, after, 1000)
                except FileNotFound:
                    break
                for e in entries:
                    try:
                        await self._r.call_shard(
                            self._r.shard_of(e.id),
                            "quota.adopt",
                            {"id": e.id, "realm": realm, "realm_key": key},
                        )
                    except FileNotFound:
                        continue  # removed meanwhile
                    yield e.id, e.kind
                    if e.kind == KIND_DIR:
                        stack.append(e.id)
                if nxt is None:
                    break
                after = nxt

    # --- quotas -----------------------------------------------------------------------------

    async def set_quota(self, dir_id: int, max_bytes: int, max_files: int) -> dict[str, Any]:
        """Set (or change) the limits of ``dir_id`` (0: no limit); a new quota counts the
        tree below it at once. Returns the quota as ``get_quota`` does."""
        if max_bytes < 0 or max_files < 0:
            raise InvalidArgument("quota limits are 0 (none) or positive")
        await self._dir(dir_id)
        r = await self._r.call_shard(
            self._r.shard_of(dir_id),
            "quota.set",
            {"dir": dir_id, "max_bytes": max_bytes, "max_files": max_files, "realm_key": new_id()},
        )
        self._files.forget_policy(dir_id)
        try:
            # Also when the quota was there: a set cut short by a crash is finished so.
            await self._adopt_tree(dir_id, dir_id, int(r["realm_key"]))
        except InvalidArgument:
            if r["fresh"]:
                await self.remove_quota(dir_id)
            raise
        return await self.get_quota(dir_id)

    async def get_quota(self, dir_id: int) -> dict[str, Any]:
        """Limits and usage of ``dir_id``'s quota (FileNotFound: it has none): used as
        folded so far (``settle`` first for the exact figure), claimed by writers, reserved."""
        r = await self._r.call_shard(self._r.shard_of(dir_id), "quota.get", {"dir": dir_id})
        return dict(r["quota"])

    async def list_quotas(self) -> list[dict[str, Any]]:
        """Every quota of the cluster (each shard asked)."""

        def job(shard: int) -> Any:
            return functools.partial(self._r.call_shard, shard, "quota.list", {})

        pages = await gather([job(s) for s in range(self._r.config.shards)])
        return sorted((q for p in pages for q in p["quotas"]), key=lambda q: q["dir"])

    async def remove_quota(self, dir_id: int) -> None:
        """Drop ``dir_id``'s quota: records below count toward nothing."""
        await self.get_quota(dir_id)  # FileNotFound before the walk: nothing to remove
        await self._adopt_tree(dir_id, 0, 0)
        await self._r.call_shard(self._r.shard_of(dir_id), "quota.remove", {"dir": dir_id})
        self._files.forget_policy(dir_id)

    # --- claims (the write path) -------------------------------------------------------------

    async def claim(
        self,
        realm: int,
        *,
        dir_id: int = 0,
        file_id: int = 0,
        need: int = 0,
        want: int = 0,
        files: int = 0,
        prealloc: bool = False,
    ) -> tuple[int, int]:
        """(bytes the caller may add to ``file_id``, ``need`` to ``want``; of which fallocate
        had set aside for it), or QuotaExceeded."""
        r = await self._r.call_shard(
            self._r.shard_of(realm),
            "quota.claim",
            {
                "realm": realm,
                "dir": dir_id,
                "file": file_id,
                "need": need,
                "want": want,
                "files": files,
                "prealloc": prealloc,
            },
        )
        return int(r["granted"]), int(r["prealloc"])

    async def unclaim(self, realm: int, file_id: int, nbytes: int, *, keep: bool = False) -> None:
        if nbytes > 0:
            await self._r.call_shard(
                self._r.shard_of(realm),
                "quota.unclaim",
                {"realm": realm, "file": file_id, "bytes": nbytes, "keep": keep},
            )

    async def dir_realm(self, dir_id: int) -> tuple[int, int]:
        """(realm, key) new entries of ``dir_id`` count toward (cached briefly)."""
        return await self._files.realm(dir_id)

    # --- reservations -------------------------------------------------------------------------

    async def reserve(self, dir_id: int, nbytes: int, ttl_s: float) -> dict[str, Any]:
        """Hold ``nbytes`` logical bytes for ``dir_id``'s writes for ``ttl_s`` seconds, or
        fail at once: NoSpace (the live chunk stores' free raw space, less other
        reservations, cannot hold it with the EC overhead of the directory's policy) or
        QuotaExceeded (its quota cannot). Nothing is written either way."""
        if nbytes < 0:
            raise InvalidArgument("a reservation is 0 or more bytes")
        if not 0 < ttl_s <= MAX_TTL_S:
            raise InvalidArgument(f"a reservation's TTL is over 0 and at most {MAX_TTL_S} s")
        attrs = await self._dir(dir_id)
        policy = ECPolicy.parse(attrs.ec)
        raw = -(-nbytes * policy.n // policy.k)
        ttl_ns = int(ttl_s * 1e9)
        space = await self._r.call_registry(
            "space.reserve", {"dir": dir_id, "raw_bytes": raw, "ttl_ns": ttl_ns}
        )
        out = {"dir": dir_id, "bytes": nbytes, "raw_bytes": raw, "raw_free": space["free"]}
        if attrs.realm:
            try:
                q = await self._r.call_shard(
                    self._r.shard_of(attrs.realm),
                    "quota.reserve",
                    {"realm": attrs.realm, "dir": dir_id, "bytes": nbytes, "ttl_ns": ttl_ns},
                )
            except QuotaExceeded:
                await self._r.call_registry("space.release", {"dir": dir_id})
                raise
            out["quota"] = attrs.realm
            out["quota_free"] = q["free"]
        return out

    async def release(self, dir_id: int, realm: int | None = None) -> int:
        """End ``dir_id``'s reservation (commit of its step, or the user's); returns the
        bytes it still held of its quota. ``realm``: known to the caller (a step directory
        renamed by a commit is still in its realm)."""
        if realm is None:
            realm = (await self._files.getattr(dir_id)).realm
        await self._r.call_registry("space.release", {"dir": dir_id})
        if not realm:
            return 0
        r = await self._r.call_shard(
            self._r.shard_of(realm), "quota.release", {"realm": realm, "dir": dir_id}
        )
        return int(r["left"])

    # --- folding and recounting (maintenance, fsck) -------------------------------------------

    async def settle(self, *, max_pages: int = 100) -> int:
        """Fold every shard's pending deltas into their realms; returns the pages folded."""

        def job(shard: int) -> Any:
            return functools.partial(self._settle_shard, shard, max_pages)

        return sum(await gather([job(s) for s in range(self._r.config.shards)]))

    async def _settle_shard(self, shard: int, max_pages: int) -> int:
        done = 0
        for _ in range(max_pages):
            r = await self._r.call_shard(shard, "quota.pending", {"limit": PENDING_PAGE})
            if not r["pages"]:
                break
            for page in r["pages"]:
                realm, key = page["realm"], page["realm_key"]
                r = await self._r.call_shard(
                    self._r.shard_of(realm),
                    "quota.fold",
                    {
                        "realm": realm,
                        "realm_key": key,
                        "src_shard": shard,
                        "first": page["first"],
                        "upto": page["upto"],
                        "bytes": page["bytes"],
                        "files": page["files"],
                        "grown": page["grown"],
                    },
                )
                # Folded now, or before (an ack lost to a crash): the deltas up to what the
                # realm has go, and a page that began in them is read again without them.
                await self._r.call_shard(
                    shard,
                    "quota.ack",
                    {"realm": realm, "realm_key": key, "upto": int(r["last_seq"])},
                )
                done += 1
        return done

    async def recount(self) -> list[dict[str, Any]]:
        """Every quota's usage as accounted (folded + deltas pending) beside a count of the
        records that count toward it: ``ok`` when the two agree, which they always do on a
        quiet cluster (the shards are read one after another, so a write between two reads
        shows as a difference while writers run)."""

        def job(shard: int) -> Any:
            return functools.partial(self._r.call_shard, shard, "quota.recount", {})

        parts = await gather([job(s) for s in range(self._r.config.shards)])
        records: dict[tuple[int, int], list[int]] = {}
        pend: dict[tuple[int, int], list[int]] = {}
        for part in parts:
            for into, rows in ((records, part["records"]), (pend, part["pending"])):
                for realm, key, nbytes, nfiles in rows:
                    acc = into.setdefault((realm, key), [0, 0])
                    acc[0] += int(nbytes)
                    acc[1] += int(nfiles)
        out = []
        for part in parts:
            for dir_id, key, used_bytes, used_files in part["quotas"]:
                counted = records.get((dir_id, key), [0, 0])
                waiting = pend.get((dir_id, key), [0, 0])
                accounted = [used_bytes + waiting[0], used_files + waiting[1]]
                out.append(
                    {
                        "dir": dir_id,
                        "accounted_bytes": accounted[0],
                        "accounted_files": accounted[1],
                        "counted_bytes": counted[0],
                        "counted_files": counted[1],
                        "pending_bytes": waiting[0],
                        "pending_files": waiting[1],
                        "ok": accounted == counted,
                    }
                )
        return sorted(out, key=lambda q: q["dir"])
