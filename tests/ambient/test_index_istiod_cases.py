"""Reduced cases where the index differed from istiod's ambient index (each failed before
its fix), plus the deliberate differences docs/xds.md lists.

What istiod does is read from its ``serviceEntryWorkloadBuilder``,
``workloadEntryWorkloadBuilder``, ``endpointSlicesBuilder`` and ``constructServiceEntries``
(pilot/pkg/serviceregistry/ambient/workloads.go, services.go) and krt's ``FilterSelects``.
"""

from __future__ import annotations

import copy
import ipaddress
import logging

from ambient import authorization_pb2 as az
from ambient import workload_pb2 as wl
from tests.ambient.builders import Harness, pod, policy, service, waypoint

STRICT = "istio-system/istio_converted_static_strict"
SE_UID = "cluster0/networking.istio.io/ServiceEntry/ns/se/"


def _se(resolution: str = "DNS", labels: dict | None = None, endpoints: list | None = None,
        hosts: list | None = None, **spec) -> dict:
    body = {"hosts": hosts or ["a.example.com"], "resolution": resolution,
            "ports": [{"number": 80, "name": "http"}], **spec}
    if endpoints is not None:
        body["endpoints"] = endpoints
    return {"apiVersion": "networking.istio.io/v1", "kind": "ServiceEntry",
            "metadata": {"name": "se", "namespace": "ns", "labels": labels or {},
                         "creationTimestamp": "2024-01-01T00:00:00Z"},
            "spec": body}


def _strict_pa(namespace: str = "ns") -> dict:
    return policy("default", namespace, kind="PeerAuthentication", mtls={"mode": "STRICT"})


def _allow(name: str, match: dict) -> dict:
    return policy(name, selector={"matchLabels": match}, action="ALLOW",
                  rules=[{"from": [{"source": {"principals": ["x"]}}]}])


# -------------------------------------------------------------- DNS ServiceEntry workloads


def test_dns_service_entry_host_workload_gets_namespace_strict_peer_authentication():
    """Was: the implicit per-host workload had no policies at all (mTLS open)."""
    h = Harness(_strict_pa(), _se())
    w = h.workload(SE_UID + "a.example.com")
    assert list(w.authorization_policies) == [STRICT]


def test_dns_service_entry_host_workload_gets_selector_policy_by_its_labels_and_no_waypoint():
    h = Harness(waypoint(hostname="waypoint.example.com"), _allow("by-se", {"app": "ext"}),
                _se(labels={"app": "ext", "istio.io/use-waypoint": "waypoint"}))
    w = h.workload(SE_UID + "a.example.com")
    assert list(w.authorization_policies) == ["ns/by-se"]
    assert not w.HasField("waypoint")  # istiod binds no waypoint to an implicit endpoint


# -------------------------------------------------------------- inline endpoints


def test_inline_endpoint_policies_follow_the_service_entry_labels_not_the_endpoint_labels():
    se = _se("STATIC", labels={"app": "se"},
             endpoints=[{"address": "2.3.4.5", "labels": {"app": "ep"}}])
    h = Harness(_allow("by-se", {"app": "se"}), _allow("by-ep", {"app": "ep"}), se)
    assert list(h.workload(SE_UID + "2.3.4.5").authorization_policies) == ["ns/by-se"]


def test_selector_policy_added_then_removed_after_the_service_entry_reaches_its_workloads():
    """Was: the workloads kept the policies of the ServiceEntry's last change."""
    h = Harness(_se("STATIC", labels={"app": "se"}, endpoints=[{"address": "2.3.4.5"}]))
    uid = SE_UID + "2.3.4.5"
    assert list(h.workload(uid).authorization_policies) == []
    change = h.apply(_allow("late", {"app": "se"}))
    assert uid in change.addresses_changed
    assert list(h.workload(uid).authorization_policies) == ["ns/late"]
    h.apply(_strict_pa())
    assert list(h.workload(uid).authorization_policies) == ["ns/late", STRICT]
    change = h.delete("AuthorizationPolicy", "ns", "late")
    assert uid in change.addresses_changed
    assert list(h.workload(uid).authorization_policies) == [STRICT]


