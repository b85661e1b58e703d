"""Every metadata operation, declared once (metadata/api/contract.py says what a declaration
holds and what is made of it; docs/operations-table.md is this table rendered).

Roles (tectonic_py/core/auth.py): a client (a GPU node) may read the namespace and change it
as a filesystem user can: create, write, rename, remove. The maintenance daemon may do what a
client may (it removes dead jobs' staging trees, names orphans) and the upkeep of the Block
and File layers besides: scans, repointing and forgetting chunks, delete capabilities, lease
recovery. Admin may call everything. The servers among themselves (role node) heartbeat
into the registry and ask each other where a rename's destination points.

Limits of arguments live here and nowhere else; the layers import what they enforce too.
"""

from __future__ import annotations

from metadata.api.contract import (
    ANY,
    DRAWN,
    I64,
    REGISTRY,
    SCAN,
    SERVER,
    Arg,
    Contract,
    Op,
    Route,
    bool_,
    by,
    bytes_,
    id_,
    int_,
    list_,
    name_,
    str_,
)
from tectonic_py.core.auth import ROLE_ADMIN, ROLE_CLIENT, ROLE_MAINTENANCE, ROLE_NODE
from tectonic_py.core.cluster_file import DEFAULT_CHUNK_SIZE
from tectonic_py.core.ec_policy import DEFAULT_POLICY
from tectonic_py.core.ids import MAX_ID
from tectonic_py.core.records import MAX_SYMLINK_TARGET

MAX_KEEP = 1_000_000  # steps a retention policy keeps, at most

MAX_MODE = 0o7777
MAX_UGID = 2**32 - 1
MAX_PAGE = 10_000  # entries of one name.list page
MAX_SCAN = 10_000  # items of one maintenance scan or call
MAX_BLOCKS = 100_000  # block ids of one block.durability
MAX_STATES = 10_000  # file ids of one file.states, entries of one name.staging page
MAX_BATCH_OPS = 512
MAX_PACK_FILES = 4096  # files of one pack block (a block of 4 KiB files at most)
MAX_DELEGATE = 4096  # file ids one name.delegate reserves
MAX_XATTR_VALUE = 64 * 1024
MAX_CHUNK_SIZE = 64 * 2**20
MAX_SIZE = 2**62
MAX_SHARD_NO = 2**31

# Who may call what.
READ = frozenset({ROLE_CLIENT, ROLE_MAINTENANCE, ROLE_ADMIN})
WRITE = READ  # a filesystem user's changes (the maintenance daemon removes staging trees)
UPKEEP = frozenset({ROLE_MAINTENANCE, ROLE_ADMIN})
ADMIN = frozenset({ROLE_ADMIN})
EVERYONE = frozenset({ROLE_CLIENT, ROLE_MAINTENANCE, ROLE_ADMIN, ROLE_NODE})

_EC = str_("ec", DEFAULT_POLICY.name, max_len=16)
_CHUNK_SIZE = int_("chunk_size", DEFAULT_CHUNK_SIZE, lo=4096, hi=MAX_CHUNK_SIZE)
_UID = int_("uid", 0, hi=MAX_UGID)
_GID = int_("gid", 0, hi=MAX_UGID)
_TOKEN = int_("token", hi=MAX_ID)
_NS = int_("before_ns", hi=I64)
_LIMIT = int_("limit", 1000, lo=1, hi=MAX_SCAN)
_NODE = str_("node_id", max_len=64)
_INDEX = int_("index", hi=255)
_CHECKSUM = int_("checksum", hi=2**32 - 1)
_ENTRIES = list_("entries", "entries", (), max_len=100_000)
_BLOCK_INFOS = list_("blocks", "list", (), max_len=10_000)


def _op(
    name: str,
    args: list[Arg],
    result: str,
    route: Route,
    roles: frozenset[str],
    *,
    mutates: bool,
    repeatable: bool | None = None,
    coalesce: bool = False,
    doc: str = "",
) -> Op:
    """A declaration; a read is always safe to send again."""
    again = (not mutates) if repeatable is None else repeatable
    return Op(name, tuple(args), result, route, roles, mutates, again, coalesce, doc)


