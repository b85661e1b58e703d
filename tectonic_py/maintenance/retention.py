"""Retention: the maintenance service that keeps the newest N committed steps of a directory.

Each round asks every shard for its policies (``tectonic retention set``) and makes one
retention pass over each directory (``MetadataClient.apply_retention``, metadata/
retention_calls.py): the steps past the newest N, less those a symbolic link names, are
renamed to hidden tombs in one transaction of the directory's shard, then emptied and
removed. A round follows each ``tectonic commit`` within ``--retention-interval`` seconds.

Safe to kill at any moment: a step is under its name, whole, until the transaction that
renames it; after that it is a hidden tomb that the next round finishes removing
(metadata/retention_ops.py).
"""

from __future__ import annotations

import logging

from tectonic_py.core.errors import FileNotFound, NotADirectory
from tectonic_py.maintenance.runtime import Maintenance

log = logging.getLogger(__name__)


class Retention:
    """The retention service of one maintenance process."""

    def __init__(self, m: Maintenance) -> None:
        self.m = m

    async def round(self) -> int:
        """One pass over every policy; how many steps went."""
        meta = self.m.meta
        retired = 0
        for dir_id, _, path in await meta.retention_policies(self.m.config.shards):
            try:
                names = await meta.apply_retention(dir_id)
            except (FileNotFound, NotADirectory):
                log.info("retention: %s is gone; its policy with it", path or dir_id)
                continue
            for name in names:
                log.info("retention: %s/%s retired", path, name)
            self.m.counters.steps_retired += len(names)
            retired += len(names)
        return retired