def test_workload_peer_authentication_selects_service_entry_by_its_labels():
    pa = policy("wl", kind="PeerAuthentication", selector={"matchLabels": {"app": "se"}},
                mtls={"mode": "STRICT"})
    h = Harness(_se("STATIC", labels={"app": "se"}, endpoints=[{"address": "2.3.4.5"}]))
    h.apply(pa)
    assert list(h.workload(SE_UID + "2.3.4.5").authorization_policies) == [STRICT]


def test_service_entry_workload_name_is_the_service_entry_name():
    se = _se("STATIC", labels={"service.istio.io/workload-name": "other"},
             endpoints=[{"address": "2.3.4.5"}])
    w = Harness(se).workload(SE_UID + "2.3.4.5")
    assert (w.workload_name, w.canonical_name) == ("se", "se")


# -------------------------------------------------------------- WorkloadEntry without address


def test_workload_entry_without_address_is_kept_and_logged_once(caplog):
    gw = {"kind": "Gateway", "metadata": {"name": "remote", "namespace": "ns-gtw", "labels": {
        "topology.istio.io/network": "remote-network"}},
        "spec": {"gatewayClassName": "istio-remote",
                 "listeners": [{"name": "m", "port": 15008, "protocol": "HBONE"}]},
        "status": {"addresses": [{"type": "IPAddress", "value": "9.9.9.9"}]}}
    we = {"apiVersion": "networking.istio.io/v1", "kind": "WorkloadEntry",
          "metadata": {"name": "remote-we", "namespace": "ns", "labels": {"app": "a"}},
          "spec": {"network": "remote-network", "serviceAccount": "sa"}}
    with caplog.at_level(logging.INFO, logger="ambient.index_workloads"):
        h = Harness(gw, service("svc", selector={"app": "a"}), we)
        we2 = copy.deepcopy(we)
        we2["metadata"]["labels"]["v"] = "2"
        h.apply(we2)
    w = h.workload("cluster0/networking.istio.io/WorkloadEntry/ns/remote-we")
    assert (list(w.addresses), w.hostname, w.network) == ([], "", "remote-network")
    assert w.network_gateway.hbone_mtls_port == 15008
    lines = [r.getMessage() for r in caplog.records if "remote-we" in r.getMessage()]
    assert len(lines) == 1 and "spec.address" in lines[0]


# -------------------------------------------------------------- EndpointSlice-only endpoints


def _slice(addresses: list[list[str]]) -> dict:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": "svc-abc", "namespace": "ns",
                         "labels": {"kubernetes.io/service-name": "svc"}},
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": a} for a in addresses]}


def test_endpoint_slice_endpoint_carries_no_workload_name_canonical_or_type():
    h = Harness(service("svc"), _slice([["10.1.1.1"]]))
    w = h.workload("cluster0/discovery.k8s.io/EndpointSlice/ns/svc-abc/10.1.1.1")
    assert w.name == "svc-abc"
    assert (w.workload_name, w.canonical_name, w.canonical_revision) == ("", "", "")
    assert w.workload_type == wl.DEPLOYMENT and w.network_mode == wl.HOST_NETWORK


def test_endpoint_slice_bad_or_repeated_address_skips_that_endpoint_only(caplog):
    with caplog.at_level(logging.WARNING):
        h = Harness(service("svc"), _slice([["10.1.1.1"], ["bad"], ["10.1.1.1"], ["10.1.1.2"]]))
    base = "cluster0/discovery.k8s.io/EndpointSlice/ns/svc-abc/"
    assert {n for n in h.index.address_names("workload")} == {base + "10.1.1.1",
                                                              base + "10.1.1.2"}
    text = caplog.text
    assert "endpoints[1].addresses[0]" in text and "endpoints[2].addresses[0]" in text


# -------------------------------------------------------------- auto-allocated addresses


def _allocated(se: dict, *pairs: tuple[str, str]) -> dict:
    se["status"] = {"addresses": [{"host": h, "value": v} for h, v in pairs]}
    return se


def _vips(h: Harness, host: str) -> list[str]:
    return [str(ipaddress.ip_address(a.address)) for a in h.service(f"ns/{host}").addresses]


