"""The one exception hierarchy of tectonic-py.

Every layer below the FUSE mount and the RPC server raises these classes and nothing
else for domain failures. Each class carries a stable wire ``code``: the RPC server
encodes an error to its code in exactly one place (``rpc_server.error_to_header``), and the
client raises the same class again from the code (``error_from_code``), so a caller
three hops away catches ``ChunkCorrupt`` as if it had happened locally. The FUSE layer
maps classes to errno in exactly one place (``tectonic_py.mount.errno_map``).

``retryable`` tells a caller whether the same request may succeed later unchanged
(busy, a node that is restarting); callers never retry anything else.
"""

from __future__ import annotations

_BY_CODE: dict[str, type[TectonicError]] = {}


class TectonicError(Exception):
    """Base of every domain error. ``str(e)`` is one line meant for a human."""

    code: str = "internal"
    retryable: bool = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        code = cls.__dict__.get("code")
        if code is not None:
            if code in _BY_CODE:
                raise TypeError(f"duplicate error code {code!r}")
            _BY_CODE[code] = cls

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.__class__.__doc__ or self.code)

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else self.code


_BY_CODE["internal"] = TectonicError


def error_from_code(code: str, message: str) -> TectonicError:
    """Rebuild the domain error a server sent. Unknown codes stay visible, never hidden."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return TectonicError(f"[{code}] {message}")
    return cls(message)


# --- wire and connection -------------------------------------------------------------


class ProtocolError(TectonicError):
    """A frame was malformed, oversized or out of order."""

    code = "protocol"


class AuthError(TectonicError):
    """The peer failed the challenge-response over the cluster secret."""

    code = "auth"


class PermissionDenied(TectonicError):
    """The connection's role may not call this operation (tectonic_py/core/auth.py roles,
    metadata/api for which role may call what). Nothing was changed."""

    code = "permission"


class UnknownOp(TectonicError):
    """The server has no handler for the requested operation."""

    code = "unknown_op"


class InvalidArgument(TectonicError):
    """A request field is missing, of the wrong type or out of range."""

    code = "invalid"


class Busy(TectonicError):
    """The server is at its admission limit; retry after a short pause."""

    code = "busy"
    retryable = True


class Unavailable(TectonicError):
    """A server cannot be reached or dropped the connection mid-request."""

    code = "unavailable"
    retryable = True


class Timeout(TectonicError):
    """A request did not complete within the caller's deadline."""

    code = "timeout"
    retryable = True


class BadCapability(TectonicError):
    """A chunk write carried a missing, forged or expired capability token."""

    code = "bad_capability"


class ConfigError(TectonicError):
    """The cluster file or a command-line setting is wrong."""

    code = "config"


# --- chunk store -----------------------------------------------------------------------


class ChunkNotFound(TectonicError):
    """No chunk with that id is stored on this node."""

    code = "chunk_not_found"


class ChunkCorrupt(TectonicError):
    """A stored chunk failed its checksum; its bytes are never returned."""

    code = "chunk_corrupt"


class ChunkConflict(TectonicError):
    """A chunk with this id already exists with different contents."""

    code = "chunk_conflict"


class ChecksumMismatch(TectonicError):
    """Bytes received do not match the checksum sent with them."""

    code = "checksum_mismatch"
    retryable = True


class DiskFull(TectonicError):
    """The node's disk has no room for the chunk."""

    code = "disk_full"


# --- metadata ------------------------------------------------------------------------------


class FileNotFound(TectonicError):
    """No such file or directory."""

    code = "enoent"


class FileExists(TectonicError):
    """The name already exists."""

    code = "eexist"


class NotADirectory(TectonicError):
    """A path component is not a directory."""

    code = "enotdir"


class IsADirectory(TectonicError):
    """The operation needs a file but the name is a directory."""

    code = "eisdir"


class DirectoryNotEmpty(TectonicError):
    """The directory still has entries."""

    code = "enotempty"


class InvalidName(TectonicError):
    """A name is empty, '.', '..', contains '/' or NUL, or is over 255 bytes."""

    code = "invalid_name"


class StaleWriterToken(TectonicError):
    """Another writer opened the file since; this writer is fenced off."""

    code = "stale_writer"


class FileSealed(TectonicError):
    """The file is sealed (closed by its writer) and cannot be appended to."""

    code = "sealed"


class DanglingName(TectonicError):
    """A name whose file record is gone or cannot be read (an admin's ``file.drop`` of a
    named file, a damaged shard). Only that name fails; unlink and rm still remove it.
    Raised by the metadata client, which knows the entry behind it: ``file_id`` and
    ``kind`` say what the name pointed at."""

    code = "dangling"

    def __init__(self, message: str = "", *, file_id: int = 0, kind: str = "") -> None:
        super().__init__(message)
        self.file_id = file_id
        self.kind = kind


class XattrNotFound(TectonicError):
    """The file has no extended attribute of that name."""

    code = "enodata"


class WrongShard(TectonicError):
    """The server does not host the shard named in the request."""

    code = "wrong_shard"


class ShardUnavailable(TectonicError):
    """The metadata shard that owns this key cannot be reached."""

    code = "shard_unavailable"
    retryable = True


class NoSpace(TectonicError):
    """Placement found fewer live nodes than the erasure-coding scheme needs, or the
    cluster's free raw space cannot hold a reservation."""

    code = "no_space"


class QuotaExceeded(TectonicError):
    """A directory quota (bytes or files) cannot hold the write, create or reservation;
    nothing of it was taken (metadata/quota_layer.py)."""

    code = "edquot"


class CrossRealm(TectonicError):
    """A rename or hard link between two quota realms (the record would leave the usage
    it is counted in); copy and delete instead, as across filesystems."""

    code = "exdev"


class Refused(TectonicError):
    """An upkeep op's precondition does not hold (a block a file still references, a chunk
    onto a node that is not registered, a node id registered at another address that is
    still up); nothing was changed."""

    code = "refused"


# --- client data path ---------------------------------------------------------------------


class QuorumLost(TectonicError):
    """Fewer chunk stores than the write quorum took a block, or too few chunks remain to read."""

    code = "quorum_lost"
