"""The index acceptance cases (1-32, 35) against the real store + index.

Cases 33-34 are delta-xDS stream behaviour (on-demand, reconnect versions) and belong to
the xDS server's tests; the index side of 33 (lookup by IP / VIP) is covered here.
"""

from __future__ import annotations

import ipaddress

from ambient import authorization_pb2 as az
from ambient import workload_pb2 as wl
from tests.ambient.builders import Harness, ns, pod, policy, service, waypoint

UID = "cluster0//Pod/ns/name"
HOST = "svc.ns.svc.domain.suffix"


def ip(raw: bytes) -> str:
    return str(ipaddress.ip_address(raw))


def test_case1_pending_pod_without_ip_has_no_workload():
    h = Harness(pod("name", ip=None, ready=False, phase="Pending"))
    assert h.index.address(UID) is None


def test_case2_3_pending_or_unready_pod_with_ip_is_unhealthy():
    h = Harness(pod("name", ready=False, phase="Pending", sa=""))
    w = h.workload(UID)
    assert [ip(a) for a in w.addresses] == ["1.2.3.4"]
    assert (w.network, w.cluster_id, w.status) == ("testnetwork", "cluster0", wl.UNHEALTHY)
    assert (w.workload_type, w.workload_name, w.canonical_name, w.canonical_revision) == \
        (wl.POD, "name", "name", "latest")
    h.apply(pod("name", ready=False))
    assert h.workload(UID).status == wl.UNHEALTHY
    h.apply(pod("name", ready=True))
    assert h.workload(UID).status == wl.HEALTHY


def test_case4_workload_name_from_controller_owner():
    p = pod("rs-xvnqd")
    p["metadata"].update(generateName="rs-", ownerReferences=[
        {"kind": "ReplicaSet", "name": "rs", "controller": True}])
    w = Harness(p).workload("cluster0//Pod/ns/rs-xvnqd")
    assert (w.workload_name, w.canonical_name) == ("rs", "rs")
    p["metadata"]["labels"] = {"pod-template-hash": "5d7f9"}
    p["metadata"]["ownerReferences"][0]["name"] = "web-5d7f9"
    assert Harness(p).workload("cluster0//Pod/ns/rs-xvnqd").workload_name == "web"


def test_case5_selected_pod_lists_service_ports():
    h = Harness(pod("name", labels={"app": "foo"}), service("svc", selector={"app": "foo"}))
    w = h.workload(UID)
    assert dict(w.services).keys() == {f"ns/{HOST}"}
    assert h.ports(w, f"ns/{HOST}") == [(80, 8080)]
    assert (w.canonical_name, w.status) == ("foo", wl.HEALTHY)


def test_case6_named_target_ports_resolve_per_pod_and_missing_ones_drop():
    h = Harness(pod("name", labels={"app": "foo"},
                    ports=[{"name": "81-target", "containerPort": 9090, "protocol": "TCP"}]),
                service("svc", selector={"app": "foo"}, ports=[
                    {"port": 80, "targetPort": 8080}, {"port": 81, "targetPort": "81-target"},
                    {"port": 82, "targetPort": "82-target"}]))
    assert h.ports(h.workload(UID), f"ns/{HOST}") == [(80, 8080), (81, 9090)]


def test_case7_service_entry_selects_pods_and_named_port_resolves():
    se = {"kind": "ServiceEntry", "metadata": {"name": "se", "namespace": "httpbin2"},
          "spec": {"hosts": ["httpbin.httpbin2.mesh.internal"],
                   "ports": [{"number": 8002, "name": "http", "protocol": "HTTP"}],
                   "workloadSelector": {"labels": {"app": "httpbin"}}, "resolution": "STATIC"}}
    h = Harness(se, pod("p", "httpbin2", labels={"app": "httpbin"},
                        ports=[{"name": "http", "containerPort": 8000}]))
    w = h.workload("cluster0//Pod/httpbin2/p")
    assert h.ports(w, "httpbin2/httpbin.httpbin2.mesh.internal") == [(8002, 8000)]


def test_case8_locality_from_node_labels_and_node_change_cascades():
    node = {"kind": "Node", "metadata": {"name": "node", "labels": {
        "topology.kubernetes.io/region": "region", "topology.kubernetes.io/zone": "zone"}}}
    h = Harness(node, pod("name"))
    w = h.workload(UID)
    assert w.node == "node"
    assert (w.locality.region, w.locality.zone) == ("region", "zone")
    node["metadata"]["labels"]["topology.kubernetes.io/zone"] = "zone2"
    assert h.apply(node).addresses_changed == {UID}
    assert h.workload(UID).locality.zone == "zone2"


