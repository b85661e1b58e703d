"""POSIX on a real FUSE mount: what training jobs, copy tools and archivers rely on.

Open files that lose their name, times that stay as set, extended attributes that copy,
df, directory attributes, symbolic and hard links, special files, other users held to the
modes by the kernel, and cp/rsync/tar round trips of a tree holding all of them, compared
entry by entry. docs/posix.md has what the mount does and does not do, and why.
"""

from __future__ import annotations

import errno
import os
import pwd
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fuse_fixtures import Mount

from metadata.server_calls import capacity_of
from tectonic_py.core.ec_policy import DEFAULT_POLICY
from tectonic_py.core.records import NodeInfo

pytestmark = pytest.mark.fuse

MiB = 1024 * 1024
SETTLE_S = 1.5  # past the kernel's attribute cache (1 s) and the seal of the last release
OURS = "user.tectonic."


@pytest.fixture
def wdir(shared_mount: Mount, request: pytest.FixtureRequest) -> Path:
    d = shared_mount.path / request.node.name.replace("[", "_").replace("]", "")
    d.mkdir()
    return d


def _run(*argv: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        [str(a) for a in argv], check=False, capture_output=True, text=True, cwd=cwd, timeout=300
    )
    assert r.returncode == 0, f"{argv} exited {r.returncode}: {r.stderr}"
    return r


# --- bug 1: an open file that loses its name ------------------------------------------------


def test_unlinked_open_file_stays_readable(wdir: Path) -> None:
    f = wdir / "f"
    with open(f, "wb") as w:
        w.write(b"x" * 99)
    fd = os.open(f, os.O_RDONLY)  # within moments of the writer's close: its release may lag
    try:
        os.unlink(f)
        assert os.fstat(fd).st_size == 99
        assert os.pread(fd, 9, 0) == b"x" * 9
        time.sleep(SETTLE_S)  # the seal is done and the kernel asks again
        assert os.fstat(fd).st_nlink == 0
        assert os.pread(fd, 200, 90) == b"x" * 9
    finally:
        os.close(fd)


def test_open_file_survives_a_new_file_taking_its_name(wdir: Path) -> None:
    f = wdir / "f"
    f.write_bytes(b"old" * 1000)
    time.sleep(SETTLE_S)
    with open(f, "rb") as old:
        assert old.read(3) == b"old"
        (wdir / "new").write_bytes(b"new")
        os.replace(wdir / "new", f)  # the old file loses its only name
        time.sleep(SETTLE_S)
        assert os.fstat(old.fileno()).st_size == 3000
        assert old.read() == b"old" * 999
        f.unlink()
        f.write_bytes(b"third")
        assert os.pread(old.fileno(), 6, 0) == b"oldold"
    assert f.read_bytes() == b"third"


# --- bug 2: times set right after close --------------------------------------------------------


def test_mtime_set_right_after_close_is_kept(wdir: Path) -> None:
    want = 1_600_000_000_123_456_789
    for i in range(60):
        p = wdir / f"u{i}"
        with open(p, "wb") as w:
            w.write(os.urandom(1000 + i))
        os.utime(p, ns=(want, want + i))
    src = wdir / "src"
    src.write_bytes(b"s" * 5000)
    os.utime(src, ns=(want, want))
    for i in range(30):
        shutil.copy2(src, wdir / f"c{i}")
    time.sleep(SETTLE_S)
    lost = [i for i in range(60) if (wdir / f"u{i}").stat().st_mtime_ns != want + i]
    lost += [f"c{i}" for i in range(30) if (wdir / f"c{i}").stat().st_mtime_ns != want]
    assert not lost


def test_mtime_seen_after_close_does_not_move(wdir: Path) -> None:
    seen = {}
    for i in range(20):
        p = wdir / f"m{i}"
        with open(p, "wb") as w:
            w.write(os.urandom(2000))
        seen[p] = p.stat().st_mtime_ns
    time.sleep(SETTLE_S)
    moved = {p.name: p.stat().st_mtime_ns - t for p, t in seen.items() if p.stat().st_mtime_ns != t}
    assert not moved


# --- bug 4: extended attributes copy --------------------------------------------------------


