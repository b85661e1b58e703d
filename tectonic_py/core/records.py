"""Records of the metadata service as the client library sees them.

These travel over the wire as plain msgpack maps (``to_wire``/``from_wire``); the
dataclasses are the typed view on both sides. Sizes are bytes, times are integer
nanoseconds since the epoch, modes are permission bits only (the kind says file or dir).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

from tectonic_py.core.errors import InvalidName

T = TypeVar("T")

KIND_FILE = "file"
KIND_DIR = "dir"
# Metadata-only records: a symbolic link (its target kept in the File layer) and the special
# files of mknod(2) (a FIFO, a socket, a character or block device: no data, a device number).
KIND_SYMLINK = "symlink"
KIND_FIFO = "fifo"
KIND_SOCK = "sock"
KIND_CHR = "chr"
KIND_BLK = "blk"
SPECIAL_KINDS = frozenset({KIND_FIFO, KIND_SOCK, KIND_CHR, KIND_BLK})
NODE_KINDS = frozenset({KIND_SYMLINK}) | SPECIAL_KINDS
ALL_KINDS = frozenset({KIND_FILE, KIND_DIR}) | NODE_KINDS
MAX_NAME_BYTES = 255
MAX_SYMLINK_TARGET = 4095  # PATH_MAX less its NUL

# A file's seal state (``Attrs.seal_state``): sealed is complete; writing has a live writer
# token, so more bytes may come; unsealed has neither, so it may lack its tail for good
# (its writer died or lost its mount) and a reader should be told.
SEALED = "sealed"
WRITING = "writing"
UNSEALED = "unsealed"


def validate_name(name: object) -> str:
    """The one place names are checked: a single path component, 1..255 bytes of UTF-8.

    Clients check before they send and servers again on receipt, so both import it from here.
    """
    if not isinstance(name, str):
        raise InvalidName(f"a name must be a string, not {type(name).__name__}")
    if name in ("", ".", ".."):
        raise InvalidName(f"invalid name {name!r}")
    if "/" in name or "\x00" in name:
        raise InvalidName(f"name {name!r} contains '/' or NUL")
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidName(f"name {name!r} is not valid UTF-8") from None
    if len(encoded) > MAX_NAME_BYTES:
        raise InvalidName(f"name is {len(encoded)} bytes, over {MAX_NAME_BYTES}")
    return name


_FIELD_NAMES: dict[type, frozenset[str]] = {}


def _from_wire(cls: type[T], data: dict[str, Any]) -> T:
    # The names once per class: a file's block list decodes ten placements a block, and
    # ``fields`` was most of the cost of a list of a thousand patched extents.
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = frozenset(f.name for f in fields(cls))  # type: ignore[arg-type]
    return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class Attrs:
    """A file's or directory's attributes (File layer; directories live there too)."""

    id: int
    kind: str  # KIND_FILE, KIND_DIR, KIND_SYMLINK or one of SPECIAL_KINDS
    size: int = 0
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    atime_ns: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    sealed: bool = False
    ec: str = "rs-6-3"  # files: their policy; directories: the policy new files inherit
    chunk_size: int = 4 * 1024 * 1024  # C: bytes per data chunk of a full block
    nlink: int = 1
    writer: bool = False  # a writer token is held (and its lease not expired)
    # Bytes of the file's range that stored blocks cover (holes of a sparse file excluded):
    # what st_blocks counts. A directory's or a special file's is 0.
    stored: int = 0
    rdev: int = 0  # device number of a KIND_CHR or KIND_BLK record
    # The quota realm (its directory's id, 0: none) and its key (metadata/quota_layer.py):
    # for a directory, the one its new entries count toward (its own quota, else its own
    # realm); for any other record, the one it counts toward.
    realm: int = 0
    realm_key: int = 0

    @property
    def is_dir(self) -> bool:
        return self.kind == KIND_DIR

    @property
    def seal_state(self) -> str:
        """``SEALED``, ``WRITING`` or ``UNSEALED`` (directories count as sealed)."""
        if self.sealed or self.is_dir:
            return SEALED
        return WRITING if self.writer else UNSEALED

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Attrs:
        return _from_wire(cls, data)


@dataclass
class DirEntry:
    name: str
    id: int
    kind: str

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> DirEntry:
        return _from_wire(cls, data)


@dataclass
class NodeInfo:
    """A chunk store as the node registry knows it."""

    node_id: str
    address: str
    failure_domain: str
    state: str = "up"  # "up" or "down"
    capacity: int = 0
    free: int = 0
    chunk_count: int = 0
    queue_depth: int = 0
    # The filesystem under the store's data directory (id, size, free): stores that share
    # one are counted once in the cluster's capacity. Empty for a store that did not say.
    fs_id: str = ""
    fs_total: int = 0
    fs_free: int = 0
    last_seen: float = 0.0

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> NodeInfo:
        return _from_wire(cls, data)


@dataclass
class ChunkPlacement:
    """Where one chunk of a block lives, and its CRC-32C."""

    index: int
    node_id: str
    checksum: int
    address: str = ""  # filled in by the client from the registry when locating
    # The block id the chunk is stored under when it is an earlier version's chunk that this
    # block adopted (an in-place write rewrote other chunks of the block); 0: its own.
    stored_as: int = 0

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "index": self.index,
            "node_id": self.node_id,
            "checksum": self.checksum,
        }
        if self.stored_as:
            wire["stored_as"] = self.stored_as
        return wire

    def storage_block(self, block_id: int) -> int:
        """The block id of the chunk's file on its store (its id is that and ``index``)."""
        return self.stored_as or block_id

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> ChunkPlacement:
        return _from_wire(cls, data)


