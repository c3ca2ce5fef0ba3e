"""Pods started while the agent is down must not come up unmeshed (issue 14).

The real agent (``agent.daemon.Agent``: files config source, enrollment, CNI event
server, snapshot writer and its own installer with ``cni_manage_config``) chains
``istio-cni`` into a real conflist of Debian's ``bridge`` + ``host-local``; the chain is
driven by ``agent.demo.cni_runtime`` exactly as a runtime drives it (loopback first, then the
conflist the installer wrote, with Kubernetes ``CNI_ARGS``), on real netns; the
reference ztunnel (``agent.demo.fake_ztunnel.FakeZtunnel``) acks ZDS. Host probe rules go into a
scratch netns. Then the agent stops (what SIGTERM runs): the plugin stays; an ambient
pod's ADD fails with code 11 and a non-ambient pod starts; the agent comes back and the
runtime's retry of the ambient pod enrolls it.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess

import pytest
import yaml
from pyroute2 import netns as pr_netns

from agent.core import config as agent_config
from agent import daemon
from agent.demo.envoy import free_port
from cni import plugin_request
from agent.demo.cni_runtime import CniPluginError, CniRuntime, load_conflist
from tests.helpers import eventually
from tests.netns.toolkit import unique
from agent.demo.fake_ztunnel import FakeZtunnel

pytestmark = pytest.mark.skipif(not os.path.exists("/usr/lib/cni/bridge"),
                                reason="containernetworking-plugins not installed")

NODE = "node-down"
AMBIENT = {"istio.io/dataplane-mode": "ambient"}
LO = {"cniVersion": "1.0.0", "name": "lo", "plugins": [{"type": "loopback"}]}


def write_yaml(path, *objs):
    tmp = str(path) + ".tmp"
    with open(tmp, "w") as f:
        yaml.safe_dump_all(list(objs), f)
    os.replace(tmp, path)


def pod_obj(name, ns, uid):
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "uid": uid},
            "spec": {"nodeName": NODE, "serviceAccountName": "default"},
            "status": {"phase": "Pending"}}


class Node:
    """A node: primary conflist, cluster directory, scratch netns for host rules, and
    the agent started/stopped on demand (same state dir each time)."""

    def __init__(self, root):
        self.root = root
        self.bridge = unique("tdbr")
        self.host_netns = unique("tdh")
        self.pod_netns: list[str] = []
        subnet = f"10.{secrets.randbelow(50) + 130}.{secrets.randbelow(250)}.0/24"
        for d in ("net.d", "bin", "cluster", "cache"):
            os.makedirs(root / d)
        (root / "net.d" / "10-test.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": unique("tdn"), "plugins": [
                {"type": "bridge", "bridge": self.bridge, "isGateway": True, "ipMasq": False,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": subnet}]],
                          "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(root / "ipam")}}]}))
        write_yaml(root / "cluster" / "namespaces.yaml",
                   {"apiVersion": "v1", "kind": "Namespace",
                    "metadata": {"name": "amb", "labels": AMBIENT}},
                   {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "plain"}})
        pr_netns.create(self.host_netns)
        self.runtime = CniRuntime([str(root / "bin"), "/usr/lib/cni"], str(root / "cache"))
        self.agent = None
        self.zds = None
        self.zds_task = None

    def flags(self):
        r = self.root
        return {"state_dir": f"{r}/state", "config_dir": f"{r}/cluster",
                "config_file": os.devnull, "node_name": NODE, "cni_conf_dir": f"{r}/net.d",
                "cni_bin_dir": f"{r}/bin", "cni_manage_config": "true",
                "ztunnel_uds_address": f"{r}/state/ztunnel.sock", "ambient_ipv6": "false",
                "status_port": str(free_port()), "health_port": str(free_port()),
                "monitoring_port": "0",
                "xds_port": str(free_port()), "xds_tls_port": "0", "log_level": "warn",
                "shutdown_grace": "2s", "host_rules_netns": f"/var/run/netns/{self.host_netns}"}

    async def start_agent(self):
        self.config = agent_config.load(self.flags(), env={})
        self.agent = daemon.Agent(self.config)
        await self.agent.start()
        self.zds = FakeZtunnel(self.config.ztunnel_uds_address, open_listeners=False)
        self.zds_task = asyncio.create_task(self.zds.run())
        await self.zds.wait_snapshot(timeout=10)

    async def stop_agent(self):
        if self.zds is not None:
            self.zds.stop()
            try:
                await asyncio.wait_for(self.zds_task, 5)
            except (asyncio.CancelledError, asyncio.TimeoutError):
                pass
            self.zds = None
        if self.agent is not None:
            await self.agent.stop()
            self.agent = None

    def conflist(self):
        return load_conflist(str(self.root / "net.d" / "10-test.conflist"))

    def new_netns(self):
        name = unique("tdp")
        subprocess.run(["ip", "netns", "add", name], check=True)
        self.pod_netns.append(name)
        return f"/var/run/netns/{name}"

    def add(self, cid, netns, ns, name, uid):
        args = {"K8S_POD_NAMESPACE": ns, "K8S_POD_NAME": name, "K8S_POD_UID": uid}
        self.runtime.add(LO, cid, netns, "lo", args)
        return self.runtime.add(self.conflist(), cid, netns, "eth0", args)

    def delete(self, cid, netns, ns, name, uid):
        args = {"K8S_POD_NAMESPACE": ns, "K8S_POD_NAME": name, "K8S_POD_UID": uid}
        self.runtime.delete(self.conflist(), cid, netns, "eth0", args)
        self.runtime.delete(LO, cid, netns, "lo", args)

    def enrolled(self, uid):
        pods = self.agent.enrollment.debug_state()["pods"]
        return (pods.get(uid) or {}).get("status") == "enabled" and uid in self.zds.pods

    async def close(self):
        await self.stop_agent()
        for name in self.pod_netns:
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], check=False, capture_output=True)
        pr_netns.remove(self.host_netns)


@pytest.fixture
async def node(tmp_path):
    n = Node(tmp_path)
    try:
        yield n
    finally:
        await n.close()


async def test_plugin_stays_and_holds_ambient_pods_while_the_agent_is_down(node):
    root = node.root
    write_yaml(root / "cluster" / "known.yaml", pod_obj("known", "amb", "u-known"))
    await node.start_agent()
    known_ns = node.new_netns()
    await asyncio.to_thread(node.add, "c-known", known_ns, "amb", "known", "u-known")
    assert node.enrolled("u-known")
    chained = node.conflist()
    assert [p["type"] for p in chained["plugins"]] == ["bridge", "istio-cni"]

    await node.stop_agent()  # what SIGTERM runs
    # the plugin stays: same conflist, launcher in place, snapshot next to the socket
    assert node.conflist() == chained
    assert os.access(root / "bin" / "istio-cni", os.X_OK)
    snap = json.loads((root / "state" / plugin_request.SNAPSHOT_NAME).read_text())
    assert snap["pods"] == {"u-known": True} and snap["namespaces"]["amb"] is True
    assert not os.path.exists(root / "state" / "pluginevent.sock")

    # an ambient pod created while the agent is down: the runtime gets "try again later"
    write_yaml(root / "cluster" / "late.yaml", pod_obj("late", "amb", "u-late"))
    late_ns = node.new_netns()
    with pytest.raises(CniPluginError) as err:
        await asyncio.to_thread(node.add, "c-late", late_ns, "amb", "late", "u-late")
    assert err.value.plugin == "istio-cni" and err.value.code == plugin_request.ERR_TRY_AGAIN
    assert "pod amb/late is ambient" in err.value.msg
    # the runtime tears the failed sandbox's network down (DEL is best effort: exit 0)
    await asyncio.to_thread(node.delete, "c-late", late_ns, "amb", "late", "u-late")
    # a non-ambient pod is never held
    plain_ns = node.new_netns()
    result = await asyncio.to_thread(node.add, "c-plain", plain_ns, "plain", "web", "u-plain")
    assert result["ips"] and any(i.get("sandbox") == plain_ns for i in result["interfaces"])
    # a sandbox re-created for the known pod is held too (the agent's own last answer)
    again_ns = node.new_netns()
    with pytest.raises(CniPluginError) as err:
        await asyncio.to_thread(node.add, "c-known2", again_ns, "amb", "known", "u-known")
    assert err.value.code == plugin_request.ERR_TRY_AGAIN
    await asyncio.to_thread(node.delete, "c-known2", again_ns, "amb", "known", "u-known")

    # the agent is back: the runtime's retry of the held pod enrolls it
    await node.start_agent()
    assert node.conflist() == chained  # found installed, not rewritten
    await asyncio.to_thread(node.add, "c-late", late_ns, "amb", "late", "u-late")
    await eventually(lambda: node.enrolled("u-late"))
    assert not node.enrolled("u-plain")
    for cid, ns_path, ns, name, uid in [("c-late", late_ns, "amb", "late", "u-late"),
                                        ("c-plain", plain_ns, "plain", "web", "u-plain"),
                                        ("c-known", known_ns, "amb", "known", "u-known")]:
        await asyncio.to_thread(node.delete, cid, ns_path, ns, name, uid)