def test_xattrs_copy_with_cp_and_rsync(wdir: Path, tmp_path: Path) -> None:
    src = wdir / "src"
    src.write_bytes(os.urandom(3000))
    os.setxattr(src, "user.note", b"hello")
    os.setxattr(src, "user.bin", bytes(range(256)))
    assert os.getxattr(src, "user.bin") == bytes(range(256))
    assert os.getxattr(src, "user.tectonic.ec") == DEFAULT_POLICY.name.encode()
    os.setxattr(src, "user.tectonic.ec", DEFAULT_POLICY.name.encode())  # its own policy
    with pytest.raises(OSError) as info:
        os.setxattr(src, "user.tectonic.ec", b"rs-4-2")  # a coded file cannot change it
    assert info.value.errno == errno.EPERM
    _run("cp", "--preserve=xattr", src, wdir / "cp")
    _run("rsync", "-aX", src, wdir / "rsync")
    local = tmp_path / "local"
    _run("cp", "--preserve=xattr", src, local)
    _run("rsync", "-aX", local, wdir / "back")
    for name in ("cp", "rsync", "back"):
        copy = wdir / name
        assert copy.read_bytes() == src.read_bytes()
        assert os.getxattr(copy, "user.note") == b"hello"
        assert os.getxattr(copy, "user.bin") == bytes(range(256))
    os.removexattr(wdir / "cp", "user.note")
    assert "user.note" not in os.listxattr(wdir / "cp")


# --- bug 5: df -----------------------------------------------------------------------------


def test_df_counts_a_shared_filesystem_once(shared_mount: Mount) -> None:
    # Every chunk store of the test cluster lives on the one filesystem of the test's tmp.
    cluster_root = shared_mount.cluster.root
    disk = os.statvfs(cluster_root)
    mnt = os.statvfs(shared_mount.path)
    k_over_n = DEFAULT_POLICY.k / DEFAULT_POLICY.n
    assert mnt.f_blocks * mnt.f_frsize <= disk.f_blocks * disk.f_frsize * k_over_n * 1.01
    assert mnt.f_bavail * mnt.f_frsize <= disk.f_bavail * disk.f_frsize * k_over_n * 1.01 + MiB


def test_capacity_of_groups_stores_by_filesystem() -> None:
    def node(i: int, fs: str, cap: int, free: int, fs_total: int, fs_free: int) -> NodeInfo:
        return NodeInfo(f"n{i}", "127.0.0.1:1", "d", "up", cap, free, 0, 0, fs, fs_total, fs_free)

    shared = [node(i, "h:1", 100, 40, 100, 40) for i in range(3)]  # three stores, one disk
    quotas = [node(3, "h:2", 30, 20, 1000, 900), node(4, "h:2", 30, 25, 1000, 900)]
    silent = [node(5, "", 70, 7, 0, 0)]  # a store that names no filesystem counts alone
    assert capacity_of(shared) == (100, 40)
    assert capacity_of(quotas) == (60, 45)
    assert capacity_of(shared + quotas + silent) == (230, 92)


# --- bug 6: directory attributes and st_blocks ---------------------------------------------


def test_directory_times_and_link_count_follow_its_entries(wdir: Path) -> None:
    def times() -> tuple[int, int]:
        st = os.stat(wdir)
        return st.st_mtime_ns, st.st_ctime_ns

    assert os.stat(wdir).st_nlink == 2
    steps = [
        lambda: (wdir / "f").write_bytes(b"1"),
        lambda: os.mkdir(wdir / "d"),
        lambda: os.rename(wdir / "f", wdir / "g"),
        lambda: os.unlink(wdir / "g"),
        lambda: os.mkdir(wdir / "e"),
        lambda: os.rmdir(wdir / "e"),
    ]
    for step in steps:
        before = times()
        time.sleep(0.01)
        step()
        after = times()
        assert after[0] > before[0] and after[1] > before[1], step
    assert os.stat(wdir).st_nlink == 3  # itself, its entry in the parent, d's ..
    os.mkdir(wdir / "d" / "sub")
    os.rename(wdir / "d" / "sub", wdir / "sub")
    assert (os.stat(wdir).st_nlink, os.stat(wdir / "d").st_nlink) == (4, 2)
    listed = _run("ls", "-a", wdir).stdout.split()
    assert listed == [".", "..", "d", "sub"]


