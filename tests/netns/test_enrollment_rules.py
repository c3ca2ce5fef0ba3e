"""In-pod rules with real netns, real iptables/nftables and real TCP/UDP traffic.

Pods are netns on a bridge (tests/netns/toolkit.py). ztunnel's in-pod listeners
(15001, 15006, 15053) are plain sockets opened inside the pod netns here, exactly
where ztunnel opens them; the rules under test are the real ones from
``cni.rules_iptables`` / ``cni.rules_nftables`` applied with the real tools.
Every backend must pass the same traffic tests (behavioral identity).
"""

from __future__ import annotations

import socket
import struct
import subprocess

import pytest

from cni import rules_detect
from cni.rules_common import INPOD_MARK, RuleOptions, RulesError
from cni.rules_iptables import IptablesBackend
from cni.rules_nftables import NftablesBackend

SO_ORIGINAL_DST = 80  # SOL_IP and SOL_IPV6 (IP6T_SO_ORIGINAL_DST) share the number
SO_MARK = 36

BACKENDS = {
    "iptables-nft": lambda: IptablesBackend("nft"),
    "iptables-legacy": lambda: IptablesBackend("legacy"),
    "nftables": lambda: NftablesBackend(),
}


def original_dst(conn: socket.socket) -> tuple[str, int]:
    """The pre-REDIRECT destination of an accepted connection."""
    if conn.family == socket.AF_INET6:
        raw = conn.getsockopt(socket.IPPROTO_IPV6, SO_ORIGINAL_DST, 28)
        port = struct.unpack("!H", raw[2:4])[0]
        return socket.inet_ntop(socket.AF_INET6, raw[8:24]), port
    raw = conn.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    return socket.inet_ntoa(raw[4:8]), struct.unpack("!H", raw[2:4])[0]


def accept_one(listener: socket.socket, timeout: float = 3.0) -> socket.socket:
    listener.settimeout(timeout)
    conn, _ = listener.accept()
    return conn


def dial(pod, host: str, port: int, mark: int | None = None) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET

    def connect():
        s = socket.socket(family, socket.SOCK_STREAM)
        s.settimeout(3)
        if mark is not None:
            s.setsockopt(socket.SOL_SOCKET, SO_MARK, mark)
        s.connect((host, port))
        return s
    return pod.run(connect)


def snapshot(pod) -> str:
    """Everything our rules could touch in a pod: both rule stacks, ip rules, table 100;
    without the IPv6 link-local address and routes the kernel adds on its own once the
    veth is up (they appear at a time of the kernel's choosing, not ours)."""
    out = []
    for argv in (["iptables-save"], ["ip6tables-save"], ["iptables-legacy-save"],
                 ["nft", "list", "ruleset"], ["ip", "rule"], ["ip", "-6", "rule"],
                 ["ip", "route", "show", "table", "all"],
                 ["ip", "-6", "route", "show", "table", "all"]):
        text = pod.exec(*argv).stdout
        if argv == ["iptables-legacy-save"]:
            # legacy xtables tables, once loaded in a netns, can't be unregistered; an
            # empty one (no rules, no custom chains) is not something we left behind
            text = _drop_empty_tables(text)
        out.append(" ".join(argv) + "\n" + "\n".join(
            line for line in text.splitlines()
            if not line.startswith("#") and "fe80:" not in line))
    return "\n".join(out)


def _drop_empty_tables(save: str) -> str:
    out, section = [], []
    for line in save.splitlines():
        if line.startswith("#"):
            continue
        section.append(line)
        if line == "COMMIT":
            if any(ln.startswith("-") or (ln.startswith(":") and " - " in ln) for ln in section):
                out += section
            section = []
    return "\n".join(out + section)


def apply(pod, backend, opts):
    return pod.run(backend.apply, opts)


@pytest.fixture(params=sorted(BACKENDS))
def backend(request):
    return BACKENDS[request.param]()


