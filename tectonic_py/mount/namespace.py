"""The namespace handlers of the FUSE mount (a mixin of ``Operations``): names made, removed,
moved and listed.

Each change of a name keeps two things of this mount current at once: its listings
(``tectonic_py.mount.dir_listings``: a lookup never answers absent for a name this mount
made) and the order against its creates in flight (``tectonic_py.client.async_creates``):
an unlink, rename or listing of a name waits until this mount's create of it has landed,
so a later operation never reaches the shard before an earlier one.
"""

from __future__ import annotations

import dataclasses
import errno
import stat
from typing import Any

import pyfuse3
import trio

from tectonic_py.core.errors import (
    DanglingName,
    FileExists,
    FileNotFound,
    InvalidArgument,
    InvalidName,
    TectonicError,
)
from tectonic_py.core.ids import ROOT_ID
from tectonic_py.core.records import (
    KIND_BLK,
    KIND_CHR,
    KIND_DIR,
    KIND_FIFO,
    KIND_FILE,
    KIND_SOCK,
    KIND_SYMLINK,
    Attrs,
    DirEntry,
)
from tectonic_py.mount.dangling import DanglingNames, placeholder
from tectonic_py.mount.errno_map import fuse_op
from tectonic_py.mount.inode_cache import DirHandle, InodeCache

S_IFMT_OF_KIND = {
    KIND_FILE: stat.S_IFREG,
    KIND_DIR: stat.S_IFDIR,
    KIND_SYMLINK: stat.S_IFLNK,
    KIND_FIFO: stat.S_IFIFO,
    KIND_SOCK: stat.S_IFSOCK,
    KIND_CHR: stat.S_IFCHR,
    KIND_BLK: stat.S_IFBLK,
}
KIND_OF_IFMT = {v: k for k, v in S_IFMT_OF_KIND.items()}
DOTDOT_OFFSET = 2  # readdir offsets: 1 is ".", 2 is "..", entries from 3 (DirHandle)
READDIR_PAGE = 64  # entries per metadata page; the kernel's buffer holds roughly this many
ATTR_FETCH_LIMIT = 32  # concurrent getattr calls per readdir page


def fuse_name(raw: bytes) -> str:
    """A FUSE name as the metadata service spells it (UTF-8, at most 255 bytes)."""
    if len(raw) > 255:
        raise pyfuse3.FUSEError(errno.ENAMETOOLONG)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidName(f"name {raw!r} is not UTF-8") from None


def dir_entry(inode: int) -> pyfuse3.EntryAttributes:
    e = pyfuse3.EntryAttributes()
    e.st_ino = inode
    e.st_mode = stat.S_IFDIR
    return e


