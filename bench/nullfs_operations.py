"""nullfs's filesystem: an in-memory namespace whose file contents are discarded.

Its own module because it imports pyfuse3 at the top, and ``bench.nullfs`` must import
without it (the test suite imports the mount helpers on machines without FUSE). It runs only
in the mount's own process, started by ``bench.nullfs.serve``.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from dataclasses import dataclass, field
from typing import Any

import pyfuse3

MiB = 1024 * 1024


@dataclass
class Node:
    """A file or a directory (``children`` is None for a file); a file keeps only its size."""

    inode: int
    mode: int
    size: int = 0
    nlink: int = 1
    mtime_ns: int = field(default_factory=time.time_ns)
    children: dict[bytes, int] | None = None


class NullOperations(pyfuse3.Operations):  # type: ignore[misc]
    """In-memory namespace; contents discarded on write and zeros on read."""

    supports_dot_lookup = False
    enable_writeback_cache = False

    def __init__(self) -> None:
        super().__init__()
        root = Node(pyfuse3.ROOT_INODE, stat.S_IFDIR | 0o755, nlink=2, children={})
        self.nodes: dict[int, Node] = {root.inode: root}
        self.next_inode = pyfuse3.ROOT_INODE + 1
        self.zeros: dict[int, bytes] = {}
        self.bytes_written = 0
        self.bytes_read = 0
        self.writes = 0
        self.reads = 0

    # helpers
    def _node(self, inode: int) -> Node:
        node = self.nodes.get(inode)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return node

    def _dir(self, inode: int) -> Node:
        node = self._node(inode)
        if node.children is None:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return node

    def _attr(self, node: Node) -> Any:
        a = pyfuse3.EntryAttributes()
        a.st_ino = node.inode
        a.st_mode = node.mode
        a.st_nlink = node.nlink
        a.st_size = node.size
        a.st_uid = os.getuid()
        a.st_gid = os.getgid()
        a.st_blksize = MiB
        a.st_blocks = -(-node.size // 512)
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = node.mtime_ns
        a.entry_timeout = a.attr_timeout = 300
        return a

    def _new(self, parent: int, name: bytes, mode: int) -> Node:
        pdir = self._dir(parent)
        assert pdir.children is not None
        if name in pdir.children:
            raise pyfuse3.FUSEError(errno.EEXIST)
        node = Node(self.next_inode, mode)
        self.next_inode += 1
        if stat.S_ISDIR(mode):
            node.children, node.nlink = {}, 2
        self.nodes[node.inode] = node
        pdir.children[name] = node.inode
        pdir.mtime_ns = time.time_ns()
        return node

    # lookups and attributes
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> Any:
        pdir = self._dir(parent_inode)
        assert pdir.children is not None
        if name == b".":
            return self._attr(pdir)
        inode = pdir.children.get(name)
        if inode is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(self.nodes[inode])

    async def getattr(self, inode: int, ctx: Any = None) -> Any:
        return self._attr(self._node(inode))

    async def setattr(self, inode: int, attr: Any, fields: Any, fh: Any, ctx: Any) -> Any:
        node = self._node(inode)
        if fields.update_size:
            node.size = attr.st_size
        if fields.update_mode:
            node.mode = stat.S_IFMT(node.mode) | stat.S_IMODE(attr.st_mode)
        if fields.update_mtime:
            node.mtime_ns = attr.st_mtime_ns
        return self._attr(node)

    async def statfs(self, ctx: Any) -> Any:
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = s.f_bfree = s.f_bavail = 2**40 // 4096
        s.f_files = s.f_ffree = s.f_favail = 2**32
        s.f_namemax = 255
        return s

    async def forget(self, inode_list: Any) -> None:
        return None

    # directories
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any) -> Any:
        return self._attr(self._new(parent_inode, name, stat.S_IFDIR | stat.S_IMODE(mode)))

    async def opendir(self, inode: int, ctx: Any) -> int:
        self._dir(inode)
        return inode

    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        node = self._dir(fh)
        assert node.children is not None
        entries = sorted(node.children.items())
        for i, (name, inode) in enumerate(entries[start_id:], start_id + 1):
            if not pyfuse3.readdir_reply(token, name, self._attr(self.nodes[inode]), i):
                break

    async def releasedir(self, fh: int) -> None:
        return None

    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        return None

    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        pdir = self._dir(parent_inode)
        assert pdir.children is not None
        inode = pdir.children.get(name)
        if inode is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        node = self._dir(inode)
        if node.children:
            raise pyfuse3.FUSEError(errno.ENOTEMPTY)
        del pdir.children[name]
        del self.nodes[inode]

    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        pdir = self._dir(parent_inode)
        assert pdir.children is not None
        inode = pdir.children.get(name)
        if inode is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if self.nodes[inode].children is not None:
            raise pyfuse3.FUSEError(errno.EISDIR)
        del pdir.children[name]
        del self.nodes[inode]

    async def rename(
        self, p_old: int, name_old: bytes, p_new: int, name_new: bytes, flags: int, ctx: Any
    ) -> None:
        src, dst = self._dir(p_old), self._dir(p_new)
        assert src.children is not None and dst.children is not None
        inode = src.children.get(name_old)
        if inode is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        old = dst.children.get(name_new)
        if old is not None and old != inode:
            victim = self.nodes[old]
            if victim.children:
                raise pyfuse3.FUSEError(errno.ENOTEMPTY)
            del self.nodes[old]
        del src.children[name_old]
        dst.children[name_new] = inode

    # files
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Any) -> Any:
        node = self._new(parent_inode, name, stat.S_IFREG | stat.S_IMODE(mode))
        return pyfuse3.FileInfo(fh=node.inode, keep_cache=False), self._attr(node)

    async def open(self, inode: int, flags: int, ctx: Any) -> Any:
        node = self._node(inode)
        if node.children is not None:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if flags & os.O_TRUNC:
            node.size = 0
        # keep_cache off: every open drops the file's pages, so a read after a write
        # reaches the daemon (a ceiling measured from the page cache would be a lie).
        return pyfuse3.FileInfo(fh=inode, keep_cache=False)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        node = self.nodes.get(fh)
        n = 0 if node is None else max(0, min(size, node.size - off))
        self.reads += 1
        self.bytes_read += n
        z = self.zeros.get(n)
        if z is None:
            z = self.zeros[n] = bytes(n)
        return z

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        node = self.nodes.get(fh)
        if node is not None and off + len(buf) > node.size:
            node.size = off + len(buf)
        self.writes += 1
        self.bytes_written += len(buf)
        return len(buf)

    async def flush(self, fh: int) -> None:
        return None

    async def fsync(self, fh: int, datasync: bool) -> None:
        return None

    async def release(self, fh: int) -> None:
        return None
