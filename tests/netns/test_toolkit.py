"""The netns toolkit itself: pods are isolated, reachable over the bridge, and torn down."""

from __future__ import annotations

import os
import socket
import threading

from pyroute2 import IPRoute

from agent.core.netns import netns_inode
from tests.netns.toolkit import Bridge


def _accept_once(server: socket.socket, out: list):
    conn, addr = server.accept()
    out.append(addr[0])
    conn.sendall(b"ok")
    conn.close()


def test_pod_to_pod_over_bridge(bridge):
    a, b = bridge.add_pod(), bridge.add_pod()
    server = b.listen(7070)
    seen: list = []
    t = threading.Thread(target=_accept_once, args=(server, seen))
    t.start()
    conn = a.connect(b.ip, 7070)
    assert conn.recv(2) == b"ok"
    conn.close()
    t.join(5)
    server.close()
    assert seen == [a.ip]


def test_pod_netns_is_not_host_netns(bridge):
    pod = bridge.add_pod()
    assert netns_inode(pod.netns_path) != netns_inode("/proc/self/ns/net")
    # A listener on the pod's loopback is not reachable from the host.
    server = pod.listen(7071, host="127.0.0.1")
    with socket.socket() as s:
        s.settimeout(1)
        assert s.connect_ex(("127.0.0.1", 7071)) != 0
    server.close()


def test_dual_stack(bridge6):
    a, b = bridge6.add_pod(), bridge6.add_pod()
    server = b.listen(7072, host="::", family=socket.AF_INET6)
    seen: list = []
    t = threading.Thread(target=_accept_once, args=(server, seen))
    t.start()
    conn = a.connect(b.ip6, 7072)
    assert conn.recv(2) == b"ok"
    conn.close()
    t.join(5)
    server.close()
    assert seen == [a.ip6]


def test_teardown_removes_everything():
    br = Bridge()
    pods = [br.add_pod(), br.add_pod()]
    names = [p.name for p in pods]
    veths = [p.host_veth for p in pods]
    br.close()
    for n in names:
        assert not os.path.exists(f"/var/run/netns/{n}")
    with IPRoute() as ipr:
        for ifname in veths + [br.name]:
            assert not ipr.link_lookup(ifname=ifname)