@pytest.mark.parametrize("family", ["ipv4", "ipv6"])
def test_outbound_inbound_and_ztunnel_bypass(bridge6, backend, family):
    v6 = family == "ipv6"
    a, b, c = bridge6.add_pod("ta"), bridge6.add_pod("tb"), bridge6.add_pod("tc")
    addr = (lambda p: p.ip6) if v6 else (lambda p: p.ip)
    any_addr = "::" if v6 else "0.0.0.0"
    opts = RuleOptions(ipv6=True, dns_capture=False)
    assert apply(a, backend, opts) == "applied"
    assert apply(b, backend, opts) == "applied"

    outbound = a.listen(15001, any_addr)
    inbound = b.listen(15006, any_addr)
    app_c = c.listen(8080, any_addr)
    try:
        # A -> B lands on A's outbound listener with B as original destination
        client = dial(a, addr(b), 8080)
        conn = accept_one(outbound)
        assert original_dst(conn) == (addr(b), 8080)
        conn.close(), client.close()

        # unenrolled C -> B lands on B's inbound plaintext listener
        client = dial(c, addr(b), 8080)
        conn = accept_one(inbound)
        assert original_dst(conn) == (addr(b), 8080)
        conn.close(), client.close()

        # ztunnel's own traffic (mark 0x539) from A bypasses redirection and reaches C
        client = dial(a, addr(c), 8080, mark=INPOD_MARK)
        conn = accept_one(app_c)
        assert conn.getsockname()[1] == 8080
        conn.close(), client.close()

        # HBONE port 15008 is not redirected inbound: C reaches B's own 15008 listener
        hbone = b.listen(15008, any_addr)
        try:
            client = dial(c, addr(b), 15008)
            conn = accept_one(hbone)
            assert conn.getsockname()[1] == 15008
            conn.close(), client.close()
        finally:
            hbone.close()
    finally:
        for s in (outbound, inbound, app_c):
            s.close()


@pytest.mark.parametrize("dns", [True, False])
def test_dns_capture(bridge, backend, dns):
    """DNS on: UDP and TCP port 53 land on 15053. Off: UDP goes to the server itself,
    TCP/53 is ordinary outbound TCP (15001)."""
    a, c = bridge.add_pod("ta"), bridge.add_pod("tc")
    apply(a, backend, RuleOptions(ipv6=False, dns_capture=dns))
    udp = a.run(lambda: _bound(socket.SOCK_DGRAM, 15053))
    tcp = a.listen(15053, "0.0.0.0")
    outbound = a.listen(15001, "0.0.0.0")
    udp_c = c.run(lambda: _bound(socket.SOCK_DGRAM, 53))
    try:
        a.run(lambda: _send_udp(c.ip, 53, b"query"))
        target = udp if dns else udp_c
        target.settimeout(3)
        data, _ = target.recvfrom(100)
        assert data == b"query"
        client = dial(a, c.ip, 53)
        conn = accept_one(tcp if dns else outbound)
        assert original_dst(conn) == (c.ip, 53)
        assert conn.getsockname()[1] == (15053 if dns else 15001)
        conn.close(), client.close()
    finally:
        for s in (udp, tcp, outbound, udp_c):
            s.close()


def _bound(kind: int, port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, kind)
    s.bind(("0.0.0.0", port))
    return s


def _send_udp(host: str, port: int, data: bytes) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(data, (host, port))


def test_probe_source_is_not_redirected(bridge, backend):
    """Traffic from the probe SNAT address reaches the app, not 15006 (kubelet probes)."""
    b = bridge.add_pod("tb")
    apply(b, backend, RuleOptions(ipv6=False, probe_snat_ipv4="169.254.7.127"))
    app = b.listen(8080, "0.0.0.0")
    inbound = b.listen(15006, "0.0.0.0")
    subprocess.run(["ip", "addr", "add", "169.254.7.127/32", "dev", bridge.name], check=True)
    try:
        def connect():
            s = socket.socket()
            s.settimeout(3)
            s.bind(("169.254.7.127", 0))
            s.connect((b.ip, 8080))
            return s
        client = connect()
        conn = accept_one(app)
        conn.close(), client.close()
    finally:
        subprocess.run(["ip", "addr", "del", "169.254.7.127/32", "dev", bridge.name])
        app.close(), inbound.close()


