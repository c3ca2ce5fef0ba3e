"""Who may call what: loopback-only metrics (``metrics_localhost_only``, spec
``docs/status.md``). The admin endpoints are not on TCP at all (admin socket).

"Loopback" is decided from the TCP peer address only (127.0.0.0/8, ::1, or an
IPv4-mapped loopback); headers such as ``X-Forwarded-For`` are never trusted.
"""

from __future__ import annotations

import ipaddress

from aiohttp import web


def peer_ip(request: web.Request) -> str:
    """The TCP peer's IP as a string ("" when unknown, e.g. a Unix socket)."""
    peer = request.transport.get_extra_info("peername") if request.transport else None
    if isinstance(peer, (tuple, list)) and peer:
        return str(peer[0])
    return ""


def is_loopback(request: web.Request) -> bool:
    """True when the request came from a loopback address."""
    try:
        ip = ipaddress.ip_address(peer_ip(request).split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback
