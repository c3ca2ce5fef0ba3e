"""Index behaviour beyond the acceptance cases: cascades, change-only announcements, bad input,
ztunnel local-config objects."""

from __future__ import annotations

import logging

from ambient import authorization_pb2 as az
from ambient import workload_pb2 as wl
from tests.ambient.builders import Harness, ns, pod, policy, service, waypoint

UID = "cluster0//Pod/ns/name"
KEY = "ns/svc.ns.svc.domain.suffix"


def test_unchanged_proto_is_not_announced():
    p = pod("name", labels={"app": "a"})
    h = Harness(p)
    p["metadata"]["annotations"] = {"unrelated": "x"}
    p["metadata"]["resourceVersion"] = "42"
    assert h.apply(p).empty()


def test_service_selector_change_touches_only_membership_changes():
    h = Harness(pod("a", labels={"app": "a"}), pod("b", ip="1.2.3.5", labels={"app": "b"}),
                pod("c", ip="1.2.3.6", labels={"app": "c"}), service("svc", selector={"app": "a"}))
    change = h.apply(service("svc", selector={"app": "b"}))
    assert change.addresses_changed == {"cluster0//Pod/ns/a", "cluster0//Pod/ns/b"}
    assert KEY not in change.addresses_changed  # the selector is not in the proto


def test_service_delete_removes_it_and_updates_former_members():
    h = Harness(pod("name", labels={"app": "a"}), service("svc", selector={"app": "a"}))
    change = h.delete("Service", "ns", "svc")
    assert change.addresses_removed == {KEY} and change.addresses_changed == {UID}
    assert not h.workload(UID).services
    assert h.index.lookup("testnetwork/10.0.0.1") == []


def test_namespace_label_binds_waypoint_to_services_and_workloads():
    h = Harness(ns("ns"), waypoint(), pod("name"), service("svc", selector={"app": "x"}))
    change = h.apply(ns("ns", {"istio.io/use-waypoint": "waypoint"}))
    assert {UID, KEY} <= change.addresses_changed
    assert h.index.waypoint_resources("ns", "waypoint") == {UID, KEY}
    # a service-only waypoint inherited from the namespace is ignored for workloads
    h.apply(waypoint(waypoint_for="service"))
    assert not h.workload(UID).HasField("waypoint") and h.service(KEY).HasField("waypoint")
    # opt-out label
    h.apply(service("svc", selector={"app": "x"}, labels={"istio.io/use-waypoint": "none"}))
    assert not h.service(KEY).HasField("waypoint")


def test_system_namespace_network_label_changes_everything():
    h = Harness(pod("name"), service("svc"))
    change = h.apply(ns("istio-system", {"topology.istio.io/network": "other"}))
    assert {UID, KEY} <= change.addresses_changed
    assert h.workload(UID).network == "other"
    assert h.index.lookup("other/1.2.3.4") == [UID]


def test_pod_deletion_and_terminal_phase_remove_workload():
    h = Harness(pod("name"))
    assert h.apply(pod("name", phase="Succeeded")).addresses_removed == {UID}
    h.apply(pod("name"))
    assert h.delete("Pod", "ns", "name").addresses_removed == {UID}


def test_shared_ip_lookup_returns_every_workload():
    we = {"kind": "WorkloadEntry", "metadata": {"name": "we", "namespace": "ns"},
          "spec": {"address": "1.2.3.4"}}
    h = Harness(pod("name"), we)
    assert h.index.lookup("testnetwork/1.2.3.4") == [
        UID, "cluster0/networking.istio.io/WorkloadEntry/ns/we"]


def test_hbone_only_for_pods_annotated_captured():
    """Issue 13 item 7: as istiod's setTunnelProtocol, HBONE follows the node agent's
    ``ambient.istio.io/redirection: enabled`` (written once the pod is enrolled); labels
    that select a pod for ambient are not enough (nothing listens on its 15008 yet)."""
    ambient_ns = ns("ns", {"istio.io/dataplane-mode": "ambient"})
    h = Harness(ambient_ns, pod("name"),
                pod("lbl", ip="1.2.3.8", labels={"istio.io/dataplane-mode": "ambient"}))
    assert h.workload(UID).tunnel_protocol == wl.NONE
    assert h.workload("cluster0//Pod/ns/lbl").tunnel_protocol == wl.NONE
    assert h.workload(UID).trust_domain == ""  # cluster.local is elided
    h.apply(pod("name", annotations={"ambient.istio.io/redirection": "enabled"}))
    assert h.workload(UID).tunnel_protocol == wl.HBONE
    h.apply(pod("name", annotations={"ambient.istio.io/redirection": "disabled"}))
    assert h.workload(UID).tunnel_protocol == wl.NONE
    native = Harness(pod("name", labels={"networking.istio.io/tunnel": "http"}))
    assert (native.workload(UID).tunnel_protocol, native.workload(UID).native_tunnel) == \
        (wl.HBONE, True)


