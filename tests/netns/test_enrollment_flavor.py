"""A pod never gets a second copy of its rules in another stack (issue 17 item 9).

When the agent's backend changes while pods keep their rules (``<state_dir>/iptables-flavor``
lost, the host's ``iptables`` alternative switched, ``native_nftables`` turned on), the
pod's netns is looked at before adding (:mod:`cni.rules_detect`): its rules are
reconciled in the stack that holds them, and removed from there, as upstream matches
its tools to where the netns's rules are. Real netns pods, real iptables-nft,
iptables-legacy and nftables, the real ZDS server with the ZDS ztunnel stand-in; host
probe rules in a scratch "node" netns.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket

import pytest

from agent.core.lifecycle import AgentContext
from cni import rules_detect
from agent.enrollment_zds import ZdsServerChannel
from cni.enrollment import Enrollment
from pyroute2 import IPRoute

from cni.rules_common import INPOD_TPROXY_MARK, ROUTE_TABLE_INBOUND, RuleOptions
from cni.rules_iptables import FLAVOR_FILE
from tests.netns.test_enrollment_reconciler import Harness, event, node_netns  # noqa: F401
from tests.netns.test_enrollment_rules import accept_one, dial, original_dst, snapshot
from zds.server import ZdsServer


def routing_present(ipv6: bool) -> bool:
    """True when the in-pod ``ip rule`` (fwmark 0x111 -> table 100) exists for every family
    (run inside the pod's netns)."""
    families = [socket.AF_INET, socket.AF_INET6] if ipv6 else [socket.AF_INET]
    with IPRoute() as ipr:
        for family in families:
            if not any(r.get_attr("FRA_TABLE") == ROUTE_TABLE_INBOUND
                       and r.get_attr("FRA_FWMARK") == INPOD_TPROXY_MARK
                       for r in ipr.get_rules(family=family)):
                return False
    return True

STACKS = rules_detect.STACKS


def ours_in(pod) -> dict[str, bool]:
    """Which stacks hold our rules, read with each stack's own tool (independent of
    :mod:`cni.rules_detect`)."""
    ipt = pod.exec("iptables-nft-save").stdout + pod.exec("ip6tables-nft-save").stdout
    leg = pod.exec("iptables-legacy-save").stdout + pod.exec("ip6tables-legacy-save").stdout
    nft = pod.exec("nft", "list", "tables").stdout
    return {rules_detect.IPTABLES_NFT: ":ISTIO_" in ipt,
            rules_detect.IPTABLES_LEGACY: ":ISTIO_" in leg,
            rules_detect.NFTABLES: "table inet istio-ambient-" in nft}


def only(stack: str) -> dict[str, bool]:
    return {s: s == stack for s in STACKS}


@pytest.mark.parametrize("stack", STACKS)
def test_held_stacks_sees_each_stack(bridge, stack):
    pod = bridge.add_pod("th")
    assert pod.run(rules_detect.held_stacks, False) == set()
    backend = rules_detect.backend_for(stack)
    pod.run(backend.apply, RuleOptions(ipv6=False))
    assert pod.run(rules_detect.held_stacks, False) == {stack}
    assert ours_in(pod) == only(stack)
    pod.run(backend.delete, False)
    assert pod.run(rules_detect.held_stacks, False) == set()


@pytest.mark.parametrize("stack", [rules_detect.IPTABLES_NFT, rules_detect.IPTABLES_LEGACY])
def test_started_apply_acts_only_when_fed(bridge, stack):
    """The iptables backend starts its restore tools before the netns is looked at
    (``start_apply``); abandoned unfed, they apply nothing; finished, the rules are in."""
    pod = bridge.add_pod("tp")
    backend = rules_detect.backend_for(stack)
    opts = RuleOptions(ipv6=False)
    pod.run(lambda: backend.start_apply(opts).abandon())
    assert ours_in(pod) == {s: False for s in STACKS}
    assert not pod.run(routing_present, False)
    assert pod.run(lambda: backend.start_apply(opts).finish()) == "applied"
    assert ours_in(pod) == only(stack)


async def start_agent(state_dir, node_netns, stack: str) -> Harness:
    h = Harness(state_dir, node_netns, native_nftables=stack == rules_detect.NFTABLES)
    h.ctx = AgentContext(h.config)
    h.zds = h.ctx.add(ZdsServer(h.config.ztunnel_uds_address, ztunnel_wait=2.0))
    h.enrollment = h.ctx.add(Enrollment(h.ctx, backend=rules_detect.backend_for(stack),
                                           zds=ZdsServerChannel(h.zds)))
    await h.zds.start()
    await h.enrollment.start()
    return h


PAIRS = [(a, b) for a, b in itertools.permutations(STACKS, 2)]


@pytest.mark.parametrize("held,agent", PAIRS, ids=[f"{a}-then-{b}" for a, b in PAIRS])
async def test_restart_with_another_backend_reconciles_in_the_held_stack(
        bridge, state_dir, node_netns, held, agent):
    """Agent 1 enrolls a pod with ``held``; its flavor file is lost and agent 2 starts
    with ``agent``. Recovery reconciles the pod's rules where they are (no copy in
    ``agent``'s stack, the rule count unchanged), traffic is still redirected once, a
    re-ADD changes nothing, and a live un-enrollment leaves the netns as it was."""
    a, b = [await asyncio.to_thread(bridge.add_pod, n) for n in ("ta", "tb")]
    clean = snapshot(a)
    h1 = await start_agent(state_dir, node_netns, held)
    await h1.ztunnel()
    await h1.enrollment.enroll(event(a))
    assert ours_in(a) == only(held)
    before = snapshot(a)
    await h1.kill()
    flavor = os.path.join(state_dir, FLAVOR_FILE)
    if os.path.exists(flavor):
        os.unlink(flavor)

    h2 = await start_agent(state_dir, node_netns, agent)
    try:
        assert h2.enrollment.debug_state()["pods"][a.uid]["status"] == "enabled"
        assert ours_in(a) == only(held), "a second copy was added in the agent's stack"
        await h2.ztunnel()
        await h2.enrollment.enroll(event(a))  # a repeated ADD: still one copy
        assert ours_in(a) == only(held)
        assert _rules(snapshot(a)) == _rules(before)

        outbound = a.listen(15001, "0.0.0.0")
        try:
            client = dial(a, b.ip, 8080)
            conn = accept_one(outbound)
            assert original_dst(conn) == (b.ip, 8080)
            conn.close(), client.close()
        finally:
            outbound.close()

        await h2.enrollment.unenroll(event(a, "DEL"), is_delete=False)
        assert ours_in(a) == {s: False for s in STACKS}
        assert snapshot(a) == clean
    finally:
        await h2.stop()


async def test_copies_in_two_stacks_are_reduced_to_one(bridge, state_dir, node_netns):
    """What the bug left behind: the pod holds our rules in iptables-nft and in
    iptables-legacy. Enrolling it with the legacy agent keeps the legacy copy (the
    agent's stack), removes the nft one, and keeps the routing."""
    pod = await asyncio.to_thread(bridge.add_pod, "td")
    opts = RuleOptions(ipv6=False)
    for stack in (rules_detect.IPTABLES_NFT, rules_detect.IPTABLES_LEGACY):
        pod.run(rules_detect.backend_for(stack).apply, opts)
    assert ours_in(pod) == {rules_detect.IPTABLES_NFT: True,
                            rules_detect.IPTABLES_LEGACY: True, rules_detect.NFTABLES: False}
    h = await start_agent(state_dir, node_netns, rules_detect.IPTABLES_LEGACY)
    try:
        await h.ztunnel()
        await h.enrollment.enroll(event(pod))
        assert ours_in(pod) == only(rules_detect.IPTABLES_LEGACY)
        assert pod.run(routing_present, False)
    finally:
        await h.stop()


def _rules(snap: str) -> list[str]:
    """Rule lines of a :func:`snapshot`, counters and handles ignored, order kept."""
    import re
    out = []
    for line in snap.splitlines():
        line = re.sub(r"\[\d+:\d+\]|counter packets \d+ bytes \d+|# handle \d+", "", line)
        out.append(line.strip())
    return out