def _name_layer() -> list[Op]:
    dirname = [id_("dir"), name_()]
    return [
        _op("name.lookup", dirname, "id, kind, [attrs]", by("dir"), EVERYONE,
            mutates=False, coalesce=True),
        _op("name.insert", [*dirname, id_("id"), Arg("kind", "kind")], "{}", by("dir"), WRITE,
            mutates=True, doc="a new record's entry; resent by the client, which reads a repeat's FileExists"),
        _op("name.make_node",
            [*dirname, Arg("kind", "kind"), int_("mode", 0o777, hi=MAX_MODE), _UID, _GID,
             bytes_("target", b"", max_len=MAX_SYMLINK_TARGET), int_("rdev", 0)],
            "attrs", by("dir"), WRITE, mutates=True, doc="a symlink or special file"),
        _op("name.list", [id_("dir"), str_("after", "", max_len=1024),
                          int_("limit", 1000, lo=1, hi=MAX_PAGE)],
            "entries, next", by("dir"), READ, mutates=False),
        _op("name.remove", [*dirname, Arg("kind", "kind"), id_("expect_id", 0, lo=0)], "id",
            by("dir"), WRITE, mutates=True, coalesce=True),
        _op("name.rename",
            [id_("src_dir"), name_("src_name"), id_("dst_dir"), name_("dst_name"),
             id_("replace_dir", 0, lo=0)],
            "id, kind, victim_id, victim_kind", by("src_dir"), WRITE, mutates=True,
            doc="both directories in this shard: one transaction"),
        _op("name.rename_prepare",
            [id_("src_dir"), name_("src_name"), id_("dst_dir"), name_("dst_name"),
             str_("dst_address", max_len=300), int_("deadline_ns", hi=I64)],
            "intent, id, kind", by("src_dir"), WRITE, mutates=True),
        _op("name.rename_apply",
            [id_("dst_dir"), name_("dst_name"), id_("id"), Arg("kind", "kind"),
             int_("deadline_ns", hi=I64), id_("replace_dir", 0, lo=0)],
            "victim_id, victim_kind", by("dst_dir"), WRITE, mutates=True),
        _op("name.rename_finish", [id_("intent"), bool_("applied")], "{}", SCAN, WRITE,
            mutates=True, doc="in the source shard, which holds the intent"),
        _op("name.intents", [_NS], "intents", SCAN, UPKEEP, mutates=False),
        _op("name.create",
            [*dirname, int_("mode", 0o644, hi=MAX_MODE), _UID, _GID, _EC, _CHUNK_SIZE,
             int_("token", 0, hi=MAX_ID), id_("id", 0, lo=0), bool_("replace", False)],
            "attrs, token, victim_id, victim_kind", by("dir"), WRITE, mutates=True,
            coalesce=True,
            doc="a regular file, named at once; a repeat with the same token gets the first "
                "file. id: one name.delegate reserved (a mount's create that did not wait); "
                "replace: a name that is taken is taken over (its file loses the name)"),
        _op("name.delegate", [int_("count", lo=1, hi=MAX_DELEGATE)], "ids, expires_ns", SCAN,
            WRITE, mutates=True, repeatable=True,
            doc="file ids hashing to this shard, reserved for the caller's creates until "
                "expires_ns (a repeat reserves more; unused ones expire)"),
        _op("name.unlink", dirname, "id, released", by("dir"), WRITE, mutates=True,
            coalesce=True, doc="resent by the client, which reads a repeat's FileNotFound"),
        _op("name.staging",
            [Arg("after", "cursor_name", (0, "")), int_("limit", 1000, lo=1, hi=MAX_STATES)],
            "entries, next", SCAN, READ, mutates=False),
        _op("name.commit",
            [id_("dir"), name_("staging"), name_("final"), bool_("replace", False),
             str_("retire", "", max_len=255), str_("latest", "", max_len=255)],
            "step commit outcome", by("dir"), WRITE, mutates=True,
            doc="a step's atomic commit: staging -> final (and latest) in one transaction"),
    ]  # fmt: skip


