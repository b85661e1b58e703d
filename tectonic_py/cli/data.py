"""``tectonic put/get/ls/rm/stat/mkdir``: direct transfers and namespace commands, no FUSE.

``put`` streams a local file into the cluster through one ``FileWriter`` (reads of 8 MiB from
disk in a worker thread, so the event loop keeps the write pipeline full) and returns only
after ``close``: the file is durable, committed and sealed when the command exits 0.
``get`` streams it back with readahead, writing to a temporary file that is fsynced and
renamed into place, so an interrupted ``get`` never leaves a truncated file under the
target name. An existing special file (a device, a FIFO) is opened and written as any
program writes to it, never renamed over: ``get ... /dev/null`` must leave /dev/null a
device. Transfers over 64 MiB show a rich progress bar on a terminal (``--quiet``
hides it).

A file that is not sealed is still copied (exit 0: its committed bytes may be all a user
has), with a one-line warning on stderr: "still being written" while a writer holds its
token, "unsealed, writer gone" when none does, as after a writer that died or lost its
mount; such a file may lack its tail for good. ``stat`` and ``ls -l`` show the same state;
``stat`` also shows a file's ``durability`` (``quorum``, ``full``, ``degraded``...: see
tectonic_py/core/durability.py).

``rm -r`` refuses the root directory before it deletes anything (as rm(1) does without
``--no-preserve-root``), checks every operand before it deletes any, and walks a tree by
ids, so a rename during the walk cannot turn it onto another directory.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import time
from pathlib import Path
from typing import Any

import trio

from tectonic_py.cli.common import add_cluster_file, add_connect_wait
from tectonic_py.client.tectonic_client import TectonicClient, open_client
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import (
    ConfigError,
    DanglingName,
    FileExists,
    FileNotFound,
    InvalidArgument,
    IsADirectory,
    NotADirectory,
)
from tectonic_py.core.records import KIND_DIR, KIND_FILE, UNSEALED, WRITING, Attrs, DirEntry

MiB = 1024 * 1024
PIECE = 8 * MiB
PROGRESS_OVER = 64 * MiB


class _Progress:
    """A rich progress bar for big transfers on a terminal, else nothing."""

    def __init__(self, label: str, total: int, quiet: bool) -> None:
        self._bar: Any = None
        if quiet or total < PROGRESS_OVER or not sys.stderr.isatty():
            return
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._bar = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            transient=True,
        )
        self._bar.start()
        self._task = self._bar.add_task(label, total=total)

    def advance(self, n: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


async def _run(cli: argparse.Namespace, fn: Any, *args: Any) -> Any:
    async with open_client(cli.cluster_file, first_contact_deadline=cli.connect_wait) as client:
        return await fn(client, *args)


def _remote(path: str) -> str:
    if not path.startswith("/"):
        raise ConfigError(f"remote path {path!r} must be absolute (start with '/')")
    return path


async def _put(
    client: TectonicClient, local: str, remote: str, ec: str | None, quiet: bool
) -> dict[str, Any]:
    try:
        f = await trio.to_thread.run_sync(open, local, "rb")
    except OSError as e:
        raise ConfigError(f"cannot read {local!r}: {e.strerror}") from None
    with f:
        total = os.fstat(f.fileno()).st_size
        if remote.endswith("/"):
            remote += os.path.basename(local)
        started = time.monotonic()
        writer = await client.create(remote, ec=ec)
        progress = _Progress(f"put {os.path.basename(local)}", total, quiet)
        try:
            buf = bytearray(PIECE)
            view = memoryview(buf)
            while True:
                n = await trio.to_thread.run_sync(f.readinto, buf)
                if not n:
                    break
                await writer.write(view[:n])
                progress.advance(n)
            attrs = await writer.close()
        except BaseException:
            with trio.CancelScope(shield=True):
                await writer.abort()
            raise
        finally:
            progress.close()
    seconds = time.monotonic() - started
    return {
        "path": remote,
        "bytes": attrs.size,
        "seconds": round(seconds, 3),
        "MB_per_s": round(attrs.size / max(seconds, 1e-9) / 1e6, 1),
        "ec": attrs.ec,
    }


def _local_target(local: str, remote: str) -> tuple[Path, bool]:
    """Where ``get`` writes, and whether in place: True for an existing file that is not a
    regular one (a device, a FIFO), which is opened and written, never renamed over."""
    target = Path(local)
    for _ in range(2):
        try:
            st = os.stat(target)
        except FileNotFoundError:
            return target, False
        except OSError as e:
            raise ConfigError(f"cannot write {str(target)!r}: {e.strerror}") from None
        if stat.S_ISREG(st.st_mode):
            return target, False
        if not stat.S_ISDIR(st.st_mode):
            return target, True
        if target != Path(local):
            break
        target = target / remote.rstrip("/").rpartition("/")[2]
    raise IsADirectory(f"{str(target)!r} is a directory")


async def _get(client: TectonicClient, remote: str, local: str, quiet: bool) -> dict[str, Any]:
    reader = await client.open_read(remote)
    try:
        target, in_place = _local_target(local, remote)
        started = time.monotonic()
        progress = _Progress(f"get {target.name}", reader.size, quiet)
        try:
            if in_place:
                await _copy_to(reader, target, progress, sync=False)
            else:
                await _copy_to_new(reader, target, progress)
        except OSError as e:
            where = f" ({e.filename})" if e.filename and e.filename != str(target) else ""
            raise ConfigError(f"cannot write {str(target)!r}: {e.strerror}{where}") from None
        finally:
            progress.close()
    finally:
        await reader.aclose()
    seconds = time.monotonic() - started
    return {
        "path": str(target),
        "bytes": reader.size,
        "seconds": round(seconds, 3),
        "MB_per_s": round(reader.size / max(seconds, 1e-9) / 1e6, 1),
        "state": reader.attrs.seal_state,
    }


async def _copy_to_new(reader: Any, target: Path, progress: _Progress) -> None:
    """Temp file, fsync, rename: the target name never holds a truncated copy."""
    tmp = target.with_name(f".{target.name}.tectonic-tmp")
    try:
        await _copy_to(reader, tmp, progress, sync=True)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


async def _copy_to(reader: Any, path: Path, progress: _Progress, *, sync: bool) -> None:
    # A FIFO's open waits for its reader: in a thread, so the event loop keeps running.
    f = await trio.to_thread.run_sync(open, path, "wb")
    with f:
        while True:
            data = await reader.read(PIECE)
            if not data:
                break
            await trio.to_thread.run_sync(f.write, data)
            progress.advance(len(data))
        await trio.to_thread.run_sync(f.flush)
        if sync:
            await trio.to_thread.run_sync(os.fsync, f.fileno())


async def _ls(client: TectonicClient, path: str, long: bool) -> list[dict[str, Any]]:
    attrs = await client.stat(path)
    if not attrs.is_dir:
        name = path.rstrip("/").rpartition("/")[2]
        return [
            {
                "name": name,
                "kind": attrs.kind,
                "size": attrs.size,
                "ec": attrs.ec,
                "state": attrs.seal_state,
            }
        ]
    out = []
    for e in await client.listdir(path):
        row: dict[str, Any] = {"name": e.name, "kind": e.kind}
        if long:
            try:
                a = await _entry_attrs(client, attrs.id, e)
            except FileNotFound:
                continue  # removed while listed
            except DanglingName as bad:
                row["error"] = str(bad)  # this entry fails alone, as ls(1) does
                out.append(row)
                continue
            row.update(
                size=a.size, ec=a.ec, sealed=a.sealed, state=a.seal_state, mtime_ns=a.mtime_ns
            )
        out.append(row)
    return out


async def _entry_attrs(client: TectonicClient, dir_id: int, e: DirEntry) -> Attrs:
    """An entry's attrs; a record found missing is looked up again by name, which tells a
    name removed meanwhile (FileNotFound) from a dangling one (DanglingName)."""
    try:
        return await client.meta.getattr(e.id)
    except FileNotFound:
        return await client.meta.lookup(dir_id, e.name)


def _is_root(path: str) -> bool:
    """``path`` names the root directory once normalised ("/", "//", "/./")."""
    return not [p for p in path.split("/") if p and p != "."]


async def _rm(client: TectonicClient, paths: list[str], recursive: bool) -> None:
    for path in paths:
        if _is_root(path):
            raise InvalidArgument("refusing to remove '/', the cluster's root directory")
    targets: list[tuple[Attrs, str, Attrs]] = []
    for path in paths:
        parts = [p for p in path.split("/") if p and p != "."]
        parent = await client.stat("/" + "/".join(parts[:-1]))
        try:
            attrs = await client.meta.lookup(parent.id, parts[-1])
        except DanglingName as e:  # its name is removed like any other (never its entries)
            attrs = Attrs(id=e.file_id, kind=e.kind if e.kind == KIND_DIR else KIND_FILE)
        if attrs.is_dir and not recursive:
            raise IsADirectory(f"{path} is a directory (use -r)")
        if path.endswith("/") and not attrs.is_dir:
            raise NotADirectory(f"{path} is not a directory")
        targets.append((parent, parts[-1], attrs))
    for parent, name, attrs in targets:
        await _remove(client, parent.id, name, attrs.is_dir, attrs.id)


async def _remove(
    client: TectonicClient, parent_id: int, name: str, is_dir: bool, id_: int
) -> None:
    """Remove ``name`` in ``parent_id`` (a tree, children first), by ids all the way down."""
    if is_dir:
        for e in await _entries(client, id_):
            await _remove(client, id_, e.name, e.kind == KIND_DIR, e.id)
        await client.meta.rmdir(parent_id, name)
    else:
        await client.meta.unlink(parent_id, name)


async def _entries(client: TectonicClient, dir_id: int) -> list[DirEntry]:
    out: list[DirEntry] = []
    after = ""
    while True:
        try:
            page, nxt = await client.meta.readdir(dir_id, after, 1000)
        except FileNotFound:
            return out  # a dangling directory's name: no record, nothing listed under it
        out.extend(page)
        if nxt is None or not page:
            return out
        after = nxt


def cmd_put(args: argparse.Namespace) -> int:
    if args.ec:
        ECPolicy.parse(args.ec)  # before a connection or a file is made
    r = trio.run(_run, args, _put, args.local, _remote(args.remote), args.ec, args.quiet)
    if not args.quiet:
        print(
            f"{r['path']}: {r['bytes']} bytes in {r['seconds']} s ({r['MB_per_s']} MB/s, {r['ec']})"
        )
    return 0


_STATE_WARNINGS = {
    WRITING: "is still being written (unsealed): copied the bytes committed so far",
    UNSEALED: "is unsealed, writer gone: it may be incomplete for good",
}

# What ``stat`` and ``ls -l`` print for a file's seal state.
STATE_TEXT = {WRITING: "writing", UNSEALED: "unsealed, writer gone"}


def cmd_get(args: argparse.Namespace) -> int:
    r = trio.run(_run, args, _get, _remote(args.remote), args.local, args.quiet)
    if r["state"] in _STATE_WARNINGS:
        print(
            f"tectonic get: warning: {args.remote} {_STATE_WARNINGS[r['state']]}"
            f" ({r['bytes']} bytes)",
            file=sys.stderr,
        )
    if not args.quiet:
        print(f"{r['path']}: {r['bytes']} bytes in {r['seconds']} s ({r['MB_per_s']} MB/s)")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    rows = trio.run(_run, args, _ls, _remote(args.path), args.long)
    # As ls(1): an entry that cannot be read fails alone, the others are listed, exit 1.
    failed = [row for row in rows if "error" in row]
    for row in failed:
        print(f"tectonic ls: cannot access {row['name']!r}: {row['error']}", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 1 if failed else 0
    for row in rows:
        suffix = "/" if row["kind"] == "dir" else ""
        if "error" in row:
            print(f"{'?':>14} {'?':>8} {row['name']}{suffix}  [dangling]")
        elif args.long and row["kind"] != "dir":
            state = f"  [{STATE_TEXT[row['state']]}]" if row["state"] in STATE_TEXT else ""
            print(f"{row['size']:>14} {row['ec']:>8} {row['name']}{suffix}{state}")
        else:
            print(f"{row['name']}{suffix}")
    return 1 if failed else 0


def cmd_rm(args: argparse.Namespace) -> int:
    trio.run(_run, args, _rm, [_remote(p) for p in args.paths], args.recursive)
    return 0


def cmd_stat(args: argparse.Namespace) -> int:
    async def go(client: TectonicClient) -> dict[str, Any]:
        attrs = await client.stat(_remote(args.path))
        if attrs.is_dir:
            return attrs.to_wire()
        blocks = await client.meta.block_list(attrs.id) if attrs.size else []
        return {
            **attrs.to_wire(),
            "state": STATE_TEXT.get(attrs.seal_state, attrs.seal_state),
            "durability": await client.meta.durability(attrs.id, attrs),
            # Each block of the file: its own, or an extent of a pack shared with other files;
            # and the small overwrites laid over it, oldest first (each an extent of a pack).
            "extents": [
                {
                    "index": b.file_index,
                    "block": f"{b.block_id:016x}",
                    "offset": b.ext_off,
                    "length": b.base_len,
                    "packed": b.packed,
                    "patches": [
                        {
                            "at": p.at,
                            "length": p.length,
                            "block": f"{p.source.block_id:016x}",
                            "offset": p.source.ext_off,
                        }
                        for p in b.patches
                    ],
                }
                for b in blocks
            ],
        }

    print(json.dumps(trio.run(_run, args, go), indent=2))
    return 0


def cmd_mkdir(args: argparse.Namespace) -> int:
    if args.ec:
        ECPolicy.parse(args.ec)  # before anything is created: a typo changes nothing

    async def go(client: TectonicClient) -> None:
        for p in args.paths:
            attrs = await client.mkdir(_remote(p), parents=args.parents)
            if not attrs.is_dir:  # -p accepts an existing directory, never a file
                raise FileExists(f"{p} exists and is not a directory")
            if args.ec:
                await client.meta.setattr(attrs.id, ec=args.ec)

    trio.run(_run, args, go)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("put", help="copy a local file into the cluster")
    add_cluster_file(p)
    add_connect_wait(p)
    p.add_argument("local", metavar="LOCAL_PATH")
    p.add_argument("remote", metavar="REMOTE_PATH", help="absolute; ending in / keeps the name")
    p.add_argument("--ec", help="EC policy of the new file (default: its directory's)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    p.set_defaults(func=cmd_put)

    p = subparsers.add_parser("get", help="copy a file out of the cluster")
    add_cluster_file(p)
    add_connect_wait(p)
    p.add_argument("remote", metavar="REMOTE_PATH")
    p.add_argument("local", metavar="LOCAL_PATH", help="a file name or a directory")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    p.set_defaults(func=cmd_get)

    p = subparsers.add_parser("ls", help="list a directory")
    add_cluster_file(p)
    add_connect_wait(p)
    p.add_argument("path", metavar="REMOTE_PATH", nargs="?", default="/")
    p.add_argument("-l", "--long", action="store_true", help="sizes and EC policies")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ls)

    p = subparsers.add_parser("rm", help="remove files (and directories with -r)")
    add_cluster_file(p)
    add_connect_wait(p)
    p.add_argument("paths", metavar="REMOTE_PATH", nargs="+")
    p.add_argument("-r", "--recursive", action="store_true")
    p.set_defaults(func=cmd_rm)

    p = subparsers.add_parser("stat", help="attributes of a file or directory, as JSON")
    add_cluster_file(p)
    add_connect_wait(p)
    p.add_argument("path", metavar="REMOTE_PATH")
    p.set_defaults(func=cmd_stat)

    p = subparsers.add_parser("mkdir", help="make directories")
    add_cluster_file(p)
    add_connect_wait(p)
    p.add_argument("paths", metavar="REMOTE_PATH", nargs="+")
    p.add_argument("-p", "--parents", action="store_true")
    p.add_argument("--ec", help="EC policy that new files in it inherit (rs-6-3, rs-4-2, r3...)")
    p.set_defaults(func=cmd_mkdir)
