#!/usr/bin/env bash
# README command 2: install everything (apt packages, .venv with the project) and run the
# whole test suite. Exits non-zero on any failure; "no tests collected" (pytest exit 5) is a
# failure too, because a suite that silently finds nothing has tested nothing.
# Extra arguments go to pytest (e.g. `bash deploy/test.sh -x -q tests/test_wire.py`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install.sh
# The suite starts a Python process for every daemon, mount, CLI call and worker. Where the
# environment sets PYTHONDONTWRITEBYTECODE (this machine's does), each of them compiled
# trio, httpx, cryptography and our own tree from source, about 0.5 s of CPU apiece (112 of
# tests/test_client_cli.py's 178 CPU-s). Their bytecode goes to one cache under .venv
# instead, out of the source tree as that setting wants.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-$PWD/.venv/pycache}"
set +e
# Three workers, a test file each (--dist loadfile: a file's daemons and fixtures stay in one
# process). Many tests wait on daemons, timeouts and mounts rather than compute: with two
# workers the two cores sat idle 17% of the run, with three 5%
# (docs/decisions/2026-12-05-suite-time.md). `-n 0` as an argument runs it serially.
# Files are handed out longest first, as tests/conftest.py orders them
# (--no-loadscope-reorder), so that no long file starts when the others are almost done.
.venv/bin/python -m pytest -n 3 --dist loadfile --no-loadscope-reorder "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "deploy/test.sh: pytest collected no tests: failing" >&2
    exit 1
fi
exit "$rc"
