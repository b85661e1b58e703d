"""The metadata benchmark runs (tiny) so it cannot rot; its figures are not asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_bench_metadata_smoke(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.bench_metadata",
            "--smoke",
            "--json",
            "--data-dir",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert [r["servers"] for r in result["runs"]] == [1, 2]
    for r in result["runs"]:
        assert r["errors"] == 0
        assert r["files"] > 0 and r["one_dir_per_s"] > 0 and r["lookups_per_s"] > 0
    assert result["raw_sqlite"][0]["commits_per_s"] > 0
