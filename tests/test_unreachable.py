"""The unreachable-record sweep (tectonic_py/maintenance/unreachable.py) against a real
cluster: a record no name reaches is deleted after two walks a grace apart; one an open
writer holds, one an entry of an unreachable directory still names, and everything a name
reaches stay, bit-exact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from maintenance_helpers import data_of, make_cluster, open_fresh_client, open_inspector, put, read

from tectonic_py.core.errors import FileNotFound
from tectonic_py.core.ids import ROOT_ID
from tectonic_py.launch.local_cluster import LocalCluster
from tectonic_py.maintenance.unreachable import UnreachableSweep

GRACE = 0.5


def admin_call(cluster: LocalCluster, op: str, **fields: Any) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tectonic_py.cli.main", "call", str(cluster.cluster_file), op,
         json.dumps(fields)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr


async def test_sweep_deletes_only_what_no_name_and_no_writer_reaches(tmp_path: Path) -> None:
    cluster = make_cluster(tmp_path / "c", maintenance=False)
    cluster.start()
    try:
        keep, gone = data_of(70_000, seed=1), data_of(50_000, seed=2)
        async with open_fresh_client(cluster) as c:
            await c.mkdir("/d")
            await c.mkdir("/u")
            await put(c, "/d/keep", keep)
            gone_id = await put(c, "/d/gone", gone)
            inner_id = await put(c, "/u/inner", keep)
            writer = await c.create("/d/open")
            await writer.write(b"x" * 10_000)
            await writer.fsync()
            d, u = (await c.stat("/d")).id, (await c.stat("/u")).id
            # What a crash between an unlink's two shards leaves (made here as admin): the
            # names gone, the records still linked.
            admin_call(cluster, "name.remove", dir=d, name="gone", kind="file", expect_id=gone_id)
            admin_call(
                cluster, "name.remove", dir=d, name="open", kind="file", expect_id=writer.file_id
            )
            admin_call(cluster, "name.remove", dir=ROOT_ID, name="u", kind="dir", expect_id=u)
            await trio.sleep(GRACE)  # older than the grace

            async with open_inspector(cluster) as m:
                m.settings.unreachable_grace = GRACE
                sweep = UnreachableSweep(m)
                assert await sweep.round() == 0  # a first sighting deletes nothing
                assert sweep.pending >= 1
                await trio.sleep(GRACE)
                assert await sweep.round() == 1
                assert m.counters.unreachable_collected == 1

            with pytest.raises(FileNotFound):
                await c.meta.getattr(gone_id)
            assert (await c.meta.getattr(writer.file_id)).writer  # an open writer's: kept
            assert (await c.meta.getattr(u)).id == u  # a directory with entries: kept
            assert (await c.meta.getattr(inner_id)).size == len(keep)  # still named in /u
            assert await read(c, "/d/keep") == keep
            await writer.close()
    finally:
        cluster.stop()
