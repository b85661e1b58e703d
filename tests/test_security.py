"""What an adversary on the network or on the host must not be able to do.

A secret file others can read is refused; a peer that has not authenticated holds next to no
memory; a relay that passed the handshake through cannot inject, replay or reorder frames;
a capability names the one op it licenses, and no capability goes to a caller without the
file's writer token; capabilities are signed with a key clients never hold, and the metadata
service grants a delete only for a chunk no block needs, so a peer holding the cluster secret
cannot delete a live chunk.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio
import trio.testing
from metadata_fixtures import open_meta_cluster, register_nodes

from tectonic_py.core import auth, capability, framing, rpc_client, rpc_server
from tectonic_py.core.cluster_file import ClusterConfig, MetadataServer
from tectonic_py.core.errors import (
    BadCapability,
    ConfigError,
    InvalidArgument,
    StaleWriterToken,
    Unavailable,
    WrongShard,
)
from tectonic_py.core.ids import ROOT_ID, chunk_id, shard_of
from tectonic_py.core.records import BlockInfo, ChunkPlacement
from tectonic_py.core.rpc_server import Request


async def _echo(req: Request):
    return {"len": len(req.require_payload())}


async def start_server(nursery, secret, limits=framing.DEFAULT_LIMITS):
    server = rpc_server.RpcServer("test", secret, {"echo": _echo}, limits)
    _host, port = await nursery.start(server.serve, "127.0.0.1", 0)
    return server, port


# --- the secret file ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o644, 0o666, 0o640, 0o604])
def test_a_secret_file_others_can_read_is_refused(secret_file: Path, mode: int) -> None:
    secret_file.chmod(mode)
    with pytest.raises(ConfigError, match="chmod 600"):
        auth.load_secret(secret_file)


def test_a_secret_file_of_mode_600_or_400_is_accepted(secret_file: Path, secret: bytes) -> None:
    assert auth.load_secret(secret_file) == secret
    secret_file.chmod(0o400)
    assert auth.load_secret(secret_file) == secret


def test_the_cli_refuses_a_readable_secret_with_one_line(tmp_path: Path, secret_file: Path) -> None:
    secret_file.chmod(0o644)
    cluster = tmp_path / "cluster.toml"
    ClusterConfig(
        name="t", secret_file=secret_file, shards=1,
        metadata_servers=[MetadataServer("127.0.0.1:1", [0])],
    ).write(cluster)  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "tectonic_py.cli.main", "status", str(cluster)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert "chmod 600" in lines[0] and "Traceback" not in proc.stderr


# --- the wire: memory before authentication ------------------------------------------------


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def _closed_by_peer(sock: trio.socket.SocketType, within: float) -> bool:
    """True when the peer closes ``sock`` within ``within`` s (what it sent is read away)."""
    with trio.move_on_after(within):
        try:
            while await sock.recv(65536):
                pass
        except ConnectionResetError:
            pass
        return True
    return False


async def test_a_peer_announcing_a_large_header_before_auth_is_closed_holding_nothing(
    nursery, secret
):
    """Before: each of these held the 1 MiB it announced until the 10 s auth timeout."""
    server, port = await start_server(nursery, secret)
    before = _rss()
    socks = []
    for _ in range(200):
        sock = trio.socket.socket()
        await sock.connect(("127.0.0.1", port))
        await framing.send_all(sock, framing.PREFIX.pack(1, 0, 0, framing.MiB, 0) + b"\x80")
        socks.append(sock)
    try:
        for sock in socks:
            assert await _closed_by_peer(sock, within=5), "held until the auth timeout"
        assert _rss() - before < 50 * framing.MiB
        assert server.stats.auth_failures == 200
        async with rpc_client.open_connection("127.0.0.1", port, secret) as conn:
            assert (await conn.call("echo", {}, b"x")).fields == {"len": 1}
    finally:
        for sock in socks:
            sock.close()


async def test_idle_unauthenticated_connections_are_capped_and_honest_clients_get_in(
    nursery, secret
):
    limits = framing.Limits(max_unauthenticated=16, auth_timeout=30)
    server, port = await start_server(nursery, secret, limits)
    idle = []
    try:
        for _ in range(100):
            sock = trio.socket.socket()
            await sock.connect(("127.0.0.1", port))
            idle.append(sock)
        await trio.testing.wait_all_tasks_blocked(0.05)
        assert server.stats.unauthenticated <= 16
        assert server.stats.unauthenticated_dropped >= 84
        async with rpc_client.open_connection("127.0.0.1", port, secret) as conn:
            assert (await conn.call("echo", {}, b"xy")).fields == {"len": 2}
        assert server.stats.unauthenticated <= 16
    finally:
        for sock in idle:
            sock.close()


# --- the wire: frames after the handshake --------------------------------------------------


class Relay:
    """A TCP relay between a client and a server that passes every byte through and can
    inject its own bytes towards the server: a machine in the middle of the network."""

    def __init__(self, server_port: int) -> None:
        self.server_port = server_port
        self.to_server: list[bytes] = []  # what the client sent, in order
        self.upstream: trio.socket.SocketType | None = None

    async def serve(self, nursery: trio.Nursery) -> int:
        listeners = await nursery.start(trio.serve_tcp, self._handle, 0)
        return listeners[0].socket.getsockname()[1]

    async def _handle(self, stream: trio.SocketStream) -> None:
        up = await trio.open_tcp_stream("127.0.0.1", self.server_port)
        self.upstream = up.socket
        async with up, trio.open_nursery() as n:
            n.start_soon(self._pump, stream, up, True)
            n.start_soon(self._pump, up, stream, False)

    async def _pump(self, src: trio.SocketStream, dst: trio.SocketStream, upward: bool) -> None:
        try:
            while data := await src.receive_some(65536):
                if upward:
                    self.to_server.append(data)
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await dst.send_eof()

    async def inject(self, data: bytes) -> None:
        assert self.upstream is not None
        await framing.send_all(self.upstream, data)


def _forged(op: str, rid: int, tag: bytes = b"\0" * framing.TAG_BYTES) -> bytes:
    return framing.pack_frame({"op": op, "rid": rid, "f": {}}, 0, framing.FLAG_TAG) + tag


@pytest.mark.parametrize("attack", ["forged tag", "no tag", "replayed request"])
async def test_a_relay_cannot_inject_frames_after_the_handshake(nursery, secret, attack):
    """Before: the relay's own frames were obeyed (a ``stat`` and a ``delete``)."""
    seen: list[str] = []

    async def record(req: Request):
        seen.append(req.str("who"))
        return {}

    server = rpc_server.RpcServer("t", secret, {"record": record})
    _, port = await nursery.start(server.serve, "127.0.0.1", 0)
    relay = Relay(port)
    relay_port = await relay.serve(nursery)
    async with rpc_client.open_connection("127.0.0.1", relay_port, secret) as conn:
        await conn.call("record", {"who": "client"})
        if attack == "forged tag":
            frame = framing.pack_frame(
                {"op": "record", "rid": 99, "f": {"who": "relay"}}, 0, framing.FLAG_TAG
            )
            await relay.inject(frame + bytes(framing.TAG_BYTES))
        elif attack == "no tag":
            await relay.inject(
                framing.pack_frame({"op": "record", "rid": 99, "f": {"who": "relay"}}, 0)
            )
        else:
            await relay.inject(relay.to_server[-1])  # the client's last request, again
        with trio.fail_after(5):
            while not server.stats.protocol_errors:
                await trio.sleep(0.01)
        with pytest.raises(Unavailable):  # the server closed the connection
            with trio.fail_after(5):
                while True:
                    await conn.call("record", {"who": "client"})
                    await trio.sleep(0.01)
    assert "relay" not in seen and seen.count("client") >= 1
    assert server.stats.protocol_errors == 1