def test_service_entry_takes_the_addresses_allocated_in_its_status():
    se = _allocated(_se(hosts=["a.example.com", "b.example.com"]),
                    ("a.example.com", "240.240.0.1"), ("a.example.com", "2001:2::1"),
                    ("b.example.com", "240.240.0.2"), ("b.example.com", "not-an-ip"))
    h = Harness(se)
    assert _vips(h, "a.example.com") == ["240.240.0.1", "2001:2::1"]
    assert _vips(h, "b.example.com") == ["240.240.0.2"]
    assert h.index.lookup("testnetwork/240.240.0.2")[0] == "ns/b.example.com"
    # the allocation arrives later (istiod patches the status): the VIP follows
    se2 = _allocated(_se(hosts=["a.example.com", "b.example.com"]),
                     ("a.example.com", "240.240.0.9"))
    h.apply(se2)
    assert _vips(h, "a.example.com") == ["240.240.0.9"] and _vips(h, "b.example.com") == []


def test_allocated_addresses_are_ignored_where_istiod_ignores_them():
    pairs = (("a.example.com", "240.240.0.1"), ("*.wild.com", "240.240.0.3"))
    opted_out = _allocated(_se(labels={"networking.istio.io/enable-autoallocate-ip": "False"}),
                           *pairs)
    assert _vips(Harness(opted_out), "a.example.com") == []
    own = _allocated(_se(addresses=["1.1.1.1"]), *pairs)
    assert _vips(Harness(own), "a.example.com") == ["1.1.1.1"]
    none = _allocated(_se("NONE"), *pairs)
    assert _vips(Harness(none), "a.example.com") == []
    wild = _allocated(_se(hosts=["*.wild.com"]), *pairs)
    assert _vips(Harness(wild), "*.wild.com") == []  # wildcard: DYNAMIC_DNS only
    dyn = _allocated(_se("DYNAMIC_DNS", hosts=["*.wild.com"]), *pairs)
    assert _vips(Harness(dyn), "*.wild.com") == ["240.240.0.3"]


# -------------------------------------------------------------- deliberate differences


def test_deliberate_no_labels_gets_no_selector_policy():
    """istiod hands a Pod or ServiceEntry with no labels at all every selector policy of
    its namespace (krt's ``FilterSelects`` with nil labels applies no filter); the index
    matches selectors against the empty label set instead (docs/xds.md, "Deliberate
    differences from istiod")."""
    se = _se("STATIC", endpoints=[{"address": "2.3.4.5"}])
    se["metadata"].pop("labels")
    bare = pod("bare", ip="1.1.1.1")
    bare["metadata"].pop("labels")
    h = Harness(_allow("sel", {"app": "a"}), _strict_pa(), se, bare)
    assert list(h.workload(SE_UID + "2.3.4.5").authorization_policies) == [STRICT]
    assert list(h.workload("cluster0//Pod/ns/bare").authorization_policies) == [STRICT]
    # an empty selector still selects everything, as in istiod
    h.apply(policy("all", selector={"matchLabels": {}}, action="DENY",
                   rules=[{"from": [{"source": {"principals": ["x"]}}]}]))
    assert "ns/all" in h.workload("cluster0//Pod/ns/bare").authorization_policies


# -------------------------------------------------------------- upstream inputs, replayed


def _we(name: str, labels: dict, address: str = "") -> dict:
    spec = {"serviceAccount": "sa1", "labels": labels}
    if address:
        spec["address"] = address
    return {"apiVersion": "networking.istio.io/v1", "kind": "WorkloadEntry",
            "metadata": {"name": name, "namespace": "ns1", "labels": labels}, "spec": spec}


def test_upstream_empty_address_workload_entries():
    """istiod's TestAmbientIndex_EmptyAddrWorkloadEntries: both kept, found by uid, not
    by an empty address."""
    h = Harness(_we("emptyaddr1", {"app": "a"}))
    change = h.apply(_we("emptyaddr2", {"app": "a"}))
    base = "cluster0/networking.istio.io/WorkloadEntry/ns1/"
    assert base + "emptyaddr2" in change.addresses_changed
    assert {n for n in h.index.address_names("workload")} == {base + "emptyaddr1",
                                                              base + "emptyaddr2"}
    assert h.index.lookup(base + "emptyaddr1") == [base + "emptyaddr1"]
    assert h.index.lookup("testnetwork/") == []
    # an update of the entry is an event
    updated = _we("emptyaddr1", {"app": "a"})
    updated["spec"]["serviceAccount"] = "sa2"
    assert base + "emptyaddr1" in h.apply(updated).addresses_changed


