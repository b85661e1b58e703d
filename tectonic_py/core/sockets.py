"""TCP sockets of the wire protocol: addresses, connecting, and tuning for loopback.

Every server listens and every client connects through here, so a socket option that
matters (``TCP_NODELAY``: a request is a whole frame, never worth delaying for the next;
unpaced congestion control on loopback) is set in one place.
"""

from __future__ import annotations

import ipaddress
import socket as _stdlib_socket

import trio

from tectonic_py.core.errors import ConfigError

# Congestion control for connections that never leave the host, in order of preference
# (reno is one every process may choose).
LOOPBACK_CONGESTION = ("cubic", "reno")


def parse_address(text: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port), with a clear error."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ConfigError(f"bad address {text!r}: expected HOST:PORT")
    host = host.strip("[]")
    p = int(port)
    if not 0 <= p <= 65535:
        raise ConfigError(f"bad port in {text!r}")
    return host, p


async def connect_tcp(host: str, port: int) -> trio.socket.SocketType:
    """A connected, tuned TCP socket; raises ``OSError`` as the connect did. A connect that
    fails or is cancelled (a caller's connect timeout) leaves no socket behind."""
    sock = trio.socket.socket(
        _stdlib_socket.AF_INET6 if ":" in host else _stdlib_socket.AF_INET,
        _stdlib_socket.SOCK_STREAM,
    )
    try:
        sock.setsockopt(_stdlib_socket.IPPROTO_TCP, _stdlib_socket.TCP_NODELAY, 1)
        await sock.connect((host, port))
        unpaced_on_loopback(sock)
    except BaseException:
        sock.close()
        raise
    return sock


def unpaced_on_loopback(sock: trio.socket.SocketType) -> None:
    """Give a loopback TCP connection a congestion control that does not pace its sends.

    Why: with BBR as the system's default and no fq qdisc (loopback has no qdisc at all),
    the kernel paces every send with its own timers ("TCP internal pacing"), a few timer
    softirqs per large put, which cost the sender CPU and slowed chunk-store puts over
    loopback (docs/decisions/2026-12-01-wire.md). Pacing spares a network's queues;
    loopback has none. Connections to other hosts keep the system's choice, and a failure
    here changes nothing.
    """
    try:
        addr = ipaddress.ip_address(str(sock.getpeername()[0]).split("%")[0])
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        if not addr.is_loopback:
            return
        tcp = _stdlib_socket.IPPROTO_TCP
        current = sock.getsockopt(tcp, _stdlib_socket.TCP_CONGESTION, 16)
        if current.split(b"\0")[0].decode() in LOOPBACK_CONGESTION:
            return
    except (OSError, ValueError, AttributeError):  # (AttributeError: no TCP_CONGESTION)
        return
    for name in LOOPBACK_CONGESTION:
        try:
            sock.setsockopt(tcp, _stdlib_socket.TCP_CONGESTION, name.encode())
            return
        except OSError:  # not built in, or not allowed to this process
            continue
