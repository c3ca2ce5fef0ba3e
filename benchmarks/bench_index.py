"""Ambient index benchmarks (issue 8).

Figures, each next to a floor measured in the same run:
- full index build for a generated cluster of 10k pods, 1k services, 500 AuthorizationPolicies
  (100 namespaces; each pod selected by one service and one policy): wall time. Floor:
  protobuf alone building and serializing one Workload per pod and one Service per service
  (the output the index must produce anyway). Report only.
- RSS growth of that build (store + index), in MiB. Floor: the RSS growth of holding the
  input objects alone (the store). Report only.
- recompute after one pod changes (a label flip that changes its services and policies),
  median over repeated changes, at 1k pods (10 namespaces, same per-namespace density) and
  at 10k pods. The 1k figure is the floor of the 10k one: target ratio <= 1.3, i.e. the cost
  is per change, not per cluster.
"""

from __future__ import annotations

import copy
import gc
import ipaddress
import statistics
import time

import psutil

from ambient import workload_pb2 as wl
from ambient.index import AmbientIndex
from ambient.objects import Mesh
from ambient.store import ObjectStore
from benchmarks.common import Result, ratio_result

PODS_PER_NS, SVCS_PER_NS, POLICIES_PER_NS = 100, 10, 5


def generate(pods: int) -> list[dict]:
    """Namespaces, pods, services and policies at a fixed per-namespace density."""
    namespaces = max(1, pods // PODS_PER_NS)
    objs: list[dict] = []
    base = int(ipaddress.ip_address("10.0.0.0"))
    for n in range(namespaces):
        ns = f"ns{n}"
        objs.append({"kind": "Namespace", "metadata": {"name": ns, "labels": {
            "istio.io/dataplane-mode": "ambient"}}})
        for s in range(SVCS_PER_NS):
            objs.append({"kind": "Service", "metadata": {"name": f"svc{s}", "namespace": ns},
                         "spec": {"clusterIP": str(ipaddress.ip_address(
                             int(ipaddress.ip_address("10.96.0.0")) + n * SVCS_PER_NS + s)),
                                  "selector": {"app": f"app{s}"},
                                  "ports": [{"name": "http", "port": 80, "targetPort": "http"},
                                            {"name": "grpc", "port": 9090}]}})
        for p in range(POLICIES_PER_NS):
            objs.append({"kind": "AuthorizationPolicy",
                         "metadata": {"name": f"allow{p}", "namespace": ns},
                         "spec": {"selector": {"matchLabels": {"app": f"app{p}"}},
                                  "rules": [{"from": [{"source": {"principals": [
                                      f"cluster.local/ns/{ns}/sa/client"]}}],
                                             "to": [{"operation": {"ports": ["8080"]}}]}]}})
        for p in range(PODS_PER_NS):
            i = n * PODS_PER_NS + p
            objs.append({"kind": "Pod", "metadata": {
                "name": f"pod{p}", "namespace": ns, "uid": f"uid-{i}",
                "labels": {"app": f"app{p % SVCS_PER_NS}"}},
                "spec": {"nodeName": f"node{i % 50}", "serviceAccountName": "sa",
                         "containers": [{"name": "c", "ports": [
                             {"name": "http", "containerPort": 8080}]}]},
                "status": {"phase": "Running", "podIP": str(ipaddress.ip_address(base + i)),
                           "conditions": [{"type": "Ready", "status": "True"}]}})
    return objs


def build(objs: list[dict]) -> tuple[ObjectStore, AmbientIndex]:
    store = ObjectStore()
    store.apply([(o, "bench") for o in objs])
    index = AmbientIndex(store, Mesh())
    index.start()
    return store, index


def protobuf_floor(objs: list[dict]) -> float:
    t0 = time.perf_counter()
    for o in objs:
        if o["kind"] == "Pod":
            w = wl.Workload(uid=o["metadata"]["uid"], name=o["metadata"]["name"],
                            namespace=o["metadata"]["namespace"],
                            addresses=[ipaddress.ip_address(o["status"]["podIP"]).packed])
            w.services["ns/svc.ns.svc.cluster.local"].ports.add(service_port=80,
                                                                 target_port=8080)
            wl.Address(workload=w).SerializeToString(deterministic=True)
        elif o["kind"] == "Service":
            wl.Address(service=wl.Service(name=o["metadata"]["name"])).SerializeToString()
    return time.perf_counter() - t0


def one_pod_change(pods: int, repeat: int = 200) -> float:
    """Median seconds for the index to absorb one pod's label change (apply + recompute)."""
    store, index = build(generate(pods))
    pod = copy.deepcopy(store.get("Pod", "ns0", "pod0"))
    samples = []
    for i in range(repeat):
        pod = copy.deepcopy(pod)
        pod["metadata"]["labels"] = {"app": f"app{i % 2 + 1}"}
        t0 = time.perf_counter()
        change = store.apply([(pod, "bench")])
        samples.append(time.perf_counter() - t0)
        assert change
    assert index.address("Kubernetes//Pod/ns0/pod0") is not None
    return statistics.median(samples)


def run() -> list[Result]:
    proc = psutil.Process()
    objs = generate(10_000)
    gc.collect()
    floor = protobuf_floor(objs)

    rss0 = proc.memory_info().rss
    store = ObjectStore()
    store.apply([(o, "bench") for o in copy.deepcopy(objs)])
    gc.collect()
    rss_store = proc.memory_info().rss - rss0
    t0 = time.perf_counter()
    index = AmbientIndex(store, Mesh())
    index.start()
    build_time = time.perf_counter() - t0
    gc.collect()
    rss_total = proc.memory_info().rss - rss0
    n_addr, n_authz = len(index.addresses()), len(index.authorizations())
    del index, store
    gc.collect()

    small = one_pod_change(1_000)
    large = one_pod_change(10_000)
    mib = 1024 * 1024
    return [
        Result("index build 10k pods/1k svc/500 policies", build_time, "s", floor,
               note=f"{n_addr} addresses, {n_authz} authorizations; floor = protobuf only"),
        Result("index build RSS growth (store + index)", rss_total / mib, "MiB",
               max(rss_store, 1) / mib, note="floor = store holding the input objects"),
        Result("one pod change recompute, 1k pods", small * 1e3, "ms", None),
        ratio_result("one pod change recompute, 10k pods", large * 1e3, small * 1e3, "ms", 1.3,
                     note="floor = same change at 1k pods"),
    ]


if __name__ == "__main__":
    for r in run():
        print(r.as_dict())