def test_case9_selector_policies_listed_from_own_and_root_namespace():
    sel = {"selector": {"matchLabels": {"app": "foo"}}}
    h = Harness(policy("wrong-ns", "not-ns", **sel), policy("local-ns", **sel),
                policy("local-ns-wrong-labels", selector={"matchLabels": {"app": "not-foo"}}),
                policy("root-ns", "istio-system", **sel), pod("name", labels={"app": "foo"}))
    assert list(h.workload(UID).authorization_policies) == ["istio-system/root-ns", "ns/local-ns"]


def test_case10_pod_use_waypoint_label_binds_hostname_waypoint():
    h = Harness(waypoint(hostname="hostname.example"),
                pod("name", labels={"istio.io/use-waypoint": "waypoint"}))
    w = h.workload(UID)
    assert w.waypoint.hostname.namespace == "ns"
    assert w.waypoint.hostname.hostname == "hostname.example"
    assert w.waypoint.hbone_mtls_port == 15008
    assert h.index.waypoint_resources("ns", "waypoint") == {UID}


def test_case11_waypoint_instance_gets_no_waypoint_but_application_tunnel():
    inst = pod("waypoint-abc", labels={"gateway.networking.k8s.io/gateway-name": "waypoint",
                                       "istio.io/use-waypoint": "waypoint"})
    h = Harness(waypoint(annotations={"ambient.istio.io/waypoint-inbound-binding": "PROXY/15088"}),
                inst)
    w = h.workload("cluster0//Pod/ns/waypoint-abc")
    assert not w.HasField("waypoint")
    assert (w.application_tunnel.protocol, w.application_tunnel.port) == \
        (wl.ApplicationTunnel.PROXY, 15088)


def _slice(name: str, svc: str, endpoints: list, ports: list | None = None) -> dict:
    return {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1", "addressType": "IPv4",
            "metadata": {"name": name, "namespace": "default",
                         "labels": {"kubernetes.io/service-name": svc}},
            "endpoints": endpoints,
            "ports": ports or [{"name": "http", "port": 80, "protocol": "TCP"}]}


def test_case12_selectorless_service_attaches_pods_by_slice_target_ref():
    svc = service("svc", "default", ports=[{"name": "http", "port": 80}])
    ref = {"kind": "Pod", "namespace": "default", "name": "pod-123", "uid": "uid-default-pod-123"}
    h = Harness(svc, pod("pod-123", "default"),
                _slice("svc-123", "svc", [{"addresses": ["1.2.3.4"], "targetRef": ref}]))
    key = "default/svc.default.svc.domain.suffix"
    assert h.ports(h.workload("cluster0//Pod/default/pod-123"), key) == [(80, 80)]
    change = h.apply(_slice("svc-123", "svc", [{"addresses": ["1.2.3.4"]}]))
    assert not h.workload("cluster0//Pod/default/pod-123").services
    uid = "cluster0/discovery.k8s.io/EndpointSlice/default/svc-123/1.2.3.4"
    w = h.workload(uid)
    assert (w.name, w.network_mode, w.status) == ("svc-123", wl.HOST_NETWORK, wl.HEALTHY)
    assert h.ports(w, key) == [(80, 80)]
    assert {uid, "cluster0//Pod/default/pod-123"} <= change.addresses_changed


def test_case13_kubernetes_api_service_slice_workload():
    svc = service("kubernetes", "default", cluster_ip="10.96.0.1",
                  ports=[{"name": "https", "port": 443, "targetPort": 6443}])
    h = Harness(svc, _slice("kubernetes", "kubernetes", [{"addresses": ["172.18.0.5"]}],
                            [{"name": "https", "port": 6443, "protocol": "TCP"}]))
    w = h.workload("cluster0/discovery.k8s.io/EndpointSlice/default/kubernetes/172.18.0.5")
    assert w.network_mode == wl.HOST_NETWORK
    assert h.ports(w, "default/kubernetes.default.svc.domain.suffix") == [(443, 6443)]


