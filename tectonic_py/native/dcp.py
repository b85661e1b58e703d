"""torch.distributed.checkpoint (DCP) over the client library: no FUSE, one client per rank.

::

    import torch.distributed.checkpoint as dcp
    from tectonic_py.native.dcp import TectonicReader, TectonicWriter

    dcp.save(state_dict, storage_writer=TectonicWriter("/ckpt/step_100", cluster="c.toml"))
    dcp.load(state_dict, storage_reader=TectonicReader("/ckpt/step_100", cluster="c.toml"))

``cluster`` defaults to ``$TECTONIC_CLUSTER``; every writer and reader of a process shares
that cluster file's one client (``shared_client``), or uses the ``client=`` it is given.
Checkpoint paths are absolute in the cluster's namespace (``tectonic://`` URLs are accepted).

Layout: DCP's own, byte for byte what ``FileSystemWriter`` writes: per rank ``thread_count``
data files ``__{rank}_{n}.distcp``, each item a ``torch.save`` record at an offset, and one
``.metadata`` file (the pickled ``Metadata``: every item's file, offset and length). So a
checkpoint saved here loads through ``FileSystemReader`` on the FUSE mount, and the other
way round.

Writes: DCP's writer machinery (``FileSystemWriter``, which also makes this writer an async
stager for ``dcp.async_save``) with its file operations on the client (``_TectonicFiles``):
a rank's items are split over ``thread_count`` files written at once, and within each file
the client encodes and sends several blocks concurrently inside its window. A file's close
returns once it is durable and sealed, so there is no fsync.

Atomic commit (the default, ``commit=True``): every rank writes under a staging directory
beside the step, ``<step>.staging-<id>``, whose name the coordinator draws in
``prepare_global_plan`` and hands every rank in its plan (``_StagedPrefix``). ``finish``
runs on the coordinator after every rank's ``write_data`` has returned (every data file
sealed); ``_publish`` writes the ``.metadata`` file into the staging directory and commits
it (``name.commit``: metadata/checkpoint_ops.py): the staging directory becomes the step
and, with ``latest=NAME``, the symbolic link NAME beside it points at the step, in one
metadata transaction, after a check that every file under it is sealed. A job killed at any
moment (any rank, the coordinator, during the commit) leaves the step absent or whole,
never partly visible, and the previous step and ``latest`` as they were; its staging
directory is collected by the GC (tectonic_py/maintenance/gc.py). ``overwrite`` lets a
commit replace an existing step (moved aside under a staging name), else the save is
refused up front. With ``commit=False`` (or DCP's ``no_dist`` save without collectives)
files are written in place and only the metadata file is published atomically (written
under a temporary name and renamed into place).

Reads: the rank's plan names, for each item, a file, an offset and a length; ``read_data``
opens each file once and fetches just those ranges in batches of at most
``READ_BATCH_BYTES`` into one buffer the load reuses for every batch, each range cut at
block boundaries and ``READ_PIECES_IN_FLIGHT``
pieces of a rank fetched at once (not every range at once: every rank loads at the same
moment, and a whole checkpoint asked for at once queues on the chunk stores for longer
than the client's hedge delays, which then ask for more), then deserialises them as
``FileSystemReader`` does (``torch.load`` of the record, read in place from that buffer,
narrowed to the slice the plan asks for). A piece of half a block or more is read as whole data chunks through the
client's block cache, a smaller one as chunk ranges.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import os
import pickle
import posixpath
import uuid
from collections.abc import Awaitable, Callable, Generator, Sequence
from contextlib import contextmanager
from typing import IO, Any, cast

import torch
import trio
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    FileSystem,
    FileSystemReader,
    FileSystemWriter,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from tectonic_py.client.reader import FileReader
from tectonic_py.client.sync_client import BlockingClient, PositionedStream, shared_client
from tectonic_py.core.errors import FileNotFound, TectonicError

__all__ = ["TectonicReader", "TectonicWriter"]

MiB = 1024 * 1024

URL_PREFIX = "tectonic://"
METADATA_NAME = ".metadata"
# The GC collects <step>.staging-<id> of a job that died (metadata.checkpoint_client's mark).
STAGING_MARK = ".staging-"
# Data files per rank written at once: DCP splits a rank's items over them by size.
DEFAULT_WRITE_THREADS = 4
# Bytes of items fetched before they are deserialised: bounds a rank's read memory.
READ_BATCH_BYTES = 256 * MiB
# Block-sized pieces of one rank's ranges fetched at once (with the reader's readahead on
# top): enough to keep the chunk stores of a few blocks busy, few enough that every rank of
# a job loading at once does not queue the whole checkpoint on the stores (module docstring).
READ_PIECES_IN_FLIGHT = 4
# Files of one rank opened at once.
OPEN_CONCURRENCY = 16


def checkpoint_path(checkpoint_id: str | os.PathLike[str]) -> str:
    """``/a/b`` for ``/a/b``, ``a/b``, ``tectonic://a/b`` or ``tectonic:///a/b``."""
    path = os.fspath(checkpoint_id).removeprefix(URL_PREFIX)
    return "/" + "/".join(p for p in path.split("/") if p)


