"""ztunnel's in-pod listeners as the fake ztunnel opens them in a pod's netns, and what
landed on them.

ztunnel (``src/inpod/`` and ``src/proxy/``) binds, inside each pod's netns through the
fd it was handed: TCP 15001 (outbound, REDIRECTed, so ``SO_ORIGINAL_DST`` names the
original destination), 15006 (inbound plaintext) and 15008 (HBONE), both
``IP_TRANSPARENT``, and DNS on 127.0.0.1:15053 (UDP and TCP); every socket with
``SO_MARK`` 1337 and ``SO_REUSEPORT``. IPv6 twins are opened when the netns has IPv6.
Used by :mod:`agent.demo.fake_ztunnel`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import struct
from typing import Awaitable, Callable

from agent.core.netns import run_in_netns_thread

OUTBOUND_PORT, INBOUND_PORT, HBONE_PORT, DNS_PORT = 15001, 15006, 15008, 15053
PACKET_MARK = 1337           # ztunnel's default in-pod socket mark (0x539)
SO_ORIGINAL_DST = 80         # linux/netfilter_ipv4.h; IP6T_SO_ORIGINAL_DST has the same value


@dataclasses.dataclass
class Accepted:
    """One connection (TCP) or datagram (UDP, DNS) that landed on a pod's listener.

    ``uid``: pod uid; ``port``: listener port; ``protocol``: "tcp"|"udp"; ``peer`` and
    ``local``: socket addresses; ``original_dst``: ``SO_ORIGINAL_DST`` when the kernel
    has one (REDIRECTed traffic), else ``local`` (TPROXY/IP_TRANSPARENT delivery keeps
    the original destination as the local address); ``data``: the datagram for UDP.
    """

    uid: str
    port: int
    protocol: str
    peer: tuple
    local: tuple
    original_dst: tuple | None
    data: bytes = b""


@dataclasses.dataclass(eq=False, slots=True)
class HeldPod:
    """A running "proxy" for a pod: its workload info, netns fd and listeners."""

    uid: str
    name: str
    namespace: str
    service_account: str
    netns_fd: int
    listeners: list[socket.socket] = dataclasses.field(default_factory=list)
    tasks: list[asyncio.Task] = dataclasses.field(default_factory=list)
    _identity: tuple[int, int] | None = dataclasses.field(default=None, repr=False)

    @property
    def identity(self) -> tuple[int, int]:
        """ztunnel's netns identity, ``(st_ino, st_dev)`` of the held fd. ``fstat``'d on
        first use: only a repeated Add for the uid needs it. OSError once drained."""
        if self._identity is None:
            st = os.fstat(self.netns_fd)
            self._identity = (st.st_ino, st.st_dev)
        return self._identity


def original_dst(sock: socket.socket) -> tuple | None:
    """``SO_ORIGINAL_DST`` of an accepted TCP socket as (host, port), or None if none."""
    try:
        if sock.family == socket.AF_INET6:
            raw = sock.getsockopt(socket.IPPROTO_IPV6, SO_ORIGINAL_DST, 28)
            port = struct.unpack_from("!H", raw, 2)[0]
            return socket.inet_ntop(socket.AF_INET6, raw[8:24]), port
        raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
        port = struct.unpack_from("!H", raw, 2)[0]
        return socket.inet_ntop(socket.AF_INET, raw[4:8]), port
    except OSError:
        return None


def _listener(family: int, kind: int, host: str, port: int, transparent: bool,
              mark: int) -> socket.socket:
    sock = socket.socket(family, kind | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        if transparent:
            level = socket.IPPROTO_IPV6 if family == socket.AF_INET6 else socket.SOL_IP
            opt = 75 if family == socket.AF_INET6 else 19  # IPV6_TRANSPARENT / IP_TRANSPARENT
            sock.setsockopt(level, opt, 1)
        sock.bind((host, port))
        if kind == socket.SOCK_STREAM:
            sock.listen(128)
        return sock
    except BaseException:
        sock.close()
        raise


def open_pod_listeners(netns_fd: int, mark: int = PACKET_MARK) -> list[socket.socket]:
    """Open ztunnel's in-pod listeners inside the netns ``netns_fd`` (blocking; a thread).

    IPv4 listeners are required (OSError, e.g. EADDRINUSE, propagates after closing
    what was opened); IPv6 ones are best effort (a pod netns may have IPv6 disabled).
    """
    def body() -> list[socket.socket]:
        socks: list[socket.socket] = []
        try:
            for port in (OUTBOUND_PORT, INBOUND_PORT, HBONE_PORT):
                transparent = port != OUTBOUND_PORT
                socks.append(_listener(socket.AF_INET, socket.SOCK_STREAM, "0.0.0.0", port,
                                       transparent, mark))
            for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
                socks.append(_listener(socket.AF_INET, kind, "127.0.0.1", DNS_PORT, False, mark))
            v6 = [(socket.SOCK_STREAM, "::", p, p != OUTBOUND_PORT)
                  for p in (OUTBOUND_PORT, INBOUND_PORT, HBONE_PORT)]
            v6 += [(socket.SOCK_DGRAM, "::1", DNS_PORT, False),
                   (socket.SOCK_STREAM, "::1", DNS_PORT, False)]
            for kind, host, port, transparent in v6:
                try:
                    socks.append(_listener(socket.AF_INET6, kind, host, port, transparent, mark))
                except OSError:
                    break  # no IPv6 in this netns
        except BaseException:
            for s in socks:
                s.close()
            raise
        return socks

    return run_in_netns_thread(netns_fd, body)



def close_listeners(pod: HeldPod) -> None:
    for task in pod.tasks:
        task.cancel()
    for sock in pod.listeners:
        sock.close()



Deliver = Callable[[Accepted, "socket.socket | None"], Awaitable[None]]


async def serve_listener(uid: str, sock: socket.socket, deliver: Deliver) -> None:
    """Accept on (TCP) or receive from (UDP) one of pod ``uid``'s listeners until
    cancelled; each connection or datagram goes to ``deliver`` as an :class:`Accepted`
    (with the accepted socket for TCP, which ``deliver`` then owns)."""
    loop = asyncio.get_running_loop()
    port = sock.getsockname()[1]
    while True:
        if sock.type == socket.SOCK_DGRAM:
            data, peer = await loop.sock_recvfrom(sock, 4096)
            await deliver(Accepted(uid, port, "udp", peer, sock.getsockname(),
                                   sock.getsockname(), data), None)
            continue
        conn, peer = await loop.sock_accept(sock)
        local = conn.getsockname()
        dst = original_dst(conn)
        await deliver(Accepted(uid, port, "tcp", peer, local, dst or local), conn)
