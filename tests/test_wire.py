"""Wire protocol: framing, multiplexing, mutual auth, limits and hostile input."""

from __future__ import annotations

import socket
import struct

import msgpack
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wire_helpers import address_of, raw_authenticated, read_any_frame, vma_fields

from tectonic_py.core import auth, buffers, framing, rpc_client, rpc_server, sockets
from tectonic_py.core.errors import (
    AuthError,
    Busy,
    ChunkNotFound,
    InvalidArgument,
    ProtocolError,
    Unavailable,
    UnknownOp,
)
from tectonic_py.core.rpc_server import Request


async def _echo(req: Request):
    data = req.payload
    return {"n": req.int("n", 0), "len": 0 if data is None else len(data)}, (data or b"")


async def _slow(req: Request):
    await trio.sleep(req.float("s"))
    return {"tag": req.int("tag")}


async def _missing(req: Request):
    raise ChunkNotFound(f"no chunk {req.str('id')}")


async def _crash(req: Request):
    raise RuntimeError("bug")


HANDLERS = {"echo": _echo, "slow": _slow, "missing": _missing, "crash": _crash}


async def start_server(nursery, secret, limits=framing.DEFAULT_LIMITS):
    server = rpc_server.RpcServer("test", secret, HANDLERS, limits)
    _host, port = await nursery.start(server.serve, "127.0.0.1", 0)
    return server, port


async def test_round_trip_payload_and_fields(nursery, secret):
    _, port = await start_server(nursery, secret)
    async with rpc_client.open_connection("127.0.0.1", port, secret) as conn:
        data = bytes(range(256)) * 4096
        resp = await conn.call("echo", {"n": 7}, data)
        assert resp.fields == {"n": 7, "len": len(data)}
        assert bytes(resp.payload) == data
        into = bytearray(len(data))
        resp = await conn.call("echo", {}, data, into=into)
        assert bytes(into) == data and resp.payload.obj is into


async def test_many_in_flight_matched_by_request_id(nursery, secret):
    _, port = await start_server(nursery, secret)
    results = {}
    async with rpc_client.open_connection("127.0.0.1", port, secret) as conn:

        async def one(tag):
            # Later tags finish first: replies come back out of order.
            resp = await conn.call("slow", {"s": 0.002 * (50 - tag), "tag": tag})
            results[tag] = resp.fields["tag"]

        async with trio.open_nursery() as n:
            for tag in range(50):
                n.start_soon(one, tag)
    assert results == {t: t for t in range(50)}


async def test_replies_ready_together_share_a_write_and_each_reaches_its_caller(nursery, secret):
    release = trio.Event()
    arrived = 0

    async def gate(req: Request):
        nonlocal arrived
        arrived += 1
        await release.wait()
        return {"tag": req.int("tag")}

    server = rpc_server.RpcServer("test", secret, {"gate": gate, "echo": _echo})
    _, port = await nursery.start(server.serve, "127.0.0.1", 0)
    results = {}
    async with rpc_client.open_connection("127.0.0.1", port, secret) as conn:

        async def one(tag):
            results[tag] = (await conn.call("gate", {"tag": tag})).fields["tag"]

        async with trio.open_nursery() as n:
            for tag in range(40):
                n.start_soon(one, tag)
            while arrived < 40:
                await trio.sleep(0.001)
            before = server.stats.reply_writes
            release.set()  # forty replies ready in one pass of the scheduler
        assert results == {t: t for t in range(40)}
        assert server.stats.reply_writes - before <= 4
        # A reply with a payload still goes on its own, after the small ones.
        resp = await conn.call("echo", {"n": 1}, b"x" * 100_000)
        assert resp.fields == {"n": 1, "len": 100_000} and bytes(resp.payload) == b"x" * 100_000


async def test_a_peer_that_does_not_read_its_replies_makes_senders_wait_not_memory_grow():
    """Replies queue while the socket is full; past the bound, senders wait (each holding
    its request's in-flight slot, which stops the server reading more requests)."""
    a, b = trio.socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    session = auth.FrameSession(b"k" * 32, b"k" * 32)
    outbox = rpc_server._Outbox(a, trio.Lock(), rpc_server.ServerStats(), session)
    stride = 1000 + framing.TAG_BYTES  # each frame goes out with its tag
    returned = 0

    async def reply(i: int) -> None:
        nonlocal returned
        await outbox.send(b"%06d" % i + b"r" * 994)
        returned += 1

    try:
        async with trio.open_nursery() as nursery:
            for i in range(100):
                nursery.start_soon(reply, i)
            await trio.testing.wait_all_tasks_blocked()  # one writev of 100 KB, stuck
            for i in range(100, 500):
                nursery.start_soon(reply, i)
            await trio.testing.wait_all_tasks_blocked()
            assert outbox.queued == 400
            assert returned <= 100 + rpc_server.MAX_QUEUED_REPLIES  # the other senders wait
            got = bytearray()
            while len(got) < 500 * stride:
                got += await b.recv(65536)
        assert returned == 500 and outbox.queued == 0
        assert sorted(int(got[i : i + 6]) for i in range(0, len(got), stride)) == list(range(500))
    finally:
        a.close()
        b.close()


