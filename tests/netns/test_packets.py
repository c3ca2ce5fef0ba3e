"""Packet-level checks of the in-pod rules, with scapy inside real pod netns.

The socket-level tests (test_enrollment_rules.py) show where redirected connections
land; these show what the rules must leave alone or must keep on the pod, which only a
look at the packets can: ICMP echo and IPv6 neighbour discovery pass through an enrolled
pod untouched (upstream's in-pod rules match TCP and UDP/53 only, so a ping or an NS
must be answered by the pod's own kernel), IP fragments are reassembled by conntrack
before the rules see them (a fragmented datagram reaches the app, and a fragmented DNS
query is captured to 15053 like an unfragmented one), and a captured DNS query never
leaves the pod's interface.

scapy runs in a child process started with ``ip netns exec``, so its interface and
route tables are the pod's, not the host's (scapy reads them once, at import). Each
script prints one JSON line that the test reads. Needs root; every netns, bridge and
rule is the test's own and goes with the fixtures.
"""

from __future__ import annotations

import json
import secrets
import socket
import subprocess
import sys
import textwrap

import pytest

from cni.rules_common import RuleOptions
from cni.rules_iptables import IptablesBackend
from cni.rules_nftables import NftablesBackend

BACKENDS = {
    "iptables-nft": lambda: IptablesBackend("nft"),
    "iptables-legacy": lambda: IptablesBackend("legacy"),
    "nftables": lambda: NftablesBackend(),
}

_PRELUDE = """
import json, logging
logging.getLogger("scapy").setLevel(logging.ERROR)
from scapy.all import *  # noqa
import socket, time
conf.verb = 0
"""


@pytest.fixture(params=sorted(BACKENDS))
def backend(request):
    return BACKENDS[request.param]()


