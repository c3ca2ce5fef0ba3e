"""The incremental waypoint build (``ModelState`` + ``Assembler``, driven by the index's
changes and the store's events as the xDS server drives them) gives, after every change,
exactly the resources a fresh full build of the same store and index gives: same names,
same versions (hashes of what each is made of), same messages. Real store and index, no Envoy."""

from __future__ import annotations

import copy

from prometheus_client import CollectorRegistry

from ambient.index import AmbientIndex
from ambient.objects import Mesh
from ambient.store import ObjectStore
from ambient.waypoint import resources
from ambient.waypoint.service import WaypointConfigs

NS = "inc"


def _ns() -> dict:
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": NS, "labels": {"istio.io/dataplane-mode": "ambient"}}}


def _gateway(annotations: dict | None = None) -> dict:
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
            "metadata": {"name": "wp", "namespace": NS, "annotations": annotations or {}},
            "spec": {"gatewayClassName": "istio-waypoint",
                     "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE"}]},
            "status": {"addresses": [{"type": "IPAddress", "value": "10.201.0.1"}]}}


def _service(i: int, bound: bool = True, port_name: str = "http") -> dict:
    labels = {"istio.io/use-waypoint": "wp"} if bound else {}
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": f"s{i}", "namespace": NS, "labels": labels},
            "spec": {"clusterIP": f"10.97.0.{i + 1}", "selector": {"app": f"a{i}"},
                     "ports": [{"name": port_name, "port": 80, "targetPort": 8080}]}}


def _two_port_service(i: int) -> dict:
    """An unbound Service with ports 80 and 81 (a route backend naming one of them)."""
    out = _service(i, bound=False)
    out["spec"]["ports"].append({"name": "http-alt", "port": 81, "targetPort": 8081})
    return out


def _pod(i: int, ip: str, app: str | None = None, captured: bool = True) -> dict:
    annotations = {"ambient.istio.io/redirection": "enabled"} if captured else {}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"p{i}", "namespace": NS, "uid": f"inc-u{i}",
                         "labels": {"app": app or f"a{i}"},
                         "annotations": annotations},
            "spec": {"nodeName": "n", "serviceAccountName": "sa", "containers": [{"name": "c"}]},
            "status": {"podIP": ip, "podIPs": [{"ip": ip}], "phase": "Running",
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def _route(name: str, parent: str, prefix: str, backends: list[tuple[str, int]],
           port: int = 80) -> dict:
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": parent}],
                     "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": prefix}}],
                                "backendRefs": [{"name": b, "port": port, "weight": w}
                                                for b, w in backends]}]}}


def _kind_route(kind: str, name: str, parent: str, rules: list[dict]) -> dict:
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": kind,
            "metadata": {"name": name, "namespace": NS},
            "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": parent}],
                     "rules": rules}}


def _policy(name: str, target: dict, path: str) -> dict:
    return {"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"targetRefs": [target], "action": "DENY",
                     "rules": [{"to": [{"operation": {"paths": [path]}}]}]}}


class _World:
    def __init__(self, n: int):
        self.store = ObjectStore(CollectorRegistry())
        objs = [_ns(), _gateway()]
        for i in range(n):
            objs += [_service(i), _pod(i, f"10.150.0.{i + 1}")]
        self.store.apply([(o, "t") for o in objs])
        self.index = AmbientIndex(self.store, Mesh(), CollectorRegistry())
        self.index.start()
        self.configs = WaypointConfigs(self.store, self.index)
        self.configs.start()
        self.index.subscribe(self.configs.invalidate)
        self.opts = resources.Options()

    def incremental(self) -> dict:
        return self.configs.config(NS, "wp", self.opts).resources

    def fresh(self) -> dict:
        # a new WaypointConfigs over the same store and index: one full build
        return WaypointConfigs(self.store, self.index).config(NS, "wp", self.opts).resources


def _assert_same(got: dict, want: dict, step: str) -> None:
    assert set(got) == set(want), step
    for type_url in want:
        g = {n: v for n, (v, _m) in got[type_url].items()}
        w = {n: v for n, (v, _m) in want[type_url].items()}
        assert g == w, f"{step}: {type_url.rsplit('.', 1)[-1]} differ: " \
                       f"only ours {sorted(set(g) - set(w))}, only full {sorted(set(w) - set(g))}, " \
                       f"changed {sorted(n for n in g if n in w and g[n] != w[n])}"
        for name in w:
            assert got[type_url][name][1] == want[type_url][name][1], (step, name)


