"""Short system calls made without releasing the GIL.

Why: every ``os.*`` call releases the GIL around its system call and takes it back after.
In the chunk store, up to 8 worker threads do puts while the event loop thread receives
payloads; when a thread gives the GIL up, a waiting one is woken, and taking it back means
waiting and being woken in turn. A put made about 30 such calls, and the daemon measured 60-70
context switches per 1 MiB put, with ``finish_task_switch`` and futex wake/wait the largest
items of its CPU profile (more than the copy of the payload). Calls that take microseconds
and never wait for the disk (open of an existing file, close, rename, access, stat of an
inode in memory, fcntl) gain nothing from releasing the GIL, so they go through
``ctypes.PyDLL``, whose foreign calls keep it. Calls that wait for the disk (write, fsync,
read, a ftruncate that cuts inside a block, which ext4 reads to zero its tail) or may do
real work (creating an inode, freeing blocks) still use ``os``.

Each function raises OSError (with its errno subclass, e.g. FileNotFoundError) exactly as
its ``os`` counterpart does. Where libc cannot be loaded the ``os`` functions are used.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl as _fcntl
import logging
import os
import struct
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)

_libc: ctypes.PyDLL | None
try:
    _libc = ctypes.PyDLL(None, use_errno=True)
    _open = _libc.open
    _open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint]
    _open.restype = ctypes.c_int
    _close = _libc.close
    _close.argtypes = [ctypes.c_int]
    _close.restype = ctypes.c_int
    _rename = _libc.rename
    _rename.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    _rename.restype = ctypes.c_int
    _access = _libc.access
    _access.argtypes = [ctypes.c_char_p, ctypes.c_int]
    _access.restype = ctypes.c_int
    _setfl = _libc.fcntl
    _setfl.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    _setfl.restype = ctypes.c_int
except (OSError, AttributeError):  # no libc symbols (not glibc/musl): plain os calls
    _libc = None
if os.environ.get("TECTONIC_EXPERIMENT_OS_SYSCALLS"):  # temporary: the fast-path experiment
    _libc = None

# statx (glibc 2.28+): its struct has one layout on every architecture, unlike struct stat.
_statx = None
if _libc is not None:
    try:
        _statx = _libc.statx
        _statx.argtypes = [
            ctypes.c_int,
            ctypes.c_char_p,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.c_void_p,
        ]
        _statx.restype = ctypes.c_int
    except AttributeError:
        _statx = None
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_STATX_BASIC_STATS = 0x7FF
_STATX_SIZE = 256
# stx_ino, stx_size at 32; stx_ctime at 96, stx_mtime at 112 (tv_sec, tv_nsec); stx_dev at 136
_STATX_INO_SIZE = struct.Struct("=QQ")
_STATX_TIME = struct.Struct("=qI")
_STATX_DEV = struct.Struct("=II")


class Stat(NamedTuple):
    """What the chunk store needs of a stat: size, and what identifies a file's version."""

    size: int
    ino: int
    dev: int
    ctime_ns: int
    mtime: float


def _from_os(st: os.stat_result) -> Stat:
    return Stat(st.st_size, st.st_ino, st.st_dev, st.st_ctime_ns, st.st_mtime)


def _parse_statx(buf: ctypes.Array[ctypes.c_char]) -> Stat:
    ino, size = _STATX_INO_SIZE.unpack_from(buf, 32)
    csec, cnsec = _STATX_TIME.unpack_from(buf, 96)
    msec, mnsec = _STATX_TIME.unpack_from(buf, 112)
    major, minor = _STATX_DEV.unpack_from(buf, 136)
    return Stat(size, ino, os.makedev(major, minor), csec * 10**9 + cnsec, msec + mnsec / 1e9)


def fstat(fd: int) -> Stat:
    if _statx is None:
        return _from_os(os.fstat(fd))
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if _statx(fd, b"", _AT_EMPTY_PATH, _STATX_BASIC_STATS, buf) != 0:
        raise _fail()
    return _parse_statx(buf)


def stat(path: Path) -> Stat:
    if _statx is None:
        return _from_os(os.stat(path))
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if _statx(_AT_FDCWD, os.fsencode(path), 0, _STATX_BASIC_STATS, buf) != 0:
        raise _fail(path)
    return _parse_statx(buf)


def set_direct(fd: int, on: bool) -> None:
    """Turn O_DIRECT on or off for a file opened read-only (F_SETFL; EINVAL where the
    filesystem refuses it)."""
    flags = os.O_RDONLY | (os.O_DIRECT if on else 0)
    if _libc is None:
        _fcntl.fcntl(fd, _fcntl.F_SETFL, flags)
    elif _setfl(fd, _fcntl.F_SETFL, flags) != 0:
        raise _fail()


def _fail(*paths: str | bytes | os.PathLike[str]) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, os.strerror(err), *paths[:1], None, *paths[1:2])


def open_existing(path: Path, flags: int) -> int:
    """``os.open`` of a file that exists (no O_CREAT: creating an inode is real work)."""
    if _libc is None or flags & os.O_CREAT:
        return os.open(path, flags)
    fd = _open(os.fsencode(path), flags | os.O_CLOEXEC, 0)
    if fd < 0:
        raise _fail(path)
    return fd


def close(fd: int) -> None:
    if _libc is None:
        os.close(fd)
    elif _close(fd) != 0:
        raise _fail()


def rename(src: Path, dst: Path) -> None:
    if _libc is None:
        os.rename(src, dst)
    elif _rename(os.fsencode(src), os.fsencode(dst)) != 0:
        raise _fail(src, dst)


def exists(path: Path) -> bool:
    """Whether ``path`` exists (``access(F_OK)``); other errors raise."""
    if _libc is None:
        return os.path.lexists(path)
    if _access(os.fsencode(path), os.F_OK) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.ENOENT:
        return False
    raise OSError(err, os.strerror(err), path)