@dataclass
class BlockInfo:
    """A committed block: its erasure code, lengths and chunks (Block layer record).

    ``file_index`` is the block's position in its file: it covers file bytes
    ``[file_index * k * file_chunk_size, ... + file_len)``. ``chunk_len`` is the padded
    length of each chunk of this block (short for a file's last, short block).

    A file's block may be an *extent* of a pack, a block shared with other files written at
    the same time: then its bytes are ``[ext_off, ext_off + ext_len)`` of the block (a view
    the File layer gives a file's block list; the Block layer's record has no extent).

    ``patches`` (file view only, oldest first) are small overwrites laid over those bytes,
    each an extent of a pack: the copy-on-write of a small in-place write, which costs its
    own bytes instead of a new version of the block (metadata/file_layer.py).
    """

    block_id: int
    ec: str
    chunk_len: int
    data_len: int
    chunks: list[ChunkPlacement] = field(default_factory=list)
    file_index: int = 0
    ext_off: int = 0
    ext_len: int = 0  # 0: the file's block is the whole block
    patches: tuple[Patch, ...] = ()

    @property
    def base_len(self) -> int:
        """The file bytes the block (or extent) itself holds, under any patches."""
        return self.ext_len or self.data_len

    @property
    def file_len(self) -> int:
        """The file bytes this block holds: patches may reach past its own end."""
        base = self.ext_len or self.data_len
        return max(base, max((p.at + p.length for p in self.patches), default=0))

    @property
    def packed(self) -> bool:
        return self.ext_len > 0

    def to_wire(self) -> dict[str, Any]:
        wire = {
            "block_id": self.block_id,
            "ec": self.ec,
            "chunk_len": self.chunk_len,
            "data_len": self.data_len,
            "chunks": [c.to_wire() for c in self.chunks],
            "file_index": self.file_index,
        }
        if self.ext_len:
            wire["ext_off"], wire["ext_len"] = self.ext_off, self.ext_len
        return wire

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> BlockInfo:
        info = _from_wire(cls, data)
        info.chunks = [ChunkPlacement.from_wire(c) for c in data.get("chunks", [])]
        return info


MAX_PATCHES = 1024  # patches over one block of a file; a writer folds them before this


@dataclass(frozen=True)
class Patch:
    """Bytes ``[at, at + length)`` of a file's block, overwritten by an extent of a pack
    (``source``: the pack's record with ``ext_off``/``ext_len`` set)."""

    at: int
    length: int
    source: BlockInfo


@dataclass(frozen=True)
class PackedExtent:
    """One file's part of a pack commit (``file.commit_pack``): its writer, the extent of
    the pack that is its block ``index``, its size after, and whether it is the close.
    ``at`` >= 0: the extent is a patch over bytes ``[at, at + length)`` of the block the
    file already has at ``index``, not the block itself."""

    file_id: int
    token: int
    index: int
    offset: int
    length: int
    size: int
    seal: bool
    at: int = -1

    def to_wire(self) -> dict[str, Any]:
        return {
            "id": self.file_id,
            "token": self.token,
            "index": self.index,
            "offset": self.offset,
            "length": self.length,
            "size": self.size,
            "seal": self.seal,
            **({"at": self.at} if self.at >= 0 else {}),
        }


@dataclass
class BlockGrant:
    """A freshly allocated block id, the nodes to write its chunks to, and the capability.

    ``nodes`` has k+m entries in distinct failure domains where the cluster allows, then
    the hedge nodes; ``capability`` names all of them.
    """

    block_id: int
    nodes: list[NodeInfo]
    capability: bytes

    def to_wire(self) -> dict[str, Any]:
        return {
            "block_id": self.block_id,
            "nodes": [n.to_wire() for n in self.nodes],
            "capability": self.capability,
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> BlockGrant:
        return cls(
            block_id=data["block_id"],
            nodes=[NodeInfo.from_wire(n) for n in data["nodes"]],
            capability=data["capability"],
        )
