"""The ``tectonic`` command: one entry point, one subcommand module per part of the system.

Each module in ``_COMMAND_MODULES`` (the servers' own ``main`` modules among them, imported
like any other: the CLI is the top layer) exposes ``register(subparsers)``, which adds its
subcommands with ``set_defaults(func=...)``; ``func(args)`` returns an exit code. User
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
import importlib.metadata
import logging
import os
import sys
from collections.abc import Sequence

from chunkstore import main as chunkstore_main
from metadata import main as metadata_main
from tectonic_py.cli import (
    call,
    cluster,
    commit,
    data,
    fsck,
    loadtest,
    maintenance,
    mount,
    quota,
    retention,
    stats,
    status,
)
from tectonic_py.cli.common import Parser
from tectonic_py.core.errors import TectonicError

_COMMAND_MODULES = [
    chunkstore_main,  # tectonic chunkstore
    metadata_main,  # tectonic metadata
    cluster,  # tectonic cluster up/down
    data,  # tectonic put/get/ls/rm/stat/mkdir/status
    commit,  # tectonic commit
    quota,  # tectonic quota set/get/ls/rm, tectonic reserve
    retention,  # tectonic retention set/get/ls/rm
    call,  # tectonic call
    mount,  # tectonic mount/umount
    status,  # tectonic status
    stats,  # tectonic stats
    maintenance,  # tectonic maintenance / repair
    fsck,  # tectonic fsck
    loadtest,  # tectonic loadtest
]


def version() -> str:
    try:
        return importlib.metadata.version("tectonic-py")
    except importlib.metadata.PackageNotFoundError:  # run from a tree that is not installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="tectonic", description="tectonic-py: an erasure-coded checkpoint filesystem"
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)"
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in _COMMAND_MODULES:
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
    parser = build_parser()
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
