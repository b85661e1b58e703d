"""The one question about a directory's Name entries that the File layer asks: any at all?

Kept below both layers (metadata/name_layer.py owns the ``names`` table, and builds on
metadata/file_layer.py), so that ``file_layer.kill_dir`` can check a directory is empty in
its own transaction without the File layer importing the Name layer.
"""

from __future__ import annotations

import sqlite3


def has_entries(conn: sqlite3.Connection, dir_id: int) -> bool:
    return (
        conn.execute("SELECT 1 FROM names WHERE dir_id = ? LIMIT 1", (dir_id,)).fetchone()
        is not None
    )