async def test_domain_errors_come_back_as_the_same_class(nursery, secret):
    _, port = await start_server(nursery, secret)
    async with rpc_client.open_connection("127.0.0.1", port, secret) as conn:
        with pytest.raises(ChunkNotFound, match="no chunk abc"):
            await conn.call("missing", {"id": "abc"})
        with pytest.raises(UnknownOp):
            await conn.call("nope", {}, b"x" * 1000)
        with pytest.raises(InvalidArgument):
            await conn.call("slow", {"s": "soon", "tag": 1})
        with pytest.raises(InvalidArgument):
            await conn.call("missing", {})
        with pytest.raises(Exception, match="internal error: RuntimeError"):
            await conn.call("crash")
        # The connection survived every one of those.
        assert (await conn.call("echo", {"n": 1})).fields["n"] == 1


async def test_wrong_secret_is_refused_both_ways(nursery, secret):
    _, port = await start_server(nursery, secret)
    with pytest.raises(AuthError):
        async with rpc_client.open_connection("127.0.0.1", port, b"x" * 32):
            pass


async def test_client_rejects_impostor_server(nursery, secret):
    """A server that does not know the secret cannot pass the client's check."""

    async def impostor(stream):
        sock = stream.socket
        await framing.send_all(
            sock, framing.pack_frame({"op": "hello", "proto": auth.PROTO, "nonce": b"n" * 32}, 0)
        )
        await framing.read_prefix_and_header(sock, framing.DEFAULT_LIMITS)
        await framing.send_all(sock, framing.pack_frame({"op": "welcome", "mac": b"m" * 32}, 0))
        await trio.sleep(1)

    listeners = await nursery.start(trio.serve_tcp, impostor, 0)
    port = listeners[0].socket.getsockname()[1]
    with pytest.raises(AuthError):
        async with rpc_client.open_connection("127.0.0.1", port, secret):
            pass


async def test_unreachable_server_is_unavailable(secret):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(Unavailable):
        async with rpc_client.open_connection("127.0.0.1", port, secret):
            pass


async def _read_reply(sock):
    with trio.fail_after(5):
        return await read_any_frame(sock)


@pytest.mark.parametrize(
    "frame",
    [
        struct.pack("!BBHII", 9, 0, 0, 4, 0) + b"abcd",  # bad version
        struct.pack("!BBHII", 1, 0, 0, 0, 0),  # empty header
        struct.pack("!BBHII", 1, 0, 0, 2**31, 0),  # oversized header
        struct.pack("!BBHII", 1, 0, 0, 4, 2**31) + b"abcd",  # oversized payload
        struct.pack("!BBHII", 1, 0, 0, 3, 0) + b"\xc1\xc1\xc1",  # undecodable msgpack
        framing.PREFIX.pack(1, 0, 0, 2, 0) + msgpack.packb([1]),  # not a map
        # (flagged as tagged: the header's shape is refused before the tag is read)
        framing.pack_frame({"op": 5, "rid": 1}, 0, framing.FLAG_TAG),  # op not a string
        framing.pack_frame({"op": "echo", "rid": -1}, 0, framing.FLAG_TAG),  # bad rid
        framing.pack_frame({"op": "echo", "rid": 1, "f": [1]}, 0, framing.FLAG_TAG),  # not a map
        framing.pack_frame({"op": "echo", "rid": 1}, 0),  # no tag after the handshake
        framing.pack_frame({"op": "echo", "rid": 1}, 0, 0x80),  # unknown flag
        framing.PREFIX.pack(1, 0, 0, 50, 0) + b"\x81",  # truncated frame, then EOF
    ],
)
async def test_malformed_frames_get_an_error_and_the_server_keeps_serving(nursery, secret, frame):
    _server, port = await start_server(nursery, secret)
    sock = await raw_authenticated(port, secret)
    await framing.send_all(sock, frame)
    if frame.startswith(framing.PREFIX.pack(1, 0, 0, 50, 0)):
        sock.shutdown(socket.SHUT_WR)
    reply = await _read_reply(sock)
    if reply is not None:
        header, _ = reply
        assert header["rid"] == 0 and header["err"] == ProtocolError.code
    # The server closed that connection...
    assert await _read_reply(sock) is None
    sock.close()
    # ...and still serves everyone else.
    async with rpc_client.open_connection("127.0.0.1", port, secret) as conn:
        assert (await conn.call("echo", {"n": 3})).fields["n"] == 3


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(garbage=st.binary(min_size=1, max_size=300), authenticate=st.booleans())
def test_garbage_never_hurts_the_server(secret, garbage, authenticate):
    async def main():
        async with trio.open_nursery() as nursery:
            _, port = await start_server(nursery, secret, framing.Limits(auth_timeout=1))
            if authenticate:
                sock = await raw_authenticated(port, secret)
            else:
                sock = trio.socket.socket()
                await sock.connect(("127.0.0.1", port))
            try:
                await framing.send_all(sock, garbage)
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            with trio.move_on_after(3):
                try:
                    while await sock.recv(65536):
                        pass
                except ConnectionResetError:
                    pass
            sock.close()
            async with rpc_client.open_connection("127.0.0.1", port, secret) as conn:
                assert (await conn.call("echo", {"n": 1})).fields["n"] == 1
            nursery.cancel_scope.cancel()

    trio.run(main)


