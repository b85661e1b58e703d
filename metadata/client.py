"""Client of the metadata service: routes each call to the shard that owns its key.

CONTRACT (the data-path client in tectonic_py/client.py and the FUSE layer code against these
signatures; the metadata implementation fills them in without changing them):

Every method raises only ``tectonic_py.errors`` classes (FileNotFound, FileExists,
NotADirectory, IsADirectory, DirectoryNotEmpty, InvalidName, StaleWriterToken, FileSealed,
ShardUnavailable, NoSpace, ...). Operations that span layers (create = File layer record in
the file's shard + Name layer entry in the directory's shard; commit = Block layer in the
block's shard + File layer append in the file's shard) are sequenced here so that a crash
between steps leaves only garbage that is collected later, never a visible half-done state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import trio

from metadata.model import Attrs, BlockGrant, BlockInfo, DirEntry, NodeInfo
from tectonic_py.cluster_file import ClusterConfig


class MetadataClient:
    """One per process; owns pooled connections to every metadata server."""

    def __init__(self, config: ClusterConfig, *, nursery: trio.Nursery) -> None:
        self.config = config
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError

    # --- Name layer (+ File layer records of new entries) ----------------------------------

    async def lookup(self, dir_id: int, name: str) -> Attrs:
        """Attrs of the child ``name`` of ``dir_id``; FileNotFound if absent."""
        raise NotImplementedError

    async def getattr(self, file_id: int) -> Attrs:
        raise NotImplementedError

    async def resolve(self, path: str) -> Attrs:
        """Walk an absolute path ('/a/b') from the root directory."""
        raise NotImplementedError

    async def mkdir(
        self, dir_id: int, name: str, *, mode: int = 0o755, uid: int = 0, gid: int = 0
    ) -> Attrs:
        """New directory; inherits the parent's EC policy. FileExists if the name is taken."""
        raise NotImplementedError

    async def create(
        self,
        dir_id: int,
        name: str,
        *,
        mode: int = 0o644,
        uid: int = 0,
        gid: int = 0,
        exclusive: bool = True,
        ec: str | None = None,
    ) -> tuple[Attrs, int]:
        """Create a file and take its writer token: ``(attrs, token)``.

        The EC policy is ``ec`` or the directory's. With ``exclusive=False`` an existing file
        of that name is opened for writing and truncated to zero (O_CREAT|O_TRUNC) instead.
        """
        raise NotImplementedError

    async def readdir(
        self, dir_id: int, after: str = "", limit: int = 1000
    ) -> tuple[list[DirEntry], str | None]:
        """One page of entries sorted by name, strictly after ``after``; next cursor or None."""
        raise NotImplementedError

    async def unlink(self, dir_id: int, name: str) -> int:
        """Remove a file's name; its blocks are queued for GC. Returns the file's id."""
        raise NotImplementedError

    async def rmdir(self, dir_id: int, name: str) -> None:
        raise NotImplementedError

    async def rename(self, src_dir: int, src_name: str, dst_dir: int, dst_name: str) -> None:
        """Atomic within one directory, also over an existing file; crash-safe across."""
        raise NotImplementedError

    async def setattr(
        self,
        file_id: int,
        *,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        atime_ns: int | None = None,
        mtime_ns: int | None = None,
        ec: str | None = None,
    ) -> Attrs:
        """Change attributes; ``ec`` on a directory sets the policy new files inherit."""
        raise NotImplementedError

    async def getxattr(self, file_id: int, name: str) -> bytes:
        raise NotImplementedError

    async def setxattr(self, file_id: int, name: str, value: bytes) -> None:
        raise NotImplementedError

    async def listxattr(self, file_id: int) -> list[str]:
        raise NotImplementedError

    async def removexattr(self, file_id: int, name: str) -> None:
        raise NotImplementedError

    # --- File layer: the write path -------------------------------------------------------

    async def open_for_write(self, file_id: int, *, truncate: bool = False) -> int:
        """Take (steal) the writer token; unseals the file. Returns the new token."""
        raise NotImplementedError

    async def renew_lease(self, file_id: int, token: int) -> None:
        raise NotImplementedError

    async def allocate_block(self, file_id: int, token: int, ec: str, hedge: int = 2) -> BlockGrant:
        """A new block id plus k+m+hedge placed nodes and a capability token."""
        raise NotImplementedError

    async def more_nodes(
        self, block_id: int, exclude: Sequence[str], count: int
    ) -> BlockGrant:
        """Replacement nodes for a block whose chunk writes failed (same block id)."""
        raise NotImplementedError

    async def commit_blocks(self, file_id: int, token: int, blocks: Sequence[BlockInfo]) -> None:
        """Commit blocks (Block layer) and put them at their ``file_index`` in the file.

        A block at an index that already has one replaces it (the old block is queued for
        GC). StaleWriterToken if another writer took the file since ``token`` was issued.
        """
        raise NotImplementedError

    async def seal(self, file_id: int, token: int, size: int) -> Attrs:
        """Set the final size, release the writer token and seal the file."""
        raise NotImplementedError

    async def set_size(self, file_id: int, token: int, size: int) -> Attrs:
        """Change the size of a file being written (truncate or grow sparse); blocks wholly
        past the new size are dropped and queued for GC."""
        raise NotImplementedError

    # --- Read path -----------------------------------------------------------------------------

    async def block_list(self, file_id: int) -> list[BlockInfo]:
        """Every committed block of the file, sorted by file_index, with chunk placements
        (addresses filled in from the registry)."""
        raise NotImplementedError

    async def locate_blocks(self, block_ids: Sequence[int]) -> list[BlockInfo]:
        """Block layer records of the given blocks (grouped per shard), addresses filled in."""
        raise NotImplementedError

    async def blocks_on_node(self, node_id: str) -> list[tuple[int, int]]:
        """(block_id, chunk_index) of every committed chunk on a node: the reverse index,
        gathered from every block shard (repair and ``tectonic status`` use it)."""
        raise NotImplementedError

    async def replace_chunk(
        self, block_id: int, index: int, old_node: str, new_node: str, checksum: int
    ) -> None:
        """Point one chunk of a committed block at a new node (repair, rebalance), keeping
        the reverse index in step; refused if the chunk is no longer on ``old_node``."""
        raise NotImplementedError

    # --- Node registry ----------------------------------------------------------------------

    async def nodes(self) -> list[NodeInfo]:
        raise NotImplementedError

    async def statfs(self) -> dict[str, Any]:
        """Cluster capacity: {"capacity", "free", "files"...} from the registry."""
        raise NotImplementedError
