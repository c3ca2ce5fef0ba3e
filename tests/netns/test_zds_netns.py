"""ZDS end to end with real network namespaces (root): the fd ztunnel receives is the
pod's netns, listeners opened through it live in the pod, redirected traffic lands on
them with the original destination, and a port conflict becomes a real NACK.

The ztunnel side is the fake ztunnel (agent.demo.fake_ztunnel), built from ``docs/zds.md``;
no real ztunnel runs here (``docs/maintainers/testing.md``).
"""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from agent.core.netns import open_netns
from zds import PodInfo, ZdsNack
from tests.zds.helpers import running_client, running_server


def _read_banner(sock: socket.socket) -> str:
    try:
        return sock.recv(200).decode()
    finally:
        sock.close()


def _host_connect(host: str, port: int) -> str | None:
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect((host, port))
    except OSError:
        s.close()
        return None
    return _read_banner(s)


async def _add(server, p, **kw):
    fd = open_netns(p.netns_path)
    try:
        await server.add(PodInfo(p.uid, p.name, "default", "sa", fd), **kw)
    finally:
        os.close(fd)  # the server keeps its own dup


async def test_received_fd_is_the_pods_netns(bridge):
    p = await asyncio.to_thread(bridge.add_pod, "zp")
    async with running_server() as server:
        async with running_client(server.path, open_listeners=True) as client:
            await client.wait_snapshot(timeout=5)
            await _add(server, p)
            held = client.pods[p.uid]
            assert held.identity[0] == os.stat(p.netns_path).st_ino
            # Reachable from inside the pod on its loopback: only the pod's listener can answer.
            banner = await asyncio.to_thread(lambda: _read_banner(p.connect("127.0.0.1", 15006)))
            assert banner == f"zds-client {p.uid} 15006\n"
            # From the host, 127.0.0.1 is the host's loopback: our pod's listener is not there.
            assert await asyncio.to_thread(_host_connect, "127.0.0.1", 15006) != banner
            # Through the bridge the pod's address reaches it (it lives in the pod's netns).
            assert await asyncio.to_thread(_host_connect, p.ip, 15008) == \
                f"zds-client {p.uid} 15008\n"
            accepted = [await client.accepted.get() for _ in range(2)]
            assert [(a.uid, a.port) for a in accepted] == [(p.uid, 15006), (p.uid, 15008)]
            assert accepted[1].peer[0] == bridge.gateway
            await server.delete(p.uid)
            assert p.uid not in client.pods
            # Listeners closed with the proxy.
            assert await asyncio.to_thread(_host_connect, p.ip, 15008) is None


async def test_redirected_traffic_lands_with_original_destination(bridge):
    p = await asyncio.to_thread(bridge.add_pod, "zr")
    # A slice of the golden in-pod rules (``docs/enrollment.md``): outbound and inbound REDIRECT.
    rules = ("*nat\n"
             "-A PREROUTING -p tcp --dport 8080 -j REDIRECT --to-ports 15006\n"
             "-A OUTPUT -p tcp -d 192.0.2.10 -m mark ! --mark 0x539/0xfff "
             "-j REDIRECT --to-ports 15001\n"
             "COMMIT\n")
    p.exec("iptables-restore", "--noflush", input=rules)
    async with running_server() as server:
        async with running_client(server.path, open_listeners=True) as client:
            await _add(server, p)
            out = await asyncio.to_thread(lambda: _read_banner(p.connect("192.0.2.10", 9999)))
            assert out == f"zds-client {p.uid} 15001\n"
            a = await client.accepted.get()
            assert (a.port, a.original_dst) == (15001, ("192.0.2.10", 9999))
            inbound = await asyncio.to_thread(_host_connect, p.ip, 8080)
            assert inbound == f"zds-client {p.uid} 15006\n"
            a = await client.accepted.get()
            assert (a.port, a.original_dst, a.peer[0]) == (15006, (p.ip, 8080), bridge.gateway)
            # DNS on 15053 (UDP) inside the pod.
            def dns():
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                s.sendto(b"query", ("127.0.0.1", 15053))
                s.close()
            await asyncio.to_thread(p.run, dns)
            a = await asyncio.wait_for(client.accepted.get(), 3)
            assert (a.port, a.protocol, a.data) == (15053, "udp", b"query")


async def test_port_conflict_is_a_nack_then_pending_retry_succeeds(bridge):
    p = await asyncio.to_thread(bridge.add_pod, "zc")
    blocker = p.listen(15001)  # no SO_REUSEPORT: ztunnel's bind must fail
    try:
        async with running_server() as server:
            async with running_client(server.path, open_listeners=True,
                                      pending_retry=0.1) as client:
                with pytest.raises(ZdsNack, match="failure to start proxy"):
                    await _add(server, p)
                assert p.uid in client.pending and not client.ready
                blocker.close()
                await client.wait_for_pod(p.uid, timeout=3)
                assert not client.pending and client.ready
    finally:
        blocker.close()


async def test_two_ztunnels_share_pod_ports_and_new_netns_replaces_proxy(bridge):
    p = await asyncio.to_thread(bridge.add_pod, "z2")
    q = await asyncio.to_thread(bridge.add_pod, "z2")
    async with running_server() as server:
        async with running_client(server.path, open_listeners=True) as old:
            await _add(server, p)
            async with running_client(server.path, open_listeners=True) as new:
                await new.wait_snapshot(timeout=5)
                # SO_REUSEPORT lets both ztunnels hold the pod's ports (rolling upgrade).
                assert p.uid in old.pods and p.uid in new.pods
                # Sandbox re-created: same uid, q's netns -> the proxy moves.
                fd = open_netns(q.netns_path)
                try:
                    await server.add(PodInfo(p.uid, p.name, "default", "sa", fd))
                finally:
                    os.close(fd)
                assert new.pods[p.uid].identity[0] == os.stat(q.netns_path).st_ino
                banner = await asyncio.to_thread(_host_connect, q.ip, 15008)
                assert banner == f"zds-client {p.uid} 15008\n"