def test_case14_host_network_pod_gets_only_selector_services():
    h = Harness(pod("name", ip="1.1.1.1", labels={"app": "foo"}, hostNetwork=True),
                service("svc", selector={"app": "foo"}))
    w = h.workload(UID)
    assert w.network_mode == wl.HOST_NETWORK and list(w.services) == [f"ns/{HOST}"]


def _we(name="name", address="1.2.3.4", labels=None, spec_labels=None, **spec):
    return {"kind": "WorkloadEntry", "metadata": {"name": name, "namespace": "ns",
                                                  "labels": labels or {}},
            "spec": {"address": address, **({"labels": spec_labels} if spec_labels else {}),
                     **spec}}


def test_case15_workload_entry_with_tunnel_label_is_native_hbone():
    h = Harness(service("svc", selector={"app": "foo"}),
                _we(labels={"app": "foo", "networking.istio.io/tunnel": "http"}))
    w = h.workload("cluster0/networking.istio.io/WorkloadEntry/ns/name")
    assert (w.tunnel_protocol, w.native_tunnel, w.status) == (wl.HBONE, True, wl.HEALTHY)
    assert h.ports(w, f"ns/{HOST}") == [(80, 8080)]
    h2 = Harness(service("svc", selector={"app": "foo"}), _we(spec_labels={"app": "foo"}))
    assert f"ns/{HOST}" in h2.workload("cluster0/networking.istio.io/WorkloadEntry/ns/name").services


def test_case16_hostname_workload_entry_port_mapping():
    se = {"kind": "ServiceEntry", "metadata": {"name": "se", "namespace": "ns"},
          "spec": {"hosts": ["a.example.com"], "resolution": "DNS",
                   "workloadSelector": {"labels": {"app": "foo"}},
                   "ports": [{"number": 80, "name": "http", "targetPort": 8080},
                             {"number": 81, "name": "81"}, {"number": 82, "name": "82"}]}}
    h = Harness(se, _we(address="hostname", labels={"app": "foo"}, ports={"81": 8180}))
    w = h.workload("cluster0/networking.istio.io/WorkloadEntry/ns/name")
    assert (w.hostname, list(w.addresses)) == ("hostname", [])
    assert h.ports(w, "ns/a.example.com") == [(80, 8080), (81, 8180), (82, 82)]


def test_case17_remote_network_gateway():
    gw = {"kind": "Gateway", "metadata": {"name": "remote", "namespace": "ns-gtw", "labels": {
        "topology.istio.io/network": "remote-network"}},
        "spec": {"gatewayClassName": "istio-remote",
                 "listeners": [{"name": "m", "port": 15008, "protocol": "HBONE"}]},
        "status": {"addresses": [{"type": "IPAddress", "value": "9.9.9.9"}]}}
    h = Harness(gw, _we(network="remote-network"))
    w = h.workload("cluster0/networking.istio.io/WorkloadEntry/ns/name")
    assert w.network == "remote-network"
    assert (w.network_gateway.address.network, ip(w.network_gateway.address.address),
            w.network_gateway.hbone_mtls_port) == ("remote-network", "9.9.9.9", 15008)
    gw["status"]["addresses"] = [{"type": "Hostname", "value": "networkgateway.example.com"}]
    h.apply(gw)
    w = h.workload("cluster0/networking.istio.io/WorkloadEntry/ns/name")
    assert (w.network_gateway.hostname.namespace, w.network_gateway.hostname.hostname) == \
        ("ns-gtw", "networkgateway.example.com")


def test_case18_dns_service_entry_without_endpoints_yields_host_workloads():
    se = {"kind": "ServiceEntry", "metadata": {"name": "name", "namespace": "ns"},
          "spec": {"hosts": ["a.example.com", "b.example.com"], "resolution": "DNS",
                   "ports": [{"number": 80, "name": "http"}]}}
    h = Harness(se)
    for host in ("a.example.com", "b.example.com"):
        w = h.workload(f"cluster0/networking.istio.io/ServiceEntry/ns/name/{host}")
        assert w.hostname == host and h.ports(w, f"ns/{host}") == [(80, 80)]


