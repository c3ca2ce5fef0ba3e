"""Golden tests of the rule builders: every upstream scenario of ``docs/enrollment.md``.

The iptables goldens use upstream's recording format (the two state probes, then the
v4 restore text, then the v6 one); ``default.golden`` is
upstream's default-options IPv4 output (``istio/istio:cni/pkg/iptables/testdata``), kept
byte for byte. nftables goldens are our ``nft -f`` transaction text for the same
scenarios. Regenerate (then review the diff!) with ``UPDATE_GOLDEN=1``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cni.hostrules import HostProbeRules
from cni.rules_common import RuleOptions, pod_options
from cni.rules_iptables_text import golden_record
from cni.rules_nftables import render_transaction

TESTDATA = Path(__file__).parent / "testdata"
PROBE_V4 = "169.254.7.127"
PROBE_V6 = "e9ac:1e77:90ca:399f:4d6d:ece2:2f9b:3164"  # upstream's in-pod test value
VIFS = ("fake1s0f0", "fake1s0f1")

SCENARIOS = {
    "default": dict(dns_capture=True),
    "ingress": dict(dns_capture=False, ingress_mode=True),
    "virtual_interfaces": dict(dns_capture=False, virtual_interfaces=VIFS),
    "ingress_and_virtual_interfaces": dict(dns_capture=False, ingress_mode=True,
                                           virtual_interfaces=VIFS),
    "dns_pod_enabled_and_off_globally": dict(dns_capture=False, pod_dns="true"),
    "dns_pod_disabled_and_on_globally": dict(dns_capture=True, pod_dns="false"),
}


def scenario_options(name: str, ipv6: bool) -> RuleOptions:
    spec = dict(SCENARIOS[name])
    pod_dns = spec.pop("pod_dns", None)
    opts = RuleOptions(probe_snat_ipv4=PROBE_V4, probe_snat_ipv6=PROBE_V6, ipv6=ipv6, **spec)
    return pod_options(opts, {"ambient.istio.io/dns-capture": pod_dns} if pod_dns else {})


def check_golden(path: Path, actual: str) -> None:
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(actual)
    assert path.exists(), f"missing golden {path} (run with UPDATE_GOLDEN=1)"
    assert actual.splitlines() == path.read_text().splitlines()
    assert actual == path.read_text()


CASES = [(n, v6) for n in SCENARIOS for v6 in (False, True)]


@pytest.mark.parametrize("name,ipv6", CASES, ids=[f"{n}{'_ipv6' if v else ''}" for n, v in CASES])
def test_iptables_golden(name, ipv6):
    opts = scenario_options(name, ipv6)
    check_golden(TESTDATA / "iptables" / f"{name}{'_ipv6' if ipv6 else ''}.golden",
                 golden_record(opts))


@pytest.mark.parametrize("name,ipv6", CASES, ids=[f"{n}{'_ipv6' if v else ''}" for n, v in CASES])
def test_nftables_golden(name, ipv6):
    opts = scenario_options(name, ipv6)
    check_golden(TESTDATA / "nftables" / f"{name}{'_ipv6' if ipv6 else ''}.golden",
                 render_transaction(opts))


# Upstream's default-options IPv4 ruleset, verbatim: our default IPv4 output must equal it.
SPEC_DEFAULT = """iptables-save
ip6tables-save
* mangle
-N ISTIO_PRERT
-N ISTIO_OUTPUT
-A PREROUTING -j ISTIO_PRERT
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff
-A ISTIO_OUTPUT -m connmark --mark 0x111/0xfff -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff
COMMIT
* nat
-N ISTIO_PRERT
-N ISTIO_OUTPUT
-A OUTPUT -j ISTIO_OUTPUT
-A PREROUTING -j ISTIO_PRERT
-A ISTIO_PRERT -s 169.254.7.127 -p tcp -m tcp -j ACCEPT
-A ISTIO_OUTPUT -d 169.254.7.127 -p tcp -m tcp -j ACCEPT
-A ISTIO_PRERT ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15006
-A ISTIO_OUTPUT ! -o lo -p udp -m mark ! --mark 0x539/0xfff -m udp --dport 53 -j REDIRECT --to-port 15053
-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -p tcp --dport 53 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15053
-A ISTIO_OUTPUT -p tcp -m mark --mark 0x111/0xfff -j ACCEPT
-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -o lo -j ACCEPT
-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -p tcp -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15001
COMMIT
* raw
-N ISTIO_OUTPUT
-N ISTIO_PRERT
-A PREROUTING -j ISTIO_PRERT
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -p udp -m mark --mark 0x539/0xfff -m udp --dport 53 -j CT --zone 1
-A ISTIO_PRERT -p udp -m mark ! --mark 0x539/0xfff -m udp --sport 53 -j CT --zone 1
COMMIT"""


def test_default_matches_spec_fact_reference():
    assert golden_record(RuleOptions(ipv6=False)) == SPEC_DEFAULT
    assert (TESTDATA / "iptables" / "default.golden").read_text() == SPEC_DEFAULT


def test_hostprobe_golden_iptables():
    for ipv6 in (False, True):
        rules = HostProbeRules(ipv6=ipv6)
        text = "\n".join(["iptables-save", "ip6tables-save", rules.render_iptables().rstrip()]
                         + ([rules.render_iptables(True).rstrip()] if ipv6 else []))
        check_golden(TESTDATA / "iptables" / f"hostprobe{'_ipv6' if ipv6 else ''}.golden", text)


def test_hostprobe_golden_nftables():
    for ipv6 in (False, True):
        rules = HostProbeRules(backend="nftables", ipv6=ipv6, snat_ipv6=PROBE_V6)
        check_golden(TESTDATA / "nftables" / f"hostprobe{'_ipv6' if ipv6 else ''}.golden",
                     rules.render_nft(1000))


def test_hostprobe_spec_fact():
    assert HostProbeRules(ipv6=False).render_iptables() == (
        "* nat\n-N ISTIO_POSTRT\n-I POSTROUTING 1 -j ISTIO_POSTRT\n"
        "-A ISTIO_POSTRT -m owner --socket-exists -p tcp -m set --match-set "
        "istio-inpod-probes-v4 dst -j SNAT --to-source 169.254.7.127\nCOMMIT\n")


def test_pod_overrides():
    """Annotation parsing."""
    base = RuleOptions(dns_capture=False)
    assert pod_options(base, {"ambient.istio.io/dns-capture": "true"}).dns_capture is True
    assert pod_options(RuleOptions(), {"ambient.istio.io/dns-capture": "false"}).dns_capture is False
    assert pod_options(base, {"ambient.istio.io/dns-capture": "maybe"}) == base
    assert pod_options(base, {"ambient.istio.io/bypass-inbound-capture": "true"}).ingress_mode
    assert pod_options(base, {"istio.io/reroute-virtual-interfaces": "a, b,"}
                       ).virtual_interfaces == ("a", "b")
    assert pod_options(base, None) == base


@pytest.mark.parametrize("name,ipv6", CASES, ids=[f"{n}{'_ipv6' if v else ''}" for n, v in CASES])
def test_ztunnel_mark_connmark_rule_in_every_mode(name, ipv6):
    """Issue 16 item 3: ingress mode (bypass-inbound-capture) keeps the rule that connmarks
    ztunnel's own packets, as upstream's ingress goldens do; without it replies to
    ztunnel's inbound connections are not routed back and inbound HBONE hangs."""
    opts = scenario_options(name, ipv6)
    ipt = golden_record(opts).splitlines()
    rule = "-A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff"
    assert ipt.count(rule) == (2 if ipv6 else 1)  # once per family's mangle table
    nft = render_transaction(opts).splitlines()
    assert nft.count("add rule inet istio-ambient-mangle istio-prerouting meta mark & 0xfff "
                     "== 0x539 counter ct mark set ct mark & 0xfffff000 | 0x111") == 1