class NamespaceOps:
    """mkdir, symlink, mknod, link, rmdir, unlink, rename and readdir over the client."""

    meta: Any
    client: Any
    cache: InodeCache
    creates: Any  # the client's AsyncCreates
    listings: Any  # DirListings
    dangling: DanglingNames

    def _entry_taken(self, attrs: Attrs) -> pyfuse3.EntryAttributes:
        raise NotImplementedError

    def _entry(self, attrs: Attrs) -> pyfuse3.EntryAttributes:
        raise NotImplementedError

    async def _attrs(self, inode: int) -> Attrs:
        raise NotImplementedError

    @fuse_op
    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        key = fuse_name(name)
        attrs = await self.meta.mkdir(
            parent_inode, key, mode=mode & 0o7777, uid=ctx.uid, gid=ctx.gid
        )
        self.listings.added(parent_inode, key)
        self.cache.dir_changed(parent_inode, links=1)
        return self._entry_taken(attrs)

    @fuse_op
    async def symlink(
        self, parent_inode: int, name: bytes, target: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        key = fuse_name(name)
        attrs = await self.meta.symlink(parent_inode, key, bytes(target), uid=ctx.uid, gid=ctx.gid)
        self.listings.added(parent_inode, key)
        self.cache.dir_changed(parent_inode)
        return self._entry_taken(attrs)

    @fuse_op
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        return await self.meta.readlink(inode)

    @fuse_op
    async def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        """Special files are metadata only (a FIFO or socket here is a name; the kernel
        keeps the pipe); a regular file is created empty and sealed."""
        kind = KIND_OF_IFMT.get(stat.S_IFMT(mode) or stat.S_IFREG)
        if kind is None or kind in (KIND_DIR, KIND_SYMLINK):
            raise InvalidArgument(f"mknod of mode {mode:o}")
        if kind == KIND_FILE:
            writer = await self.client.create_in(
                parent_inode,
                fuse_name(name),
                mode=mode & 0o7777,
                uid=ctx.uid,
                gid=ctx.gid,
                exclusive=True,
            )
            attrs = await writer.close()
        else:
            attrs = await self.meta.mknod(
                parent_inode,
                fuse_name(name),
                kind,
                mode=mode & 0o7777,
                rdev=rdev if kind in (KIND_CHR, KIND_BLK) else 0,
                uid=ctx.uid,
                gid=ctx.gid,
            )
        self.listings.added(parent_inode, fuse_name(name))
        self.cache.dir_changed(parent_inode)
        return self._entry_taken(attrs)

    @fuse_op
    async def link(
        self, inode: int, new_parent_inode: int, new_name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        await self.creates.settle_file(inode)
        attrs = await self.meta.link(inode, new_parent_inode, fuse_name(new_name))
        self.listings.added(new_parent_inode, fuse_name(new_name))
        self.cache.dir_changed(new_parent_inode)
        ofile = self.cache.writing(inode)
        if ofile is not None and ofile.attrs is not None:
            ofile.attrs.nlink = attrs.nlink
        return self._entry_taken(attrs)

    @fuse_op
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        # The directory's emptiness is judged at its shard: this mount's creates in flight
        # (in it or anywhere) land first.
        await self.creates.settle_all()
        key = fuse_name(name)
        await self.meta.rmdir(parent_inode, key)
        self.listings.removed(parent_inode, key)
        self.cache.dir_changed(parent_inode, links=-1)

    @fuse_op
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        # Open handles keep their FileReader/FileWriter, so the data stays readable until
        # the last release; the metadata service collects the blocks after a grace period.
        key = fuse_name(name)
        await self.creates.settle_name(parent_inode, key)
        file_id = await self.meta.unlink(parent_inode, key)
        self.listings.removed(parent_inode, key)
        self.cache.dir_changed(parent_inode)
        self.dangling.removed(file_id)
        ofile = self.cache.writing(file_id)
        if ofile is not None and ofile.attrs is not None:  # fstat of our writer's handles
            ofile.attrs = dataclasses.replace(ofile.attrs, nlink=max(ofile.attrs.nlink - 1, 0))

    @fuse_op
    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: pyfuse3.RequestContext,
    ) -> None:
        old, new = fuse_name(name_old), fuse_name(name_new)
        await self.creates.settle_name(parent_inode_old, old)
        await self.creates.settle_name(parent_inode_new, new)
        if flags & pyfuse3.RENAME_EXCHANGE:
            raise InvalidArgument("RENAME_EXCHANGE is not supported")
        if flags & pyfuse3.RENAME_NOREPLACE:
            # Not atomic against a concurrent create of the target by another mount; within
            # this mount the kernel holds the directory locks across the whole call.
            try:
                await self.meta.lookup(parent_inode_new, new)
            except FileNotFound:
                pass
            else:
                raise FileExists(f"{new!r} exists")
            replaced = None
        else:
            replaced = await self._reader_of_replaced(parent_inode_new, new)
        if replaced is not None:
            # Kept before the rename is sent: an OPEN of the old inode may be handled while
            # the rename is in flight, once its shard has freed the record.
            extra = self.cache.keep(replaced.file_id, replaced)
            if extra is not None:
                await extra.aclose()
        await self.meta.rename(parent_inode_old, old, parent_inode_new, new)
        self.listings.removed(parent_inode_old, old)
        self.listings.added(parent_inode_new, new)
        self.cache.forget_dir(parent_inode_old)  # link counts may move: read them afresh
        self.cache.forget_dir(parent_inode_new)

    async def _reader_of_replaced(self, dir_id: int, name: str) -> Any:
        """A reader of the file a rename is about to replace, if the kernel holds its inode
        (it may send OPEN for it after the rename: inode_cache's "replaced files"), else
        None. Costs a lookup and a block list per rename over a held file."""
        if self.listings.absent(dir_id, name):
            return None
        try:
            victim = await self.meta.lookup(dir_id, name)
        except (FileNotFound, DanglingName):
            return None
        if (
            victim.kind != KIND_FILE
            or victim.nlink > 1  # another name keeps the record
            or not self.cache.lookup_count(victim.id)
        ):
            return None
        try:
            return await self.client.reader_at(victim)
        except FileNotFound:
            return None

    @fuse_op
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        return self.cache.open_dir(inode).fh

    @fuse_op
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        try:
            dh = self.cache.dir_handle(fh)
        except KeyError:
            raise pyfuse3.FUSEError(errno.EBADF) from None
        if start_id < DOTDOT_OFFSET:
            await self.creates.settle_dir(dh.inode)  # this mount's new files are listed
            if not await self._reply_dots(dh, start_id, token):
                return
            after: str | None = ""
        else:
            after = dh.cursors.get(start_id)
            if after is None:
                raise InvalidArgument(f"readdir offset {start_id} was never handed out")
        while True:
            entries, cursor = await self.meta.readdir(dh.inode, after, READDIR_PAGE)
            self.listings.seen(dh.inode, [e.name for e in entries])
            attrs = await self._attrs_of(dh.inode, entries)
            for entry in entries:
                a = attrs.get(entry.id)
                if a is None:
                    continue  # removed since the page was read
                offset = dh.next_offset
                dh.next_offset += 1
                dh.cursors[offset] = entry.name
                reply = placeholder(a) if isinstance(a, DanglingName) else self._entry(a)
                if not pyfuse3.readdir_reply(token, entry.name.encode("utf-8"), reply, offset):
                    return
                self.cache.remember(entry.id)  # the kernel took a reference (readdirplus)
            if cursor is None or not entries:
                return
            after = cursor

    async def _reply_dots(self, dh: DirHandle, start_id: int, token: pyfuse3.ReaddirToken) -> bool:
        """``.`` and ``..`` first (offsets 1 and 2), as programs that count entries expect.
        The kernel links neither into its cache and takes no reference for them, so only
        their inode number and type matter (no attribute round trip)."""
        if start_id == 0 and not pyfuse3.readdir_reply(token, b".", dir_entry(dh.inode), 1):
            return False
        parent = dh.inode if dh.inode == ROOT_ID else await self.meta.parent(dh.inode)
        dh.cursors[DOTDOT_OFFSET] = ""  # resuming after ".." starts at the first entry
        return bool(pyfuse3.readdir_reply(token, b"..", dir_entry(parent), DOTDOT_OFFSET))

    async def _attrs_of(
        self, dir_id: int, entries: list[DirEntry]
    ) -> dict[int, Attrs | DanglingName]:
        """Attributes of a readdir page, fetched concurrently. Vanished entries are left out;
        one whose record is gone or unreadable is listed as dangling (its own stat answers
        EIO), never failing the listing."""
        out: dict[int, Attrs | DanglingName] = {}
        limiter = trio.CapacityLimiter(ATTR_FETCH_LIMIT)

        async def one(entry: DirEntry) -> None:
            async with limiter:
                try:
                    out[entry.id] = await self._attrs(entry.id)
                except FileNotFound:
                    await confirm(entry)
                except TectonicError as e:  # an unreadable record fails alone
                    unreadable = DanglingName(
                        f"{entry.name!r} in directory {dir_id}: record {entry.id} cannot be"
                        f" read ({type(e).__name__}: {e})",
                        file_id=entry.id,
                        kind=entry.kind,
                    )
                    self.dangling.note(unreadable)
                    out[entry.id] = unreadable

        async def confirm(entry: DirEntry) -> None:
            """Removed since the page was read (left out), or dangling (listed)."""
            try:
                found = await self.meta.lookup(dir_id, entry.name)
            except FileNotFound:
                return
            except DanglingName as e:
                self.dangling.note(e)
                out[entry.id] = e
                return
            if found.id == entry.id:
                out[entry.id] = found

        async with trio.open_nursery() as nursery:
            for entry in entries:
                nursery.start_soon(one, entry)
        return out

    @fuse_op
    async def releasedir(self, fh: int) -> None:
        self.cache.close_dir(fh)