def scapy_in(pod, script: str, timeout: float = 60) -> dict:
    """Run ``script`` (after scapy's import) in ``pod``'s netns; its last stdout line is
    JSON and is returned. A non-zero exit fails the test with scapy's stderr."""
    code = _PRELUDE + textwrap.dedent(script)
    proc = subprocess.run(["ip", "netns", "exec", pod.name, sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"scapy script in {pod.name} failed:\n{proc.stderr[-2000:]}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert lines, f"scapy script in {pod.name} printed nothing; stderr:\n{proc.stderr[-2000:]}"
    return json.loads(lines[-1])


def _udp_socket(family: int, port: int) -> socket.socket:
    s = socket.socket(family, socket.SOCK_DGRAM)
    s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
    s.settimeout(10)
    return s


def test_icmp_echo_is_answered_by_the_enrolled_pod_itself(bridge6, backend):
    """An echo request (ICMP and ICMPv6) to an enrolled pod gets an echo reply from that
    pod's address with the payload intact, and the enrolled pod's own pings reach their
    target: the rules redirect TCP (and UDP/TCP 53) only."""
    a, b = bridge6.add_pod("ta"), bridge6.add_pod("tb")
    assert a.run(backend.apply, RuleOptions(ipv6=True)) == "applied"
    payload = secrets.token_hex(16)
    for src, dst in ((b, a), (a, b)):
        got = scapy_in(src, f"""
            out = {{}}
            for fam, probe in (
                    ("ipv4", IP(dst={dst.ip!r})/ICMP(id=4242, seq=1)/Raw({payload!r})),
                    ("ipv6", IPv6(dst={dst.ip6!r})/ICMPv6EchoRequest(id=4242, seq=1,
                                                                   data={payload!r}))):
                reply = None
                for _ in range(3):  # the first IPv6 echo may go while ND still resolves
                    reply = sr1(probe, timeout=3)
                    if reply is not None:
                        break
                if reply is None:
                    out[fam] = None
                    continue
                inner = reply[ICMPv6EchoReply] if fam == "ipv6" else reply[ICMP]
                data = inner.data if fam == "ipv6" else bytes(inner.payload)
                out[fam] = [reply.src, int(inner.type),
                            data.decode() if isinstance(data, bytes) else data]
            print(json.dumps(out))
        """)
        assert got["ipv4"] == [dst.ip, 0, payload], f"{src.name} -> {dst.ip}: {got}"
        assert got["ipv6"] == [dst.ip6, 129, payload], f"{src.name} -> {dst.ip6}: {got}"


def test_ipv6_neighbour_discovery_is_left_alone(bridge6, backend):
    """A Neighbor Solicitation for an enrolled pod's address, sent to its solicited-node
    multicast group, is answered with a Neighbor Advertisement carrying the pod's MAC;
    and the enrolled pod resolves its neighbours the same way."""
    a, b = bridge6.add_pod("ta"), bridge6.add_pod("tb")
    assert a.run(backend.apply, RuleOptions(ipv6=True)) == "applied"
    macs = {p.name: p.exec("cat", f"/sys/class/net/{p.pod_veth}/address").stdout.strip()
            for p in (a, b)}
    for src, dst in ((b, a), (a, b)):
        got = scapy_in(src, f"""
            tgt = {dst.ip6!r}
            group = in6_getnsma(inet_pton(socket.AF_INET6, tgt))
            ns = (Ether(src={macs[src.name]!r}, dst=in6_getnsmac(group))
                  / IPv6(src={src.ip6!r}, dst=inet_ntop(socket.AF_INET6, group), hlim=255)
                  / ICMPv6ND_NS(tgt=tgt) / ICMPv6NDOptSrcLLAddr(lladdr={macs[src.name]!r}))
            # the NA is unicast back to us, which scapy's request/answer matching of a
            # multicast request does not pair up: sniff for it instead. Only an NA carrying
            # the target's link-layer address answers a multicast NS (RFC 4861 7.2.4):
            # one without it answers the kernel's own unicast NUD probe of that address,
            # which can cross ours under load (failed CI once: lladdr None)
            na = None
            for _ in range(3):
                sniffer = AsyncSniffer(iface={src.pod_veth!r}, count=1,
                                       lfilter=lambda p: ICMPv6ND_NA in p
                                       and p[ICMPv6ND_NA].tgt == tgt
                                       and ICMPv6NDOptDstLLAddr in p)
                sniffer.start()
                time.sleep(0.3)
                sendp(ns, iface={src.pod_veth!r})
                sniffer.join(timeout=3)
                if sniffer.running:
                    sniffer.stop()
                if sniffer.results:
                    na = sniffer.results[0]
                    break
            if na is None:
                print(json.dumps({{"na": None}}))
            else:
                opt = na[ICMPv6NDOptDstLLAddr].lladdr if ICMPv6NDOptDstLLAddr in na else None
                print(json.dumps({{"na": na[ICMPv6ND_NA].tgt, "lladdr": opt}}))
        """)
        assert got["na"] == dst.ip6, f"{src.name} soliciting {dst.ip6}: {got}"
        assert got["lladdr"] == macs[dst.name]


def test_fragmented_udp_reaches_the_enrolled_pods_app_whole(bridge, backend):
    """A 3,000-byte UDP datagram sent as 512-byte IP fragments to an enrolled pod's app
    port arrives as one datagram, byte for byte (inbound UDP is not redirected, and the
    rules must not break reassembly)."""
    a, b = bridge.add_pod("ta"), bridge.add_pod("tb")
    assert a.run(backend.apply, RuleOptions(ipv6=False)) == "applied"
    app = a.run(_udp_socket, socket.AF_INET, 9000)
    try:
        body = secrets.token_hex(1500)
        got = scapy_in(b, f"""
            frags = fragment(IP(dst={a.ip!r})/UDP(sport=40000, dport=9000)/Raw({body!r}),
                             fragsize=512)
            send(frags)
            print(json.dumps({{"fragments": len(frags)}}))
        """)
        assert got["fragments"] >= 6
        data, peer = app.recvfrom(65535)
        assert data.decode() == body and peer[0] == b.ip
    finally:
        app.close()


def test_fragmented_dns_query_is_captured_and_never_leaves_the_pod(bridge, backend):
    """With DNS capture on, a UDP query to port 53 sent as IP fragments from the enrolled
    pod is reassembled and lands on 15053 whole; a sniffer on the pod's interface sees
    no packet of it go out, and the real server gets nothing."""
    a, c = bridge.add_pod("ta"), bridge.add_pod("tc")
    assert a.run(backend.apply, RuleOptions(ipv6=False, dns_capture=True)) == "applied"
    dns_proxy = a.run(_udp_socket, socket.AF_INET, 15053)
    server = c.run(_udp_socket, socket.AF_INET, 53)
    server.settimeout(1)
    try:
        body = secrets.token_hex(1000)
        got = scapy_in(a, f"""
            sniffer = AsyncSniffer(iface={a.pod_veth!r}, store=True,
                                   lfilter=lambda p: IP in p and p[IP].dst == {c.ip!r})
            sniffer.start()
            time.sleep(0.5)
            # through the pod's own IP stack (a raw IP socket, so LOCAL_OUT and its
            # rules see the fragments); scapy's default L3 socket writes frames at L2,
            # past every netfilter hook, which would test nothing
            conf.L3socket = L3RawSocket
            frags = fragment(IP(dst={c.ip!r})/UDP(sport=40001, dport=53)/Raw({body!r}),
                             fragsize=400)
            send(frags)
            time.sleep(1.0)
            seen = sniffer.stop()
            print(json.dumps({{"fragments": len(frags), "left_pod": len(seen)}}))
        """)
        assert got["fragments"] >= 5
        data, _ = dns_proxy.recvfrom(65535)
        assert data.decode() == body
        assert got["left_pod"] == 0, "a captured DNS query left the pod's interface"
        with pytest.raises(socket.timeout):
            server.recvfrom(65535)
    finally:
        dns_proxy.close(), server.close()
