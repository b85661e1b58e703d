"""``tectonic fsck CLUSTER_FILE [PATH]``: the namespace, its records, their blocks and the
chunk stores checked end to end (tectonic_py/maintenance/fsck.py says what each finding
means), one line per finding and path, or ``--json``.

Exit codes: 0 clean; 3 data lost (a file has a block whose record is gone or with fewer than
k good chunks); 4 everything readable but not whole (degraded blocks, dangling names,
unreachable records, chunks on unknown nodes, expired writer leases); 1 the command failed;
2 a usage error. ``--repair`` does the safe repairs, checks again and exits with what is
left. Each pass's summary is kept in the root directory's ``user.tectonic.fsck`` xattr,
which ``tectonic status`` shows.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import trio

from tectonic_py.cli.common import EXIT_DEGRADED, EXIT_UNHEALTHY, add_cluster_file
from tectonic_py.cli.maintenance import with_maintenance
from tectonic_py.core import cluster_file
from tectonic_py.maintenance import fsck_summary
from tectonic_py.maintenance.fsck import DEFAULT_GRACE_S, Fsck, check_and_repair
from tectonic_py.maintenance.runtime import Maintenance

log = logging.getLogger(__name__)

EXIT_OF = {"clean": 0, "degraded": EXIT_DEGRADED, "lost": EXIT_UNHEALTHY}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "fsck",
        help="check names, records, blocks and chunks end to end (exit 0 clean, 3 data lost, "
        "4 degraded but readable)",
    )
    add_cluster_file(p, type=Path)
    p.add_argument("path", metavar="PATH", nargs="?", default="/", help="the subtree to check")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--repair",
        action="store_true",
        help="remove dangling names, move unreachable records that hold data to /lost+found "
        "(delete empty ones), rebuild degraded blocks; then check again",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=DEFAULT_GRACE_S,
        help="seconds a record may be unreachable (a create in flight) before it is reported",
    )
    p.add_argument(
        "--no-inventory",
        action="store_true",
        help="skip the pass over every chunk store's listing (use what was recorded before)",
    )
    p.set_defaults(func=run_fsck)


async def fsck_pass(
    m: Maintenance, path: str, *, repair: bool, grace_s: float, inventory: bool
) -> dict[str, Any]:
    if repair:
        report, after, acted = await check_and_repair(m, path, grace_s=grace_s, inventory=inventory)
        out: dict[str, Any] = report.to_json()
        out["repaired"] = len(acted)
        out["repairs"] = [f.to_json() for f in acted]
        out["after_repair"] = after.to_json()
        report = after
    else:
        report = await Fsck(m, grace_s=grace_s).check(path, inventory=inventory)
        out = report.to_json()
    await fsck_summary.keep(m.meta, report.summary())
    out["exit_code"] = EXIT_OF[report.severity]
    return out


def run_fsck(args: argparse.Namespace) -> int:
    config = cluster_file.load(args.cluster_file)

    async def one(m: Maintenance) -> dict[str, Any]:
        return await fsck_pass(
            m,
            args.path,
            repair=args.repair,
            grace_s=args.grace,
            inventory=not args.no_inventory,
        )

    out = trio.run(with_maintenance, config, one)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(format_report(out))
    code: int = out["exit_code"]
    return code


def format_report(out: dict[str, Any]) -> str:
    lines = []
    for f in out["findings"]:
        lines.append(f"{f['kind']}: {f['path']}: {f['detail']}")
    for f in out.get("repairs", []):
        lines.append(f"repaired {f['kind']}: {f['path']}: {f['repaired']}")
    lines.append(
        f"checked {out['path']}: {out['dirs']} directories, {out['files']} files,"
        f" {out['blocks']} block entries, {out['records']} records: {out['severity']}"
    )
    after = out.get("after_repair")
    if after is not None:
        lines.append(f"repaired {out['repaired']} findings; after repair: {after['severity']}")
        lines += [f"  still {f['kind']}: {f['path']}: {f['detail']}" for f in after["findings"]]
    return "\n".join(lines)
