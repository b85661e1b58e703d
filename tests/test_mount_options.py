"""The mount's tuning options (tectonic_py/cli/mount_options.py): every knob of the data-path
client and of the FUSE layer is a flag and an ``-o`` option with its default taken from the
code, a flag beats ``-o``, mount(8)'s own options are ignored and anything else unknown or
malformed is one line and exit 1 with nothing mounted; docs/mount-options.md is current; a
real mount runs with what it was given (its ready file says so), and ``mount.tectonic`` mounts
as mount(8) runs it."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fuse_fixtures import REPO_ROOT, Mount

from tectonic_py.cli import mount_helper
from tectonic_py.cli import mount_options as knobs
from tectonic_py.cli.main import build_parser
from tectonic_py.core.cluster_file import ClusterConfig, MetadataServer
from tectonic_py.core.errors import ConfigError
from tectonic_py.launch.local_cluster import LocalCluster

MiB = 1024 * 1024


def _cli(*args: str, module: str = "tectonic_py.cli.main") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO_ROOT,
    )


def _one_line(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 1, proc
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def _resolve(*argv: str) -> dict[str, dict]:
    args = build_parser().parse_args(["mount", "c.toml", "/mnt/x", *argv])
    return knobs.resolve(args)


def test_every_knob_of_the_client_and_the_fuse_layer_is_an_option() -> None:
    keys = set(knobs.BY_KEY)
    assert set(knobs.CLIENT_DEFAULTS) <= keys, set(knobs.CLIENT_DEFAULTS) - keys
    assert set(knobs.FUSE_DEFAULTS) <= keys, set(knobs.FUSE_DEFAULTS) - keys
    settings = _resolve()
    for o in knobs.OPTIONS:
        if o.target == "client":
            assert settings["client"].get(o.key, None) == knobs.CLIENT_DEFAULTS[o.key]
        elif o.target == "fuse":
            assert settings["fuse"][o.key] == knobs.FUSE_DEFAULTS[o.key]


def test_flags_beat_o_and_o_beats_defaults() -> None:
    s = _resolve(
        "-o",
        "window_bytes=64MiB,entry_timeout=0.5,noasync_creates,_netdev,x-systemd.automount",
        "-o",
        "pack-limit=0.25,nonempty",
        "--window-bytes",
        "128MiB",
        "--max-packs",
        "8",
    )
    assert s["client"]["window_bytes"] == 128 * MiB  # the flag wins
    assert s["client"]["pack_limit"] == 0.25 and s["client"]["max_packs"] == 8
    assert s["fuse"]["entry_timeout"] == 0.5 and s["fuse"]["async_creates"] is False
    assert s["mount"]["nonempty"] is True
    assert _resolve("--sync-creates")["fuse"]["async_creates"] is False
    assert _resolve("-o", "allow_other=off")["mount"]["allow_other"] is False
    assert knobs.parse_o(["bogus=1,cache_bytes=1MiB"], sloppy=True) == {"cache_bytes": MiB}


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("bogus=1", "unknown mount option 'bogus'"),
        ("window_bytes=lots", "mount option window_bytes: bad size"),
        ("entry_timeout", "needs a value"),
        ("entry_timeout=-1", "0..3600"),
        ("pack_limit=2", "give 0..1"),
        ("max_packs=many", "bad count"),
        ("async_creates=maybe", "give on or off"),
    ],
)
def test_bad_o_options_are_one_clear_error(text: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        knobs.parse_o([text])


def test_bad_options_end_the_command_with_one_line_and_mount_nothing(
    tmp_path: Path, secret_file: Path
) -> None:
    cluster = tmp_path / "c.toml"
    ClusterConfig(
        name="t", secret_file=secret_file, shards=4,
        metadata_servers=[MetadataServer("127.0.0.1:1", [0, 1, 2, 3])],
    ).write(cluster)  # fmt: skip
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    _one_line(_cli("mount", str(cluster), str(mnt), "-o", "bogus=1"), "unknown mount option")
    _one_line(_cli("mount", str(cluster), str(mnt), "-o", "cache_bytes=x"), "cache_bytes")
    bad_flag = _cli("mount", str(cluster), str(mnt), "--pack-limit", "2")
    assert bad_flag.returncode == 2 and "--pack-limit" in bad_flag.stderr
    # mount(8)'s -f: everything checked, nothing mounted, no cluster contacted.
    fake = _cli(str(cluster), str(mnt), "-f", "-o", "rw,_netdev", module=mount_helper.__name__)
    assert fake.returncode == 0, fake.stderr
    helper_bad = _cli(str(cluster), str(mnt), "-f", "-o", "nope", module=mount_helper.__name__)
    _one_line(helper_bad, "unknown mount option 'nope'")
    assert not os.path.ismount(mnt)


def test_mount_helper_translates_mount8s_call() -> None:
    argv, fake = mount_helper.tectonic_argv(
        ["/etc/c.toml", "/mnt/ckpt", "-n", "-s", "-o", "rw,window_bytes=1GiB", "-t", "tectonic"]
    )
    assert argv == ["mount", "/etc/c.toml", "/mnt/ckpt", "-o", "rw,window_bytes=1GiB", "--sloppy"]
    assert fake is False
    assert mount_helper.tectonic_argv(["c", "d", "-f"])[1] is True


def test_the_options_page_is_current() -> None:
    page = (REPO_ROOT / "docs" / "mount-options.md").read_text()
    assert page == knobs.markdown(), (
        "run: python -m tectonic_py.cli.mount_options > docs/mount-options.md"
    )


def test_help_lists_every_option() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[
        "mount"
    ]
    text = sub.format_help()
    for o in knobs.OPTIONS:
        assert o.flag in text, o.flag


def test_a_mount_runs_with_its_options_and_mount_helper_mounts(
    fuse_cluster: LocalCluster, tmp_path: Path
) -> None:
    ready = tmp_path / "ready.json"
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mount = Mount(fuse_cluster, mnt, tmp_path / "mount.log")
    try:
        mount.start(
            "-o",
            "window_bytes=64MiB,entry_timeout=0.5,noasync_creates,_netdev",
            "--cache-bytes",
            "32MiB",
            "--ready-file",
            str(ready),
        )
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        options = json.loads(ready.read_text())["options"]
        assert options["window_bytes"] == 64 * MiB and options["cache_bytes"] == 32 * MiB
        assert options["entry_timeout"] == 0.5 and options["async_creates"] is False
        assert options["pack_limit"] == knobs.CLIENT_DEFAULTS["pack_limit"]
        (mnt / "f").write_bytes(b"x" * 100_000)
        assert (mnt / "f").read_bytes() == b"x" * 100_000
    finally:
        mount.stop()

    # As mount(8) runs it for an fstab line: the helper forks the mount and returns once up.
    second = tmp_path / "mnt2"
    second.mkdir()
    helper = _cli(
        str(fuse_cluster.client_file),
        str(second),
        "-o",
        "rw,_netdev,read_ahead_kb=512,max_packs=2",
        module=mount_helper.__name__,
    )
    try:
        assert helper.returncode == 0, helper.stderr
        assert os.path.ismount(second)
        (second / "g").write_bytes(b"y" * 5000)
        assert (second / "g").read_bytes() == b"y" * 5000
    finally:
        subprocess.run(["fusermount3", "-u", str(second)], capture_output=True, check=False)
        deadline = time.monotonic() + 30
        while os.path.ismount(second) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.ismount(second)
