"""A blocking wrapper over the trio client, for plain scripts: ``tectonic_py.connect(...)``.

::

    fs = tectonic_py.connect("cluster.toml")
    with fs.open("/ckpt/step_10/rank_0.pt", "wb") as f:
        torch.save(state, f)
    with fs.open("/ckpt/step_10/rank_0.pt", "rb") as f:
        state = torch.load(f)
    fs.close()

How: one thread runs ``trio.run`` holding an open ``TectonicClient``; every blocking call is
sent to it through ``trio.from_thread.run`` with that run's token. The files are ``io``
raw streams wrapped in ``io.BufferedWriter``/``BufferedReader`` with block-sized buffers, so
``torch.save``'s many small writes cross the thread boundary in large pieces. The one thread
is the documented exception to "no bare threads": it is the portal into trio for code that is
not async.
"""

from __future__ import annotations

import atexit
import io
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Self, TypeVar

import trio

from tectonic_py.client.reader import FileReader
from tectonic_py.client.tectonic_client import TectonicClient, open_client
from tectonic_py.client.writer import FileWriter
from tectonic_py.core.cluster_file import ClusterConfig
from tectonic_py.core.errors import ConfigError, InvalidArgument, TectonicError, Unavailable
from tectonic_py.core.records import Attrs, DirEntry

log = logging.getLogger(__name__)

T = TypeVar("T")
MiB = 1024 * 1024


