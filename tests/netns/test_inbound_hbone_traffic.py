"""Inbound HBONE through a ztunnel-like proxy, with real rules and real TCP (issue 16 item 3).

What ztunnel does for an inbound HBONE connection, reduced to its kernel facts (ztunnel
``src/proxy/inbound.rs`` and ``socket.rs``): it accepts on the pod's port 15008 inside the
pod netns, then opens the connection to the application from the *client's* address
(``IP_TRANSPARENT``/``IPV6_TRANSPARENT`` socket bound to a non-local address) with its
packet mark 0x539 (``SO_MARK``). The application's replies go to that foreign address;
only the in-pod mangle rule (mark 0x539 -> connmark 0x111) and the fwmark routing
(0x111 -> table 100 -> ``local default dev lo``) bring them back to ztunnel's socket.
Without that rule the reply leaves through eth0, the client's kernel resets it, and
the connection never completes.

Pods are real netns on a bridge; the rules are ours applied with the real tools
(iptables-nft, iptables-legacy, nftables), IPv4 and IPv6, in the default mode and in
ingress mode (``ambient.istio.io/bypass-inbound-capture: "true"``), which must keep the
mangle rule exactly as upstream's ``ingress.golden`` does.
"""

from __future__ import annotations

import socket
import threading

import pytest

from cni.rules_common import ANNOTATION_BYPASS_INBOUND, INPOD_MARK, RuleOptions, pod_options
from tests.netns.test_enrollment_rules import BACKENDS, SO_MARK, accept_one

IP_TRANSPARENT = 19  # <linux/in.h>
IPV6_TRANSPARENT = 75  # <linux/in6.h>
APP_PORT, HBONE_PORT = 8080, 15008


def transparent_socket(family: int, source: str) -> socket.socket:
    """What ztunnel's inbound side dials the app with: a TCP socket marked 0x539, bound to
    the client's (non-local) address. Call inside the pod netns."""
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.settimeout(3)
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, IPV6_TRANSPARENT, 1)
        else:
            s.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
        s.setsockopt(socket.SOL_SOCKET, SO_MARK, INPOD_MARK)
        s.bind((source, 0))
    except BaseException:
        s.close()
        raise
    return s


def app_server(listener: socket.socket, seen: list) -> None:
    """The pod's application: answer one request with ``pong:<peer address>``."""
    conn = accept_one(listener, timeout=5)
    with conn:
        peer = conn.getpeername()[0]
        seen.append(peer)
        if conn.recv(64) == b"ping":
            conn.sendall(b"pong:" + peer.encode())


@pytest.fixture(params=sorted(BACKENDS))
def backend(request):
    return BACKENDS[request.param]()


@pytest.mark.parametrize("mode", ["default", "ingress"])
@pytest.mark.parametrize("family", ["ipv4", "ipv6"])
def test_inbound_via_transparent_marked_socket_completes(bridge6, backend, family, mode):
    """Client C connects to A's HBONE port; the proxy there dials A's app from C's address
    with mark 0x539 and relays one request. The app sees C's address, the client gets
    the answer. Fails without the mangle CONNMARK rule (ingress mode before the fix)."""
    v6 = family == "ipv6"
    fam = socket.AF_INET6 if v6 else socket.AF_INET
    addr = (lambda p: p.ip6) if v6 else (lambda p: p.ip)
    any_addr = "::" if v6 else "0.0.0.0"
    a, c = bridge6.add_pod("ta"), bridge6.add_pod("tc")
    annotations = {ANNOTATION_BYPASS_INBOUND: "true"} if mode == "ingress" else {}
    opts = pod_options(RuleOptions(ipv6=True, dns_capture=False), annotations)
    assert opts.ingress_mode is (mode == "ingress")
    a.run(backend.apply, opts)

    app = a.listen(APP_PORT, any_addr)
    hbone = a.listen(HBONE_PORT, any_addr)
    seen: list[str] = []
    server = threading.Thread(target=app_server, args=(app, seen), daemon=True)
    server.start()
    client = upstream = downstream = None
    try:
        client = c.connect(addr(a), HBONE_PORT, timeout=3)  # not captured: port 15008
        downstream = accept_one(hbone)
        client_ip = downstream.getpeername()[0]
        assert client_ip == addr(c)
        upstream = a.run(transparent_socket, fam, client_ip)
        try:
            upstream.connect((addr(a), APP_PORT))
        except OSError as e:
            pytest.fail(f"ztunnel-like connect from {client_ip} to the app did not complete "
                        f"({e}): replies to mark-0x539 connections are not routed back")
        client.sendall(b"ping")
        upstream.sendall(downstream.recv(64))
        downstream.sendall(upstream.recv(64))
        client.settimeout(3)
        assert client.recv(64) == b"pong:" + addr(c).encode()
        assert seen == [addr(c)]  # the app saw the real client, as with ztunnel
    finally:
        for s in (client, upstream, downstream, app, hbone):
            if s is not None:
                s.close()
        server.join(timeout=6)