def test_case19_service_entry_endpoint_waypoint_from_endpoint_labels():
    se = {"kind": "ServiceEntry", "metadata": {"name": "name", "namespace": "ns"},
          "spec": {"hosts": ["a.example.com"], "resolution": "STATIC",
                   "ports": [{"number": 80, "name": "http"}],
                   "endpoints": [{"address": "2.3.4.5"}, {"address": "3.4.5.6", "labels": {
                       "istio.io/use-waypoint": "waypoint"}}]}}
    h = Harness(waypoint(hostname="waypoint.example.com"), se)
    base = "cluster0/networking.istio.io/ServiceEntry/ns/name/"
    assert not h.workload(base + "2.3.4.5").HasField("waypoint")
    assert h.workload(base + "3.4.5.6").waypoint.hostname.hostname == "waypoint.example.com"


def test_case20_service_entry_endpoint_port_and_ip_lookup():
    se = {"kind": "ServiceEntry", "metadata": {"name": "se", "namespace": "ns1"},
          "spec": {"hosts": ["se.istio.io"], "addresses": ["240.240.23.45"],
                   "resolution": "STATIC",
                   "ports": [{"number": 80, "name": "http", "targetPort": 8080}],
                   "endpoints": [{"address": "127.0.0.1", "ports": {"http": 8081}}]}}
    h = Harness(se)
    uid = "cluster0/networking.istio.io/ServiceEntry/ns1/se/127.0.0.1"
    assert h.ports(h.workload(uid), "ns1/se.istio.io") == [(80, 8081)]
    assert h.index.lookup("testnetwork/127.0.0.1") == [uid]
    assert h.index.lookup("testnetwork/240.240.23.45") == ["ns1/se.istio.io", uid]


def test_case21_k8s_service_fields_external_name_and_headless():
    h = Harness(service("name", cluster_ip="1.2.3.4", ports=[{"name": "http", "port": 80}]))
    s = h.service("ns/name.ns.svc.domain.suffix")
    assert (s.hostname, s.canonical) == ("name.ns.svc.domain.suffix", True)
    assert [(a.network, ip(a.address)) for a in s.addresses] == [("testnetwork", "1.2.3.4")]
    assert [(p.service_port, p.target_port, p.app_protocol) for p in s.ports] == \
        [(80, 80, wl.HTTP11)]
    h.apply(service("ext", type="ExternalName", externalName="x.example.com"),
            service("headless", cluster_ip="None"))
    assert h.index.address("ns/ext.ns.svc.domain.suffix") is None
    assert not h.service("ns/headless.ns.svc.domain.suffix").addresses


def test_case22_named_target_port_is_zero_in_service():
    h = Harness(service("name", ports=[{"name": "http", "port": 80, "targetPort": 81},
                                       {"name": "http-alt", "port": 8080,
                                        "targetPort": "something"}]))
    s = h.service("ns/name.ns.svc.domain.suffix")
    assert [(p.service_port, p.target_port, p.app_protocol) for p in s.ports] == \
        [(80, 81, wl.HTTP11), (8080, 0, wl.HTTP11)]


def test_case23_traffic_distribution_and_publish_not_ready():
    LB = wl.LoadBalancing
    h = Harness(service("a", trafficDistribution="PreferClose"),
                service("b", trafficDistribution="PreferSameNode"),
                service("c", publishNotReadyAddresses=True),
                service("d", internalTrafficPolicy="Local"))
    a = h.service("ns/a.ns.svc.domain.suffix").load_balancing
    assert (list(a.routing_preference), a.mode) == ([LB.NETWORK, LB.REGION, LB.ZONE], LB.FAILOVER)
    b = h.service("ns/b.ns.svc.domain.suffix").load_balancing
    assert list(b.routing_preference) == [LB.NETWORK, LB.REGION, LB.ZONE, LB.SUBZONE, LB.NODE]
    assert h.service("ns/c.ns.svc.domain.suffix").load_balancing.health_policy == LB.ALLOW_ALL
    d = h.service("ns/d.ns.svc.domain.suffix").load_balancing
    assert (list(d.routing_preference), d.mode) == ([LB.NODE], LB.STRICT)