def test_bad_input_is_skipped_with_reason_and_counter(caplog):
    caplog.set_level(logging.WARNING)
    h = Harness()
    bad_pod = pod("bad", ip="999.1.1.1")
    bad_svc = service("bad", ports=[{"port": "eighty"}])
    bad_ap = policy("bad", rules="not-a-list")
    odd_ap = policy("odd", rules=[{"from": [{"source": {"principals": ["a"], "bogus": ["x"]}}]}])
    nothing = service("nothing", selector={"app": "does-not-exist"})
    change = h.apply(bad_pod, bad_svc, bad_ap, odd_ap, nothing, pod("good", ip="1.2.3.7"))
    assert "cluster0//Pod/ns/good" in change.addresses_changed
    assert "ns/nothing.ns.svc.domain.suffix" in change.addresses_changed
    assert h.index.address("cluster0//Pod/ns/bad") is None
    assert h.index.address("ns/bad.ns.svc.domain.suffix") is None
    bad = h.index.authorization("ns/bad")  # sent closed, never dropped: an ALLOW of nothing
    assert bad is not None and bad.action == az.ALLOW and not bad.groups
    assert h.index.authorization("ns/odd") is not None  # unknown field: ignored, logged
    text = caplog.text
    assert "Pod ns/bad" in text and "999.1.1.1" in text
    assert "spec.ports[0].port" in text and "spec.rules" in text
    assert "rules[0].from[0].source.bogus" in text
    assert h.counter("ambient_agent_index_rejected_total", kind="Pod") == 1
    assert h.counter("ambient_agent_index_rejected_total", kind="AuthorizationPolicy") == 2
    # a fixed object replaces the skipped one
    assert h.apply(pod("bad", ip="1.2.3.8")).addresses_changed == {"cluster0//Pod/ns/bad"}


def test_store_rejects_malformed_and_duplicate_uid_objects():
    h = Harness(pod("a"))
    dup = pod("b", ip="1.2.3.5")
    dup["metadata"]["uid"] = "uid-ns-a"
    change = h.apply(dup, {"kind": "Pod", "metadata": {"namespace": "ns"}}, ["not", "a", "dict"],
                     {"kind": "Secret", "metadata": {"name": "s"}})
    assert change.empty()
    assert h.counter("ambient_agent_config_objects_rejected_total", source="files",
                     reason="duplicate-uid") == 1
    assert h.counter("ambient_agent_config_objects_rejected_total", source="files",
                     reason="invalid") == 3
    assert h.store.pod_by_uid("uid-ns-a")["metadata"]["name"] == "a"


def test_local_config_objects_map_one_to_one():
    from ambient.localconfig import to_objects
    doc = {"workloads": [{"uid": "cluster1//Pod/default/local", "name": "local",
                          "namespace": "default", "serviceAccount": "default",
                          "workloadIps": ["127.0.0.1"], "protocol": "HBONE", "node": "local",
                          "services": {"default/example.com": {80: 8080}},
                          "waypoint": {"destination": "/10.0.0.5", "hboneMtlsPort": 15008}}],
           "services": [{"name": "local", "namespace": "default", "hostname": "example.com",
                         "vips": ["/127.10.0.1"], "ports": {80: 8080}}],
           "policies": [{"name": "deny-9999", "namespace": "default", "scope": "Namespace",
                         "action": "Deny", "dryRun": False,
                         "rules": [[[{"notDestinationPorts": [9999]}]]]}]}
    objs = [o for o, _, err in to_objects(doc) if not err]
    h = Harness(*objs)
    w = h.workload("cluster1//Pod/default/local")
    assert (w.tunnel_protocol, w.waypoint.address.network, w.waypoint.hbone_mtls_port) == \
        (wl.HBONE, "", 15008)
    assert [(p.service_port, p.target_port) for p in w.services["default/example.com"].ports] \
        == [(80, 8080)]
    assert h.index.lookup("/127.10.0.1") == ["default/example.com",
                                             "cluster1//Pod/default/local"]
    a = h.index.authorization("default/deny-9999")
    assert list(a.groups[0].rules[0].matches[0].not_destination_ports) == [9999]


def test_inbound_binding_selects_the_bound_listener_for_allowed_namespaces():
    """Istio ``findBoundListener``: the binding's port, else for PROXY the
    ``istio.io/PROXY`` listener, decides allowedRoutes; otherwise the HBONE/15008 one."""
    from ambient.waypoints import waypoint_from_gateway

    def gw(binding=None, proxy_port=15088):
        g = waypoint(annotations={"ambient.istio.io/waypoint-inbound-binding": binding}
                     if binding else None)
        g["spec"]["listeners"].append({"name": "proxy", "port": proxy_port,
                                       "protocol": "istio.io/PROXY",
                                       "allowedRoutes": {"namespaces": {"from": "All"}}})
        return g

    assert waypoint_from_gateway(gw(), None, "").allowed_from == "Same"
    assert waypoint_from_gateway(gw("PROXY/15088"), None, "").allowed_from == "All"
    assert waypoint_from_gateway(gw("PROXY"), None, "").allowed_from == "All"
    assert waypoint_from_gateway(gw("NONE/15088"), None, "").allowed_from == "All"
    assert waypoint_from_gateway(gw("NONE"), None, "").allowed_from == "Same"
    assert waypoint_from_gateway(gw("PROXY/9999"), None, "").allowed_from == "Same"
