"""A dangling name (its file record dropped by an admin's ``file.drop``) never fails its
directory: the mount, ``tectonic ls -l`` and fsspec list every good entry, the name's own
stat and open answer EIO (logged once by the mount), and ``rm`` through the mount or
``tectonic rm`` removes it (issue 34)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time

import fsspec
import pytest
from fuse_fixtures import Mount
from test_cli import assert_one_line_error

from tectonic_py.client.sync_client import close_shared_clients
from tectonic_py.launch.local_cluster import LocalCluster
from tectonic_py.native.fsspec import TectonicFileSystem

pytestmark = pytest.mark.fuse

SETTLE_S = 1.5  # past the mount's 1 s name and attribute caches


def tectonic(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tectonic_py.cli.main", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def drop(cluster: LocalCluster, file_id: int) -> None:
    """The damage: the admin role may drop a record a name still reaches."""
    proc = tectonic("call", str(cluster.cluster_file), "file.drop", json.dumps({"id": file_id}))
    assert proc.returncode == 0, proc.stderr


def errno_of(fn: object, *args: object) -> int:
    try:
        fn(*args)  # type: ignore[operator]
    except OSError as e:
        return e.errno or 0
    return 0


def test_a_dangling_name_fails_alone_and_can_be_removed(
    mount: Mount, fuse_cluster: LocalCluster
) -> None:
    mount.expect_errors = True  # the one line that reports the dangling name
    d = mount.path / "d"
    d.mkdir()
    for name in ("a", "b", "c", "e"):
        (d / name).write_bytes(name.encode() * 1000)
    # A dangling subdirectory too, and a file whose record lives in another directory's
    # shard (renamed in), so that both of name.lookup's paths are crossed.
    (d / "sub").mkdir()
    (mount.path / "elsewhere").mkdir()
    (mount.path / "elsewhere" / "moved").write_bytes(b"m" * 10)
    os.rename(mount.path / "elsewhere" / "moved", d / "moved")
    time.sleep(SETTLE_S)  # the writers' seals
    ids = {n: os.stat(d / n).st_ino for n in ("b", "e", "sub", "moved")}
    for file_id in ids.values():
        drop(fuse_cluster, file_id)
    time.sleep(SETTLE_S)

    # The mount: every good entry listed and readable, the dangling ones EIO on their own.
    assert sorted(os.listdir(d)) == ["a", "b", "c", "e", "moved", "sub"]
    ls = subprocess.run(["ls", "-l", str(d)], capture_output=True, text=True, check=False)
    assert ls.returncode == 1, ls  # ls(1)'s "minor problem": some entry could not be read
    for good in ("a", "c"):
        assert any(line.endswith(f" {good}") and "1000" in line for line in ls.stdout.splitlines())
    for bad in ("b", "e", "sub", "moved"):
        assert f"cannot access '{d / bad}': Input/output error" in ls.stderr, ls.stderr
        assert errno_of(os.stat, d / bad) == errno.EIO
    assert errno_of(open, d / "b", "rb") == errno.EIO
    assert errno_of(open, d / "moved", "r+b") == errno.EIO
    assert (d / "a").read_bytes() == b"a" * 1000
    dangling_lines = [ln for ln in mount.log_text().splitlines() if "dangling name" in ln]
    assert len(dangling_lines) == 4, dangling_lines  # once each, however often asked

    # The CLI: ls -l lists the good entries and names the bad one; get says what is wrong.
    client_toml = str(fuse_cluster.client_file)
    long = tectonic("ls", "-l", client_toml, "/d")
    assert long.returncode == 1
    rows = {line.split()[2]: line for line in long.stdout.splitlines()}
    assert rows["a"].split()[0] == "1000" and rows["c"].split()[0] == "1000"
    assert rows["b"].endswith("[dangling]") and rows["moved"].endswith("[dangling]")
    assert long.stderr.count("which is gone") == 4, long.stderr
    got = tectonic("get", client_toml, "/d/b", str(mount.path.parent / "out"), "-q")
    assert_one_line_error(got, "'b'", "which is gone")

    # fsspec's listing: the good entries (a dangling one has nothing to describe).
    try:
        fs = fsspec.filesystem("tectonic", cluster=client_toml)
        assert isinstance(fs, TectonicFileSystem)
        assert sorted(e["name"].rpartition("/")[2] for e in fs.ls("/d")) == ["a", "c"]
    finally:
        TectonicFileSystem.clear_instance_cache()
        close_shared_clients()

    # Removal: rm through the mount, and tectonic rm (a file, and -r of a directory).
    os.unlink(d / "b")
    subprocess.run(["rm", "-f", str(d / "moved")], check=True)
    assert tectonic("rm", client_toml, "/d/e").returncode == 0
    removed = tectonic("rm", "-r", client_toml, "/d/sub")
    assert removed.returncode == 0, removed.stderr
    time.sleep(SETTLE_S)
    assert sorted(os.listdir(d)) == ["a", "c"]
    assert subprocess.run(["ls", "-l", str(d)], capture_output=True, check=False).returncode == 0
    listed = tectonic("ls", "-l", client_toml, "/d")
    assert listed.returncode == 0 and listed.stderr == "", listed
