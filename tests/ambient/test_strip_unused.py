"""What the Kubernetes source keeps of each object (``ambient.source_kube.strip_unused``,
istiod's informer transforms): the fields the agent reads are all there, so the index
serves the same Addresses from a stripped store as from the full objects; what goes is
gone; a field of the wrong type stays, so its object is still rejected naming it."""

from __future__ import annotations

import copy

from ambient import workload_pb2 as wl
from ambient.index import AmbientIndex
from ambient.objects import Mesh
from ambient.source_kube import strip_unused
from ambient.store import ObjectStore
from benchmarks.bench_index import generate

MANAGED = [{"manager": "kubelet", "operation": "Update", "apiVersion": "v1",
            "fieldsType": "FieldsV1", "fieldsV1": {"f:status": {"f:phase": {}}}}]


def full_pod() -> dict:
    return {
        "kind": "Pod", "apiVersion": "v1",
        "metadata": {"name": "web-1", "namespace": "shop", "uid": "u-1",
                     "resourceVersion": "7", "managedFields": copy.deepcopy(MANAGED),
                     "labels": {"app": "web", "istio.io/dataplane-mode": "ambient"},
                     "annotations": {"ambient.istio.io/redirection": "enabled",
                                     "proxy.istio.io/overrides": '{"containers": []}'},
                     "ownerReferences": [{"kind": "ReplicaSet", "name": "web-5d9f",
                                          "uid": "rs-1", "controller": True}]},
        "spec": {"serviceAccountName": "web-sa", "serviceAccount": "web-sa",
                 "nodeName": "node-a", "hostname": "web-1", "subdomain": "web",
                 "restartPolicy": "Always", "dnsPolicy": "ClusterFirst",
                 "volumes": [{"name": "data", "emptyDir": {}}],
                 "containers": [
                     {"name": "app", "image": "web:1", "env": [{"name": "A", "value": "1"}],
                      "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"},
                                {"name": "dns", "containerPort": 53, "protocol": "UDP"}],
                      "readinessProbe": {"httpGet": {"path": "/ready", "port": 8080}}},
                     {"name": "logger", "image": "log:1"}],
                 "initContainers": [
                     {"name": "sidecar", "restartPolicy": "Always", "image": "s:1",
                      "ports": [{"name": "metrics", "containerPort": 9090}]},
                     {"name": "setup", "image": "init:1",
                      "ports": [{"name": "ignored", "containerPort": 1}]}]},
        "status": {"phase": "Running", "podIP": "10.1.0.5", "podIPs": [{"ip": "10.1.0.5"}],
                   "hostIP": "192.168.0.10",
                   "conditions": [{"type": "Ready", "status": "True"}],
                   "containerStatuses": [{"name": "app", "ready": True, "restartCount": 0,
                                          "state": {"running": {}}}],
                   "initContainerStatuses": [{"name": "setup", "ready": True}]}}


def test_a_pod_keeps_what_the_agent_reads_and_loses_the_rest():
    pod = strip_unused(full_pod(), "Pod")
    meta, spec, status = pod["metadata"], pod["spec"], pod["status"]
    assert "managedFields" not in meta
    assert meta["annotations"] == {"ambient.istio.io/redirection": "enabled"}
    assert meta["ownerReferences"] and meta["labels"] == full_pod()["metadata"]["labels"]
    assert spec == {
        "serviceAccountName": "web-sa", "serviceAccount": "web-sa", "nodeName": "node-a",
        "hostname": "web-1", "subdomain": "web",
        "containers": [{"name": "app", "ports": full_pod()["spec"]["containers"][0]["ports"]}],
        "initContainers": [{"name": "sidecar", "restartPolicy": "Always",
                            "ports": [{"name": "metrics", "containerPort": 9090}]}]}
    assert "containerStatuses" not in status and "initContainerStatuses" not in status
    assert status["conditions"] == [{"type": "Ready", "status": "True"}]


