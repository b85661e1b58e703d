"""``python -m metadata.api --markdown``: the operations table of docs/operations-table.md."""

from __future__ import annotations

import sys

from metadata.api import OPS

HEADER = """# Metadata operations

Rendered from the one declaration of every operation (metadata/api/ops.py) by
`python -m metadata.api --markdown > docs/operations-table.md`; tests/test_roles.py fails when
this file and the declarations differ. Roles: `client` (GPU nodes: mount, CLI data commands,
load test, DCP, fsspec), `maintenance` (the maintenance daemon), `admin` (the operator's
CLI: everything), `node` (the servers among themselves). Arguments in brackets are optional,
with their default; ops routed to a shard also take `shard`. "Resent safely": a repeat after
a lost reply does no harm, so the client sends it again on its own.

"""

if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m metadata.api --markdown")
    sys.stdout.write(HEADER + OPS.markdown())
