"""Index cases where istiod's ambient index is the reference (issue 17, items 1-3).

Each test is the reduced input of a case replayed against istiod's
pilot/pkg/serviceregistry/ambient (services.go ``constructService``; workloads.go
``podWorkloadBuilder`` / ``matchingServicesWithoutSelectors`` / ``endpointSliceAddressIndex``
/ ``constructServices``), with the expected output istiod produces for it.
"""

from __future__ import annotations

import pytest

from ambient import workload_pb2 as wl
from tests.ambient.builders import Harness, pod, service

KEY = "default/svc.default.svc.domain.suffix"
POD_UID = "cluster0//Pod/default/pod-123"


def _headless(families: list[str] | None, **extra) -> dict:
    svc = service("svc", "default", selector={"app": "a"}, cluster_ip=None, **extra)
    svc["spec"]["clusterIP"] = "None"
    svc["spec"]["clusterIPs"] = ["None"]
    if families is not None:
        svc["spec"]["ipFamilies"] = families
    return svc


# ---------------------------------------------------------------- item 1: ip_families


@pytest.mark.parametrize("families, expected", [
    (["IPv4"], wl.IPV4_ONLY),
    (["IPv6"], wl.IPV6_ONLY),
    (["IPv4", "IPv6"], wl.DUAL),
    (["IPv6", "IPv4"], wl.DUAL),
])
def test_headless_service_ip_families_come_from_spec(families, expected):
    h = Harness(_headless(families))
    svc = h.service(KEY)
    assert list(svc.addresses) == []
    assert svc.ip_families == expected


def test_headless_service_without_ip_families_is_automatic():
    assert Harness(_headless(None)).service(KEY).ip_families == wl.AUTOMATIC


@pytest.mark.parametrize("ips, families, expected", [
    (["10.0.0.1"], ["IPv4"], wl.IPV4_ONLY),
    (["fd00::1"], ["IPv6"], wl.IPV6_ONLY),
    (["fd00::1", "10.0.0.1"], ["IPv6", "IPv4"], wl.DUAL),
    # spec.ipFamilies is what istiod reads; the addresses do not override it
    (["10.0.0.1"], ["IPv4", "IPv6"], wl.DUAL),
    # absent (raw YAML): filled from clusterIPs as the API server would
    (["10.0.0.1"], None, wl.IPV4_ONLY),
    (["fd00::1"], None, wl.IPV6_ONLY),
    (["10.0.0.1", "fd00::1"], None, wl.DUAL),
])
def test_cluster_ip_service_ip_families(ips, families, expected):
    svc = service("svc", "default", selector={"app": "a"}, cluster_ip=ips[0])
    svc["spec"]["clusterIPs"] = ips
    if families is not None:
        svc["spec"]["ipFamilies"] = families
    assert Harness(svc).service(KEY).ip_families == expected


@pytest.mark.parametrize("families, bad", [(["IPv5"], "IPv5"), (["IPv4", "IPv4"], "IPv4")])
def test_bad_ip_families_rejects_the_service_and_names_the_field(families, bad, caplog):
    h = Harness(_headless(families))
    assert h.index.address(KEY) is None
    assert h.counter("ambient_agent_index_rejected_total", kind="Service") == 1
    assert any("spec.ipFamilies[" in r.getMessage() and bad in r.getMessage()
               for r in caplog.records)


def test_ip_families_change_is_announced():
    h = Harness(_headless(["IPv4"]))
    change = h.apply(_headless(["IPv4", "IPv6"]))
    assert KEY in change.addresses_changed
    assert h.service(KEY).ip_families == wl.DUAL


# ---------------------------------------------------------------- item 2: Service ports


def _slice(endpoints: list, ports: list, svc: str = "svc", name: str = "svc-123") -> dict:
    return {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1", "addressType": "IPv4",
            "metadata": {"name": name, "namespace": "default",
                         "labels": {"kubernetes.io/service-name": svc}},
            "endpoints": endpoints, "ports": ports}


def _ref(name: str = "pod-123", uid: str | None = "uid-default-pod-123") -> dict:
    ref = {"kind": "Pod", "namespace": "default", "name": name}
    if uid is not None:
        ref["uid"] = uid
    return ref


def test_selectorless_service_pod_gets_service_ports_whatever_the_slice_port_names():
    svc = service("svc", "default", ports=[{"name": "http", "port": 80, "targetPort": 8080},
                                           {"name": "admin", "port": 9000}])
    es = _slice([{"addresses": ["1.2.3.4"], "targetRef": _ref()}],
                [{"name": "web", "port": 8080, "protocol": "TCP"}])
    h = Harness(svc, pod("pod-123", "default"), es)
    assert h.ports(h.workload(POD_UID), KEY) == [(80, 8080), (9000, 9000)]


def test_selectorless_service_named_target_port_resolves_against_the_pod():
    svc = service("svc", "default", ports=[{"name": "http", "port": 80, "targetPort": "web"},
                                           {"name": "grpc", "port": 90, "targetPort": "rpc"}])
    es = _slice([{"addresses": ["1.2.3.4"], "targetRef": _ref()}],
                [{"name": "other", "port": 1, "protocol": "TCP"}])
    p = pod("pod-123", "default", ports=[{"name": "web", "containerPort": 8081}])
    h = Harness(svc, p, es)
    # the pod has no port named "rpc": that Service port is dropped, as for selected pods
    assert h.ports(h.workload(POD_UID), KEY) == [(80, 8081)]