async def test_payload_budget_refuses_with_busy_past_the_queue(nursery, secret):
    limits = framing.Limits(payload_budget=1024 * 1024, max_payload_waiters=0)
    hold = trio.Event()

    async def blocking(req):
        await hold.wait()
        return {}

    server = rpc_server.RpcServer("t", secret, {"hold": blocking, **HANDLERS}, limits)
    _, port = await nursery.start(server.serve, "127.0.0.1", 0)
    async with (
        rpc_client.open_connection("127.0.0.1", port, secret) as conn,
        trio.open_nursery() as n,
    ):
        n.start_soon(conn.call, "hold", {}, b"x" * (1024 * 1024))
        await trio.sleep(0.2)
        assert server.stats.payload_bytes_held == 1024 * 1024
        with pytest.raises(Busy):
            await conn.call("echo", {}, b"y" * 1000)
        # Payload-free requests are still served.
        assert (await conn.call("echo", {"n": 2})).fields["n"] == 2
        hold.set()
    assert server.stats.busy_refusals == 1
    assert server.stats.payload_bytes_held == 0


async def test_cancelled_call_leaves_the_connection_usable(nursery, secret):
    _, port = await start_server(nursery, secret)
    async with rpc_client.open_connection("127.0.0.1", port, secret) as conn:
        with trio.move_on_after(0.05):
            await conn.call("slow", {"s": 0.5, "tag": 1})
        resp = await conn.call("echo", {}, b"z" * 100_000)
        assert bytes(resp.payload) == b"z" * 100_000


async def test_a_call_made_when_already_cancelled_sends_nothing(nursery, secret):
    server, port = await start_server(nursery, secret)
    async with rpc_client.open_connection("127.0.0.1", port, secret) as conn:
        await conn.call("echo", {})
        before = server.stats.requests
        with trio.CancelScope() as scope:
            scope.cancel()
            await conn.call("echo", {"n": 1}, b"x" * 1000)
        assert scope.cancelled_caught
        resp = await conn.call("echo", {"n": 2})
        assert resp.fields["n"] == 2
        assert server.stats.requests == before + 1  # only the last call reached the server


def _congestion(sock) -> str:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0")[0].decode()


async def test_loopback_connections_use_a_congestion_control_that_does_not_pace(nursery, secret):
    _, port = await start_server(nursery, secret)
    async with rpc_client.open_connection("127.0.0.1", port, secret) as conn:
        await conn.call("echo", {})
        assert _congestion(conn._sock) in sockets.LOOPBACK_CONGESTION
    # A socket that starts with BBR (internal pacing without fq) is switched.
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.socket()
    try:
        try:
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"bbr")
        except OSError:
            pytest.skip("no bbr in this kernel")
        client.connect(listener.getsockname())
        sockets.unpaced_on_loopback(trio.socket.from_stdlib_socket(client))
        assert _congestion(client) in sockets.LOOPBACK_CONGESTION
    finally:
        client.close()
        listener.close()


