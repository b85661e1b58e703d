"""The ``tectonic://`` fsspec filesystem on a real cluster (one per module, shared by its
tests, each in a directory of its own).

fsspec's own abstract test suites (copy, get, put, open, pipe) run against it; beside them:
the entry point and URL forms, random seeks on read, append, the namespace calls and their
errors, transactions, and a pandas / pyarrow Parquet round trip through ``tectonic://``.
"""

from __future__ import annotations

import errno
import os
import posixpath
import random
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
from cluster_fixtures import suite_cluster
from fsspec.tests.abstract import (
    AbstractCopyTests,
    AbstractFixtures,
    AbstractGetTests,
    AbstractOpenTests,
    AbstractPipeTests,
    AbstractPutTests,
)

from tectonic_py.client.sync_client import CLUSTER_ENV, close_shared_clients
from tectonic_py.launch.local_cluster import LocalCluster
from tectonic_py.native.fsspec import TectonicFileSystem


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with suite_cluster(tmp_path_factory.mktemp("fsspec") / "cluster") as c:
        try:
            yield c
        finally:
            TectonicFileSystem.clear_instance_cache()
            close_shared_clients()


@pytest.fixture
def tfs(cluster: LocalCluster) -> TectonicFileSystem:
    fs = fsspec.filesystem(PROTOCOL, cluster=str(cluster.cluster_file))
    assert isinstance(fs, TectonicFileSystem)
    return fs


@pytest.fixture
def home(tfs: TectonicFileSystem) -> Iterator[str]:
    """A fresh directory for one test, removed after it."""
    path = f"/t-{uuid.uuid4().hex[:8]}"
    tfs.mkdir(path)
    yield path
    tfs.rm(path, recursive=True)


PROTOCOL = "tectonic"


class TestFsspecConventions(
    AbstractFixtures,
    AbstractCopyTests,
    AbstractGetTests,
    AbstractPutTests,
    AbstractOpenTests,
    AbstractPipeTests,
):
    """fsspec's abstract suites, as fsspec runs them on its own filesystems. The glob edge
    cases run for copy only: get's and put's expand the same globs with the same code on
    the same listings, and would triple the module's time."""

    test_get_glob_edge_cases = None
    test_put_glob_edge_cases = None

    @pytest.fixture
    def fs(self, tfs: TectonicFileSystem) -> TectonicFileSystem:
        return tfs

    @pytest.fixture
    def fs_join(self):  # type: ignore[no-untyped-def]
        return posixpath.join

    @pytest.fixture
    def fs_path(self, home: str) -> str:
        return home


# --- names and URLs -------------------------------------------------------------------------


