"""Real programs on a real FUSE mount of a real cluster: every checkpoint writer in
docs/checkpoint-io.md, POSIX corner cases they rely on, and crashes (kill -9 of the mount,
of a chunk store, of too many chunk stores)."""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from fuse_fixtures import REPO_ROOT, Mount

# torch is installed by deploy/install.sh (a pinned CPU wheel), not by the test extra
torch = pytest.importorskip("torch", reason="needs torch (deploy/install.sh installs it)")

pytestmark = pytest.mark.fuse

MiB = 1024 * 1024
SUBPROCESS_TIMEOUT_S = 180


@pytest.fixture
def wdir(shared_mount: Mount, request: pytest.FixtureRequest) -> Path:
    d = shared_mount.path / request.node.name.replace("[", "_").replace("]", "")
    d.mkdir()
    return d


def _state_dict(total_bytes: int, tensors: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    per = total_bytes // (tensors - 2) // 4
    sd = {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(tensors - 2)}
    sd["odd"] = torch.randn(4097, generator=g)  # not a multiple of anything
    sd["tiny"] = torch.randn(3, 3, generator=g)
    return sd


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _python(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    full_env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), **(env or {}))
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=REPO_ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc: subprocess.Popen[str], timeout: float = SUBPROCESS_TIMEOUT_S) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return proc.returncode, out


