"""Quotas seen through a real FUSE mount (role client, as a GPU node mounts): a write over
the quota fails with EDQUOT and the bytes before it read back; the quota as xattrs
(``tectonic.quota.*``, set only by admin: EACCES here); a reservation by xattr; fallocate's
modes 0 and KEEP_SIZE through ``tectonic.fallocate`` (pyfuse3 3.5 passes no fallocate(2)
on: it stays EOPNOTSUPP, posix_fallocate writes the range and is counted); a rename out of
the realm is EXDEV; df of a mount whose root has a quota shows the quota. One mount for the
module; the root quota last."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import AsyncIterator

import pytest
import trio
from fuse_fixtures import Mount

from tectonic_py.client.tectonic_client import TectonicClient, open_client
from tectonic_py.core.ids import ROOT_ID

KiB = 1024
MiB = 1024 * KiB


@pytest.fixture
async def admin(shared_mount: Mount) -> AsyncIterator[TectonicClient]:
    async with open_client(shared_mount.cluster.cluster_file) as c:
        yield c


async def _quota_dir(admin: TectonicClient, path: str, max_bytes: int, max_files: int = 0) -> int:
    await admin.mkdir(path, parents=True)
    dir_id = (await admin.stat(path)).id
    await admin.meta.set_quota(dir_id, max_bytes, max_files)
    await trio.sleep(2.1)  # the mount's cached directory attributes (and realm) expire
    return dir_id


async def _q(admin: TectonicClient, dir_id: int) -> dict[str, int]:
    await admin.meta.settle_quotas()
    return dict(await admin.meta.get_quota(dir_id))


async def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return await trio.to_thread.run_sync(
        lambda: subprocess.run(argv, capture_output=True, text=True, check=False)
    )


def _fill(path: str, piece: bytes, limit: int) -> tuple[int, OSError | None]:
    written = 0
    try:
        with open(path, "wb") as f:
            while written < limit:
                written += f.write(piece)
                f.flush()
    except OSError as e:
        return written, e
    return written, None


async def test_edquot_mid_write_xattrs_and_exdev(
    shared_mount: Mount, admin: TectonicClient
) -> None:
    mnt = shared_mount.path
    dir_id = await _quota_dir(admin, "/mq", 1 * MiB, 5)
    piece = os.urandom(256 * KiB)
    written, err = await trio.to_thread.run_sync(_fill, str(mnt / "mq" / "ckpt"), piece, 4 * MiB)
    assert err is not None and err.errno == errno.EDQUOT, err
    assert written == 1 * MiB
    data = (mnt / "mq" / "ckpt").read_bytes()
    assert data == piece * 4  # what was written before the refusal reads back whole
    q = await _q(admin, dir_id)
    assert (q["used_bytes"], q["used_files"]) == (1 * MiB, 1)

    d = str(mnt / "mq")
    assert os.getxattr(d, "tectonic.quota.max_bytes") == b"1048576"
    assert os.getxattr(d, "user.tectonic.quota.max_files") == b"5"
    assert os.getxattr(d, "tectonic.quota.used_bytes") == str(1 * MiB).encode()
    with pytest.raises(OSError) as e:  # the mount's role is client: quotas are admin's
        os.setxattr(d, "tectonic.quota.max_bytes", b"2M")
    assert e.value.errno == errno.EACCES
    with pytest.raises(OSError) as e:
        os.setxattr(d, "tectonic.quota.used_bytes", b"0")
    assert e.value.errno == errno.EPERM
    with pytest.raises(OSError) as e:
        os.rename(mnt / "mq" / "ckpt", mnt / "ckpt_moved_out")
    assert e.value.errno == errno.EXDEV
    assert os.getxattr(d, "tectonic.quota.max_bytes") == b"1048576"  # nothing changed


async def test_reserve_and_fallocate_by_xattr(shared_mount: Mount, admin: TectonicClient) -> None:
    mnt = shared_mount.path
    dir_id = await _quota_dir(admin, "/fa", 24 * MiB)
    step = mnt / "fa" / "step.staging-x"
    step.mkdir()
    os.setxattr(step, "tectonic.reserve", b"4M:10m")
    assert (await _q(admin, dir_id))["reserved_bytes"] == 4 * MiB
    for bad in (b"-4M", b"4M:soon", b"lots"):
        with pytest.raises(OSError) as e:
            os.setxattr(step, "tectonic.reserve", bad)
        assert e.value.errno == errno.EINVAL
    os.removexattr(step, "tectonic.reserve")
    assert (await _q(admin, dir_id))["reserved_bytes"] == 0

    # fallocate(2) itself never reaches the mount; the attribute does what it would.
    f = mnt / "fa" / "pre"
    f.write_bytes(b"")
    r = await _run("fallocate", "-l", "10M", str(f))
    assert r.returncode != 0 and "not supported" in r.stderr
    os.setxattr(f, "tectonic.fallocate", b"0 0 10M")
    assert f.stat().st_size == 10 * MiB
    assert f.read_bytes() == bytes(10 * MiB)
    os.setxattr(f, "tectonic.fallocate", b"keep_size 10M 8M")
    assert f.stat().st_size == 10 * MiB  # KEEP_SIZE: the size stays, the space is held
    q = await _q(admin, dir_id)
    assert (q["used_bytes"], q["claimed_bytes"]) == (10 * MiB, 8 * MiB)
    with pytest.raises(OSError) as e:  # 10 used + 8 held + 8 more > 24
        os.setxattr(mnt / "fa" / "pre", "tectonic.fallocate", b"0 18M 8M")
    assert e.value.errno == errno.EDQUOT
    with pytest.raises(OSError) as e:
        os.setxattr(f, "tectonic.fallocate", b"punch_hole 0 1M")
    assert e.value.errno == errno.EINVAL
    # The file's later growth draws from what KEEP_SIZE held: nothing more is claimed.
    with open(f, "r+b") as fh:
        fh.seek(10 * MiB)
        fh.write(b"g" * 6 * MiB)
    q = await _q(admin, dir_id)
    assert (q["used_bytes"], q["claimed_bytes"]) == (16 * MiB, 2 * MiB)
    # posix_fallocate (glibc writes the range) is counted like any write.
    g = mnt / "fa" / "posix"
    r = await _run("fallocate", "-x", "-l", "1M", str(g))
    assert r.returncode == 0, r.stderr
    assert (await _q(admin, dir_id))["used_bytes"] == 17 * MiB


async def test_df_shows_the_root_quota(shared_mount: Mount, admin: TectonicClient) -> None:
    before = os.statvfs(shared_mount.path)
    for q in await admin.meta.list_quotas():  # quotas do not nest: the others go first
        await admin.meta.remove_quota(q["dir"])
    await admin.meta.set_quota(ROOT_ID, 5 * 1024 * MiB, 100_000)
    try:
        await trio.sleep(2.1)  # the mount's cached root attributes expire
        st = os.statvfs(shared_mount.path)
        assert st.f_blocks * st.f_frsize == 5 * 1024 * MiB
        assert st.f_files == 100_000
        assert 0 < st.f_bavail * st.f_frsize <= 5 * 1024 * MiB
        assert 0 < st.f_ffree <= 100_000
    finally:
        await admin.meta.remove_quota(ROOT_ID)
    await trio.sleep(2.1)
    assert os.statvfs(shared_mount.path).f_blocks == before.f_blocks
