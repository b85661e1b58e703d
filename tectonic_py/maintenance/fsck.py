"""fsck: the whole chain names -> File records -> Block records -> chunks, checked end to end.

``tectonic fsck`` and ``tectonic status`` (tectonic_py/cli/) read the same report. A pass:

1. The chunk level is the inventory's (``inventory.Inventory``): every up chunk store's
   listing against what the Block layer places there, what is missing or replaced recorded
   in the Block layer; then repair's view of bad chunks (``Repairer.bad_chunks``: those
   records, the scrubs' reports) and its rule of a block's health (``repair.assess``). No
   second walk of the stores.
2. The namespace from ``path`` down (``name.list``, ``file.get``): a name whose record is
   gone is **dangling**; each file's block entries (``file.blocks``) are located
   (``block.locate``): a block whose record is gone or that has fewer than k good chunks
   makes the file **lost**, one below k+m **degraded** (readable), a chunk placed on a node
   the registry does not know is named.
3. Every File record of every shard (``file.scan``): one the walk did not reach is
   **unreachable**, unless it is younger than ``grace`` (a create or mkdir in flight), the
   child of a pending cross-shard rename intent, or unlinked and still open (no names, a
   live writer). Its blocks are checked as a named file's are (its bytes are worth keeping).
   A writer lease past its term (not yet recovered by the GC) is named too.
4. Of a whole-cluster pass: every directory quota's usage, folded first, against a recount
   of the records below it (``recount_quotas``); a difference is **quota drift**, which
   the accounting's design rules out (metadata/quota_layer.py).

Severity: ``lost`` (some file's bytes cannot be read now), else ``degraded`` (anything else
found: readable, and repair, the GC or ``--repair`` can make it whole), else ``clean``.

``repair`` does only what is safe: it removes dangling names (the record is already gone,
so nothing is lost; each is logged), names unreachable records that still hold data in
``/lost+found`` (made if absent) as ``<id in hex>``, deletes unreachable records that hold
nothing (no bytes, no blocks, no entries: what the GC's unreachable-record sweep would
delete, with its re-checks), and rebuilds degraded blocks that are still readable. It
deletes no block or chunk, and nothing a name or a live writer reaches.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import FileExists, FileNotFound, NotADirectory, TectonicError
from tectonic_py.core.ids import ROOT_ID
from tectonic_py.core.records import KIND_DIR, KIND_FILE, BlockInfo, NodeInfo
from tectonic_py.maintenance import fsck_summary
from tectonic_py.maintenance.inventory import Inventory, summary
from tectonic_py.maintenance.repair import BlockHealth, Repairer, assess
from tectonic_py.maintenance.runtime import Maintenance

log = logging.getLogger(__name__)

LOST_AND_FOUND = "lost+found"
DEFAULT_GRACE_S = 60.0  # records younger than this may be a create in flight: not reported
_LOCATE_BATCH = 1000
REPAIR_PASSES = 4
_MAX_INTENT_NS = 2**63 - 1

# Kinds of finding, and the severity each gives the report.
DANGLING = "dangling_name"
UNREACHABLE = "unreachable_record"
BLOCK_MISSING = "block_missing"
BLOCK_LOST = "block_lost"
BLOCK_DEGRADED = "block_degraded"
UNKNOWN_NODE = "chunk_on_unknown_node"
LEASE_EXPIRED = "lease_expired"
QUOTA_DRIFT = "quota_drift"
_LOST_KINDS = fsck_summary.LOST_KINDS


@dataclass
class Finding:
    """One thing fsck found, at the path it concerns."""

    kind: str
    path: str
    id: int  # the record (a file, a directory)
    detail: str
    block_id: int = 0
    dir_id: int = 0  # a dangling name's directory
    name: str = ""
    entry_kind: str = ""
    holds_data: bool = False  # an unreachable record: bytes or entries worth keeping
    ctime_ns: int = 0  # an unreachable record's, as the scan saw it
    repaired: str = ""  # what --repair did about it

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": self.kind,
            "path": self.path,
            "id": self.id,
            "detail": self.detail,
        }
        if self.block_id:
            out["block_id"] = f"{self.block_id:016x}"
        if self.repaired:
            out["repaired"] = self.repaired
        return out


@dataclass
class Report:
    """What one pass found."""

    path: str
    names: int = 0
    files: int = 0
    dirs: int = 0
    blocks: int = 0
    records: int = 0  # File records scanned (0 when the record scan was skipped)
    findings: list[Finding] = field(default_factory=list)
    inventory: dict[str, Any] | None = None
    checked_at: float = field(default_factory=time.time)

    @property
    def severity(self) -> str:
        if any(f.kind in _LOST_KINDS for f in self.findings):
            return "lost"
        return "degraded" if self.findings else "clean"

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.findings:
            out[f.kind] = out.get(f.kind, 0) + 1
        return out

    def summary(self) -> dict[str, Any]:
        """What status shows of this pass (fsck_summary)."""
        lost = sorted({f.path for f in self.findings if f.kind in _LOST_KINDS})
        return fsck_summary.summarize(
            self.path, self.severity, self.counts(), lost, self.checked_at
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "severity": self.severity,
            "checked_at": self.checked_at,
            "names": self.names,
            "files": self.files,
            "dirs": self.dirs,
            "blocks": self.blocks,
            "records": self.records,
            "counts": self.counts(),
            "findings": [f.to_json() for f in self.findings],
            "inventory": self.inventory,
        }


async def recount_quotas(meta: Any) -> list[dict[str, Any]]:
    """Every quota's accounted usage beside a recount of the records below it, after the
    pending usage is folded (metadata/quota_layer.py): ``ok`` when they agree, as they
    always should on a quiet cluster, crashes of any server at any point included."""
    await meta.settle_quotas()
    return list(await meta.recount_quotas())


def _join(parent: str, name: str) -> str:
    return f"{parent.rstrip('/')}/{name}"


class Fsck:
    """One pass (``check``) and its safe repairs (``repair``), over a ``Maintenance``."""

    def __init__(self, m: Maintenance, *, grace_s: float = DEFAULT_GRACE_S) -> None:
        self.m = m
        self.grace_s = grace_s
        self.nodes: dict[str, NodeInfo] = {}
        self.bad: set[tuple[int, int, str]] = set()
        self._blocks: dict[int, BlockInfo | None] = {}
        self._health: dict[int, BlockHealth] = {}

    async def check(self, path: str = "/", *, inventory: bool = True) -> Report:
        meta = self.m.meta
        report = Report(path)
        self.nodes = await self.m.nodes()
        if inventory:
            report.inventory = summary(await Inventory(self.m).round())
        self.bad = await Repairer(self.m).bad_chunks(self.nodes)
        self._blocks, self._health = {}, {}
        start = await meta.resolve(path)
        reached: dict[int, str] = {start.id: path}
        if start.kind == KIND_DIR:
            await self._walk(report, start.id, path, reached)
        elif start.kind == KIND_FILE:
            await self._check_file(report, start.id, path)
        await self._scan_records(report, reached, whole=start.id == ROOT_ID)
        if start.id == ROOT_ID:
            for q in await recount_quotas(meta):
                if not q["ok"]:
                    report.findings.append(
                        Finding(
                            QUOTA_DRIFT,
                            f"quota of directory {q['dir']}",
                            q["dir"],
                            f"accounted {q['accounted_bytes']} bytes, {q['accounted_files']}"
                            f" files; its records hold {q['counted_bytes']} bytes,"
                            f" {q['counted_files']} files",
                        )
                    )
        return report

    async def reachable(self) -> set[int]:
        """Every record a name reaches from the root: the names alone (no record, block or
        chunk is read), for the unreachable-record sweep."""
        reached: dict[int, str] = {ROOT_ID: "/"}
        await self._walk(Report("/"), ROOT_ID, "/", reached, names_only=True)
        return set(reached)

    async def _walk(
        self,
        report: Report,
        top: int,
        top_path: str,
        reached: dict[int, str],
        *,
        names_only: bool = False,
    ) -> None:
        meta = self.m.meta
        todo = [(top, top_path)]
        report.dirs += 1
        while todo:
            dir_id, dir_path = todo.pop()
            after: str | None = ""
            while after is not None:
                try:
                    entries, after = await meta.readdir(dir_id, after)
                except (FileNotFound, NotADirectory):
                    break  # removed while we walk
                for e in entries:
                    report.names += 1
                    p = _join(dir_path, e.name)
                    if names_only:
                        if e.id not in reached:
                            reached[e.id] = p
                            if e.kind == KIND_DIR:
                                todo.append((e.id, p))
                        continue
                    try:
                        await meta.getattr(e.id)
                    except FileNotFound:
                        report.findings.append(
                            Finding(
                                DANGLING,
                                p,
                                e.id,
                                f"names record {e.id}, which does not exist",
                                dir_id=dir_id,
                                name=e.name,
                                entry_kind=e.kind,
                            )
                        )
                        continue
                    if e.id in reached:
                        continue  # a hard link: checked once
                    reached[e.id] = p
                    if e.kind == KIND_DIR:
                        report.dirs += 1
                        todo.append((e.id, p))
                    elif e.kind == KIND_FILE:
                        await self._check_file(report, e.id, p)

    async def _check_file(self, report: Report, file_id: int, path: str) -> None:
        report.files += 1
        try:
            r = await self.m.meta.call("file.blocks", {"id": file_id})
        except FileNotFound:
            return  # removed while we walk
        # A patch's pack holds file bytes as the block under it does: checked the same way.
        refs = [(f"block {int(e[0])}", int(e[1])) for e in r["blocks"]]
        refs += [(f"a patch of block {int(p[0])}", int(p[3])) for p in r.get("patches", [])]
        await self._locate(list({b for _, b in refs if b not in self._blocks}))
        for what, block_id in refs:
            report.blocks += 1
            info = self._blocks.get(block_id)
            if info is None:
                report.findings.append(
                    Finding(
                        BLOCK_MISSING,
                        path,
                        file_id,
                        f"{what} ({block_id:016x}) has no record: its bytes are lost",
                        block_id=block_id,
                    )
                )
                continue
            for c in info.chunks:
                if c.node_id not in self.nodes:
                    report.findings.append(
                        Finding(
                            UNKNOWN_NODE,
                            path,
                            file_id,
                            f"chunk {c.index} of {what} is placed on {c.node_id!r},"
                            " which the registry does not know",
                            block_id=block_id,
                        )
                    )
            health = self._assess(info)
            k, n = _kn(info)
            if len(health.live) < k:
                report.findings.append(
                    Finding(
                        BLOCK_LOST,
                        path,
                        file_id,
                        f"{what} has {len(health.live)} good chunks of the {k} needed",
                        block_id=block_id,
                    )
                )
            elif health.missing:
                report.findings.append(
                    Finding(
                        BLOCK_DEGRADED,
                        path,
                        file_id,
                        f"{what} has {len(health.live)} good chunks of {n}"
                        f" (missing {sorted(health.missing)}); readable",
                        block_id=block_id,
                    )
                )

    def _assess(self, info: BlockInfo) -> BlockHealth:
        h = self._health.get(info.block_id)
        if h is None:
            h = self._health[info.block_id] = assess(info, self.nodes, self.bad)
        return h

    async def _locate(self, ids: list[int]) -> None:
        """Block records of ``ids`` into the cache; None for one that is gone."""
        meta = self.m.meta
        for i in range(0, len(ids), _LOCATE_BATCH):
            batch = ids[i : i + _LOCATE_BATCH]
            try:
                found = await meta.locate_blocks(batch)
            except FileNotFound:
                found = []
                for b in batch:
                    try:
                        found.extend(await meta.locate_blocks([b]))
                    except FileNotFound:
                        self._blocks[b] = None
            self._blocks.update((info.block_id, info) for info in found)

    async def _scan_records(self, report: Report, reached: dict[int, str], *, whole: bool) -> None:
        """Every record of every shard: the unreachable ones (``whole`` walks only: a walk of
        a subtree reaches only part of the namespace) and expired writer leases."""
        meta = self.m.meta
        now = time.time_ns()
        young = now - int(self.grace_s * 1e9)
        renaming = await self.renaming()
        unreachable_files: list[tuple[int, str]] = []
        for shard in range(self.m.config.shards):
            async for rec in meta.scan_files(shard):
                report.records += 1
                fid = int(rec["id"])
                path = reached.get(fid)
                if rec["writer"] and rec["lease_ns"] < now and (path is not None or whole):
                    report.findings.append(
                        Finding(
                            LEASE_EXPIRED,
                            path or f"<record {fid}>",
                            fid,
                            f"writer lease ran out {(now - rec['lease_ns']) / 1e9:.0f}s ago"
                            " without a close (the GC recovers it)",
                        )
                    )
                if not whole or path is not None or fid == ROOT_ID:
                    continue
                if rec["created_ns"] >= young or fid in renaming:
                    continue  # a create or a rename in flight
                if rec["nlink"] == 0 and (rec["writer"] or rec["kind"] == KIND_DIR):
                    continue  # unlinked while open; a removed directory's last step
                holds = rec["size"] > 0 or rec["blocks"] > 0 or rec["kind"] == KIND_DIR
                label = f"<record {fid}, was {rec['name']!r}>" if rec["name"] else f"<record {fid}>"
                if rec["blocks"] and rec["kind"] == KIND_FILE:
                    unreachable_files.append((fid, label))
                report.findings.append(
                    Finding(
                        UNREACHABLE,
                        label,
                        fid,
                        f"{rec['kind']} record no name reaches ({rec['size']} bytes,"
                        f" {rec['blocks']} blocks, {rec['nlink']} links)",
                        entry_kind=str(rec["kind"]),
                        holds_data=bool(holds and rec["nlink"] > 0),
                        ctime_ns=int(rec["ctime_ns"]),
                    )
                )
        for fid, label in unreachable_files:  # their bytes too: --repair keeps them whole
            await self._check_file(report, fid, label)

    async def renaming(self) -> set[int]:
        """Children of every pending cross-shard rename intent (any deadline)."""
        out: set[int] = set()
        for shard in range(self.m.config.shards):
            r = await self.m.meta.call(
                "name.intents", {"shard": shard, "before_ns": _MAX_INTENT_NS}
            )
            out.update(int(i["id"]) for i in r["intents"])
        return out

    # --- --repair ----------------------------------------------------------------------------

    async def repair(self, report: Report) -> int:
        """The safe repairs of the module docstring, for ``report``'s findings (a pass of
        ``check`` just before); returns how many findings were acted on."""
        done = 0
        lost_found: int | None = None
        repairer = Repairer(self.m)
        for f in report.findings:
            try:
                if f.kind == DANGLING:
                    await self.m.meta.call(
                        "name.remove",
                        {"dir": f.dir_id, "name": f.name, "kind": f.entry_kind, "expect_id": f.id},
                    )
                    log.warning("fsck: removed dangling name %s (it named record %d)", f.path, f.id)
                    f.repaired = f"name removed (it named record {f.id})"
                elif f.kind == UNREACHABLE and f.holds_data:
                    if lost_found is None:
                        lost_found = await self._lost_and_found()
                    name = f"{f.id:016x}"
                    await self._adopt(lost_found, name, f.id, f.entry_kind)
                    log.warning(
                        "fsck: record %d %s moved to /%s/%s", f.id, f.path, LOST_AND_FOUND, name
                    )
                    f.repaired = f"named /{LOST_AND_FOUND}/{name}"
                elif f.kind == UNREACHABLE:
                    # Nothing in it to keep: what the GC's sweep would delete, with the same
                    # re-checks (unchanged since the scan, no live writer, no entries).
                    if not await self.m.meta.collect_unreachable(f.id, f.ctime_ns):
                        continue
                    log.warning("fsck: deleted empty unreachable record %d %s", f.id, f.path)
                    f.repaired = "empty record deleted"
                elif f.kind == BLOCK_DEGRADED and f.block_id in self._health:
                    h = self._health.pop(f.block_id)  # a pack's block: rebuilt once
                    restored = await repairer.repair_block(h, self.nodes, self.bad)
                    f.repaired = f"{restored} chunks rebuilt"
                else:
                    continue
            except TectonicError as e:
                log.warning("fsck: could not repair %s (%s): %s", f.path, f.kind, e)
                f.repaired = f"not repaired: {e}"
                continue
            done += 1
        return done

    async def _lost_and_found(self) -> int:
        meta = self.m.meta
        try:
            return (await meta.lookup(ROOT_ID, LOST_AND_FOUND)).id
        except FileNotFound:
            pass
        try:
            return (await meta.mkdir(ROOT_ID, LOST_AND_FOUND, mode=0o700)).id
        except FileExists:
            return (await meta.lookup(ROOT_ID, LOST_AND_FOUND)).id

    async def _adopt(self, dir_id: int, name: str, record: int, kind: str) -> None:
        """Name ``record`` in ``dir_id``: the entry first, then the record's name hint (a
        crash in between leaves a named record whose hint is stale, which fsck accepts)."""
        meta = self.m.meta
        try:
            await meta.call(
                "name.insert", {"dir": dir_id, "name": name, "id": record, "kind": kind}
            )
        except FileExists:
            if (await meta.lookup(dir_id, name)).id != record:
                raise
        await meta.call("file.link", {"id": record, "parent": dir_id, "name": name})


def _kn(info: BlockInfo) -> tuple[int, int]:
    policy = ECPolicy.parse(info.ec)
    return policy.k, policy.n


async def check_and_repair(
    m: Maintenance, path: str = "/", *, grace_s: float = DEFAULT_GRACE_S, inventory: bool = True
) -> tuple[Report, Report, list[Finding]]:
    """``--repair``: a pass and its repairs, then passes again while repairs expose more (a
    directory named in /lost+found brings its subtree into the walk), at most
    ``REPAIR_PASSES`` times. Returns the first report, the last one and every finding acted
    on (each with what was done)."""
    fsck = Fsck(m, grace_s=grace_s)
    first = report = await fsck.check(path, inventory=inventory)
    acted: list[Finding] = []
    for _ in range(REPAIR_PASSES):
        if not await fsck.repair(report):
            break
        acted += [f for f in report.findings if f.repaired]
        fsck = Fsck(m, grace_s=grace_s)
        report = await fsck.check(path, inventory=False)
        if report.severity == "clean":
            break
    return first, report, acted