async def _gather(jobs: Sequence[Callable[[], Awaitable[None]]], limit: int) -> None:
    """Run jobs, at most ``limit`` at once; the first domain error, never an exception
    group (the public edge of this module raises the client's own classes)."""
    limiter = trio.CapacityLimiter(limit)
    errors: list[TectonicError] = []

    async def run(job: Callable[[], Awaitable[None]]) -> None:
        async with limiter:
            if errors:
                return
            try:
                await job()
            except TectonicError as e:
                errors.append(e)

    async with trio.open_nursery() as nursery:
        for job in jobs:
            nursery.start_soon(run, job)
    if errors:
        raise errors[0]


class _TectonicFiles(FileSystem):
    """The file operations DCP's writer and reader machinery needs, on the client (every
    one of ``FileSystem``'s is replaced: none touches the local disk)."""

    def __init__(self, client: BlockingClient, ec: str | None = None) -> None:
        self.client = client
        self.ec = ec

    @contextmanager
    def create_stream(
        self, path: str | os.PathLike[str], mode: str
    ) -> Generator[io.IOBase, None, None]:
        stream = self.client.open(os.fspath(path), mode, ec=self.ec if mode != "rb" else None)
        try:
            yield stream
        finally:
            stream.close()

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return posixpath.join(os.fspath(path), suffix)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        self.client.rename(os.fspath(path), os.fspath(new_path))

    def init_path(self, path: str | os.PathLike[str]) -> str:
        return checkpoint_path(path)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        self.client.mkdir(os.fspath(path), parents=True)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return os.fspath(checkpoint_id).startswith(URL_PREFIX)

    def exists(self, path: str | os.PathLike[str]) -> bool:
        try:
            self.client.stat(os.fspath(path))
        except FileNotFound:
            return False
        return True

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        self.client.unlink(os.fspath(path))

    def ls(self, path: str | os.PathLike[str]) -> list[str]:
        return [
            posixpath.join(os.fspath(path), e.name) for e in self.client.listdir(os.fspath(path))
        ]


@dataclasses.dataclass
class _StagedPrefix(_StoragePrefix):
    """A rank's storage data in the global plan: its files' prefix, as DCP's, and the
    staging directory the coordinator drew for this save."""

    staging: str = ""


async def _commit(
    client: BlockingClient, staging: str, final: str, latest: str, replace: bool
) -> dict[str, Any]:
    parent = await client.client.stat(posixpath.dirname(final))
    return await client.client.meta.commit_step(
        parent.id,
        posixpath.basename(staging),
        posixpath.basename(final),
        latest=latest,
        replace=replace,
    )


async def _reserve(client: BlockingClient, staging: str, size: int, ttl: float) -> None:
    d = await client.client.stat(staging)
    await client.client.meta.reserve(d.id, size, ttl)


ITEM_OVERHEAD = 4096  # a torch.save record's header, and a bytes item's guess


def plan_bytes(plans: Sequence[SavePlan]) -> int:
    """What the plans will write, about: each tensor item's bytes and a record's overhead
    (a non-tensor item counts the overhead alone)."""
    total = 0
    for plan in plans:
        for item in plan.items:
            total += ITEM_OVERHEAD
            td = item.tensor_data
            if td is not None:
                itemsize = torch.empty((), dtype=td.properties.dtype).element_size()
                total += math.prod(td.chunk.sizes) * itemsize
    return total


def _client(
    cluster: str | os.PathLike[str] | None, client: BlockingClient | None
) -> BlockingClient:
    return client if client is not None else shared_client(cluster)