def _file_layer() -> list[Op]:
    fid = [id_("id")]
    return [
        _op("file.create",
            [Arg("kind", "kind"), int_("mode", 0o644, hi=MAX_MODE), _UID, _GID, _EC,
             _CHUNK_SIZE, id_("parent"), name_(), id_("realm", 0, lo=0),
             int_("realm_key", 0, hi=MAX_ID)],
            "attrs, token", DRAWN, WRITE, mutates=True, repeatable=True,
            doc="an unnamed record (a repeat leaves one more, which the orphan GC collects)"),
        _op("file.get", fid, "attrs, parent", by("id"), READ, mutates=False, coalesce=True),
        _op("file.open", [*fid, bool_("truncate", False)], "token", by("id"), WRITE,
            mutates=True, coalesce=True),
        _op("file.renew", [*fid, _TOKEN], "{}", by("id"), WRITE, mutates=True,
            repeatable=True, coalesce=True),
        _op("file.seal", [*fid, _TOKEN, int_("size", hi=MAX_SIZE)], "attrs", by("id"), WRITE,
            mutates=True, coalesce=True),
        _op("file.set_size", [*fid, _TOKEN, int_("size", hi=MAX_SIZE)], "attrs", by("id"),
            WRITE, mutates=True, repeatable=True, coalesce=True),
        _op("file.setattr",
            [*fid, int_("mode", None, hi=MAX_MODE), int_("uid", None, hi=MAX_UGID),
             int_("gid", None, hi=MAX_UGID), int_("atime_ns", None, hi=I64),
             int_("mtime_ns", None, hi=I64), str_("ec", None, max_len=16)],
            "attrs", by("id"), WRITE, mutates=True),
        _op("file.link", [*fid, id_("parent"), name_()], "{}", by("id"), WRITE, mutates=True,
            repeatable=True, doc="marks a record named (its name hint)"),
        _op("file.add_link", fid, "attrs", by("id"), WRITE, mutates=True),
        _op("file.readlink", fid, "target", by("id"), READ, mutates=False),
        _op("file.unlink", fid, "{}", by("id"), WRITE, mutates=True, coalesce=True),
        _op("file.kill_dir", fid, "{}", by("id"), WRITE, mutates=True),
        _op("file.revive_dir", fid, "{}", by("id"), WRITE, mutates=True),
        _op("file.drop", fid, "{}", by("id"), WRITE, mutates=True, repeatable=True,
            doc="a record no name reaches; a client may drop only a dead directory or an "
                "unnamed record"),
        _op("file.blocks", fid, "blocks [[index, id, offset, length]]", by("id"), READ,
            mutates=False, doc="length 0: the whole block; else an extent of a pack"),
        _op("file.getxattr", [*fid, str_("name", max_len=255)], "value", by("id"), READ,
            mutates=False),
        _op("file.setxattr",
            [*fid, str_("name", max_len=255), bytes_("value", max_len=MAX_XATTR_VALUE)], "{}",
            by("id"), WRITE, mutates=True),
        _op("file.listxattr", fid, "names", by("id"), READ, mutates=False),
        _op("file.removexattr", [*fid, str_("name", max_len=255)], "{}", by("id"), WRITE,
            mutates=True),
        _op("file.orphans", [int_("older_than_ns", hi=I64), _LIMIT], "orphans", SCAN, UPKEEP,
            mutates=False),
        _op("file.collect_orphan", fid, "deleted", by("id"), UPKEEP, mutates=True),
        _op("file.gc_blocks", [_LIMIT], "block_ids", SCAN, UPKEEP, mutates=False),
        _op("file.commit", [*fid, _TOKEN, _ENTRIES, _BLOCK_INFOS], "{}", by("id"), WRITE,
            mutates=True, repeatable=True, coalesce=True,
            doc="a writer's blocks: Block layer commit and File layer entries, one transaction"),
        _op("file.close", [*fid, _TOKEN, int_("size", hi=MAX_SIZE), _ENTRIES, _BLOCK_INFOS],
            "attrs", by("id"), WRITE, mutates=True, coalesce=True,
            doc="file.commit and the seal; resent by the client, which checks a repeat's seal"),
        _op("file.commit_pack",
            [Arg("block", "map"), list_("files", max_len=MAX_PACK_FILES)], "results",
            SCAN, WRITE, mutates=True, repeatable=True,
            doc="a pack block and its files' extents (each commit, size, [seal]): one "
                "transaction; each file's error is its own"),
        _op("file.relocate_extents",
            [Arg("block", "map"), id_("old_block_id"),
             list_("moves", "pairs", max_len=MAX_PACK_FILES, width=5)], "moved", SCAN, UPKEEP,
            mutates=True, repeatable=True,
            doc="compaction: commit a new pack and move [file_id, index, old_offset, length, "
                "new_offset] extents that still name the old one (compaction_ops)"),
        _op("file.states", [list_("ids", "ids", max_len=MAX_STATES)], "states", by("ids"),
            READ, mutates=False),
        _op("file.gc_queue",
            [int_("older_than_ns", hi=I64), _LIMIT, int_("superseded_before_ns", 0, hi=I64)],
            "blocks", SCAN, UPKEEP, mutates=False),
        _op("file.gc_ack", [list_("block_ids", "ids", max_len=MAX_SCAN)], "{}", SCAN, UPKEEP,
            mutates=True, repeatable=True),
        _op("file.referenced", [list_("refs", "pairs", max_len=MAX_SCAN, width=3)],
            "referenced", SCAN, UPKEEP, mutates=False),
        _op("file.scan", [id_("after", 0, lo=0), _LIMIT], "files, next", SCAN, UPKEEP,
            mutates=False, doc="every record of a shard in id order (fsck, the "
                               "unreachable-record sweep); never a writer token"),
        _op("file.collect_unreachable", [*fid, int_("ctime_ns", hi=I64)], "deleted",
            by("id"), UPKEEP, mutates=True, repeatable=True,
            doc="a record no name reaches (the sweep's two walks), if unchanged since "
                "(ctime_ns), without a live writer, not a directory with entries"),
        _op("file.expired_leases", [_NS, _LIMIT], "files [[id, lease_ns]]", SCAN, UPKEEP,
            mutates=False, doc="never a writer token; before_ns no later than now (admin: "
                               "any)"),
        _op("file.recover_lease", [*fid, int_("lease_ns", lo=1, hi=I64), _NS], "outcome",
            by("id"), UPKEEP, mutates=True,
            doc="fenced on the lease expiry expired_leases reported"),
    ]  # fmt: skip


