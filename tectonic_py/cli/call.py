"""``tectonic call CLUSTER_FILE OP [JSON_ARGS]``: one metadata operation by name.

For operators and tests, as ``ceph tell`` is: the op is any of the metadata contract's
(metadata/api; ``tectonic call --list`` prints them with their arguments and roles), its
arguments a JSON object, routed to the shard its declaration names (a ``shard`` argument
picks one for the ops that scan shard by shard; ops answered by every server print one result
per server). It runs as the cluster file's role, so the servers refuse what that role may
not call. Arguments of type bytes are given as text (UTF-8); bytes in a result print as hex.

Exit 0 with the result as one JSON line; 1 with one line (the server's refusal, a bad
argument, an unknown op, JSON that does not parse): nothing was changed.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import trio

from metadata.api import OPS, Op
from tectonic_py.cli.common import add_cluster_file, add_connect_wait
from tectonic_py.client.tectonic_client import open_client
from tectonic_py.core.errors import InvalidArgument


def parse_args(op: Op, text: str) -> dict[str, Any]:
    """The JSON object of ``text`` as the op's fields (its bytes arguments encoded)."""
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"{op.name}: arguments are not JSON: {e.msg} at {e.pos}") from None
    if not isinstance(fields, dict):
        raise InvalidArgument(f'{op.name}: arguments must be a JSON object, like {{"id": 5}}')
    for name, arg in op.arg_map.items():
        if arg.type == "bytes" and isinstance(fields.get(name), str):
            fields[name] = fields[name].encode()
    return fields


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def cmd_call(args: argparse.Namespace) -> int:
    if args.list:
        for op in sorted(OPS, key=lambda o: o.name):
            roles = ",".join(sorted(op.roles))
            print(f"{op.name:24} [{roles}] {', '.join(a.describe() for a in op.args)}")
        return 0
    if not args.op:
        raise InvalidArgument("name an op (tectonic call --list prints them)")
    op = OPS[args.op]
    fields = parse_args(op, args.json_args)

    async def go() -> Any:
        async with open_client(
            args.cluster_file, first_contact_deadline=args.connect_wait
        ) as client:
            return await client.meta.call(op.name, fields)

    print(json.dumps(_jsonable(trio.run(go))))
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "call",
        help="one metadata operation by name, its arguments as JSON (operators, tests)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    add_cluster_file(p)
    add_connect_wait(p)
    p.add_argument("op", metavar="OP", nargs="?", help="e.g. file.get, block.forget")
    p.add_argument(
        "json_args", metavar="JSON_ARGS", nargs="?", default="{}", help="e.g. '{\"id\": 5}'"
    )
    p.add_argument(
        "--list", action="store_true", help="print every op with its arguments and roles"
    )
    p.set_defaults(func=cmd_call)
