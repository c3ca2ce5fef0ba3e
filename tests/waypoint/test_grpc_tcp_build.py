"""GRPCRoute and TCPRoute -> the waypoint's Envoy resources, as istiod converts them
(``convertGRPCRoute``/``createGRPCURIMatch``, ``convertTCPRoute`` +
``buildWaypointNetworkFilters``), built from the real store and index (no Envoy: the
Envoy tests are tests/waypoint/test_envoy_grpc_tcp.py). Every resource is a parsed Envoy
protobuf, so nothing here is a config Envoy would reject for its shape; the computed
status of each kind, and the warnings naming each unsupported field."""

from __future__ import annotations

import logging

import pytest
from google.protobuf import json_format
from prometheus_client import CollectorRegistry

from ambient.index import AmbientIndex
from ambient.objects import Mesh
from ambient.store import ObjectStore
from ambient.waypoint import resources, tcproute
from ambient.waypoint.model import build_model
from ambient.waypoint.status import statuses

NS = "gt"
GW = "gateway.networking.k8s.io/v1"
HOST = f"svc.{NS}.svc.cluster.local"


def _svc(name: str, ip: str, ports: list[dict], bound: bool = False) -> dict:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": NS,
                         "labels": {"istio.io/use-waypoint": "wp"} if bound else {}},
            "spec": {"clusterIP": ip, "selector": {"app": name}, "ports": ports}}


def _pod(name: str, ip: str, app: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "uid": f"gt-{name}",
                         "labels": {"app": app},
                         "annotations": {"ambient.istio.io/redirection": "enabled"}},
            "spec": {"nodeName": "n", "serviceAccountName": "sa", "containers": [{"name": "c"}]},
            "status": {"podIP": ip, "podIPs": [{"ip": ip}], "phase": "Running",
                       "conditions": [{"type": "Ready", "status": "True"}]}}


PORTS = [{"name": "grpc", "port": 50051}, {"name": "tcp-db", "port": 9000},
         {"name": "http", "port": 80}, {"name": "other", "port": 7000}]


def _world(*extra: dict) -> tuple[ObjectStore, AmbientIndex]:
    store = ObjectStore(CollectorRegistry())
    objs = [
        {"apiVersion": "v1", "kind": "Namespace",
         "metadata": {"name": NS, "labels": {"istio.io/dataplane-mode": "ambient"}}},
        {"apiVersion": GW, "kind": "Gateway", "metadata": {"name": "wp", "namespace": NS},
         "spec": {"gatewayClassName": "istio-waypoint",
                  "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE"}]},
         "status": {"addresses": [{"type": "IPAddress", "value": "10.202.0.1"}]}},
        _svc("svc", "10.96.1.1", PORTS, bound=True), _pod("p0", "10.151.0.1", "svc"),
        _svc("a", "10.96.1.2", PORTS), _pod("p1", "10.151.0.2", "a"),
        _svc("b", "10.96.1.3", PORTS), _pod("p2", "10.151.0.3", "b"),
        *extra]
    store.apply([(o, "t") for o in objs])
    index = AmbientIndex(store, Mesh(), CollectorRegistry())
    index.start()
    return store, index


def _build(*extra: dict) -> tuple[dict, list[str], ObjectStore]:
    store, index = _world(*extra)
    built, problems = resources.build(build_model(store, index, NS, "wp"))
    out = {t: {n: json_format.MessageToDict(m, preserving_proto_field_name=True)
               for n, m in items.items()} for t, items in built.items()}
    return out, problems, store


def _grpc(name: str, rules: list[dict], port: int | None = 50051, ts: str = "") -> dict:
    ref: dict = {"group": "", "kind": "Service", "name": "svc"}
    if port:
        ref["port"] = port
    meta: dict = {"name": name, "namespace": NS}
    if ts:
        meta["creationTimestamp"] = ts
    return {"apiVersion": GW, "kind": "GRPCRoute", "metadata": meta,
            "spec": {"parentRefs": [ref], "rules": rules}}


def _tcp(name: str, rules: list[dict], port: int | None = 9000, ts: str = "",
         kind: str = "TCPRoute") -> dict:
    ref: dict = {"group": "", "kind": "Service", "name": "svc"}
    if port:
        ref["port"] = port
    meta: dict = {"name": name, "namespace": NS}
    if ts:
        meta["creationTimestamp"] = ts
    return {"apiVersion": GW, "kind": kind, "metadata": meta,
            "spec": {"parentRefs": [ref], "rules": rules}}


