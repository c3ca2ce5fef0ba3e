"""podman containers registered from their CNI ADD: no Pod YAML is written by anyone.

Rootful podman 4.3 (CNI backend, runc; private containers.conf) on a bridge network whose
conflist has istio-cni chained by our installer with ``ambient_default``; the agent's
real pieces (files config source on an empty directory, ``registration`` in ``local``
mode following podman's real event stream for labels, ambient index, CNI event server,
enrollment, ZDS server) with the fake ztunnel (agent.demo.fake_ztunnel,
from ztunnel's inpod protocol). Checked: the container's workload appears with the IP
podman gave it, the identity from its labels, HBONE and Ready; a restart moves it to the
new IP; an agent restart keeps it (state file); the container's removal (CNI DEL)
removes it.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess

import pytest
from pyroute2 import netns as pr_netns

from agent.demo import podman
from agent.core.config import load
from agent.core.lifecycle import AgentContext
from ambient import index as ambient_index
from ambient import source as ambient_source
from ambient import workload_pb2 as wl
from cni import registration, registration_record
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


class Agent:
    def __init__(self, root, host_netns, containers_conf):
        self.config = load({"state_dir": str(root / "state"), "config_file": os.devnull},
                           env={}).replace(
            config_dir=str(root / "cluster"), node_name="host-a",
            ztunnel_uds_address=str(root / "state" / "zds.sock"), ztunnel_wait=2.0,
            host_rules_netns=f"/var/run/netns/{host_netns}", ambient_ipv6=False,
            workload_registration="local", podman_containers_conf=str(containers_conf))

    async def start(self):
        self.ctx = AgentContext(self.config)
        self.source = self.ctx.add(ambient_source.build(self.ctx))
        self.registrar = self.ctx.add(registration.build(self.ctx, self.source))
        self.index = self.ctx.add(ambient_index.build(self.ctx, self.source.store))
        self.components = [self.source, self.registrar, self.index]
        self.zds = self.ctx.add(ZdsServer(self.config.ztunnel_uds_address, ztunnel_wait=2.0))
        self.enrollment = self.ctx.add(Enrollment(self.ctx, zds=ZdsServerChannel(self.zds),
                                                  source=self.source, registrar=self.registrar))
        self.events = self.ctx.add(CniEventServer(
            self.ctx, self.config.cni_event_socket, store=self.source.store,
            enrollment=self.enrollment, registrar=self.registrar))
        for c in self.components:
            await c.start()
        await self.zds.start()
        self.ztunnel = await asyncio.to_thread(
            FakeZtunnelThread(self.config.ztunnel_uds_address).start)
        await self.enrollment.start()
        await self.events.start()
        await asyncio.wait_for(self.registrar.label_source.started.wait(), 10)
        return self

    def workload(self, cid: str) -> wl.Workload | None:
        pod = self.source.store.pod_by_uid(cid)
        if pod is None:
            return None
        meta = pod["metadata"]
        addr = self.index.index.address(f"Kubernetes//Pod/{meta['namespace']}/{meta['name']}")
        return addr.workload if addr is not None and addr.HasField("workload") else None

    async def stop(self):
        self.ztunnel.close()
        await self.events.stop(1.0)
        await self.enrollment.stop(1.0)
        await self.zds.stop(0.5)
        for c in reversed(self.components):
            await c.stop(0.5)
        self.ctx.executor.shutdown(wait=False)


@pytest.fixture
def host(tmp_path):
    bin_dir, conf_dir = tmp_path / "bin", tmp_path / "net.d"
    for d in (conf_dir, tmp_path / "cluster", tmp_path / "state"):
        d.mkdir()
    conf = tmp_path / "containers.conf"
    podman.write_containers_conf(conf, [bin_dir, "/usr/lib/cni"], conf_dir)
    pm = podman.Podman(conf)
    bridge, network = unique("trbr"), unique("trnet")
    subnet = f"10.{secrets.randbelow(50) + 170}.{secrets.randbelow(250)}.0/24"
    (conf_dir / f"50-{network}.conflist").write_text(json.dumps({
        "cniVersion": "1.0.0", "name": network, "plugins": [
            {"type": "bridge", "bridge": bridge, "isGateway": True, "ipMasq": False,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": subnet}]],
                      "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(tmp_path / "ipam")}}]}))
    Installer(conf_dir=str(conf_dir), bin_dir=str(bin_dir), run_dir=str(tmp_path / "state"),
              ambient_default=True).install()
    image = f"localhost/ambient-reg-test:{secrets.token_hex(4)}"
    pm.import_busybox(image)
    host_netns = unique("trh")
    pr_netns.create(host_netns)
    containers: list[str] = []
    try:
        yield pm, conf, network, image, host_netns, containers
    finally:
        for c in containers:
            pm.remove(c)
        pm.run("rmi", "-f", image, check=False)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)
        pr_netns.remove(host_netns)


async def test_podman_container_registered_from_cni_follows_restarts(tmp_path, host):
    pm, conf, network, image, host_netns, containers = host
    agent = await Agent(tmp_path, host_netns, conf).start()
    name = unique("web")
    try:
        cid = await asyncio.to_thread(
            pm.create, name, network, image, "/bin/busybox", "sleep", "3600",
            labels={"app": "web", "version": "v2", registration_record.NAMESPACE_LABEL: "shop",
                    registration_record.SERVICE_ACCOUNT_LABEL: "web-sa"})
        containers.append(cid)
        await asyncio.to_thread(pm.start, cid)  # CNI ADD
        _netns, ip = await asyncio.to_thread(pm.netns_and_ip, cid, network)
        pod = agent.source.store.pod_by_uid(cid)
        assert pod is not None, "no Pod registered for the container"
        assert (pod["metadata"]["namespace"], pod["metadata"]["name"]) == ("shop", name)
        assert pod["spec"]["serviceAccountName"] == "web-sa"
        assert agent.source.store.origin_of(("Pod", "shop", name)) == registration.LOCAL_ORIGIN
        await eventually(lambda: agent.workload(cid) is not None, what="workload in the index")
        w = agent.workload(cid)
        assert [a for a in w.addresses] == [bytes(map(int, ip.split(".")))]
        assert (w.namespace, w.service_account, w.node, w.canonical_name,
                w.canonical_revision) == ("shop", "web-sa", "host-a", "web", "v2")
        assert w.status == wl.HEALTHY and w.tunnel_protocol == wl.HBONE
        assert agent.enrollment.pods()[cid].namespace == "shop"
        assert cid in agent.ztunnel.adds

        # container restart: DEL then ADD with the next address host-local hands out
        await asyncio.to_thread(pm.run, "restart", "-t", "0", cid)
        _netns2, ip2 = await asyncio.to_thread(pm.netns_and_ip, cid, network)
        assert ip2 != ip
        await eventually(lambda: agent.workload(cid) is not None and list(
            agent.workload(cid).addresses) == [bytes(map(int, ip2.split(".")))],
            what="workload on the new IP")
    finally:
        await agent.stop()

    saved = json.loads((tmp_path / "state" / registration_record.STATE_FILE).read_text())
    assert [r["ips"] for r in saved["registrations"]] == [[ip2]]
    # a restarted agent serves the workload again from its state file
    agent = await Agent(tmp_path, host_netns, conf).start()
    try:
        await eventually(lambda: agent.workload(cid) is not None, what="workload after restart")
        assert list(agent.workload(cid).addresses) == [bytes(map(int, ip2.split(".")))]
        await asyncio.to_thread(pm.remove, cid)  # CNI DEL
        containers.remove(cid)
        await eventually(lambda: agent.source.store.pod_by_uid(cid) is None,
                         what="workload gone after the DEL")
        assert json.loads((tmp_path / "state" / registration_record.STATE_FILE).read_text()) == {
            "registrations": []}
    finally:
        await agent.stop()


def in_netns(netns_path: str, *argv: str) -> str:
    return subprocess.run(["nsenter", f"--net={netns_path}", *argv], capture_output=True,
                          text=True, check=True).stdout


def assert_meshed_at_start(agent, pm, cid, network, namespace):
    """Right after ``podman start`` returned (the CNI ADD is answered before the
    container's process runs): enrolled under its labels' namespace, rules in its netns.
    Read at once, not eventually: a later fix-up is the fail-open being tested."""
    rec = agent.enrollment.pods().get(cid)
    assert rec is not None, "container started without being enrolled"
    assert rec.namespace == namespace
    pod = agent.source.store.pod_by_uid(cid)
    assert pod is not None and pod["metadata"]["namespace"] == namespace
    netns, _ip = pm.netns_and_ip(cid, network)
    assert "-A PREROUTING -j ISTIO_PRERT" in in_netns(netns, "iptables-save")


async def test_container_created_while_agent_down_starts_meshed(tmp_path, host, caplog):
    """A newuser finding: agent down, ``podman create`` (ambient, namespace demo), agent
    up, ``podman start``: the ADD was decided "not ambient" under default/ and fixed up
    ~0.4 s later. Now the agent lists the existing containers' labels at start; a
    container whose labels it still lacks is held (code 11), never guessed about."""
    pm, conf, network, image, host_netns, containers = host
    labels = {"istio.io/dataplane-mode": "ambient", registration_record.NAMESPACE_LABEL: "demo"}
    early, late = unique("early"), unique("late")
    cid = await asyncio.to_thread(pm.create, early, network, image, "/bin/busybox", "sleep",
                                  "3600", labels=labels)
    containers.append(cid)
    cid2 = await asyncio.to_thread(pm.create, late, network, image, "/bin/busybox", "sleep",
                                   "3600", labels=labels)
    containers.append(cid2)
    agent = await Agent(tmp_path, host_netns, conf).start()
    try:
        src = agent.registrar.label_source
        await eventually(lambda: src.stats["listed"] >= 2, what="existing containers listed")
        await asyncio.to_thread(pm.start, cid)
        await asyncio.to_thread(assert_meshed_at_start, agent, pm, cid, network, "demo")

        # one whose labels the agent lacks (as if podman ps had not answered): held
        src._labels.pop(cid2)
        with pytest.raises(podman.PodmanError) as e:
            await asyncio.to_thread(pm.start, cid2)
        assert "(status 503)" in str(e.value) and "not read from the runtime yet" in str(
            e.value), e.value
        # the plugin's own line, forwarded to the agent's log: CNI "try again later"
        await eventually(lambda: any("ADD failed (code 11)" in r.getMessage()
                                     for r in caplog.records), what="plugin's code 11")
        assert agent.enrollment.pods().get(cid2) is None
        assert agent.source.store.pod_by_uid(cid2) is None
        assert agent.registrar.stats["held"] == 1
        # the agent read them once the failed start let go of the container: next start
        await eventually(lambda: cid2 in src._labels, what="labels read after the hold")
        await asyncio.to_thread(pm.start, cid2)
        await asyncio.to_thread(assert_meshed_at_start, agent, pm, cid2, network, "demo")
    finally:
        await agent.stop()