class BlockingClient:
    """A connected client usable from ordinary (non-async) code. Thread-safe."""

    def __init__(self, cluster: ClusterConfig | str | os.PathLike[str], **tuning: Any) -> None:
        self._started = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._client: TectonicClient | None = None
        self._stop: trio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._main, args=(cluster, tuning), name="tectonic-client", daemon=True
        )
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def _main(self, cluster: Any, tuning: dict[str, Any]) -> None:
        async def run() -> None:
            try:
                async with open_client(cluster, **tuning) as client:
                    self._client = client
                    self._token = trio.lowlevel.current_trio_token()
                    self._stop = trio.Event()
                    self._started.set()
                    await self._stop.wait()
            except BaseException as e:
                self._error = e
                raise

        try:
            trio.run(run)
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
            if self._error is None:
                self._error = e
        finally:
            self._started.set()

    def _call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        if self._token is None or self._stop is None or self._stop.is_set():
            raise Unavailable("the tectonic client is closed")
        try:
            return trio.from_thread.run(fn, *args, trio_token=self._token)
        except trio.RunFinishedError:
            raise Unavailable("the tectonic client is closed") from None

    @property
    def client(self) -> TectonicClient:
        assert self._client is not None
        return self._client

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``await fn(*args)`` in the client's trio thread, its result returned here: for the
        layers over this client (fsspec, DCP) that need what the blocking calls do not
        offer, such as many ranged reads at once."""
        return self._call(fn, *args)

    def stat(self, path: str) -> Attrs:
        return self._call(self.client.stat, path)

    def listdir(self, path: str) -> list[DirEntry]:
        return self._call(self.client.listdir, path)

    def mkdir(self, path: str, mode: int = 0o755, parents: bool = False) -> Attrs:
        async def go() -> Attrs:
            return await self.client.mkdir(path, mode, parents)

        return self._call(go)

    def unlink(self, path: str) -> None:
        self._call(self.client.unlink, path)

    def rmdir(self, path: str) -> None:
        self._call(self.client.rmdir, path)

    def rename(self, src: str, dst: str) -> None:
        self._call(self.client.rename, src, dst)

    def open(
        self, path: str, mode: str = "rb", *, ec: str | None = None, buffer_size: int = 8 * MiB
    ) -> io.BufferedIOBase:
        """``"rb"`` or ``"wb"`` (also ``"xb"``: fail if it exists); binary only."""
        if mode == "rb":
            reader = self._call(self.client.open_read, path)
            return io.BufferedReader(_RawReader(self, reader), buffer_size)
        if mode in ("wb", "xb"):

            async def create() -> FileWriter:
                return await self.client.create(path, exclusive=mode == "xb", ec=ec)

            writer = self._call(create)
            return io.BufferedWriter(_RawWriter(self, writer), buffer_size)
        raise InvalidArgument(f"mode {mode!r}: use 'rb', 'wb' or 'xb'")

    def close(self) -> None:
        if self._token is not None and self._stop is not None and not self._stop.is_set():
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PositionedStream(io.RawIOBase):
    """Position bookkeeping for raw streams over a pwrite/pread interface (the client's
    files, native.dcp's in-memory items): seek/tell are pure arithmetic on ``_pos``."""

    def __init__(self) -> None:
        super().__init__()
        self._pos = 0

    @property
    def _size(self) -> int:
        raise NotImplementedError

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise OSError("negative seek position")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos


class _RawStream(PositionedStream):
    """A client file as a raw stream, its calls sent through the owner's portal."""

    def __init__(self, owner: BlockingClient) -> None:
        super().__init__()
        self._owner = owner

    def fileno(self) -> int:
        raise OSError("a tectonic file has no file descriptor")


class _RawWriter(_RawStream):
    """A FileWriter as a raw binary stream; seekable (pwrite) so zip writers may patch."""

    def __init__(self, owner: BlockingClient, writer: FileWriter) -> None:
        super().__init__(owner)
        self._w = writer

    @property
    def _size(self) -> int:
        return self._w.size

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def write(self, b: Any) -> int:
        data = bytes(b) if not isinstance(b, (bytes, bytearray, memoryview)) else b
        n = self._owner._call(self._w.pwrite, memoryview(data).cast("B"), self._pos)
        self._pos += n
        return n

    def truncate(self, size: int | None = None) -> int:
        size = self._pos if size is None else size
        self._owner._call(self._w.truncate, size)
        return size

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if not self.closed:
            try:
                self._owner._call(self._w.close)
            except TectonicError:
                self._owner._call(self._w.abort)
                raise
            finally:
                super().close()


class _RawReader(_RawStream):
    def __init__(self, owner: BlockingClient, reader: FileReader) -> None:
        super().__init__(owner)
        self._r = reader

    @property
    def _size(self) -> int:
        return self._r.size

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = self._owner._call(self._r.pread_into, self._pos, memoryview(b))
        self._pos += n
        return n

    def close(self) -> None:
        if not self.closed:
            try:
                self._owner._call(self._r.aclose)
            finally:
                super().close()


def connect(cluster: ClusterConfig | str | os.PathLike[str], **tuning: Any) -> BlockingClient:
    """Connect to a cluster from plain (non-async) Python; see ``BlockingClient``."""
    return BlockingClient(cluster, **tuning)


# The environment variable that names the cluster file when a caller gives none.
CLUSTER_ENV = "TECTONIC_CLUSTER"

_shared: dict[tuple[int, str], BlockingClient] = {}
_shared_lock = threading.Lock()


def shared_client(cluster_file: str | os.PathLike[str] | None = None) -> BlockingClient:
    """The process's one client of a cluster file, connected on first use, closed at exit;
    without a cluster file, the one ``$TECTONIC_CLUSTER`` names.

    Why: the fsspec filesystem and the DCP writers and readers are handed a cluster file and
    are made anew for every checkpoint; each opening its own connections, threads and
    buffer window would multiply them per rank. Keyed by process id as well, so that a
    forked child never uses its parent's client, whose thread did not survive the fork.
    """
    if cluster_file is None:
        cluster_file = os.environ.get(CLUSTER_ENV) or None
        if cluster_file is None:
            raise ConfigError(f"no cluster file given and ${CLUSTER_ENV} is not set")
    key = (os.getpid(), os.path.realpath(cluster_file))
    with _shared_lock:
        client = _shared.get(key)
        if client is None or not client._thread.is_alive():
            client = _shared[key] = BlockingClient(cluster_file)
        return client


def close_shared_clients() -> None:
    """Close this process's shared clients (``shared_client``); also run at exit. The next
    ``shared_client`` call connects again."""
    with _shared_lock:
        clients = [c for (pid, _), c in _shared.items() if pid == os.getpid()]
        _shared.clear()
    for client in clients:
        try:
            client.close()
        except TectonicError as e:
            log.warning("closing a shared tectonic client at exit: %s", e)


atexit.register(close_shared_clients)
