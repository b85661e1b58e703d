"""``tectonic commit CLUSTER_FILE STAGING_DIR FINAL_DIR [--latest NAME]``: publish a step.

For checkpoints written through the mount (or any writer) into a staging directory: once
every file under STAGING_DIR is sealed, it becomes FINAL_DIR, and the symbolic link
``--latest`` beside it points at it, in ONE metadata transaction (``name.commit``, see
metadata/checkpoint_ops.py). A reader sees the step whole or not at all, and ``latest``
never names a step that is not there. Both paths are in the cluster's namespace and must
share their parent directory (their names then live in one shard). Name the staging
directory ``<final>.staging-<anything>`` so the GC collects it if the job dies before the
commit. An existing FINAL_DIR is refused unless ``--replace`` (it is then moved aside
under a staging name and collected after the GC's grace).

Exit 0 with a JSON line (the step's id, its files and directories, the time taken) once
the step is visible; 1 with one line if a file is not sealed or a name is taken.
"""

from __future__ import annotations

import argparse
import json
import posixpath
import time
from typing import Any

import trio

from tectonic_py.cli.common import add_cluster_file, add_connect_wait
from tectonic_py.client.tectonic_client import TectonicClient, open_client
from tectonic_py.core.errors import ConfigError


async def commit_paths(
    client: TectonicClient, staging: str, final: str, *, latest: str = "", replace: bool = False
) -> dict[str, Any]:
    """Commit the staging directory ``staging`` as ``final`` (absolute paths, one parent)."""
    for path in (staging, final):
        if not path.startswith("/") or path.rstrip("/") == "":
            raise ConfigError(f"path {path!r} must be absolute and not the root")
    s_parent, s_name = posixpath.split(posixpath.normpath(staging))
    f_parent, f_name = posixpath.split(posixpath.normpath(final))
    if s_parent != f_parent:
        raise ConfigError(
            f"{staging!r} and {final!r} must be in one directory: the commit is one"
            " transaction of that directory's shard"
        )
    parent = await client.stat(s_parent)
    return await client.meta.commit_step(parent.id, s_name, f_name, latest=latest, replace=replace)


def cmd_commit(args: argparse.Namespace) -> int:
    async def go() -> dict[str, Any]:
        async with open_client(
            args.cluster_file, first_contact_deadline=args.connect_wait
        ) as client:
            start = time.perf_counter()
            r = await commit_paths(
                client, args.staging, args.final, latest=args.latest or "", replace=args.replace
            )
            return {**r, "seconds": round(time.perf_counter() - start, 4)}

    print(json.dumps({"committed": args.final, **trio.run(go)}))
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "commit",
        help="make a staging directory a checkpoint step, atomically, once all is sealed",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    add_cluster_file(p)
    add_connect_wait(p)
    p.add_argument("staging", metavar="STAGING_DIR", help="the staging directory (absolute)")
    p.add_argument("final", metavar="FINAL_DIR", help="the step's name, beside STAGING_DIR")
    p.add_argument("--latest", metavar="NAME", help="a symbolic link beside it to point at it")
    p.add_argument(
        "--replace", action="store_true", help="move an existing FINAL_DIR aside instead"
    )
    p.set_defaults(func=cmd_commit)
