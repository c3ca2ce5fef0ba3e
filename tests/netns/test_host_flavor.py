"""The host probe rules live in one iptables flavor, the one holding them (issue 26 item 2).

A restarted agent whose ``<state_dir>/iptables-flavor`` record is lost, on a host whose
``iptables`` alternative points at legacy while the previous agent wrote to
iptables-nft, used to write the host rule to legacy and leave the nft copy, whose SNAT
went on rewriting probes to the old address. Now the flavor holding our ``ISTIO_*``
chains on the node is kept and any copy in the other flavor is removed after ours is
written. The "node" is a scratch netns (setting ``host_rules_netns``); the host's
``iptables`` alternative is simulated by a private directory first on ``PATH`` with an
``iptables`` link to ``iptables-legacy`` (what Debian's alternatives are: a link).
Real iptables-nft and iptables-legacy.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess

import pytest

from cni.hostrules import HostProbeRules
from cni.rules_iptables import FLAVOR_FILE
from tests.netns.test_enrollment_reconciler import Harness, node_netns  # noqa: F401

pytestmark = pytest.mark.skipif(
    not (shutil.which("iptables-legacy") and shutil.which("iptables-nft-save")),
    reason="needs both iptables-legacy and iptables-nft installed")

OLD_SNAT, NEW_SNAT = "169.254.7.1", "169.254.7.127"


def nat(netns: str, flavor: str) -> str:
    """The node's nat table as ``iptables-<flavor>-save`` prints it."""
    return subprocess.run(["ip", "netns", "exec", os.path.basename(netns),
                           f"iptables-{flavor}-save", "-t", "nat"],
                          capture_output=True, text=True, check=True).stdout


def snat_sources(save: str, chain: str) -> list[str]:
    return [ln.rsplit("--to-source ", 1)[1] for ln in save.splitlines()
            if ln.startswith(f"-A {chain} ") and "--to-source " in ln]


async def test_lost_record_and_legacy_alternative_keep_the_nft_rules(
        state_dir, node_netns, monkeypatch, tmp_path):
    """Agent 1 writes the host rule to iptables-nft with the old SNAT address; its flavor
    record is lost and the host's ``iptables`` now says legacy. Agent 2 keeps nft (where
    ours are), rewrites the rule there with its address, and legacy gets nothing."""
    h1 = await Harness(state_dir, node_netns, host_probe_snat_ip=OLD_SNAT).start()
    assert h1.enrollment.debug_state()["iptables_flavor"] == "nft"
    await h1.kill()
    assert snat_sources(nat(node_netns, "nft"), "ISTIO_POSTRT") == [OLD_SNAT]
    os.unlink(os.path.join(state_dir, FLAVOR_FILE))

    bin_dir = tmp_path / "alt-bin"
    bin_dir.mkdir()
    (bin_dir / "iptables").symlink_to(shutil.which("iptables-legacy"))
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")

    h2 = await Harness(state_dir, node_netns, host_probe_snat_ip=NEW_SNAT).start()
    try:
        assert h2.enrollment.debug_state()["iptables_flavor"] == "nft"
        assert snat_sources(nat(node_netns, "nft"), "ISTIO_POSTRT") == [NEW_SNAT]
        legacy = nat(node_netns, "legacy")
        assert ":ISTIO_POSTRT" not in legacy and "ISTIO_POSTRT" not in legacy
        with open(os.path.join(state_dir, FLAVOR_FILE)) as f:
            assert f.read().strip() == "nft"
    finally:
        await h2.stop()


def test_copy_in_the_other_flavor_is_removed_after_ours_is_written(node_netns, caplog):
    """What the old code left: our chain in both flavors with different SNAT addresses.
    Setting up in legacy removes the nft copy (one warning naming it and its address),
    the legacy rule carries the new address, and a second setup changes nothing."""
    tag = secrets.token_hex(2)
    names = dict(chain=f"ISTIO_POSTRT_{tag}", set_v4=f"pv4-{tag}", set_v6=f"pv6-{tag}",
                 ipv6=False, netns=node_netns)
    old = HostProbeRules(flavor="nft", snat_ipv4=OLD_SNAT, **names)
    new = HostProbeRules(flavor="legacy", snat_ipv4=NEW_SNAT, **names)
    try:
        old.setup()
        assert snat_sources(nat(node_netns, "nft"), names["chain"]) == [OLD_SNAT]
        with caplog.at_level("WARNING", logger="cni.hostrules"):
            new.setup()
        assert names["chain"] not in nat(node_netns, "nft")
        assert snat_sources(nat(node_netns, "legacy"), names["chain"]) == [NEW_SNAT]
        warned = [r.getMessage() for r in caplog.records if "stale copy" in r.getMessage()]
        assert len(warned) == 1 and OLD_SNAT in warned[0] and "iptables-nft" in warned[0]
        once = nat(node_netns, "legacy")
        new.setup()
        assert nat(node_netns, "legacy").count(f"-j {names['chain']}") == once.count(
            f"-j {names['chain']}") == 1
        assert new.remove_stale_flavor() == []
    finally:
        new.teardown()
        old.teardown()
    assert names["chain"] not in nat(node_netns, "nft") + nat(node_netns, "legacy")