async def test_a_relay_cannot_inject_replies_to_the_client(nursery, secret):
    hold = trio.Event()

    async def slow(req: Request):
        await hold.wait()
        return {"from": "server"}

    server = rpc_server.RpcServer("t", secret, {"slow": slow})
    _, port = await nursery.start(server.serve, "127.0.0.1", 0)

    async def forging_relay(stream: trio.SocketStream) -> None:
        async with await trio.open_tcp_stream("127.0.0.1", port) as up:
            for _ in range(2):  # hello; then welcome, after the client's auth
                await stream.send_all(await up.receive_some(65536))
                await up.send_all(await stream.receive_some(65536))
            await stream.send_all(
                framing.pack_frame({"rid": 1, "f": {"from": "relay"}}, 0, framing.FLAG_TAG)
                + bytes(framing.TAG_BYTES)
            )
            await trio.sleep_forever()

    listeners = await nursery.start(trio.serve_tcp, forging_relay, 0)
    relay_port = listeners[0].socket.getsockname()[1]
    async with rpc_client.open_connection("127.0.0.1", relay_port, secret) as conn:
        with pytest.raises(Unavailable, match="authentication"), trio.fail_after(5):
            await conn.call("slow")
    hold.set()


def test_a_frames_tag_covers_its_header_and_payload_in_one_piece_or_two():
    """The incremental GMAC over header then payload gives the one-call tag of both."""
    session = auth.FrameSession(b"k" * 32, b"k" * 32)
    head, payload = framing.pack_frame({"op": "x", "rid": 1}, 5, framing.FLAG_TAG), b"12345"
    whole = auth.FrameSession(b"k" * 32, b"k" * 32).seal(head + payload, None)
    assert session.seal(head, payload) == whole
    assert session.seal(head, payload) != whole  # the next sequence number: another tag


