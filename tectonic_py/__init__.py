"""tectonic_py: an erasure-coded checkpoint filesystem after Meta's Tectonic.

``tectonic_py.connect(cluster_file)`` is the blocking client for plain scripts; async code uses
``tectonic_py.client.tectonic_client.open_client``. Both are imported lazily so that daemons importing a
submodule do not pull in the client.
"""

from __future__ import annotations

from typing import Any

__all__ = ["connect", "open_client"]


def __getattr__(name: str) -> Any:
    if name == "connect":
        from tectonic_py.client.sync_client import connect

        return connect
    if name == "open_client":
        from tectonic_py.client.tectonic_client import open_client

        return open_client
    raise AttributeError(f"module 'tectonic_py' has no attribute {name!r}")
