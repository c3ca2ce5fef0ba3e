"""Host probe rules and sets in a scratch "node" netns (never the real host), both
backends, unique chain/set names: IP reuse by a new pod (owner = UID), idempotent
setup, start-of-day sync and pruning (spec cni-zds.md §3.7, §3.9, §3.11, §6.12)."""

from __future__ import annotations

import re
import secrets
import subprocess

import pytest
from pyroute2 import netns as pr_netns

from cni.hostrules import HostProbeRules


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


def test_sync_prunes_only_with_complete_snapshot(rules):
    rules.setup()
    for ip, uid in (("2.2.2.2", "a"), ("6.6.6.6", "stale"), ("3.3.3.3", "b")):
        rules.add_pod(uid, [ip])
    assert rules.sync({"a": ["2.2.2.2"], "b": ["3.3.3.3"], "c": []}) == []  # c has no IP
    assert "6.6.6.6" in rules.entries()
    assert rules.sync({"a": ["2.2.2.2"], "b": ["3.3.3.3"]}) == ["6.6.6.6"]
    assert rules.entries() == {"2.2.2.2": "a", "3.3.3.3": "b"}


def test_setup_flushes_stale_entries(rules):
    rules.setup()
    rules.add_pod("x", ["10.1.1.1"])
    rules.setup()
    assert rules.entries() == {}