# --- capabilities ----------------------------------------------------------------------------


def test_a_capability_names_its_op_and_a_put_token_does_not_license_a_delete(secret):
    key = b"k" * 32
    put = capability.issue(key, 7, ["n1"])
    capability.verify(key, put, 7, "n1", index=4)  # a writer's: any chunk of the block
    with pytest.raises(BadCapability, match="not 'delete'"):
        capability.verify(key, put, 7, "n1", op="delete", index=4)
    delete = capability.issue(key, 7, ["n1"], op="delete", index=4)
    capability.verify(key, delete, 7, "n1", op="delete", index=4)
    with pytest.raises(BadCapability):
        capability.verify(key, delete, 7, "n1", index=4)  # and no put with a delete token
    with pytest.raises(BadCapability):
        capability.verify(key, delete, 8, "n1", op="delete", index=4)
    with pytest.raises(BadCapability, match="not for chunk 5"):
        capability.verify(key, delete, 7, "n1", op="delete", index=5)
    with pytest.raises(BadCapability, match="signature"):  # signed with the secret, not the key
        capability.verify(key, capability.issue(secret, 7, ["n1"]), 7, "n1", index=4)
    with pytest.raises(ValueError):
        capability.issue(key, 7, ["n1"], op="delete")  # a delete always names its chunk


def test_a_capability_key_file_is_required_and_refused_when_others_can_read_it(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match="no --capability-key-file"):
        capability.load_key(None)
    key = tmp_path / "capability_key"
    key.write_bytes(b"k" * 32)
    key.chmod(0o640)
    with pytest.raises(ConfigError, match="capability key file .* chmod 600"):
        capability.load_key(key)
    key.chmod(0o600)
    assert capability.load_key(key) == b"k" * 32


