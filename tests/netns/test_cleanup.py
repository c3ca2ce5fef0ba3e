"""``ambient-agent cleanup``: a node decommissioned with real rules (needs root).

The "node" is a scratch netns (``host_rules_netns``), never the real host: the host probe
rules and sets of both backends are created there with their default names, as a
stopped agent leaves them; a "pod" netns on a bridge holds real in-pod rules and the
state dir its record; the CNI dirs hold the plugin and conflist entry ``cni install``
writes. ``--dry-run`` lists everything and changes nothing; cleanup removes it all and a
second run has nothing to do; a running agent (its lock held) or a foreign plugin is
refused with one line, nothing changed."""

from __future__ import annotations

import fcntl
import io
import json
import os
import shutil
import subprocess
from contextlib import redirect_stderr, redirect_stdout

import pytest
from pyroute2 import netns as pr_netns

from agent import cli as agent_cli
from cni.enrollment.records import PodRecord, PodStateStore
from cni.hostrules import HostProbeRules
from cni.install import Installer
from cni.rules_common import RuleOptions
from cni.rules_iptables import IptablesBackend
from tests.netns.test_enrollment_rules import _strip_counters, snapshot as _snapshot
from tests.netns.toolkit import unique

PRIMARY = {"cniVersion": "1.0.0", "name": "podman",
           "plugins": [{"type": "bridge", "bridge": "cni0"}]}


@pytest.fixture
def node():
    name = unique("tcl")
    pr_netns.create(name)
    try:
        yield f"/var/run/netns/{name}"
    finally:
        pr_netns.remove(name)


def snapshot(pod) -> str:
    """The pod's rules and routes, packet counters left out (traffic may move them)."""
    return _strip_counters(_snapshot(pod))


def node_rules(node: str) -> str:
    out = []
    for argv in (["nft", "list", "ruleset"], ["ipset", "list", "-n"]):
        p = subprocess.run(["nsenter", f"--net={node}", *argv], capture_output=True, text=True)
        out.append(p.stdout)
    return _strip_counters("\n".join(out))


