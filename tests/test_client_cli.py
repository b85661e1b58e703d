"""``tectonic put/get/ls/stat/mkdir/rm`` as a user runs them, against a real local cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


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