def test_a_metadata_server_without_a_capability_key_refuses_to_start_in_one_line(
    tmp_path: Path, secret_file: Path
) -> None:
    """Before: there was no key; a server signed capabilities with the cluster secret."""
    proc = subprocess.run(
        [
            sys.executable, "-m", "tectonic_py.cli.main", "metadata",
            "--data-dir", str(tmp_path / "d"), "--shards", "0", "--total-shards", "1",
            "--secret-file", str(secret_file),
        ],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert "no --capability-key-file" in lines[0]


async def test_the_metadata_service_grants_no_delete_of_a_chunk_a_block_needs(
    tmp_path, secret_file
):
    """``block.caps``: a delete only where the Block layer no longer needs the chunk on that
    node (a hedge copy, an old copy repointed away, a forgotten block), never for a chunk a
    committed block reads there or one a writer may still be writing."""
    async with open_meta_cluster(tmp_path, secret_file, servers=2, shards=4) as mc:
        c, key = mc.client, mc.capability_key
        await register_nodes(c, 4)
        f, tok = await c.create(ROOT_ID, "f", ec="rs-2-1")
        g = await c.allocate_block(f.id, tok, "rs-2-1", hedge=1)
        b, nodes = g.block_id, [n.node_id for n in g.nodes]
        shard = shard_of(b, 4)

        async def caps(action: str, *chunks: tuple[str, int, int]) -> list[bytes | None]:
            r = await c.call_shard(
                shard, "block.caps", {"action": action, "chunks": [list(x) for x in chunks]}
            )
            return r["caps"]

        # Allocated: a writer may be putting its chunks now; its put capability came with
        # block.allocate, and nothing else is granted.
        assert await caps("delete", (nodes[0], b, 0)) == [None]
        assert await caps("put", (nodes[0], b, 0)) == [None]
        placed = [ChunkPlacement(i, nodes[i], 70 + i) for i in range(3)]
        await c.commit_blocks(f.id, tok, [BlockInfo(b, "rs-2-1", 100, 150, placed, 0)])
        live = [(nodes[i], b, i) for i in range(3)]
        assert await caps("delete", *live) == [None, None, None]
        # The hedge copy of chunk 0 on nodes[3], chunk 1 on a node that holds chunk 0.
        hedge, misplaced = await caps("delete", (nodes[3], b, 0), (nodes[0], b, 1))
        assert hedge is not None and misplaced is not None
        capability.verify(key, hedge, b, nodes[3], op="delete", index=0)
        with pytest.raises(BadCapability):  # only that chunk, only on that node
            capability.verify(key, hedge, b, nodes[3], op="delete", index=1)
        with pytest.raises(BadCapability):
            capability.verify(key, hedge, b, nodes[0], op="delete", index=0)
        with pytest.raises(BadCapability):  # signed with the key, never with the secret
            capability.verify(mc.config.credential().key, hedge, b, nodes[3], op="delete", index=0)
        # Repair's put of a committed block's chunk; then the repoint frees the old copy.
        (put,) = await caps("put", (nodes[3], b, 0))
        assert put is not None
        capability.verify(key, put, b, nodes[3], index=0)
        await c.set_chunk(b, 0, nodes[0], nodes[3], 70)
        old, new = await caps("delete", (nodes[0], b, 0), (nodes[3], b, 0))
        assert old is not None and new is None
        # A block of another shard is absent here, which must not read as "gone".
        other = next(x for x in range(1, 1000) if shard_of(x, 4) != shard)
        with pytest.raises(WrongShard):
            await caps("delete", (nodes[0], other, 0))
        with pytest.raises(InvalidArgument):
            await caps("erase", (nodes[0], b, 0))
        with pytest.raises(InvalidArgument):
            await caps("delete", ("../etc", b, 0))
        # The block of a deleted file, once the GC forgot it: every chunk may go.
        await c.seal(f.id, tok, 150)
        await c.unlink(ROOT_ID, "f")
        assert await c.forget_block(b, state="committed") is not None
        assert None not in await caps("delete", (nodes[3], b, 0), (nodes[1], b, 1))


async def test_block_allocate_without_a_writer_token_hands_out_no_capability(tmp_path, secret_file):
    """Before: token 0 (no lease on the file) got a block and the capability to write it."""
    async with open_meta_cluster(tmp_path, secret_file) as mc:
        c = mc.client
        await register_nodes(c, 3)
        f, token = await c.create(ROOT_ID, "f", ec="rs-2-1")
        with pytest.raises(StaleWriterToken, match="without a writer token"):
            await c.allocate_block(f.id, 0, "rs-2-1", hedge=0)
        grant = await c.allocate_block(f.id, token, "rs-2-1", hedge=0)
        capability.verify(
            mc.capability_key, grant.capability, grant.block_id, grant.nodes[0].node_id
        )


async def test_a_client_of_a_real_cluster_cannot_delete_a_live_chunk(tmp_path):
    """Before: a peer holding the cluster secret deleted any chunk it could name. Now a
    client (even the maintenance runtime, without the key) gets no delete capability for a
    chunk a committed block needs, and cannot forge one: the key is not in the cluster file."""
    from maintenance_helpers import data_of, make_cluster, open_fresh_client, open_inspector, put

    cluster = make_cluster(tmp_path / "c", chunkstores=6, maintenance=False)
    try:
        config = cluster.start()
        key_file = cluster.capability_key_file
        assert key_file.stat().st_mode & 0o777 == 0o600
        assert "capability" not in cluster.cluster_file.read_text()
        data = data_of(40_000, seed=1)
        async with open_fresh_client(cluster) as client:
            await put(client, "/f", data)
            (block,) = await client.meta.block_list((await client.stat("/f")).id)
        chunk = block.chunks[0]
        cid = chunk_id(block.block_id, chunk.index)
        async with open_inspector(cluster) as m:
            node = (await m.nodes())[chunk.node_id]
            with pytest.raises(BadCapability, match="grants no delete"):
                await m.delete_chunk(node, block.block_id, chunk.index)
            forged = capability.issue(
                config.credential().key,
                block.block_id,
                [node.node_id],
                op="delete",
                index=chunk.index,
            )
            put_cap = capability.issue(config.credential().key, block.block_id, [node.node_id])
            c = await m.pool.client(node.address)
            for cap in (b"", forged, put_cap):
                with pytest.raises(BadCapability):
                    await c.delete(cid, cap)
            assert (await c.stat(cid)).size == block.chunk_len
        async with open_fresh_client(cluster) as client:
            r = await client.open_read("/f")
            try:
                assert await r.read() == data
            finally:
                await r.aclose()
    finally:
        cluster.stop()