def _wait_size(path: Path, size: int, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    """Wait (bounded) until ``path`` has grown past ``size`` while ``proc`` writes it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if path.stat().st_size >= size:
                return
        except FileNotFoundError:
            pass
        if proc.poll() is not None:
            raise AssertionError(f"the writer ended early: {_finish(proc)[1][-2000:]}")
        time.sleep(0.02)
    raise AssertionError(f"{path} never reached {size} bytes")


# --- torch --------------------------------------------------------------------------------------


def test_torch_save_load_all_modes_and_resave(wdir: Path) -> None:
    sd = _state_dict(200 * MiB)
    path = wdir / "rank_0.pt"
    torch.save(sd, path)
    assert path.stat().st_size > 200 * MiB
    assert _equal(sd, torch.load(path))
    assert _equal(sd, torch.load(path, weights_only=True))
    mapped = torch.load(path, mmap=True)
    assert _equal(sd, mapped)
    # Re-save over the existing checkpoint (O_TRUNC in place) while the old one is mapped.
    sd2 = _state_dict(24 * MiB, seed=1)
    torch.save(sd2, path)
    assert _equal(sd2, torch.load(path, weights_only=True))
    del mapped


DCP_RANK = """
import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
g = torch.Generator().manual_seed(rank)
sd = {f"rank{rank}.w{i}": torch.randn(1 << 18, generator=g) for i in range(4)}
for _ in range(2):  # the second save writes over the first checkpoint
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(sys.argv[1], thread_count=2, overwrite=True))
dist.barrier()
back = {k: torch.empty_like(v) for k, v in sd.items()}
dcp.load(back, storage_reader=dcp.FileSystemReader(sys.argv[1]))
assert all(torch.equal(sd[k], back[k]) for k in sd), "mismatch"
dist.destroy_process_group()
print("RANK-OK", rank)
"""


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint:UserWarning")
def test_dcp_threads_and_resave(wdir: Path) -> None:
    import torch.distributed.checkpoint as dcp

    sd = _state_dict(32 * MiB, tensors=12)
    ckpt = wdir / "step_100"
    for _ in range(2):
        dcp.save(
            sd,
            storage_writer=dcp.FileSystemWriter(ckpt, thread_count=4, overwrite=True),
            no_dist=True,
        )
    names = sorted(os.listdir(ckpt))
    assert ".metadata" in names and sum(n.endswith(".distcp") for n in names) == 4
    back = {k: torch.empty_like(v) for k, v in sd.items()}
    dcp.load(back, storage_reader=dcp.FileSystemReader(ckpt), no_dist=True)
    assert _equal(sd, back)


def test_dcp_four_processes_one_checkpoint(wdir: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ckpt = wdir / "ckpt"
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "4",
        "GLOO_SOCKET_IFNAME": "lo",
    }
    procs = [_python(DCP_RANK, str(ckpt), env={**env, "RANK": str(r)}) for r in range(4)]
    results = [_finish(p) for p in procs]
    for rc, out in results:
        assert rc == 0 and "RANK-OK" in out, out[-3000:]
    assert sum(n.endswith(".distcp") for n in os.listdir(ckpt)) >= 4


# --- other writers ------------------------------------------------------------------------------


def test_safetensors_save_load_safe_open(wdir: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    sd = _state_dict(24 * MiB, seed=2)
    path = wdir / "model.safetensors"
    save_file(sd, path)
    sd2 = _state_dict(8 * MiB, seed=3)
    save_file(sd2, path)  # tmp + ftruncate + rename over the existing file while open
    assert (path.stat().st_mode & 0o777) == 0o600  # the O_EXCL create mode is kept
    assert _equal(sd2, load_file(path))
    with safe_open(str(path), "pt") as f:
        assert torch.equal(f.get_tensor("odd"), sd2["odd"])
    assert [n for n in os.listdir(wdir) if n.startswith(".tmp")] == []


def test_numpy_save_load_memmap(wdir: Path) -> None:
    a = np.random.default_rng(4).random(5_000_000, dtype=np.float32)
    path = wdir / "a.npy"
    np.save(path, a)
    assert np.array_equal(np.load(path), a)
    mm = np.load(path, mmap_mode="r")  # MAP_SHARED: needs no direct_io
    assert np.array_equal(mm, a)
    del mm


def test_cp_cp_a_tar_round_trips(wdir: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    rng = np.random.default_rng(5)
    sizes = {"empty": 0, "small": 1000, "block": 6 * MiB, "block+1": 6 * MiB + 1}
    for name, size in sizes.items():
        (src / "sub" / name).write_bytes(rng.bytes(size))
    os.chmod(src / "sub" / "small", 0o640)
    subprocess.run(["cp", "-r", str(src / "sub"), str(wdir / "cp")], check=True)
    subprocess.run(["cp", "-a", str(src / "sub"), str(wdir / "cpa")], check=True)
    subprocess.run(["tar", "cf", str(wdir / "t.tar"), "-C", str(src), "sub"], check=True)
    (wdir / "x").mkdir()
    subprocess.run(["tar", "xf", str(wdir / "t.tar"), "-C", str(wdir / "x")], check=True)
    subprocess.run(
        ["tar", "cf", str(tmp_path / "back.tar"), "-C", str(wdir / "cpa"), "."], check=True
    )
    for name in sizes:
        for copy in (wdir / "cp" / name, wdir / "cpa" / name, wdir / "x" / "sub" / name):
            subprocess.run(["cmp", str(src / "sub" / name), str(copy)], check=True)
    st_src, st_cpa = os.stat(src / "sub" / "small"), os.stat(wdir / "cpa" / "small")
    assert (st_cpa.st_mode & 0o777) == 0o640
    assert st_cpa.st_mtime_ns == st_src.st_mtime_ns
    assert (st_cpa.st_mode & 0o777) == (os.stat(wdir / "x" / "sub" / "small").st_mode & 0o777)


def test_fsspec_put_get(wdir: Path, tmp_path: Path) -> None:
    import fsspec

    fs = fsspec.filesystem("file")
    data = np.random.default_rng(6).bytes(7 * MiB + 3)
    (tmp_path / "in.bin").write_bytes(data)
    fs.makedirs(str(wdir / "a" / "b"), exist_ok=True)
    fs.put(str(tmp_path / "in.bin"), str(wdir / "a" / "b" / "x.bin"))
    fs.get(str(wdir / "a" / "b" / "x.bin"), str(tmp_path / "out.bin"))
    assert (tmp_path / "out.bin").read_bytes() == data
    with fs.open(str(wdir / "a" / "y.bin"), "wb") as f:
        f.write(data)
    assert fs.info(str(wdir / "a" / "y.bin"))["size"] == len(data)
    fs.mv(str(wdir / "a" / "y.bin"), str(wdir / "a" / "z.bin"))
    assert fs.cat_file(str(wdir / "a" / "z.bin")) == data
    fs.rm(str(wdir / "a"), recursive=True)
    assert not fs.exists(str(wdir / "a"))


# --- POSIX semantics the writers rely on --------------------------------------------------------


def test_create_open_flags_and_sizes(wdir: Path) -> None:
    p = str(wdir / "f")
    assert not os.path.exists(p)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with pytest.raises(FileExistsError):
            os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, b"a" * 5000)
        assert os.fstat(fd).st_size == 5000  # the size written so far, while writing
        fd2 = os.dup(fd)
        os.write(fd2, b"b" * 100)
        os.close(fd2)  # a flush; the file stays open through fd
        os.write(fd, b"c")
    finally:
        os.close(fd)
    assert os.stat(p).st_size == 5101
    assert (os.stat(p).st_mode & 0o777) == 0o600
    with open(p, "rb") as f:
        assert f.read() == b"a" * 5000 + b"b" * 100 + b"c"
    with open(p, "wb") as f:  # O_TRUNC of an existing file
        f.write(b"new")
    assert Path(p).read_bytes() == b"new"
    os.truncate(p, 0)  # a path truncate, with no handle open
    assert os.stat(p).st_size == 0


def test_sparse_truncate_and_overwrites(wdir: Path) -> None:
    p = wdir / "sparse"
    block = 6 * MiB  # RS(6,3) with 1 MiB chunks
    expect = bytearray(2 * block + 12345)
    rng = np.random.default_rng(7)
    with open(p, "r+b" if p.exists() else "w+b") as f:
        f.truncate(len(expect))  # grow sparse first (safetensors)
        assert os.fstat(f.fileno()).st_size == len(expect)
        assert f.read(100) == bytes(100)
        # Sequential writes over the sparse range, then overwrites of data already sent,
        # across a block boundary and at the very start.
        data = rng.bytes(len(expect))
        f.seek(0)
        f.write(data)
        expect[:] = data
        for off, n in ((block - 1000, 5000), (0, 10), (len(expect) - 7, 7), (3 * MiB, MiB)):
            patch = rng.bytes(n)
            f.seek(off)
            f.write(patch)
            expect[off : off + n] = patch
        f.flush()
        f.seek(block - 2000)
        assert f.read(10000) == bytes(expect[block - 2000 : block + 8000])  # read-your-writes
    assert p.read_bytes() == bytes(expect)
    with open(p, "r+b") as f:
        f.truncate(block + 10)  # cut inside a block, then grow again: zeros, not old bytes
        f.truncate(block + 5000)
    assert p.read_bytes() == bytes(expect[: block + 10]) + bytes(4990)


def test_reads_random_backwards_and_concurrent(wdir: Path) -> None:
    data = np.random.default_rng(8).bytes(20 * MiB + 17)
    p = wdir / "r.bin"
    p.write_bytes(data)
    fd = os.open(p, os.O_RDONLY)
    try:
        for off in range(len(data) - 4096, 0, -(3 * MiB + 4099)):  # backwards, as zip readers
            assert os.pread(fd, 4096, off) == data[off : off + 4096]
        assert os.pread(fd, 100, len(data) - 10) == data[-10:]  # short at EOF
        assert os.pread(fd, 100, len(data) + 10) == b""
        errors: list[str] = []

        def worker(seed: int) -> None:
            rng = np.random.default_rng(seed)
            for _ in range(20):
                off = int(rng.integers(0, len(data)))
                n = int(rng.integers(1, 2 * MiB))
                if os.pread(fd, n, off) != data[off : off + n]:
                    errors.append(f"{off}+{n}")

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert errors == []
    finally:
        os.close(fd)


def test_unlinked_open_files_stay_usable(wdir: Path) -> None:
    data = os.urandom(3 * MiB)
    r = wdir / "r"
    r.write_bytes(data)
    with open(r, "rb") as f:
        os.unlink(r)
        assert not r.exists()
        assert f.read() == data
    w = wdir / "w"
    with open(w, "w+b") as f:
        f.write(data)
        f.flush()
        os.unlink(w)
        f.write(b"tail")
        f.seek(0)
        assert f.read() == data + b"tail"
    assert os.listdir(wdir) == []


def test_rename_over_existing_while_source_open(wdir: Path) -> None:
    (wdir / "target").write_bytes(b"old")
    with open(wdir / "target", "rb") as reader:
        with open(wdir / "tmp", "wb") as f:
            f.write(b"new" * 1000)
            os.rename(wdir / "tmp", wdir / "target")
            f.write(b"!")  # written after the rename, flushed and released under the new name
        assert (wdir / "target").read_bytes() == b"new" * 1000 + b"!"
        assert reader.read() == b"old"  # the replaced file stays readable while open
    assert sorted(os.listdir(wdir)) == ["target"]


def test_directories_and_attributes(wdir: Path) -> None:
    d = wdir / "d"
    d.mkdir(mode=0o750)
    with pytest.raises(FileExistsError):
        d.mkdir()
    names = sorted(f"rank_{i:04d}.pt" for i in range(100))
    for n in names:
        (d / n).write_bytes(n.encode())
    assert sorted(os.listdir(d)) == names  # several readdir pages
    assert {e.name: e.stat().st_size for e in os.scandir(d)} == {n: len(n) for n in names}
    with pytest.raises(OSError) as info:
        os.rmdir(d)
    assert info.value.errno == errno.ENOTEMPTY
    f = d / names[0]
    os.chmod(f, 0o604)
    os.chown(f, 1234, 5678)
    os.utime(f, ns=(1_000_000_000_123, 2_000_000_000_456))
    st = os.stat(f)
    assert (st.st_mode & 0o777, st.st_uid, st.st_gid) == (0o604, 1234, 5678)
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_000_123, 2_000_000_000_456)
    with pytest.raises(FileNotFoundError):
        os.stat(d / "nope")
    with pytest.raises(NotADirectoryError):
        os.listdir(f)
    shutil.rmtree(d)
    assert not d.exists()
    vfs = os.statvfs(wdir)
    assert vfs.f_blocks > 0 and 0 < vfs.f_bavail <= vfs.f_blocks and vfs.f_namemax == 255
    with pytest.raises(OSError) as info:
        (wdir / ("x" * 256)).write_bytes(b"")
    assert info.value.errno == errno.ENAMETOOLONG


def test_ec_policy_xattr(wdir: Path) -> None:
    assert os.getxattr(wdir, "user.tectonic.ec") == b"rs-6-3"
    os.setxattr(wdir, "user.tectonic.ec", b"rs-4-2")
    (wdir / "f").write_bytes(os.urandom(MiB))
    assert os.getxattr(wdir / "f", "user.tectonic.ec") == b"rs-4-2"
    # Read by name, never listed (cp -a and rsync -X copy what is listed, and rsync removes
    # from a copy what its source lacks).
    assert "user.tectonic.ec" not in os.listxattr(wdir / "f")
    assert "user.tectonic.ec" not in os.listxattr(wdir)
    os.setxattr(wdir / "f", "user.tectonic.ec", b"rs-4-2")  # its own value: nothing changes
    with pytest.raises(OSError) as info:
        os.setxattr(wdir, "user.tectonic.ec", b"rs-99-1")
    assert info.value.errno == errno.EINVAL
    with pytest.raises(OSError) as info:
        os.setxattr(wdir / "f", "user.tectonic.ec", b"rs-6-3")
    assert info.value.errno == errno.EPERM
    with pytest.raises(OSError) as info:
        os.getxattr(wdir / "f", "security.capability")
    assert info.value.errno == errno.ENODATA
    os.setxattr(wdir / "f", "user.note", b"hello")
    assert os.getxattr(wdir / "f", "user.note") == b"hello"
    with pytest.raises(OSError) as info:
        os.getxattr(wdir / "f", "user.missing")
    assert info.value.errno == errno.ENODATA


def test_many_writers_at_once(wdir: Path) -> None:
    """Several threads and processes each writing files at once (several ranks per node)."""
    payloads = {f"t{i}": os.urandom(3 * MiB + i) for i in range(6)}

    def write(name: str) -> None:
        with open(wdir / name, "wb") as f:
            for i in range(0, len(payloads[name]), 256 * 1024):
                f.write(payloads[name][i : i + 256 * 1024])

    code = """
    import sys, numpy as np
    data = np.random.default_rng(int(sys.argv[2])).bytes(5 << 20)
    open(sys.argv[1], "wb").write(data)
    """
    procs = [_python(code, str(wdir / f"p{i}"), str(i)) for i in range(2)]
    threads = [threading.Thread(target=write, args=(n,)) for n in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for p in procs:
        assert _finish(p)[0] == 0
    for name, data in payloads.items():
        assert (wdir / name).read_bytes() == data
    for i in range(2):
        assert (wdir / f"p{i}").read_bytes() == np.random.default_rng(i).bytes(5 << 20)


# --- crashes ------------------------------------------------------------------------------------

SAVER = """
import sys, torch
g = torch.Generator().manual_seed(int(sys.argv[2]))
sd = {f"w{i}": torch.randn(int(sys.argv[3]) // 16 // 4, generator=g) for i in range(16)}
torch.save(sd, sys.argv[1])
back = torch.load(sys.argv[1], weights_only=True)
assert all(torch.equal(sd[k], back[k]) for k in sd)
print("SAVED-OK")
"""


def _saved(seed: int, total: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(total // 16 // 4, generator=g) for i in range(16)}


def test_kill_mount_mid_save_leaves_no_fake_checkpoint(mount: Mount) -> None:
    done = _saved(1, 16 * MiB)
    torch.save(done, mount / "step_1.pt")
    proc = _python(SAVER, str(mount / "step_2.pt"), "2", str(96 * MiB))
    try:
        _wait_size(mount / "step_2.pt", 24 * MiB, proc)
        mount.kill()  # kill -9 of the mount process mid torch.save
        rc, out = _finish(proc, timeout=60)
        assert rc != 0 and "SAVED-OK" not in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    mount.start()  # remount the same cluster
    assert _equal(done, torch.load(mount / "step_1.pt", weights_only=True))
    partial = mount / "step_2.pt"
    if partial.exists():
        assert partial.stat().st_size < 96 * MiB
        with pytest.raises((RuntimeError, EOFError, pickle.UnpicklingError, OSError)):
            torch.load(partial, weights_only=True)


def test_chunk_store_killed_during_save(mount: Mount) -> None:
    mount.expect_warnings = True  # blocks committed without the dead store's chunk
    total = 64 * MiB
    proc = _python(SAVER, str(mount / "ckpt.pt"), "3", str(total))
    try:
        _wait_size(mount / "ckpt.pt", 12 * MiB, proc)
        mount.cluster.kill_chunkstore(4)
        rc, out = _finish(proc)
        assert rc == 0 and "SAVED-OK" in out, out[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _equal(_saved(3, total), torch.load(mount / "ckpt.pt", weights_only=True))


def test_lost_quorum_is_eio_with_a_clear_log_line(mount: Mount) -> None:
    mount.expect_errors = True
    (mount / "before").write_bytes(b"x" * 1000)
    for i in range(4):  # 5 of 9 left: fewer than the write quorum of RS(6,3)
        mount.cluster.kill_chunkstore(i)
    data = os.urandom(13 * MiB)
    with pytest.raises(OSError) as info, open(mount / "after", "wb") as f:
        f.write(data)
    assert info.value.errno in (errno.EIO, errno.ENOSPC)
    assert any("failed" in line for line in mount.problems()), mount.log_tail()
    # The mount itself lives on (the small file's data is unreadable now: 5 < k chunks left).
    assert (mount / "before").stat().st_size == 1000
    assert sorted(os.listdir(mount.path)) in (["after", "before"], ["before"])


def test_cli_background_mount_umount_and_sigterm(fuse_cluster, tmp_path: Path) -> None:
    """``tectonic mount`` without --foreground returns once mounted; ``tectonic umount``
    unmounts; a foreground mount ends cleanly on SIGTERM. Data survives each remount."""
    import signal

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    cli = [sys.executable, "-m", "tectonic_py.cli.main"]
    ready = tmp_path / "ready.json"
    try:
        r = subprocess.run(
            [
                *cli,
                "mount",
                str(fuse_cluster.cluster_file),
                str(mnt),
                "--ready-file",
                str(ready),
                "--log-file",
                str(tmp_path / "bg.log"),
            ],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert r.returncode == 0, r.stderr
        assert os.path.ismount(mnt) and ready.exists()
        (mnt / "kept").write_bytes(b"kept")
        r = subprocess.run(
            [*cli, "umount", str(mnt)],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert r.returncode == 0, r.stderr
        assert not os.path.ismount(mnt)

        fg_log = tmp_path / "fg.log"
        with open(fg_log, "wb") as log:
            fg = subprocess.Popen(
                [*cli, "-v", "mount", str(fuse_cluster.cluster_file), str(mnt), "--foreground"],
                cwd=REPO_ROOT,
                env=env,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        try:
            deadline = time.monotonic() + 60
            while not os.path.ismount(mnt) and time.monotonic() < deadline:
                assert fg.poll() is None, fg_log.read_text()
                time.sleep(0.05)
            assert (mnt / "kept").read_bytes() == b"kept"
            fg.send_signal(signal.SIGTERM)
            assert fg.wait(timeout=60) == 0
            assert not os.path.ismount(mnt)
        finally:
            if fg.poll() is None:
                fg.kill()
                fg.wait()
    finally:
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True, check=False)
    assert "ERROR" not in (tmp_path / "bg.log").read_text()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tectonic_py.cli.main", *args],
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_unsealed_file_whose_writer_is_gone_is_marked(wdir: Path, shared_mount: Mount) -> None:
    """A writer that fsynced and then died (its lease recovered, as the GC does once it runs
    out): ls -l shows no read bits, the durability xattr says unsealed, root still reads."""
    import trio

    from tectonic_py.client.tectonic_client import open_client

    data = os.urandom(300_000)
    remote = f"/{wdir.name}/unsealed.pt"

    async def leave_unsealed() -> None:
        async with open_client(shared_mount.cluster.cluster_file) as client:
            writer = await client.create(remote, mode=0o644)
            await writer.write(data)
            await writer.fsync()
            meta = client.meta
            shard = meta.shard_of(writer.file_id)
            expired = await meta.expired_leases(shard, before_ns=2**62, limit=10_000)
            lease_ns = dict(expired)[writer.file_id]  # as admin: a lease not yet run out
            await meta.recover_lease(writer.file_id, lease_ns, before_ns=2**62)
            await writer.abort()

    trio.run(leave_unsealed)
    (wdir / "sealed.pt").write_bytes(data)
    listing = subprocess.run(
        ["ls", "-l", str(wdir)], capture_output=True, text=True, check=True
    ).stdout
    modes = {line.split()[-1]: line.split()[0] for line in listing.splitlines()[1:]}
    assert modes == {"sealed.pt": "-rw-r--r--", "unsealed.pt": "--w-------"}, listing
    assert os.getxattr(wdir / "unsealed.pt", "user.tectonic.durability") == b"unsealed"
    assert os.getxattr(wdir / "sealed.pt", "user.tectonic.durability") == b"full"
    assert (wdir / "unsealed.pt").stat().st_size == len(data)
    if os.geteuid() == 0:
        assert (wdir / "unsealed.pt").read_bytes() == data  # what was committed, for root


def test_umount_clears_a_mount_whose_daemon_died(mount: Mount) -> None:
    (mount / "kept").write_bytes(b"kept")
    assert mount.proc is not None
    os.kill(mount.pid, signal.SIGKILL)  # our own mount process, by PID
    mount.proc.wait(timeout=60)
    with pytest.raises(OSError) as info:
        os.stat(mount.path)
    assert info.value.errno == errno.ENOTCONN
    r = _cli("mount", str(mount.cluster.cluster_file), str(mount.path))
    assert r.returncode == 1 and "tectonic umount" in r.stderr, r.stderr
    r = _cli("umount", str(mount.path))
    assert r.returncode == 0, r.stderr
    assert "cleared" in r.stderr and "died" in r.stderr, r.stderr
    assert os.path.isdir(mount.path) and not os.path.ismount(mount.path)
    mount.start()  # and it mounts again on the same directory, data intact
    assert (mount / "kept").read_bytes() == b"kept"
