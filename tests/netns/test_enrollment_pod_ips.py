"""Pod IPs in IPv4-mapped IPv6 form (``::ffff:10.0.0.19``, as some CNIs report them) are
IPv4 pods (issue 17 item 5; upstream unmaps with ``netip.Addr.Unmap()``).

Real netns pods on a bridge, real in-pod rules, the real ZDS server with the ZDS
fake ztunnel (agent.demo.fake_ztunnel), the real CNI event server, and the
real ``istio-cni`` plugin executed through the launcher our installer writes, exactly as
a runtime runs it. Host probe sets live in a scratch "node" netns.
"""

from __future__ import annotations

import asyncio
import os

from cni.install import Installer
from tests.cni.conftest import cni_env, net_conf, run_plugin
from tests.netns.test_enrollment_cancel import start, stop
from tests.netns.test_enrollment_reconciler import (FakeConfigSource, Harness, host_entries,
                                                    node_netns)  # noqa: F401


def plugin_launcher(tmp_path) -> str:
    inst = Installer(conf_dir=str(tmp_path / "net.d"), bin_dir=str(tmp_path / "bin"),
                     run_dir=str(tmp_path / "run"))
    inst.install_binary()
    return inst.binary_path


def pod_env(h: Harness, pod, command: str) -> dict:
    return cni_env(command=command, container_id="c-" + pod.name, netns=pod.netns_path,
                   args=f"IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={pod.name};"
                        f"K8S_POD_UID={pod.uid}")


def mapped_conf(h: Harness, pod) -> dict:
    conf = net_conf(os.path.dirname(h.config.cni_event_socket), ambient_default=True)
    conf["prevResult"]["ips"] = [{"address": f"::ffff:{pod.ip}/120", "interface": 0}]
    return conf


async def test_cni_add_and_del_with_mapped_ipv4_pod_ip(bridge, state_dir, node_netns,
                                                        tmp_path):
    """The real plugin's ADD with ``prevResult.ips[0].address = ::ffff:<ip>/120``: the pod
    is enrolled (exit 0, its prevResult printed unchanged), its IPv4 probe entry is the
    dotted form, and the DEL with the same mapped form removes it. Before the fix the
    ADD failed with code 11 ("illegal IP address string passed to inet_pton") forever."""
    h = await start(Harness(state_dir, node_netns))
    try:
        await h.ztunnel()
        pod = await asyncio.to_thread(bridge.add_pod, "tm")
        launcher = plugin_launcher(tmp_path)
        conf = mapped_conf(h, pod)
        code, out, err = await run_plugin(launcher, pod_env(h, pod, "ADD"), conf)
        assert code == 0, (out, err)
        assert out["ips"] == conf["prevResult"]["ips"]  # the runtime's result, untouched
        rec = h.enrollment.pods()[pod.uid]
        assert rec.status == "enabled" and rec.ips == [pod.ip]
        assert await host_entries(h) == {pod.ip: pod.uid}

        code, out, err = await run_plugin(launcher, pod_env(h, pod, "DEL"), conf)
        assert code == 0, (out, err)
        assert await host_entries(h) == {}
        assert pod.uid not in h.enrollment.pods()
    finally:
        await stop(h)


async def test_restart_takes_mapped_pod_ips_from_pod_status(bridge, state_dir, node_netns):
    """Kubernetes mode, a pod annotated ``enabled`` whose ``status.podIPs`` holds the
    mapped form and no state file: at start its probe entry is the IPv4 address (before
    the fix the set add failed with inet_pton and the pod's probes were never SNATed)."""
    pod = await asyncio.to_thread(bridge.add_pod, "ts")
    source = FakeConfigSource()
    source.pods[pod.uid] = {
        "kind": "Pod",
        "metadata": {"uid": pod.uid, "name": pod.name, "namespace": "default",
                     # still ambient: the agent removes an enrolled pod whose labels no
                     # longer select it (cni.enrollment.watch), which would race the checks below
                     "labels": {"istio.io/dataplane-mode": "ambient"},
                     "annotations": {"ambient.istio.io/redirection": "enabled"}},
        "spec": {"nodeName": ""},
        "status": {"podIP": f"::ffff:{pod.ip}", "podIPs": [{"ip": f"::ffff:{pod.ip}"}]}}
    h = await Harness(state_dir, node_netns, config_source="kubernetes").start(source)
    try:
        assert h.enrollment.pods()[pod.uid].ips == [pod.ip]
        assert await host_entries(h) == {pod.ip: pod.uid}
    finally:
        await h.stop()
