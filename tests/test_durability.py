"""A file's durability in sight: ``quorum`` -> ``full`` -> ``degraded`` as chunks are
placed and lost, through the metadata client, the mount's xattr (Operations called
directly) and ``tectonic stat``.

The cluster has exactly k+m = 6 chunk stores (rs-4-2), so a block written while one store
is down is committed with the 5 chunks that landed (the write quorum k+1) and nothing can
place the sixth until that store is back: ``quorum`` until repair places it, then ``full``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pyfuse3
import pytest
from maintenance_helpers import data_of, make_cluster, open_fresh_client, put, wait_for

from tectonic_py.core import durability as dur
from tectonic_py.core.durability import ChunkState, block_word, classify
from tectonic_py.mount.operations import Operations

CTX = SimpleNamespace(uid=0, gid=0, pid=1, umask=0o022)
XATTR = b"user.tectonic.durability"


def test_block_words() -> None:
    """The rules of tectonic_py/core/durability.py on one rs-4-2 block."""
    every = tuple((i, f"cs{i}") for i in range(6))
    up = {f"cs{i}" for i in range(6)}
    assert block_word(ChunkState(1, 4, 6, every), up) == dur.FULL
    short = ChunkState(1, 4, 6, every[:5], ((5, ""),))
    assert block_word(short, up) == dur.QUORUM  # never placed: waiting for repair
    assert block_word(ChunkState(1, 4, 6, every), up - {"cs2"}) == dur.DEGRADED  # store down
    assert block_word(ChunkState(1, 4, 6, every, ((2, "cs2"),)), up) == dur.DEGRADED  # bad
    assert block_word(ChunkState(1, 4, 6, every[:4]), up) == dur.DEGRADED  # below k+1
    assert classify([ChunkState(1, 4, 6, every), short], up) == dur.QUORUM
    assert classify([], up) == dur.FULL


def _stat(cluster_file: Path, path: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-m", "tectonic_py.cli.main", "stat", str(cluster_file), path],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    return json.loads(out.stdout)


async def test_durability_quorum_full_degraded(tmp_path: Path) -> None:
    with make_cluster(tmp_path / "c", chunkstores=6) as cluster:
        async with open_fresh_client(cluster) as client:
            ops = Operations(client)
            meta = client.meta
            first = await put(client, "/a", data_of(150_000, 1))  # 3 blocks of 64 KiB
            assert await meta.durability(first) == dur.FULL
            assert await ops.getxattr(first, XATTR, CTX) == b"full"
            # Read by name only, never listed (the mount's rule for its own xattrs: cp -a
            # and rsync -X would copy a status that belongs to the source).
            assert XATTR not in await ops.listxattr(first, CTX)
            with pytest.raises(pyfuse3.FUSEError):
                await ops.setxattr(first, XATTR, b"full", CTX)

            # A store down: the file that had a chunk there is degraded, a file written now
            # is committed with k+1 chunks (quorum) until the store is back.
            cluster.kill_chunkstore(5)

            async def degraded() -> bool:
                return await meta.durability(first) == dur.DEGRADED

            await wait_for("the first file degraded", degraded, timeout=30)
            second = await put(client, "/b", data_of(70_000, 2))
            assert await meta.durability(second) == dur.QUORUM
            assert await ops.getxattr(second, XATTR, CTX) == b"quorum"
            assert _stat(cluster.cluster_file, "/b")["durability"] == dur.QUORUM

            # Back: repair places the missing chunks, and both files are full.
            cluster.start_chunkstore(5)

            async def both_full() -> bool:
                words = {await meta.durability(f) for f in (first, second)}
                return words == {dur.FULL}

            await wait_for("both files full", both_full, timeout=60)
            assert await ops.getxattr(second, XATTR, CTX) == b"full"