def test_every_change_gives_what_a_full_build_gives():
    w = _World(6)
    _assert_same(w.incremental(), w.fresh(), "initial")
    steps = [
        ("pod IP change", lambda: w.store.apply([(_pod(1, "10.150.1.1"), "t")])),
        ("second pod of a service", lambda: w.store.apply([(_pod(20, "10.150.2.1", "a2"), "t")])),
        ("pod deleted", lambda: w.store.apply(deletes=[("Pod", NS, "p20")])),
        ("service unbound", lambda: w.store.apply([(_service(3, bound=False), "t")])),
        ("service bound again", lambda: w.store.apply([(_service(3), "t")])),
        ("new service", lambda: w.store.apply([(_service(7), "t"), (_pod(7, "10.150.0.8"), "t")])),
        ("port renamed (protocol tcp)", lambda: w.store.apply([(_service(4, port_name="tcp"),
                                                                "t")])),
        ("service deleted", lambda: w.store.apply(deletes=[("Service", NS, "s5")])),
        ("HTTPRoute to a bound and an unbound backend",
         lambda: w.store.apply([(_service(9, bound=False), "t"), (_pod(9, "10.150.0.10"), "t"),
                                (_route("r0", "s0", "/a", [("s0", 80), ("s9", 20)]), "t")])),
        ("unbound backend's pod moves", lambda: w.store.apply([(_pod(9, "10.150.3.10"), "t")])),
        ("HTTPRoute changed", lambda: w.store.apply([(_route("r0", "s0", "/b", [("s1", 1)]),
                                                      "t")])),
        ("policy on one service", lambda: w.store.apply([(_policy(
            "p1", {"group": "", "kind": "Service", "name": "s1"}, "/deny"), "t")])),
        ("policy on the waypoint", lambda: w.store.apply([(_policy(
            "p2", {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "wp"},
            "/all"), "t")])),
        ("service policy removed", lambda: w.store.apply(
            deletes=[("AuthorizationPolicy", NS, "p1")])),
        ("HTTPRoute deleted", lambda: w.store.apply(deletes=[("HTTPRoute", NS, "r0")])),
        # istiod parity (tests/oracle/test_waypoint_oracle.py): a member outside the mesh
        # gets a plaintext endpoint; a route backend gets clusters only for the ports named
        ("member pod leaves the mesh (plaintext endpoint)", lambda: w.store.apply([(_pod(
            2, "10.150.0.3", captured=False), "t")])),
        ("member pod captured again (HBONE endpoint)", lambda: w.store.apply([(_pod(
            2, "10.150.0.3"), "t")])),
        ("second member outside the mesh", lambda: w.store.apply([(_pod(
            21, "10.150.2.21", "a1", captured=False), "t")])),
        ("HTTPRoute to port 80 of a two-port backend", lambda: w.store.apply([
            (_two_port_service(10), "t"), (_pod(10, "10.150.0.11"), "t"),
            (_route("r1", "s0", "/m", [("s10", 1)]), "t")])),
        ("that route now names port 81", lambda: w.store.apply([(_route(
            "r1", "s0", "/m", [("s10", 1)], port=81), "t")])),
        ("that backend's pod leaves the mesh", lambda: w.store.apply([(_pod(
            10, "10.150.0.11", captured=False), "t")])),
        ("GRPCRoute on a service", lambda: w.store.apply([(_kind_route(
            "GRPCRoute", "g0", "s1", [{"matches": [{"method": {"service": "pkg.Svc"}}],
                                      "backendRefs": [{"name": "s9", "port": 80}]}]), "t")])),
        ("port renamed (protocol tcp) under a TCPRoute", lambda: w.store.apply([
            (_service(6, port_name="tcp"), "t"), (_kind_route(
                "TCPRoute", "t0", "s6", [{"backendRefs": [{"name": "s9", "port": 80,
                                                          "weight": 3},
                                                         {"name": "s6", "port": 80}]}]),
             "t")])),
        ("TCPRoute backend's pod moves", lambda: w.store.apply([(_pod(9, "10.150.4.10"), "t")])),
        ("TCPRoute deleted, GRPCRoute deleted", lambda: w.store.apply(
            deletes=[("TCPRoute", NS, "t0"), ("GRPCRoute", NS, "g0")])),
        ("gateway annotation (xfcc)", lambda: w.store.apply([(_gateway(
            {resources.XFCC_ANNOTATION: "true"}), "t")])),
    ]
    before = w.incremental()
    for step, change in steps:
        change()
        got = w.incremental()
        _assert_same(got, w.fresh(), step)
        _assert_versions_follow_content(before, got, step)
        before = got
        _assert_istiod_fields(got, step)
        if step == "member pod leaves the mesh (plaintext endpoint)":
            assert _addresses(got, "s2") == [("socket", "10.150.0.3", 8080)], step
        if step == "member pod captured again (HBONE endpoint)":
            assert _addresses(got, "s2") == [("hbone", "10.150.0.3:8080", 0)], step
        if step == "second member outside the mesh":
            assert sorted(_addresses(got, "s1")) == [("hbone", "10.150.1.1:8080", 0),
                                                     ("socket", "10.150.2.21", 8080)], step
        backend = f"s10.{NS}.svc.cluster.local"
        if step == "HTTPRoute to port 80 of a two-port backend":
            assert _backend_ports(got, backend) == {80}, step
        if step == "that route now names port 81":
            assert _backend_ports(got, backend) == {81}, step
        if step == "that backend's pod leaves the mesh":
            cla = got[resources.ENDPOINT_TYPE][resources.cluster_name("http", 81, backend)][1]
            addr = cla.endpoints[0].lb_endpoints[0].endpoint.address.socket_address
            assert (addr.address, addr.port_value) == ("10.150.0.11", 8081), step


