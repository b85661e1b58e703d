"""``tectonic retention set|get|ls|rm CLUSTER_FILE [DIR]``: keep-last-N enforced by the cluster.

``set DIR --keep-last N`` keeps the newest N committed steps of DIR (its subdirectories
whose names hold a step number; staging directories, hidden names and other entries are
never touched): after each ``tectonic commit`` (within the maintenance daemon's
``--retention-interval``) the older ones are removed, except any step a symbolic link in DIR
(``latest``) names. A removed step is first renamed out of sight in one transaction, so a
crash leaves every step whole or gone (metadata/retention_ops.py). ``get`` prints DIR's
policy, ``ls`` every policy of the cluster, ``rm`` drops DIR's policy (its steps stay).

Refused with one line, nothing changed: DIR ``/``, N below 1, a DIR that does not exist or is
not a directory, ``rm`` of a DIR without a policy.
"""

from __future__ import annotations

import argparse
import json
import posixpath
from typing import Any

import trio

from tectonic_py.cli.common import add_cluster_file, add_connect_wait
from tectonic_py.client.tectonic_client import TectonicClient, open_client
from tectonic_py.core.errors import ConfigError, FileNotFound, InvalidArgument

MAX_KEEP = 1_000_000


def _dir_path(path: str) -> str:
    if not path.startswith("/"):
        raise ConfigError(f"{path!r}: the directory must be an absolute path in the cluster")
    norm = posixpath.normpath(path)
    if norm == "/":
        raise ConfigError("retention on / is refused: its entries are not one job's steps")
    return norm


async def _dir_id(client: TectonicClient, path: str) -> int:
    try:
        attrs = await client.stat(path)
    except FileNotFound:
        raise ConfigError(f"{path}: no such directory") from None
    if not attrs.is_dir:
        raise ConfigError(f"{path}: not a directory")
    return attrs.id


async def set_retention(client: TectonicClient, path: str, keep_last: int) -> None:
    """Keep the newest ``keep_last`` committed steps of ``path`` (the loadtest's too)."""
    path = _dir_path(path)
    if not 1 <= keep_last <= MAX_KEEP:
        raise ConfigError(f"--keep-last must be 1..{MAX_KEEP}, not {keep_last}")
    try:
        await client.meta.set_retention(await _dir_id(client, path), keep_last, path)
    except InvalidArgument as e:
        raise ConfigError(str(e)) from None


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    async with open_client(args.cluster_file, first_contact_deadline=args.connect_wait) as client:
        meta = client.meta
        if args.action == "ls":
            rows = await meta.retention_policies(client.config.shards)
            return {"policies": [{"dir": p, "keep_last": k} for _, k, p in sorted(rows)]}
        path = _dir_path(args.dir)
        if args.action == "set":
            await set_retention(client, path, args.keep_last)
            return {"dir": path, "keep_last": args.keep_last}
        dir_id = await _dir_id(client, path)
        if args.action == "get":
            keep = await meta.retention_of(dir_id)
            return {"dir": path, "keep_last": keep or None}
        if not await meta.remove_retention(dir_id):
            raise ConfigError(f"{path}: no retention policy to remove")
        return {"dir": path, "removed": True}


def cmd_retention(args: argparse.Namespace) -> int:
    if args.action in ("set", "get", "rm") and not args.dir:
        raise ConfigError(f"retention {args.action} needs a DIR")
    if args.action == "set":
        if args.keep_last is None:
            raise ConfigError("retention set needs --keep-last N")
        _dir_path(args.dir)
        if not 1 <= args.keep_last <= MAX_KEEP:
            raise ConfigError(f"--keep-last must be 1..{MAX_KEEP}, not {args.keep_last}")
    result = trio.run(_run, args)
    if args.json:
        print(json.dumps(result))
    elif args.action == "ls":
        for p in result["policies"]:
            print(f"{p['dir']}\tkeep-last {p['keep_last']}")
    elif args.action == "get":
        keep = result["keep_last"]
        print(f"{result['dir']}\t{f'keep-last {keep}' if keep else 'no retention policy'}")
    elif args.action == "set":
        print(f"{result['dir']}\tkeep-last {result['keep_last']}")
    else:
        print(f"{result['dir']}\tretention policy removed")
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "retention",
        help="keep the newest N committed steps of a directory, enforced by the cluster",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument("action", choices=("set", "get", "ls", "rm"), help="what to do")
    add_cluster_file(p)
    p.add_argument("dir", metavar="DIR", nargs="?", help="the directory of the steps")
    p.add_argument("--keep-last", type=int, metavar="N", help="set: how many steps to keep")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    add_connect_wait(p)
    p.set_defaults(func=cmd_retention)
