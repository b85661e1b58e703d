"""The Operations class called directly (as S3QL's t3_fs_api does) over a real client and a
real local cluster: handle sharing, seal on the last release, sticky write errors that are
never sealed, lookup counts, and the errno of bad calls. No kernel in between, so each
handler's answer is checked exactly."""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import pyfuse3
import pytest
import trio
from cluster_fixtures import suite_cluster

from tectonic_py.client.tectonic_client import TectonicClient, open_client
from tectonic_py.core.ids import ROOT_ID
from tectonic_py.launch.local_cluster import LocalCluster
from tectonic_py.mount.operations import Operations

CTX = SimpleNamespace(uid=1000, gid=1000, pid=1, umask=0o022)
RW = os.O_RDWR


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One cluster for the tests that break nothing (each uses its own names): 11 daemons
    per test would cost the suite a minute."""
    with suite_cluster(tmp_path_factory.mktemp("ops") / "cluster") as cluster:
        yield cluster


@pytest.fixture
async def ops(shared_cluster: LocalCluster) -> AsyncIterator[Operations]:
    async with open_client(shared_cluster.cluster_file) as client:
        yield Operations(client)


async def _errno(call) -> int:
    with pytest.raises(pyfuse3.FUSEError) as info:
        await call
    return info.value.errno


async def test_one_writer_shared_and_sealed_on_last_release(ops: Operations) -> None:
    fi, entry = await ops.create(ROOT_ID, b"f", 0o640, os.O_WRONLY | os.O_CREAT, CTX)
    inode = entry.st_ino
    assert (entry.st_mode & 0o777, entry.st_uid, entry.st_gid) == (0o640, 1000, 1000)
    assert ops.cache.lookup_count(inode) == 1
    fi2 = await ops.open(inode, RW, CTX)
    assert ops.cache.handle(fi.fh).ofile.writer is ops.cache.handle(fi2.fh).ofile.writer
    assert await ops.write(fi.fh, 0, b"a" * 100_000) == 100_000
    assert await ops.write(fi2.fh, 100_000, b"b" * 50) == 50
    assert (await ops.getattr(inode, CTX)).st_size == 100_050  # from the writer, unsynced
    assert await ops.read(fi2.fh, 99_990, 100) == b"a" * 10 + b"b" * 50  # read-your-writes
    await ops.flush(fi.fh)
    await ops.flush(fi.fh)  # dup'd descriptors: several flushes, nothing new to sync
    await ops.release(fi.fh)
    assert not (await ops.meta.getattr(inode)).sealed  # another handle still writes
    await ops.release(fi2.fh)
    attrs = await ops.meta.getattr(inode)
    assert attrs.sealed and attrs.size == 100_050
    assert ops.cache.open_files == {} and ops.cache.handles == {}
    fi3 = await ops.open(inode, os.O_RDONLY, CTX)
    assert await ops.read(fi3.fh, 0, 5) == b"aaaaa"
    await ops.release(fi3.fh)


async def test_open_trunc_and_setattr_size(ops: Operations) -> None:
    fi, entry = await ops.create(ROOT_ID, b"t", 0o644, os.O_WRONLY | os.O_CREAT, CTX)
    await ops.write(fi.fh, 0, b"x" * 1000)
    await ops.release(fi.fh)
    fi = await ops.open(entry.st_ino, os.O_WRONLY | os.O_TRUNC, CTX)
    assert (await ops.getattr(entry.st_ino, CTX)).st_size == 0
    fields = SimpleNamespace(
        update_size=True,
        update_mode=False,
        update_uid=False,
        update_gid=False,
        update_atime=False,
        update_mtime=False,
        update_ctime=False,
    )
    attr = pyfuse3.EntryAttributes()
    attr.st_size = 5000
    assert (await ops.setattr(entry.st_ino, attr, fields, fi.fh, CTX)).st_size == 5000
    await ops.release(fi.fh)
    fi = await ops.open(entry.st_ino, os.O_RDONLY, CTX)
    assert await ops.read(fi.fh, 0, 10_000) == bytes(5000)
    await ops.release(fi.fh)


async def test_failed_write_is_sticky_and_never_sealed(
    client: TectonicClient, local_cluster: LocalCluster, caplog: pytest.LogCaptureFixture
) -> None:
    ops = Operations(client)
    fi, entry = await ops.create(ROOT_ID, b"doomed", 0o644, os.O_WRONLY | os.O_CREAT, CTX)
    await ops.write(fi.fh, 0, b"x" * 4096)
    await ops.flush(fi.fh)
    for i in range(4):  # 5 of 9 chunk stores left: below the RS(6,3) write quorum
        local_cluster.kill_chunkstore(i)
    data = os.urandom(64 * 1024)
    codes = []
    for n in range(1, 40):  # blocks are 384 KiB here; the failure surfaces at a flush
        try:
            await ops.write(fi.fh, 4096 + (n - 1) * len(data), data)
        except pyfuse3.FUSEError as e:
            codes.append(e.errno)
            break
    if not codes:
        codes.append(await _errno(ops.flush(fi.fh)))
    assert codes[0] in (errno.EIO, errno.ENOSPC)
    assert await _errno(ops.write(fi.fh, 0, b"y")) == codes[0]  # sticky
    assert await _errno(ops.flush(fi.fh)) == codes[0]
    await ops.release(fi.fh)
    attrs = await ops.meta.getattr(entry.st_ino)
    assert not attrs.sealed  # incomplete data is never made to look complete
    assert "will not be sealed" in caplog.text and "not sealed after a failed write" in caplog.text


async def test_unlinked_file_keeps_its_handles(ops: Operations) -> None:
    fi, _ = await ops.create(ROOT_ID, b"u", 0o644, os.O_RDWR | os.O_CREAT, CTX)
    await ops.write(fi.fh, 0, b"hello")
    await ops.unlink(ROOT_ID, b"u", CTX)
    assert await _errno(ops.lookup(ROOT_ID, b"u", CTX)) == errno.ENOENT
    await ops.write(fi.fh, 5, b" world")
    assert await ops.read(fi.fh, 0, 100) == b"hello world"
    await ops.flush(fi.fh)
    await ops.release(fi.fh)
    assert ops.cache.open_files == {}


async def test_lookup_counts_and_forget(ops: Operations) -> None:
    entry = await ops.mkdir(ROOT_ID, b"d", 0o755, CTX)
    assert ops.cache.lookup_count(entry.st_ino) == 1
    await ops.lookup(ROOT_ID, b"d", CTX)
    await ops.lookup(ROOT_ID, b"d", CTX)
    assert ops.cache.lookup_count(entry.st_ino) == 3
    await ops.forget([(entry.st_ino, 3)])
    assert ops.cache.lookup_count(entry.st_ino) == 0
    # A failed lookup hands the kernel nothing, so it counts nothing.
    assert await _errno(ops.lookup(entry.st_ino, b"missing", CTX)) == errno.ENOENT
    assert ops.cache.lookups == {}


async def test_a_replaced_file_stays_openable_until_forget(ops: Operations) -> None:
    """The kernel resolved a name to an inode, then a rename replaced the file: its OPEN
    of that inode still gets the old file (issue 34), until its FORGET frees the reader."""
    d = await ops.mkdir(ROOT_ID, b"swap", 0o755, CTX)
    made = {}
    for name, data in ((b"target", b"old" * 100), (b"tmp", b"new" * 100)):
        fi, made[name] = await ops.create(d.st_ino, name, 0o644, RW | os.O_CREAT, CTX)
        await ops.write(fi.fh, 0, data)
        await ops.flush(fi.fh)
        await ops.release(fi.fh)
    old = await ops.lookup(d.st_ino, b"target", CTX)
    await ops.rename(d.st_ino, b"tmp", d.st_ino, b"target", 0, CTX)
    assert (await ops.meta.lookup(d.st_ino, "target")).id != old.st_ino
    fi = await ops.open(old.st_ino, os.O_RDONLY, CTX)
    assert await ops.read(fi.fh, 0, 1000) == b"old" * 100
    assert (await ops.getattr(old.st_ino, CTX)).st_nlink == 0
    await ops.release(fi.fh)
    assert ops.cache.lookup_count(old.st_ino) == 2  # its create's entry and the lookup
    await ops.forget([(old.st_ino, 1)])
    assert list(ops.cache.kept) == [old.st_ino]
    await ops.forget([(old.st_ino, 1)])
    assert ops.cache.kept == {}
    assert await _errno(ops.open(old.st_ino, os.O_RDONLY, CTX)) == errno.ENOENT
    # A rename over a file the kernel does not hold keeps nothing.
    await ops.forget([(made[b"tmp"].st_ino, 1)])
    await ops.rename(d.st_ino, b"target", d.st_ino, b"again", 0, CTX)
    assert ops.cache.kept == {}


async def test_bad_calls_get_their_errno(ops: Operations) -> None:
    assert await _errno(ops.read(999, 0, 10)) == errno.EBADF
    assert await _errno(ops.write(999, 0, b"x")) == errno.EBADF
    assert await _errno(ops.flush(999)) == errno.EBADF
    assert await _errno(ops.mkdir(ROOT_ID, b"x" * 256, 0o755, CTX)) == errno.ENAMETOOLONG
    assert await _errno(ops.mkdir(ROOT_ID, b"\xff", 0o755, CTX)) == errno.EINVAL
    await ops.mkdir(ROOT_ID, b"dir", 0o755, CTX)
    fi, _ = await ops.create(ROOT_ID, b"file", 0o644, os.O_WRONLY | os.O_CREAT, CTX)
    await ops.release(fi.fh)
    assert (
        await _errno(ops.create(ROOT_ID, b"file", 0o644, os.O_WRONLY | os.O_CREAT | os.O_EXCL, CTX))
        == errno.EEXIST
    )
    assert await _errno(ops.mkdir(ROOT_ID, b"dir", 0o755, CTX)) == errno.EEXIST
    assert await _errno(ops.rmdir(ROOT_ID, b"file", CTX)) == errno.ENOTDIR
    assert await _errno(ops.unlink(ROOT_ID, b"dir", CTX)) == errno.EISDIR
    assert (
        await _errno(ops.rename(ROOT_ID, b"file", ROOT_ID, b"dir", pyfuse3.RENAME_NOREPLACE, CTX))
        == errno.EEXIST
    )
    assert (
        await _errno(ops.rename(ROOT_ID, b"file", ROOT_ID, b"dir", pyfuse3.RENAME_EXCHANGE, CTX))
        == errno.EINVAL
    )
    assert await _errno(ops.getxattr(ROOT_ID, b"security.capability", CTX)) == pyfuse3.ENOATTR
    assert await _errno(ops.setxattr(ROOT_ID, b"trusted.x", b"1", CTX)) == errno.EOPNOTSUPP
    assert await _errno(ops.setxattr(ROOT_ID, b"user.tectonic.ec", b"rs-1-99", CTX)) == errno.EINVAL


async def test_statfs_reports_cluster_capacity(ops: Operations) -> None:
    s = await ops.statfs(CTX)
    assert s.f_blocks > 0 and 0 < s.f_bfree <= s.f_blocks and s.f_namemax == 255


async def test_no_error_logs_on_the_happy_path(
    ops: Operations, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    fi, _ = await ops.create(ROOT_ID, b"h", 0o644, os.O_WRONLY | os.O_CREAT, CTX)
    await ops.write(fi.fh, 0, os.urandom(1_000_000))
    await ops.fsync(fi.fh, False)
    await ops.release(fi.fh)
    await ops.rename(ROOT_ID, b"h", ROOT_ID, b"h2", 0, CTX)
    await ops.unlink(ROOT_ID, b"h2", CTX)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize("release_first", [False, True])
async def test_open_racing_the_last_release_keeps_a_working_writer(
    ops: Operations, release_first: bool
) -> None:
    """An open for writing and the last release of the same inode at once: whichever wins
    the inode's lock, the new handle ends up with a live writer and the data is sealed."""
    name = b"race-%d" % release_first
    fi, entry = await ops.create(ROOT_ID, name, 0o644, os.O_WRONLY | os.O_CREAT, CTX)
    await ops.write(fi.fh, 0, b"first")
    await ops.flush(fi.fh)
    opened: list[pyfuse3.FileInfo] = []

    async def reopen() -> None:
        # O_TRUNC: the open holds the inode's lock across an await (the truncate), the
        # window in which the last release of the old handle comes in.
        opened.append(await ops.open(entry.st_ino, os.O_WRONLY | os.O_TRUNC, CTX))

    async with trio.open_nursery() as nursery:
        if release_first:
            nursery.start_soon(ops.release, fi.fh)
            nursery.start_soon(reopen)
        else:
            nursery.start_soon(reopen)
            nursery.start_soon(ops.release, fi.fh)
    fh = opened[0].fh
    assert await ops.write(fh, 0, b"second") == 6
    await ops.flush(fh)
    await ops.release(fh)
    attrs = await ops.meta.getattr(entry.st_ino)
    assert attrs.sealed and attrs.size == len(b"second")


