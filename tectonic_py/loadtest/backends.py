"""Where the ranks' bytes go: the tectonic client library (one client per worker process,
shared by its ranks) or real file I/O on a mounted filesystem (tectonic's FUSE mount, or a
peer's, for comparison). Both offer the same few calls, so the worker and the coordinator do
not care which one runs.

``write_file`` and ``read_file`` call ``opened(seconds)`` once the file is open, with the
seconds spent inside the create/open call alone: through a mount the ``os.open`` itself,
timed in the thread that makes it (no wait for a thread or the limiter counted); through the
client library the ``create`` / ``open_read`` call (resolve and metadata round trip), timed
on the worker's trio loop, so it includes time the loop spent on other ranks meanwhile.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import time
from collections.abc import Iterable
from typing import Any

import trio

from tectonic_py.core.errors import TectonicError
from tectonic_py.loadtest.config import PIECE

log = logging.getLogger(__name__)


class ClientBackend:
    """Ranks through the client library: one client per worker process, shared by its ranks."""

    def __init__(self, client: Any) -> None:
        self.client = client

    async def makedirs(self, path: str) -> None:
        await self.client.mkdir(path, parents=True)

    async def write_file(self, path: str, pieces: Iterable[memoryview], opened: Any) -> None:
        t = time.perf_counter()
        w = await self.client.create(path)
        opened(time.perf_counter() - t)
        try:
            for piece in pieces:
                await w.write(piece)
        except BaseException:
            await _abort(w)
            raise
        await w.close()

    async def read_file(self, path: str, size: int, sink: Any, opened: Any) -> None:
        t = time.perf_counter()
        r = await self.client.open_read(path)
        opened(time.perf_counter() - t)
        try:
            offset = 0
            while offset < size:
                data = await r.pread(offset, min(PIECE, size - offset))
                if not data:
                    break
                sink(data)
                offset += len(data)
        finally:
            await _close_reader(r)

    async def remove_tree(self, path: str) -> None:
        try:
            entries = await self.client.listdir(path)
        except TectonicError as e:
            if getattr(e, "code", "") == "enoent":
                return
            raise
        for entry in entries:
            child = f"{path}/{getattr(entry, 'name', entry)}"
            st = entry if hasattr(entry, "kind") else await self.client.stat(child)
            if _is_dir(st):
                await self.remove_tree(child)
            else:
                await self.client.unlink(child)
        await self.client.rmdir(path)

    async def read_small(self, path: str) -> bytes:
        r = await self.client.open_read(path)
        try:
            return bytes(await r.read())
        finally:
            await _close_reader(r)

    async def write_small(self, path: str, data: bytes) -> None:
        w = await self.client.create(path)
        await w.write(data)
        await w.close()

    async def reserve(self, path: str, nbytes: int, ttl_s: float) -> None:
        """``tectonic reserve`` of the directory: NoSpace or QuotaExceeded at once."""
        d = await self.client.stat(path)
        await self.client.meta.reserve(d.id, nbytes, ttl_s)

    async def release(self, path: str) -> None:
        await self.client.meta.release((await self.client.stat(path)).id)


def _is_dir(st: Any) -> bool:
    kind = getattr(st, "kind", None)
    if kind is not None:
        return str(getattr(kind, "value", kind)).lower() in ("dir", "directory", "d")
    mode = getattr(st, "mode", None) or getattr(st, "st_mode", None)
    if mode is not None:
        return stat.S_ISDIR(mode)
    return bool(getattr(st, "is_dir", False))


async def _abort(writer: Any) -> None:
    for name in ("abort", "aclose"):
        fn = getattr(writer, name, None)
        if fn is not None:
            with trio.CancelScope(shield=True):
                try:
                    await fn()
                except TectonicError as e:  # the write's own error is the one reported
                    log.debug("abort after a failed write: %s", e)
            return


async def _close_reader(reader: Any) -> None:
    for name in ("close", "aclose"):
        fn = getattr(reader, name, None)
        if fn is not None:
            result = fn()
            if hasattr(result, "__await__"):
                await result
            return


class MountBackend:
    """Ranks doing real file I/O on a mount: open/write/fsync/close as torch.distributed.checkpoint
    does, each blocking call in a worker thread (one per rank, so ranks overlap)."""

    def __init__(self, root: str, limiter: trio.CapacityLimiter) -> None:
        self.root = root
        self.limiter = limiter

    def _path(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    async def makedirs(self, path: str) -> None:
        await self._run(lambda: os.makedirs(self._path(path), exist_ok=True))

    async def reserve(self, path: str, nbytes: int, ttl_s: float) -> None:
        """The mount's ``tectonic.reserve`` attribute: ENOSPC or EDQUOT at once."""
        value = f"{nbytes}:{ttl_s}s".encode()
        await self._run(lambda: os.setxattr(self._path(path), "tectonic.reserve", value))

    async def release(self, path: str) -> None:
        await self._run(lambda: os.removexattr(self._path(path), "tectonic.reserve"))

    async def write_file(self, path: str, pieces: Iterable[memoryview], opened: Any) -> None:
        fd, open_s = await self._run(
            _timed_open,
            self._path(path),
            os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
            0o644,
        )
        opened(open_s)
        try:
            for piece in pieces:
                view = piece
                while view:
                    n = await self._run(os.write, fd, view)
                    view = view[n:]
            await self._run(os.fsync, fd)
        finally:
            await self._run(os.close, fd)

    async def read_file(self, path: str, size: int, sink: Any, opened: Any) -> None:
        fd, open_s = await self._run(_timed_open, self._path(path), os.O_RDONLY | os.O_CLOEXEC)
        opened(open_s)
        # A restore follows a restart: drop what the page cache kept from the write, so the
        # read reaches the filesystem (as the client-library mode always does).
        await self._run(os.posix_fadvise, fd, 0, 0, os.POSIX_FADV_DONTNEED)
        buf = bytearray(PIECE)
        view = memoryview(buf)
        try:
            offset = 0
            while offset < size:
                n = await self._run(os.preadv, fd, [view[: min(PIECE, size - offset)]], offset)
                if not n:
                    break
                sink(view[:n])
                offset += n
        finally:
            await self._run(os.close, fd)

    async def remove_tree(self, path: str) -> None:
        await self._run(lambda: shutil.rmtree(self._path(path), ignore_errors=True))

    async def read_small(self, path: str) -> bytes:
        def read() -> bytes:
            with open(self._path(path), "rb") as f:
                return f.read()

        return bytes(await self._run(read))

    async def write_small(self, path: str, data: bytes) -> None:
        """Write then rename, as DCP writes ``.metadata`` (``.metadata.tmp`` then rename)."""

        def write() -> None:
            target = self._path(path)
            tmp = target + ".tmp"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, target)

        await self._run(write)


def _timed_open(path: str, flags: int, mode: int = 0o777) -> tuple[int, float]:
    """``os.open`` and the seconds it took, measured around the call alone (in the thread)."""
    t = time.perf_counter()
    fd = os.open(path, flags, mode)
    return fd, time.perf_counter() - t