def _block_layer() -> list[Op]:
    bid = [id_("block_id")]
    return [
        _op("block.allocate",
            [id_("file_id"), int_("token", 0, hi=MAX_ID), str_("ec", max_len=16),
             list_("nodes", "node_ids", max_len=256), bool_("pack", False)],
            "block_id, capability", by("file_id"), WRITE, mutates=True, repeatable=True,
            coalesce=True,
            doc="pack: a block shared by files of the shard (write_ops); a maintenance or "
                "admin caller allocates one without a token (compaction)"),
        _op("block.pack_usage",
            [id_("after", 0, lo=0), _LIMIT, int_("older_than_ns", hi=I64),
             int_("max_live_permille", 500, hi=1000)],
            "packs, next", SCAN, UPKEEP, mutates=False,
            doc="packs whose live extents hold at most this share of their bytes"),
        _op("block.grant", [*bid, list_("nodes", "node_ids", max_len=256)],
            "nodes, capability", by("block_id"), WRITE, mutates=True, repeatable=True,
            coalesce=True),
        _op("block.commit", [id_("file_id"), list_("blocks", max_len=10_000)], "{}", SCAN,
            WRITE, mutates=True, repeatable=True, coalesce=True,
            doc="in the blocks' own shard"),
        _op("block.locate", [list_("ids", "ids", max_len=100_000)], "blocks", by("ids"), READ,
            mutates=False, coalesce=True),
        _op("block.by_node",
            [_NODE, id_("after", 0, lo=0), int_("limit", 10_000, lo=1, hi=100_000)], "chunks",
            SCAN, UPKEEP, mutates=False),
        _op("block.replace_chunk",
            [*bid, _INDEX, str_("old_node", max_len=64), str_("new_node", max_len=64),
             _CHECKSUM],
            "{}", by("block_id"), UPKEEP, mutates=True),
        _op("block.report_bad_chunk",
            [*bid, _INDEX, _NODE, str_("reason", "corrupt", max_len=64)], "recorded",
            by("block_id"), READ, mutates=True, repeatable=True,
            doc="a reader found a chunk corrupt or missing; repair checks it"),
        _op("block.durability", [list_("ids", "ids", max_len=MAX_BLOCKS)], "blocks",
            by("ids"), READ, mutates=False),
        _op("block.scan", [id_("after", 0, lo=0), _LIMIT], "blocks, next", SCAN, UPKEEP,
            mutates=False),
        _op("block.set_chunk",
            [*bid, _INDEX, str_("old_node", "", max_len=64), str_("new_node", max_len=64),
             _CHECKSUM, str_("registry", "", max_len=300)],
            "{}", by("block_id"), UPKEEP, mutates=True,
            doc="refused onto a node the registry does not know (registry: its address, "
                "for a server that does not hold it), or from where the chunk is not"),
        _op("block.forget",
            [*bid, str_("state", max_len=16, choices=("allocated", "committed")),
             id_("file_id", None, lo=0), int_("file_index", None, lo=-1, hi=MAX_ID)],
            "forgotten, chunks", by("block_id"), UPKEEP, mutates=True,
            doc="refused while a file's block entry (or a pack extent) names the block"),
        _op("block.dead_chunks", [_NODE, list_("chunks", "pairs", max_len=MAX_SCAN, width=2)],
            "dead", SCAN, UPKEEP, mutates=False),
        _op("block.bad_chunks", [id_("after", 0, lo=0), _LIMIT], "chunks, next", SCAN, UPKEEP,
            mutates=False),
        _op("block.node_chunks",
            [_NODE, Arg("after", "cursor_chunk", (0, -1)), id_("upto", MAX_ID, lo=0), _LIMIT],
            "chunks", SCAN, UPKEEP, mutates=False),
        _op("block.caps",
            [str_("action", max_len=8, choices=("put", "delete")),
             list_("chunks", "chunk_refs", max_len=MAX_SCAN)],
            "caps", SCAN, UPKEEP, mutates=False,
            doc="capabilities for chunk stores: delete only where the Block layer no longer "
                "needs the chunk"),
    ]  # fmt: skip


