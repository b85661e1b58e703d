"""A real small filesystem for disk-full tests (test_chunkstore, test_metadata).

Why tmpfs: ENOSPC must come from the kernel at a real write or fsync, not from a mock, and
a tmpfs of a few MiB fills in milliseconds. Where mounting is not allowed the test skips.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def small_tmpfs(tmp_path: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (mount's ``size=`` option, e.g. ``"3m"``) at
    ``tmp_path/small``, yield it, and always unmount it (lazily, so an open file cannot
    keep it)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
        capture_output=True,
        check=False,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)