def _assert_versions_follow_content(old: dict, new: dict, step: str) -> None:
    """A resource kept by name has the same version exactly when its message is equal
    (versions of prototype copies are derived from what was set, not serialized)."""
    for type_url, items in new.items():
        for name, (version, msg) in items.items():
            if name in old.get(type_url, {}):
                old_version, old_msg = old[type_url][name]
                assert (old_version == version) == (old_msg == msg), (step, name)


def _addresses(got: dict, svc: str) -> list[tuple[str, str, int]]:
    """The endpoints of ``svc``'s port-80 HTTP cluster: ("socket", IP, port) for a
    plaintext one, ("hbone", endpoint id, 0) for one through connect_originate."""
    cla = got[resources.ENDPOINT_TYPE][resources.cluster_name(
        "http", 80, f"{svc}.{NS}.svc.cluster.local")][1]
    out = []
    for group in cla.endpoints:
        for lb in group.lb_endpoints:
            a = lb.endpoint.address
            if a.HasField("socket_address"):
                out.append(("socket", a.socket_address.address, a.socket_address.port_value))
            else:
                out.append(("hbone", a.envoy_internal_address.endpoint_id, 0))
    return out


def _backend_ports(got: dict, hostname: str) -> set[int]:
    return {int(n.split("|")[1]) for n in got[resources.CLUSTER_TYPE]
            if n.endswith("|" + hostname)}


def _assert_istiod_fields(got: dict, step: str) -> None:
    """The istiod-parity fields are in what both builds gave (so the equality above
    covers them): least request and panic off on every inbound-vip cluster, the default
    retry policy and the 500 for a missing cluster on routes, WebSocket upgrades on every
    HTTP chain, APPEND_FORWARD on connect_terminate."""
    from envoy.extensions.filters.network.http_connection_manager.v3 import (
        http_connection_manager_pb2 as hcm_pb2)

    for name, (_v, c) in got[resources.CLUSTER_TYPE].items():
        if name.startswith("inbound-vip|"):
            assert c.lb_policy == c.LEAST_REQUEST, (step, name)
            assert c.common_lb_config.HasField("healthy_panic_threshold"), (step, name)
    for name, (_v, rc) in got[resources.ROUTE_TYPE].items():
        for route in rc.virtual_hosts[0].routes:
            if route.HasField("route") and not route.route.HasField("retry_policy"):
                raise AssertionError((step, name, route.name, "no retry policy"))
            if route.HasField("route") and route.name != "default":
                assert route.route.cluster_not_found_response_code == \
                    route.route.INTERNAL_SERVER_ERROR, (step, name)
    main = got[resources.LISTENER_TYPE][resources.MAIN_INTERNAL][1]
    for chain in main.filter_chains:
        hcm_any = chain.filters[-1].typed_config
        if hcm_any.type_url.endswith("HttpConnectionManager"):
            hcm = hcm_pb2.HttpConnectionManager()
            hcm_any.Unpack(hcm)
            assert [u.upgrade_type for u in hcm.upgrade_configs] == ["websocket"], \
                (step, chain.name)
    term = got[resources.LISTENER_TYPE][resources.CONNECT_TERMINATE][1]
    hcm = hcm_pb2.HttpConnectionManager()
    term.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    assert hcm.forward_client_cert_details == hcm.APPEND_FORWARD, step


def test_a_route_change_rebuilds_only_its_service():
    w = _World(30)
    first = copy.copy(w.incremental())
    w.store.apply([(_route("r0", "s0", "/x", [("s0", 1)]), "t")])
    after = w.incremental()
    changed = {(t, n) for t in after for n in after[t]
               if n not in first[t] or first[t][n][0] != after[t][n][0]}
    name = resources.cluster_name("http", 80, f"s0.{NS}.svc.cluster.local")
    assert changed == {(resources.ROUTE_TYPE, name)}
    # and the other services' messages are the very same objects (not rebuilt)
    for type_url in (resources.CLUSTER_TYPE, resources.ENDPOINT_TYPE, resources.ROUTE_TYPE,
                     resources.LISTENER_TYPE):
        assert all(after[type_url][n][1] is first[type_url][n][1]
                   for n in first[type_url] if "|s0." not in n), type_url
