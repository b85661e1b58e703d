"""``python -m tectonic_py.loadtest --worker SPEC``: a worker process of the load test (the
coordinator starts these; users run ``tectonic loadtest``)."""

from __future__ import annotations

import sys

from tectonic_py.loadtest.worker import worker_entry

if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(worker_entry(sys.argv[2]))
    print("usage: tectonic loadtest ... (this module's --worker mode is internal)", file=sys.stderr)
    sys.exit(2)
