"""Creates that do not wait (tectonic_py/client/async_creates.py), through real FUSE mounts.

Three mounts of one cluster: ``a`` and ``b`` as GPU nodes mount (asynchronous creates,
negative listings), and ``truth``, which caches nothing (synchronous creates, no negative
listing, entry and attr timeouts 0), as the view of what the metadata service holds.
What must hold, as the design promises it:

* a non-exclusive create of a name another mount created meanwhile behaves as if the two
  were serialized: one entry, holding one writer's whole contents;
* of two mounts creating one name with O_EXCL, exactly one succeeds;
* once close() returned, every other mount's readdir and stat see the file with its bytes;
* kill -9 of the mount after close(): every closed file is there with its bytes; kill -9 of
  a metadata server during the creates: each is applied once;
* a create that fails at the shard is reported by the file's close, and logged.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fuse_fixtures import Mount, _cluster, fuse_skip_reason
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tectonic_py.launch.local_cluster import LocalCluster

TRUTH = ("--sync-creates", "--negative-timeout", "0", "--entry-timeout", "0", "--attr-timeout", "0")
FAST = ("--negative-timeout", "5", "--entry-timeout", "0")


class Mounts:
    def __init__(self, cluster: LocalCluster, base: Path) -> None:
        self.cluster = cluster
        self.base = base
        self.a = Mount(cluster, _dir(base / "a"), base / "a.log")
        self.b = Mount(cluster, _dir(base / "b"), base / "b.log")
        self.truth = Mount(cluster, _dir(base / "truth"), base / "truth.log")

    def all(self) -> list[Mount]:
        return [self.a, self.b, self.truth]


def _dir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


@pytest.fixture(scope="module")
def mounts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mounts]:
    reason = fuse_skip_reason()
    if reason:
        pytest.skip(reason)
    base = tmp_path_factory.mktemp("async-creates")
    with _cluster(base / "cluster") as cluster:
        m = Mounts(cluster, base)
        try:
            m.a.start(*FAST)
            m.b.start(*FAST)
            m.truth.start(*TRUTH)
            yield m
        finally:
            for mount in m.all():
                mount.stop()
        problems = [p for mount in m.all() if not mount.expect_errors for p in mount.problems()]
        if problems:
            pytest.fail("a mount logged errors:\n" + "\n".join(problems[:20]))


_step_counter = iter(range(10**6))


def _step(m: Mounts) -> str:
    """A new step directory, made through ``a`` and known to both ``a`` and ``b`` (each
    has looked up a missing name in it, so each holds its listing)."""
    name = f"step_{next(_step_counter)}"
    os.mkdir(m.a / name)
    for mount in (m.a, m.b):
        assert not os.path.exists(mount / name / "absent")
    return name


def _write(path: Path, data: bytes, flags: int = os.O_CREAT | os.O_TRUNC) -> None:
    fd = os.open(path, os.O_WRONLY | flags, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _contents(mount: Mount, step: str) -> dict[str, bytes]:
    d = mount / step
    return {n: (d / n).read_bytes() for n in sorted(os.listdir(d))}


def _delegated(cluster: LocalCluster) -> int:
    """Ids the shards hold delegated to mounts (what the asynchronous path draws on)."""
    total = 0
    for db in cluster.root.glob("**/shard-*.db"):
        with sqlite3.connect(db) as conn:
            total += conn.execute("SELECT COUNT(*) FROM delegated_ids").fetchone()[0]
    return total


def test_creates_land_once_with_their_bytes_and_others_see_them(mounts: Mounts) -> None:
    step = _step(mounts)
    files = {f"rank_{i:03d}.pt": os.urandom(1000 + i) for i in range(64)}
    for name, data in files.items():
        _write(mounts.a / step / name, data)
    assert _delegated(mounts.cluster) > 0  # the mount reserved ids: creates did not wait
    # Once close returned: every other mount lists and reads them, with their bytes.
    assert _contents(mounts.truth, step) == files
    # b holds a listing read before the creates: a readdir brings its names in.
    assert _contents(mounts.b, step) == files
    for name, data in files.items():
        assert os.stat(mounts.truth / step / name).st_size == len(data)
    # The creating mount sees its own files at once (stat, listing, reads).
    assert _contents(mounts.a, step) == files


def test_non_exclusive_creates_of_one_name_from_two_mounts_serialize(mounts: Mounts) -> None:
    """Two mounts rewrite the same names at once. Where a create was answered from a
    listing that did not know the other's file, it takes the name over at the shard; where
    it found the file, it opens it and takes its writer token, and the writer it fenced
    fails with ESTALE (one writer per file). Either way: one entry per name, holding one
    writer's whole contents, and a writer whose close succeeded is the one whose contents
    are there unless the other wrote after it."""
    step = _step(mounts)
    names = [f"shard_{i:02d}" for i in range(24)]
    payload = {
        "a": lambda n: b"A" * 70_000 + n.encode(),
        "b": lambda n: b"B" * 50_000 + n.encode(),
    }
    fenced: dict[str, set[str]] = {"a": set(), "b": set()}
    errors: list[BaseException] = []

    def writer(mount: Mount, who: str) -> None:
        for n in names:
            try:
                _write(mount / step / n, payload[who](n))
            except OSError as e:
                if e.errno != errno.ESTALE:
                    errors.append(e)
                fenced[who].add(n)

    threads = [
        threading.Thread(target=writer, args=(mounts.a, "a")),
        threading.Thread(target=writer, args=(mounts.b, "b")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert sorted(os.listdir(mounts.truth / step)) == names  # one entry per name, never two
    for n in names:
        data = (mounts.truth / step / n).read_bytes()
        assert data in (payload["a"](n), payload["b"](n)), f"{n}: a mix or a short file"
        for who in ("a", "b"):
            if n in fenced[who]:
                assert data != payload[who](n), f"{n}: {who} was fenced, yet its bytes are there"
    for mount in (mounts.a, mounts.b):
        mount.expect_errors = True  # a fenced writer's failure is logged


def test_exclusive_creates_of_one_name_from_two_mounts_one_wins(mounts: Mounts) -> None:
    step = _step(mounts)
    names = [f"lock_{i:02d}" for i in range(24)]
    wins: dict[str, list[str]] = {n: [] for n in names}
    lock = threading.Lock()

    def racer(mount: Mount, who: str) -> None:
        for n in names:
            try:
                _write(mount / step / n, who.encode(), os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                continue
            with lock:
                wins[n].append(who)

    threads = [
        threading.Thread(target=racer, args=(m, w)) for m, w in ((mounts.a, "a"), (mounts.b, "b"))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for n in names:
        assert len(wins[n]) == 1, f"{n}: {wins[n]}"
        assert (mounts.truth / step / n).read_bytes() == wins[n][0].encode()


def test_create_that_fails_at_its_shard_fails_close(mounts: Mounts) -> None:
    """The parent went (another mount removed it) between the create's answer and its
    flush: close reports it, and the mount logs it; nothing is lost silently."""
    step = _step(mounts)
    _write(mounts.a / step / "first", b"1")  # a knows the directory's policy and listing
    dirfd = os.open(mounts.a / step, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert os.listdir(mounts.b / step) == ["first"]  # b learns of a's file
        os.unlink(mounts.b / step / "first")
        os.rmdir(mounts.b / step)
        mounts.a.expect_errors = True
        # Relative to the open directory: no path walk asks for the removed directory.
        fd = os.open("orphan", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=dirfd)
        with pytest.raises(OSError) as info:
            try:
                os.write(fd, b"x" * 1000)
            finally:
                os.close(fd)
    finally:
        os.close(dirfd)
    assert info.value.errno == errno.ENOENT
    assert not os.path.exists(mounts.truth / step)
    assert "failed after it was answered" in mounts.a.log_text()


def test_a_listing_may_hide_another_mounts_new_name_for_the_negative_timeout(
    mounts: Mounts,
) -> None:
    """The documented trade (tectonic_py/mount/dir_listings.py): b read the directory's
    listing before a made the file, so b may answer ENOENT for it until the listing is
    older than b's negative timeout; a readdir on b brings the name in at once."""
    step = _step(mounts)
    _write(mounts.a / step / "late", b"late")
    assert (mounts.truth / step / "late").read_bytes() == b"late"
    assert "late" in os.listdir(mounts.b / step)
    assert (mounts.b / step / "late").read_bytes() == b"late"