def _quotas() -> list[Op]:
    """Directory quotas, claims, reservations (metadata/quota_layer.py). Setting and removing
    a quota is the operator's (admin); a filesystem user reads quotas, claims the bytes its
    writes add and reserves space; folding usage is the maintenance daemon's."""
    realm = id_("realm")
    signed = {"lo": -I64, "hi": I64}
    return [
        _op("quota.set",
            [id_("dir"), int_("max_bytes", hi=I64), int_("max_files", hi=I64),
             id_("realm_key")],
            "realm_key, fresh", by("dir"), ADMIN, mutates=True, repeatable=True,
            doc="limits of a directory (0: none); a new realm takes realm_key and the "
                "caller attaches the tree below (quota.adopt)"),
        _op("quota.get", [id_("dir")], "quota", by("dir"), READ, mutates=False),
        _op("quota.list", [], "quotas", SCAN, READ, mutates=False),
        _op("quota.remove", [id_("dir")], "realm_key", by("dir"), ADMIN, mutates=True,
            doc="drops the realm; the caller detaches the tree below (quota.adopt to 0)"),
        _op("quota.adopt", [id_("id"), id_("realm", lo=0), int_("realm_key", hi=MAX_ID)],
            "kind", by("id"), ADMIN, mutates=True, repeatable=True,
            doc="the record counts toward this realm from now on (0: none)"),
        _op("quota.claim",
            [realm, id_("dir", 0, lo=0), id_("file", 0, lo=0), int_("need", hi=I64),
             int_("want", 0, hi=I64), int_("files", 0, hi=MAX_DELEGATE),
             bool_("prealloc", False)],
            "granted, prealloc", by("realm"), WRITE, mutates=True,
            doc="bytes a writer may add (need..want), or EDQUOT; prealloc: set aside for "
                "the file (fallocate KEEP_SIZE)"),
        _op("quota.unclaim",
            [realm, id_("file", 0, lo=0), int_("bytes", hi=I64), bool_("keep", False)], "{}",
            by("realm"), WRITE, mutates=True,
            doc="claimed bytes a writer did not use (keep: they stay set aside for the file)"),
        _op("quota.reserve",
            [realm, id_("dir"), int_("bytes", hi=I64), int_("ttl_ns", lo=1, hi=I64)],
            "free", by("realm"), WRITE, mutates=True, repeatable=True,
            doc="hold bytes of the quota for one directory's writes, or EDQUOT"),
        _op("quota.release", [realm, id_("dir")], "left", by("realm"), WRITE, mutates=True,
            repeatable=True),
        _op("quota.pending", [_LIMIT], "pages", SCAN, UPKEEP, mutates=False,
            doc="the shard's oldest deltas, summed per realm"),
        _op("quota.fold",
            [realm, id_("realm_key"), int_("src_shard", hi=MAX_SHARD_NO), int_("first", hi=I64),
             int_("upto", hi=I64),
             int_("bytes", **signed), int_("files", **signed),
             list_("grown", "pairs", max_len=MAX_SCAN, width=3)],
            "outcome, last_seq", by("realm"), UPKEEP, mutates=True, repeatable=True,
            doc="once per page of sequence numbers first..upto: a page whose start was "
                "folded is refused (repeat), and the caller acks up to last_seq"),
        _op("quota.ack", [realm, id_("realm_key"), int_("upto", hi=I64)], "{}", SCAN, UPKEEP,
            mutates=True, repeatable=True),
        _op("quota.recount", [], "records, pending, quotas", SCAN, UPKEEP, mutates=False),
        _op("space.reserve", [id_("dir"), int_("raw_bytes", hi=I64), int_("ttl_ns", lo=1, hi=I64)],
            "free", REGISTRY, WRITE, mutates=True, repeatable=True,
            doc="hold raw bytes of the live chunk stores' free space, or ENOSPC"),
        _op("space.release", [id_("dir")], "{}", REGISTRY, WRITE, mutates=True,
            repeatable=True),
    ]  # fmt: skip


