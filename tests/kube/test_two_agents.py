"""Two agents on two nodes against one real kube-apiserver, each with its own token of the
DaemonSet's ServiceAccount: both hold the same cluster-wide address set (every pod and
service, as the workload xDS they serve needs), and each finds only its own node's pods
among them (``AmbientIndex.node_workloads``; enrollment's live-pod check filters on the same
``spec.nodeName``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from ambient.index import AmbientIndex
from ambient.objects import Mesh
from ambient.source_kube import KubernetesSource
from ambient.store import ObjectStore
from tests.helpers import eventually
from tests.kube import cluster as kc


class Agent:
    def __init__(self, kubeconfig: str):
        self.store = ObjectStore()
        self.source = KubernetesSource(self.store, kubeconfig, sync_timeout=20)
        self.index = AmbientIndex(self.store, Mesh(cluster_id="Kubernetes"), CollectorRegistry())

    async def start(self) -> None:
        self.index.start()
        await self.source.start()

    async def stop(self) -> None:
        await self.source.stop()
        self.index.stop()

    def addresses(self, namespace: str) -> dict[str, bytes]:
        """This namespace's Address resources, name -> deterministic bytes."""
        return {name: a.SerializeToString(deterministic=True)
                for name, a in self.index.addresses().items() if f"/{namespace}/" in name
                or name.startswith(f"{namespace}/")}


async def test_two_agents_same_address_set_own_node_pods(kube_cluster, kube_admin, kube_namespace,
                                                         tmp_path):
    nodes = [kc.unique("node-a"), kc.unique("node-b")]
    for i, node in enumerate(nodes):
        await kc.create_node(kube_admin, node, ip=f"127.0.0.{10 + i}")
    agents = []
    try:
        for i in range(2):  # each DaemonSet pod has its own token of the same ServiceAccount
            kubeconfig = await kc.agent_kubeconfig(kube_cluster, kube_admin,
                                                   str(tmp_path / f"agent{i}.kubeconfig"))
            agents.append(Agent(kubeconfig))
        for agent in agents:
            await agent.start()
            assert agent.source.is_synced() and not agent.source.errors
        await kc.apply(kube_admin, {
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "web", "namespace": kube_namespace},
            "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80,
                                                            "targetPort": 8080}]}})
        pods = {}
        for i in range(6):
            node = nodes[i % 2]
            name = f"web-{i}"
            pod = await kc.run_pod(kube_admin, name, kube_namespace, node,
                                   [f"10.251.{i % 2}.{i + 1}"], labels={"app": "web"})
            pods[name] = (node, pod["metadata"]["uid"])

        def workload_names(agent: Agent) -> set[str]:
            return {n for n in agent.index.addresses() if kube_namespace in n and "/Pod/" in n}

        await eventually(lambda: all(len(workload_names(a)) == 6 for a in agents), timeout=30,
                         what="six workloads in both agents")
        await eventually(lambda: agents[0].addresses(kube_namespace) ==
                         agents[1].addresses(kube_namespace), timeout=30,
                         what="identical address sets")
        service = [n for n in agents[0].index.addresses()
                   if n.endswith(f"/web.{kube_namespace}.svc.cluster.local")]
        assert service, sorted(agents[0].index.addresses())
        for agent, node in zip(agents, nodes):
            own = agent.index.node_workloads(node)
            want = {n for n in workload_names(agent)
                    if any(n.endswith(f"/Pod/{kube_namespace}/{name}")
                           for name, (pn, _) in pods.items() if pn == node)}
            assert own == want and len(own) == 3, (node, own)
            other = nodes[1 - nodes.index(node)]
            assert own.isdisjoint(agent.index.node_workloads(other))
        # a change on node B reaches agent A too (same cluster-wide set)
        await kc.delete_pod(kube_admin, kube_namespace, "web-1")
        await eventually(lambda: all(len(workload_names(a)) == 5 for a in agents), timeout=30)
        assert agents[0].addresses(kube_namespace) == agents[1].addresses(kube_namespace)
    finally:
        for agent in agents:
            await agent.stop()
        for node in nodes:
            await kc.delete_node(kube_admin, node)
