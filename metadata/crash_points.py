"""Deterministic crash points: a metadata server that SIGKILLs itself at a named point, so a
test can kill it exactly between two steps of a protocol instead of hoping a timed kill -9
lands there. The one place that documents them.

Armed only by the environment variable ``TECTONIC_CRASH_POINT`` of a ``tectonic metadata``
process (read once, by ``metadata/main.py``, at start; a server built in-process by a test or a
tool is never armed). ``NAME`` dies the first time the point is reached, ``NAME@N`` the N-th
time (counted over all shards of the process). A name not in ``POINTS`` refuses to start the
server, so a typo never leaves a test waiting for a crash that cannot come. A production
cluster never sets it; unarmed, a point costs one comparison with ``None``.

The points, each reached after its transaction committed and before its reply is sent (the
client sees a lost reply over a change that is durable):

==================== =============================================================
``rename.after_prepare``    src shard: the intent of a cross-shard rename is recorded
``rename.after_dst_insert`` dst shard: the new name is in (``name.rename_apply``)
``rename.after_finish``     src shard: the intent is settled, the old name gone
``create.after_commit``     ``name.create`` (a delegated id's create, or a plain one)
``pack.after_commit``       ``file.commit_pack``: the pack and every file's extent
==================== =============================================================
"""

from __future__ import annotations

import logging
import os
import signal

from tectonic_py.core.errors import ConfigError

log = logging.getLogger(__name__)

ENV = "TECTONIC_CRASH_POINT"
POINTS = frozenset(
    {
        "rename.after_prepare",
        "rename.after_dst_insert",
        "rename.after_finish",
        "create.after_commit",
        "pack.after_commit",
    }
)

_armed: str | None = None
_left = 0  # times the armed point may still be passed before it fires


def arm_from_env() -> None:
    """Arm the point ``TECTONIC_CRASH_POINT`` names, if any (``metadata/main.py`` at start)."""
    global _armed, _left
    spec = os.environ.get(ENV, "")
    if not spec:
        return
    name, _, count = spec.partition("@")
    if name not in POINTS or (count and not (count.isdigit() and int(count) >= 1)):
        raise ConfigError(f"{ENV}={spec!r}: give NAME or NAME@N, NAME one of {sorted(POINTS)}")
    _armed, _left = name, int(count or 1) - 1
    log.warning("crash point %s armed: this server kills itself when it is reached", spec)


def reached(point: str) -> None:
    """The server passes ``point``; if it is the armed one (and its count is up), SIGKILL."""
    global _left
    if _armed is None or point != _armed:
        return
    if _left > 0:
        _left -= 1
        return
    log.warning("crash point %s reached: SIGKILL", point)
    os.kill(os.getpid(), signal.SIGKILL)
