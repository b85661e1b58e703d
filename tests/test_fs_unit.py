"""The FUSE layer's pure parts: errno mapping, handler wrapping, lookup counts, handle table."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pyfuse3
import pytest
import trio

from tectonic_py.cli import mount as fs_cli
from tectonic_py.core import errors
from tectonic_py.mount import errno_map as fs
from tectonic_py.mount import namespace
from tectonic_py.mount.inode_cache import InodeCache


def _all_error_classes() -> list[type[errors.TectonicError]]:
    out, todo = [], [errors.TectonicError]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def test_every_domain_error_has_an_explicit_errno():
    # A new error class must be given its errno on purpose, not fall through to EIO.
    missing = [c.__name__ for c in _all_error_classes() if c not in fs.ERRNO]
    assert missing == []


@pytest.mark.parametrize(
    "exc, code",
    [
        (errors.FileNotFound("x"), errno.ENOENT),
        (errors.FileExists("x"), errno.EEXIST),
        (errors.NotADirectory("x"), errno.ENOTDIR),
        (errors.IsADirectory("x"), errno.EISDIR),
        (errors.DirectoryNotEmpty("x"), errno.ENOTEMPTY),
        (errors.InvalidName("x"), errno.EINVAL),
        (errors.NoSpace("x"), errno.ENOSPC),
        (errors.DiskFull("x"), errno.ENOSPC),
        (errors.QuorumLost("x"), errno.EIO),
        (errors.ShardUnavailable("x"), errno.EIO),
        (errors.StaleWriterToken("x"), errno.ESTALE),
        (errors.Timeout("x"), errno.ETIMEDOUT),
        (errors.error_from_code("nonsense", "from a newer server"), errno.EIO),
        (pyfuse3.FUSEError(errno.EXDEV), errno.EXDEV),
        (RuntimeError("bug"), errno.EIO),
        (ExceptionGroup("g", [ValueError("a"), errors.NoSpace("b")]), errno.ENOSPC),
        (ExceptionGroup("g", [ValueError("a")]), errno.EIO),
    ],
)
def test_errno_of(exc, code):
    assert fs.errno_of(exc) == code


def test_a_new_subclass_inherits_its_parents_errno():
    class Quota(errors.NoSpace):
        pass

    assert fs.errno_of(Quota("over quota")) == errno.ENOSPC


class _Ops:
    """Just enough of an Operations object for the handler wrapper."""

    @fs.fuse_op
    async def boom(self, exc):
        raise exc


@pytest.mark.parametrize(
    "exc, code, level",
    [
        (errors.FileNotFound("no such"), errno.ENOENT, None),
        (errors.QuorumLost("4 of 9 chunk stores took block 7"), errno.EIO, logging.ERROR),
        (KeyError("bug"), errno.EIO, logging.ERROR),
        (pyfuse3.FUSEError(errno.EBADF), errno.EBADF, None),
    ],
)
async def test_handlers_raise_only_fuse_errors(exc, code, level, caplog):
    caplog.set_level(logging.DEBUG, logger="tectonic_py.mount")
    with pytest.raises(pyfuse3.FUSEError) as info:
        await _Ops().boom(exc)
    assert info.value.errno == code
    worst = max((r.levelno for r in caplog.records), default=None)
    if level is None:
        assert worst is None or worst < logging.WARNING
    else:
        assert worst == level
        # One clear line that names what failed.
        assert type(exc).__name__ in caplog.text or "internal error" in caplog.text


class _Sleeper:
    @fs.fuse_op
    async def nap(self):
        await trio.sleep_forever()


async def test_cancellation_is_not_swallowed():
    # Unmount cancels handlers in flight: a Cancelled must pass through, not become EIO.
    with trio.move_on_after(0.01) as scope:
        await _Sleeper().nap()
    assert scope.cancelled_caught


def test_names():
    assert namespace.fuse_name(b"rank_0.pt") == "rank_0.pt"
    assert namespace.fuse_name("ünïcode".encode()) == "ünïcode"
    with pytest.raises(pyfuse3.FUSEError) as info:
        namespace.fuse_name(b"x" * 256)
    assert info.value.errno == errno.ENAMETOOLONG
    with pytest.raises(errors.InvalidName):
        namespace.fuse_name(b"\xff\xfe")


def test_lookup_counts():
    cache = InodeCache()
    cache.remember(5)
    cache.remember(5, 2)
    assert cache.lookup_count(5) == 3
    assert cache.forget(5, 2) is False
    assert cache.forget(5, 1) is True
    assert cache.lookup_count(5) == 0 and 5 not in cache.lookups


def test_forget_more_than_counted_logs_and_clamps(caplog):
    cache = InodeCache()
    cache.remember(9)
    assert cache.forget(9, 3) is True
    assert "only 1 lookups" in caplog.text
    assert cache.lookup_count(9) == 0


def test_handles_share_one_open_file_and_count_writers():
    cache = InodeCache()
    ofile = cache.open_file(7)
    assert cache.open_file(7) is ofile
    ofile.writer = object()
    w1 = cache.add_handle(ofile, readable=False, writable=True)
    w2 = cache.add_handle(ofile, readable=True, writable=True)
    r1 = cache.add_handle(ofile, readable=True, writable=False)
    assert len({w1.fh, w2.fh, r1.fh}) == 3
    assert ofile.write_handles == 2 and cache.writing(7) is ofile

    _, last_writer, last = cache.remove_handle(w1.fh)
    assert (last_writer, last) == (False, False)
    _, last_writer, last = cache.remove_handle(w2.fh)
    assert (last_writer, last) == (True, False)  # seal now, a reader is still open
    ofile.writer = None
    assert cache.writing(7) is None
    _, last_writer, last = cache.remove_handle(r1.fh)
    assert (last_writer, last) == (False, True)
    assert cache.drop_if_idle(ofile) and 7 not in cache.open_files
    with pytest.raises(KeyError):
        cache.handle(w1.fh)


def test_open_file_stays_while_its_writer_is_sealing():
    # A release that is still sealing keeps the OpenFile (and its lock) in the table, so a
    # racing open waits for the seal instead of stealing the writer token.
    cache = InodeCache()
    ofile = cache.open_file(3)
    ofile.writer = object()
    h = cache.add_handle(ofile, readable=False, writable=True)
    cache.remove_handle(h.fh)
    assert cache.drop_if_idle(ofile) is False
    assert cache.open_file(3) is ofile
    ofile.writer = None
    assert cache.drop_if_idle(ofile) is True
    assert cache.open_file(3) is not ofile


def test_dir_handles():
    cache = InodeCache()
    dh = cache.open_dir(1)
    assert cache.dir_handle(dh.fh) is dh
    cache.close_dir(dh.fh)
    with pytest.raises(KeyError):
        cache.dir_handle(dh.fh)


def test_mountinfo_parsing(monkeypatch, tmp_path):
    line = (
        "36 35 0:52 / /tmp/with\\040space rw,nosuid - fuse.tectonic tectonic:local rw\n"
        "37 35 0:61 / /tmp/with\\040space rw,nosuid - fuse.tectonic tectonic:local rw\n"
    )
    fake = tmp_path / "mountinfo"
    fake.write_text(line)
    real_open = open
    monkeypatch.setattr(
        "builtins.open",
        lambda p, *a, **k: real_open(fake if p == "/proc/self/mountinfo" else p, *a, **k),
    )
    assert fs_cli.mount_device("/tmp/with space") == "0:61"
    assert fs_cli.mount_device("/elsewhere") is None


def test_cli_parses_mount_and_umount():
    from tectonic_py.cli import main as cli

    args = cli.build_parser().parse_args(
        ["mount", "c.toml", "/mnt/x", "--foreground", "--allow-other"]
    )
    assert (args.cluster_file, args.mountpoint, args.foreground, args.allow_other) == (
        "c.toml",
        "/mnt/x",
        True,
        True,
    )
    assert args.func is fs_cli.cmd_mount
    args = cli.build_parser().parse_args(["mount", "c.toml", "/mnt/x"])
    assert args.allow_other is None  # decided by who mounts: on for root
    args = cli.build_parser().parse_args(["mount", "c.toml", "/mnt/x", "--no-allow-other"])
    assert args.allow_other is False
    args = cli.build_parser().parse_args(["umount", "/mnt/x"])
    assert args.func is fs_cli.cmd_umount


def test_allow_other_by_default_for_root_only(monkeypatch):
    from tectonic_py.core.cluster_file import ClusterConfig, MetadataServer

    config = ClusterConfig("c", Path("s"), 1, [MetadataServer("127.0.0.1:1", [0])])
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert {"allow_other", "default_permissions"} <= fs_cli.mount_options(config, allow_other=None)
    assert "allow_other" not in fs_cli.mount_options(config, allow_other=False)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "allow_other" not in fs_cli.mount_options(config, allow_other=None)
    assert "allow_other" in fs_cli.mount_options(config, allow_other=True)


def test_mount_refuses_bad_mountpoints(tmp_path, capsys):
    from tectonic_py.cli import main as cli

    missing = tmp_path / "nope"
    cfg = tmp_path / "cluster.toml"
    cfg.write_text(
        'secret_file = "s"\nshards = 1\n[[metadata_servers]]\n'
        'address = "127.0.0.1:1"\nshards = [0]\n'
    )
    assert cli.main(["mount", str(cfg), str(missing), "--foreground"]) == 1
    assert "is not a directory" in capsys.readouterr().err
    assert cli.main(["umount", str(tmp_path)]) == 1
    assert "is not mounted" in capsys.readouterr().err
