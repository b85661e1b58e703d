"""What an adversary on the network or on the host must not be able to do.

A secret file others can read is refused; a peer that has not authenticated holds next to no
memory; a relay that passed the handshake through cannot inject, replay or reorder frames;
a capability names the one op it licenses, and no capability goes to a caller without the
file's writer token.
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
from tectonic_py.core.errors import BadCapability, ConfigError, StaleWriterToken, Unavailable
from tectonic_py.core.ids import ROOT_ID
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
    put = capability.issue(secret, 7, ["n1"])
    capability.verify(secret, put, 7, "n1")
    with pytest.raises(BadCapability, match="not 'delete'"):
        capability.verify(secret, put, 7, "n1", op="delete")
    delete = capability.issue(secret, 7, ["n1"], op="delete")
    capability.verify(secret, delete, 7, "n1", op="delete")
    with pytest.raises(BadCapability):
        capability.verify(secret, delete, 7, "n1")  # and no put with a delete token
    with pytest.raises(BadCapability):
        capability.verify(secret, delete, 8, "n1", op="delete")


async def test_block_allocate_without_a_writer_token_hands_out_no_capability(tmp_path, secret_file):
    """Before: token 0 (no lease on the file) got a block and the capability to write it."""
    async with open_meta_cluster(tmp_path, secret_file) as mc:
        c = mc.client
        await register_nodes(c, 3)
        f, token = await c.create(ROOT_ID, "f", ec="rs-2-1")
        with pytest.raises(StaleWriterToken, match="without a writer token"):
            await c.allocate_block(f.id, 0, "rs-2-1", hedge=0)
        grant = await c.allocate_block(f.id, token, "rs-2-1", hedge=0)
        secret = secret_file.read_bytes().strip()
        capability.verify(secret, grant.capability, grant.block_id, grant.nodes[0].node_id)