@pytest.mark.parametrize("opts", [RuleOptions(), RuleOptions(ingress_mode=True,
                                                               virtual_interfaces=("eth9",))],
                         ids=["default", "ingress+vif"])
def test_idempotent_and_delete_restores_everything(bridge6, backend, opts):
    pod = bridge6.add_pod("tp")
    before = snapshot(pod)
    assert apply(pod, backend, opts) == "applied"
    once = snapshot(pod)
    assert apply(pod, backend, opts) == "replaced"
    assert _strip_counters(snapshot(pod)) == _strip_counters(once)  # nothing duplicated
    pod.run(backend.delete, True)
    assert snapshot(pod) == before
    pod.run(backend.delete, True)  # deleting twice is fine
    assert snapshot(pod) == before


def _strip_counters(text: str) -> str:
    import re
    # nft counters and iptables-save's per-chain [packets:bytes]: a stray packet (IPv6
    # router solicitation on the bridge) between two snapshots is not a rule change
    text = re.sub(r"counter packets \d+ bytes \d+", "counter", text)
    return re.sub(r"\[\d+:\d+\]", "[0:0]", text)


def test_options_change_replaces_rules(bridge):
    pod = bridge.add_pod("tp")
    backend = IptablesBackend("nft")
    apply(pod, backend, RuleOptions(ipv6=False, dns_capture=True))
    apply(pod, backend, RuleOptions(ipv6=False, dns_capture=False))
    save = pod.exec("iptables-save").stdout
    assert "15053" not in save and ":ISTIO_PRERT" in save
    assert save.count("-A PREROUTING -j ISTIO_PRERT") == 2  # mangle + nat, raw jump gone


def test_restore_failure_reports_stderr_and_leaves_nothing(bridge):
    pod = bridge.add_pod("tp")
    before = snapshot(pod)
    bad = RuleOptions(ipv6=False, virtual_interfaces=("bad name!",))
    with pytest.raises(RulesError) as err:
        apply(pod, IptablesBackend("nft"), bad)
    assert "iptables-nft-restore failed" in str(err.value) and "line" in str(err.value)
    pod.run(IptablesBackend("nft").delete, False)  # enrollment's rollback
    assert snapshot(pod) == before


@pytest.mark.parametrize("via", ["backend", "everywhere"])
@pytest.mark.parametrize("flavor", ["nft", "legacy"])
def test_delete_keeps_foreign_rules_and_their_tables(bridge, flavor, via):
    """Deletion drops a table whole only when nothing but ours is in it (nft flavor):
    a table holding someone else's rule (nat here, with a custom chain) keeps them,
    loses only our chains and jumps. ``everywhere``: through
    ``rules_detect.delete_everywhere``, which judges the tables from its netlink look."""
    pod = bridge.add_pod("tp")
    real = IptablesBackend(flavor)
    backend = real if via == "backend" else _Everywhere(real)
    save, restore = f"iptables-{flavor}-save", f"iptables-{flavor}-restore"
    pod.exec(restore, "--noflush", input="*nat\n:KEEPME - [0:0]\n"
             "-A OUTPUT -d 192.0.2.9/32 -j KEEPME\n-A KEEPME -j RETURN\nCOMMIT\n")
    foreign = [ln for ln in pod.exec(save).stdout.splitlines()
               if "KEEPME" in ln and not ln.startswith("#")]
    apply(pod, backend, RuleOptions(ipv6=False))
    pod.run(backend.delete, False)
    after = pod.exec(save).stdout
    assert "ISTIO" not in after
    assert [ln for ln in after.splitlines() if "KEEPME" in ln] == foreign
    if flavor == "nft":  # ours-only tables are gone, the shared one stays
        tables = pod.exec("nft", "list", "tables").stdout.split()
        assert "mangle" not in tables and "raw" not in tables and "nat" in tables
    pod.run(backend.delete, False)  # idempotent
    assert [ln for ln in pod.exec(save).stdout.splitlines() if "KEEPME" in ln] == foreign