def _to(*backends: tuple[str, int, int]) -> list[dict]:
    return [{"name": n, "port": p, "weight": w} for n, p, w in backends]


def _routes(out: dict, port: int) -> list[dict]:
    rc = out[resources.ROUTE_TYPE][resources.cluster_name("http", port, HOST)]
    return rc["virtual_hosts"][0]["routes"]


def _tcp_proxy(out: dict, port: int) -> dict:
    main = out[resources.LISTENER_TYPE][resources.MAIN_INTERNAL]
    chain = next(fc for fc in main["filter_chains"]
                 if fc["name"] == resources.cluster_name("tcp", port, HOST))
    return chain["filters"][-1]["typed_config"]


def test_grpc_method_matches_as_istiod_converts_them():
    out, problems, _ = _build(_grpc("r", [
        {"matches": [{"method": {"service": "pkg.Svc", "method": "Get"}}],
         "backendRefs": _to(("a", 50051, 1))},
        {"matches": [{"method": {"service": "pkg.Svc"}}], "backendRefs": _to(("a", 50051, 1))},
        {"matches": [{"method": {"method": "List"}}], "backendRefs": _to(("b", 50051, 1))},
        {"matches": [{"method": {"type": "RegularExpression", "service": "pkg\\..*"}}],
         "backendRefs": _to(("b", 50051, 1))},
        {"matches": [{"method": {"type": "RegularExpression", "service": "p.*",
                                 "method": "W.*"}}], "backendRefs": _to(("b", 50051, 1))},
        {"matches": [{"headers": [{"name": "X-Tier", "type": "RegularExpression",
                                   "value": "gold|silver"}]}],
         "backendRefs": _to(("a", 50051, 3), ("b", 50051, 1))},
        {"backendRefs": _to(("b", 50051, 1))},
    ]))
    assert problems == []
    routes = _routes(out, 50051)
    got = [(r["match"], None if "route" not in r else r["route"].get("cluster") or
            [c["weight"] for c in r["route"]["weighted_clusters"]["clusters"]])
           for r in routes]
    a = resources.cluster_name("http", 50051, f"a.{NS}.svc.cluster.local")
    b = resources.cluster_name("http", 50051, f"b.{NS}.svc.cluster.local")
    # istiod's sort: exact, prefix, regex (longer first), no path; a rule without matches last
    assert got == [
        ({"path": "/pkg.Svc/Get"}, a),
        ({"path_separated_prefix": "/pkg.Svc"}, a),
        # equally long regexes keep the rules' order
        ({"safe_regex": {"regex": "/[^/]+/List"}}, b),
        ({"safe_regex": {"regex": "/pkg\\..*/.+"}}, b),
        ({"safe_regex": {"regex": "/p.*/W.*"}}, b),
        ({"prefix": "/", "headers": [{"name": "x-tier", "string_match": {
            "safe_regex": {"regex": "gold|silver"}}}]}, [3, 1]),
        ({"prefix": "/"}, b),
        ({"prefix": "/"}, None),  # the 404 after an attached route's rules
    ]
    assert routes[-1]["direct_response"]["status"] == 404
    # a GRPCRoute has no timeouts/retries of its own: istiod's defaults
    assert routes[0]["route"]["retry_policy"]["num_retries"] == 2
    # only the port the parentRef names: port 80's chain keeps its default route
    assert [r["name"] for r in _routes(out, 80)] == ["default"]


def test_grpc_and_http_routes_grouped_by_kind_oldest_first():
    http = {"apiVersion": GW, "kind": "HTTPRoute",
            "metadata": {"name": "h", "namespace": NS, "creationTimestamp": "2026-01-02T00:00:00Z"},
            "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "svc",
                                     "port": 50051}],
                     "rules": [{"matches": [{"path": {"type": "Exact", "value": "/x/y"}}],
                                "backendRefs": _to(("b", 50051, 1))}]}}
    grpc_route = _grpc("g", [{"matches": [{"method": {"service": "pkg.Svc"}}],
                              "backendRefs": _to(("a", 50051, 1))}],
                       ts="2026-01-01T00:00:00Z")
    out, _, _ = _build(http, grpc_route)
    # the GRPCRoute is older: its VirtualService, and so its routes, come first (istiod
    # keeps one merged VirtualService per kind and concatenates them by age)
    assert [r["match"] for r in _routes(out, 50051)][:2] == [{"path_separated_prefix": "/pkg.Svc"},
                                                             {"path": "/x/y"}]


