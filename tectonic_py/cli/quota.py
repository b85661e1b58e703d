"""``tectonic quota set/get/ls/rm`` and ``tectonic reserve``: directory quotas and reservations.

``quota set CLUSTER_FILE DIR --bytes SIZE --files N`` limits the logical bytes and the
entries (files, directories, links) under DIR; 0 or left out: no limit on that side (a
limit left out of a change keeps its value). The first set counts what is already there.
Setting and removing quotas needs the admin cluster file (``cluster.toml``); reading them
does not. ``quota get`` folds the usage not yet folded first when the role may (admin,
maintenance), so it shows exact figures. A write over a quota fails with EDQUOT (on a
mount: "Disk quota exceeded"), a create over the file limit too; what was written before
stays. Quotas do not nest, and a rename between two quota realms is refused (EXDEV).

``reserve CLUSTER_FILE DIR SIZE [--ttl 10m]`` holds SIZE logical bytes for DIR's writes
(files directly in DIR) before a checkpoint: it fails at once, with nothing written, when
the cluster's free raw space on live chunk stores (less other reservations; SIZE times the
EC overhead of DIR's policy) cannot hold it (ENOSPC), or DIR's quota cannot (EDQUOT).
While it lasts, DIR's writes draw from it and no other writer can take it. It ends at
``tectonic commit`` of DIR, at ``--release``, or after the TTL.
docs/quotas.md has the whole story.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import trio

from tectonic_py.cli.common import add_cluster_file, add_connect_wait
from tectonic_py.client.tectonic_client import TectonicClient, open_client
from tectonic_py.core.errors import FileNotFound, NotADirectory, PermissionDenied
from tectonic_py.core.units import duration_arg, format_size, size_arg


async def _dir_id(client: TectonicClient, path: str) -> int:
    attrs = await client.stat(path)
    if not attrs.is_dir:
        raise NotADirectory(
            f"{path!r} is a {attrs.kind}: quotas and reservations are on directories"
        )
    return attrs.id


async def _settled(client: TectonicClient) -> None:
    try:
        await client.meta.settle_quotas()
    except PermissionDenied:
        pass  # a client's cluster file: usage as folded by the maintenance daemon


def _line(path: str, q: dict[str, Any]) -> str:
    def side(used: int, limit: int, size: bool) -> str:
        show = format_size if size else str
        return f"{show(used)} of {show(limit) if limit else 'unlimited'}"

    extra = ""
    if q["claimed_bytes"] or q["reserved_bytes"]:
        extra = (
            f", {format_size(q['claimed_bytes'])} claimed by writers,"
            f" {format_size(q['reserved_bytes'])} reserved"
        )
    return (
        f"{path}: bytes {side(q['used_bytes'], q['max_bytes'], True)},"
        f" files {side(q['used_files'], q['max_files'], False)}{extra}"
    )


def _run(args: argparse.Namespace, body: Any) -> Any:
    async def go() -> Any:
        async with open_client(
            args.cluster_file, first_contact_deadline=args.connect_wait
        ) as client:
            return await body(client)

    return trio.run(go)


def cmd_set(args: argparse.Namespace) -> int:
    if args.bytes is None and args.files is None:
        raise SystemExit("tectonic quota set: error: give --bytes SIZE, --files N or both")

    async def body(client: TectonicClient) -> dict[str, Any]:
        dir_id = await _dir_id(client, args.dir)
        try:
            current = await client.meta.get_quota(dir_id)
        except FileNotFound:  # a new quota
            current = {"max_bytes": 0, "max_files": 0}
        max_bytes = current["max_bytes"] if args.bytes is None else args.bytes
        max_files = current["max_files"] if args.files is None else args.files
        await client.meta.set_quota(dir_id, max_bytes, max_files)
        await _settled(client)
        return dict(await client.meta.get_quota(dir_id))

    q = _run(args, body)
    print(json.dumps({"path": args.dir, **q}) if args.json else _line(args.dir, q))
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    async def body(client: TectonicClient) -> dict[str, Any]:
        dir_id = await _dir_id(client, args.dir)
        await _settled(client)
        return dict(await client.meta.get_quota(dir_id))

    q = _run(args, body)
    print(json.dumps({"path": args.dir, **q}) if args.json else _line(args.dir, q))
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    async def body(client: TectonicClient) -> list[dict[str, Any]]:
        await _settled(client)
        return list(await client.meta.list_quotas())

    quotas = _run(args, body)
    if args.json:
        print(json.dumps(quotas))
    else:
        for q in quotas:
            print(_line(f"directory {q['dir']}", q))
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    async def body(client: TectonicClient) -> None:
        await client.meta.remove_quota(await _dir_id(client, args.dir))

    _run(args, body)
    print(f"{args.dir}: quota removed")
    return 0


def cmd_reserve(args: argparse.Namespace) -> int:
    if args.release == (args.size is not None):
        raise SystemExit("tectonic reserve: error: give SIZE, or --release")

    async def body(client: TectonicClient) -> dict[str, Any]:
        dir_id = await _dir_id(client, args.dir)
        if args.release:
            return {"released": args.dir, "left": await client.meta.release(dir_id)}
        r = await client.meta.reserve(dir_id, args.size, args.ttl)
        return {"reserved": args.dir, "ttl_s": args.ttl, **r}

    print(json.dumps(_run(args, body)))
    return 0


def _common(p: argparse.ArgumentParser, *, path: bool = True) -> None:
    add_cluster_file(p)
    add_connect_wait(p)
    if path:
        p.add_argument("dir", metavar="DIR", help="a directory of the cluster (absolute path)")
    p.add_argument("--json", action="store_true", help="print JSON")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "quota",
        help="directory quotas on logical bytes and files",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    sub = p.add_subparsers(dest="quota_command", metavar="ACTION")
    sub.required = True
    s = sub.add_parser("set", help="set or change a directory's limits (admin)")
    _common(s)
    s.add_argument("--bytes", type=size_arg, help="logical bytes (4GiB, 1TB; 0: no limit)")
    s.add_argument("--files", type=_count, help="files, directories and links (0: no limit)")
    s.set_defaults(func=cmd_set)
    g = sub.add_parser("get", help="a directory's limits and usage")
    _common(g)
    g.set_defaults(func=cmd_get)
    ls = sub.add_parser("ls", help="every quota of the cluster")
    _common(ls, path=False)
    ls.set_defaults(func=cmd_ls)
    rm = sub.add_parser("rm", help="remove a directory's quota (admin)")
    _common(rm)
    rm.set_defaults(func=cmd_rm)

    r = subparsers.add_parser(
        "reserve",
        help="reserve space for a directory's writes, or fail at once (ENOSPC, EDQUOT)",
        description=__doc__.split("\n\n")[2] if __doc__ else None,
    )
    add_cluster_file(r)
    add_connect_wait(r)
    r.add_argument("dir", metavar="DIR", help="the directory its writes go to (absolute path)")
    r.add_argument("size", metavar="SIZE", nargs="?", type=size_arg, help="logical bytes")
    r.add_argument("--ttl", type=duration_arg, default="10m", help="how long it lasts")
    r.add_argument("--release", action="store_true", help="end the directory's reservation")
    r.set_defaults(func=cmd_reserve)


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"bad count {text!r}: a whole number, 0 for no limit")
    return int(text)
