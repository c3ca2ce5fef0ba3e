"""Workload xDS change latency with the real API server (issue 19; needs root and Go).

An API write to a ztunnel-like client holding it: a pod's labels are PATCHed on a real
kube-apiserver (scripts/kube-test-apiserver.sh); the agent's Kubernetes source
(``ambient.source_kube.KubernetesSource``, authenticated as the DaemonSet's
ServiceAccount with the shipped RBAC) sees the watch event, the store and the ambient
index apply it, the xDS server (the agent's default push debounce, 0.1 s) pushes it, and
the reference delta client (``ambient.xds.client.DeltaXdsClient``, wildcard, as ztunnel)
holds it. Timed from just before the PATCH to the client holding pod0's workload in its
new service; the label flips between ``app0`` and ``app1`` (two services), 40 changes
after 4 warm-up ones.

The cluster is :func:`benchmarks.bench_index.generate`'s shape, made through the API:
per namespace 100 pods (kubelet's status with IP and readiness played by the benchmark),
10 Services (10 %) and 5 AuthorizationPolicies (5 %). First 1,000 pods (10 namespaces)
are made and measured; then 9,000 more (90 namespaces) and the same is measured at
10,000 with a fresh agent; each size with the agent's xDS debounce and with none (the
work itself). Floors: at 1k, the xDS debounce (reported); at 10k the same figure at 1k,
target ratio <= 1.3 (the cost is per change, not per cluster); with no debounce only the
p50 is judged: a p99 of a few ms is the shared machine's scheduling noise (reported).
"""

from __future__ import annotations

import functools
import time

from ambient.index import AmbientIndex
from ambient.objects import Mesh
from ambient.source_kube import KubernetesSource
from ambient.store import ObjectStore
from ambient.xds.client import DeltaXdsClient
from ambient.xds.server import XdsServer
from benchmarks.bench_kube import _available, _gather_limited, on_private_api_server
from benchmarks.bench_xds_change import XDS_DEBOUNCE, XDS_DEBOUNCE_MAX, _holds
from benchmarks.common import Result, percentile, ratio_result
from tests.kube import cluster as kc

PODS_PER_NS, SVCS_PER_NS, POLICIES_PER_NS = 100, 10, 5
NODES = 10
SAMPLES, WARMUP = 40, 4
POD = "Kubernetes//Pod/x00/pod0"


def _ip(k: int) -> str:
    return f"10.{100 + k // 65536}.{(k // 256) % 256}.{k % 256}"