def test_grpc_unsupported_fields_warned_and_not_accepted():
    route = _grpc("bad", [
        {"matches": [{"method": {"type": "Exact"}}], "backendRefs": _to(("a", 50051, 1))},
        {"matches": [{"method": {"service": "pkg.Svc"}}],
         "filters": [{"type": "RequestMirror", "requestMirror": {"backendRef": {
             "name": "b", "port": 50051}}}],
         "sessionPersistence": {"type": "Cookie"},
         "backendRefs": _to(("a", 50051, 1))}])
    route["spec"]["rules"].append({"matches": [
        {"method": {"type": "RegularExpression", "service": "(?P<x>a)(?P=x)"}},
        {"method": {"type": "RegularExpression", "method": "G(?=e)t"}}],
        "backendRefs": _to(("a", 50051, 1))})
    out, problems, store = _build(route)
    assert any("spec.rules[2].matches[0].method' regex '/(?P<x>a)(?P=x)/.+' is not "
               "supported: it is not an RE2 regular expression" in p for p in problems), problems
    assert any("spec.rules[2].matches[1].method' regex '/[^/]+/G(?=e)t'" in p
               for p in problems), problems
    assert any("spec.rules[0].matches[0].method' needs 'service' or 'method'" in p
               for p in problems), problems
    assert any("spec.rules[1].filters[0].type' 'RequestMirror'" in p for p in problems)
    assert any("spec.rules[1].sessionPersistence' is not supported" in p for p in problems)
    # the rest is served
    assert [r["match"] for r in _routes(out, 50051)] == [{"path_separated_prefix": "/pkg.Svc"},
                                                         {"prefix": "/"}]
    parent = statuses(store)["grpcroutes"][f"{NS}/bad"]["parents"][0]
    accepted = parent["conditions"][0]
    assert (accepted["type"], accepted["status"], accepted["reason"]) == (
        "Accepted", "False", "UnsupportedValue")
    assert "RequestMirror" in accepted["message"] and "sessionPersistence" in accepted["message"]


def test_tcproute_weighted_single_and_zero_weight():
    out, problems, store = _build(_tcp("w", [{"backendRefs": _to(("a", 9000, 80),
                                                                 ("b", 9000, 20))}]))
    assert problems == []
    proxy = _tcp_proxy(out, 9000)
    assert proxy["weighted_clusters"] == {"clusters": [
        {"name": resources.cluster_name("tcp", 9000, f"a.{NS}.svc.cluster.local"),
         "weight": 80},
        {"name": resources.cluster_name("tcp", 9000, f"b.{NS}.svc.cluster.local"),
         "weight": 20}]}
    assert "cluster" not in proxy
    # the backends' clusters exist (tcp subset: their port is TCP) with their endpoints
    for host in (f"a.{NS}.svc.cluster.local", f"b.{NS}.svc.cluster.local"):
        name = resources.cluster_name("tcp", 9000, host)
        assert name in out[resources.CLUSTER_TYPE] and out[resources.ENDPOINT_TYPE][name]
    # the chain on port 7000 (undeclared: sniffed) is not the route's port: unchanged
    assert _tcp_proxy(out, 7000)["cluster"] == resources.cluster_name("tcp", 7000, HOST)
    st = statuses(store)["tcproutes"][f"{NS}/w"]["parents"][0]["conditions"]
    assert [(c["type"], c["status"]) for c in st] == [
        ("Accepted", "True"), ("ResolvedRefs", "True"), ("ResolvedWaypoints", "True")]

    out, _, _ = _build(_tcp("one", [{"backendRefs": _to(("a", 9000, 5), ("b", 9000, 0))}]))
    assert _tcp_proxy(out, 9000)["cluster"] == resources.cluster_name(
        "tcp", 9000, f"a.{NS}.svc.cluster.local")

    out, _, _ = _build(_tcp("zero", [{"backendRefs": _to(("a", 9000, 0))}]))
    assert _tcp_proxy(out, 9000)["cluster"] == tcproute.ZERO_WEIGHT_CLUSTER
    # a backend port that is HTTP or undeclared is reached by its http cluster (portToSubset)
    out, _, _ = _build(_tcp("http-backend", [{"backendRefs": _to(("a", 80, 1))}]))
    assert _tcp_proxy(out, 9000)["cluster"] == resources.cluster_name(
        "http", 80, f"a.{NS}.svc.cluster.local")


