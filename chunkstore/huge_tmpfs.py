"""Shared memory in transparent huge pages, with no host setting: a tmpfs of the daemon's own.

Why: a put's payload is received into memory the writer process maps too
(``writer_process.SharedBuffers``), and the writer's O_DIRECT write reads those pages. A
memfd is memory of the kernel's internal shmem mount, whose huge pages follow
``/sys/kernel/mm/transparent_hugepage/shmem_enabled``: ``never`` by default, so a 1 MiB
payload lies in 256 small pages, and the block layer cuts a write into a request per 254
pages. A tmpfs mount's own ``huge=`` option is honoured whatever ``shmem_enabled`` says
(the kernel's admin-guide/mm/transhuge), so the same memory taken from a tmpfs mounted
``huge=within_size`` is in 2 MiB pages, one segment each. On the project machine (puts only,
16 in flight, interleaved runs, medians of rounds 1-2): 1 MiB puts 1,284 → 1,500 MB/s and
4 MiB puts 1,525 → 2,700 MB/s, as reserved huge pages gave (``vm.nr_hugepages``), but
without a reservation for an administrator to size.

How, without a mount anyone can see: mounting needs CAP_SYS_ADMIN over the mount namespace.
A short-lived helper process (this module run with ``-m``) unshares a mount namespace of its
own (and a user namespace when it is not root), makes it private so that nothing propagates
to the host, mounts the tmpfs, and passes a descriptor of the tmpfs's root back over a
socketpair. When the helper exits its namespace goes, and the tmpfs, attached to no
namespace, lives as long as that descriptor or a file in it is open: no mount point to clean
up after a crash, and nothing on the host's mount table ever. Where the helper cannot do
this (a seccomp profile that forbids ``unshare``, no user namespaces), the caller goes on
with memfds.

Buffers are files created in the tmpfs and unlinked at once, so they behave as memfds do: a
descriptor to send with a job, memory freed on the last close and unmap. Their names keep
``tectonic-payload`` in /proc/PID/maps, as the memfds' names did.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import mmap
import os
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from tectonic_py.core.process_env import child_env

log = logging.getLogger(__name__)

MOUNT_OPTIONS = "huge=within_size,mode=0700"
HELPER_TIMEOUT = 10.0  # seconds the helper may take (a Python start-up and three syscalls)

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 0x2, 0x4, 0x8
_MS_REC, _MS_PRIVATE = 0x4000, 0x40000

_lock = threading.Lock()
_root: int | None = None
_tried = False
_names = itertools.count()


def helper_command() -> list[str]:
    """How the helper is started (a function so that tests can make it fail)."""
    return [sys.executable, "-m", __name__]


def open_private_tmpfs() -> int:
    """A descriptor of the root directory of a new huge-page tmpfs that no mount namespace
    shows; OSError saying why where one cannot be made here."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with parent, child:
        try:
            done = subprocess.run(
                [*helper_command(), str(child.fileno())],
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env=child_env(),
                timeout=HELPER_TIMEOUT,
                check=False,
            )
        except subprocess.TimeoutExpired as e:
            raise OSError(f"the tmpfs helper did not finish in {HELPER_TIMEOUT:g} s") from e
        if done.returncode != 0:
            why = done.stderr.decode(errors="replace").strip().splitlines()
            raise OSError(
                f"the tmpfs helper failed (exit status {done.returncode})"
                + (f": {why[-1]}" if why else "")
            )
        parent.settimeout(1.0)
        _msg, fds, _flags, _addr = socket.recv_fds(parent, 16, 1)
        if not fds:
            raise OSError("the tmpfs helper sent no descriptor")
        return fds[0]


def private_tmpfs() -> int | None:
    """This process's huge-page tmpfs (made at the first call, then shared by every caller),
    or None where none can be made; the reason is logged once."""
    global _root, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                _root = open_private_tmpfs()
                os.set_inheritable(_root, False)
            except OSError as e:
                log.info("payload buffers in small pages: no private huge-page tmpfs (%s)", e)
    return _root


def tmpfile_buffer(root: int, size: int) -> tuple[int, mmap.mmap]:
    """A new unlinked file of ``size`` bytes in the tmpfs ``root`` and its shared mapping;
    nothing left open on failure."""
    name = f"tectonic-payload-{next(_names)}"
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600, dir_fd=root)
    try:
        os.unlink(name, dir_fd=root)
        os.ftruncate(fd, size)
        return fd, mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _helper(sock_fd: int) -> None:
    """Mount the tmpfs in a mount namespace of this process's own; send its root back."""
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.geteuid(), os.getegid()
    if uid == 0:
        _check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    else:
        _check(libc.unshare(_CLONE_NEWNS | _CLONE_NEWUSER), "unshare(CLONE_NEWNS|CLONE_NEWUSER)")
        # Map the caller's ids into the new user namespace, so that the daemon (outside it)
        # may create files in the tmpfs.
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
        Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")
    _check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private")
    target = tempfile.gettempdir().encode()
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    _check(
        libc.mount(b"tectonic-payload", target, b"tmpfs", flags, MOUNT_OPTIONS.encode()),
        f"mount tmpfs ({MOUNT_OPTIONS}) on {target.decode()}",
    )
    fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
    with socket.socket(fileno=sock_fd) as sock:
        socket.send_fds(sock, [b"tmpfs"], [fd])


if __name__ == "__main__":
    try:
        _helper(int(sys.argv[1]))
    except OSError as e:
        print(e, file=sys.stderr)
        sys.exit(1)
