"""The FUSE mount: a pyfuse3 ``Operations`` class, a thin layer over the client library.

All logic of reads and writes lives in the client library (``tectonic_py.client``, as in
Tectonic); this module only translates kernel requests into client calls and keeps the
per-mount bookkeeping the kernel needs (``tectonic_py.mount.inode_cache``). Every handler goes
through ``tectonic_py.mount.errno_map.fuse_op``, the one place where domain errors become
errno.

Semantics, and why (docs/checkpoint-io.md has what each checkpoint writer asks):

* **One writer per inode.** Every handle that writes an inode shares one ``FileWriter``
  (a second would steal the writer token and fence the first off). Reads of an inode that has
  a writer in this mount go through the writer's ``pread`` (read-your-writes).
* **close is the durability point even without fsync.** torch.save, safetensors and numpy
  never call fsync, and the kernel ignores release's result and sends release *after*
  close(2) has returned. So ``flush`` (sent synchronously by every close(2)) makes all written
  bytes durable and committed with ``FileWriter.fsync`` and reports errors to close(2); it is
  skipped when nothing was written since the last fsync, so the several flushes of dup'd
  descriptors cost one round trip at most. The last ``release`` of a written inode seals the
  file (``FileWriter.close``). A reader that opens right after close(2) therefore sees every
  byte, even before the seal lands.
* **Never seal what may be incomplete.** The first write-path error of an inode is sticky:
  later writes, flushes and fsyncs fail with it, and release aborts the writer instead of
  sealing it. A mount killed mid-write leaves the file unsealed with its committed size,
  which a checkpoint reader rejects (a zip without its tail), never a short file that loads.
* **Unlinked files stay readable** while open: readers are opened at ``open``, the writer
  lives until the last release, and its seal hands the handles that read through it readers
  of its own block map; getattr of an inode whose record is gone answers from the attrs its
  handles hold (nlink 0).
* **getxattr is cheap.** The kernel asks for ``security.capability`` before every write once
  getxattr exists; only ``user.*`` names ever reach the metadata service. The EC policy of a
  file or directory is the xattr ``user.tectonic.ec`` (settable on directories: new files
  inherit it); a file's durability is ``user.tectonic.durability`` (read-only):
  ``writing`` (a writer holds its token), ``unsealed`` (no writer and no seal), and for a
  sealed file ``quorum``, ``full`` or ``degraded`` (tectonic_py/core/durability.py).
  Both are read and set by name and never listed, so copy tools leave them alone.
* **Symlinks and special files are metadata only** (the kernel follows links and keeps a
  FIFO's pipe); docs/posix.md has what the mount does of POSIX and what it does not.
* **An unsealed file whose writer is gone shows no read bits.** Its writer died or lost its
  mount before the seal, so its tail may be missing for good. ``ls -l`` shows it as
  ``--w-------`` rather than as a complete file, a program run by an ordinary user gets
  EACCES instead of loading it, and root (who bypasses modes) can still read what was
  committed. The stored mode is unchanged: a writer that rewrites and seals it shows it again.
* No ``direct_io`` (numpy memmap needs shared mmap) and no ``writeback_cache`` (it reorders
  and splits writes, see docs/checkpoint-io.md).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import pyfuse3
import trio

from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import (
    DanglingName,
    FileNotFound,
    FileSealed,
    InvalidArgument,
    QuotaExceeded,
    StaleWriterToken,
    TectonicError,
)
from tectonic_py.core.ids import ROOT_ID
from tectonic_py.core.records import (
    KIND_FILE,
    UNSEALED,
    Attrs,
)
from tectonic_py.mount import quota_xattrs
from tectonic_py.mount.dangling import DanglingNames, placeholder
from tectonic_py.mount.dir_listings import DEFAULT_NEGATIVE_TIMEOUT_S, DirListings
from tectonic_py.mount.errno_map import fuse_op
from tectonic_py.mount.inode_cache import Handle, InodeCache, OpenFile
from tectonic_py.mount.metrics import FuseMetrics
from tectonic_py.mount.namespace import S_IFMT_OF_KIND, NamespaceOps, fuse_name
from tectonic_py.mount.xattrs import XattrOps

if TYPE_CHECKING:
    from tectonic_py.client.tectonic_client import TectonicClient
    from tectonic_py.client.writer import FileWriter

log = logging.getLogger(__name__)

FALLOC_FL_KEEP_SIZE = 1

T = TypeVar("T")


# --- the Operations class -------------------------------------------------------------------

# st_blksize sets the buffer size of Python's io (and so the size of the read/write calls of
# torch.load's buffered reader): 128 KiB matches the kernel's FUSE read request size.
BLKSIZE = 128 * 1024
FRSIZE = 4096


class Operations(NamespaceOps, XattrOps, pyfuse3.Operations):
    """pyfuse3 handlers over a ``TectonicClient``.

    Inode numbers are metadata ids (the root directory is id 1, as FUSE's root inode).
    ``entry_timeout``/``attr_timeout`` bound how long the kernel trusts a name or attributes
    without asking: another mount's changes show within that time (close-to-open within
    this mount is exact, as sizes of written files come from the local writer).
    """

    supports_dot_lookup = False  # no ".." lookups: we keep no parent pointers
    # The FUSE layer's metrics (mount/metrics.py), counted by ``fuse_op``; None: off.
    fuse_metrics: FuseMetrics | None = None
    enable_writeback_cache = False
    enable_acl = False

    def __init__(
        self,
        client: TectonicClient,
        *,
        entry_timeout: float = 1.0,
        attr_timeout: float = 1.0,
        negative_timeout: float = DEFAULT_NEGATIVE_TIMEOUT_S,
        async_creates: bool = True,
    ) -> None:
        super().__init__()
        self.client = client
        self.meta = client.meta
        self.cache = InodeCache()
        self.dangling = DanglingNames()
        self.entry_timeout = entry_timeout
        self.attr_timeout = attr_timeout
        self.listings = DirListings(client.meta, client.nursery, timeout=negative_timeout)
        self.creates = client.creates
        self.async_creates = async_creates
        # Set once the kernel's INIT request is handled: settings of the mount's backing
        # device (read_ahead_kb) made before that are overwritten by the kernel.
        self.initialized = trio.Event()

    def init(self) -> None:
        self.initialized.set()

    # --- attributes -----------------------------------------------------------------------

    def _entry_taken(self, attrs: Attrs) -> pyfuse3.EntryAttributes:
        """The entry of a reply by which the kernel takes a reference to the inode (lookup,
        create, mkdir, ...): counted, so that forget can drop it."""
        entry = self._entry(attrs)
        self.cache.remember(attrs.id)
        return entry

    def _entry(self, attrs: Attrs) -> pyfuse3.EntryAttributes:
        ofile = self.cache.writing(attrs.id)
        size = ofile.writer.size if ofile is not None else attrs.size
        e = pyfuse3.EntryAttributes()
        e.st_ino = attrs.id
        e.generation = 0
        e.entry_timeout = self.entry_timeout
        e.attr_timeout = self.attr_timeout
        mode = attrs.mode & 0o7777
        if ofile is None and attrs.kind == KIND_FILE and attrs.seal_state == UNSEALED:
            mode &= ~0o444  # see the module docstring: not shown as a complete file
        e.st_mode = S_IFMT_OF_KIND[attrs.kind] | mode
        e.st_nlink = max(attrs.nlink, 2) if attrs.is_dir else attrs.nlink
        e.st_uid = attrs.uid
        e.st_gid = attrs.gid
        e.st_rdev = attrs.rdev
        e.st_size = size
        e.st_blksize = BLKSIZE
        # 512-byte units of the data stored: a sparse file's holes take none.
        stored = size if ofile is not None else attrs.stored
        e.st_blocks = -(-stored // 512)
        e.st_atime_ns = attrs.atime_ns
        e.st_mtime_ns = attrs.mtime_ns
        e.st_ctime_ns = attrs.ctime_ns
        return e

    async def _attrs(self, inode: int) -> Attrs:
        """Attributes of an inode; a file this mount writes needs no round trip. A file
        that lost its last name while open here keeps the attrs its handles hold (fstat of
        an open, unlinked file), with no link left."""
        ofile = self.cache.writing(inode)
        if ofile is not None and ofile.attrs is not None:
            return ofile.attrs
        held_dir = self.cache.dir_attrs(inode, self.attr_timeout)
        if held_dir is not None:
            return held_dir
        try:
            attrs: Attrs = await self.meta.getattr(inode)
        except FileNotFound as e:
            self.cache.forget_dir(inode)
            held = self._held_attrs(inode)
            if held is None:
                self.dangling.check(inode, e)
                raise
            return held
        if attrs.is_dir:
            self.cache.note_dir(attrs)
        return attrs

    def _held_attrs(self, inode: int) -> Attrs | None:
        ofile = self.cache.open_files.get(inode)
        if ofile is None:
            kept = self.cache.kept.get(inode)
            return None if kept is None else dataclasses.replace(kept.attrs, nlink=0)
        for fh in ofile.handles:
            reader = self.cache.handles[fh].reader
            if reader is not None:
                return dataclasses.replace(reader.attrs, nlink=0)
        if ofile.attrs is not None:
            return dataclasses.replace(ofile.attrs, nlink=0)
        return None

    @fuse_op
    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        if name == b".":
            attrs = await self._attrs(parent_inode)
        else:
            key = fuse_name(name)
            left = self.listings.absent_for(parent_inode, key)
            if left > 0:
                # A negative entry the kernel keeps while the listing is fresh: the
                # create that usually follows needs no second lookup.
                negative = pyfuse3.EntryAttributes()
                negative.st_ino = 0
                negative.entry_timeout = left
                return negative
            await self.creates.settle_name(parent_inode, key)
            try:
                attrs = await self.meta.lookup(parent_inode, key)
            except DanglingName as e:
                return self._dangling_taken(e)
            except FileNotFound:
                # What comes next is often a create of that name: have its ids at hand.
                self.listings.missed(parent_inode)
                if self.async_creates:
                    self.creates.prepare(parent_inode)
                raise
        return self._entry_taken(attrs)

    def _dangling_taken(self, error: DanglingName) -> pyfuse3.EntryAttributes:
        """A dangling name's placeholder entry (tectonic_py.mount.dangling), counted as any
        entry the kernel takes."""
        self.dangling.note(error)
        self.cache.remember(error.file_id)
        return placeholder(error)

    @fuse_op
    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for inode, count in inode_list:
            if self.cache.forget(inode, count):
                kept = self.cache.unkeep(inode)
                if kept is not None:
                    await _aclose_reader(kept)

    @fuse_op
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._entry(await self._attrs(inode))

    @fuse_op
    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        if fields.update_size:
            await self._truncate(inode, attr.st_size)
        changes: dict[str, int] = {}
        if fields.update_mode:
            changes["mode"] = attr.st_mode & 0o7777
        if fields.update_uid:
            changes["uid"] = attr.st_uid
        if fields.update_gid:
            changes["gid"] = attr.st_gid
        if fields.update_atime:
            changes["atime_ns"] = attr.st_atime_ns
        if fields.update_mtime:
            changes["mtime_ns"] = attr.st_mtime_ns
        if changes:
            attrs = await self._set_attrs(inode, changes)
            if attrs.is_dir:
                self.cache.note_dir(attrs)
        else:
            attrs = await self._attrs(inode)
        return self._entry(attrs)

    async def _set_attrs(self, inode: int, changes: dict[str, int]) -> Attrs:
        """chmod, chown, utimes. With a writer open here the change is made under the
        writer's lock, so it lands either before a flush or seal (which then puts the times
        back) or after it, never in the middle where the flush's stamp would undo it."""
        await self.creates.settle_file(inode)
        ofile = self.cache.open_files.get(inode)
        if ofile is None or (ofile.writer is None and not ofile.lock.locked()):
            return await self.meta.setattr(inode, **changes)
        async with ofile.lock:
            attrs = await self.meta.setattr(inode, **changes)
            if ofile.writer is not None:
                ofile.attrs = attrs
                ofile.times.update(
                    {k: v for k, v in changes.items() if k in ("atime_ns", "mtime_ns")}
                )
        return attrs

    async def _truncate(self, inode: int, size: int) -> None:
        """ftruncate: grow sparse or cut (truncate(1) on a path, or O_TRUNC on a kernel
        without atomic_o_trunc)."""
        if size < 0:
            raise InvalidArgument(f"negative size {size}")
        await self._change(inode, lambda w: w.truncate(size), fresh=size == 0, times_changed=True)

    async def fallocate_inode(self, inode: int, keep_size: bool, offset: int, length: int) -> None:
        """fallocate(2) of modes 0 and KEEP_SIZE on a file (client/writer.py's
        ``fallocate``; the ``tectonic.fallocate`` attribute: pyfuse3 3.5 passes no fallocate
        call on)."""
        await self._change(inode, lambda w: w.fallocate(offset, length, keep_size=keep_size))

    async def _change(
        self,
        inode: int,
        change: Callable[[FileWriter], Awaitable[None]],
        *,
        fresh: bool = False,
        times_changed: bool = False,
    ) -> None:
        """A change of a file's bytes outside write(): through the writer a handle holds, or
        a writer of its own, sealed at once (``fresh``: opened truncated, which is the whole
        change)."""
        ofile = self.cache.open_file(inode)
        try:
            async with ofile.lock:
                if ofile.error is not None:
                    raise ofile.error
                if ofile.writer is not None:
                    await self._guard(ofile, change(ofile.writer))
                    ofile.write_seq += 1
                    if times_changed:
                        ofile.times.clear()
                    return
                writer = await self.client.open_writer(inode, truncate=fresh)
                try:
                    if not fresh:
                        await change(writer)
                    await writer.close()
                except BaseException:
                    with trio.CancelScope(shield=True):
                        await _abort(writer)
                    raise
        finally:
            self.cache.drop_if_idle(ofile)

    @fuse_op
    async def fallocate(self, fh: int, mode: int, offset: int, length: int) -> None:
        """The handler fallocate(2) would reach if pyfuse3 dispatched it (3.5 does not):
        mode 0 and FALLOC_FL_KEEP_SIZE; every other mode is EOPNOTSUPP."""
        if mode not in (0, FALLOC_FL_KEEP_SIZE):
            raise pyfuse3.FUSEError(errno.EOPNOTSUPP)
        handle = self._handle(fh)
        if not handle.writable:
            raise pyfuse3.FUSEError(errno.EBADF)
        await self.fallocate_inode(handle.ofile.inode, mode == FALLOC_FL_KEEP_SIZE, offset, length)

    # --- files ----------------------------------------------------------------------------

    @fuse_op
    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: pyfuse3.RequestContext
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        key = fuse_name(name)
        started = None
        if (
            self.async_creates
            and flags & os.O_TRUNC
            and not flags & os.O_EXCL
            and self.listings.absent(parent_inode, key)
        ):
            started = await self.client.create_pending(
                parent_inode, key, mode=mode & 0o7777, uid=ctx.uid, gid=ctx.gid
            )
        if started is not None:
            writer = started[0]
        else:
            writer = await self.client.create_in(
                parent_inode,
                key,
                mode=mode & 0o7777,
                uid=ctx.uid,
                gid=ctx.gid,
                exclusive=bool(flags & os.O_EXCL),
                ec=None,
            )
        self.listings.added(parent_inode, key)
        self.cache.dir_changed(parent_inode)
        attrs = writer.attrs
        ofile = self.cache.open_file(attrs.id)
        if ofile.writer is not None:
            # Only an O_CREAT without O_EXCL racing with an open of the same new name gets
            # here: the new writer has taken the token, so the old one is fenced anyway.
            log.warning("create of %r replaced the open writer of inode %d", name, attrs.id)
            await _abort(ofile.writer)
        ofile.writer, ofile.attrs, ofile.error = writer, attrs, None
        # A create answered before it was sent is not yet durable: the first flush (every
        # close) waits for it, even with nothing written.
        ofile.write_seq, ofile.synced_seq = (1 if started is not None else 0), 0
        # A handle that holds a writer reference is writable whatever its flags say, so
        # that its release seals the new file.
        handle = self.cache.add_handle(
            ofile, readable=(flags & os.O_ACCMODE) != os.O_WRONLY, writable=True
        )
        return pyfuse3.FileInfo(fh=handle.fh), self._entry_taken(attrs)

    @fuse_op
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        acc = flags & os.O_ACCMODE
        writable = acc in (os.O_WRONLY, os.O_RDWR)
        readable = acc in (os.O_RDONLY, os.O_RDWR)
        truncate = writable and bool(flags & os.O_TRUNC)
        await self.creates.settle_file(inode)
        ofile = self.cache.open_file(inode)
        reader = None
        try:
            if writable:
                async with ofile.lock:
                    if ofile.writer is None:
                        writer = await self.client.open_writer(inode, truncate=truncate)
                        ofile.writer, ofile.attrs, ofile.error = writer, writer.attrs, None
                        ofile.write_seq = ofile.synced_seq = 0
                    elif truncate:
                        if ofile.error is not None:
                            raise ofile.error
                        await self._guard(ofile, ofile.writer.truncate(0))
                        ofile.write_seq += 1
            elif readable:
                if ofile.closing:
                    async with ofile.lock:  # wait for the seal of the last writer
                        pass
                if ofile.writer is None:
                    reader = await self._open_reader(inode)
        except FileNotFound as e:
            self.cache.drop_if_idle(ofile)
            self.dangling.check(inode, e)
            raise
        except BaseException:
            self.cache.drop_if_idle(ofile)
            raise
        handle = self.cache.add_handle(ofile, readable=readable, writable=writable)
        handle.reader = reader
        return pyfuse3.FileInfo(fh=handle.fh)

    async def _open_reader(self, inode: int) -> Any:
        """A reader of the inode; of a replaced file the kernel still holds, a copy of the
        reader kept at the rename (inode_cache: the open gets the old file, as on a local
        filesystem)."""
        try:
            return await self.client.open_reader(inode)
        except FileNotFound:
            kept = self.cache.kept.get(inode)
            if kept is None:
                raise
            return self.client.reader_like(kept)

    async def _guard(self, ofile: OpenFile, call: Awaitable[T]) -> T:
        """Run a write-path call; its first failure becomes the inode's sticky error.

        A writer here holds a writer token, so a file found sealed under it was taken by
        another writer (or by lease recovery) and closed: fenced, as when the other writer is
        still writing. Both answer ESTALE, the errno NFS gives a handle that went stale, and
        not EPERM, which would send the user looking at file permissions.
        """
        try:
            try:
                return await call
            except FileSealed as e:
                raise StaleWriterToken(f"{e}: another writer took and closed it") from e
        except QuotaExceeded:
            raise  # refused before a byte was taken: the file and its writer are whole
        except Exception as e:
            if ofile.error is None:
                ofile.error = e
                log.error(
                    "inode %d: write path failed (%s: %s); the file will not be sealed",
                    ofile.inode,
                    type(e).__name__,
                    e,
                )
            raise

    @fuse_op
    async def read(  # type: ignore[override]  # pyfuse3 takes any buffer, not only bytes
        self, fh: int, off: int, size: int
    ) -> bytes | bytearray | memoryview:
        # pyfuse3 copies the returned buffer into the kernel before anything else runs, so
        # a view of the reader's cached block is safe and saves a copy (FileReader.pread_view).
        handle = self._handle(fh)
        ofile = handle.ofile
        writer = ofile.writer
        if writer is not None and not ofile.closing:
            return await writer.pread(off, size)
        if handle.reader is None or ofile.closing:
            # The last writer may be sealing right now: after its seal this handle reads
            # what it sealed (``_hand_over``), not a block map from before its patches.
            async with ofile.lock:
                if ofile.writer is not None:
                    return await ofile.writer.pread(off, size)
                if handle.reader is None:
                    handle.reader = await self._open_reader(ofile.inode)
        return await handle.reader.pread_view(off, size)

    @fuse_op
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        handle = self._handle(fh)
        ofile = handle.ofile
        async with ofile.lock:
            if ofile.error is not None:
                raise ofile.error
            writer = ofile.writer
            if writer is None or not handle.writable:
                raise pyfuse3.FUSEError(errno.EBADF)
            if off == writer.size:
                await self._guard(ofile, writer.write(buf))  # the append fast path
            else:
                await self._guard(ofile, writer.pwrite(buf, off))
            ofile.write_seq += 1
            ofile.times.clear()
        return len(buf)

    async def _sync(self, handle: Handle, *, always: bool) -> None:
        ofile = handle.ofile
        if ofile.error is not None:
            raise ofile.error
        writer = ofile.writer
        if writer is None or ofile.closing:
            return
        seq = ofile.write_seq
        if seq == ofile.synced_seq and not always:
            return
        await self._guard(ofile, writer.fsync())
        ofile.synced_seq = max(ofile.synced_seq, seq)
        ofile.attrs = writer.attrs  # the times the durability point stamped
        await self._reapply_times(ofile)

    async def _reapply_times(self, ofile: OpenFile) -> None:
        """Put back times the program set (the commit just stamped mtime with "now")."""
        if ofile.times:
            ofile.attrs = await self.meta.setattr(ofile.inode, **ofile.times)

    @fuse_op
    async def flush(self, fh: int) -> None:
        handle = self._handle(fh)
        if handle.writable:
            await self._sync(handle, always=False)

    @fuse_op
    async def fsync(self, fh: int, datasync: bool) -> None:
        await self._sync(self._handle(fh), always=True)

    @fuse_op
    async def release(self, fh: int) -> None:
        handle, last_writer, _ = self.cache.remove_handle(fh)
        ofile = handle.ofile
        try:
            if last_writer and ofile.writer is not None:
                async with ofile.lock:
                    # An open for writing that held the lock may have joined the writer
                    # meanwhile (it adds its handle without a checkpoint after the lock).
                    if ofile.write_handles == 0 and ofile.writer is not None:
                        await self._seal(ofile)
        finally:
            if handle.reader is not None:
                with trio.CancelScope(shield=True):
                    await _aclose_reader(handle.reader)
            self.cache.drop_if_idle(ofile)

    async def _seal(self, ofile: OpenFile) -> None:
        """Seal the inode's writer after its last writable handle is gone (or abort it if
        a write failed: a sealed file must never be missing data). The kernel ignores
        release's result, so failures are logged, loudly, and the file stays unsealed."""
        writer = ofile.writer
        ofile.closing = True
        try:
            if ofile.error is not None:
                log.error(
                    "inode %d: not sealed after a failed write (%s); it stays incomplete",
                    ofile.inode,
                    ofile.error,
                )
                await _abort(writer)
                return
            try:
                with trio.CancelScope(shield=True):
                    ofile.attrs = await writer.close()
                    self._hand_over(ofile, writer)
                    await self._reapply_times(ofile)
            except FileNotFound:
                log.debug("inode %d was removed before its seal", ofile.inode)
            except TectonicError as e:
                log.error(
                    "inode %d: seal failed (%s: %s); the file stays unsealed",
                    ofile.inode,
                    type(e).__name__,
                    e,
                )
        finally:
            ofile.writer = None
            ofile.closing = False
            ofile.error = None
            ofile.times.clear()

    def _hand_over(self, ofile: OpenFile, writer: Any) -> None:
        """Every readable handle of the inode gets a reader of what the writer sealed, made
        from its own block map: handles that read through the writer keep reading after the
        file loses its last name, even one that went before the seal (an open right after a
        writer's close(2), whose release came later); and a reader opened before the writer
        sees its writes, as on a local file system (a patch leaves the block it read as it
        was: client/patches.py)."""
        for fh in ofile.handles:
            handle = self.cache.handles[fh]
            if handle.readable:
                handle.reader = self.client.reader_of(writer)

    def _handle(self, fh: int) -> Handle:
        try:
            return self.cache.handle(fh)
        except KeyError:
            raise pyfuse3.FUSEError(errno.EBADF) from None

    @fuse_op
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        """Real capacity from the node registry, as usable bytes under the cluster's
        default EC policy (raw bytes * k / n), so that df shows what fits; when the root
        has a quota, its limits and what is left of them (as CephFS's df of a quota)."""
        stats = await self.meta.statfs()
        policy = ECPolicy.parse(self.client.config.default_ec)
        usable = int(stats.get("capacity", 0)) * policy.k // policy.n
        free = int(stats.get("free", 0)) * policy.k // policy.n
        files, ffree = int(stats.get("files", 0)) + 2**32, 2**32
        if (await self._attrs(ROOT_ID)).realm == ROOT_ID:
            try:
                limits = quota_xattrs.statfs_limits(await self.meta.get_quota(ROOT_ID), free)
            except FileNotFound:
                limits = (0, -1, 0, -1)  # removed since the attributes were read
            if limits[0]:
                usable, free = limits[0], limits[1]
            if limits[2]:
                files, ffree = limits[2], limits[3]
        s = pyfuse3.StatvfsData()
        s.f_bsize = BLKSIZE
        s.f_frsize = FRSIZE
        s.f_blocks = usable // FRSIZE
        s.f_bfree = free // FRSIZE
        s.f_bavail = free // FRSIZE
        s.f_files = files
        s.f_ffree = ffree
        s.f_favail = ffree
        s.f_namemax = 255
        return s

    # --- shutdown ---------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """After the main loop ends: abort writers still open (never seal them: their
        program did not close them, so they may be incomplete) and close readers."""
        c = self.creates
        log.info(
            "creates: %d answered at once (%d failed at their shard), %d waited for ids; "
            "%d lookups answered absent from %d listings read",
            c.started,
            c.failed,
            c.dry,
            self.listings.hits,
            self.listings.reads,
        )
        with trio.CancelScope(shield=True):
            for ofile in list(self.cache.open_files.values()):
                if ofile.writer is not None:
                    log.warning(
                        "inode %d still open for writing at unmount: left unsealed", ofile.inode
                    )
                    await _abort(ofile.writer)
                    ofile.writer = None
            for handle in list(self.cache.handles.values()):
                if handle.reader is not None:
                    await _aclose_reader(handle.reader)
                    handle.reader = None


async def _abort(writer: Any) -> None:
    try:
        await writer.abort()
    except TectonicError as e:
        log.warning("aborting writer of file %s failed: %s", getattr(writer, "file_id", "?"), e)


async def _aclose_reader(reader: Any) -> None:
    try:
        await reader.aclose()
    except TectonicError as e:
        log.warning("closing reader of file %s failed: %s", getattr(reader, "file_id", "?"), e)
