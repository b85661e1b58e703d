"""The mount's quota, reservation and fallocate attributes (as CephFS's ``ceph.quota.*``).

On a directory with a quota: ``tectonic.quota.max_bytes`` and ``tectonic.quota.max_files``
(read; set by a mount whose cluster file has role admin: the metadata contract lets only
admin set quotas, so a client's setxattr answers EACCES), ``tectonic.quota.used_bytes``
and ``tectonic.quota.used_files`` (read only: usage as folded so far, a few seconds behind
the writes). ``tectonic.reserve`` on a directory, set to ``SIZE[:TTL]`` (``10GiB:10m``;
TTL 10 minutes when left out), reserves space for its writes as ``tectonic reserve`` does;
removing it ends the reservation. ``tectonic.fallocate`` on a file, set to ``MODE OFFSET
LENGTH`` (``0 0 10M``, ``keep_size 0 1G``), does what fallocate(2) would: pyfuse3 (3.5) has
no fallocate handler, so the kernel never passes fallocate(2) itself on (EOPNOTSUPP).

Each name is also accepted with a ``user.`` prefix (``user.tectonic.quota.max_bytes``), for
tools that only pass that namespace. None of them is listed (listxattr): copies must not
carry a quota or a reservation with them.
"""

from __future__ import annotations

import errno
from typing import Any

import pyfuse3

from tectonic_py.core.errors import (
    ConfigError,
    FileNotFound,
    InvalidArgument,
    PermissionDenied,
    XattrNotFound,
)
from tectonic_py.core.units import parse_duration, parse_size

PREFIX = "tectonic."
MAX_BYTES = "tectonic.quota.max_bytes"
MAX_FILES = "tectonic.quota.max_files"
USED_BYTES = "tectonic.quota.used_bytes"
USED_FILES = "tectonic.quota.used_files"
RESERVE = "tectonic.reserve"
FALLOCATE = "tectonic.fallocate"
NAMES = frozenset({MAX_BYTES, MAX_FILES, USED_BYTES, USED_FILES, RESERVE, FALLOCATE})
DEFAULT_TTL_S = 600.0
FALLOC_MODES = {"0": False, "keep_size": True, "1": True}  # FALLOC_FL_KEEP_SIZE is 1


def ours(key: str) -> str | None:
    """The attribute ``key`` names, without a ``user.`` prefix; None: not one of ours."""
    name = key[5:] if key.startswith("user.tectonic.") else key
    return name if name in NAMES else None


def _text(value: bytes) -> str:
    try:
        return value.decode("ascii").strip().rstrip("\x00")
    except UnicodeDecodeError:
        raise InvalidArgument(f"{value!r} is not ASCII") from None


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as e:
        raise InvalidArgument(str(e)) from None


async def get(ops: Any, inode: int, name: str) -> bytes:
    if name in (RESERVE, FALLOCATE):
        raise XattrNotFound(f"{name} is set, not read")
    try:
        quota = await ops.meta.get_quota(inode)
    except FileNotFound:
        raise XattrNotFound(f"no quota on inode {inode}") from None
    field = name.rsplit(".", 1)[1]
    return str(quota[field]).encode()


async def set_(ops: Any, inode: int, name: str, value: bytes) -> None:
    text = _text(value)
    if name in (USED_BYTES, USED_FILES):
        raise pyfuse3.FUSEError(errno.EPERM)
    if name == FALLOCATE:
        parts = text.split()
        if len(parts) != 3 or parts[0].lower() not in FALLOC_MODES:
            raise InvalidArgument(
                f"{FALLOCATE}: {text!r}: use MODE OFFSET LENGTH, MODE 0 or keep_size"
            )
        await ops.fallocate_inode(
            inode, FALLOC_MODES[parts[0].lower()], _size(parts[1]), _size(parts[2])
        )
        return
    if name == RESERVE:
        size_text, _, ttl_text = text.partition(":")
        try:
            ttl = parse_duration(ttl_text) if ttl_text else DEFAULT_TTL_S
        except ConfigError as e:
            raise InvalidArgument(str(e)) from None
        await ops.meta.reserve(inode, _size(size_text), ttl)
        return
    limit = _size(text) if name == MAX_BYTES else _count(text)
    try:
        current = await ops.meta.get_quota(inode)
        limits = {"max_bytes": current["max_bytes"], "max_files": current["max_files"]}
    except FileNotFound:
        limits = {"max_bytes": 0, "max_files": 0}
    limits[name.rsplit(".", 1)[1]] = limit
    try:
        await ops.meta.set_quota(inode, limits["max_bytes"], limits["max_files"])
    except PermissionDenied:
        raise pyfuse3.FUSEError(errno.EACCES) from None  # a client's mount: the operator's call
    ops.cache.forget_dir(inode)


def _count(text: str) -> int:
    if not text.isdigit():
        raise InvalidArgument(f"{MAX_FILES}: {text!r} is not a count of files (0: no limit)")
    return int(text)


async def remove(ops: Any, inode: int, name: str) -> None:
    if name == RESERVE:
        await ops.meta.release(inode)
    elif name in (MAX_BYTES, MAX_FILES):
        await ops.meta.remove_quota(inode)
        ops.cache.forget_dir(inode)
    else:
        raise pyfuse3.FUSEError(errno.EPERM)


def statfs_limits(quota: dict[str, Any], free_bytes: int) -> tuple[int, int, int, int]:
    """(total, free bytes, total, free files) df shows for a quota: its limits, and what
    is left of them (no more than the cluster has free); an unlimited side shows the
    cluster's. Files: -1 where unlimited."""
    held = quota["used_bytes"] + quota["claimed_bytes"] + quota["reserved_bytes"]
    total = quota["max_bytes"]
    free = min(free_bytes, max(0, total - held)) if total else -1
    files = quota["max_files"]
    ffree = max(0, files - quota["used_files"] - quota["claimed_files"]) if files else -1
    return total, free, files, ffree