def test_tcproute_without_port_applies_to_every_tcp_chain_not_http():
    out, _, _ = _build(_tcp("all", [{"backendRefs": _to(("a", 9000, 1))}], port=None))
    a = resources.cluster_name("tcp", 9000, f"a.{NS}.svc.cluster.local")
    assert _tcp_proxy(out, 9000)["cluster"] == a
    assert _tcp_proxy(out, 7000)["cluster"] == a  # the TCP side of a sniffed port
    # HTTP ports have no TCP chain, and their routes are the HTTP kinds' only
    assert [r["name"] for r in _routes(out, 80)] == ["default"]


def test_tcproute_oldest_route_first_rule_and_bad_backends(caplog):
    old = _tcp("old", [{"backendRefs": _to(("a", 9000, 1))},
                       {"backendRefs": _to(("b", 9000, 1))}], ts="2026-01-01T00:00:00Z")
    new = _tcp("new", [{"backendRefs": _to(("b", 9000, 1))}], ts="2026-02-01T00:00:00Z")
    out, problems, store = _build(new, old)
    assert _tcp_proxy(out, 9000)["cluster"] == resources.cluster_name(
        "tcp", 9000, f"a.{NS}.svc.cluster.local")
    assert any(f"TCPRoute {NS}/old: field 'spec.rules[1]' is not used" in p for p in problems)
    assert any(f"TCPRoute {NS}/new: is not used for port 9000" in p for p in problems)
    # istiod accepts both (a rule it does not use is not an unsupported value)
    for name in ("old", "new"):
        cond = statuses(store)["tcproutes"][f"{NS}/{name}"]["parents"][0]["conditions"][0]
        assert cond["status"] == "True", (name, cond)

    bad = _tcp("bad", [{"backendRefs": [
        {"name": "x", "kind": "Backend", "group": "example.com", "port": 9000},
        {"name": "missing", "port": 9000}]}])
    out, problems, store = _build(bad)
    assert _tcp_proxy(out, 9000)["cluster"] == tcproute.ZERO_WEIGHT_CLUSTER
    for text in ("backendRefs[0]' kind 'Backend' is not supported",
                 "backendRefs[1]' Service 'missing' port 9000 does not resolve"):
        assert any(text in p for p in problems), (text, problems)
    conds = {c["type"]: c for c in
             statuses(store)["tcproutes"][f"{NS}/bad"]["parents"][0]["conditions"]}
    assert (conds["ResolvedRefs"]["status"], conds["ResolvedRefs"]["reason"]) == (
        "False", "InvalidKind")
    # values the CRD refuses (no port for a Service, a negative weight): not served at all
    base, _, _ = _build()
    invalid = _tcp("invalid", [{"backendRefs": [
        {"name": "a"}, {"name": "b", "port": 9000, "weight": -1}]}])
    out, problems, store = _build(invalid)
    assert _tcp_proxy(out, 9000) == _tcp_proxy(base, 9000)
    (warning,) = [p for p in problems if f"TCPRoute {NS}/invalid" in p]
    for text in ("field 'spec.rules[0].backendRefs[0].port' value None: is required",
                 "field 'spec.rules[0].backendRefs[1].weight' value -1: must be an integer"):
        assert text in warning, (text, warning)
    conds = {c["type"]: c for c in
             statuses(store)["tcproutes"][f"{NS}/invalid"]["parents"][0]["conditions"]}
    assert (conds["Accepted"]["status"], conds["Accepted"]["reason"]) == (
        "False", "UnsupportedValue")
    assert "backendRefs[1].weight' value -1" in conds["Accepted"]["message"]


@pytest.mark.parametrize("kind", ["GRPCRoute", "TCPRoute"])
def test_route_to_a_service_not_bound_or_missing_changes_nothing(kind, caplog):
    caplog.set_level(logging.WARNING)
    route = _tcp("elsewhere", [{"backendRefs": _to(("a", 9000, 1))}], kind=kind)
    route["spec"]["parentRefs"][0]["name"] = "a"  # not bound to this waypoint
    base, _, _ = _build()
    out, problems, store = _build(route)
    assert out == base and problems == []
    route["spec"]["parentRefs"][0]["name"] = "nope"
    _, _, store = _build(route)
    section = "tcproutes" if kind == "TCPRoute" else "grpcroutes"
    cond = statuses(store)[section][f"{NS}/elsewhere"]["parents"][0]["conditions"][0]
    assert (cond["status"], cond["reason"]) == ("False", "NoMatchingParent")


