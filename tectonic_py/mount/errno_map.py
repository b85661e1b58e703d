"""Where domain errors become errno for every FUSE handler (the table is
``tectonic_py.core.errnos``, shared with the fsspec filesystem).

pyfuse3 ends the whole mount when a handler raises anything but ``FUSEError``, so every
handler of ``tectonic_py.mount.operations`` goes through ``fuse_op``: it maps
``TectonicError`` to its errno by class and turns a bug into EIO plus a traceback in the log
instead of a dead mount.
"""

from __future__ import annotations

import errno
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import pyfuse3

from tectonic_py.core.errnos import ERRNO, errno_for
from tectonic_py.core.errors import DanglingName, TectonicError

__all__ = ["ERRNO", "errno_of", "fuse_op"]

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

# Errors that are a normal answer (existence checks, O_EXCL races, rmdir of a full
# directory): logged at debug. Everything else is a failure of the system and is logged as
# one clear error line.
_ANSWERS = frozenset(
    {
        errno.ENOENT,
        errno.EEXIST,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.ENOTEMPTY,
        errno.EINVAL,
        errno.ENAMETOOLONG,
        errno.ENODATA,
        errno.EOPNOTSUPP,
        errno.EPERM,
        errno.EDQUOT,  # a quota refused a write or create (the user's limit, not a fault)
        errno.EXDEV,  # a rename between quota realms: mv copies instead
    }
)


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        out: list[BaseException] = []
        for inner in exc.exceptions:
            out.extend(_leaves(inner))
        return out
    return [exc]


def errno_of(exc: BaseException) -> int:
    """The errno a handler answers for ``exc``.

    ``FUSEError`` keeps its errno; a domain error maps by class (the nearest mapped base
    class wins, so a new subclass inherits its parent's errno); an exception group (a client
    nursery) answers for its first domain error; anything else is a bug and answers EIO.
    """
    if isinstance(exc, pyfuse3.FUSEError):
        return exc.errno
    if isinstance(exc, BaseExceptionGroup):
        leaves = _leaves(exc)
        for leaf in leaves:
            if isinstance(leaf, (TectonicError, pyfuse3.FUSEError)):
                return errno_of(leaf)
        return errno.EIO
    if isinstance(exc, TectonicError):
        return errno_for(exc)
    return errno.EIO


def fuse_op(fn: F) -> F:
    """Wrap a handler so that nothing but ``FUSEError`` ever leaves it; with the mount's
    ``fuse_metrics`` (mount/metrics.py), count and time it on the way."""
    op = fn.__name__

    @functools.wraps(fn)
    async def handler(self: Any, *args: Any) -> Any:
        metrics = getattr(self, "fuse_metrics", None)
        started = 0.0 if metrics is None else time.perf_counter()
        try:
            result = await fn(self, *args)
        except pyfuse3.FUSEError as e:
            if metrics is not None:
                metrics.failed(op, started, e.errno)
            raise
        except Exception as e:
            code = errno_of(e)
            domain = isinstance(e, TectonicError) or (
                isinstance(e, ExceptionGroup)
                and any(isinstance(x, (TectonicError, pyfuse3.FUSEError)) for x in _leaves(e))
            )
            name = errno.errorcode.get(code, str(code))
            if not domain:
                log.exception("%s%r: internal error -> %s", op, args[:2], name)
            elif code in _ANSWERS or isinstance(e, DanglingName):  # logged once when met
                log.debug("%s%r: %s -> %s", op, args[:2], e, name)
            else:
                log.error("%s%r failed: %s: %s -> %s", op, args[:2], type(e).__name__, e, name)
            if metrics is not None:
                metrics.failed(op, started, code)
            raise pyfuse3.FUSEError(code) from None
        if metrics is not None:
            metrics.done(op, started, result)
        return result

    return cast(F, handler)
