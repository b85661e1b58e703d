"""``mount.tectonic``: what mount(8) runs for ``mount -t tectonic`` and fstab lines of type
``tectonic``, so a node can mount the cluster at boot like any other filesystem::

    /etc/tectonic/client.toml  /mnt/ckpt  tectonic  _netdev,window_bytes=2GiB  0  0

mount(8) calls ``mount.tectonic SPEC DIR [-sfnv] [-N NS] [-o OPTIONS] [-t TYPE]``: SPEC is
the cluster file, OPTIONS the fstab options (tectonic's ``-o`` keys, docs/mount-options.md,
mount(8)'s own ones ignored). ``-f`` (fake) checks everything but mounts nothing; ``-n``
and ``-v`` change nothing here (no mtab is kept); ``-s`` skips unknown options. The mount
itself is ``tectonic mount`` in the background: it returns once mounted, with its exit
status and one-line error otherwise.
"""

from __future__ import annotations

import argparse
import sys

from tectonic_py.cli import main as cli


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mount.tectonic", description=__doc__.split("\n\n")[0])
    p.add_argument("spec", metavar="CLUSTER_FILE")
    p.add_argument("mountpoint", metavar="DIR")
    p.add_argument("-o", dest="options", action="append", default=[])
    p.add_argument("-s", dest="sloppy", action="store_true")
    p.add_argument("-f", dest="fake", action="store_true")
    p.add_argument("-n", dest="no_mtab", action="store_true")
    p.add_argument("-v", dest="verbose", action="store_true")
    p.add_argument("-N", dest="namespace")
    p.add_argument("-t", dest="type")
    return p


def tectonic_argv(argv: list[str]) -> tuple[list[str], bool]:
    """The ``tectonic mount`` command line for mount(8)'s call, and whether it is fake."""
    args = _parser().parse_args(argv)
    out = ["mount", args.spec, args.mountpoint]
    for options in args.options:
        out += ["-o", options]
    if args.sloppy:
        out.append("--sloppy")
    return out, args.fake


def main(argv: list[str] | None = None) -> int:
    command, fake = tectonic_argv(sys.argv[1:] if argv is None else argv)
    if fake:
        command.append("--check-only")
    return cli.main(command)


if __name__ == "__main__":
    sys.exit(main())
