"""Route and Gateway status as istiod's Gateway controller reports them, computed from the
real store, and the same conditions in the ``/debug/mesh`` waypoint rows that
``ambient-agent status --waypoints`` prints. No Envoy, no API server."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from agent.status.mesh import MeshParts, mesh_view, render
from ambient.index import AmbientIndex
from ambient.objects import Mesh
from ambient.store import ObjectStore
from ambient.waypoint.service import WaypointConfigs
from ambient.waypoint.status import CONTROLLER, statuses

NS = "st"


def _objects() -> list[dict]:
    def svc(name, ip, labels=None):
        return {"apiVersion": "v1", "kind": "Service",
                "metadata": {"name": name, "namespace": NS, "labels": labels or {}},
                "spec": {"clusterIP": ip, "selector": {"app": name},
                         "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}}
    return [
        {"apiVersion": "v1", "kind": "Namespace",
         "metadata": {"name": NS, "labels": {"istio.io/dataplane-mode": "ambient"}}},
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
         "metadata": {"name": "wp", "namespace": NS, "generation": 3},
         "spec": {"gatewayClassName": "istio-waypoint",
                  "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE"}]},
         "status": {"addresses": [{"type": "IPAddress", "value": "10.98.0.1"}]}},
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
         "metadata": {"name": "lonely", "namespace": NS},
         "spec": {"gatewayClassName": "istio-waypoint", "listeners": []}},
        {**svc("wp", "10.98.0.1"), "spec": {
            "clusterIP": "10.98.0.1", "selector": {"app": "wp"},
            "ports": [{"name": "mesh", "port": 15008, "appProtocol": "all"}]}},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": "wp-1", "namespace": NS,
                      "labels": {"kubernetes.io/service-name": "wp"}},
         "addressType": "IPv4", "ports": [{"name": "mesh", "port": 15008}],
         "endpoints": [{"addresses": ["10.0.5.5"]}]},
        svc("web", "10.98.0.2", {"istio.io/use-waypoint": "wp"}),
        svc("other", "10.98.0.3"),
    ]


def _route(name: str, parent: str, backends: list[dict], filters: list | None = None,
           generation: int = 1) -> dict:
    rule: dict = {"backendRefs": backends}
    if filters:
        rule["filters"] = filters
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
            "metadata": {"name": name, "namespace": NS, "generation": generation},
            "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": parent}],
                     "rules": [rule]}}


def _by_type(conditions: list[dict]) -> dict[str, dict]:
    return {c["type"]: c for c in conditions}


def _store() -> ObjectStore:
    store = ObjectStore(CollectorRegistry())
    store.apply([(o, "t") for o in _objects()])
    store.apply([(r, "t") for r in [
        _route("good", "web", [{"name": "web", "port": 80, "weight": 80},
                               {"name": "other", "port": 80, "weight": 20}], generation=4),
        _route("missing-backend", "web", [{"name": "nope", "port": 80}]),
        _route("bad-port", "web", [{"name": "other", "port": 81}]),
        _route("bad-kind", "web", [{"group": "example.com", "kind": "Bucket", "name": "b"}]),
        _route("unsupported", "web", [{"name": "web", "port": 80}],
               filters=[{"type": "URLRewrite", "urlRewrite": {"hostname": "x"}}]),
        _route("unknown-filter", "web", [{"name": "web", "port": 80}],
               filters=[{"type": "ExtensionRef", "extensionRef": {"name": "x"}}]),
        _route("no-parent", "gone", [{"name": "web", "port": 80}]),
    ]])
    return store


def test_route_conditions_as_istiod_reports_them():
    routes = statuses(_store())["httproutes"]
    good = routes[f"{NS}/good"]["parents"]
    assert len(good) == 1 and good[0]["controllerName"] == CONTROLLER
    assert good[0]["parentRef"] == {"group": "", "kind": "Service", "name": "web"}
    c = _by_type(good[0]["conditions"])
    assert (c["Accepted"]["status"], c["Accepted"]["reason"], c["Accepted"]["message"]) == \
        ("True", "Accepted", "Route was valid")
    assert (c["ResolvedRefs"]["status"], c["ResolvedRefs"]["reason"]) == ("True", "ResolvedRefs")
    assert c["ResolvedWaypoints"]["status"] == "True"
    assert all(x["observedGeneration"] == 4 for x in good[0]["conditions"])

    for name, reason, text in (
            ("missing-backend", "BackendNotFound", f"backend(nope.{NS}.svc.cluster.local) "
                                                   f"not found"),
            ("bad-port", "BackendNotFound", f"backend(other.{NS}.svc.cluster.local) not found"),
            ("bad-kind", "InvalidKind", "kind 'Bucket'")):
        c = _by_type(routes[f"{NS}/{name}"]["parents"][0]["conditions"])
        assert c["Accepted"]["status"] == "True", name
        assert (c["ResolvedRefs"]["status"], c["ResolvedRefs"]["reason"]) == ("False", reason)
        assert text in c["ResolvedRefs"]["message"], (name, c["ResolvedRefs"]["message"])

    c = _by_type(routes[f"{NS}/unsupported"]["parents"][0]["conditions"])
    assert (c["Accepted"]["status"], c["Accepted"]["reason"]) == ("False", "UnsupportedValue")
    assert "spec.rules[0].filters[0].type" in c["Accepted"]["message"]  # names the field

    # a filter type istiod does not convert either: its InvalidFilter under ResolvedRefs
    c = _by_type(routes[f"{NS}/unknown-filter"]["parents"][0]["conditions"])
    assert (c["Accepted"]["status"], c["Accepted"]["message"]) == ("True", "Route was valid")
    assert (c["ResolvedRefs"]["status"], c["ResolvedRefs"]["reason"],
            c["ResolvedRefs"]["message"]) == ("False", "InvalidFilter",
                                              'unsupported filter type "ExtensionRef"')

    c = _by_type(routes[f"{NS}/no-parent"]["parents"][0]["conditions"])
    assert (c["Accepted"]["status"], c["Accepted"]["reason"], c["Accepted"]["message"]) == \
        ("False", "NoMatchingParent", 'parent service: "gone" not found')
    assert c["ResolvedWaypoints"]["message"] == "parent not found"
    assert c["ResolvedWaypoints"]["status"] == "True"  # istiod never sets it False


def test_route_to_a_service_without_use_waypoint_says_so_as_istiod():
    store = _store()
    store.apply([(_route("unlabelled", "other", [{"name": "web", "port": 80}]), "t")])
    c = _by_type(statuses(store)["httproutes"][f"{NS}/unlabelled"]["parents"][0]["conditions"])
    assert (c["ResolvedWaypoints"]["status"], c["ResolvedWaypoints"]["message"]) == (
        "True", "istio.io/use-waypoint label missing from parent and parent namespace; in "
                "ambient mode, route will not be respected")
    assert _by_type(statuses(store)["httproutes"][f"{NS}/good"]["parents"][0]["conditions"])[
        "ResolvedWaypoints"]["message"] == "All waypoints resolved"


def test_gateway_programmed_with_its_service_address():
    gws = statuses(_store())["gateways"]
    wp = gws[f"{NS}/wp"]
    c = _by_type(wp["conditions"])
    assert (c["Programmed"]["status"], c["Programmed"]["reason"]) == ("True", "Programmed")
    assert c["Accepted"]["status"] == "True" and c["Programmed"]["observedGeneration"] == 3
    assert c["Programmed"]["message"] == ("Resource programmed, assigned to service(s) "
                                          f"wp.{NS}.svc.cluster.local:15008")
    assert (c["ResolvedRefs"]["status"], c["ResolvedRefs"]["message"]) == \
        ("True", "All references resolved")
    # istiod reports the class's addresses as IPs then the Service's hostname
    assert wp["addresses"] == [{"type": "IPAddress", "value": "10.98.0.1"},
                               {"type": "Hostname", "value": f"wp.{NS}.svc.cluster.local"}]
    (listener,) = wp["listeners"]
    assert listener["name"] == "mesh" and listener["attachedRoutes"] == 0
    assert _by_type(listener["conditions"])["Accepted"]["reason"] == "Accepted"
    lonely = _by_type(gws[f"{NS}/lonely"]["conditions"])
    assert (lonely["Programmed"]["status"], lonely["Programmed"]["reason"],
            lonely["Programmed"]["message"]) == (
        "False", "AddressNotUsable", "Failed to assign to any requested addresses: hostname "
        f'"lonely.{NS}.svc.cluster.local" not found')
    assert gws[f"{NS}/lonely"]["addresses"] == []


def test_gateway_without_endpoints_or_hbone_port_is_not_programmed():
    store = _store()
    store.apply(deletes=[("EndpointSlice", NS, "wp-1")])
    c = _by_type(statuses(store)["gateways"][f"{NS}/wp"]["conditions"])
    assert (c["Programmed"]["status"], c["Programmed"]["reason"]) == ("False", "AddressNotAssigned")
    assert "no instances found" in c["Programmed"]["message"]
    store.apply([(o, "t") for o in _objects() if o["kind"] == "EndpointSlice"])
    svc = {**store.get("Service", NS, "wp")}
    svc["spec"] = {**svc["spec"], "ports": [{"name": "http", "port": 80}]}
    store.apply([(svc, "t")])
    st = statuses(store)["gateways"][f"{NS}/wp"]
    c = _by_type(st["conditions"])
    assert (c["Programmed"]["reason"], st["addresses"]) == ("AddressNotUsable", [])
    assert "port 15008 not found" in c["Programmed"]["message"]


def test_cross_namespace_backend_resolves_without_a_reference_grant_as_istiod():
    """istiod converts Service-parented (mesh) routes with ``enforceRefGrant = !mesh``:
    no ReferenceGrant is needed for a backend in another namespace."""
    store = _store()
    store.apply([({"apiVersion": "v1", "kind": "Service",
                   "metadata": {"name": "far", "namespace": "elsewhere"},
                   "spec": {"clusterIP": "10.98.0.9", "ports": [{"port": 80}]}}, "t"),
                 (_route("cross", "web", [{"name": "far", "namespace": "elsewhere",
                                           "port": 80}]), "t")])
    c = _by_type(statuses(store)["httproutes"][f"{NS}/cross"]["parents"][0]["conditions"])
    assert (c["ResolvedRefs"]["status"], c["ResolvedRefs"]["reason"]) == ("True", "ResolvedRefs")


def _view(store: ObjectStore) -> dict:
    """The mesh view ``status --services/--waypoints`` renders, of ``store``."""
    index = AmbientIndex(store, Mesh(), CollectorRegistry())
    index.start()
    try:
        return mesh_view(MeshParts(index=index, waypoints=WaypointConfigs(store, index)))
    finally:
        index.stop()


def _store_of(objects: list[dict]) -> ObjectStore:
    store = ObjectStore(CollectorRegistry())
    store.apply([(o, "t") for o in objects])
    return store


def _waypoint_row(view: dict, service: str) -> dict:
    """The one waypoint row Service ``service`` of :data:`NS` is bound to."""
    rows = [r for r in view["waypoints"]
            if f"{NS}/{service}.{NS}.svc.cluster.local" in r["bound"]]
    assert len(rows) == 1, view["waypoints"]
    return rows[0]


def test_status_waypoints_rows_carry_the_conditions():
    view = _view(_store())
    row = _waypoint_row(view, "web")
    assert row["gateway"] == f"{NS}/wp: Accepted=True,Programmed=True,ResolvedRefs=True"
    routes = dict(r.split(": ", 1) for r in row["routes"])
    assert routes[f"{NS}/good"] == "Accepted=True,ResolvedRefs=True,ResolvedWaypoints=True"
    assert routes[f"{NS}/unsupported"].startswith("Accepted=False(UnsupportedValue)")
    assert "ResolvedRefs=False(BackendNotFound)" in routes[f"{NS}/missing-backend"]
    assert f"{NS}/no-parent" not in routes  # its parent is not bound to this waypoint
    text = render(view, ["waypoints"])
    assert "Programmed=True" in text and "ResolvedRefs=False(InvalidKind" in text


def test_the_shipped_example_waypoint_is_programmed_without_endpointslices():
    """examples/cluster has no EndpointSlice (no controller writes them in the YAML
    directory); its waypoint Gateway was ``Programmed=False`` (``AddressNotAssigned``)
    while ``status --services`` listed the waypoint Service's endpoint (newuser
    finding). Without any EndpointSlice of the Service, a running pod its selector
    matches is an instance; once an EndpointSlice exists, it decides."""
    from pathlib import Path

    from ambient.source_files import parse_file, scan
    store = ObjectStore(CollectorRegistry())
    root = Path(__file__).resolve().parents[2] / "examples" / "cluster"
    for path in scan(str(root)):
        store.apply(list(parse_file(path).objects))
    conds = {c["type"]: (c["status"], c["reason"])
             for c in statuses(store)["gateways"]["demo/waypoint"]["conditions"]}
    assert conds["Programmed"] == ("True", "Programmed"), conds
    store.apply([({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                   "metadata": {"name": "waypoint-x", "namespace": "demo",
                                "labels": {"kubernetes.io/service-name": "waypoint"}},
                   "addressType": "IPv4", "endpoints": []}, "t")])
    conds = {c["type"]: (c["status"], c["reason"])
             for c in statuses(store)["gateways"]["demo/waypoint"]["conditions"]}
    assert conds["Programmed"] == ("False", "AddressNotAssigned"), conds


def test_a_waypoint_addressed_by_ip_shows_its_gateway_in_the_mesh_view():
    """A plain host's Gateway with only ``status.addresses`` (an IP, no Service of that
    name, as docs/waypoint.md suggests) was shown by ``status --waypoints`` under its IP
    with no namespace, name or conditions (newuser finding): it is found by the
    addresses its object declares."""
    ghost = {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
             "metadata": {"name": "ghost", "namespace": NS},
             "spec": {"gatewayClassName": "istio-waypoint",
                      "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE"}]},
             "status": {"addresses": [{"type": "IPAddress", "value": "127.61.0.16"}]}}
    bound = {"apiVersion": "v1", "kind": "Service",
             "metadata": {"name": "api", "namespace": NS,
                          "labels": {"istio.io/use-waypoint": "ghost"}},
             "spec": {"clusterIP": "10.98.0.9", "selector": {"app": "api"},
                      "ports": [{"name": "http", "port": 80}]}}
    row = _waypoint_row(_view(_store_of([*_objects(), ghost, bound])), "api")
    assert (row["namespace"], row["name"], row["ips"]) == (NS, "ghost", ["127.61.0.16"])
    assert row["gateway"].startswith(f"{NS}/ghost: Accepted=True,"), row


def test_a_named_target_port_is_shown_as_named_not_as_the_service_port():
    """``status --services`` showed ``80->80`` for ``targetPort: http`` (the pods listen
    on 8080): the Address leaves a named target unset, each pod resolves it (newuser
    finding)."""
    named = {"apiVersion": "v1", "kind": "Service",
             "metadata": {"name": "named", "namespace": NS},
             "spec": {"clusterIP": "10.98.0.8", "selector": {"app": "named"},
                      "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}}
    ports = {s["name"]: s["ports"] for s in _view(_store_of([*_objects(), named]))["services"]}
    assert ports["named"] == ["80->named"] and ports["web"] == ["80->8080"], ports
