#!/usr/bin/env bash
# README command 2: install everything (apt packages, .venv with the project) and run the
# whole test suite. Exits non-zero on any failure; "no tests collected" (pytest exit 5) is a
# failure too, because a suite that silently finds nothing has tested nothing.
# Extra arguments go to pytest (e.g. `bash deploy/test.sh -x -q tests/test_wire.py`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install.sh
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "deploy/test.sh: pytest collected no tests: failing" >&2
    exit 1
fi
exit "$rc"
