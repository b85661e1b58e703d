"""Pieces several bench scripts share, so each figure is produced the same way everywhere."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tectonic_py.client import FileWriter


async def write_repeated(w: FileWriter, piece: bytes, size: int) -> None:
    """Write ``size`` bytes to ``w`` as slices of ``piece`` (at most ``len(piece)`` per call),
    then close it: the data pattern is fixed so runs compare, and the close is part of the
    write (it commits the last block)."""
    left = size
    while left:
        n = min(left, len(piece))
        await w.write(memoryview(piece)[:n])
        left -= n
    await w.close()


def print_results(results: Any, as_json: bool, format_table: Callable[[Any], str]) -> None:
    """``--json``: one JSON object on a line (what run_all reads); otherwise the table."""
    if as_json:
        json.dump(results, sys.stdout)
        print()
    else:
        print(format_table(results))