def test_urls_and_the_environment_name_the_cluster(
    cluster: LocalCluster, tfs: TectonicFileSystem, home: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tfs.pipe_file(f"{home}/a", b"through a URL")
    fs, path = fsspec.url_to_fs(f"tectonic:/{home}/a", cluster=str(cluster.cluster_file))
    assert fs is tfs  # fsspec's instance cache; one client per process under it
    assert path == f"{home}/a"
    with fsspec.open(f"tectonic://{home.lstrip('/')}/a", cluster=str(cluster.cluster_file)) as f:
        assert f.read() == b"through a URL"
    monkeypatch.setenv(CLUSTER_ENV, str(cluster.cluster_file))
    with fsspec.open(f"tectonic://{home}/a", "rb", skip_instance_cache=True) as f:
        assert f.read() == b"through a URL"
    assert TectonicFileSystem._strip_protocol("tectonic:///a//b/") == "/a/b"
    assert TectonicFileSystem._strip_protocol("tectonic://") == "/"


# --- open files -----------------------------------------------------------------------------


def test_random_seeks_on_read(tfs: TectonicFileSystem, home: str) -> None:
    data = random.Random(1).randbytes(2_000_003)  # five blocks of 384 KiB and a short one
    with tfs.open(f"{home}/f", "wb") as f:
        f.write(data[:1000])
        f.write(data[1000:])
    rng = random.Random(2)
    with tfs.open(f"{home}/f", "rb", block_size=64 * 1024) as f:
        assert f.size == len(data)
        for _ in range(300):
            offset = rng.randrange(len(data) + 10)
            n = rng.choice([0, 1, 100, 70_000, 400_000])
            assert f.seek(offset) == offset
            assert f.read(n) == data[offset : offset + n]
        f.seek(-10, os.SEEK_END)
        assert f.read() == data[-10:]
        f.seek(5)
        f.seek(10, os.SEEK_CUR)
        assert f.tell() == 15
        buf = bytearray(300_000)
        assert f.readinto(buf) == len(buf)
        assert buf == data[15 : 15 + len(buf)]
    assert tfs.cat_file(f"{home}/f", 1_000_000, 1_000_010) == data[1_000_000:1_000_010]
    assert tfs.cat_file(f"{home}/f", -7) == data[-7:]
    assert tfs.cat_file(f"{home}/f", 10, -10) == data[10:-10]


def test_append_and_exclusive_create(tfs: TectonicFileSystem, home: str) -> None:
    tfs.pipe_file(f"{home}/log", b"one\n")
    with tfs.open(f"{home}/log", "ab") as f:
        assert f.tell() == 4
        f.write(b"two\n")
    with tfs.open(f"{home}/new", "ab") as f:
        f.write(b"fresh")
    assert tfs.cat_file(f"{home}/log") == b"one\ntwo\n"
    assert tfs.cat_file(f"{home}/new") == b"fresh"
    with pytest.raises(FileExistsError):
        tfs.open(f"{home}/log", "xb")
    with tfs.open(f"{home}/text", "w") as t:
        t.write("héllo\n")
    assert tfs.read_text(f"{home}/text") == "héllo\n"
    with pytest.raises(FileNotFoundError):
        tfs.open(f"{home}/missing", "rb")
    with pytest.raises(IsADirectoryError):
        tfs.open(home, "rb")


def test_a_file_is_sealed_at_close_and_written_into_new_directories(
    tfs: TectonicFileSystem, home: str
) -> None:
    with tfs.open(f"{home}/deep/er/f", "wb") as f:
        f.write(b"x" * 100)
        assert tfs.info(f"{home}/deep/er/f")["durability"] == "writing"
    info = tfs.info(f"{home}/deep/er/f")
    assert (info["seal_state"], info["durability"]) == ("sealed", "full")
    assert "durability" not in tfs.info(f"{home}/deep/er")
    assert info["size"] == 100
    assert info["type"] == "file"
    assert tfs.isdir(f"{home}/deep/er")


# --- namespace ------------------------------------------------------------------------------


def test_namespace_calls(tfs: TectonicFileSystem, home: str) -> None:
    tfs.makedirs(f"{home}/a/b/c")
    tfs.makedirs(f"{home}/a/b", exist_ok=True)
    with pytest.raises(FileExistsError):
        tfs.makedirs(f"{home}/a/b")
    with pytest.raises(FileExistsError):
        tfs.mkdir(f"{home}/a")
    with pytest.raises(FileNotFoundError):
        tfs.mkdir(f"{home}/x/y", create_parents=False)
    for i in range(5):
        tfs.pipe_file(f"{home}/a/f{i}", bytes(i))
    listing = tfs.ls(f"{home}/a")
    assert [e["name"] for e in listing] == [
        f"{home}/a/{n}" for n in ["b", "f0", "f1", "f2", "f3", "f4"]
    ]
    assert [e["size"] for e in listing] == [0, 0, 1, 2, 3, 4]
    assert [e["type"] for e in listing] == ["directory"] + ["file"] * 5
    assert tfs.ls(f"{home}/a/f3", detail=False) == [f"{home}/a/f3"]
    assert tfs.exists(f"{home}/a/f3") and not tfs.exists(f"{home}/a/nope")
    assert not tfs.exists(f"{home}/a/f3/under-a-file")
    with pytest.raises(FileNotFoundError):
        tfs.info(f"{home}/nope")

    tfs.cp_file(f"{home}/a/f4", f"{home}/a/b/copy")
    assert tfs.cat_file(f"{home}/a/b/copy") == bytes(4)
    tfs.mv(f"{home}/a/f1", f"{home}/a/b/c")  # into an existing directory
    assert tfs.cat_file(f"{home}/a/b/c/f1") == bytes(1)
    tfs.mv(f"{home}/a/f2", f"{home}/a/f3")  # over an existing file: one rename
    assert tfs.cat_file(f"{home}/a/f3") == bytes(2) and not tfs.exists(f"{home}/a/f2")
    tfs.mv(f"{home}/a/b", f"{home}/moved")  # a whole directory
    assert tfs.find(f"{home}/moved") == [f"{home}/moved/c/f1", f"{home}/moved/copy"]
    with pytest.raises(FileNotFoundError):
        tfs.mv(f"{home}/a/f0", f"{home}/no/such/dir/f0")

    with pytest.raises(OSError) as e:
        tfs.rmdir(f"{home}/moved")
    assert e.value.errno == errno.ENOTEMPTY
    tfs.rm(f"{home}/moved", recursive=True)
    tfs.rm(f"{home}/a/f0")
    assert tfs.ls(home, detail=False) == [f"{home}/a"]
    assert tfs.modified(f"{home}/a/f3").year >= 2024


def test_a_transaction_makes_files_visible_on_commit_only(
    tfs: TectonicFileSystem, home: str
) -> None:
    with tfs.transaction:
        with tfs.open(f"{home}/t1", "wb") as f:
            f.write(b"committed")
        assert not tfs.exists(f"{home}/t1")
    assert tfs.cat_file(f"{home}/t1") == b"committed"
    with pytest.raises(RuntimeError), tfs.transaction:
        with tfs.open(f"{home}/t2", "wb") as f:
            f.write(b"never seen")
        raise RuntimeError("the job failed")
    assert tfs.ls(home, detail=False) == [f"{home}/t1"]  # no t2, no hidden leftovers


# --- the data ecosystem ---------------------------------------------------------------------


def test_a_parquet_round_trip_through_tectonic_urls(
    cluster: LocalCluster, tfs: TectonicFileSystem, home: str
) -> None:
    pd = pytest.importorskip("pandas", reason="pandas is in the test extra")
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is in the test extra")
    rows = 50_000
    rng = random.Random(3)
    df = pd.DataFrame(
        {
            "step": range(rows),
            "loss": [rng.random() for _ in range(rows)],
            "tag": [f"rank-{i % 64}" for i in range(rows)],
        }
    )
    url = f"tectonic://{home}/metrics.parquet"
    options = {"cluster": str(cluster.cluster_file)}
    df.to_parquet(url, storage_options=options, row_group_size=10_000)
    assert tfs.info(f"{home}/metrics.parquet")["seal_state"] == "sealed"
    back = pd.read_parquet(url, storage_options=options)
    pd.testing.assert_frame_equal(back, df)
    # One column of one row group: pyarrow seeks to the footer, then to that column chunk.
    with pq.ParquetFile(f"{home}/metrics.parquet", filesystem=tfs) as pf:
        table = pf.read_row_group(3, columns=["loss"])
    assert table.column("loss").to_pylist() == df["loss"][30_000:40_000].tolist()


def test_put_and_get_through_local_files(
    tfs: TectonicFileSystem, home: str, tmp_path: Path
) -> None:
    local = tmp_path / "in.bin"
    local.write_bytes(os.urandom(1_000_000))
    tfs.put_file(str(local), f"{home}/in.bin")
    tfs.get_file(f"{home}/in.bin", str(tmp_path / "out.bin"))
    assert (tmp_path / "out.bin").read_bytes() == local.read_bytes()
