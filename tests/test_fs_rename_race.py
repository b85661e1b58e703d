"""Rename over an existing file is atomic for opens racing it through the mount (issue 34):
an open of the target gets the old file or the new one, never ENOENT, and reads one
complete version, as on a local filesystem; the replaced files' records are all freed."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
from fuse_fixtures import Mount

pytestmark = pytest.mark.fuse

SIZE = 64 * 1024
SWAPS = 200
READERS = 2
DEADLINE_S = 240.0  # the whole race, however slow the machine


def version(i: int) -> bytes:
    return i.to_bytes(4, "little") * (SIZE // 4)


def which_version(data: bytes) -> int | None:
    """The version ``data`` is, or None for a torn or short read."""
    if len(data) != SIZE:
        return None
    i = int.from_bytes(data[:4], "little")
    return i if data == version(i) else None


def records(mount: Mount) -> int:
    """File records in the cluster (statfs counts them: f_files is that plus 2**32)."""
    return os.statvfs(mount.path).f_files - 2**32


def test_open_racing_os_replace_gets_the_old_or_the_new_file(mount: Mount) -> None:
    d = mount.path / "swap"
    d.mkdir()
    target = d / "target.bin"
    target.write_bytes(version(0))
    time.sleep(1.5)  # the seal of its writer's release
    before = records(mount)
    stop = threading.Event()
    deadline = time.monotonic() + DEADLINE_S
    enoent: list[int] = []
    torn: list[int] = []
    seen: list[set[int]] = [set() for _ in range(READERS)]
    opened = [0] * READERS
    failures: list[OSError] = []

    def read_loop(me: int) -> None:
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                with open(target, "rb") as f:
                    data = f.read()
            except OSError as e:
                if e.errno == errno.ENOENT:
                    enoent.append(me)
                    continue
                failures.append(e)  # reported by the test, not lost in the thread
                return
            got = which_version(data)
            if got is None:
                torn.append(len(data))
            else:
                opened[me] += 1
                seen[me].add(got)

    readers = [threading.Thread(target=read_loop, args=(i,)) for i in range(READERS)]
    for t in readers:
        t.start()
    try:
        for i in range(1, SWAPS + 1):
            assert time.monotonic() < deadline, f"only {i - 1} swaps in {DEADLINE_S} s"
            tmp = d / f".target.bin.tmp{i}"
            with open(tmp, "wb") as f:
                f.write(version(i))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
    finally:
        stop.set()
        for t in readers:
            t.join(timeout=60)
    assert not failures, failures
    assert all(not t.is_alive() for t in readers)
    print(
        f"opens that read a version: {sum(opened)} ({sum(len(s) for s in seen)} distinct);"
        f" ENOENT: {len(enoent)}; torn reads: {len(torn)}"
    )
    assert enoent == [], f"{len(enoent)} opens of the target failed with ENOENT"
    assert torn == [], f"{len(torn)} reads returned no complete version: {torn[:5]}"
    assert all(seen), "a reader never read the target"
    assert which_version(target.read_bytes()) == SWAPS
    # Every replaced file's record is freed: only the target's is left of this test's.
    end = time.monotonic() + 30
    while records(mount) != before and time.monotonic() < end:
        time.sleep(0.5)
    assert records(mount) == before