def test_rename_and_unlink_of_a_name_just_created_follow_it(mounts: Mounts) -> None:
    step = _step(mounts)
    d = mounts.a / step
    for i in range(16):
        _write(d / f"tmp_{i}", b"%d" % i)
        os.rename(d / f"tmp_{i}", d / f"final_{i}")
        if i % 2:
            os.unlink(d / f"final_{i}")
    expected = {f"final_{i}": b"%d" % i for i in range(0, 16, 2)}
    assert _contents(mounts.truth, step) == expected


@contextmanager
def _own_cluster(tmp_path: Path) -> Iterator[tuple[LocalCluster, Mount, Mount]]:
    """A cluster of the test's own (it kills things), a mount with a step directory it
    holds the listing of, and a truth mount; both always unmounted."""
    reason = fuse_skip_reason()
    if reason:
        pytest.skip(reason)
    with _cluster(tmp_path / "cluster") as cluster:
        mount = Mount(cluster, _dir(tmp_path / "m"), tmp_path / "m.log")
        truth = Mount(cluster, _dir(tmp_path / "t"), tmp_path / "t.log")
        try:
            mount.start()
            truth.start(*TRUTH)
            os.mkdir(mount / "step")
            assert not os.path.exists(mount / "step" / "absent")
            yield cluster, mount, truth
        finally:
            mount.stop()
            truth.stop()