def test_a_pod_of_the_host_network_stays_one():
    pod = full_pod()
    pod["spec"]["hostNetwork"] = True
    assert strip_unused(pod, "Pod")["spec"]["hostNetwork"] is True


def test_a_node_keeps_its_labels_and_addresses():
    node = {"kind": "Node", "apiVersion": "v1",
            "metadata": {"name": "node-a", "managedFields": copy.deepcopy(MANAGED),
                         "labels": {"topology.kubernetes.io/zone": "z1"},
                         "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
                         "ownerReferences": [{"kind": "Machine", "name": "m"}]},
            "status": {"addresses": [{"type": "InternalIP", "address": "192.168.0.10"}],
                       "capacity": {"cpu": "2"}, "allocatable": {"cpu": "2"},
                       "images": [{"names": ["a"]}], "conditions": [{"type": "Ready"}]}}
    strip_unused(node, "Node")
    assert node["metadata"] == {"name": "node-a",
                                "labels": {"topology.kubernetes.io/zone": "z1"}}
    assert node["status"] == {"addresses": [{"type": "InternalIP",
                                             "address": "192.168.0.10"}]}


def test_other_kinds_lose_only_managed_fields():
    svc = {"kind": "Service", "metadata": {"name": "s", "namespace": "n",
                                           "managedFields": MANAGED,
                                           "annotations": {"a": "b"}},
           "spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 80}]}}
    want = copy.deepcopy(svc)
    del want["metadata"]["managedFields"]
    assert strip_unused(svc, "Service") == want


def test_fields_of_the_wrong_type_are_left_for_the_translator_to_name():
    for bad in ("not-a-list", 7, {"name": "x"}):
        pod = full_pod()
        pod["spec"]["containers"] = bad
        assert strip_unused(pod, "Pod")["spec"]["containers"] == bad
    pod = full_pod()
    pod["spec"] = "not-a-mapping"
    pod["metadata"]["annotations"] = "not-a-mapping"
    assert strip_unused(pod, "Pod")["spec"] == "not-a-mapping"
    assert strip_unused({"kind": "Pod", "metadata": 3}, "Pod") == {"kind": "Pod",
                                                                   "metadata": 3}


def _addresses(objs: list[dict]) -> dict[str, bytes]:
    store = ObjectStore()
    store.apply([(o, "test") for o in objs])
    index = AmbientIndex(store, Mesh())
    index.start()
    out = {}
    for o in objs:
        if o["kind"] == "Pod":
            uid = f"Kubernetes//Pod/{o['metadata']['namespace']}/{o['metadata']['name']}"
            addr = index.address(uid)
            out[uid] = addr.SerializeToString(deterministic=True) if addr else b""
    return out


def test_the_index_serves_the_same_addresses_from_stripped_objects():
    """A generated cluster (bench_index's: services, policies, pods with named ports)
    plus the pod above: every Pod's Address is byte-identical either way."""
    objs = generate(200)
    objs += [{"kind": "Namespace", "metadata": {"name": "shop", "labels": {
        "istio.io/dataplane-mode": "ambient"}}},
        {"kind": "Service", "metadata": {"name": "web", "namespace": "shop"},
         "spec": {"clusterIP": "10.96.9.9", "selector": {"app": "web"},
                  "ports": [{"name": "http", "port": 80, "targetPort": "http"},
                            {"name": "m", "port": 9090, "targetPort": "metrics"}]}},
        full_pod()]
    for o in objs:
        o.setdefault("metadata", {})["managedFields"] = copy.deepcopy(MANAGED)
    before = _addresses(copy.deepcopy(objs))
    after = _addresses([strip_unused(copy.deepcopy(o), o["kind"]) for o in objs])
    assert after == before
    web = wl.Address.FromString(before["Kubernetes//Pod/shop/web-1"]).workload
    assert web.service_account == "web-sa" and web.node == "node-a"
    ports = {p.service_port: p.target_port
             for p in web.services["shop/web.shop.svc.cluster.local"].ports}
    assert ports == {80: 8080, 9090: 9090}
