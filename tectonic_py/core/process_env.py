"""The environment of the project's own child processes (daemons, helpers, workers).

A child runs ``python -m <module of this project>``: it must import the very tree its parent
runs from, whatever the caller's working directory or an installed copy, so that tree goes
first on its PYTHONPATH.
"""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def child_env() -> dict[str, str]:
    """This process's environment with the project's tree first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
    return env