def test_kill_mount_after_close_keeps_every_closed_file(tmp_path: Path) -> None:
    with _own_cluster(tmp_path) as (_, mount, truth):
        files = {f"rank_{i:03d}": os.urandom(5000) for i in range(48)}
        for name, data in files.items():
            _write(mount / "step" / name, data)
        mount.kill()  # kill -9 right after the last close returned
        assert _contents(truth, "step") == files


# Ranks of the kill test, in a process of their own: each writes its file (bytes derived
# from its name) and prints the names whose close returned. The test process itself then
# holds no file of the mount open, so its restart of the metadata servers is not held up:
# a fork+exec closes every inherited descriptor, and each close of a file on the mount is a
# FLUSH that waits for that file's create, which waits for the killed server.
_RANKS = """
import hashlib, json, os, sys, threading
step, first, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
closed = []
def rank(i):
    name = f"rank_{i:03d}"
    data = hashlib.sha256(name.encode()).digest() * 100
    try:
        fd = os.open(os.path.join(step, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    except OSError:
        return
    closed.append(name)
threads = [threading.Thread(target=rank, args=(i,)) for i in range(first, first + count)]
for t in threads:
    t.start()
print("started", flush=True)
for t in threads:
    t.join(timeout=180)
print(json.dumps(closed), flush=True)
"""


def _rank_data(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest() * 100


def test_kill_metadata_server_during_creates_applies_each_once(tmp_path: Path) -> None:
    with _own_cluster(tmp_path) as (cluster, mount, truth):
        mount.expect_warnings = mount.expect_errors = True
        step = str(mount / "step")

        def ranks(first: int) -> subprocess.Popen[str]:
            proc = subprocess.Popen(
                [sys.executable, "-c", _RANKS, step, str(first), "48"],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert proc.stdout is not None and proc.stdout.readline() == "started\n"
            return proc

        before = ranks(0)
        for i in range(2):  # whichever server holds the directory's shard
            cluster.kill_metadata(i)
        after = ranks(48)
        for i in range(2):
            cluster.start_metadata(i)
        closed: list[str] = []
        for proc in (before, after):
            out, _ = proc.communicate(timeout=240)
            closed += json.loads(out)
        got = _contents(truth, "step")
        for name in closed:  # every close that returned: there, its bytes
            assert got.get(name) == _rank_data(name), name
        assert set(got) <= {f"rank_{i:03d}" for i in range(96)}  # one entry per name
        # The servers came back within seconds: the creates rode the restart out.
        assert len(closed) == 96, sorted({f"rank_{i:03d}" for i in range(96)} - set(closed))


# --- a model of one directory, operated on from two mounts ------------------------------

NAMES = ["n0", "n1", "n2", "n3"]
OPS = st.lists(
    st.tuples(
        st.sampled_from(["a", "b"]),
        st.sampled_from(["create", "create_excl", "unlink", "rename"]),
        st.sampled_from(NAMES),
        st.sampled_from(NAMES),
        st.binary(min_size=0, max_size=300),
    ),
    min_size=1,
    max_size=10,
)


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=OPS)
def test_two_mounts_against_a_model_of_the_namespace(mounts: Mounts, ops: list) -> None:
    """After every operation the metadata service holds what the model says. Exact where
    the design is exact (O_EXCL, a mount's own names, O_TRUNC creates); where a mount may
    not yet know another's new name (its negative listing), an ENOENT is allowed and the
    model follows what happened."""
    step = _step(mounts)
    model: dict[str, bytes] = {}
    last: dict[str, str] = {}  # name -> the mount that last made or moved it
    for who, op, name, other, data in ops:
        mount = getattr(mounts, who)
        path, target = mount / step / name, mount / step / other
        stale_ok = name in model and last.get(name) != who
        if op == "create":
            _write(path, data)
            model[name], last[name] = data, who
        elif op == "create_excl":
            try:
                _write(path, data, os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                assert name in model, f"O_EXCL of {name} refused, but it does not exist"
            else:
                assert name not in model, f"O_EXCL of {name} succeeded over an existing file"
                model[name], last[name] = data, who
        elif op == "unlink":
            try:
                os.unlink(path)
            except FileNotFoundError:
                assert name not in model or stale_ok, f"unlink of {name}: ENOENT"
            else:
                assert name in model
                del model[name]
        else:
            try:
                os.rename(path, target)
            except FileNotFoundError:
                assert name not in model or stale_ok, f"rename of {name}: ENOENT"
            else:
                assert name in model
                if name != other:
                    model[other] = model.pop(name)
                    last[other] = who
        assert _contents(mounts.truth, step) == model, (who, op, name, other)
