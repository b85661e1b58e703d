"""Roles and the metadata contract: who may call what, on a real cluster.

The matrix is driven by the declarations (metadata/api/ops.py and the chunk store's
``OP_ROLES``): every op, every role, served or refused as declared, so a new op without
roles, or a handler without a declaration, fails here. The attack is what a compromised GPU
node can do with nothing but ``client.toml``: every destructive maintenance op is refused and
every file reads back bit-exact.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_fixtures import suite_cluster
from maintenance_helpers import put, read
from test_cli import assert_one_line_error

from chunkstore.server import OP_ROLES
from metadata.api import OPS
from metadata.server import MetadataServer
from tectonic_py.client.tectonic_client import open_client
from tectonic_py.core import auth, cluster_file, rpc_client, sockets
from tectonic_py.core.auth import ROLES, Credential
from tectonic_py.core.errors import AuthError, InvalidArgument, PermissionDenied, TectonicError
from tectonic_py.launch.local_cluster import LocalCluster

FILES = 5
SIZE = 3 * 1024 * 1024 + 17


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with suite_cluster(tmp_path_factory.mktemp("roles") / "cluster", node_timeout=5.0) as c:
        yield c


def tectonic(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tectonic_py.cli.main", *args],
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    """A failed command's one line (test_cli's check), with exit code 1: it failed."""
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    return assert_one_line_error(proc, *needles)


def test_every_handler_is_declared_and_every_declaration_has_a_handler() -> None:
    handlers = {a for a in dir(MetadataServer) if a.startswith("op_")}
    assert handlers == {op.handler_name for op in OPS}
    for op in OPS:
        assert auth.ROLE_ADMIN in op.roles, op.name
        assert op.result, op.name


def test_the_operations_table_in_docs_is_the_declarations() -> None:
    """docs/operations-table.md is rendered from the contract: regenerate it with
    ``python -m metadata.api --markdown > docs/operations-table.md``."""
    doc = Path(__file__).resolve().parent.parent / "docs" / "operations-table.md"
    assert OPS.markdown() in doc.read_text(), "docs/operations-table.md is stale"


def _secret(cluster: LocalCluster) -> bytes:
    return auth.load_secret(cluster.secret_file)


async def test_every_op_is_served_or_refused_for_every_role_as_declared(
    cluster: LocalCluster,
) -> None:
    """Empty fields: a permitted call gets past the role check (and is then refused for
    its missing arguments, changing nothing); a refused one gets PermissionDenied."""
    config = cluster_file.load(cluster.cluster_file)
    host, port = sockets.parse_address(config.server_for_shard(0))
    secret = _secret(cluster)
    for role in ROLES:
        async with rpc_client.open_connection(
            host, port, Credential.from_secret(secret, role)
        ) as conn:
            for op in OPS:
                if op.name in ("server.owners", "node.list", "server.stats"):
                    fields: dict[str, object] = {}
                else:
                    fields = {"no_such_field": 1}  # never reaches a handler
                try:
                    await conn.call(op.name, fields)
                    outcome = "served"
                except PermissionDenied as e:
                    outcome = "refused"
                    assert f"{op.name} needs role" in e.message
                except TectonicError:
                    outcome = "served"
                want = "served" if role in op.roles else "refused"
                assert outcome == want, (role, op.name)


async def test_chunk_store_ops_are_served_or_refused_as_declared(cluster: LocalCluster) -> None:
    async with open_client(cluster.cluster_file) as client:
        node = (await client.meta.nodes())[0]
    host, port = sockets.parse_address(node.address)
    secret = _secret(cluster)
    for role in ROLES:
        async with rpc_client.open_connection(
            host, port, Credential.from_secret(secret, role)
        ) as conn:
            for op, roles in OP_ROLES.items():
                try:
                    await conn.call(op, {"chunk_id": "nope"})
                    outcome = "served"
                except PermissionDenied:
                    outcome = "refused"
                except TectonicError:
                    outcome = "served"
                assert outcome == ("served" if role in roles else "refused"), (role, op)


async def test_a_made_up_role_or_a_wrong_key_is_refused_at_the_handshake(
    cluster: LocalCluster,
) -> None:
    config = cluster_file.load(cluster.cluster_file)
    host, port = sockets.parse_address(config.server_for_shard(0))
    client_key = auth.role_key(_secret(cluster), auth.ROLE_CLIENT)
    with pytest.raises(AuthError):  # the client's key, claiming admin
        async with rpc_client.open_connection(host, port, Credential("admin", client_key)):
            pass


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def test_a_client_key_cannot_make_the_cluster_forget_move_or_delete_anything(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """The attack of the contract issue, with client.toml only; then every file reads
    back bit-exact."""
    client_toml = str(cluster.client_file)
    assert cluster_file.load(client_toml).role == "client"
    assert "secret" not in Path(client_toml).read_text()
    assert os.stat(cluster.key_file("client")).st_mode & 0o777 == 0o600
    blobs = {f"/victim/f{i}": os.urandom(SIZE) for i in range(FILES)}
    async with open_client(cluster.cluster_file) as admin:  # someone else's files
        await admin.mkdir("/victim")
        for path, data in blobs.items():
            await put(admin, path, data)
        victim = await admin.stat("/victim/f0")
        (block,) = (await admin.meta.block_list(victim.id))[:1]
        root_attrs = await admin.stat("/")
    shard_args = {"block_id": block.block_id, "shard": 0}
    attacks = [
        ("block.forget", {"block_id": block.block_id, "state": "committed"}),
        ("block.set_chunk", {**shard_args, "index": 0, "new_node": "cs8", "checksum": 0}),
        ("block.caps", {"shard": 0, "action": "delete",
                        "chunks": [[c.node_id, block.block_id, c.index] for c in block.chunks]}),
        ("file.gc_ack", {"shard": 0, "block_ids": [block.block_id]}),
        ("file.expired_leases", {"shard": 0, "before_ns": 2**62}),
        ("file.recover_lease", {"id": victim.id, "lease_ns": 1, "before_ns": 2**62}),
        ("block.replace_chunk", {"block_id": block.block_id, "index": 0, "old_node": "cs0",
                                 "new_node": "cs8", "checksum": 0}),
        ("node.heartbeat", {"node_id": "evil", "address": "127.0.0.1:1",
                            "failure_domain": "fd0"}),
        ("server.backup", {"dest": str(tmp_path / "stolen")}),
    ]  # fmt: skip
    for op, args in attacks:
        proc = tectonic("call", client_toml, op, json.dumps(args))
        one_line_error(proc, f"permission denied: {op} needs role")
    # A client may drop only records no name reaches: a named file is refused.
    proc = tectonic("call", client_toml, "file.drop", json.dumps({"id": victim.id}))
    one_line_error(proc, "permission denied", "file.drop")
    # What a filesystem user may do still works with client.toml.
    local = tmp_path / "x.bin"
    local.write_bytes(b"hello roles")
    assert tectonic("put", client_toml, str(local), "/mine.bin", "-q").returncode == 0
    got = tmp_path / "back.bin"
    assert tectonic("get", client_toml, "/mine.bin", str(got), "-q").returncode == 0
    assert got.read_bytes() == b"hello roles"
    assert "mine.bin" in tectonic("ls", client_toml, "/").stdout
    assert json.loads(tectonic("stat", client_toml, "/mine.bin").stdout)["size"] == 11
    assert tectonic("rm", client_toml, "/mine.bin").returncode == 0
    ok = tectonic(
        "call", client_toml, "name.lookup", json.dumps({"dir": root_attrs.id, "name": "victim"})
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["kind"] == "dir"
    async with open_client(cluster.cluster_file) as admin:
        for path, data in blobs.items():
            assert _digest(await read(admin, path)) == _digest(data), path
        assert "evil" not in {n.node_id for n in await admin.meta.nodes()}
    assert not (tmp_path / "stolen").exists()


def test_bad_input_through_tectonic_call_is_one_line_and_changes_nothing(
    cluster: LocalCluster,
) -> None:
    admin = str(cluster.cluster_file)
    one_line_error(tectonic("call", admin, "no.such_op"), "unknown metadata op 'no.such_op'")
    one_line_error(tectonic("call", admin, "file.get", "{not json"), "not JSON")
    one_line_error(tectonic("call", admin, "file.get", "[1, 2]"), "JSON object")
    one_line_error(tectonic("call", admin, "file.get", '{"id": -1}'), "file.get", "'id'")
    one_line_error(
        tectonic("call", admin, "file.get", '{"id": 1, "evil": 2}'), "unknown field 'evil'"
    )
    one_line_error(
        tectonic("call", admin, "name.list", '{"dir": 1, "limit": 999999999}'), "'limit'"
    )
    one_line_error(
        tectonic("call", admin, "block.forget", '{"block_id": 5, "state": "gone"}'), "'state'"
    )
    one_line_error(
        tectonic("call", admin, "file.orphans", '{"older_than_ns": 1}'), "file.orphans", "shard"
    )
    listed = tectonic("call", admin, "--list")
    assert listed.returncode == 0 and "block.forget" in listed.stdout
    served = tectonic("call", admin, "server.owners")
    assert served.returncode == 0, served.stderr
    assert "owners" in json.loads(served.stdout)


def test_a_cluster_file_made_before_roles_still_works_as_admin(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """An upgraded cluster: a cluster file that names the secret itself (the only kind
    before roles) speaks as admin with the derived key, and may name another role."""
    config = cluster_file.load(cluster.cluster_file)
    legacy = tmp_path / "old.toml"
    cluster_file.ClusterConfig(
        name="old", secret_file=cluster.secret_file, shards=config.shards,
        metadata_servers=config.metadata_servers,
    ).write(legacy)  # fmt: skip
    text = legacy.read_text()
    assert "secret_file" in text and "key_file" not in text
    assert cluster_file.load(legacy).credential().role == "admin"
    assert tectonic("ls", str(legacy), "/").returncode == 0
    assert tectonic("call", str(legacy), "block.scan", '{"shard": 0}').returncode == 0
    as_client = tmp_path / "old-client.toml"
    as_client.write_text(text.replace('role = "admin"', 'role = "client"'))
    one_line_error(
        tectonic("call", str(as_client), "block.scan", '{"shard": 0}'),
        "permission denied: block.scan needs role maintenance",
    )


def test_key_files_are_private_and_a_loose_one_is_refused(cluster: LocalCluster) -> None:
    for role in ("client", "maintenance", "admin"):
        assert os.stat(cluster.key_file(role)).st_mode & 0o777 == 0o600
    loose = cluster.key_file("client")
    os.chmod(loose, 0o644)
    try:
        one_line_error(
            tectonic("ls", str(cluster.client_file), "/"), "client key file", "chmod 600"
        )
    finally:
        os.chmod(loose, 0o600)


def test_a_field_equal_to_its_default_in_another_type_is_refused() -> None:
    """``False`` is not the token 0, nor ``0.0`` the uid 0: the type counts, as it did
    when each handler read its fields itself; and an omitted list is never shared."""
    base = {"shard": 0, "dir": 1, "name": "f"}
    with pytest.raises(InvalidArgument, match="'token'"):
        OPS["name.create"].validate({**base, "token": False})
    with pytest.raises(InvalidArgument, match="'uid'"):
        OPS["name.create"].validate({**base, "uid": 0.0})
    assert OPS["name.create"].validate({**base, "token": 0})["token"] == 0
    fields = OPS["file.commit"].validate({"shard": 0, "id": 5, "token": 1})
    assert fields["entries"] == () and fields["blocks"] == ()
