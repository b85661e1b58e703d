"""The mount's tuning options, declared once: each is a ``tectonic mount`` flag, a ``-o
key=value`` option (so fstab, systemd mount units and ``mount -t tectonic`` can pass it), a
line of ``--help`` and a row of docs/mount-options.md (``python -m
tectonic_py.cli.mount_options``; a test checks the page is current).

Why one table: a knob added to the client without a row here cannot be set by a mount, and
the page, the flags and the ``-o`` parser can never disagree. ``target`` says who reads the
value: the data-path client (``TectonicClient``'s keyword arguments), the FUSE
``Operations`` (timeouts, create mode) or the mount command itself.

Precedence: a flag beats ``-o``, and ``-o`` beats the default. ``mount(8)``'s own options
(``rw``, ``defaults``, ``_netdev``, ``nofail``, ``x-systemd.*``...) are accepted and ignored;
any other unknown key is refused with one line that names it.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from tectonic_py.client.tectonic_client import TectonicClient
from tectonic_py.core.errors import ConfigError
from tectonic_py.core.metrics_http import parse_listen
from tectonic_py.core.units import format_size, parse_size
from tectonic_py.mount.operations import Operations


def _defaults(cls: type) -> dict[str, Any]:
    """The keyword-only parameters of ``cls`` and their defaults: the table takes its
    defaults from the code that reads them, so the two cannot drift."""
    params = inspect.signature(cls.__init__).parameters.values()  # type: ignore[misc]
    return {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}


DEFAULT_READ_AHEAD_KB = 1024
CLIENT_DEFAULTS = _defaults(TectonicClient)
FUSE_DEFAULTS = _defaults(Operations)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"bad duration {text!r}: give seconds, e.g. 0.5 or 30") from None
    if not 0 <= value <= 3600:
        raise ConfigError(f"bad duration {text!r}: give 0..3600 seconds")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"bad count {text!r}: give a whole number, e.g. 4") from None
    if value < 0:
        raise ConfigError(f"bad count {text!r}: give 0 or more")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"bad fraction {text!r}: give 0..1, e.g. 0.5") from None
    if not 0 <= value <= 1:
        raise ConfigError(f"bad fraction {text!r}: give 0..1, e.g. 0.5")
    return value


def _listen(text: str) -> str:
    parse_listen(text)
    return text


def _flag(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "yes", "true", "on"):
        return True
    if lowered in ("0", "no", "false", "off"):
        return False
    raise ConfigError(f"bad switch {text!r}: give on or off")


@dataclass(frozen=True)
class MountOption:
    """One knob: its key (the keyword its target takes), how its text parses, its default
    and when to change it."""

    key: str
    parse: Callable[[str], Any]
    default: Any
    target: str  # "client", "fuse" or "mount"
    help: str
    unit: str = ""

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    def shown(self, value: Any) -> str:
        if self.parse is parse_size and isinstance(value, int):
            return format_size(value).replace(" ", "").replace(".0", "")
        if self.parse is _flag:
            return "on" if value else "off"
        return "auto" if value is None else str(value)


OPTIONS: tuple[MountOption, ...] = (
    MountOption(
        "window_bytes", parse_size, CLIENT_DEFAULTS["window_bytes"], "client",
        "memory for blocks being written (all files of the mount together); a writer that "
        "finds it full waits. Raise it when many ranks write at once and the node has memory",
    ),
    MountOption(
        "cache_bytes", parse_size, CLIENT_DEFAULTS["cache_bytes"], "client",
        "memory for blocks read (readahead and the blocks of packs that neighbouring files "
        "share). Raise it for restores of many small files",
    ),
    MountOption(
        "readahead_blocks", _count, CLIENT_DEFAULTS["readahead_blocks"], "client",
        "whole blocks fetched ahead of a sequential reader (0: none)",
    ),
    MountOption(
        "write_quorum", _count, CLIENT_DEFAULTS["write_quorum"], "client",
        "chunks of a block that must land before close returns (auto: k + 1). Never below k "
        "+ 1 unless a lost chunk store may lose data written just before",
    ),
    MountOption(
        "hedge", _count, CLIENT_DEFAULTS["hedge"], "client",
        "extra chunk stores a block's chunks may go to when a store is slow or down",
    ),
    MountOption(
        "chunk_timeout", _seconds, CLIENT_DEFAULTS["chunk_timeout"], "client",
        "seconds one chunk put or get may take before it counts as failed", "s",
    ),
    MountOption(
        "write_hedge_s", _seconds, CLIENT_DEFAULTS["write_hedge_s"], "client",
        "seconds before a slow chunk put is also sent to a hedge store", "s",
    ),
    MountOption(
        "slow_chunk_s", _seconds, CLIENT_DEFAULTS["slow_chunk_s"], "client",
        "seconds before a read asks every parity chunk left (and a range read rebuilds "
        "around a slow store)", "s",
    ),
    MountOption(
        "read_hedge_s", _seconds, CLIENT_DEFAULTS["read_hedge_s"], "client",
        "seconds before a data chunk still missing is hedged with a parity fetch", "s",
    ),
    MountOption(
        "max_reconstructions", _count, CLIENT_DEFAULTS["max_reconstructions"], "client",
        "degraded blocks decoded at once (bounds the CPU a storm of degraded reads takes)",
    ),
    MountOption(
        "connect_timeout", _seconds, CLIENT_DEFAULTS["connect_timeout"], "client",
        "seconds a connect to a chunk store may take (a cut link drops SYNs silently)", "s",
    ),
    MountOption(
        "node_backoff_s", _seconds, CLIENT_DEFAULTS["node_backoff_s"], "client",
        "seconds a chunk store this mount failed to reach is avoided (reads go degraded, "
        "puts go elsewhere) before it is tried again", "s",
    ),
    MountOption(
        "pack_delay_s", _seconds, CLIENT_DEFAULTS["pack_delay_s"], "client",
        "seconds an open pack of small files waits for more files while another is being "
        "stored (a lone file never waits)", "s",
    ),
    MountOption(
        "max_packs", _count, CLIENT_DEFAULTS["max_packs"], "client", "packs of small files open or being stored at once"
    ),
    MountOption(
        "pack_limit", _fraction, CLIENT_DEFAULTS["pack_limit"], "client",
        "files (and tails) up to this fraction of a block are packed with others into "
        "shared blocks (0: every file a block of its own)",
    ),
    MountOption(
        "entry_timeout", _seconds, FUSE_DEFAULTS["entry_timeout"], "fuse",
        "seconds the kernel trusts a name without asking (another mount's removal or "
        "rename shows after this long at most)", "s",
    ),
    MountOption(
        "attr_timeout", _seconds, FUSE_DEFAULTS["attr_timeout"], "fuse",
        "seconds the kernel (and the mount, for directories) trusts attributes", "s",
    ),
    MountOption(
        "negative_timeout", _seconds, FUSE_DEFAULTS["negative_timeout"], "fuse",
        "seconds a directory listing answers lookups of absent names without a round trip; "
        "another mount's new name may read as absent that long (0: always ask)", "s",
    ),
    MountOption(
        "async_creates", _flag, FUSE_DEFAULTS["async_creates"], "fuse",
        "answer an O_CREAT|O_TRUNC of a name known absent at once and make it durable by "
        "close (off: every create waits for its metadata commit)",
    ),
    MountOption(
        "read_ahead_kb", _count, DEFAULT_READ_AHEAD_KB, "mount",
        "kernel read-ahead of the mount in KiB (0 keeps the kernel's 128)",
    ),
    MountOption(
        "allow_other", _flag, None, "mount",
        "let users other than the mounter in, the kernel checking modes (auto: on when "
        "root mounts, as a node's shared mount)",
    ),
    MountOption(
        "nonempty", _flag, False, "mount", "mount over a directory that has files in it"
    ),
    MountOption(
        "metrics_listen", _listen, None, "mount",
        "serve Prometheus metrics (FUSE ops, client bytes) on http://HOST:PORT/metrics; "
        "port 0 picks a free port, the ready file names it (docs/metrics.md; auto: none)",
    ),
)  # fmt: skip

BY_KEY = {o.key: o for o in OPTIONS}

# mount(8)'s own options and those fstab and systemd add: not ours, accepted and ignored.
_SYSTEM_KEYS = frozenset(
    ("defaults", "rw", "ro", "auto", "noauto", "user", "nouser", "users", "owner", "group")
    + ("exec", "noexec", "suid", "nosuid", "dev", "nodev", "async", "sync", "atime")
    + ("noatime", "relatime", "strictatime", "lazytime", "diratime", "nodiratime")
    + ("_netdev", "nofail", "silent", "loud")
)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Every option as a flag (default None: only what was given counts) and ``-o``."""
    group = parser.add_argument_group("tuning (also as -o key=value; docs/mount-options.md)")
    for o in OPTIONS:
        if o.parse is _flag:
            group.add_argument(
                o.flag,
                dest=o.key,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"{o.help} (default {o.shown(o.default)})",
            )
        else:
            group.add_argument(
                o.flag,
                dest=o.key,
                type=_argparse_type(o.parse),
                default=None,
                metavar=o.key.upper(),
                help=f"{o.help} (default {o.shown(o.default)})",
            )
    group.add_argument(
        "-o",
        dest="options",
        action="append",
        default=[],
        metavar="KEY=VALUE,...",
        help="options as fstab and mount(8) give them; a flag beats -o",
    )
    group.add_argument(
        "-s",
        "--sloppy",
        action="store_true",
        help="skip unknown -o options instead of refusing them (mount(8)'s -s)",
    )