def _services() -> list[Op]:
    return [
        _op("node.heartbeat",
            [_NODE, str_("address", max_len=300), str_("failure_domain", max_len=128),
             int_("capacity", 0, hi=I64), int_("free", 0, hi=I64),
             int_("chunk_count", 0, hi=I64), int_("queue_depth", 0, hi=2**31),
             str_("fs_id", "", max_len=300), int_("fs_total", 0, hi=I64),
             int_("fs_free", 0, hi=I64)],
            "{}", REGISTRY, frozenset({ROLE_NODE, ROLE_ADMIN}), mutates=True, repeatable=True,
            doc="a chunk store's membership and free space; refused for a node id "
                "registered at another address that is still up"),
        _op("node.list", [], "nodes", REGISTRY, EVERYONE, mutates=False),
        _op("server.stats", [], "files, shards", SERVER, READ, mutates=False),
        _op("server.owners", [], "owners {shard: address}", ANY, EVERYONE, mutates=False),
        _op("server.backup", [str_("dest")], "manifest", SERVER, ADMIN, mutates=False,
            repeatable=False, doc="an online snapshot of the server's shards on its host"),
        _op("batch", [list_("ops", max_len=MAX_BATCH_OPS)], "results", ANY, READ,
            mutates=True, doc="independent name/file/block requests in one frame, each "
                              "checked against its own declaration and roles"),
    ]  # fmt: skip


def _retention() -> list[Op]:
    at = [id_("dir")]
    return [
        _op("retention.set",
            [*at, int_("keep_last", lo=1, hi=MAX_KEEP), str_("path", "", max_len=4096)],
            "{}", by("dir"), WRITE, mutates=True, repeatable=True,
            doc="keep the newest keep_last committed steps of a directory (not /)"),
        _op("retention.get", at, "keep_last (0: none), path", by("dir"), READ, mutates=False),
        _op("retention.remove", at, "existed", by("dir"), WRITE, mutates=True,
            repeatable=True),
        _op("retention.list", [], "policies [[dir, keep_last, path]]", SCAN, READ,
            mutates=False),
        _op("retention.retire", [*at, list_("protect", "list", (), max_len=1024)],
            "retired [[name, tomb, id]], tombs [[tomb, id]], dropped", by("dir"), WRITE,
            mutates=True, repeatable=True,
            doc="one transaction: the steps past keep_last (less those a link names) "
                "renamed to hidden tombs, for the caller to empty (as a client may remove "
                "steps, it may run the pass: the load test does)"),
    ]  # fmt: skip


OPS = Contract(
    [*_name_layer(), *_file_layer(), *_block_layer(), *_quotas(), *_services(), *_retention()]
)