@pytest.mark.parametrize("other_closed", [False, True])
async def test_a_fenced_writer_gets_estale(
    ops: Operations, shared_cluster: LocalCluster, other_closed: bool
) -> None:
    """A second mount opens the file for writing: the first one's handle is fenced, and its
    next commit fails with ESTALE, whether the other writer is still writing or has already
    closed (sealed) the file. The failure is sticky and the fenced handle never seals."""
    name = b"fenced-%d" % other_closed
    fi, entry = await ops.create(ROOT_ID, name, 0o644, os.O_WRONLY | os.O_CREAT, CTX)
    await ops.write(fi.fh, 0, b"first")
    await ops.flush(fi.fh)
    async with open_client(shared_cluster.cluster_file) as other_client:
        other = Operations(other_client)
        inode = (await other.lookup(ROOT_ID, name, CTX)).st_ino
        fi2 = await other.open(inode, os.O_WRONLY | os.O_TRUNC, CTX)
        await other.write(fi2.fh, 0, b"second writer")
        await other.flush(fi2.fh)
        if other_closed:
            await other.release(fi2.fh)
        await ops.write(fi.fh, 5, b" more")
        assert await _errno(ops.flush(fi.fh)) == errno.ESTALE
        assert await _errno(ops.write(fi.fh, 10, b"x")) == errno.ESTALE  # sticky
        await ops.release(fi.fh)
        if not other_closed:
            await other.release(fi2.fh)
    attrs = await ops.meta.getattr(entry.st_ino)
    assert attrs.sealed and attrs.size == len(b"second writer")