def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = parse.__name__.lstrip("_")
    return convert


def parse_o(texts: Iterable[str], *, sloppy: bool = False) -> dict[str, Any]:
    """``-o`` strings (comma-separated ``key=value`` or ``key`` for a switch) as values.
    ``sloppy`` (mount(8)'s ``-s``): unknown keys are skipped, not refused."""
    values: dict[str, Any] = {}
    for text in texts:
        for item in text.split(","):
            item = item.strip()
            if not item:
                continue
            key, eq, raw = item.partition("=")
            key = key.strip().replace("-", "_")
            if key in _SYSTEM_KEYS or key.startswith(("x_systemd.", "x_", "comment=")):
                continue
            if key.startswith("no") and key[2:] in BY_KEY and not eq:
                key, raw, eq = key[2:], "off", "="
            option = BY_KEY.get(key)
            if option is None and sloppy:
                continue
            if option is None:
                raise ConfigError(f"unknown mount option {key!r} (known: {', '.join(BY_KEY)})")
            if not eq:
                if option.parse is not _flag:
                    raise ConfigError(f"mount option {key!r} needs a value: {key}=VALUE")
                raw = "on"
            try:
                values[key] = option.parse(raw.strip())
            except ConfigError as e:
                raise ConfigError(f"mount option {key}: {e}") from None
    return values