def test_case24_cross_namespace_waypoint_selector_allowance():
    wp = waypoint(namespace="waypoint-ns", waypoint_for="service", allowed={
        "from": "Selector", "selector": {"matchLabels": {"kubernetes.io/metadata.name": "ns"}}})
    svc = service("name", labels={"istio.io/use-waypoint": "waypoint",
                                  "istio.io/use-waypoint-namespace": "waypoint-ns"})
    h = Harness(ns("ns", {"kubernetes.io/metadata.name": "ns"}), wp, svc)
    key = "ns/name.ns.svc.domain.suffix"
    assert h.service(key).waypoint.hostname.namespace == "waypoint-ns"
    assert h.index.waypoint_resources("waypoint-ns", "waypoint") == {key}
    wp["spec"]["listeners"][0]["allowedRoutes"]["namespaces"]["selector"]["matchLabels"] = {
        "kubernetes.io/metadata.name": "not-ns"}
    assert key in h.apply(wp).addresses_changed
    assert not h.service(key).HasField("waypoint")


def test_case25_canary_weighted_waypoints():
    svc = service("name", labels={"istio.io/use-waypoint": "waypoint",
                                  "istio.io/use-waypoint-canary": "canary"},
                  annotations={"istio.io/use-waypoint-canary-weight": "5"})
    h = Harness(waypoint(), waypoint("canary"), svc)
    s = h.service("ns/name.ns.svc.domain.suffix")
    assert s.waypoint.hostname.hostname == "waypoint.ns.svc.cluster.local"
    assert [(x.destination.hostname.hostname, x.weight) for x in s.weighted_waypoints] == \
        [("waypoint.ns.svc.cluster.local", 95), ("canary.ns.svc.cluster.local", 5)]
    for bad in ("abc", "101"):
        svc["metadata"]["annotations"]["istio.io/use-waypoint-canary-weight"] = bad
        h.apply(svc)
        assert not h.service("ns/name.ns.svc.domain.suffix").weighted_waypoints


def test_case26_service_entry_cidr_addresses_and_passthrough():
    se = {"kind": "ServiceEntry", "metadata": {"name": "se", "namespace": "ns"},
          "spec": {"hosts": ["cidr.example"], "addresses": ["10.0.0.5/24", "1.2.3.4/32"],
                   "resolution": "NONE", "ports": [{"number": 80, "name": "tcp"}]}}
    s = Harness(se).service("ns/cidr.example")
    assert [(ip(a.address), a.HasField("length") and a.length) for a in s.addresses] == \
        [("10.0.0.0", 24), ("1.2.3.4", False)]
    assert (s.load_balancing.mode, s.load_balancing.health_policy) == \
        (wl.LoadBalancing.PASSTHROUGH, wl.LoadBalancing.ALLOW_ALL)


def _se(name, namespace, host, created, endpoints=None):
    return {"kind": "ServiceEntry", "metadata": {"name": name, "namespace": namespace,
                                                 "creationTimestamp": created},
            "spec": {"hosts": [host], "resolution": "STATIC",
                     "ports": [{"number": 80, "name": "http"}],
                     "endpoints": endpoints or [{"address": "5.5.5.5"}]}}


def test_case27_hostname_collisions_and_canonical():
    h = Harness(_se("se-1", "ns1", "foo.com", "2024-01-01T00:00:00Z"),
                _se("se-2", "ns1", "foo.com", "2024-02-01T00:00:00Z", [{"address": "6.6.6.6"}]))
    assert h.service("ns1/foo.com").name == "se-1"
    assert h.index.address("cluster0/networking.istio.io/ServiceEntry/ns1/se-2/6.6.6.6") is None
    change = h.delete("ServiceEntry", "ns1", "se-1")
    assert h.service("ns1/foo.com").name == "se-2"
    assert "cluster0/networking.istio.io/ServiceEntry/ns1/se-2/6.6.6.6" in change.addresses_changed
    # a k8s Service beats a ServiceEntry with its hostname
    host = "svc1.ns1.svc.domain.suffix"
    h2 = Harness(service("svc1", "ns1"), _se("se-2", "ns1", host, "2020-01-01T00:00:00Z"))
    assert h2.service(f"ns1/{host}").name == "svc1"
    h2.delete("Service", "ns1", "svc1")
    s = h2.service(f"ns1/{host}")
    assert (s.name, s.canonical) == ("se-2", True)
    # across namespaces both are published, only the k8s Service is canonical
    h3 = Harness(service("svc", "team-a"),
                 _se("se", "team-b", "svc.team-a.svc.domain.suffix", "2020-01-01T00:00:00Z"))
    assert h3.service("team-a/svc.team-a.svc.domain.suffix").canonical is True
    assert h3.service("team-b/svc.team-a.svc.domain.suffix").canonical is False