def test_connections_to_other_hosts_keep_the_systems_congestion_control():
    class Peer:
        def __init__(self, address):
            self.address, self.set = address, []

        def getpeername(self):
            return self.address

        def getsockopt(self, *args):
            return b"bbr\0"

        def setsockopt(self, *args):
            self.set.append(args)

    for address in (("10.1.2.3", 9000), ("fd00::5", 9000, 0, 0), ("::ffff:10.0.0.1", 1, 0, 0)):
        peer = Peer(address)
        sockets.unpaced_on_loopback(peer)
        assert peer.set == []
    for address in (("127.0.0.5", 9000), ("::1", 9000, 0, 0), ("::ffff:127.0.0.1", 1, 0, 0)):
        peer = Peer(address)
        sockets.unpaced_on_loopback(peer)
        assert peer.set and peer.set[0][2] == b"cubic"


async def test_server_death_fails_pending_calls_with_unavailable(secret):
    async with trio.open_nursery() as outer:
        server_scope = trio.CancelScope()

        async def run_server(task_status=trio.TASK_STATUS_IGNORED):
            with server_scope:
                server = rpc_server.RpcServer("t", secret, HANDLERS)
                await server.serve("127.0.0.1", 0, task_status=task_status)

        _, port = await outer.start(run_server)
        async with rpc_client.open_connection("127.0.0.1", port, secret) as conn:
            async with trio.open_nursery() as n:

                async def doomed():
                    with pytest.raises(Unavailable):
                        await conn.call("slow", {"s": 10, "tag": 1})

                n.start_soon(doomed)
                await trio.sleep(0.1)
                server_scope.cancel()
            with pytest.raises(Unavailable):
                await conn.call("echo")


async def test_a_send_waiting_on_a_full_socket_gets_unavailable_when_the_connection_closes(
    nursery, secret
):
    """A peer that stops reading fills the socket; closing the connection then must fail the
    call parked in its send with Unavailable, not with trio's ClosedResourceError."""
    sn = b"s" * 32

    async def authenticates_then_never_reads(stream):
        sock = stream.socket
        await framing.send_all(
            sock, framing.pack_frame({"op": "hello", "proto": auth.PROTO, "nonce": sn}, 0)
        )
        header, _ = await framing.read_prefix_and_header(sock, framing.DEFAULT_LIMITS)
        key = auth.role_key(secret, header["role"])
        mac = auth.mac(key, b"server|" + header["role"].encode(), header["nonce"], sn)
        await framing.send_all(sock, framing.pack_frame({"op": "welcome", "mac": mac}, 0))
        await trio.sleep_forever()

    listeners = await nursery.start(trio.serve_tcp, authenticates_then_never_reads, 0)
    port = listeners[0].socket.getsockname()[1]
    async with rpc_client.open_connection("127.0.0.1", port, secret) as conn:
        errors: list[BaseException] = []

        async def send_more_than_the_socket_holds():
            try:
                await conn.call("echo", {}, bytes(32 * framing.MiB))
            except BaseException as e:  # noqa: BLE001  (the test looks at which one)
                errors.append(e)

        async with trio.open_nursery() as n:
            n.start_soon(send_more_than_the_socket_holds)
            await trio.sleep(0.5)  # the send fills the socket and waits for room
            assert not errors
            await conn.aclose()
        assert len(errors) == 1 and isinstance(errors[0], Unavailable), errors


def test_parse_address():
    assert sockets.parse_address("127.0.0.1:80") == ("127.0.0.1", 80)
    assert sockets.parse_address("[::1]:9") == ("::1", 9)
    from tectonic_py.core.errors import ConfigError

    for bad in ["nohost", ":80", "h:", "h:99999", "h:x"]:
        with pytest.raises(ConfigError):
            sockets.parse_address(bad)


async def test_payload_buffers_are_reused_but_never_while_a_view_lives(nursery, secret):
    kept: list[memoryview] = []

    async def keep(req: Request):
        kept.append(req.require_payload())
        return {}

    async def digest(req: Request):
        return {"sum": sum(req.require_payload()[::4096])}

    server = rpc_server.RpcServer("t", secret, {"keep": keep, "digest": digest})
    _, port = await nursery.start(server.serve, "127.0.0.1", 0)
    async with rpc_client.open_connection("127.0.0.1", port, secret) as conn:
        size = 256 * 1024
        await conn.call("digest", {}, bytes([1]) * size)
        before = server._spares.reused
        for i in range(4):
            resp = await conn.call("digest", {}, bytes([i + 2]) * (size - i))
            assert resp.fields["sum"] == (i + 2) * len(range(0, size - i, 4096))
        assert server._spares.reused >= before + 3  # a buffer went round and came back
        await conn.call("keep", {}, b"\x07" * size)
        for i in range(3):
            await conn.call("digest", {}, b"\x09" * size)
        assert bytes(kept[0]) == b"\x07" * size  # the kept view was never handed out again
        # echo replies with a view of its own payload: the buffer is reused only after the send.
        echo_server = rpc_server.RpcServer("e", secret, HANDLERS)
        _, eport = await nursery.start(echo_server.serve, "127.0.0.1", 0)
    async with rpc_client.open_connection("127.0.0.1", eport, secret) as conn:
        for i in range(3):
            data = bytes([i]) * size
            assert bytes((await conn.call("echo", {}, data)).payload) == data