def resolve(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every option's value (flag, else ``-o``, else default), grouped by target."""
    given = parse_o(args.options, sloppy=getattr(args, "sloppy", False))
    out: dict[str, dict[str, Any]] = {"client": {}, "fuse": {}, "mount": {}}
    for o in OPTIONS:
        value = getattr(args, o.key, None)
        if value is None:
            value = given.get(o.key, o.default)
        out[o.target][o.key] = value
    if out["client"]["write_quorum"] is None:
        del out["client"]["write_quorum"]
    return out


def markdown() -> str:
    """docs/mount-options.md."""
    lines = [
        "# Mount options",
        "",
        "Made by `python -m tectonic_py.cli.mount_options` from the table in",
        "`tectonic_py/cli/mount_options.py`; a test fails when this page is stale.",
        "",
        "Each option is a flag of `tectonic mount` (`--window-bytes 2GiB`) and an `-o` option",
        "(`-o window_bytes=2GiB,entry_timeout=5`), so an fstab line or a systemd mount unit",
        "can pass it:",
        "",
        "```",
        "/etc/tectonic/client.toml  /mnt/ckpt  tectonic  _netdev,window_bytes=2GiB  0  0",
        "```",
        "",
        "(`mount -t tectonic` runs the `mount.tectonic` helper, which `deploy/install.sh`",
        "links into /sbin.) A flag beats `-o`; `-o` beats the default. A switch is given as",
        "`key`, `nokey` or `key=on|off`. mount(8)'s own options (`rw`, `defaults`, `_netdev`,",
        "`nofail`, `x-systemd.*`, ...) are accepted and ignored; any other unknown key is an",
        "error that names it. Sizes take units (`512MiB`, `2GiB`); durations are seconds.",
        "",
        "| option | default | read by | what it does, and when to change it |",
        "|---|---|---|---|",
    ]
    readers = {"client": "data path", "fuse": "FUSE layer", "mount": "mount command"}
    for o in OPTIONS:
        default = o.shown(o.default) + (o.unit if o.default is not None else "")
        text = o.help.replace("|", "\\|")
        lines.append(f"| `{o.key}` | {default} | {readers[o.target]} | {text} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
