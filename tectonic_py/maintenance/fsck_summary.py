"""The last fsck pass, kept where every tool can read it: the root directory's
``user.tectonic.fsck`` xattr (a small JSON summary, whatever the cluster's size).

``tectonic status`` and ``tectonic repair --status`` do not walk the namespace: a walk costs
one call per name and per record, far too much for a command an operator or a monitor runs
every minute on a big cluster. They check what is cheap (down stores, the chunks recorded bad,
the blocks of both) and show this summary beside it, with its age: a file whose block record
is gone, or a chunk pointed at a store that does not hold it, shows from the next fsck or
inventory pass on. Any tool holding the client key can write the xattr; it is a report, and
status never takes "clean" from it, only "lost".
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Protocol

from tectonic_py.core.errors import TectonicError, XattrNotFound
from tectonic_py.core.ids import ROOT_ID

log = logging.getLogger(__name__)

LAST_RESULT_XATTR = "user.tectonic.fsck"
LOST_KINDS = frozenset({"block_missing", "block_lost"})


class Xattrs(Protocol):
    """What the summary needs of the metadata client."""

    async def getxattr(self, file_id: int, name: str) -> bytes: ...

    async def setxattr(self, file_id: int, name: str, value: bytes) -> None: ...


def summarize(
    path: str, severity: str, counts: dict[str, int], lost_paths: list[str], checked_at: float
) -> dict[str, Any]:
    return {
        "checked_at": checked_at,
        "path": path,
        "severity": severity,
        "counts": counts,
        "lost_files": len(lost_paths),
        "lost_paths": sorted(lost_paths)[:20],
    }


async def keep(meta: Xattrs, summary: dict[str, Any]) -> None:
    """Store ``summary`` for status; a failure is logged, the pass's own report stands."""
    try:
        await meta.setxattr(ROOT_ID, LAST_RESULT_XATTR, json.dumps(summary).encode())
    except TectonicError as e:
        log.warning("could not keep the fsck summary for tectonic status: %s", e)


async def last(meta: Xattrs) -> dict[str, Any] | None:
    """The last pass's summary with its ``age_s``, or None when none was kept (or it is
    unreadable: then status says so rather than guess)."""
    try:
        raw = await meta.getxattr(ROOT_ID, LAST_RESULT_XATTR)
        summary = json.loads(raw)
        if not isinstance(summary, dict) or "severity" not in summary:
            return None
    except (XattrNotFound, ValueError):
        return None
    summary["age_s"] = max(0.0, time.time() - float(summary.get("checked_at", 0.0)))
    return summary


def says_lost(summary: dict[str, Any] | None) -> bool:
    return summary is not None and summary.get("severity") == "lost"


def describe(summary: dict[str, Any] | None) -> str:
    """One line for the human forms of status and repair --status."""
    if summary is None:
        return (
            "last fsck: none kept; this status checks down stores and recorded bad chunks"
            " only (run `tectonic fsck` for the full walk)"
        )
    counts = ", ".join(f"{k}: {v}" for k, v in sorted(summary.get("counts", {}).items()))
    lost = summary.get("lost_paths") or []
    text = (
        f"last fsck of {summary.get('path', '/')}: {summary['severity']},"
        f" {summary['age_s'] / 60:.0f} min ago" + (f" ({counts})" if counts else "")
    )
    if lost:
        text += f"; data lost in {summary.get('lost_files', len(lost))} files, e.g. {lost[0]}"
    return text
