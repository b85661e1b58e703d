"""``tectonic://``: an fsspec filesystem over the client library, without FUSE or a kernel hop.

::

    fs = fsspec.filesystem("tectonic", cluster="cluster.toml")
    fs.pipe_file("/data/a.bin", b"...")
    df = pandas.read_parquet("tectonic:///data/t.parquet", storage_options={"cluster": ...})

The cluster file comes from the ``cluster`` storage option or, without one, from the
``TECTONIC_CLUSTER`` environment variable. Paths are absolute in the cluster's namespace:
``tectonic://a/b``, ``tectonic:///a/b`` and ``/a/b`` all name ``/a/b``. The class is found
by name through the ``fsspec.specs`` entry point. Every instance of a process with the same
cluster file shares one client (``shared_client``), kept open for the process's life, since
fsspec makes and caches instances wherever a URL is opened.

Files: a read is an ``AbstractBufferedFile`` over one ``FileReader`` (the block list fetched
once, at open), each cache miss one ``pread`` of just that range. A write takes its
``FileWriter`` at open, so ``xb`` fails there and a missing parent directory is made there
(as LocalFileSystem's ``auto_mkdir``), and sends ``block_size`` pieces; ``close`` returns
once every byte is durable and the file sealed. ``ab`` takes the writer token of the
existing file and appends. Outside a transaction a file is written in place (readers see it
whole after the close: close-to-open); inside ``fs.transaction`` it is written under a
hidden name beside its target and renamed over it on commit, one metadata transaction.

Errors: the client's domain errors become the ``OSError`` subclasses fsspec callers catch
(``FileNotFoundError``, ``FileExistsError``, ...) in ``_os_errors``, the one place here.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import posixpath
import secrets
import stat
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, TypeVar

import trio
from fsspec.spec import AbstractBufferedFile, AbstractFileSystem
from fsspec.utils import stringify_path

from tectonic_py.client.reader import FileReader
from tectonic_py.client.sync_client import BlockingClient, shared_client
from tectonic_py.client.tectonic_client import TectonicClient
from tectonic_py.client.writer import FileWriter
from tectonic_py.core.errnos import errno_for
from tectonic_py.core.errors import (
    FileNotFound,
    IsADirectory,
    TectonicError,
)
from tectonic_py.core.records import Attrs

__all__ = ["TectonicFile", "TectonicFileSystem"]

log = logging.getLogger(__name__)

T = TypeVar("T")
MiB = 1024 * 1024

PROTOCOL = "tectonic"
# Concurrent attribute fetches of one listing: a directory of rank files is listed in a few
# round trips rather than one per entry.
LIST_CONCURRENCY = 64


@contextmanager
def _os_errors(path: str) -> Iterator[None]:
    """Domain errors as ``OSError`` with an errno (Python picks the subclass from it, e.g.
    ``FileNotFoundError`` for ENOENT); data-path failures (quorum lost, a store or shard
    unreachable) are EIO, as the mount answers them."""
    try:
        yield
    except TectonicError as e:
        raise OSError(errno_for(e), e.message, path) from e


def _info(path: str, attrs: Attrs) -> dict[str, Any]:
    """One entry as fsspec describes it (``name``, ``size``, ``type``), and what the File
    layer knows besides: ``mtime``/``created`` in seconds (LocalFileSystem's units), the
    seal state (``sealed``, ``writing`` or ``unsealed``), the EC policy and chunk size."""
    kind = stat.S_IFDIR if attrs.is_dir else stat.S_IFREG
    return {
        "name": path,
        "size": 0 if attrs.is_dir else attrs.size,
        "type": "directory" if attrs.is_dir else "file",
        "mode": kind | attrs.mode,
        "uid": attrs.uid,
        "gid": attrs.gid,
        "nlink": attrs.nlink,
        "mtime": attrs.mtime_ns / 1e9,
        "created": attrs.ctime_ns / 1e9,
        "id": attrs.id,
        "seal_state": attrs.seal_state,
        "ec": attrs.ec,
        "chunk_size": attrs.chunk_size,
    }


class TectonicFileSystem(AbstractFileSystem):
    """fsspec's ``AbstractFileSystem`` on a tectonic cluster (see the module docstring).

    ``cluster``: the cluster file (default ``$TECTONIC_CLUSTER``); ``client``: an open
    ``BlockingClient`` to use instead (the caller closes it); ``ec``: the EC policy of new
    files (default: the directory's); ``auto_mkdir``: make missing parent directories of a
    file opened for writing (default True, as fsspec's copy conventions expect).
    """

    protocol = PROTOCOL
    root_marker = "/"
    blocksize = 8 * MiB

    def __init__(
        self,
        cluster: str | os.PathLike[str] | None = None,
        *,
        client: BlockingClient | None = None,
        ec: str | None = None,
        auto_mkdir: bool = True,
        **storage_options: Any,
    ) -> None:
        super().__init__(**storage_options)
        self.client = client if client is not None else shared_client(cluster)
        self.ec = ec
        self.auto_mkdir = auto_mkdir

    # --- paths ---------------------------------------------------------------------------

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = stringify_path(path)
        for prefix in (f"{PROTOCOL}://", f"{PROTOCOL}::"):
            path = path.removeprefix(prefix)
        return "/" + "/".join(p for p in path.split("/") if p)

    # --- calls into the client -----------------------------------------------------------

    @property
    def _tc(self) -> TectonicClient:
        return self.client.client

    def _run(self, path: str, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        with _os_errors(path):
            return self.client.run(fn, *args)

    # --- namespace -------------------------------------------------------------------------

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        """``_info``'s fields, and for a file its ``durability`` (``quorum``, ``full``,
        ``degraded``...: tectonic_py/core/durability.py), which ``ls`` leaves out: it costs a
        call per block shard of the file."""
        path = self._strip_protocol(path)
        return self._run(path, self._info_with_durability, path)

    async def _info_with_durability(self, path: str) -> dict[str, Any]:
        attrs = await self._tc.stat(path)
        out = _info(path, attrs)
        if not attrs.is_dir:
            out["durability"] = await self._tc.meta.durability(attrs.id, attrs)
        return out

    def exists(self, path: str, **kwargs: Any) -> bool:
        path = self._strip_protocol(path)
        try:
            self._run(path, self._tc.stat, path)
        except FileNotFoundError:
            return False
        except NotADirectoryError:
            return False
        return True

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        path = self._strip_protocol(path)
        entries = self._run(path, self._listing, path)
        if detail:
            return entries
        return [e["name"] for e in entries]

    async def _listing(self, path: str) -> list[dict[str, Any]]:
        """A directory's entries with their attributes (fetched concurrently), or the file's
        own entry; an entry removed while it is listed is left out."""
        attrs = await self._tc.stat(path)
        if not attrs.is_dir:
            return [_info(path, attrs)]
        names = await self._tc.listdir(path)
        found: dict[str, Attrs] = {}
        errors: list[TectonicError] = []
        limiter = trio.CapacityLimiter(LIST_CONCURRENCY)

        async def one(name: str, file_id: int) -> None:
            async with limiter:
                try:
                    found[name] = await self._tc.meta.getattr(file_id)
                except FileNotFound:
                    pass
                except TectonicError as e:
                    errors.append(e)

        async with trio.open_nursery() as nursery:
            for entry in names:
                nursery.start_soon(one, entry.name, entry.id)
        if errors:
            raise errors[0]
        return [
            _info(posixpath.join(path, e.name), found[e.name]) for e in names if e.name in found
        ]

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        path = self._strip_protocol(path)

        async def go() -> None:
            try:
                await self._tc.mkdir(path)
            except FileNotFound:
                if not create_parents:
                    raise
                await self._tc.mkdir(posixpath.dirname(path), parents=True)
                await self._tc.mkdir(path)

        self._run(path, go)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        path = self._strip_protocol(path)
        if not exist_ok:
            self.mkdir(path, create_parents=True)
            return
        attrs = self._run(path, self._tc.mkdir, path, 0o755, True)
        if not attrs.is_dir:
            raise FileExistsError(errno.EEXIST, "exists and is not a directory", path)

    def rmdir(self, path: str) -> None:
        path = self._strip_protocol(path)
        self._run(path, self._tc.rmdir, path)

    def rm_file(self, path: str) -> None:
        """Remove a file, or an empty directory: ``rm(recursive=True)`` hands this every
        path it found, children before their parents."""
        path = self._strip_protocol(path)

        async def go() -> None:
            try:
                await self._tc.unlink(path)
            except IsADirectory:
                await self._tc.rmdir(path)

        self._run(path, go)

    def _rm(self, path: str) -> None:
        self.rm_file(path)

    def mv(
        self,
        path1: Any,
        path2: Any,
        recursive: bool = False,
        maxdepth: int | None = None,
        **kwargs: Any,
    ) -> None:
        """A rename, one metadata operation (atomic within a directory, crash-safe across),
        also of a whole directory; into ``path2`` when that is a directory. Lists and globs
        go through fsspec's copy-then-remove."""
        if not (isinstance(path1, str) and isinstance(path2, str)) or any(
            c in path1 for c in "*?["
        ):
            super().mv(path1, path2, recursive=recursive, maxdepth=maxdepth, **kwargs)
            return
        src, dst = self._strip_protocol(path1), self._strip_protocol(path2)
        if src == dst:
            return
        if self.isdir(dst):
            dst = posixpath.join(dst, posixpath.basename(src))
        self._run(src, self._tc.rename, src, dst)

    def created(self, path: str) -> datetime:
        return datetime.fromtimestamp(self.info(path)["created"], tz=UTC)

    def modified(self, path: str) -> datetime:
        return datetime.fromtimestamp(self.info(path)["mtime"], tz=UTC)

    # --- whole files ---------------------------------------------------------------------

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any
    ) -> bytes:
        """Bytes ``[start, end)`` (negative values count from the end, as slices do): one
        ranged read, never the whole file."""
        path = self._strip_protocol(path)

        async def go() -> bytes:
            reader = await self._tc.open_read(path)
            try:
                lo, hi = slice(start, end).indices(reader.size)[:2]
                return await reader.pread(lo, max(0, hi - lo))
            finally:
                await reader.aclose()

        return self._run(path, go)

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        path = self._strip_protocol(path)

        async def go() -> None:
            writer = await self._create(path, exclusive=mode == "create")
            try:
                await writer.write(value)
                await writer.close()
            except BaseException:
                await writer.abort()
                raise

        self._run(path, go)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        """Copy a file through this client in ``blocksize`` pieces (a directory: make it,
        as fsspec's recursive copy hands directories here too)."""
        src, dst = self._strip_protocol(path1), self._strip_protocol(path2)
        if self.isdir(src):
            self.makedirs(dst, exist_ok=True)
            return
        if src == dst:
            return  # creating the copy would truncate its source

        async def go() -> None:
            reader = await self._tc.open_read(src)
            writer = await self._create(dst, exclusive=False)
            try:
                for offset in range(0, reader.size, self.blocksize):
                    await writer.write(await reader.pread(offset, self.blocksize))
                await writer.close()
            except BaseException:
                await writer.abort()
                raise
            finally:
                await reader.aclose()

        self._run(src, go)

    # --- open files ----------------------------------------------------------------------

    async def _create(self, path: str, *, exclusive: bool) -> FileWriter:
        try:
            return await self._tc.create(path, exclusive=exclusive, ec=self.ec)
        except FileNotFound:
            if not self.auto_mkdir:
                raise
            await self._tc.mkdir(posixpath.dirname(path), parents=True)
            return await self._tc.create(path, exclusive=exclusive, ec=self.ec)

    async def _append(self, path: str) -> FileWriter:
        """The writer of an existing file, positioned at its end; a new file if none."""
        try:
            attrs = await self._tc.stat(path)
        except FileNotFound:
            return await self._create(path, exclusive=False)
        if attrs.is_dir:
            raise IsADirectory(f"{path!r} is a directory")
        return await self._tc.open_writer(attrs.id)

    def _open(
        self,
        path: str,
        mode: str = "rb",
        block_size: int | None = None,
        autocommit: bool = True,
        cache_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> TectonicFile:
        return TectonicFile(
            self,
            self._strip_protocol(path),
            mode,
            block_size=block_size or self.blocksize,
            autocommit=autocommit,
            cache_options=cache_options,
            **kwargs,
        )


class TectonicFile(AbstractBufferedFile):
    """An open tectonic file, fsspec style: reads through fsspec's cache (``readahead`` by
    default) into ranged reads; writes sent in ``blocksize`` pieces (see the module
    docstring for modes and transactions)."""

    def __init__(self, fs: TectonicFileSystem, path: str, mode: str = "rb", **kwargs: Any) -> None:
        self._reader: FileReader | None = None
        self._writer: FileWriter | None = None
        self._temp: str | None = None
        autocommit = kwargs.get("autocommit", True)
        if mode == "rb":
            self._reader = fs._run(path, fs._tc.open_read, path)
            kwargs["size"] = self._reader.size
            self._details = _info(path, self._reader.attrs)
        elif mode in ("wb", "xb"):
            target = path
            if not autocommit:
                head, tail = posixpath.split(path)
                self._temp = target = posixpath.join(head, f".{tail}.tmp-{secrets.token_hex(6)}")
                if mode == "xb" and fs.exists(path):
                    raise FileExistsError(errno.EEXIST, "file exists", path)

            async def create() -> FileWriter:
                return await fs._create(target, exclusive=mode == "xb")

            self._writer = fs._run(path, create)
        elif mode == "ab":
            self._writer = fs._run(path, fs._append, path)
        else:
            raise ValueError(f"mode {mode!r}: use 'rb', 'wb', 'xb' or 'ab'")
        super().__init__(fs, path, mode, **kwargs)
        if mode == "ab":
            assert self._writer is not None
            self.loc = self._writer.size

    def _fetch_range(self, start: int, end: int) -> bytes:
        assert self._reader is not None
        return self.fs._run(self.path, self._reader.pread, start, max(0, end - start))

    def _initiate_upload(self) -> None:
        pass  # the writer was taken at open

    def _upload_chunk(self, final: bool = False) -> bool:
        assert self._writer is not None
        try:
            with self.buffer.getbuffer() as view:
                if view.nbytes:
                    self.fs._run(self.path, self._writer.write, view)
            if final and self.autocommit:
                self.commit()
        except BaseException:
            self.discard()
            raise
        return True

    def commit(self) -> None:
        """Seal the file (every byte durable); in a transaction, rename it into place."""
        assert self._writer is not None
        self.fs._run(self.path, self._writer.close)
        if self._temp is not None:
            self.fs._run(self.path, self.fs._tc.rename, self._temp, self.path)
            self._temp = None

    def discard(self) -> None:
        """Drop what was not yet durable; in a transaction, the hidden file too."""
        if self._writer is None:
            return
        self.fs._run(self.path, self._writer.abort)
        if self._temp is not None:
            temp, self._temp = self._temp, None
            try:
                self.fs._run(temp, self.fs._tc.unlink, temp)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        # A reader holds nothing but its block list (no call to close it), so a file the
        # garbage collector closes, maybe in the client's own thread, makes no call.
        self._reader = None
        super().close()

    def __del__(self) -> None:
        """A write left open is committed, as fsspec does, unless the collector runs in the
        client's own thread, which cannot wait on itself: then it is lost, and said so."""
        if self.closed:
            return
        try:
            self.close()
        except (OSError, RuntimeError) as e:
            log.warning("%s was left open and could not be closed: %s", self.path, e)

    def read(self, length: int = -1) -> bytes:
        """Reads of at least ``blocksize`` skip fsspec's cache: its readahead would fetch a
        block more than asked for and copy the bytes once more."""
        length = -1 if length is None else int(length)
        if length < 0:
            length = max(0, self.size - self.loc)
        if self._reader is None or self.closed or length < self.blocksize:
            return bytes(super().read(length))
        data = self.fs._run(self.path, self._reader.pread, self.loc, length)
        self.loc += len(data)
        return data

    def readinto(self, b: Any) -> int:
        """As ``read``: a large read lands straight in ``b``, one copy from the blocks."""
        out = memoryview(b).cast("B")
        if self._reader is None or self.closed or out.nbytes < self.blocksize:
            return int(super().readinto(b))
        n = self.fs._run(self.path, self._reader.pread_into, self.loc, out)
        self.loc += n
        return n

    def fileno(self) -> int:
        raise io.UnsupportedOperation("a tectonic file has no file descriptor")
