"""The ready file a daemon writes once it serves: how a launcher learns its address and PID.

Every daemon (metadata server, chunk store, maintenance, the mount) writes it the same way,
atomically (a temporary file, fsync, rename), so a launcher polling for it never reads half
of one; ``pid`` is always the writer's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_ready_file(path: str | os.PathLike[str], **info: Any) -> None:
    """``info`` and ``pid`` as one JSON object at ``path``; fields that are None are left out
    (a daemon without a metrics endpoint has no ``metrics``)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    fields = {"pid": os.getpid(), **{k: v for k, v in info.items() if v is not None}}
    with open(tmp, "w") as f:
        json.dump(fields, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