class TectonicWriter(FileSystemWriter):
    """A DCP ``StorageWriter`` onto a tectonic cluster (see the module docstring).

    ``path``: the checkpoint directory; ``cluster``: the cluster file (default
    ``$TECTONIC_CLUSTER``) or ``client``: an open ``BlockingClient``; ``thread_count``: data
    files per rank written at once; ``ec``: the EC policy of the checkpoint's files (default:
    the directory's); ``commit``: write under a staging directory and commit the step
    atomically at ``finish``; ``latest``: the name of a symbolic link beside the step that
    the commit points at it; ``reserve``: before any rank writes, reserve the save's size
    in its staging directory (``True``: the plan's total, estimated from its tensors; an
    int: that many bytes), so a save that cannot fit fails at once with ENOSPC or EDQUOT
    (``NoSpace``, ``QuotaExceeded``) instead of half written; the reservation lasts until
    the commit or ``reserve_ttl`` seconds. The other arguments are ``FileSystemWriter``'s.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        cluster: str | os.PathLike[str] | None = None,
        client: BlockingClient | None = None,
        thread_count: int = DEFAULT_WRITE_THREADS,
        single_file_per_rank: bool = True,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        ec: str | None = None,
        commit: bool = True,
        latest: str | None = None,
        reserve: bool | int = False,
        reserve_ttl: float = 600.0,
    ) -> None:
        super().__init__(
            checkpoint_path(path),
            single_file_per_rank=single_file_per_rank,
            sync_files=False,  # a close returns once the file is durable and sealed
            thread_count=thread_count,
            per_thread_copy_ahead=per_thread_copy_ahead,
            cache_staged_state_dict=cache_staged_state_dict,
            overwrite=overwrite,
        )
        self.client = _client(cluster, client)
        self.fs = _TectonicFiles(self.client, ec)
        self.path = self.fs.init_path(path)
        self.commit = commit
        self.latest = latest or ""
        self.reserve = reserve
        self.reserve_ttl = reserve_ttl
        self._staging = ""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _TectonicFiles.validate_checkpoint_id(checkpoint_id)

    def _atomic(self) -> bool:
        return self.commit and self.use_collectives

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Atomic: only the step's parent is made here (the step itself appears at the
        commit), and an existing step is refused unless ``overwrite``."""
        if not self._atomic():
            return super().prepare_local_plan(plan)
        self.fs.mkdir(posixpath.dirname(os.fspath(self.path)))
        if not self.overwrite and self.fs.exists(self.path):
            raise RuntimeError(f"Checkpoint already exists and {self.overwrite=}.")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """On the coordinator: DCP's file prefixes, and this save's staging directory."""
        plans = super().prepare_global_plan(plans)
        if not self._atomic():
            self._reserve_for(plans, os.fspath(self.path))
            return plans
        self._staging = f"{self.path}{STAGING_MARK}{uuid.uuid4().hex[:16]}"
        self._reserve_for(plans, self._staging)
        return [
            dataclasses.replace(
                p, storage_data=_StagedPrefix(p.storage_data.prefix, staging=self._staging)
            )
            for p in plans
        ]

    def _reserve_for(self, plans: list[SavePlan], directory: str) -> None:
        """``reserve``: the save's size in the directory its files go to, before any rank
        writes (a save that is not atomic keeps it until its TTL: no commit ends it)."""
        if self.reserve is False:
            return
        size = plan_bytes(plans) if self.reserve is True else int(self.reserve)
        self.fs.mkdir(directory)
        self.client.run(_reserve, self.client, directory, size, self.reserve_ttl)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """DCP's writer, aimed at the staging directory when the plan names one (the
        write is done when this returns: the future is already set)."""
        staged = plan.storage_data
        if not isinstance(staged, _StagedPrefix) or not staged.staging:
            return super().write_data(plan, planner)
        self.fs.mkdir(staged.staging)
        final, self.path = self.path, staged.staging
        try:
            return super().write_data(plan, planner)
        finally:
            self.path = final

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Complete ``metadata`` as FileSystemWriter does (version, every item's storage
        info, the save's ids) and publish the step (``_publish``)."""
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
        metadata.storage_meta = self.storage_meta()
        if self.use_collectives or self.rank is None:
            name = METADATA_NAME
        else:
            name = f"__{self.rank}{METADATA_NAME}"
        self._publish(name, pickle.dumps(metadata))

    def _publish(self, name: str, blob: bytes) -> None:
        """Make the step loadable. Atomic: the metadata file into the staging directory,
        then the commit of the module docstring. Otherwise: the metadata file written whole
        under a temporary name and renamed over ``name`` (atomic in one directory, also
        over an older one). Every data file the metadata names is sealed by now."""
        if self._staging:
            with self.fs.create_stream(self.fs.concat_path(self._staging, name), "wb") as f:
                f.write(blob)
            staging, self._staging = self._staging, ""
            self.client.run(_commit, self.client, staging, self.path, self.latest, self.overwrite)
            return
        final = self.fs.concat_path(self.path, name)
        temp = f"{final}.tmp"
        with self.fs.create_stream(temp, "wb") as f:
            f.write(blob)
        self.fs.rename(temp, final)


class TectonicReader(FileSystemReader):
    """A DCP ``StorageReader`` from a tectonic cluster: ``path`` and ``cluster``/``client``
    as ``TectonicWriter``'s; reads only the byte ranges of the items a rank's plan needs."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        cluster: str | os.PathLike[str] | None = None,
        client: BlockingClient | None = None,
    ) -> None:
        super().__init__(checkpoint_path(path))
        self.client = _client(cluster, client)
        self.fs = _TectonicFiles(self.client)
        self.path = self.fs.init_path(path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _TectonicFiles.validate_checkpoint_id(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The pickled ``Metadata``, in one read. Unpickling trusts the checkpoint's writer,
        as DCP's own readers do."""
        path = os.fspath(self._get_metadata_path(kwargs.get("rank")))

        async def whole() -> bytes:
            reader = await self.client.client.open_read(path)
            try:
                return await reader.pread(0, reader.size)
            finally:
                await reader.aclose()

        metadata = cast(Metadata, pickle.loads(self.client.run(whole)))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Fetch the plan's ranges in batches (each file opened once), then load each item
        into the planner's tensors or bytes."""
        readers: dict[str, FileReader] = {}
        arena = bytearray()
        try:
            for batch in self._batches(plan.items):
                ranges = sorted({self._range(req) for req in batch})
                need = sum(length for _, _, length in ranges)
                if len(arena) < need:
                    arena = bytearray(need)
                blobs = self.client.run(self._fetch, ranges, readers, memoryview(arena))
                for req in batch:
                    self._load_item(req, blobs[self._range(req)], planner)
                del blobs
        finally:
            self.client.run(_close_readers, list(readers.values()))
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _range(self, req: ReadItem) -> tuple[str, int, int]:
        info = self.storage_data[req.storage_index]
        path = posixpath.join(os.fspath(self.path), info.relative_path)
        return (path, int(info.offset), int(info.length))

    def _batches(self, items: list[ReadItem]) -> Generator[list[ReadItem], None, None]:
        """The plan's items in file and offset order, cut into batches of at most
        ``READ_BATCH_BYTES`` (an item larger than that is a batch of its own)."""
        batch: list[ReadItem] = []
        size = 0
        for req in sorted(items, key=self._range):
            length = self._range(req)[2]
            if batch and size + length > READ_BATCH_BYTES:
                yield batch
                batch, size = [], 0
            batch.append(req)
            size += length
        if batch:
            yield batch

    async def _fetch(
        self,
        ranges: list[tuple[str, int, int]],
        readers: dict[str, FileReader],
        arena: memoryview,
    ) -> dict[tuple[str, int, int], memoryview]:
        """A batch's ranges, side by side in ``arena`` (one buffer for every batch of a
        load: fresh memory per batch cost more in page faults than the copies did), with
        the files' readers opened on first use and kept in ``readers`` for later batches."""
        blobs: dict[tuple[str, int, int], memoryview] = {}

        async def open_one(path: str) -> None:
            readers[path] = await self.client.client.open_read(path)

        async def fetch_piece(path: str, offset: int, into: memoryview) -> None:
            got = await readers[path].pread_into(offset, into)
            if got != into.nbytes:
                raise TectonicError(
                    f"{path}: {offset}+{into.nbytes} lies past its end ({got} read)"
                )

        paths = sorted({path for path, _, _ in ranges} - readers.keys())
        await _gather([functools.partial(open_one, p) for p in paths], OPEN_CONCURRENCY)
        pieces = []
        at = 0
        for key in ranges:
            path, offset, length = key
            blobs[key] = view = arena[at : at + length]
            at += length
            for piece in readers[path].layout.pieces(offset, length):
                into = view[piece.out_offset : piece.out_offset + piece.length]
                pieces.append(functools.partial(fetch_piece, path, offset + piece.out_offset, into))
        await _gather(pieces, READ_PIECES_IN_FLIGHT)
        return blobs

    def _load_item(self, req: ReadItem, blob: memoryview, planner: LoadPlanner) -> None:
        """One item, as FileSystemReader loads it: stream transforms, then bytes to the
        planner or a ``torch.load`` narrowed to the requested slice into its tensor."""
        info = self.storage_data[req.storage_index]
        stream = self.transforms.transform_load_stream(
            req, info.transform_descriptors or (), cast(IO[bytes], _ViewStream(blob))
        )
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(stream.read()))
            return
        seekable = stream if stream.seekable() else io.BytesIO(stream.read())
        tensor = torch.load(seekable, map_location="cpu", weights_only=True)
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise ValueError(
                f"item {req.storage_index}: stored size {tuple(tensor.size())}, "
                f"the plan expects {tuple(target.size())}"
            )
        target.copy_(tensor)
        planner.commit_tensor(req, target)


class _ViewStream(PositionedStream):
    """A seekable read stream over a memoryview without copying it (``io.BytesIO`` of a
    bytearray or view copies the whole item before torch.load copies it again)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view

    @property
    def _size(self) -> int:
        return self._view.nbytes

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        got = self._view[self._pos : self._pos + out.nbytes]
        out[: got.nbytes] = got
        self._pos += got.nbytes
        return got.nbytes


async def _close_readers(readers: list[FileReader]) -> None:
    for reader in readers:
        await reader.aclose()
