"""A checkpoint burst that fills the chunk stores' disk fails cleanly: the ranks that could
not store their shard get a clear "no space" error, and every file whose close returned is
there, sealed and whole (read back and checked byte for byte)."""

from __future__ import annotations

from cluster_fixtures import suite_cluster
from tmpfs_helpers import small_tmpfs

from tectonic_py.client.tectonic_client import open_client
from tectonic_py.core.checksum import checksum
from tectonic_py.loadtest import LoadtestConfig, ShardData, run_loadtest

KiB = 1024
SHARD = 700 * KiB
RANKS = 48
NO_SPACE = ("DiskFull", "NoSpace", "ENOSPC", "no space", "No space")


def _expected_crc(data: ShardData, rank: int) -> int:
    crc = 0
    for piece in data.pieces(1, rank, SHARD, bytearray(1 << 20)):
        crc = checksum(piece, crc)
    return crc


async def test_a_burst_that_fills_the_disk_fails_cleanly_and_loses_no_closed_file(tmp_path):
    root = tmp_path / "cluster"
    root.mkdir()
    # Every chunk store's data directory on one small filesystem (the metadata on the real
    # disk), so the chunk stores run out in the middle of the burst: 48 x 700 KiB is about
    # 50 MiB of chunks with RS(6,3).
    tmpfs = small_tmpfs(tmp_path, "20m")
    small = next(tmpfs)
    try:
        (root / "chunks").symlink_to(small)
        with suite_cluster(root, node_timeout=5.0) as cluster:
            cfg = LoadtestConfig(
                cluster_file=str(cluster.cluster_file),
                ranks=RANKS,
                processes=2,
                shard_size=SHARD,
                run_dir="/full",
                max_seconds=240,
                keep=True,
                restore=False,  # checked below, file by file, with the seal state
                client_options={"chunk_timeout": 10.0, "slow_chunk_s": 5.0},
            )
            result = await run_loadtest(cfg)
            async with open_client(cluster.cluster_file) as client:
                entries = await client.listdir("/full/step_000001")
                whole = {}
                for e in entries:
                    if not e.name.endswith(".distcp"):
                        continue
                    path = f"/full/step_000001/{e.name}"
                    if (await client.stat(path)).sealed:
                        r = await client.open_read(path)
                        whole[int(e.name[2:].split("_")[0])] = bytes(await r.read())
    finally:
        next(tmpfs, None)
    write = next(p for p in result["phases"] if p["phase"] == "write")
    assert 0 < write["errors"] < RANKS, result["error_samples"]  # the disk filled mid-burst
    failures = [e for e in result["error_samples"] if " write: " in e]
    assert failures and all(any(m in e for m in NO_SPACE) for e in failures), failures
    assert not result["timed_out"]
    # every close that returned left a sealed file with exactly the bytes written
    assert len(whole) == write["files"] == RANKS - write["errors"]
    data = ShardData(cfg.seed)
    for rank, content in whole.items():
        assert len(content) == SHARD and checksum(content) == _expected_crc(data, rank), rank
