"""What a metadata operation is: its arguments, result, routing, safety and roles, declared once.

Every op of the metadata service is one ``Op`` in metadata/api/ops.py. From those
declarations come the server's dispatch table (``bind``: each op's handler, its arguments
checked and filled in before the handler runs), the roles the RPC server lets call each op
(``roles_by_op``), the client's routing and its read/repeatable/coalesced sets, ``tectonic
call`` and the operations table of docs/operations-table.md (``markdown``). A handler
without a declaration, or a declaration without a handler, stops the server from starting.

Arguments: each ``Arg`` has a type and bounds. ``validate`` refuses a missing required
argument, an argument of the wrong type or out of bounds, and an argument the op does not
declare (a misspelt field is a bug to hear about, not a default to fall back on), each with
an ``InvalidArgument`` that names the op and the field; then it fills in every default, so a
handler reads ``req["name"]`` and never checks a field again.

Routing (``Route``): ``shard`` ops go to the shard of their key field (a list key: the shard
of its items, which must share one); ``drawn`` ops to a shard the caller draws (a new
record's); ``scan`` ops to the shard the caller names (the maintenance scans visit every
shard); ``registry`` ops to the registry's shard; ``server`` ops to every metadata server
(each answers for itself); ``any`` ops to any server. Shard-bound ops (``shard``, ``drawn``,
``scan``) carry the ``shard`` field.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tectonic_py.core.auth import ROLE_ADMIN, ROLES
from tectonic_py.core.errors import InvalidArgument
from tectonic_py.core.ids import MAX_CHUNK_INDEX, MAX_ID, NODE_ID_RE
from tectonic_py.core.records import ALL_KINDS, validate_name
from tectonic_py.core.rpc_server import Request

REQUIRED: Any = object()
MAX_SHARD = 2**31
I64 = 2**63 - 1


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ints_in(v: object, bounds: Iterable[tuple[int, int]]) -> bool:
    bounds = list(bounds)
    return (
        isinstance(v, list | tuple)
        and len(v) == len(bounds)
        and all(_is_int(x) and lo <= x <= hi for x, (lo, hi) in zip(v, bounds, strict=True))
    )


@dataclass(frozen=True)
class Arg:
    """One field of a request. ``type``: id (1..MAX_ID), int, float, str, bytes, bool, list,
    map, name (a path component), kind (a record kind), ids, node_ids, pairs (lists of
    ``width`` integers 0..MAX_ID), chunk_refs ([node_id, block_id, index]), entries
    ([index, block_id]), cursor_chunk ([block_id, index]), cursor_name ([dir_id, name])."""

    name: str
    type: str
    default: Any = REQUIRED
    lo: int = 0
    hi: int = 2**64 - 1
    max_len: int = 4096
    choices: tuple[str, ...] = ()
    width: int = 0

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def describe(self) -> str:
        """The argument as the operations table shows it."""
        t = self.type
        if t == "id":
            t = "id" if self.lo else "id or 0"
        elif t == "int" and (self.lo, self.hi) != (0, 2**64 - 1):
            t += f" {self.lo}..{_num(self.hi)}"
        elif t in ("str", "bytes", "list", "ids", "node_ids", "pairs", "chunk_refs", "entries"):
            t += f" <={_num(self.max_len)}"
        if self.choices:
            t = " / ".join(self.choices)
        text = f"{self.name}: {t}"
        return text if self.required else f"[{text} = {self.default!r}]"

    def check(self, op: str, value: Any) -> Any:
        """``value`` if it is of this argument's type and within its bounds (lists of pairs
        as tuples), else ``InvalidArgument``. A value equal to the default, of the default's
        own type (never ``False`` for a default ``0``), stands for it; defaults are
        immutable, since every request that omits the field shares one."""
        if value is None or (
            not self.required and type(value) is type(self.default) and value == self.default
        ):
            if self.required:
                raise InvalidArgument(f"{op}: missing field {self.name!r}")
            return self.default
        check = _CHECKS[self.type]
        ok, out = check(self, value)
        if not ok:
            raise InvalidArgument(f"{op}: field {self.name!r} {out}")
        return out


def _num(n: int) -> str:
    for e in (64, 63, 62, 32, 31):
        if n == 2**e - 1:
            return f"2^{e}-1"
        if n == 2**e:
            return f"2^{e}"
    return str(n)


def _int(a: Arg, v: Any) -> tuple[bool, Any]:
    if not _is_int(v):
        return False, "must be an integer"
    if not a.lo <= v <= a.hi:
        return False, f"outside {a.lo}..{a.hi}"
    return True, v


def _float(a: Arg, v: Any) -> tuple[bool, Any]:
    if not (_is_int(v) or isinstance(v, float)) or not math.isfinite(v):
        return False, "must be a finite number"
    return True, v


def _sized(
    kind: type[str | bytes | list[Any]], what: str
) -> Callable[[Arg, Any], tuple[bool, Any]]:
    def check(a: Arg, v: Any) -> tuple[bool, Any]:
        if not isinstance(v, kind):
            return False, f"must be {what}"
        if len(v) > a.max_len:
            return False, f"longer than {a.max_len}"
        if a.choices and v not in a.choices:
            return False, f"must be one of {', '.join(a.choices)}, not {v!r}"
        return True, v

    return check


def _bool(a: Arg, v: Any) -> tuple[bool, Any]:
    return (True, v) if isinstance(v, bool) else (False, "must be true or false")


def _map(a: Arg, v: Any) -> tuple[bool, Any]:
    return (True, v) if isinstance(v, dict) else (False, "must be a map")


def _name(a: Arg, v: Any) -> tuple[bool, Any]:
    return True, validate_name(v)  # (InvalidName, its own errno: ENAMETOOLONG, EINVAL)


def _kind(a: Arg, v: Any) -> tuple[bool, Any]:
    if v not in ALL_KINDS:
        return False, f"is an unknown kind {v!r}"
    return True, v


def _list_of(
    test: Callable[[Arg, Any], bool], what: str, convert: Callable[[Any], Any] = lambda x: x
) -> Callable[[Arg, Any], tuple[bool, Any]]:
    def check(a: Arg, v: Any) -> tuple[bool, Any]:
        if not isinstance(v, list):
            return False, "must be a list"
        if len(v) > a.max_len:
            return False, f"has over {a.max_len} items"
        if not all(test(a, x) for x in v):
            return False, f"must be {what}"
        return True, [convert(x) for x in v]

    return check


def _cursor(bounds: Callable[[Any], bool], what: str) -> Callable[[Arg, Any], tuple[bool, Any]]:
    def check(a: Arg, v: Any) -> tuple[bool, Any]:
        if not (isinstance(v, list | tuple) and len(v) == 2 and bounds(v)):
            return False, f"must be {what}"
        return True, (v[0], v[1])

    return check


_CHECKS: dict[str, Callable[[Arg, Any], tuple[bool, Any]]] = {
    "int": _int,
    "id": _int,
    "float": _float,
    "str": _sized(str, "a string"),
    "bytes": _sized(bytes, "bytes"),
    "bool": _bool,
    "list": _sized(list, "a list"),
    "map": _map,
    "name": _name,
    "kind": _kind,
    "ids": _list_of(lambda a, x: _is_int(x) and 0 < x <= MAX_ID, "ids"),
    "node_ids": _list_of(lambda a, x: isinstance(x, str) and bool(NODE_ID_RE.match(x)), "node ids"),
    "pairs": _list_of(
        lambda a, x: _ints_in(x, [(0, MAX_ID)] * a.width),
        "lists of integers",
        tuple,
    ),
    "chunk_refs": _list_of(
        lambda a, x: (
            isinstance(x, list | tuple)
            and len(x) == 3
            and isinstance(x[0], str)
            and bool(NODE_ID_RE.match(x[0]))
            and _ints_in(x[1:], [(1, MAX_ID), (0, MAX_CHUNK_INDEX)])
        ),
        "[node_id, block_id, index] triples",
        tuple,
    ),
    "entries": _list_of(
        lambda a, x: isinstance(x, list) and _ints_in(x, [(0, 2**40 - 1), (1, MAX_ID)]),
        "[index, block_id] pairs",
        tuple,
    ),
    "cursor_chunk": _cursor(
        lambda v: _ints_in(v, [(0, MAX_ID), (-1, MAX_CHUNK_INDEX)]), "[block_id, index]"
    ),
    "cursor_name": _cursor(
        lambda v: _is_int(v[0]) and 0 <= v[0] <= MAX_ID and isinstance(v[1], str), "[dir_id, name]"
    ),
}


# --- argument constructors: the declarations read as a table --------------------------------


def id_(name: str, default: Any = REQUIRED, *, lo: int = 1) -> Arg:
    return Arg(name, "id", default, lo=lo, hi=MAX_ID)


def int_(name: str, default: Any = REQUIRED, *, lo: int = 0, hi: int = 2**64 - 1) -> Arg:
    return Arg(name, "int", default, lo=lo, hi=hi)


def str_(
    name: str, default: Any = REQUIRED, *, max_len: int = 4096, choices: tuple[str, ...] = ()
) -> Arg:
    return Arg(name, "str", default, max_len=max_len, choices=choices)


def bytes_(name: str, default: Any = REQUIRED, *, max_len: int = 65536) -> Arg:
    return Arg(name, "bytes", default, max_len=max_len)


def bool_(name: str, default: Any = REQUIRED) -> Arg:
    return Arg(name, "bool", default)


def name_(name: str = "name", default: Any = REQUIRED) -> Arg:
    return Arg(name, "name", default)


def list_(
    name: str, type_: str = "list", default: Any = REQUIRED, *, max_len: int, width: int = 0
) -> Arg:
    return Arg(name, type_, default, max_len=max_len, width=width)


# --- operations ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    """Where an op goes (module docstring): ``kind`` and, for ``shard``, its key field."""

    kind: str
    key: str = ""

    KINDS = ("shard", "drawn", "scan", "registry", "server", "any")

    @property
    def shard_bound(self) -> bool:
        return self.kind in ("shard", "drawn", "scan")

    def describe(self) -> str:
        return f"shard of {self.key}" if self.kind == "shard" else self.kind


def by(key: str) -> Route:
    return Route("shard", key)


DRAWN, SCAN, REGISTRY, SERVER, ANY = (
    Route(k) for k in ("drawn", "scan", "registry", "server", "any")
)


@dataclass(frozen=True)
class Op:
    """One metadata operation. ``mutates``: it changes the metadata. ``repeatable``: sending
    it again after a lost reply does no harm (every read is; a mutation is when a repeat
    lands the same, or leaves only garbage the GC collects). ``coalesce``: the client may
    carry it in a ``batch`` with others (the burst's short calls). ``roles``: who may call
    it; admin may call everything."""

    name: str
    args: tuple[Arg, ...]
    result: str
    route: Route
    roles: frozenset[str]
    mutates: bool
    repeatable: bool = False
    coalesce: bool = False
    doc: str = ""
    arg_map: Mapping[str, Arg] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.route.kind not in Route.KINDS:
            raise ValueError(f"{self.name}: unknown route {self.route.kind!r}")
        unknown = set(self.roles) - set(ROLES)
        if unknown or ROLE_ADMIN not in self.roles:
            raise ValueError(f"{self.name}: roles {sorted(self.roles)} (admin must be one)")
        args = list(self.args)
        if self.route.shard_bound:
            args.append(int_("shard", hi=MAX_SHARD))
        names = [a.name for a in args]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: an argument declared twice")
        if self.route.kind == "shard" and self.route.key not in names:
            raise ValueError(f"{self.name}: routed by {self.route.key!r}, not an argument")
        object.__setattr__(self, "arg_map", {a.name: a for a in args})

    @property
    def handler_name(self) -> str:
        """The server method that answers it: ``name.lookup`` -> ``op_name__lookup``."""
        return "op_" + self.name.replace(".", "__", 1)

    def validate(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        """The request's fields checked against the declaration, defaults filled in."""
        extra = fields.keys() - self.arg_map.keys()
        if extra:
            raise InvalidArgument(f"{self.name}: unknown field {min(extra)!r}")
        return {n: a.check(self.name, fields.get(n)) for n, a in self.arg_map.items()}


class Contract:
    """The declared ops by name (metadata/api/ops.py builds the one instance, ``OPS``)."""

    def __init__(self, ops: Iterable[Op]) -> None:
        self.ops: dict[str, Op] = {}
        for op in ops:
            if op.name in self.ops:
                raise ValueError(f"{op.name} declared twice")
            self.ops[op.name] = op

    def __getitem__(self, name: str) -> Op:
        op = self.ops.get(name)
        if op is None:
            raise InvalidArgument(f"unknown metadata op {name!r}")
        return op

    def __contains__(self, name: object) -> bool:
        return name in self.ops

    def __iter__(self) -> Any:
        return iter(self.ops.values())

    def names(self, test: Callable[[Op], bool]) -> frozenset[str]:
        return frozenset(op.name for op in self if test(op))

    def roles_by_op(self) -> dict[str, frozenset[str]]:
        """What the RPC server lets each role call (``RpcServer(roles=...)``)."""
        return {op.name: op.roles for op in self}

    def bind(self, server: object) -> dict[str, Callable[[Request], Awaitable[Any]]]:
        """The dispatch table over ``server``'s ``op_*`` methods, each behind its
        declaration's argument check. Refuses a handler without a declaration and a
        declaration without a handler."""
        methods = {a for a in dir(server) if a.startswith("op_")}
        declared = {op.handler_name: op for op in self}
        if methods != set(declared):
            missing = sorted(set(declared) - methods)
            undeclared = sorted(methods - set(declared))
            raise ValueError(
                f"contract and handlers differ: no handler for {missing}, "
                f"no declaration for {undeclared}"
            )
        return {op.name: _checked(op, getattr(server, h)) for h, op in declared.items()}

    def markdown(self) -> str:
        """The operations table of docs/ (tests/test_contract.py keeps the file current)."""
        lines = [
            "| op | arguments | result | route | roles | mutates | resent safely |",
            "|---|---|---|---|---|---|---|",
        ]
        for op in sorted(self, key=lambda o: o.name):
            args = ", ".join(a.describe() for a in op.args) or "-"
            roles = ", ".join(r for r in ROLES if r in op.roles)
            lines.append(
                f"| `{op.name}` | {args} | {op.result or '-'} | {op.route.describe()} | {roles} "
                f"| {'yes' if op.mutates else 'no'} | {'yes' if op.repeatable else 'no'} |"
            )
        return "\n".join(lines) + "\n"


def _checked(
    op: Op, handler: Callable[[Request], Awaitable[Any]]
) -> Callable[[Request], Awaitable[Any]]:
    async def checked(req: Request) -> Any:
        req.fields = op.validate(req.fields)
        return await handler(req)

    checked.__name__ = handler.__name__
    return checked
