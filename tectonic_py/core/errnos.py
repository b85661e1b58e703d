"""The errno of every domain error, in one table, for the boundaries that speak errno: the
FUSE mount (``tectonic_py.mount.errno_map``) and the fsspec filesystem (OSErrors). Nothing
else in the project maps domain errors to errno."""

from __future__ import annotations

import errno

from tectonic_py.core.errors import (
    AuthError,
    BadCapability,
    Busy,
    ChecksumMismatch,
    ChunkConflict,
    ChunkCorrupt,
    ChunkNotFound,
    ConfigError,
    CrossRealm,
    DanglingName,
    DirectoryNotEmpty,
    DiskFull,
    FileExists,
    FileNotFound,
    FileSealed,
    InvalidArgument,
    InvalidName,
    IsADirectory,
    NoSpace,
    NotADirectory,
    PermissionDenied,
    ProtocolError,
    QuorumLost,
    QuotaExceeded,
    Refused,
    ShardUnavailable,
    StaleWriterToken,
    TectonicError,
    Timeout,
    Unavailable,
    UnknownOp,
    WrongShard,
    XattrNotFound,
)

ERRNO: dict[type[TectonicError], int] = {
    FileNotFound: errno.ENOENT,
    FileExists: errno.EEXIST,
    NotADirectory: errno.ENOTDIR,
    IsADirectory: errno.EISDIR,
    DirectoryNotEmpty: errno.ENOTEMPTY,
    InvalidName: errno.EINVAL,
    InvalidArgument: errno.EINVAL,
    NoSpace: errno.ENOSPC,
    DiskFull: errno.ENOSPC,
    QuotaExceeded: errno.EDQUOT,
    CrossRealm: errno.EXDEV,
    # Another writer (another mount, or a recovery) took the file: this handle is fenced
    # off for good, which is what "stale file handle" tells a program.
    StaleWriterToken: errno.ESTALE,
    # Appending to a sealed file without reopening it for writing: not permitted.
    FileSealed: errno.EPERM,
    XattrNotFound: errno.ENODATA,  # pyfuse3.ENOATTR on Linux
    Timeout: errno.ETIMEDOUT,
    # Data or the service is unreachable or damaged. Programs handle EIO as "this call
    # failed"; EAGAIN would make a blocking write look spuriously non-blocking, and EACCES
    # for an auth failure would send the user hunting for file permissions.
    QuorumLost: errno.EIO,
    ShardUnavailable: errno.EIO,
    Unavailable: errno.EIO,
    Busy: errno.EIO,
    WrongShard: errno.EIO,
    ChunkNotFound: errno.EIO,
    ChunkCorrupt: errno.EIO,
    ChunkConflict: errno.EIO,
    ChecksumMismatch: errno.EIO,
    BadCapability: errno.EIO,
    AuthError: errno.EIO,
    PermissionDenied: errno.EACCES,
    # A name whose record is gone: that name's own stat and open fail, as a damaged inode
    # of a local filesystem does; the directory still lists and unlink removes the name.
    DanglingName: errno.EIO,
    Refused: errno.EBUSY,
    ProtocolError: errno.EIO,
    UnknownOp: errno.EIO,
    ConfigError: errno.EIO,
    TectonicError: errno.EIO,
}


def errno_for(exc: TectonicError) -> int:
    """The nearest mapped base class wins, so a new subclass inherits its parent's errno."""
    for cls in type(exc).__mro__:
        if cls in ERRNO:
            return ERRNO[cls]  # type: ignore[index]
    return errno.EIO