def test_route_regexes_envoy_would_reject_leave_the_route_out():
    """The same RE2 check guards HTTPRoute's path, header and query regexes and
    GRPCRoute's header regexes (one bad regex would make Envoy reject the whole route
    table): such a route is not accepted and not served, every bad field is named, and
    the chain keeps its default route (as if the API server had refused the object)."""
    def rule(match: dict) -> dict:
        return {"matches": [match], "backendRefs": _to(("a", 80, 1))}
    http = {"apiVersion": GW, "kind": "HTTPRoute", "metadata": {"name": "h", "namespace": NS},
            "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "svc",
                                     "port": 80}],
                     "rules": [
                         rule({"path": {"type": "RegularExpression", "value": "/a(?=b)"}}),
                         rule({"headers": [{"name": "h", "type": "RegularExpression",
                                            "value": "x" * 150}]}),
                         rule({"queryParams": [{"name": "q", "type": "RegularExpression",
                                                "value": "(unclosed"}]}),
                         rule({"path": {"type": "RegularExpression", "value": "/ok/[0-9]+"}})]}}
    grpc = _grpc("g", [{"matches": [{"headers": [{"name": "h", "type": "RegularExpression",
                                                   "value": "[" + "a" * 200 + "]{200}"}]}],
                        "backendRefs": _to(("a", 50051, 1))}])
    baseline, _, _ = _build()
    out, problems, store = _build(http, grpc)
    texts = ("field 'spec.rules[0].matches[0].path.value' value '/a(?=b)': is not an RE2",
             "field 'spec.rules[1].matches[0].headers[0].value' value 'xxx",
             "field 'spec.rules[2].matches[0].queryParams[0].value' value '(unclosed': is not")
    (warning,) = [p for p in problems if f"HTTPRoute {NS}/h" in p]
    assert "not accepted, not served" in warning
    for text in texts:
        assert text in warning, (text, warning)
    (warning,) = [p for p in problems if f"GRPCRoute {NS}/g" in p]
    assert "field 'spec.rules[0].matches[0].headers[0].value'" in warning
    assert "more than Envoy's limit of 100" in warning
    assert _routes(out, 80) == _routes(baseline, 80)
    assert _routes(out, 50051) == _routes(baseline, 50051)
    st = statuses(store)
    for section, name in (("httproutes", "h"), ("grpcroutes", "g")):
        accepted = st[section][f"{NS}/{name}"]["parents"][0]["conditions"][0]
        assert (accepted["status"], accepted["reason"]) == ("False", "UnsupportedValue")
    message = st["httproutes"][f"{NS}/h"]["parents"][0]["conditions"][0]["message"]
    assert all(t in message for t in texts), message


def test_http_only_allow_is_enforced_on_http_chains_and_named_on_tcp_chains():
    """An ALLOW naming methods targets the waypoint: its HTTP chains carry the rule; a TCP
    chain cannot check methods, so the rule is dropped there (allows less), and the warning
    names that chain, not the policy as a whole (a bare "rule is dropped" read as if the
    policy were not enforced)."""
    out, problems, _ = _build({
        "apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
        "metadata": {"name": "get-only", "namespace": NS},
        "spec": {"targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                 "name": "wp"}],
                 "action": "ALLOW", "rules": [{"to": [{"operation": {"methods": ["GET"]}}]}]}})
    dropped = [p for p in problems if "get-only" in p]
    assert dropped and all(p.startswith("filter chain '") and "(TCP, no HTTP attributes)" in p
                           and "allows less" in p for p in dropped), dropped
    main = out[resources.LISTENER_TYPE][resources.MAIN_INTERNAL]
    http = next(fc for fc in main["filter_chains"]
                if fc["name"] == resources.cluster_name("http", 80, HOST))
    hcm = http["filters"][-1]["typed_config"]
    rbac = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.rbac")
    assert "GET" in str(rbac["typed_config"]["rules"])