class _Everywhere:
    """``apply``/``delete`` of a backend, the delete through rules_detect.delete_everywhere."""

    def __init__(self, backend):
        self.backend = backend

    def apply(self, opts):
        return self.backend.apply(opts)

    def delete(self, ipv6):
        rules_detect.delete_everywhere(self.backend, ipv6)


FOREIGN = {  # iptables-restore input someone else put in the pod, and what it is
    "none": "",
    "custom chain in nat": "*nat\n:KEEPME - [0:0]\n-A OUTPUT -d 192.0.2.9/32 -j KEEPME\n"
                           "-A KEEPME -j RETURN\nCOMMIT\n",
    "plain rule in mangle OUTPUT": "*mangle\n-A OUTPUT -d 192.0.2.9/32 -j RETURN\nCOMMIT\n",
    "policy DROP in raw": "*raw\n:OUTPUT DROP [0:0]\nCOMMIT\n",
    "conditional jump to ours": "",  # added after apply, below
}


@pytest.mark.parametrize("case", sorted(FOREIGN))
def test_netlink_judge_agrees_with_the_save(bridge, case):
    """rules_detect's netlink look says a table holds nothing but ours exactly when
    ``iptables-save`` (read the way the backend's delete reads it) says so."""
    from cni.rules_iptables_text import empty_without_istio, istio_residue

    pod = bridge.add_pod("tj")
    if FOREIGN[case]:
        pod.exec("iptables-nft-restore", "--noflush", input=FOREIGN[case])
    apply(pod, IptablesBackend("nft"), RuleOptions(ipv6=False))
    if case == "conditional jump to ours":
        pod.exec("iptables-nft", "-t", "nat", "-A", "OUTPUT", "-p", "udp", "-j", "ISTIO_OUTPUT")
    save = pod.exec("iptables-nft-save").stdout
    from_save = {("ip", t): t in empty_without_istio(save) for t in istio_residue(save)}
    assert pod.run(rules_detect.look, False, True).nft_tables == from_save
    if case == "none":
        assert from_save and all(from_save.values())
    elif case != "conditional jump to ours":
        assert not all(from_save.values())


def test_routing_batch_matches_the_ip_tool(bridge6):
    """The in-pod routing, written in one netlink batch (``rules_common.add_routing``),
    is what ``ip rule add`` / ``ip route replace`` make of the same request (the
    reference pod gets it from the ``ip`` tool itself); a second call finds our rule
    (True), changes nothing and fails nothing; a failed request is named with its errno;
    ``delete_routing`` removes all of it."""
    from cni import rules_common as rc

    ours, ref = bridge6.add_pod("tr"), bridge6.add_pod("tq")
    assert ours.run(rc.add_routing, True) is False
    for v in (["-4"], ["-6"]):
        ref.exec("ip", *v, "rule", "add", "fwmark", "0x111/0xfff", "lookup", "100", "pref",
                 "32764")
        dst = "0.0.0.0/0" if v == ["-4"] else "::/0"
        ref.exec("ip", *v, "route", "replace", "local", dst, "dev", "lo", "table", "100",
                 "proto", "static")

    def routing(pod) -> str:
        return "\n".join(pod.exec("ip", *a).stdout for a in (
            ["rule"], ["-6", "rule"], ["-d", "route", "show", "table", "100"],
            ["-d", "-6", "route", "show", "table", "100"]))
    assert routing(ours) == routing(ref)
    assert "fwmark 0x111/0xfff lookup 100" in routing(ours)
    assert ours.run(rc.add_routing, True) is True
    assert routing(ours) == routing(ref)

    def bad_loopback() -> bool:
        real, rc._loopback_index = rc._loopback_index, lambda: 99999
        try:
            return rc.add_routing(False)
        finally:
            rc._loopback_index = real
    with pytest.raises(RulesError, match=r"ip route replace local 0.0.0.0/0 table 100: "
                                         r".* \(errno 19\)"):
        ours.run(bad_loopback)
    ours.run(rc.delete_routing, True)
    assert "lookup 100" not in routing(ours) and "local default" not in routing(ours)
