"""The ``tectonic`` command: one entry point, one subcommand module per part of the system.

Each module named in ``COMMANDS`` (the servers' own ``main`` modules among them: the CLI is
the top layer) exposes ``register(subparsers)``, which adds its subcommands with
``set_defaults(func=...)``; ``func(args)`` returns an exit code. Only the module of the
command asked for is imported (all of them for ``--help``, ``--version`` or an unknown
command): every daemon, mount and CLI call is a process of its own, and importing every
command's libraries would charge each of them for the others' (the measurement is in
docs/decisions/2026-12-05-suite-time.md). User
mistakes and domain failures (``TectonicError``) print one clear line and exit non-zero;
only a genuine bug prints a traceback.

Exit codes, the same for every subcommand: 0 done; 1 the command failed (one line on
stderr); 2 a usage error (argparse); 3 (``EXIT_UNHEALTHY``) the command ran but found the
cluster unable to serve everything (``status``, ``repair --status``) or a load test with
errors; 130 interrupted.

A daemon subcommand names its loggers in ``set_defaults(daemon_loggers=[...])``: those log at
INFO even without ``-v`` (start, ready, shutdown), which is what a service log needs.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import os
import sys
from collections.abc import Sequence
from types import ModuleType

from tectonic_py.cli.common import Parser
from tectonic_py.core.errors import TectonicError

# Every subcommand and the module that registers it, in the order `tectonic --help` lists them.
# tests/test_cli.py checks that each module registers exactly the commands named here.
COMMANDS = {
    "chunkstore": "chunkstore.main",
    "metadata": "metadata.main",
    "cluster": "tectonic_py.cli.cluster",
    "put": "tectonic_py.cli.data",
    "get": "tectonic_py.cli.data",
    "ls": "tectonic_py.cli.data",
    "rm": "tectonic_py.cli.data",
    "stat": "tectonic_py.cli.data",
    "mkdir": "tectonic_py.cli.data",
    "commit": "tectonic_py.cli.commit",
    "quota": "tectonic_py.cli.quota",
    "reserve": "tectonic_py.cli.quota",
    "retention": "tectonic_py.cli.retention",
    "call": "tectonic_py.cli.call",
    "mount": "tectonic_py.cli.mount",
    "umount": "tectonic_py.cli.mount",
    "status": "tectonic_py.cli.status",
    "stats": "tectonic_py.cli.stats",
    "maintenance": "tectonic_py.cli.maintenance",
    "repair": "tectonic_py.cli.maintenance",
    "fsck": "tectonic_py.cli.fsck",
    "loadtest": "tectonic_py.cli.loadtest",
}


def command_modules(argv: Sequence[str] | None = None) -> list[ModuleType]:
    """The modules to register for ``argv``: the command's own, or every one when ``argv``
    names no known command (help, --version, a typo: argparse then lists them all)."""
    command = next((a for a in argv or () if not a.startswith("-")), None)
    names = [COMMANDS[command]] if command in COMMANDS else list(dict.fromkeys(COMMANDS.values()))
    return [importlib.import_module(name) for name in names]


def version() -> str:
    try:
        return importlib.metadata.version("tectonic-py")
    except importlib.metadata.PackageNotFoundError:  # run from a tree that is not installed
        return "unknown (not installed)"


def build_parser(modules: Sequence[ModuleType] | None = None) -> argparse.ArgumentParser:
    """The whole command line, or only ``modules``' commands (``command_modules``)."""
    parser = Parser(
        prog="tectonic", description="tectonic-py: an erasure-coded checkpoint filesystem"
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)"
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in command_modules() if modules is None else modules:
        module.register(sub)
    return parser


def setup_logging(verbose: int, daemon_loggers: Sequence[str] = ()) -> None:
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    for name in daemon_loggers:
        logging.getLogger(name).setLevel(min(level, logging.INFO))


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    parser = build_parser(command_modules(argv))
    args = parser.parse_args(argv)
    setup_logging(args.verbose, getattr(args, "daemon_loggers", ()))
    try:
        return int(args.func(args) or 0)
    except TectonicError as e:
        print(f"tectonic {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `tectonic status --json | head`: the reader went away; that is not an error of ours.
        # Point stdout at /dev/null so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