async def populate(api, namespaces: range) -> None:
    """Namespaces ``x<n>`` with their services, policies and running pods."""
    for n in namespaces:
        await kc.create_namespace(api, f"x{n:02d}", labels={"istio.io/dataplane-mode": "ambient"})

    async def one_ns(n: int) -> None:
        ns = f"x{n:02d}"
        for s in range(SVCS_PER_NS):
            await kc.request(api, "POST", f"/api/v1/namespaces/{ns}/services", body={
                "apiVersion": "v1", "kind": "Service", "metadata": {"name": f"svc{s}"},
                "spec": {"selector": {"app": f"app{s}"},
                         "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}})
        for p in range(POLICIES_PER_NS):
            await kc.apply(api, {
                "apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
                "metadata": {"name": f"allow{p}", "namespace": ns},
                "spec": {"selector": {"matchLabels": {"app": f"app{p}"}},
                         "rules": [{"from": [{"source": {"principals": [
                             f"cluster.local/ns/{ns}/sa/client"]}}]}]}})

    async def one_pod(n: int, p: int) -> None:
        ns, k = f"x{n:02d}", n * PODS_PER_NS + p
        await kc.run_pod(api, f"pod{p}", ns, f"node-{k % NODES}", ips=[_ip(k)],
                         labels={"app": f"app{p % SVCS_PER_NS}"},
                         ports=[{"name": "http", "containerPort": 8080}])

    await _gather_limited(one_ns(n) for n in namespaces)
    await _gather_limited(one_pod(n, p) for n in namespaces for p in range(PODS_PER_NS))


async def latency(cluster: kc.KubeCluster, api, workdir: str, pods: int,
                  debounce: float = XDS_DEBOUNCE) -> list[float]:
    """Seconds from a label PATCH to the client holding it, :data:`SAMPLES` times."""
    kubeconfig = await kc.agent_kubeconfig(cluster, api, f"{workdir}/agent-{pods}.kubeconfig")
    store = ObjectStore()
    source = KubernetesSource(store, kubeconfig, sync_timeout=300)
    await source.start()
    if not source.is_synced():
        raise RuntimeError(f"agent not synced: {source.errors}")
    index = AmbientIndex(store, Mesh())
    index.start()
    server = XdsServer(index, port=0, debounce=debounce, debounce_max=XDS_DEBOUNCE_MAX)
    await server.start()
    client = DeltaXdsClient(f"127.0.0.1:{server.port}")
    try:
        await client.connect()
        await client.wait_synced(timeout=120)
        await client.wait_for(POD, timeout=60)
        held = len(client.resources())
        if held < pods:
            raise RuntimeError(f"client holds {held} addresses, expected >= {pods}")
        out = []
        for i in range(SAMPLES + WARMUP):
            app, want = ("app1", "svc1") if i % 2 == 0 else ("app0", "svc0")
            t0 = time.perf_counter()
            await kc.request(api, "PATCH", "/api/v1/namespaces/x00/pods/pod0",
                             body={"metadata": {"labels": {"app": app}}},
                             content_type="application/merge-patch+json")
            await client.wait(functools.partial(_holds, client, want, POD), timeout=30)
            out.append(time.perf_counter() - t0)
        return out[WARMUP:]
    finally:
        await client.close()
        await server.stop(0.5)
        index.stop()
        await source.stop()


async def measure(cluster: kc.KubeCluster, workdir: str) -> list[Result]:
    api = await cluster.admin_client()
    try:
        await kc.apply_crds(api)
        await kc.create_namespace(api, kc.AGENT_NAMESPACE)
        await kc.apply_manifest(api, "rbac.yaml")
        await _gather_limited(kc.create_node(api, f"node-{n}", ip=f"127.2.0.{n + 1}")
                              for n in range(NODES))
        await populate(api, range(10))
        small = {d: await latency(cluster, api, workdir, 1_000, d) for d in (XDS_DEBOUNCE, 0.0)}
        await populate(api, range(10, 100))
        large = {d: await latency(cluster, api, workdir, 10_000, d) for d in (XDS_DEBOUNCE, 0.0)}
    finally:
        await api.close()
    ms = 1e3
    results = []
    for d in (XDS_DEBOUNCE, 0.0):
        label = "agent debounce" if d else "debounce 0"
        note = (f"label PATCH -> kube-apiserver -> watch -> store -> index -> xDS -> "
                f"reference client; {SAMPLES} changes, xDS debounce {d * 1e3:g} ms")
        for p in (50, 99):
            s, lg = percentile(small[d], p) * ms, percentile(large[d], p) * ms
            results.append(Result(f"xds change via API server ({label}), p{p} at 1k", s, "ms",
                                  d * 1e3 or None, "report", None,
                                  note + ("; floor: the xDS debounce (waited by design)"
                                          if d else "")))
            judged = d or p == 50  # debounce 0, p99: a few ms of scheduler noise; reported
            results.append((ratio_result if judged else _reported)(
                f"xds change via API server ({label}), p{p} at 10k", lg, s, "ms", 1.3,
                "floor: the same figure at 1k pods"))
    return results


def _reported(figure, value, floor, unit, _max_ratio, note) -> Result:
    return Result(figure, value, unit, floor, "report", None, note)


async def run() -> list[Result]:
    why = _available()
    if why:
        return [Result("xds change via API server", float("nan"), "ms",
                       note=f"skipped: {why}")]
    return await on_private_api_server("bench-kube-xds-", measure)
