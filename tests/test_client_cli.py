"""``tectonic put/get/ls/stat/mkdir/rm`` as a user runs them, against a real local cluster."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import trio

from tectonic_py.client.tectonic_client import open_client
from tectonic_py.launch.local_cluster import LocalCluster


@pytest.fixture
def local_cluster(shared_local_cluster: LocalCluster) -> LocalCluster:
    """One cluster for the module: the commands here never kill, stop or reconfigure a
    daemon."""
    return shared_local_cluster


def _tectonic(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tectonic_py.cli.main", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_put_get_ls_stat_mkdir_rm(local_cluster, tmp_path: Path):
    cf = str(local_cluster.cluster_file)
    src = tmp_path / "src.bin"
    data = os.urandom(3_000_000)
    src.write_bytes(data)
    r = _tectonic("mkdir", cf, "/d/e", "-p", "--ec", "rs-4-2")
    assert r.returncode == 0, r.stderr
    r = _tectonic("put", cf, str(src), "/d/e/")
    assert r.returncode == 0, r.stderr
    assert "3000000 bytes" in r.stdout and "rs-4-2" in r.stdout
    out = tmp_path / "out.bin"
    r = _tectonic("get", cf, "/d/e/src.bin", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == data
    r = _tectonic("ls", cf, "/d/e", "-l", "--json")
    assert json.loads(r.stdout)[0]["size"] == 3_000_000
    r = _tectonic("stat", cf, "/d/e/src.bin")
    assert json.loads(r.stdout)["ec"] == "rs-4-2"
    r = _tectonic("rm", cf, "/d")
    assert r.returncode == 1 and "directory" in r.stderr
    r = _tectonic("rm", cf, "-r", "/d")
    assert r.returncode == 0, r.stderr
    assert _tectonic("ls", cf, "/").stdout.strip() == ""


def test_cli_errors_are_one_clear_line(local_cluster, tmp_path: Path):
    cf = str(local_cluster.cluster_file)
    r = _tectonic("put", cf, str(tmp_path / "missing"), "/x")
    assert r.returncode == 1 and "cannot read" in r.stderr and "Traceback" not in r.stderr
    r = _tectonic("get", cf, "/nope", str(tmp_path / "o"))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert not (tmp_path / "o").exists()
    r = _tectonic("put", cf, __file__, "relative")
    assert r.returncode == 1 and "absolute" in r.stderr


def _ls_names(cf: str, path: str = "/") -> list[str]:
    r = _tectonic("ls", cf, path)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def _one_line_error(r: subprocess.CompletedProcess[str], needle: str) -> None:
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert needle in r.stderr, r.stderr


def test_rm_r_refuses_the_root_before_deleting_anything(local_cluster, tmp_path: Path):
    cf = str(local_cluster.cluster_file)
    src = tmp_path / "f"
    src.write_bytes(b"keep me")
    for remote in ("/a/x", "/b"):
        assert _tectonic("mkdir", cf, "-p", "/a").returncode == 0
        assert _tectonic("put", cf, "-q", str(src), remote).returncode == 0
    for roots in (["/"], ["/./"], ["/b", "/"]):
        _one_line_error(_tectonic("rm", cf, "-r", *roots), "refusing to remove '/'")
    assert _ls_names(cf) == ["a/", "b"]
    assert _ls_names(cf, "/a") == ["x"]
    # Every operand is checked before any is removed: /b survives a missing second operand.
    _one_line_error(_tectonic("rm", cf, "-r", "/b", "/missing"), "missing")
    _one_line_error(_tectonic("rm", cf, "/b", "/a"), "directory")
    _one_line_error(_tectonic("rm", cf, "/b/"), "not a directory")
    assert _ls_names(cf) == ["a/", "b"]
    r = _tectonic("rm", cf, "-r", "/a", "/b")
    assert r.returncode == 0, r.stderr
    assert _ls_names(cf) == []


def test_get_writes_into_special_files_and_never_replaces_them(local_cluster, tmp_path: Path):
    cf = str(local_cluster.cluster_file)
    data = os.urandom(200_000)
    (tmp_path / "src").write_bytes(data)
    assert _tectonic("put", cf, "-q", str(tmp_path / "src"), "/f").returncode == 0
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    # Held open for writing until get is done, so the reader's EOF comes after get's bytes
    # (and comes even if get never opens the FIFO).
    hold = os.open(fifo, os.O_RDWR)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    try:
        r = _tectonic("get", cf, "/f", str(fifo))
    finally:
        os.close(hold)
        reader.join(timeout=60)
    assert r.returncode == 0, r.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and got == [data]
    null = tmp_path / "null"
    try:
        os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pass  # not root, or no CAP_MKNOD: the FIFO above covers the rule
    else:
        r = _tectonic("get", cf, "/f", str(null))
        assert r.returncode == 0, r.stderr
        assert stat.S_ISCHR(os.lstat(null).st_mode)
    (tmp_path / "d" / "f").mkdir(parents=True)  # get into d would write d/f: a directory
    _one_line_error(_tectonic("get", cf, "/f", str(tmp_path / "d")), "is a directory")


def test_get_into_unwritable_places_is_one_line(local_cluster, tmp_path: Path):
    cf = str(local_cluster.cluster_file)
    (tmp_path / "src").write_bytes(b"x" * 1000)
    assert _tectonic("put", cf, "-q", str(tmp_path / "src"), "/f").returncode == 0
    _one_line_error(_tectonic("get", cf, "/f", str(tmp_path / "no" / "dir" / "f")), "cannot write")
    with open("/proc/version", "rb") as f:
        before = f.read()
    _one_line_error(_tectonic("get", cf, "/f", "/proc/version"), "cannot write")
    with open("/proc/version", "rb") as f:
        assert f.read() == before
    assert not (tmp_path / "no").exists()


def test_mkdir_p_over_a_file_fails(local_cluster, tmp_path: Path):
    cf = str(local_cluster.cluster_file)
    (tmp_path / "src").write_bytes(b"x")
    assert _tectonic("put", cf, "-q", str(tmp_path / "src"), "/f").returncode == 0
    _one_line_error(_tectonic("mkdir", cf, "-p", "/f"), "not a directory")
    r = _tectonic("mkdir", cf, "-p", "/f/sub")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    _one_line_error(_tectonic("mkdir", cf, "/f"), "exists")
    assert _tectonic("mkdir", cf, "-p", "/d/e").returncode == 0
    assert _tectonic("mkdir", cf, "-p", "/d/e").returncode == 0  # an existing directory is fine


async def _unsealed_file(cluster_file: Path, data: bytes) -> None:
    """``/gone``: fsynced by a writer that then died, its lease recovered (what GC does once
    the lease runs out): committed, never sealed, no writer."""
    async with open_client(cluster_file) as client:
        writer = await client.create("/gone")
        await writer.write(data)
        await writer.fsync()
        meta = client.meta
        # As admin (this cluster file's role), a lease counts as expired before any time.
        leases = await meta.expired_leases(
            meta.shard_of(writer.file_id), before_ns=2**62, limit=1000
        )
        (lease_ns,) = [ns for f, ns in leases if f == writer.file_id]
        assert await meta.recover_lease(writer.file_id, lease_ns, before_ns=2**62) == "incomplete"
        await writer.abort()
        attrs = await client.stat("/gone")
        assert (attrs.sealed, attrs.writer, attrs.size) == (False, False, len(data))


async def _get_while_written(cluster_file: Path, out: Path) -> subprocess.CompletedProcess[bytes]:
    """``tectonic get`` of ``/open`` while its writer (fsynced, not closed) is alive."""
    async with open_client(cluster_file) as client:
        writer = await client.create("/open")
        await writer.write(b"z" * 1000)
        await writer.fsync()
        try:
            argv = [sys.executable, "-m", "tectonic_py.cli.main", "get", str(cluster_file)]
            return await trio.run_process(
                [*argv, "/open", str(out)], capture_stdout=True, capture_stderr=True, check=False
            )
        finally:
            await writer.abort()


def test_unsealed_file_writer_gone_is_said_by_get_stat_and_ls(local_cluster, tmp_path: Path):
    cf = str(local_cluster.cluster_file)
    data = os.urandom(100_000)
    trio.run(_unsealed_file, local_cluster.cluster_file, data)
    r = _tectonic("get", cf, "/gone", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out").read_bytes() == data  # its committed bytes are still handed out
    assert "warning" in r.stderr and "unsealed, writer gone" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = _tectonic("stat", cf, "/gone")
    assert json.loads(r.stdout)["state"] == "unsealed, writer gone"
    r = _tectonic("ls", cf, "/", "-l")
    assert "gone  [unsealed, writer gone]" in r.stdout, r.stdout
    (tmp_path / "src").write_bytes(data)
    assert _tectonic("put", cf, "-q", str(tmp_path / "src"), "/sealed").returncode == 0
    r = _tectonic("get", cf, "/sealed", str(tmp_path / "out2"))
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert json.loads(_tectonic("stat", cf, "/sealed").stdout)["state"] == "sealed"
    r = trio.run(_get_while_written, local_cluster.cluster_file, tmp_path / "out3")
    assert r.returncode == 0 and b"still being written" in r.stderr, r.stderr
    assert (tmp_path / "out3").read_bytes() == b"z" * 1000