def test_case28_audit_custom_and_target_ref_policies_are_not_sent():
    h = Harness(policy("audit", action="AUDIT"), policy("custom", action="CUSTOM"),
                policy("wp", targetRefs=[{"kind": "Gateway", "name": "waypoint"}]))
    assert h.index.authorizations() == {}


ALLOW_FULL_RULES = [
    {"from": [{"source": {"principals": ["principal", "principal-prefix-*", "*-suffix-principal",
                                         "*"]}}]},
    {"from": [{"source": {"serviceAccounts": ["ns/sa", "sa-only"]}}]},
    {"from": [{"source": {"ipBlocks": ["1.2.3.4", "5.6.0.0/16"]}}]},
    {"to": [{"operation": {"ports": ["80", "90"]}}]},
    {"from": [{"source": {"namespaces": ["ns"]}}]},
    {"from": [{"source": {"notPrincipals": ["x"]}}]},
    {"to": [{"operation": {"notPorts": ["8080"]}}]},
    {"from": [{"source": {"notIpBlocks": ["9.9.9.9"]}}]},
    {"when": [{"key": "source.ip", "values": ["10.0.0.1"]}]},
    {},
    {"from": [{"source": {"requestPrincipals": ["*"]}}]},
    {"from": [{"source": {"remoteIpBlocks": ["1.1.1.1"]}}]},
    {"to": [{"operation": {"methods": ["GET"]}}]},
    {"to": [{"operation": {"hosts": ["a"]}}]},
    {"to": [{"operation": {"paths": ["/a"]}}]},
    {"when": [{"key": "request.headers[x]", "values": ["y"]}]},
]


def test_case29_allow_policy_l4_translation_and_l7_rules_dropped():
    h = Harness(policy("allow", "cfg", rules=ALLOW_FULL_RULES))
    a = h.index.authorization("cfg/allow")
    assert (a.scope, a.action, len(a.groups)) == (az.NAMESPACE, az.ALLOW, 10)
    principals = a.groups[0].rules[0].matches[0].principals
    assert [p.WhichOneof("match_type") for p in principals] == \
        ["exact", "prefix", "suffix", "presence"]
    assert (principals[1].prefix, principals[2].suffix) == ("principal-prefix-", "-suffix-principal")
    sas = a.groups[1].rules[0].matches[0].service_accounts
    assert [(s.namespace, s.serviceAccount) for s in sas] == [("ns", "sa"), ("cfg", "sa-only")]
    ips = a.groups[2].rules[0].matches[0].source_ips
    assert [(ip(x.address), x.length) for x in ips] == [("1.2.3.4", 32), ("5.6.0.0", 16)]
    assert list(a.groups[3].rules[0].matches[0].destination_ports) == [80, 90]
    assert len(a.groups[9].rules) == 0  # empty rule: matches everything


def test_case30_deny_policy_keeps_l4_parts_of_l7_rules_and_l7_only_rules_deny_all():
    rules = [{"from": [{"source": {"principals": ["p"], "requestPrincipals": ["r"],
                                   "namespaces": ["n"]}}],
              "to": [{"operation": {"ports": ["80"]}}]},
             {"from": [{"source": {"requestPrincipals": ["r"]}}],
              "to": [{"operation": {"methods": ["GET"]}}]},
             {"when": [{"key": "connection.sni", "values": ["x"]}]}]
    a = Harness(policy("groups-deny", action="DENY", rules=rules)).index.authorization(
        "ns/groups-deny")
    g0 = a.groups[0]
    assert list(g0.rules[0].matches[0].destination_ports) == [80]
    m = g0.rules[1].matches[0]
    assert (m.namespaces[0].exact, m.principals[0].exact) == ("n", "p")
    # rules with only HTTP conditions deny more: no clause left, the group matches every
    # connection (istiod sends empty matches here, which ztunnel skips: a DENY that never
    # fires); see tests/ambient/test_authz_semantics.py for the evaluated behaviour
    assert len(a.groups) == 3 and list(a.groups[1].rules) == list(a.groups[2].rules) == []