def test_spare_buffer_is_not_handed_out_while_a_view_lives():
    spares = buffers.SpareBuffers(keep=8 * 1024 * 1024)
    buf = spares.take(100_000)
    view = memoryview(buf)[10:20]
    view[:] = b"k" * 10
    spares.give_back(buf)
    other = spares.take(100_000)
    assert other is not buf and spares.reused == 0 and bytes(view) == b"k" * 10
    del view
    assert spares.take(100_000) is buf and spares.reused == 1
    spares.give_back(bytearray(100_000))  # not one of ours: never kept
    assert spares.take(1000) == bytearray(1000)


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def test_huge_spare_buffers_are_whole_huge_pages_of_private_memory():
    """O_DIRECT buffers: sizes over half a huge page take whole huge pages, and the memory
    is private and advised for THP (shared anonymous memory is shmem, kept in small pages
    by default), so the kernel can back it with 2 MiB pages."""
    MiB = 1024 * 1024
    spares = buffers.SpareBuffers(keep=16 * MiB, huge=True)
    assert spares.size_class(1028 * 1024) == 2 * MiB
    assert spares.size_class(4 * MiB + 4096) == 6 * MiB
    assert spares.size_class(MiB) == buffers.SpareBuffers(0).size_class(MiB) == MiB
    buf = spares.take(1028 * 1024)
    assert len(buf) == 2 * MiB
    buf[:] = b"x" * len(buf)  # fault it in
    address = address_of(buf)
    assert address % 4096 == 0
    vma = vma_fields(address)
    assert vma, "mapping not found in smaps"
    if _thp_mode() in ("always", "madvise"):
        assert vma.get("THPeligible") == "1", vma
    spares.give_back(buf)
    assert spares.take(1100 * 1024) is buf and spares.reused == 1
    # A huge page the buffer would use less than half of stays in small pages: a 4 MiB
    # chunk and its header take two huge pages and a small one, not three huge pages.
    big = spares.take(4 * MiB + 4096)
    assert len(big) == 6 * MiB
    if _thp_mode() == "madvise":
        base = address_of(big)
        assert vma_fields(base).get("THPeligible") == "1"
        assert vma_fields(base + 4 * MiB).get("THPeligible") == "0"


def test_spare_buffers_make_room_for_a_new_size():
    """A pool full of one size must not refuse every buffer of the next size (1 MiB chunks
    after 4 MiB ones): spares of the size used least recently are dropped instead."""
    MiB = 1024 * 1024
    spares = buffers.SpareBuffers(keep=8 * MiB)
    big = [spares.take(4 * MiB) for _ in range(2)]
    for buf in big:
        spares.give_back(buf)
    small = [spares.take(1 * MiB) for _ in range(4)]
    for buf in small:
        spares.give_back(buf)
    before = spares.reused
    again = [spares.take(1 * MiB) for _ in range(4)]
    assert spares.reused == before + 4 and {id(b) for b in again} == {id(b) for b in small}
    assert spares._bytes <= spares.keep
    assert any(b.closed for b in big)


async def test_concurrent_drains_each_feed_their_own_bytes():
    """Two connections refused at once drain their payloads side by side; each tag check must
    see that connection's bytes (a scratch buffer shared between drains failed honest tags)."""
    pairs = [trio.socket.socketpair() for _ in range(2)]
    size = 3 * framing.DRAIN_PIECE + 123
    seen: list[bytearray] = [bytearray(), bytearray()]

    async def drain_one(i: int) -> None:
        await framing.drain(pairs[i][1], size, lambda piece: seen[i].extend(piece))

    async def trickle(i: int) -> None:
        data = bytes([i + 1]) * size
        for off in range(0, size, 4096):  # small sends, so the drains interleave
            await pairs[i][0].send(data[off : off + 4096])
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as n:
        for i in range(2):
            n.start_soon(drain_one, i)
            n.start_soon(trickle, i)
    for i in range(2):
        assert bytes(seen[i]) == bytes([i + 1]) * size
    for a, b in pairs:
        a.close()
        b.close()
