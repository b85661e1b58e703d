"""What every ``tectonic`` subcommand shares: one spelling of the cluster-file argument and
help that shows each option's default.

The cluster file is always the positional ``CLUSTER_FILE`` (the ``cluster.toml`` that
``cluster up`` writes), first after the subcommand, so ``tectonic status CLUSTER_FILE`` and
``tectonic put CLUSTER_FILE ...`` read alike. Sizes use ``tectonic_py.core.units.size_arg``
(``4MiB``, ``1GiB``, plain bytes) and their defaults are written with units.
"""

from __future__ import annotations

import argparse
from typing import Any

from metadata.client import INTERACTIVE_FIRST_CONTACT_S, RECONNECT_DEADLINE_S

# The command ran, and found the cluster unable to serve everything (or a load test saw
# errors): distinct from 1 (the command failed) and 2 (argparse's usage error).
EXIT_UNHEALTHY = 3
# Everything is readable, but something is not whole: a block below k+m good chunks, a
# dangling name, an unreachable record (``tectonic fsck``, ``tectonic status``). Not 2,
# which argparse uses for a usage error.
EXIT_DEGRADED = 4


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """argparse's ArgumentDefaultsHelpFormatter, minus the noise: no "(default: None)" or
    "(default: False)" for options that have no default worth naming, and nothing added to
    help that already names its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "%(default)" in text
            or default is None
            or default is False
            or default == []
            or default is argparse.SUPPRESS
            or not (action.option_strings or action.nargs in ("?", "*"))
        ):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help shows defaults; subparsers made from it are the same."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)


def add_cluster_file(p: argparse.ArgumentParser, *, optional: bool = False, **kw: Any) -> None:
    """The positional CLUSTER_FILE (``optional``: may be left out, as ``loadtest
    --through-mount`` does)."""
    help_text = "the cluster file (cluster.toml, written by `tectonic cluster up`)"
    if optional:
        kw.setdefault("nargs", "?")
    p.add_argument("cluster_file", metavar="CLUSTER_FILE", help=help_text, **kw)


def add_connect_wait(p: argparse.ArgumentParser, help_text: str | None = None) -> None:
    """``--connect-wait``: an interactive command says a cluster that is down within seconds;
    the data path (a mount, a training job's client) waits as long for a first answer as
    for a restart (``metadata.client.RECONNECT_DEADLINE_S``)."""
    p.add_argument(
        "--connect-wait",
        metavar="SECONDS",
        type=float,
        default=INTERACTIVE_FIRST_CONTACT_S,
        help=help_text
        or "how long to wait for a metadata server that has not answered yet (down, or"
        " restarting) before failing; once a server has answered, its restart is waited out"
        f" for up to {RECONNECT_DEADLINE_S:g} s",
    )