def test_case31_converted_peer_authentication():
    pa = policy("pa", kind="PeerAuthentication", selector={"matchLabels": {"app": "a"}},
                mtls={"mode": "STRICT"}, portLevelMtls={"9090": {"mode": "PERMISSIVE"}})
    h = Harness(pa)
    a = h.index.authorization("ns/converted_peer_authentication_pa")
    assert (a.action, a.scope, len(a.groups)) == (az.DENY, az.WORKLOAD_SELECTOR, 1)
    clauses = a.groups[0].rules
    assert clauses[0].matches[0].not_principals[0].HasField("presence")
    assert list(clauses[1].matches[0].not_destination_ports) == [9090]
    pa["spec"] = {"selector": {"matchLabels": {"app": "a"}}, "mtls": {"mode": "PERMISSIVE"},
                  "portLevelMtls": {"9090": {"mode": "STRICT"}}}
    h.apply(pa)
    m = h.index.authorization("ns/converted_peer_authentication_pa").groups[0].rules[0].matches[0]
    assert list(m.destination_ports) == [9090] and m.not_principals[0].HasField("presence")
    pa["spec"] = {"selector": {"matchLabels": {"app": "a"}}, "mtls": {"mode": "STRICT"}}
    change = h.apply(pa)
    assert change.authorizations_removed == {"ns/converted_peer_authentication_pa"}


def test_case32_peer_authentication_keys_on_workloads():
    static = "istio-system/istio_converted_static_strict"
    h = Harness(policy("mesh", "istio-system", kind="PeerAuthentication",
                       mtls={"mode": "PERMISSIVE"}),
                policy("ns", "ns1", kind="PeerAuthentication", mtls={"mode": "STRICT"}),
                pod("pod1", "ns1", labels={"app": "a"}), pod("pod2", "ns1", ip="1.2.3.5"))
    assert list(h.workload("cluster0//Pod/ns1/pod1").authorization_policies) == [static]
    assert list(h.workload("cluster0//Pod/ns1/pod2").authorization_policies) == [static]
    wpa = policy("selector", "ns1", kind="PeerAuthentication", created="2024-02-01T00:00:00Z",
                 selector={"matchLabels": {"app": "a"}}, mtls={"mode": "PERMISSIVE"})
    change = h.apply(wpa)
    assert change.addresses_changed == {"cluster0//Pod/ns1/pod1"}
    assert list(h.workload("cluster0//Pod/ns1/pod1").authorization_policies) == []
    wpa["spec"]["portLevelMtls"] = {"9090": {"mode": "STRICT"}}
    h.apply(wpa)
    assert list(h.workload("cluster0//Pod/ns1/pod1").authorization_policies) == \
        ["ns1/converted_peer_authentication_selector"]


def test_case33_lookup_by_ip_vip_hostname_and_node():
    h = Harness(pod("pod", "default", ip="127.0.0.1", labels={"app": "a"}),
                service("svc1", "default", selector={"app": "a"}))
    uid = "cluster0//Pod/default/pod"
    key = "default/svc1.default.svc.domain.suffix"
    assert h.index.lookup("testnetwork/127.0.0.1") == [uid]
    assert h.index.lookup("testnetwork/127.0.0.2") == []
    assert h.index.lookup(uid) == [uid]
    assert h.index.lookup("testnetwork/10.0.0.1") == [key, uid]
    assert h.index.lookup(key) == [key, uid]
    assert h.index.node_workloads("node") == {uid}


def test_case35_authorization_changes_and_static_policy():
    h = Harness()
    assert h.apply(policy("policy1")).authorizations_changed == {"ns/policy1"}
    h.apply(policy("policy2"))
    assert h.delete("AuthorizationPolicy", "ns", "policy2").authorizations_removed == \
        {"ns/policy2"}
    c = h.apply(pod("p"))
    assert not c.authorizations_changed and not c.authorizations_removed
    c = h.apply(policy("pa", "other", kind="PeerAuthentication", mtls={"mode": "PERMISSIVE"}))
    assert c.authorizations_changed == {"istio-system/istio_converted_static_strict"}


def test_registered_workload_entry_runs_on_its_node():
    """An entry a host's agent registered (annotation ambient.istio.io/registered-by) has
    that node, so the host's ztunnel finds it among its own pods; others have none."""
    we = _we(labels={"app": "foo"})
    we["metadata"]["annotations"] = {"ambient.istio.io/registered-by": "host-a"}
    h = Harness(we)
    assert h.workload("cluster0/networking.istio.io/WorkloadEntry/ns/name").node == "host-a"
    h2 = Harness(_we(labels={"app": "foo"}))
    assert h2.workload("cluster0/networking.istio.io/WorkloadEntry/ns/name").node == ""
