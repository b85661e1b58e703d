"""Short system calls made without releasing the GIL.

Why: every ``os.*`` call releases the GIL around its system call and takes it back after.
In the chunk store, up to 8 worker threads do puts while the event loop thread receives
payloads; when a thread gives the GIL up, a waiting one is woken, and taking it back means
waiting and being woken in turn. A put made about 30 such calls, and the daemon measured 60-70
context switches per 1 MiB put, with ``finish_task_switch`` and futex wake/wait the largest
items of its CPU profile (more than the copy of the payload). Calls that take microseconds
and never wait for the disk (open of an existing file, close, rename, access, a ftruncate
that frees no blocks) gain nothing from releasing the GIL, so they go through
``ctypes.PyDLL``, whose foreign calls keep it. Calls that wait for the disk (write, fsync,
read) or may do real work (creating an inode, freeing blocks) still use ``os``.

Each function raises OSError (with its errno subclass, e.g. FileNotFoundError) exactly as
its ``os`` counterpart does. Where libc cannot be loaded the ``os`` functions are used.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

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
    _ftruncate = _libc.ftruncate
    _ftruncate.argtypes = [ctypes.c_int, ctypes.c_int64]
    _ftruncate.restype = ctypes.c_int
except (OSError, AttributeError):  # no libc symbols (not glibc/musl): plain os calls
    _libc = None


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
    if err == 2:  # ENOENT
        return False
    raise OSError(err, os.strerror(err), path)


def ftruncate_small(fd: int, size: int) -> None:
    """``ftruncate`` that frees at most one block (the caller knows the file's size)."""
    if _libc is None:
        os.ftruncate(fd, size)
    elif _ftruncate(fd, size) != 0:
        raise _fail()