def test_upstream_inlined_workload_entries():
    """istiod's TestAmbientIndex_InlinedWorkloadEntries: a ServiceEntry labelled app=a with
    two inline endpoints; a selector policy added, then deleted, then the ServiceEntry."""
    se = {"apiVersion": "networking.istio.io/v1", "kind": "ServiceEntry",
          "metadata": {"name": "se1", "namespace": "ns1", "labels": {"app": "a"}},
          "spec": {"hosts": ["se.istio.io"], "addresses": ["240.240.23.45"],
                   "resolution": "STATIC", "ports": [{"number": 80, "name": "http"}],
                   "endpoints": [{"address": "127.0.0.1"}, {"address": "127.0.0.2"}]}}
    h = Harness(se)
    uids = [f"cluster0/networking.istio.io/ServiceEntry/ns1/se1/127.0.0.{i}" for i in (1, 2)]
    change = h.apply(policy("selector", "ns1", selector={"matchLabels": {"app": "a"}},
                            action="ALLOW", rules=[{}]))
    assert set(uids) <= change.addresses_changed
    assert [list(h.workload(u).authorization_policies) for u in uids] == [["ns1/selector"]] * 2
    change = h.delete("AuthorizationPolicy", "ns1", "selector")
    assert set(uids) <= change.addresses_changed
    assert [list(h.workload(u).authorization_policies) for u in uids] == [[], []]
    h.delete("ServiceEntry", "ns1", "se1")
    assert h.index.address_names("workload") == []


def test_service_entry_endpoint_without_address_is_kept():
    """istiod keeps an inline endpoint without an address (another network's, reached
    through its network gateway): its uid ends in "/"; the other endpoints stay."""
    se = _se("STATIC", labels={"app": "se"},
             endpoints=[{"network": "remote-network", "serviceAccount": "sa"},
                        {"address": "2.3.4.5"}])
    h = Harness(se)
    w = h.workload(SE_UID)
    assert (list(w.addresses), w.hostname, w.network) == ([], "", "remote-network")
    assert h.workload(SE_UID + "2.3.4.5").network == "testnetwork"


def test_udp_service_ports_are_sent_as_istiod_sends_them():
    """Oracle case service-app-protocol-and-udp: istiod's constructService keeps every
    port of a Service (a UDP port too), and a selected pod lists it."""
    svc = service("mixed", selector={"app": "m"},
                  ports=[{"name": "grpc-x", "port": 81, "targetPort": 8081,
                          "appProtocol": "kubernetes.io/h2c"},
                         {"name": "dns", "port": 53, "targetPort": 53, "protocol": "UDP"}])
    h = Harness(svc, pod("m", labels={"app": "m"}))
    key = "ns/mixed.ns.svc.domain.suffix"
    assert [(p.service_port, p.target_port) for p in h.service(key).ports] == [(81, 8081), (53, 53)]
    assert h.ports(h.workload("cluster0//Pod/ns/m"), key) == [(81, 8081), (53, 53)]


def test_deliberate_port_level_disable_under_inherited_strict_is_honoured():
    """istiod's convertedSelectorPeerAuthentications, for a workload PeerAuthentication
    without its own mode under a STRICT namespace, looks only for PERMISSIVE port
    exceptions: one with only ``portLevelMtls: {9090: DISABLE}`` is ignored and the
    workload lists the static STRICT policy (9090 stays mTLS-only), while the same
    exception under a workload-level STRICT mode is honoured. The index honours it in
    both (docs/xds.md, "Deliberate differences from istiod"): the workload lists the
    converted policy, which is STRICT on every other port."""
    ns_strict = _strict_pa()
    wl_pa = policy("db", kind="PeerAuthentication", selector={"matchLabels": {"app": "p"}},
                   portLevelMtls={"9090": {"mode": "DISABLE"}}, created="2024-01-02T00:00:00Z")
    h = Harness(ns_strict, wl_pa, pod("p", labels={"app": "p"}))
    keys = list(h.workload("cluster0//Pod/ns/p").authorization_policies)
    assert keys == ["ns/converted_peer_authentication_db"]
    converted = h.index.authorization("ns/converted_peer_authentication_db")
    assert converted is not None and converted.action == az.DENY
