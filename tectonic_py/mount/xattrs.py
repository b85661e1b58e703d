"""Extended attributes of the mount: ``user.*`` stored in the File layer, and the mount's own.

The quota, reservation and fallocate attributes (``tectonic.quota.*``, ``tectonic.reserve``,
``tectonic.fallocate``) are tectonic_py/mount/quota_xattrs.py's.

``user.tectonic.ec`` is a file's EC policy (on a directory: the policy new files inherit,
settable there); ``user.tectonic.durability`` is a file's durability (read-only). Both are
read and set by name and never listed: listed, cp --preserve=xattr and rsync -X would copy a
status and a policy that the destination's directory decides, and rsync would remove them
from a copy whose source lacks them. Setting a file's policy to the one it has succeeds
(what a copy of the xattrs asks).

getxattr is on a hot path: the kernel asks for ``security.capability`` before every write
once getxattr exists, so only ``user.*`` names ever reach the metadata service.
"""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING, Any

import pyfuse3

from tectonic_py.core.ec_policy import ECPolicy
from tectonic_py.core.errors import InvalidArgument, InvalidName, XattrNotFound
from tectonic_py.core.records import WRITING, Attrs
from tectonic_py.mount import quota_xattrs
from tectonic_py.mount.errno_map import fuse_op

if TYPE_CHECKING:
    from tectonic_py.mount.inode_cache import InodeCache

_OURS = (b"user.", b"tectonic.")  # the namespaces that reach the metadata service
EC_XATTR = "user.tectonic.ec"
DURABILITY_XATTR = "user.tectonic.durability"


def _key(raw: bytes) -> str:
    if len(raw) > 255:
        raise pyfuse3.FUSEError(errno.ERANGE)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidName(f"xattr name {raw!r} is not UTF-8") from None


class XattrOps:
    """The xattr handlers of ``tectonic_py.mount.operations.Operations`` (a mixin)."""

    meta: Any
    cache: InodeCache
    creates: Any  # the client's AsyncCreates: a file's create lands before calls about it

    async def _attrs(self, inode: int) -> Attrs:
        raise NotImplementedError

    @fuse_op
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        # Hot path: security.capability before every write. No round trip for it.
        if not name.startswith(_OURS):
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        key = _key(name)
        quota_name = quota_xattrs.ours(key)
        if quota_name is not None:
            return await quota_xattrs.get(self, inode, quota_name)
        if not name.startswith(b"user."):
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        if key == EC_XATTR:
            return (await self._attrs(inode)).ec.encode()
        if key == DURABILITY_XATTR:
            return (await self._durability(inode)).encode()
        await self.creates.settle_file(inode)
        return await self.meta.getxattr(inode, key)

    async def _durability(self, inode: int) -> str:
        if self.cache.writing(inode) is not None:
            return WRITING
        attrs = await self._attrs(inode)
        if attrs.is_dir:
            raise XattrNotFound(f"a directory has no {DURABILITY_XATTR}")
        if not attrs.sealed:
            return attrs.seal_state
        # Asked afresh each time: a store going down changes it while the file does not.
        return await self.meta.durability(inode, attrs)

    @fuse_op
    async def setxattr(
        self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext
    ) -> None:
        if not name.startswith(_OURS):
            raise pyfuse3.FUSEError(errno.EOPNOTSUPP)
        key = _key(name)
        quota_name = quota_xattrs.ours(key)
        if quota_name is not None:
            await quota_xattrs.set_(self, inode, quota_name, value)
            return
        if not name.startswith(b"user."):
            raise pyfuse3.FUSEError(errno.EOPNOTSUPP)
        if key == DURABILITY_XATTR:
            raise pyfuse3.FUSEError(errno.EPERM)
        if key == EC_XATTR:
            try:
                text = value.decode("ascii")
            except UnicodeDecodeError:
                raise InvalidArgument(f"EC policy {value!r} is not ASCII") from None
            policy = ECPolicy.parse(text)
            attrs = await self._attrs(inode)
            if not attrs.is_dir:
                if ECPolicy.parse(attrs.ec).name == policy.name:
                    return  # what a copy of the xattrs asks: nothing changes
                # A file's blocks are already coded; only new files may choose a policy.
                raise pyfuse3.FUSEError(errno.EPERM)
            await self.meta.setattr(inode, ec=policy.name)
            self.cache.forget_dir(inode)
            return
        await self.creates.settle_file(inode)
        await self.meta.setxattr(inode, key, value)

    @fuse_op
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        # Ours are read and set by name only: listed, cp --preserve=xattr and rsync -X
        # would copy them (a status, a policy the destination's directory decides) and
        # rsync would remove them from a copy whose source lacks them.
        await self.creates.settle_file(inode)
        names = await self.meta.listxattr(inode)
        return [n.encode() for n in names if n not in (EC_XATTR, DURABILITY_XATTR)]

    @fuse_op
    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        if not name.startswith(_OURS):
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        quota_name = quota_xattrs.ours(_key(name))
        if quota_name is not None:
            await quota_xattrs.remove(self, inode, quota_name)
            return
        if not name.startswith(b"user."):
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        if _key(name) in (EC_XATTR, DURABILITY_XATTR):
            raise pyfuse3.FUSEError(errno.EPERM)
        await self.creates.settle_file(inode)
        await self.meta.removexattr(inode, _key(name))
