"""API load per node of the kubernetes config source (issue 14), against a real
kube-apiserver (scripts/kube-test-apiserver.sh; needs root and Go, skipped otherwise).

The cluster: 5,000 pods in 50 namespaces on 100 nodes (50 pods per node), 500 Services
(10 pods each) with the EndpointSlice the controller would write for each, played by the
benchmark (create, then the kubelet's status with IP and readiness). One agent
(ambient.source_kube.KubernetesSource, as the DaemonSet's ServiceAccount) syncs every kind
it reads, cluster-wide — what serving the cluster-wide address set over workload xDS needs.
Then 500 pods flip readiness (5 on each node), then each Service's EndpointSlice is
updated once (the endpointslice controller's job, played too).

Figures (report only; "floor" = what a node-narrowed agent would get: its own node's pods
by ``fieldSelector=spec.nodeName`` plus namespaces, as istio-cni watches when istiod serves
ztunnel — measured in the same run with the same server):
- objects and bytes of the initial LIST, one agent;
- bytes watched per 1,000 pod changes, one agent;
- the API server's watch egress for the whole fleet (100 agents) per 1,000 pod changes
  (one agent's figure x nodes: every agent receives every change);
- time to the first full sync of one agent.
Bytes are HTTP body bytes in JSON (the source does not ask for protobuf).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import time
from typing import Awaitable, Callable

from agent.core import kubecall
from ambient.source_kube import RESOURCES, KubernetesSource
from ambient.store import ObjectStore
from benchmarks.common import Result
from tests.kube import cluster as kc

PODS, NAMESPACES, NODES, SERVICES_PER_NS, CHANGES = 5000, 50, 100, 10, 500
PODS_PER_NS = PODS // NAMESPACES
CONCURRENCY = 24
MIB = 1024 * 1024


def _available() -> str:
    if os.geteuid() != 0:
        return "needs root"
    if not (shutil.which("go") or os.access("/usr/local/go/bin/go", os.X_OK)):
        return "needs Go"
    return ""


def pod_body(ns: str, i: int, node: str) -> dict:
    """A Deployment-like pod: labels, owner, resources, probe, env (a few KB once the API
    server added defaults, the service-account volume and managedFields)."""
    app = f"app{i % SERVICES_PER_NS}"
    body = kc.pod_manifest(f"{app}-{i:05d}", ns, node, labels={
        "app": app, "version": "v1", "pod-template-hash": "5d8f7c9b6f"},
        annotations={"kubectl.kubernetes.io/default-container": "app"},
        ports=[{"name": "http", "containerPort": 8080, "protocol": "TCP"}])
    c = body["spec"]["containers"][0]
    c["resources"] = {"requests": {"cpu": "100m", "memory": "128Mi"},
                      "limits": {"memory": "256Mi"}}
    c["readinessProbe"] = {"httpGet": {"path": "/ready", "port": 8080}, "periodSeconds": 5}
    c["env"] = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "LOG_LEVEL", "value": "info"}]
    body["metadata"]["ownerReferences"] = [{
        "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": f"{app}-5d8f7c9b6f",
        "uid": "00000000-0000-0000-0000-000000000001", "controller": True}]
    return body


def pod_ip(n: int, i: int) -> str:
    k = n * PODS_PER_NS + i
    return f"10.{128 + k // 65536}.{(k // 256) % 256}.{k % 256}"


async def _gather_limited(coros, limit: int = CONCURRENCY) -> None:
    sem = asyncio.Semaphore(limit)

    async def one(c):
        async with sem:
            await c
    await asyncio.gather(*(one(c) for c in coros))


def slice_body(ns: str, svc: int, pods: list[tuple[str, str]], ready: dict[str, bool]) -> dict:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": f"svc{svc}-abcde", "namespace": ns, "labels": {
                "kubernetes.io/service-name": f"svc{svc}",
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [ip], "conditions": {"ready": ready.get(name, True)},
                           "targetRef": {"kind": "Pod", "namespace": ns, "name": name}}
                          for name, ip in pods],
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]}


async def populate(api) -> dict[tuple[str, int], list[tuple[str, str]]]:
    """Create the cluster; returns (namespace, service) -> [(pod name, ip)]."""
    await _gather_limited(kc.create_node(api, f"node-{n:03d}", ip=f"127.1.{n // 250}.{n % 250}")
                          for n in range(NODES))
    await _gather_limited(kc.create_namespace(api, f"bench{n:02d}", labels={
        "istio.io/dataplane-mode": "ambient"}) for n in range(NAMESPACES))
    members: dict[tuple[str, int], list[tuple[str, str]]] = {}

    async def one_pod(n: int, i: int) -> None:
        ns, node = f"bench{n:02d}", f"node-{(n * PODS_PER_NS + i) % NODES:03d}"
        body = pod_body(ns, i, node)
        await kc.request(api, "POST", f"/api/v1/namespaces/{ns}/pods", body=body)
        await kc.set_pod_status(api, ns, body["metadata"]["name"], ips=[pod_ip(n, i)])
        members.setdefault((ns, i % SERVICES_PER_NS), []).append(
            (body["metadata"]["name"], pod_ip(n, i)))

    await _gather_limited(one_pod(n, i) for n in range(NAMESPACES) for i in range(PODS_PER_NS))

    async def one_service(ns: str, s: int) -> None:
        await kc.request(api, "POST", f"/api/v1/namespaces/{ns}/services", body={
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": f"svc{s}"},
            "spec": {"selector": {"app": f"app{s}"},
                     "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}})
        await kc.apply(api, slice_body(ns, s, sorted(members[(ns, s)]), {}))

    await _gather_limited(one_service(f"bench{n:02d}", s) for n in range(NAMESPACES)
                          for s in range(SERVICES_PER_NS))
    return members


class NarrowWatch:
    """What a node-narrowed agent reads: pods of one node (fieldSelector) + namespaces,
    counted in HTTP body bytes; raw requests through the ApiClient."""

    def __init__(self, api, node: str):
        self.api, self.node = api, node
        self.listed_objects = self.listed_bytes = self.watch_bytes = self.events = 0
        self._tasks: list[asyncio.Task] = []

    def _query(self, path: str) -> list[tuple[str, str]]:
        return [("fieldSelector", f"spec.nodeName={self.node}")] if path.endswith("/pods") else []

    async def start(self) -> None:
        for path in ("/api/v1/pods", "/api/v1/namespaces"):
            data = await kubecall.read(self.api, "GET", path, query=self._query(path),
                                       timeout=None)
            body = json.loads(data)
            self.listed_objects += len(body["items"])
            self.listed_bytes += len(data)
            self._tasks.append(asyncio.create_task(
                self._watch(path, body["metadata"]["resourceVersion"])))

    async def _watch(self, path: str, rv: str) -> None:
        query = self._query(path) + [("watch", "true"), ("resourceVersion", rv),
                                     ("allowWatchBookmarks", "true")]
        async with kubecall.stream(self.api, path, query=query, timeout=None) as resp:
            async for line in resp.content:
                self.watch_bytes += len(line)
                if b'"BOOKMARK"' not in line[:30]:
                    self.events += 1

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def measure(cluster: kc.KubeCluster, workdir: str) -> list[Result]:
    api = await cluster.admin_client()
    try:
        await kc.apply_crds(api)
        await kc.create_namespace(api, kc.AGENT_NAMESPACE)
        await kc.apply_manifest(api, "rbac.yaml")
        t0 = time.monotonic()
        members = await populate(api)
        populate_s = time.monotonic() - t0
        kubeconfig = await kc.agent_kubeconfig(cluster, api, f"{workdir}/agent.kubeconfig")
        agent_api = await kc.client_from_kubeconfig(kubeconfig)
        narrow = NarrowWatch(agent_api, "node-000")
        src = KubernetesSource(ObjectStore(), kubeconfig, sync_timeout=120)
        try:
            t0 = time.monotonic()
            await src.start()
            sync_s = time.monotonic() - t0
            if not src.is_synced():
                raise RuntimeError(f"agent not synced: {src.errors}")
            await narrow.start()
            listed_objects = sum(s.listed_objects for s in src.stats.values())
            listed_bytes = sum(s.listed_bytes for s in src.stats.values())
            pod_bytes = src.stats["Pod"].listed_bytes / max(1, src.stats["Pod"].listed_objects)
            before = {k: (s.watch_bytes, s.watch_events) for k, s in src.stats.items()}
            narrow_before = narrow.watch_bytes
            # churn: CHANGES pods turn unready (as many on every node), with their slices
            ready: dict[str, bool] = {}
            flipped = []
            for n in range(NAMESPACES):
                for i in range(PODS_PER_NS):
                    k = n * PODS_PER_NS + i  # on node k % NODES
                    if k % 10 == (k // NODES) % 10 and len(flipped) < CHANGES:
                        name = pod_body("", i, "")["metadata"]["name"]
                        flipped.append((f"bench{n:02d}", i % SERVICES_PER_NS, name))
                        ready[name] = False
            ips = {name: ip for pods in members.values() for name, ip in pods}
            await _gather_limited(kc.set_pod_status(api, ns, name, ips=[ips[name]], ready=False)
                                  for ns, _, name in flipped)
            await _gather_limited(kc.apply(api, slice_body(ns, svc, sorted(members[(ns, svc)]),
                                                           ready))
                                  for ns, svc in sorted({(ns, svc) for ns, svc, _ in flipped}))
            want_pods = before["Pod"][1] + len(flipped)
            deadline = time.monotonic() + 120
            while src.stats["Pod"].watch_events < want_pods and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            await asyncio.sleep(2.0)  # the narrowed watch's last events
            watched = sum(s.watch_bytes - before[k][0] for k, s in src.stats.items())
            narrow_watched = narrow.watch_bytes - narrow_before
            on_node = sum(1 for ns, _, name in flipped
                          if src.store.get("Pod", ns, name)["spec"]["nodeName"] == "node-000")
            if src.stats["Pod"].watch_events < want_pods:
                raise RuntimeError(f"agent saw {src.stats['Pod'].watch_events - before['Pod'][1]}"
                                   f" of {len(flipped)} pod changes")
        finally:
            await narrow.stop()
            await src.stop()
            await agent_api.close()
    finally:
        await api.close()
    per_k = 1000 / len(flipped)
    note = (f"{PODS} pods/{NAMESPACES} ns/{NODES} nodes/{NAMESPACES * SERVICES_PER_NS} services;"
            f" {pod_bytes / 1024:.1f} KiB per pod in JSON; floor = node-narrowed agent")
    return [
        Result("kube API load/node: initial LIST objects", listed_objects, "objects",
               narrow.listed_objects, note=note),
        Result("kube API load/node: initial LIST bytes", listed_bytes / MIB, "MiB",
               narrow.listed_bytes / MIB, note=f"{len(RESOURCES)} LIST + {len(RESOURCES)} WATCH"
               " requests per agent start"),
        Result("kube API load/node: watch bytes per 1000 pod changes", watched * per_k / MIB,
               "MiB", narrow_watched * per_k / MIB,
               note=f"{len(flipped)} readiness flips + their EndpointSlices, {on_node} on the "
                    "agent's node"),
        Result(f"kube API egress, {NODES} agents, per 1000 pod changes",
               watched * per_k * NODES / MIB, "MiB", narrow_watched * per_k * NODES / MIB,
               note="one agent's watch bytes x nodes"),
        Result("kube API load/node: first full sync", sync_s, "s", None,
               note=f"cluster populated in {populate_s:.0f}s"),
    ]


async def on_private_api_server(prefix: str, measure: Callable[[kc.KubeCluster, str],
                                                               Awaitable[list[Result]]]
                                ) -> list[Result]:
    """Build (cached) and start a private kube-apiserver + etcd under a new temporary
    directory (``prefix``), run ``measure(cluster, workdir)`` and always stop the server
    and remove the directory, also when ``measure`` raises."""
    subprocess.run(["bash", kc.SCRIPT, "build"], check=True, stdout=subprocess.DEVNULL)
    workdir = tempfile.mkdtemp(prefix=prefix)
    directory = os.path.join(workdir, "server")
    env = dict(os.environ, KUBE_TEST_OWNER_PID=str(os.getpid()))
    subprocess.run(["bash", kc.SCRIPT, "start", directory], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    try:
        return await measure(kc.KubeCluster(directory), workdir)
    finally:
        subprocess.run(["bash", kc.SCRIPT, "stop", directory], stdout=subprocess.DEVNULL)
        shutil.rmtree(workdir, ignore_errors=True)


async def run() -> list[Result]:
    why = _available()
    if why:
        return [Result("kube API load/node: initial LIST bytes", float("nan"), "MiB",
                       note=f"skipped: {why}")]
    return await on_private_api_server("bench-kube-", measure)
