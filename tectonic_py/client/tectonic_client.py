"""The data-path client: striped, erasure-coded writes and reads (Tectonic's client library).

All the logic of reads and writes lives in this package, as in Tectonic; the FUSE mount, the
``tectonic`` CLI, the blocking wrapper and the load test are thin layers over it::

    async with open_client("cluster.toml") as client:
        w = await client.create("/ckpt/rank_0.pt")
        await w.write(data)
        await w.close()                  # durable, committed and sealed
        r = await client.open_read("/ckpt/rank_0.pt")
        data = await r.read()

This module is the path API (``TectonicClient``: names to file ids, writers and readers) and
the client's resources. The rest of the package, one concept a module: ``writer``
(FileWriter: the open block, flushes, commits), ``reader`` (FileReader: sequential detection,
readahead), ``block_io`` (one block to and from chunk stores, with ``block_put`` and
``block_get``), ``buffers`` (the writers' window and the readers' block cache),
``node_view`` (which chunk stores to plan around), ``packing`` (small blocks of many files
stored as one), ``bad_chunks`` (reports for repair),
``codec`` and ``stripe``. Connections to chunk stores are ``chunkstore.client.ChunkPool``.
Writers and readers see the client through the narrow ``writer.WritePath`` (``_WritePath``
here) and ``reader.ReadPath``, so none of the modules this one wires together imports it.

Down nodes are planned around, not timed out on: ``NodeView`` keeps the registry's "down"
marks and the stores this client just failed to reach, so a dead store costs one timeout
per client rather than one per block. Slowness is never failure: under a burst every chunk
store queues, parity chunks as much as data chunks, so a slow get or put only *starts* a
hedge while the original request keeps running; a block read or write fails only when too
many requests have actually failed (an error from the store, or the connection lost).

Error handling: every public method raises only ``tectonic_py.core.errors`` classes, never
exception groups. Resource handling: background tasks (flushes, readahead, connection
receivers, bad-chunk reports) live in the nursery of ``open_client``; leaving it closes
every connection.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

from chunkstore.client import ChunkPool
from tectonic_py.client.async_creates import AsyncCreates, PendingCreate
from tectonic_py.client.block_io import BlockIO, BlockWrite, IOTuning
from tectonic_py.client.buffers import BlockCache, BufferPool
from tectonic_py.client.codec import Codec
from tectonic_py.client.metrics import watch_client
from tectonic_py.client.node_view import NodeView
from tectonic_py.client.packing import Packer, PackTuning
from tectonic_py.client.reader import FileReader
from tectonic_py.client.stats import ClientStats
from tectonic_py.client.writer import FileWriter
from tectonic_py.core import cluster_file
from tectonic_py.core.aio import open_service_nursery
from tectonic_py.core.cluster_file import ClusterConfig
from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import (
    FileExists,
    FileNotFound,
    InvalidArgument,
    InvalidName,
    IsADirectory,
)
from tectonic_py.core.ids import ROOT_ID
from tectonic_py.core.metrics import Metrics
from tectonic_py.core.metrics_http import parse_listen, serve_metrics
from tectonic_py.core.records import Attrs, BlockInfo, DirEntry

__all__ = ["ClientStats", "FileReader", "FileWriter", "TectonicClient", "open_client"]

MiB = 1024 * 1024

DEFAULT_WINDOW_BYTES = 256 * MiB
DEFAULT_CACHE_BYTES = 192 * MiB


class TectonicClient:
    """One per process: metadata client, chunk-store pool, codec threads, window and cache.

    Tuning (keyword arguments of ``open_client``):

    * ``window_bytes``: memory for block buffers across all writers (backpressure bound);
    * ``cache_bytes``: the readers' memory budget: cached blocks and block fetches in
      flight (readahead lands here; a reader with no room reads ranges);
    * ``readahead_blocks``: whole blocks fetched ahead of a sequential reader;
    * ``write_quorum``: chunks that must land for a block to commit (default k + 1);
    * ``hedge``: extra nodes asked for with every block, for re-sending failed chunks;
    * ``write_hedge_s``: a chunk put still running after this is also sent to a spare
      (hedge) node, and the first to accept wins;
    * ``chunk_timeout``: a put still running this long after its last hedge is hedged again
      (while spare nodes are left); it never fails the put;
    * ``slow_chunk_s``: a block's chunks still missing after this get every parity chunk
      left fetched as well, and a range read falls back to a whole-block read; the slow
      requests keep running and never count as failed;
    * ``read_hedge_s``: data chunks of a block still missing after this are hedged with
      parity fetches (first k good chunks win);
    * ``max_reconstructions``: degraded decodes at once;
    * ``connect_timeout``: a connect to a chunk store not answered in this long fails (a
      cut link drops SYNs silently);
    * ``node_backoff_s``: a chunk store this client failed to reach is avoided this long
      (reads go degraded, puts go to other nodes), so it costs one timeout, not one per
      block; nodes the registry marks down are avoided until it marks them up;
    * ``pack_delay_s``: an open pack of small files' blocks waits this long for more
      files before it is stored (client/packing.py);
    * ``max_packs``: packs open or being stored at once;
    * ``pack_limit``: blocks up to this fraction of a whole block go into packs (0: none).
    """

    def __init__(
        self,
        config: ClusterConfig,
        meta: Any,
        nursery: trio.Nursery,
        *,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        readahead_blocks: int = 3,
        write_quorum: int | None = None,
        hedge: int = 2,
        chunk_timeout: float = 30.0,
        write_hedge_s: float = 5.0,
        slow_chunk_s: float = 10.0,
        read_hedge_s: float = 2.0,
        max_reconstructions: int = 2,
        connect_timeout: float = 3.0,
        node_backoff_s: float = 10.0,
        pack_delay_s: float = 0.005,
        max_packs: int = 4,
        pack_limit: float = 0.5,
    ) -> None:
        if window_bytes < MiB:
            raise InvalidArgument("window_bytes must be at least 1 MiB")
        if not (pack_delay_s >= 0 and max_packs >= 1 and 0 <= pack_limit <= 1):
            raise InvalidArgument(
                f"pack_delay_s ({pack_delay_s}) must be >= 0, max_packs ({max_packs}) >= 1"
                f" and pack_limit ({pack_limit}) between 0 and 1"
            )
        if not connect_timeout > 0 or not node_backoff_s >= 0:
            raise InvalidArgument(
                f"connect_timeout ({connect_timeout}) must be > 0 and node_backoff_s "
                f"({node_backoff_s}) >= 0"
            )
        self.config = config
        self.meta = meta
        self.nursery = nursery
        self.stats = ClientStats()
        # Set by ``open_client(metrics_listen=...)``: the process's families (the mount adds
        # the FUSE layer's) and where they are served.
        self.metrics = Metrics.off()
        self.metrics_address: str | None = None
        self.node_view = NodeView(meta, nursery, node_backoff_s)
        self.codec = Codec()
        self.pool = ChunkPool(
            config.credential(),
            nursery,
            reachability=self.node_view,
            attempts=self.stats.node_attempts,
            connect_timeout=connect_timeout,
            crc=self.codec.checksum,
        )
        self.buffers = BufferPool(window_bytes, self.stats)
        self.buffers.spill = lambda writer: nursery.start_soon(writer.spill_open)
        self.cache = BlockCache(cache_bytes)
        self.readahead_blocks = max(0, readahead_blocks)
        tuning = IOTuning(
            write_quorum=write_quorum,
            hedge=max(0, hedge),
            chunk_timeout=chunk_timeout,
            write_hedge_s=write_hedge_s,
            slow_chunk_s=slow_chunk_s,
            read_hedge_s=read_hedge_s,
            max_reconstructions=max_reconstructions,
        )
        self.blocks = BlockIO(
            meta, self.pool, self.node_view, self.codec, self.cache, self.stats, nursery, tuning
        )
        self.packer = Packer(
            self.blocks.store_block,
            meta.commit_pack,
            meta.shard_of,
            nursery,
            PackTuning(pack_delay_s, max_packs, pack_limit),
        )
        self._write_path = _WritePath(meta, self.blocks, self.buffers, nursery, self.packer)
        self.creates = AsyncCreates(meta, nursery)
        self._closed = False

    def statistics(self) -> ClientStats:
        return self.stats

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.pool.aclose()

    # --- block I/O (``BlockIO``), for readers (``ReadPath``) and the mount ---------------------

    async def file_blocks(self, file_id: int) -> tuple[Attrs, list[BlockInfo]]:
        attrs = await self.meta.getattr(file_id)
        return attrs, await self.meta.block_list(file_id) if attrs.size else []

    async def read_block(self, info: BlockInfo) -> memoryview:
        return await self.blocks.read_block(info)

    async def read_part(
        self, info: BlockInfo, block_offset: int, length: int, *, view: bool = False
    ) -> bytes | bytearray | memoryview:
        return await self.blocks.read_part(info, block_offset, length, view=view)

    async def read_range(self, info: BlockInfo, block_offset: int, out: memoryview) -> None:
        await self.blocks.read_range(info, block_offset, out)

    def prefetch(self, infos: Sequence[BlockInfo]) -> None:
        self.blocks.prefetch(infos)

    # --- path level ------------------------------------------------------------------------

    async def stat(self, path: str) -> Attrs:
        return await self.meta.resolve(_normpath(path))

    async def listdir(self, path: str) -> list[DirEntry]:
        d = await self.stat(path)
        out: list[DirEntry] = []
        after = ""
        while True:
            page, nxt = await self.meta.readdir(d.id, after, 1000)
            out.extend(page)
            if nxt is None or not page:
                return out
            after = nxt

    async def mkdir(self, path: str, mode: int = 0o755, parents: bool = False) -> Attrs:
        path = _normpath(path)
        if not parents:
            parent, name = _split(path)
            d = await self.meta.resolve(parent)
            return await self.meta.mkdir(d.id, name, mode=mode)
        current = await self.meta.getattr(ROOT_ID)
        for name in [p for p in path.split("/") if p]:
            try:
                current = await self.meta.lookup(current.id, name)
            except FileNotFound:
                try:
                    current = await self.meta.mkdir(current.id, name, mode=mode)
                except FileExists:
                    current = await self.meta.lookup(current.id, name)
        return current

    async def unlink(self, path: str) -> None:
        parent, name = _split(_normpath(path))
        d = await self.meta.resolve(parent)
        await self.meta.unlink(d.id, name)

    async def rmdir(self, path: str) -> None:
        parent, name = _split(_normpath(path))
        d = await self.meta.resolve(parent)
        await self.meta.rmdir(d.id, name)

    async def rename(self, src: str, dst: str) -> None:
        sp, sn = _split(_normpath(src))
        dp, dn = _split(_normpath(dst))
        sd = await self.meta.resolve(sp)
        dd = sd if dp == sp else await self.meta.resolve(dp)
        await self.meta.rename(sd.id, sn, dd.id, dn)

    async def symlink(self, target: str | bytes, path: str) -> Attrs:
        """``path`` becomes a symbolic link to ``target`` (as ``os.symlink(target, path)``);
        the target is stored as given and never resolved here."""
        parent, name = _split(_normpath(path))
        d = await self.meta.resolve(parent)
        raw = os.fsencode(target)
        return await self.meta.symlink(d.id, name, raw)

    async def readlink(self, path: str) -> str:
        """The target of the symbolic link ``path`` (``os.readlink``)."""
        attrs = await self.stat(path)
        return os.fsdecode(await self.meta.readlink(attrs.id))

    async def link(self, src: str, dst: str) -> Attrs:
        """A hard link: ``dst`` names the file ``src`` names (``os.link``)."""
        attrs = await self.stat(src)
        if attrs.is_dir:
            raise IsADirectory(f"{src!r} is a directory: no hard links to directories")
        parent, name = _split(_normpath(dst))
        d = await self.meta.resolve(parent)
        return await self.meta.link(attrs.id, d.id, name)

    async def create(
        self, path: str, *, mode: int = 0o644, exclusive: bool = False, ec: str | None = None
    ) -> FileWriter:
        parent, name = _split(_normpath(path))
        d = await self.meta.resolve(parent)
        return await self.create_in(d.id, name, mode=mode, exclusive=exclusive, ec=ec)

    async def open_read(self, path: str) -> FileReader:
        attrs = await self.stat(path)
        return await self.open_reader(attrs.id)

    # --- id level ----------------------------------------------------------------------------

    async def create_in(
        self,
        dir_id: int,
        name: str,
        *,
        mode: int = 0o644,
        uid: int = 0,
        gid: int = 0,
        exclusive: bool = False,
        ec: str | None = None,
    ) -> FileWriter:
        if ec is not None:
            ECPolicy.parse(ec)
        attrs, token = await self.meta.create(
            dir_id, name, mode=mode, uid=uid, gid=gid, exclusive=exclusive, ec=ec
        )
        writer = FileWriter(self._write_path, attrs, token, {})
        writer.quota.dir_id = dir_id
        return writer

    async def create_pending(
        self, dir_id: int, name: str, *, mode: int = 0o644, uid: int = 0, gid: int = 0
    ) -> tuple[FileWriter, PendingCreate] | None:
        """A writer of a new file ``name`` in ``dir_id`` made without waiting for the
        metadata service (an ``O_CREAT|O_TRUNC`` the caller believes is of a free name:
        tectonic_py/client/async_creates.py says what it promises); None when no delegated
        id is at hand, and the caller creates synchronously."""
        ec, chunk_size = await self.meta.dir_policy(dir_id)
        if (await self.meta.dir_realm(dir_id))[0]:
            return None  # under a quota: a create is counted (and may be refused) at once
        started = self.creates.start(
            dir_id, name, mode=mode, uid=uid, gid=gid, ec=ec, chunk_size=chunk_size
        )
        if started is None:
            return None
        attrs, token, pending = started
        path = _PendingPath(self._write_path, pending)
        return FileWriter(path, attrs, token, {}), pending

    async def open_writer(self, file_id: int, *, truncate: bool = False) -> FileWriter:
        token = await self.meta.open_for_write(file_id, truncate=truncate)
        attrs = await self.meta.getattr(file_id)
        blocks: dict[int, BlockInfo] = {}
        if not truncate and attrs.size:
            blocks = {b.file_index: b for b in await self.meta.block_list(file_id)}
        writer = FileWriter(self._write_path, attrs, token, blocks)
        if attrs.realm:
            writer.quota.dir_id = await self.meta.parent(file_id)  # whose reservation it draws
        return writer

    async def open_reader(self, file_id: int) -> FileReader:
        return await self.reader_at(await self.meta.getattr(file_id))

    async def reader_at(self, attrs: Attrs) -> FileReader:
        """A reader of the file whose attrs the caller just read (one round trip less)."""
        file_id = attrs.id
        if attrs.is_dir:
            raise IsADirectory(f"file id {file_id} is a directory")
        blocks = await self.meta.block_list(file_id) if attrs.size else []
        if blocks:
            await self.node_view.refresh()  # rate limited: plan this file's reads around down nodes
        return FileReader(self, attrs, {b.file_index: b for b in blocks})

    def reader_of(self, writer: FileWriter) -> FileReader:
        """A reader of what a closed writer sealed, from the writer's own block map: no
        round trip, and it works after the file lost its last name (an open file that was
        unlinked stays readable)."""
        return FileReader(self, writer.attrs, writer.committed_blocks())

    def reader_like(self, reader: FileReader) -> FileReader:
        """Another reader of what ``reader`` located, from its block map: no round trip,
        and it works after the file's record is gone (a replaced file the mount keeps
        openable while the kernel still holds its inode)."""
        return FileReader(self, reader.attrs, reader.located())


@dataclass(frozen=True)
class _WritePath:
    """What every writer of a client is given (``writer.WritePath``): the block I/O, the
    metadata calls of a writer token, the window and the nursery."""

    meta: Any
    blocks: BlockIO
    buffers: BufferPool
    nursery: trio.Nursery
    packer: Packer | None

    async def store_block(self, block: BlockWrite) -> BlockInfo:
        return await self.blocks.store_block(block)

    async def read_block(self, info: BlockInfo) -> memoryview:
        return await self.blocks.read_block(info)

    async def commit_blocks(self, file_id: int, token: int, blocks: Sequence[BlockInfo]) -> None:
        await self.meta.commit_blocks(file_id, token, blocks)

    async def set_size(self, file_id: int, token: int, size: int) -> Attrs:
        attrs: Attrs = await self.meta.set_size(file_id, token, size)
        return attrs

    async def seal(self, file_id: int, token: int, size: int, blocks: Sequence[BlockInfo]) -> Attrs:
        attrs: Attrs = await self.meta.close(file_id, token, size, blocks)
        return attrs

    async def renew_lease(self, file_id: int, token: int) -> None:
        await self.meta.renew_lease(file_id, token)

    def superseded(self, old: BlockInfo) -> None:
        self.blocks.cache.discard(old.block_id)

    async def created(self) -> None:
        return None

    async def claim(
        self, realm: int, dir_id: int, file_id: int, need: int, want: int, prealloc: bool
    ) -> tuple[int, int]:
        granted: tuple[int, int] = await self.meta.claim(
            realm, dir_id=dir_id, file_id=file_id, need=need, want=want, prealloc=prealloc
        )
        return granted

    async def unclaim(self, realm: int, file_id: int, nbytes: int, keep: bool) -> None:
        await self.meta.unclaim(realm, file_id, nbytes, keep=keep)


@dataclass(frozen=True)
class _PendingPath:
    """The write path of a file whose create is still in flight: blocks are stored at
    once (a block needs no file record until it is committed), and every metadata call of
    the writer waits for the create first, failing with its error."""

    inner: _WritePath
    pending: PendingCreate

    @property
    def buffers(self) -> BufferPool:
        return self.inner.buffers

    @property
    def nursery(self) -> trio.Nursery:
        return self.inner.nursery

    @property
    def packer(self) -> Packer | None:
        return self.inner.packer

    async def store_block(self, block: BlockWrite) -> BlockInfo:
        return await self.inner.store_block(block)

    async def read_block(self, info: BlockInfo) -> memoryview:
        return await self.inner.read_block(info)

    async def created(self) -> None:
        await self.pending.wait()

    async def commit_blocks(self, file_id: int, token: int, blocks: Sequence[BlockInfo]) -> None:
        await self.pending.wait()
        await self.inner.commit_blocks(file_id, token, blocks)

    async def set_size(self, file_id: int, token: int, size: int) -> Attrs:
        await self.pending.wait()
        return await self.inner.set_size(file_id, token, size)

    async def seal(self, file_id: int, token: int, size: int, blocks: Sequence[BlockInfo]) -> Attrs:
        await self.pending.wait()
        return await self.inner.seal(file_id, token, size, blocks)

    async def renew_lease(self, file_id: int, token: int) -> None:
        await self.pending.wait()
        await self.inner.renew_lease(file_id, token)

    def superseded(self, old: BlockInfo) -> None:
        self.inner.superseded(old)

    async def claim(
        self, realm: int, dir_id: int, file_id: int, need: int, want: int, prealloc: bool
    ) -> tuple[int, int]:
        await self.pending.wait()
        return await self.inner.claim(realm, dir_id, file_id, need, want, prealloc)

    async def unclaim(self, realm: int, file_id: int, nbytes: int, keep: bool) -> None:
        await self.inner.unclaim(realm, file_id, nbytes, keep)


# --- helpers -----------------------------------------------------------------------------------


def _normpath(path: str) -> str:
    if not isinstance(path, str) or not path.startswith("/"):
        raise InvalidName(f"path {path!r} must be absolute (start with '/')")
    parts = [p for p in path.split("/") if p and p != "."]
    if ".." in parts:
        raise InvalidName(f"path {path!r} may not contain '..'")
    return "/" + "/".join(parts)


def _split(path: str) -> tuple[str, str]:
    if path == "/":
        raise InvalidName("the root directory has no name")
    parent, _, name = path.rpartition("/")
    return parent or "/", name


@asynccontextmanager
async def open_client(
    cluster: ClusterConfig | str | os.PathLike[str],
    *,
    first_contact_deadline: float | None = None,
    metrics_listen: str | None = None,
    **tuning: Any,
) -> AsyncIterator[TectonicClient]:
    """Connect to a cluster (a ``ClusterConfig`` or the path of its cluster file).
    ``first_contact_deadline``: how long a metadata server that has not answered yet is
    waited for (``None``: as long as for a restart, the data path's choice; an interactive
    command passes a few seconds). ``metrics_listen``: serve the client's metrics on
    HOST:PORT (port 0: any; ``client.metrics_address`` says where)."""
    from metadata.client import MetadataClient

    config = cluster if isinstance(cluster, ClusterConfig) else cluster_file.load(cluster)
    listen = None if metrics_listen is None else parse_listen(metrics_listen)
    async with open_service_nursery() as nursery:
        meta = MetadataClient(
            config, nursery=nursery, first_contact_deadline=first_contact_deadline
        )
        client = TectonicClient(config, meta, nursery, **tuning)
        if listen is not None:
            client.metrics = Metrics()
            watch_client(client.metrics, client.stats)
            client.metrics_address = await nursery.start(serve_metrics, client.metrics, *listen)
        try:
            yield client
        finally:
            with trio.CancelScope(shield=True):
                await client.aclose()
                await meta.aclose()
            nursery.cancel_scope.cancel()