def cleanup(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = agent_cli.main(["cleanup", *argv])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def decommissioned(tmp_path, bridge, node):
    """What a stopped agent leaves: returns (argv, pod, state dir, conf dir, bin dir)."""
    state, conf, bindir = tmp_path / "state", tmp_path / "net.d", tmp_path / "bin"
    state.mkdir(mode=0o700)
    conf.mkdir()
    (conf / "10-podman.conflist").write_text(json.dumps(PRIMARY))
    Installer(conf_dir=str(conf), bin_dir=str(bindir), run_dir=str(state)).install()
    pod = bridge.add_pod("tq")
    pod.run(IptablesBackend("nft").apply, RuleOptions(ipv6=False))
    PodStateStore(str(state)).save(PodRecord(pod.uid, "web", "shop", netns=pod.netns_path,
                                             ips=[pod.ip], status="enabled"))
    (state / "iptables-flavor").write_text("nft\n")
    (state / "enablement.json").write_text("{}")
    (tmp_path / "none.yaml").write_text("")
    for backend in ("iptables", "nftables"):
        HostProbeRules(backend=backend, ipv6=False, netns=node, kubelet_uid=0).setup()
    argv = ("--state-dir", str(state), "--config-file", str(tmp_path / "none.yaml"),
            "--cni-conf-dir", str(conf), "--cni-bin-dir", str(bindir),
            "--host-rules-netns", node, "--ambient-ipv6", "false",
            # never the default /var/run/ztunnel/ztunnel.sock: another agent on this host
            # may serve it (cleanup would refuse), and cleanup removes what is there
            "--ztunnel-uds-address", str(tmp_path / "ztunnel.sock"))
    yield argv, pod, state, conf, bindir
    for backend in ("iptables", "nftables"):  # whatever a failed test left in the node
        HostProbeRules(backend=backend, ipv6=False, netns=node).teardown()


def test_dry_run_then_cleanup_then_nothing(decommissioned, node):
    argv, pod, state, conf, bindir = decommissioned
    pod_before, node_before = snapshot(pod), node_rules(node)
    files_before = sorted(p.name for p in [*state.iterdir(), *conf.iterdir(), *bindir.iterdir()])
    assert "ISTIO" in pod_before and "istio-ambient-nat" in node_before

    code, out, err = cleanup(*argv, "--dry-run")
    assert code == 0, err
    assert f"would remove in-pod rules of shop/web (uid {pod.uid}) in {pod.netns_path}" in out
    assert "would remove host nftables table inet istio-ambient-nat" in out
    assert "ISTIO_POSTRT" in out and "ipset istio-inpod-probes-v4" in out
    # one kernel ipset, reported by both iptables flavors: said once
    assert out.count("ipset istio-inpod-probes-v4") == 1, out
    assert f"would remove istio-cni from {conf / '10-podman.conflist'}" in out
    assert f"would remove {bindir / 'istio-cni'}" in out
    assert f"would remove state {state / 'pods'}" in out
    assert snapshot(pod) == pod_before and node_rules(node) == node_before
    assert sorted(p.name for p in [*state.iterdir(), *conf.iterdir(),
                                   *bindir.iterdir()]) == files_before

    code, out, err = cleanup(*argv)
    assert code == 0, (out, err)
    assert "ISTIO" not in snapshot(pod)
    assert "istio-ambient-nat" not in node_rules(node) and "istio-inpod" not in node_rules(node)
    primary = json.loads((conf / "10-podman.conflist").read_text())
    assert [p["type"] for p in primary["plugins"]] == ["bridge"]
    assert not (bindir / "istio-cni").exists() and not (state / "pods").exists()

    code, out, err = cleanup(*argv)
    assert (code, out, err) == (0, "nothing to clean up\n", "")


def test_running_agent_and_foreign_plugin_refused(decommissioned, node):
    argv, pod, state, conf, bindir = decommissioned
    pod_before, node_before = snapshot(pod), node_rules(node)
    lock = os.open(state / "agent.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        os.write(lock, b"4242\n")
        code, out, err = cleanup(*argv)
        assert code == 1 and out == "" and "(pid 4242) is running" in err
        assert len(err.splitlines()) == 1
        # a dry run beside the running agent still says what cleanup would remove (a
        # tester found it refused too), names the agent, exits 1, and takes no lock
        code, out, err = cleanup(*argv, "--dry-run")
        assert code == 1 and "a real run would refuse now" in err and "(pid 4242)" in err
        assert len(err.splitlines()) == 1
        assert f"would remove in-pod rules of shop/web (uid {pod.uid})" in out, out
        assert snapshot(pod) == pod_before and node_rules(node) == node_before
    finally:
        os.close(lock)
    import socket
    with socket.socket(socket.AF_UNIX) as live:  # an agent without its lock file
        live.bind(str(state / "admin.sock"))
        live.listen(1)
        code, out, err = cleanup(*argv)
        assert code == 1 and out == "" and "an agent answers on" in err and "admin_socket" in err
    (bindir / "istio-cni").write_bytes(b"\x7fELF upstream binary")
    code, out, err = cleanup(*argv)
    assert code == 1 and out == "" and "was not installed by this agent" in err
    assert len(err.splitlines()) == 1
    code, out, err = cleanup(*argv, "--dry-run")
    assert code == 1 and "was not installed by this agent" in err and "would remove" in out
    code, out, err = cleanup(*argv, "--dry-run", "--force")
    assert code == 0 and err == "" and f"would remove {bindir / 'istio-cni'}" in out
    assert snapshot(pod) == pod_before and node_rules(node) == node_before
    assert (bindir / "istio-cni").read_bytes() == b"\x7fELF upstream binary"
    code, out, err = cleanup(*argv, "--force")
    assert code == 0, err
    assert not (bindir / "istio-cni").exists() and "ISTIO" not in snapshot(pod)


def test_bad_flags_are_one_line(tmp_path):
    (tmp_path / "none.yaml").write_text("")
    code, out, err = cleanup("--state-dir", str(tmp_path), "--ambient-ipv6", "perhaps",
                             "--config-file", str(tmp_path / "none.yaml"))
    assert code == 2 and out == "" and "ambient_ipv6" in err and len(err.splitlines()) == 1


def _xtables_names(netns: str) -> tuple[str, str]:
    """The legacy xtables tables loaded in ``netns`` (IPv4, IPv6), as the kernel lists them."""
    out = []
    for v in ("", "6"):
        p = subprocess.run(["nsenter", f"--net={netns}", "cat", f"/proc/net/ip{v}_tables_names"],
                           capture_output=True, text=True)
        out.append(p.stdout)
    return out[0], out[1]


@pytest.mark.skipif(not shutil.which("iptables-legacy-save"),
                    reason="iptables-legacy not installed")
def test_looking_creates_no_legacy_tables(tmp_path, node):
    """A newuser finding: `cleanup --dry-run` and the agent's start (remove_stale_flavor)
    read the legacy nat table with iptables-legacy-save, which creates it: an empty
    legacy nat table stayed, and every iptables-save then warned "iptables-legacy tables
    present". Only loaded tables are read now; a fresh netns keeps none."""
    before = _xtables_names(node)
    assert before == ("", ""), before  # a fresh netns: nothing loaded
    (tmp_path / "none.yaml").write_text("")
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    code, out, err = cleanup("--state-dir", str(state), "--config-file",
                             str(tmp_path / "none.yaml"), "--cni-conf-dir", str(tmp_path / "c"),
                             "--cni-bin-dir", str(tmp_path / "b"), "--host-rules-netns", node,
                             "--ambient-ipv6", "true", "--ztunnel-uds-address",
                             str(tmp_path / "ztunnel.sock"), "--dry-run")
    assert code == 0, (out, err)
    assert _xtables_names(node) == before
    # the agent's start on iptables-nft: its rules written, the other flavor looked at
    rules = HostProbeRules(backend="iptables", flavor="nft", ipv6=True, netns=node)
    try:
        rules.setup()
        assert rules.remove_stale_flavor() == []
        assert _xtables_names(node) == before
    finally:
        rules.teardown()
    assert _xtables_names(node) == before
    # a legacy table that does exist is still read: a stale legacy copy of our chain is
    # found and removed by the nft agent's start
    legacy = HostProbeRules(backend="iptables", flavor="legacy", ipv6=False, netns=node)
    nft = HostProbeRules(backend="iptables", flavor="nft", ipv6=False, netns=node)
    try:
        legacy.setup()
        assert "nat" in _xtables_names(node)[0].split()

        def legacy_nat() -> str:
            return subprocess.run(["nsenter", f"--net={node}", "iptables-legacy-save", "-t",
                                   "nat"], capture_output=True, text=True, check=True).stdout

        assert f":{legacy.chain} " in legacy_nat()
        nft.setup()  # ends with remove_stale_flavor
        assert f":{legacy.chain} " not in legacy_nat()
    finally:
        nft.teardown()
        legacy.teardown()