def test_st_blocks_counts_stored_bytes(wdir: Path) -> None:
    dense = wdir / "dense"
    dense.write_bytes(os.urandom(100_000))
    sparse = wdir / "sparse"
    with open(sparse, "wb") as f:
        f.truncate(200 * MiB)
        f.write(b"head")
    time.sleep(SETTLE_S)
    assert os.stat(dense).st_blocks == -(-100_000 // 512)
    st = os.stat(sparse)
    assert st.st_size == 200 * MiB
    assert st.st_blocks * 512 < 50 * MiB  # one block of data, not 200 MiB of holes


# --- calls the mount did not have ------------------------------------------------------------


def test_symlinks(wdir: Path) -> None:
    (wdir / "target").write_bytes(b"data")
    os.symlink("target", wdir / "rel")
    os.symlink("/nowhere/at/all", wdir / "dangling")
    long = "d/" * 1000 + "x"
    os.symlink(long, wdir / "long")
    assert os.readlink(wdir / "rel") == "target"
    assert os.readlink(wdir / "long") == long
    assert (wdir / "rel").read_bytes() == b"data"
    st = os.lstat(wdir / "dangling")
    assert stat.S_ISLNK(st.st_mode) and st.st_size == len("/nowhere/at/all")
    assert not (wdir / "dangling").exists()
    with pytest.raises(FileExistsError):
        os.symlink("x", wdir / "rel")
    os.rename(wdir / "rel", wdir / "moved")
    assert (wdir / "moved").read_bytes() == b"data"
    os.unlink(wdir / "moved")
    assert (wdir / "target").exists()


def test_hard_links(wdir: Path) -> None:
    a, b = wdir / "a", wdir / "b"
    a.write_bytes(b"shared")
    os.link(a, b)
    assert (os.stat(a).st_nlink, os.stat(a).st_ino) == (2, os.stat(b).st_ino)
    with pytest.raises(FileExistsError):
        os.link(a, b)
    with pytest.raises(PermissionError):
        os.link(wdir, wdir / "dirlink")
    a.unlink()
    time.sleep(SETTLE_S)
    assert b.read_bytes() == b"shared"
    assert os.stat(b).st_nlink == 1


def test_special_files_are_metadata_only(wdir: Path) -> None:
    os.mkfifo(wdir / "fifo", 0o640)
    os.mknod(wdir / "null", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    os.mknod(wdir / "plain", 0o644 | stat.S_IFREG)
    fifo, dev = os.stat(wdir / "fifo"), os.stat(wdir / "null")
    assert stat.S_ISFIFO(fifo.st_mode) and stat.S_IMODE(fifo.st_mode) == 0o640
    assert stat.S_ISCHR(dev.st_mode) and dev.st_rdev == os.makedev(1, 3)
    assert stat.S_ISREG(os.stat(wdir / "plain").st_mode)
    assert (wdir / "plain").read_bytes() == b""
    os.unlink(wdir / "fifo")
    os.unlink(wdir / "null")


def test_posix_fallocate_grows_the_file(wdir: Path) -> None:
    """fallocate(2) itself is EOPNOTSUPP (pyfuse3 has no fallocate handler, docs/posix.md);
    glibc's posix_fallocate then writes the range, which is what programs call."""
    p = wdir / "f"
    p.write_bytes(b"abc")
    with open(p, "r+b") as f:
        os.posix_fallocate(f.fileno(), 0, 1 * MiB)
    assert os.stat(p).st_size == 1 * MiB
    assert p.read_bytes()[:4] == b"abc\0"


# --- other users -------------------------------------------------------------------------------


def _as_nobody(directory: Path, code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a Python that opened ``directory`` (as ``d``, a directory fd: the
    test's tmp above the mount is root's alone) and then became ``nobody``."""
    nobody = pwd.getpwnam("nobody")
    prelude = (
        f"import os\nd = os.open({str(directory)!r}, os.O_RDONLY)\n"
        f"os.setgroups([]); os.setgid({nobody.pw_gid}); os.setuid({nobody.pw_uid})\n"
    )
    return subprocess.run(
        [sys.executable, "-c", prelude + code],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_other_users_get_kernel_permission_checks(wdir: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the mount allows other users when root mounts it")
    os.chmod(wdir, 0o755)
    (wdir / "public").write_bytes(b"for all")
    os.chmod(wdir / "public", 0o644)
    (wdir / "secret").write_bytes(b"root only")
    os.chmod(wdir / "secret", 0o600)
    os.mkdir(wdir / "open")
    os.chmod(wdir / "open", 0o777)
    r = _as_nobody(
        wdir,
        """
def attempt(name, flags):
    try:
        os.close(os.open(name, flags, 0o644, dir_fd=d))
        print("ok", name)
    except PermissionError:
        print("EACCES", name)

fd = os.open("public", os.O_RDONLY, dir_fd=d)
print(os.read(fd, 100).decode())
attempt("secret", os.O_RDONLY)
attempt("public", os.O_WRONLY)
attempt("mine", os.O_WRONLY | os.O_CREAT)
attempt("open/mine", os.O_WRONLY | os.O_CREAT)
print(os.stat("open/mine", dir_fd=d).st_uid)
""",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "for all",
        "EACCES secret",
        "EACCES public",
        "EACCES mine",
        "ok open/mine",
        "65534",
    ]


# --- round trips: cp -a, rsync -aHX, tar -------------------------------------------------------


def _make_tree(root: Path) -> None:
    root.mkdir()
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "data.bin").write_bytes(os.urandom(3 * MiB + 17))
    (root / "small.txt").write_text("hello\n")
    (root / "empty").write_bytes(b"")
    (root / "sub" / "deeper" / "x").write_bytes(os.urandom(1000))
    os.link(root / "small.txt", root / "sub" / "hardlink.txt")
    os.symlink("../small.txt", root / "sub" / "rel-link")
    os.symlink("/absolutely/nowhere", root / "dangling")
    os.setxattr(root / "data.bin", "user.checksum", b"abc123")
    os.setxattr(root / "sub", "user.dir.note", b"a directory's xattr")
    os.chmod(root / "small.txt", 0o640)
    os.chmod(root / "sub" / "deeper", 0o750)
    t = 1_500_000_000_000_000_000
    for i, p in enumerate(sorted(root.rglob("*"), key=lambda p: -len(p.parts))):
        os.utime(p, ns=(t + i * 1_000_000_007, t + i * 1_000_000_009), follow_symlinks=False)
    os.utime(root, ns=(t, t))


def _snapshot(root: Path) -> dict[str, tuple[object, ...]]:
    """Everything a copy must keep, per relative path: kind, mode, mtime, content or link
    target, xattrs (ours, virtual, left out) and which names share an inode."""
    out: dict[str, tuple[object, ...]] = {}
    inodes: dict[int, list[str]] = {}
    for p in [root, *sorted(root.rglob("*"))]:
        rel = str(p.relative_to(root))
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            body: object = os.readlink(p)
            xattrs: dict[str, bytes] = {}
        else:
            body = p.read_bytes() if stat.S_ISREG(st.st_mode) else None
            xattrs = {
                n: os.getxattr(p, n) for n in sorted(os.listxattr(p)) if not n.startswith(OURS)
            }
        if stat.S_ISREG(st.st_mode):
            inodes.setdefault(st.st_ino, []).append(rel)
        out[rel] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_mtime_ns, body, xattrs)
    for names in inodes.values():
        for name in names:
            out[name] = (*out[name], tuple(sorted(names)))
    return out


def _assert_same(a: Path, b: Path, *, how: str) -> None:
    sa, sb = _snapshot(a), _snapshot(b)
    assert sa.keys() == sb.keys(), how
    diff = [k for k in sa if sa[k] != sb[k]]
    assert not diff, f"{how}: {[(k, sa[k][:3], sb[k][:3]) for k in diff]}"


@pytest.mark.parametrize("tool", ["cp", "rsync", "tar"])
def test_round_trip_in_out_and_inside(wdir: Path, tmp_path: Path, tool: str) -> None:
    local = tmp_path / "orig"
    _make_tree(local)

    def copy(src: Path, dst: Path) -> None:
        if tool == "cp":
            _run("cp", "-a", "--preserve=all", src, dst)
        elif tool == "rsync":
            _run("rsync", "-aHX", f"{src}/", dst)
        else:
            dst.mkdir()
            archive = tmp_path / f"{dst.name}.tar"
            _run(
                "tar",
                "--format=posix",
                "--xattrs",
                "--xattrs-include=user.*",
                "-cf",
                archive,
                "-C",
                src,
                ".",
            )
            _run("tar", "--xattrs", "--xattrs-include=user.*", "-xpf", archive, "-C", dst)

    copy(local, wdir / "in")
    _assert_same(local, wdir / "in", how=f"{tool} into the mount")
    copy(wdir / "in", wdir / "inside")
    _assert_same(local, wdir / "inside", how=f"{tool} inside the mount")
    copy(wdir / "inside", tmp_path / "out")
    _assert_same(local, tmp_path / "out", how=f"{tool} out of the mount")


def test_unlinked_file_being_written_counts_no_link(wdir: Path) -> None:
    with open(wdir / "w", "wb") as f:
        f.write(b"data")
        os.unlink(wdir / "w")
        assert os.fstat(f.fileno()).st_nlink == 0
        f.write(b"more")
        f.flush()
        again = os.open(f"/proc/self/fd/{f.fileno()}", os.O_RDONLY)  # reopens the inode
        try:
            assert os.pread(again, 8, 0) == b"datamore"
        finally:
            os.close(again)