def test_slice_without_target_ref_still_joins_slice_ports_by_name():
    """Opaque endpoints keep istiod's endpointSlicesBuilder port join (by port name)."""
    svc = service("svc", "default", ports=[{"name": "http", "port": 80, "targetPort": 8080}])
    h = Harness(svc, _slice([{"addresses": ["9.9.9.9"]}],
                            [{"name": "http", "port": 8443, "protocol": "TCP"},
                             {"name": "web", "port": 1, "protocol": "TCP"}]))
    w = h.workload("cluster0/discovery.k8s.io/EndpointSlice/default/svc-123/9.9.9.9")
    assert h.ports(w, KEY) == [(80, 8443)]


# ---------------------------------------------------------------- item 3: hostNetwork, uid


def test_host_network_pod_named_by_target_ref_is_a_member():
    svc = service("svc", "default", ports=[{"name": "http", "port": 80}])
    p = pod("pod-123", "default", ip="172.18.0.7", hostNetwork=True)
    es = _slice([{"addresses": ["172.18.0.7"], "targetRef": _ref()}],
                [{"name": "http", "port": 80, "protocol": "TCP"}])
    h = Harness(svc, p, es)
    w = h.workload(POD_UID)
    assert w.network_mode == wl.HOST_NETWORK
    assert h.ports(w, KEY) == [(80, 80)]


def test_target_ref_uid_must_be_the_pods():
    svc = service("svc", "default", ports=[{"name": "http", "port": 80}])
    ports = [{"name": "http", "port": 80, "protocol": "TCP"}]
    h = Harness(svc, pod("pod-123", "default"),
                _slice([{"addresses": ["1.2.3.4"], "targetRef": _ref(uid="uid-of-an-old-pod")}],
                       ports))
    assert not h.workload(POD_UID).services
    # without a uid the reference names no live pod either (istiod compares the uid as is)
    h.apply(_slice([{"addresses": ["1.2.3.4"], "targetRef": _ref(uid=None)}], ports))
    assert not h.workload(POD_UID).services
    change = h.apply(_slice([{"addresses": ["1.2.3.4"], "targetRef": _ref()}], ports))
    assert POD_UID in change.addresses_changed
    assert h.ports(h.workload(POD_UID), KEY) == [(80, 80)]
    # the pod is recreated under the same name: the slice still names the old uid
    recreated = pod("pod-123", "default")
    recreated["metadata"]["uid"] = "uid-new"
    h.delete("Pod", "default", "pod-123")
    h.apply(recreated)
    assert not h.workload(POD_UID).services


def test_target_ref_namespace_is_taken_as_written():
    svc = service("svc", "default", ports=[{"name": "http", "port": 80}])
    ref = _ref()
    del ref["namespace"]
    h = Harness(svc, pod("pod-123", "default"),
                _slice([{"addresses": ["1.2.3.4"], "targetRef": ref}],
                       [{"name": "http", "port": 80, "protocol": "TCP"}]))
    assert not h.workload(POD_UID).services


def test_slice_of_a_selector_service_adds_it_to_a_pod_the_selector_misses():
    """istiod's matchingServicesWithoutSelectors looks at every Service a slice names, and
    skips only those the pod's labels already select."""
    svc = service("svc", "default", selector={"app": "other"},
                  ports=[{"name": "http", "port": 80, "targetPort": 8080}])
    h = Harness(svc, pod("pod-123", "default", labels={"app": "mine"}),
                _slice([{"addresses": ["1.2.3.4"], "targetRef": _ref()}],
                       [{"name": "http", "port": 8080, "protocol": "TCP"}]))
    assert h.ports(h.workload(POD_UID), KEY) == [(80, 8080)]


def test_removing_the_slice_or_the_service_drops_the_membership():
    svc = service("svc", "default", ports=[{"name": "http", "port": 80}])
    es = _slice([{"addresses": ["1.2.3.4"], "targetRef": _ref()}],
                [{"name": "http", "port": 80, "protocol": "TCP"}])
    h = Harness(svc, pod("pod-123", "default"), es)
    assert KEY in h.workload(POD_UID).services
    h.delete("EndpointSlice", "default", "svc-123")
    assert not h.workload(POD_UID).services
    h.apply(es)
    assert KEY in h.workload(POD_UID).services
    h.delete("Service", "default", "svc")
    assert not h.workload(POD_UID).services
    h.apply(svc)
    assert KEY in h.workload(POD_UID).services


def test_bad_slice_drops_its_memberships():
    svc = service("svc", "default", ports=[{"name": "http", "port": 80}])
    good = _slice([{"addresses": ["1.2.3.4"], "targetRef": _ref()}],
                  [{"name": "http", "port": 80, "protocol": "TCP"}])
    h = Harness(svc, pod("pod-123", "default"), good)
    bad = _slice([{"addresses": ["1.2.3.4"], "targetRef": _ref()}, "not-a-mapping"],
                 [{"name": "http", "port": 80, "protocol": "TCP"}])
    h.apply(bad)
    assert h.counter("ambient_agent_index_rejected_total", kind="EndpointSlice") == 1
    assert not h.workload(POD_UID).services


def test_service_port_change_reaches_pods_named_by_its_slice():
    svc = service("svc", "default", ports=[{"name": "http", "port": 80}])
    es = _slice([{"addresses": ["1.2.3.4"], "targetRef": _ref()}],
                [{"name": "http", "port": 80, "protocol": "TCP"}])
    h = Harness(svc, pod("pod-123", "default"), es)
    change = h.apply(service("svc", "default", ports=[{"name": "http", "port": 81,
                                                       "targetPort": 8081}]))
    assert POD_UID in change.addresses_changed
    assert h.ports(h.workload(POD_UID), KEY) == [(81, 8081)]
