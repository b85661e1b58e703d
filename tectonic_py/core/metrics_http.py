"""The metrics endpoint: ``GET /metrics`` over plain HTTP/1.0, served from trio.

prometheus_client's own ``start_http_server`` runs a bare thread; the daemons are trio
programs whose only threads are ``trio.to_thread`` workers, so the endpoint is a small trio
handler and prometheus_client only makes the text (``Metrics.exposition``). One request per
connection, answered and closed: a scraper asks once every few seconds, keep-alive would
buy nothing. Requests are bounded (head size, time), so a stuck or hostile peer holds a
socket for seconds at most.
"""

from __future__ import annotations

import logging
from functools import partial

import trio
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from tectonic_py.core.errors import ConfigError
from tectonic_py.core.metrics import Metrics
from tectonic_py.core.sockets import parse_address

log = logging.getLogger(__name__)

MAX_HEAD = 16 * 1024
REQUEST_TIMEOUT_S = 10.0


def parse_listen(text: str) -> tuple[str, int]:
    """``--metrics-listen HOST:PORT`` (port 0: any free port)."""
    try:
        return parse_address(text)
    except ConfigError as e:
        raise ConfigError(f"--metrics-listen: {e.message}") from None


async def start_endpoint(nursery: trio.Nursery, metrics: Metrics, listen: str | None) -> str | None:
    """``serve_metrics`` in ``nursery`` on ``--metrics-listen``'s address; None when off."""
    if listen is None:
        return None
    host, port = parse_listen(listen)
    address: str = await nursery.start(serve_metrics, metrics, host, port)
    return address


async def serve_metrics(
    metrics: Metrics,
    host: str,
    port: int,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``metrics`` until cancelled; ``started("HOST:PORT")`` once bound."""
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as e:
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {e.strerror or e}") from None
    bound = listeners[0].socket.getsockname()
    address = f"[{bound[0]}]:{bound[1]}" if ":" in bound[0] else f"{bound[0]}:{bound[1]}"
    log.info("metrics on http://%s/metrics", address)
    task_status.started(address)
    await trio.serve_listeners(partial(_answer, metrics), listeners)


async def _answer(metrics: Metrics, stream: trio.SocketStream) -> None:
    try:
        with trio.move_on_after(REQUEST_TIMEOUT_S):
            head = await _read_head(stream)
            if head is None:
                return
            method, _, rest = head.partition(" ")
            path = rest.partition(" ")[0].partition("?")[0]
            if method not in ("GET", "HEAD"):
                await _reply(stream, "405 Method Not Allowed", b"GET only\n", "text/plain")
            elif path not in ("/metrics", "/"):
                await _reply(stream, "404 Not Found", b"see /metrics\n", "text/plain")
            else:
                await metrics.refresh()
                body = metrics.exposition()
                await _reply(stream, "200 OK", body, CONTENT_TYPE_PLAIN_0_0_4, method == "HEAD")
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()


async def _read_head(stream: trio.SocketStream) -> str | None:
    """The request line, once the whole head has arrived; None for a peer that closed or
    sent more than MAX_HEAD bytes of head."""
    data = b""
    while b"\r\n\r\n" not in data and b"\n\n" not in data:
        if len(data) > MAX_HEAD:
            return None
        piece = await stream.receive_some(4096)
        if not piece:
            return None
        data += piece
    return data.split(b"\n", 1)[0].decode("latin-1").strip()


async def _reply(
    stream: trio.SocketStream, status: str, body: bytes, content_type: str, head: bool = False
) -> None:
    header = (
        f"HTTP/1.0 {status}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode("latin-1")
    await stream.send_all(header if head else header + body)
