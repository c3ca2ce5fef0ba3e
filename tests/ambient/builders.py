"""Object builders and an index harness for the ambient tests (conventions: cluster
``cluster0``, network ``testnetwork`` from the system-namespace label,
root namespace ``istio-system``)."""

from __future__ import annotations

import copy

from prometheus_client import CollectorRegistry

from ambient.api import IndexChange
from ambient.index import AmbientIndex
from ambient.objects import Mesh
from ambient.store import ObjectStore


def ns(name: str, labels: dict | None = None, annotations: dict | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "labels": labels or {},
                         **({"annotations": annotations} if annotations else {})}}


def pod(name: str, namespace: str = "ns", ip: str | None = "1.2.3.4", labels: dict | None = None,
        ready: bool = True, phase: str = "Running", node: str = "node", sa: str = "sa",
        annotations: dict | None = None, ports: list | None = None, **spec_extra) -> dict:
    status: dict = {"phase": phase}
    if ip:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    if ready:
        status["conditions"] = [{"type": "Ready", "status": "True"}]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{namespace}-{name}",
                         "labels": labels or {}, "annotations": annotations or {}},
            "spec": {"nodeName": node, "serviceAccountName": sa,
                     "containers": [{"name": "app", "ports": ports or []}], **spec_extra},
            "status": status}


def service(name: str, namespace: str = "ns", selector: dict | None = None,
            ports: list | None = None, cluster_ip: str | None = "10.0.0.1",
            labels: dict | None = None, annotations: dict | None = None, **spec_extra) -> dict:
    spec = {"ports": ports if ports is not None else [{"name": "http", "port": 80,
                                                       "targetPort": 8080}],
            **spec_extra}
    if selector is not None:
        spec["selector"] = selector
    if cluster_ip:
        spec["clusterIP"] = cluster_ip
        spec["clusterIPs"] = [cluster_ip]
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": namespace, "labels": labels or {},
                         "annotations": annotations or {},
                         "creationTimestamp": "2024-01-01T00:00:00Z"},
            "spec": spec}


def waypoint(name: str = "waypoint", namespace: str = "ns", hostname: str | None = None,
             waypoint_for: str | None = "all", allowed: dict | None = None,
             annotations: dict | None = None) -> dict:
    labels = {"istio.io/waypoint-for": waypoint_for} if waypoint_for else {}
    listener = {"name": "mesh", "port": 15008, "protocol": "HBONE"}
    if allowed:
        listener["allowedRoutes"] = {"namespaces": allowed}
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
            "metadata": {"name": name, "namespace": namespace, "labels": labels,
                         "annotations": annotations or {}},
            "spec": {"gatewayClassName": "istio-waypoint", "listeners": [listener]},
            "status": {"addresses": [{"type": "Hostname",
                                      "value": hostname or f"{name}.{namespace}.svc.cluster.local"}]}}


def policy(name: str, namespace: str = "ns", kind: str = "AuthorizationPolicy", **spec) -> dict:
    return {"apiVersion": "security.istio.io/v1", "kind": kind,
            "metadata": {"name": name, "namespace": namespace,
                         "creationTimestamp": spec.pop("created", "2024-01-01T00:00:00Z")},
            "spec": spec}


class Harness:
    """A store + index pair; ``apply``/``delete`` return the IndexChange they caused."""

    def __init__(self, *objects: dict, network: str = "testnetwork", cluster: str = "cluster0",
                 domain: str = "domain.suffix"):
        self.registry = CollectorRegistry()
        self.store = ObjectStore(self.registry)
        self.index = AmbientIndex(self.store, Mesh(cluster_id=cluster, domain_suffix=domain),
                                  self.registry)
        self.changes: list[IndexChange] = []
        self.index.subscribe(self.changes.append)
        sys_labels = {"topology.istio.io/network": network} if network else {}
        self.store.apply([(ns("istio-system", sys_labels), "test")])
        self.index.start()
        if objects:
            self.apply(*objects)

    def apply(self, *objects: dict) -> IndexChange:
        self.changes.clear()
        self.store.apply([(copy.deepcopy(o), "test") for o in objects])
        return self._merged()

    def delete(self, kind: str, namespace: str, name: str) -> IndexChange:
        self.changes.clear()
        self.store.apply(deletes=[(kind, namespace, name)])
        return self._merged()

    def _merged(self) -> IndexChange:
        out = IndexChange()
        for c in self.changes:
            out = IndexChange(out.addresses_changed | c.addresses_changed,
                              out.addresses_removed | c.addresses_removed,
                              out.authorizations_changed | c.authorizations_changed,
                              out.authorizations_removed | c.authorizations_removed)
        return out

    def workload(self, uid: str):
        a = self.index.address(uid)
        assert a is not None, f"no address {uid}; have {sorted(self.index.addresses())}"
        assert a.WhichOneof("type") == "workload"
        return a.workload

    def service(self, key: str):
        a = self.index.address(key)
        assert a is not None, f"no address {key}; have {sorted(self.index.addresses())}"
        return a.service

    def ports(self, w, key: str) -> list[tuple[int, int]]:
        return [(p.service_port, p.target_port) for p in w.services[key].ports]

    def counter(self, name: str, **labels) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0
