"""Two hosts without Kubernetes sharing workloads through a real kube-apiserver used as a
store only (no kubelets): each host's agent (kubernetes config source + ambient index +
``registration`` in ``workloadentry`` mode, authenticated as the agent's ServiceAccount
with deploy/kubernetes/rbac.yaml + deploy/registration/rbac-registration.yaml) registers the pods its CNI
ADDs create as WorkloadEntries, and both indexes serve both hosts' workloads. A DEL
removes the entry at once; a container restart (new IP) updates it in place; an agent
restart keeps its entries; a host that is gone (its Lease not renewed) has its entries
removed by the other after the grace period."""

from __future__ import annotations

import os

from agent.core.config import load
from agent.core.lifecycle import AgentContext
from ambient import index as ambient_index
from ambient import source as ambient_source
from ambient import workload_pb2 as wl
from cni import registration
from cni.events import CniPodEvent
from cni.registration_kube import entry_name
from tests.helpers import eventually
from tests.kube import cluster as kc

GRACE = 1.0


class Host:
    """One host's agent: the components a ``run`` with these settings builds."""

    def __init__(self, tmp_path, node: str, kubeconfig: str, namespace: str):
        self.node = node
        self.config = load({"state_dir": str(tmp_path / node), "config_file": os.devnull},
                           env={}).replace(
            config_source="kubernetes", kubeconfig=kubeconfig, node_name=node,
            workload_registration="workloadentry", registration_runtime="none",
            registration_namespace=namespace, registration_grace=GRACE)

    async def start(self) -> "Host":
        self.ctx = AgentContext(self.config)
        self.source = self.ctx.add(ambient_source.build(self.ctx))
        self.registrar = self.ctx.add(registration.build(self.ctx, self.source))
        self.index = self.ctx.add(ambient_index.build(self.ctx, self.source.store))
        self.components = [self.source, self.registrar, self.index]
        for c in self.components:
            await c.start()
        return self

    async def stop(self) -> None:
        for c in reversed(self.components):
            await c.stop(0.5)
        self.ctx.executor.shutdown(wait=False)

    async def add(self, cid: str, name: str, ip: str, labels: dict | None = None):
        """What the event server does for an ambient pod's CNI ADD."""
        event = CniPodEvent(command="ADD", container_id=cid, netns="", pod_name=name,
                            ips=[ip], ambient_default=True)
        reg = await self.registrar.prepare(event)
        reg.labels.update(labels or {})
        await self.registrar.commit(reg, ambient=True)
        return reg

    def workloads(self, namespace: str) -> dict[str, wl.Workload]:
        return {a.workload.name: a.workload for a in self.index.index.addresses().values()
                if a.HasField("workload") and a.workload.namespace == namespace}


def ip4(w: wl.Workload) -> list[str]:
    return [".".join(str(b) for b in a) for a in w.addresses]


async def test_two_hosts_share_workload_entries(kube_cluster, kube_admin, kube_namespace,
                                                tmp_path):
    await kc.apply_manifest(kube_admin, kc.REGISTRATION_RBAC)
    kubeconfig = await kc.agent_kubeconfig(kube_cluster, kube_admin,
                                           str(tmp_path / "agent.kubeconfig"))
    a_node, b_node = kc.unique("host-a"), kc.unique("host-b")
    a = await Host(tmp_path, a_node, kubeconfig, kube_namespace).start()
    b = await Host(tmp_path, b_node, kubeconfig, kube_namespace).start()
    hosts = [a, b]
    try:
        web = await a.add("c" * 64, "web", "10.240.1.2", {"app": "web"})
        await b.add("d" * 64, "db", "10.240.2.2", {"app": "db"})

        def both_see(name: str, ip: str):
            return all(name in h.workloads(kube_namespace) and
                       ip4(h.workloads(kube_namespace)[name]) == [ip] for h in hosts)

        await eventually(lambda: both_see(entry_name(web), "10.240.1.2")
                         and both_see(f"db-{b_node}", "10.240.2.2"), timeout=15,
                         what="both hosts' workloads in both indexes")
        w = b.workloads(kube_namespace)[entry_name(web)]
        assert w.tunnel_protocol == wl.HBONE and w.status == wl.HEALTHY
        assert (w.service_account, w.canonical_name) == ("default", "web")
        we = await kc.request(kube_admin, "GET", f"/apis/networking.istio.io/v1/namespaces/"
                                                 f"{kube_namespace}/workloadentries/"
                                                 f"{entry_name(web)}")
        assert we["metadata"]["annotations"]["istio.io/workloadController"] == a_node
        assert "istio.io/connectedAt" in we["metadata"]["annotations"]

        # container restart on host A: DEL then ADD with a new IP, same entry updated
        await a.registrar.remove("c" * 64)
        await eventually(lambda: all(entry_name(web) not in h.workloads(kube_namespace)
                                     for h in hosts), timeout=10, what="DEL removes the entry")
        await a.add("c" * 64, "web", "10.240.1.3", {"app": "web"})
        await eventually(lambda: both_see(entry_name(web), "10.240.1.3"), timeout=10,
                         what="the new IP on both hosts")

        # agent restart on host B keeps its entry (state file), nothing duplicated
        await b.stop()
        hosts.remove(b)
        b = await Host(tmp_path, b_node, kubeconfig, kube_namespace).start()
        hosts.append(b)
        assert b.registrar.stats["restored"] == 1
        await eventually(lambda: both_see(f"db-{b_node}", "10.240.2.2"), timeout=10,
                         what="host B's entry after its agent restarted")
        assert len(b.workloads(kube_namespace)) == 2

        # host B goes away for good: host A removes its entries after the grace period
        await b.stop()
        hosts.remove(b)
        await eventually(lambda: f"db-{b_node}" not in a.workloads(kube_namespace),
                         timeout=6 * GRACE + 10, what="host B's entry cleaned up")
        assert entry_name(web) in a.workloads(kube_namespace)
        assert a.registrar.backend.stats["cleaned"] >= 1
    finally:
        for h in hosts:
            await h.stop()
