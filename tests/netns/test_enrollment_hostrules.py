"""Host probe rules and sets in a scratch "node" netns (never the real host), both
backends, unique chain/set names: IP reuse by a new pod (owner = UID), idempotent
setup keeping entries, start-of-day reconcile in place, removal by owner
(``docs/enrollment.md``; issue 17 item 6)."""

from __future__ import annotations

import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from pyroute2 import netns as pr_netns

from cni.hostrules import HostProbeRules

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def node():
    name = "tn" + secrets.token_hex(3)
    pr_netns.create(name)
    try:
        yield name
    finally:
        pr_netns.remove(name)


def dump(node: str) -> str:
    out = subprocess.run(["ip", "netns", "exec", node, "nft", "list", "ruleset"],
                         capture_output=True, text=True).stdout
    out = re.sub(r"counter packets \d+ bytes \d+", "counter", out)
    # iptables re-creates its chain at setup, which may move it within the listing
    return "\n".join(sorted(ln.strip() for ln in out.splitlines() if ln.strip()))


@pytest.fixture(params=["iptables", "nftables"])
def rules(request, node):
    tag = secrets.token_hex(2)
    r = HostProbeRules(backend=request.param, ipv6=True, chain=f"ISTIO_POSTRT_{tag}",
                       set_v4=f"probes-v4-{tag}", set_v6=f"probes-v6-{tag}",
                       nft_table=f"ambient-nat-{tag}", netns=f"/var/run/netns/{node}")
    yield r
    r.teardown()


def test_setup_idempotent_and_teardown_clean(rules, node):
    before = dump(node)
    rules.setup()
    once = dump(node)
    assert rules.chain in once or rules.nft_table in once
    rules.setup()
    assert dump(node) == once  # nothing duplicated
    rules.teardown()
    rules.teardown()
    if rules.backend == "nftables":
        assert dump(node) == before
    else:  # iptables-nft leaves its (empty) nat table; no chain, no rule of ours
        assert rules.chain not in dump(node) and rules.set_v4 not in dump(node)


def test_ip_reuse_keeps_new_owner(rules):
    rules.setup()
    rules.add_pod("uid-old", ["10.9.0.5", "fd00::5"])
    rules.add_pod("uid-old", ["10.9.0.5"])  # same IP twice: fine
    rules.add_pod("uid-new", ["10.9.0.5"])  # IP reused by a new pod before the old DEL
    assert rules.entries() == {"10.9.0.5": "uid-new", "fd00::5": "uid-old"}
    assert rules.remove_pod("uid-old", ["10.9.0.5", "fd00::5"]) == ["fd00::5"]
    assert rules.entries() == {"10.9.0.5": "uid-new"}
    assert rules.remove_pod("uid-new", ["10.9.0.5"]) == ["10.9.0.5"]
    assert rules.entries() == {}


def test_sync_reconciles_in_place(rules):
    """Issue 17 item 6: known pods' IPs upserted (owner fixed where it differs), entries
    of unknown owners removed even while some known pod has no IP yet, and that pod's
    own entry kept."""
    rules.setup()
    for ip, uid in (("2.2.2.2", "a"), ("6.6.6.6", "stale"), ("3.3.3.3", "old-owner"),
                    ("7.7.7.7", "c"), ("8.8.8.8", "")):
        rules.add_pod(uid, [ip])
    removed = rules.sync({"a": ["2.2.2.2"], "b": ["3.3.3.3", "fd00::b"], "c": []})
    assert sorted(removed) == ["6.6.6.6", "8.8.8.8"]
    assert rules.entries() == {"2.2.2.2": "a", "3.3.3.3": "b", "fd00::b": "b",
                               "7.7.7.7": "c"}
    # once c's IPs are known, its entry follows them
    assert rules.sync({"a": ["2.2.2.2"], "b": ["3.3.3.3", "fd00::b"],
                       "c": ["::ffff:7.7.7.8"]}) == ["7.7.7.7"]
    assert rules.entries() == {"2.2.2.2": "a", "3.3.3.3": "b", "fd00::b": "b",
                               "7.7.7.8": "c"}
    assert sorted(rules.sync({})) == ["2.2.2.2", "3.3.3.3", "7.7.7.8", "fd00::b"]
    assert rules.entries() == {}


def test_setup_keeps_entries_and_rules_stay_single(rules, node):
    """A second start (agent restart) keeps every entry (no flush) and rewrites the
    rules without duplicating them."""
    rules.setup()
    rules.add_pod("x", ["10.1.1.1", "fd00::1"])
    once = dump(node)
    rules.setup()
    assert rules.entries() == {"10.1.1.1": "x", "fd00::1": "x"}
    assert dump(node) == once
    if rules.backend == "iptables":
        for tool in ("iptables-save", "ip6tables-save"):
            save = subprocess.run(["ip", "netns", "exec", node, tool, "-t", "nat"],
                                  capture_output=True, text=True, check=True).stdout
            assert save.count(f"-j {rules.chain}") == 1
            assert save.count(f"-A {rules.chain} ") == 1


def test_remove_pod_by_owner_when_ips_unknown(rules):
    """A DEL for a pod whose IPs the agent doesn't know still removes the entries the pod
    owns (by the UID comment); entries of other pods stay, even for a named IP."""
    rules.setup()
    rules.add_pod("gone", ["10.2.2.2", "fd00::2"])
    rules.add_pod("other", ["10.2.2.3"])
    assert sorted(rules.remove_pod("gone")) == ["10.2.2.2", "fd00::2"]
    assert rules.remove_pod("gone", ["10.2.2.3"]) == []
    assert rules.entries() == {"10.2.2.3": "other"}


def test_without_cap_net_admin_one_clear_error(node):
    """The agent run without CAP_NET_ADMIN (as a plain user, say): setting up the host
    rules fails at once naming what is missing, not with pyroute2's bare
    "(1, 'Operation not permitted')" (``ambient-agent run`` prints it after "cannot
    start enrollment:"). CAP_SYS_ADMIN stays so the scratch netns can be entered."""
    tag = secrets.token_hex(2)
    code = ("from cni.hostrules import HostProbeRules\n"
            f"HostProbeRules(netns='/var/run/netns/{node}', set_v4='probes-v4-{tag}', "
            f"set_v6='probes-v6-{tag}', chain='ISTIO_POSTRT_{tag}').setup()\n")
    r = subprocess.run(["setpriv", "--bounding-set=-net_admin", "--inh-caps=-net_admin",
                        sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last == ("PermissionError: ipset netlink socket: operation not permitted "
                    "(host probe rules need root, CAP_NET_ADMIN)"), r.stderr
