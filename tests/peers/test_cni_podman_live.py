"""A running podman container follows its Pod object's namespace labels (files source).

Rootful podman (CNI backend, runc) on a network whose conflist has istio-cni chained by
our installer; the agent's real pieces (files config source over a YAML directory, CNI
event server, enrollment, ZDS server) with the ZDS ztunnel stand-in
(agent.demo.fake_ztunnel, on a thread of its own: ztunnel can't run here); host probe rules in a
scratch netns. The container's Pod object has ``metadata.uid`` = its container ID (how
a host without Kubernetes describes its containers, docs/cni.md). The container starts
outside the mesh; labelling its namespace ambient (a file edit) enrolls it live, found
through the sandbox its CNI ADD reported; after an agent restart the same happens with
the netns found through ``/proc`` (podman's ``libpod-<container id>`` cgroup).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import time

import pytest
import yaml
from pyroute2 import netns as pr_netns

from agent.demo import podman
from agent.core.config import load
from agent.core.lifecycle import AgentContext
from ambient import source as ambient_source
from agent.enrollment_zds import ZdsServerChannel
from cni.enrollment import Enrollment
from cni.eventserver import CniEventServer
from cni.install import Installer
from tests.helpers import eventually
from agent.demo.fake_ztunnel_thread import FakeZtunnelThread
from tests.netns.toolkit import unique
from zds.server import ZdsServer

pytestmark = [pytest.mark.podman,
              pytest.mark.skipif(not podman.available(), reason="podman or runc not installed")]

AMBIENT = {"istio.io/dataplane-mode": "ambient"}


def write_yaml(path, *objs):
    tmp = str(path) + ".tmp"
    with open(tmp, "w") as f:
        yaml.safe_dump_all(list(objs), f)
    os.replace(tmp, path)


def in_netns(netns_path, *argv):
    return subprocess.run(["nsenter", f"--net={netns_path}", *argv], capture_output=True,
                          text=True, check=True).stdout


class Agent:
    def __init__(self, root, host_netns):
        self.config = load({"state_dir": str(root / "state"), "config_file": os.devnull},
                           env={}).replace(
            config_dir=str(root / "cluster"),
            ztunnel_uds_address=str(root / "state" / "zds.sock"), ztunnel_wait=2.0,
            host_rules_netns=f"/var/run/netns/{host_netns}", ambient_ipv6=False)

    async def start(self):
        self.ctx = AgentContext(self.config)
        self.source = self.ctx.add(ambient_source.build(self.ctx))
        self.zds = self.ctx.add(ZdsServer(self.config.ztunnel_uds_address, ztunnel_wait=2.0))
        self.enrollment = self.ctx.add(Enrollment(self.ctx, zds=ZdsServerChannel(self.zds),
                                                  source=self.source))
        self.events = self.ctx.add(CniEventServer(self.ctx, self.config.cni_event_socket,
                                                  store=self.source.store,
                                                  enrollment=self.enrollment))
        await self.source.start()
        await self.zds.start()
        self.ztunnel = await asyncio.to_thread(
            FakeZtunnelThread(self.config.ztunnel_uds_address).start)
        await self.enrollment.start()
        await self.events.start()
        return self

    def status(self, uid):
        rec = self.enrollment.pods().get(uid)
        return rec.status if rec is not None else None

    async def stop(self):
        self.ztunnel.close()
        await self.events.stop(1.0)
        await self.enrollment.stop(1.0)
        await self.zds.stop(0.5)
        await self.source.stop(0.5)
        self.ctx.executor.shutdown(wait=False)


@pytest.fixture
def host(tmp_path):
    """podman with a private containers.conf and a bridge network chained with istio-cni;
    a scratch netns for the host probe rules. Everything removed at the end."""
    bin_dir, conf_dir = tmp_path / "bin", tmp_path / "net.d"
    for d in (conf_dir, tmp_path / "cluster", tmp_path / "state"):
        d.mkdir()
    podman.write_containers_conf(tmp_path / "containers.conf", [bin_dir, "/usr/lib/cni"],
                                 conf_dir)
    pm = podman.Podman(tmp_path / "containers.conf")
    bridge, network = unique("tlbr"), unique("tlnet")
    subnet = f"10.{secrets.randbelow(50) + 70}.{secrets.randbelow(250)}.0/24"
    (conf_dir / f"50-{network}.conflist").write_text(json.dumps({
        "cniVersion": "1.0.0", "name": network, "plugins": [
            {"type": "bridge", "bridge": bridge, "isGateway": True, "ipMasq": False,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": subnet}]],
                      "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(tmp_path / "ipam")}}]}))
    Installer(conf_dir=str(conf_dir), bin_dir=str(bin_dir),
              run_dir=str(tmp_path / "state")).install()
    image = f"localhost/ambient-live-test:{secrets.token_hex(4)}"
    pm.import_busybox(image)
    host_netns = unique("tlh")
    pr_netns.create(host_netns)
    containers: list[str] = []
    try:
        yield pm, network, image, host_netns, containers
    finally:
        for c in containers:
            pm.remove(c)
        pm.run("rmi", "-f", image, check=False)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)
        pr_netns.remove(host_netns)


async def test_running_podman_container_enrolled_when_its_namespace_turns_ambient(
        tmp_path, host):
    pm, network, image, host_netns, containers = host
    cluster = tmp_path / "cluster"
    write_yaml(cluster / "namespaces.yaml",
               {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}})
    cid = await asyncio.to_thread(pm.create, unique("tlc"), network, image,
                                  "/bin/busybox", "sleep", "3600")
    containers.append(cid)
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "cart", "namespace": "shop", "uid": cid},
           "spec": {"serviceAccountName": "cart"}}
    write_yaml(cluster / "cart.yaml", pod)
    agent = await Agent(tmp_path, host_netns).start()
    try:
        await eventually(lambda: agent.source.store.pod_by_uid(cid) is not None)
        await asyncio.to_thread(pm.start, cid)  # CNI ADD: not ambient, starts unmeshed
        netns, ip = await asyncio.to_thread(pm.netns_and_ip, cid, network)
        assert agent.enrollment.pods() == {}
        assert "ISTIO" not in in_netns(netns, "iptables-save")

        started = time.monotonic()
        write_yaml(cluster / "namespaces.yaml", {"apiVersion": "v1", "kind": "Namespace",
                                                 "metadata": {"name": "shop",
                                                              "labels": AMBIENT}})
        await eventually(lambda: agent.status(cid) == "enabled", timeout=2.0)
        print(f"label -> podman container enrolled: {(time.monotonic() - started) * 1000:.0f} ms")
        rec = agent.enrollment.pods()[cid]
        assert (rec.name, rec.namespace, rec.netns, rec.ips) == ("cart", "shop", netns, [ip])
        assert agent.ztunnel.adds[cid] == os.stat(netns).st_ino
        assert "-A PREROUTING -j ISTIO_PRERT" in in_netns(netns, "iptables-save")
        assert (agent.source.store.pod_by_uid(cid)["metadata"]["annotations"]
                ["ambient.istio.io/redirection"]) == "enabled"

        write_yaml(cluster / "namespaces.yaml",
                   {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}})
        await eventually(lambda: cid not in agent.enrollment.pods(), timeout=2.0)
        await eventually(lambda: not agent.enrollment.live.busy())
        assert "ISTIO" not in in_netns(netns, "iptables-save")
    finally:
        await agent.stop()

    # a new agent knows nothing of the sandbox: the Pod object now carries the IP, and
    # the netns is found through /proc (the container's libpod cgroup names its ID)
    pod["status"] = {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}
    write_yaml(cluster / "cart.yaml", pod)
    agent = await Agent(tmp_path, host_netns).start()
    try:
        await eventually(lambda: not agent.enrollment.live.busy())
        assert agent.enrollment.pods() == {}
        write_yaml(cluster / "namespaces.yaml", {"apiVersion": "v1", "kind": "Namespace",
                                                 "metadata": {"name": "shop",
                                                              "labels": AMBIENT}})
        await eventually(lambda: agent.status(cid) == "enabled", timeout=2.0)
        rec = agent.enrollment.pods()[cid]
        assert rec.netns.startswith("/proc/") and rec.netns.endswith("/ns/net")
        assert os.stat(rec.netns).st_ino == os.stat(netns).st_ino
        assert "-A PREROUTING -j ISTIO_PRERT" in in_netns(netns, "iptables-save")
        assert agent.enrollment.debug_state()["live"]["scans"] >= 1
        # the container goes away: its CNI DEL un-enrolls it
        await asyncio.to_thread(pm.remove, cid)
        containers.remove(cid)
        await eventually(lambda: cid not in agent.enrollment.pods(), timeout=10)
    finally:
        await agent.stop()