async def _recover_lease(meta: Any, file_id: int) -> None:
    """What the GC does once a dead writer's lease runs out: the token released, unsealed
    (as admin, who may fence a writer whose lease has not run out yet)."""
    expired = await meta.expired_leases(meta.shard_of(file_id), before_ns=2**62, limit=10_000)
    lease_ns = dict(expired)[file_id]
    assert await meta.recover_lease(file_id, lease_ns, before_ns=2**62) == "incomplete"


async def test_unsealed_file_whose_writer_is_gone_says_so(
    ops: Operations, shared_cluster: LocalCluster
) -> None:
    durability = b"user.tectonic.durability"
    async with open_client(shared_cluster.cluster_file) as other:  # another mount's writer
        writer = await other.create_in(ROOT_ID, "unsealed", mode=0o640)
        await writer.write(b"x" * 5000)
        await writer.fsync()
        inode = writer.file_id
        assert await ops.getxattr(inode, durability, CTX) == b"writing"
        assert (await ops.getattr(inode, CTX)).st_mode == stat.S_IFREG | 0o640
        await _recover_lease(other.meta, inode)
        await writer.abort()
    entry = await ops.getattr(inode, CTX)
    # No read bits: ls -l does not show it as a complete file, and only root may read it.
    assert (entry.st_mode, entry.st_size) == (stat.S_IFREG | 0o200, 5000)
    assert await ops.getxattr(inode, durability, CTX) == b"unsealed"
    # Read by name, not listed: cp --preserve=xattr and rsync -X copy what is listed, and a
    # status cannot be copied onto another file.
    assert durability not in await ops.listxattr(inode, CTX)
    assert await _errno(ops.setxattr(inode, durability, b"sealed", CTX)) == errno.EPERM
    assert await _errno(ops.removexattr(inode, durability, CTX)) == errno.EPERM
    assert (await ops.meta.getattr(inode)).mode == 0o640  # the stored mode is untouched
    # This mount's own writer: "writing" with its mode; sealed on the last release.
    fi, entry = await ops.create(ROOT_ID, b"mine", 0o644, os.O_WRONLY | os.O_CREAT, CTX)
    assert await ops.getxattr(entry.st_ino, durability, CTX) == b"writing"
    await ops.write(fi.fh, 0, b"y" * 10)
    await ops.release(fi.fh)
    assert await ops.getxattr(entry.st_ino, durability, CTX) == b"full"
    assert (await ops.getattr(entry.st_ino, CTX)).st_mode == stat.S_IFREG | 0o644
    assert await _errno(ops.getxattr(ROOT_ID, durability, CTX)) == pyfuse3.ENOATTR
    assert durability not in await ops.listxattr(ROOT_ID, CTX)
