"""Gateway API values the CRD schema refuses or Envoy would NACK, and malformed structure:
each makes the route (or Gateway) ``Accepted=False`` with a message naming the field and
the value, the waypoint build leaves it out with one warning, and every other route is
built as before. Real store, index and Envoy protobuf builder; no Envoy here (the Envoy
test is tests/waypoint/test_envoy_bad_values.py)."""

from __future__ import annotations

import copy

import pytest
from google.protobuf import json_format
from prometheus_client import CollectorRegistry

from agent.status.mesh import MeshParts, mesh_view, render
from ambient.index import AmbientIndex
from ambient.objects import Mesh
from ambient.store import ObjectStore
from ambient.waypoint import gwvalues, resources
from ambient.waypoint.model import build_model
from ambient.waypoint.service import WaypointConfigs
from ambient.waypoint.status import statuses

NS = "gv"
GW = "gateway.networking.k8s.io/v1"
ROUTES = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"


def _svc(name: str, ip: str, bound: bool = False) -> dict:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": NS,
                         "labels": {"istio.io/use-waypoint": "wp"} if bound else {}},
            "spec": {"clusterIP": ip, "selector": {"app": name},
                     "ports": [{"name": "http", "port": 80}]}}


GATEWAY = {"apiVersion": GW, "kind": "Gateway", "metadata": {"name": "wp", "namespace": NS},
           "spec": {"gatewayClassName": "istio-waypoint",
                    "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE"}]},
           "status": {"addresses": [{"type": "IPAddress", "value": "10.203.0.1"}]}}


def _world(*extra: dict, gateway: dict | None = None) -> tuple[ObjectStore, AmbientIndex]:
    store = ObjectStore(CollectorRegistry())
    objs = [{"apiVersion": "v1", "kind": "Namespace",
             "metadata": {"name": NS, "labels": {"istio.io/dataplane-mode": "ambient"}}},
            gateway or GATEWAY, _svc("web", "10.97.1.1", bound=True),
            _svc("other", "10.97.1.2", bound=True), _svc("b", "10.97.1.3"), *extra]
    store.apply([(o, "t") for o in objs])
    index = AmbientIndex(store, Mesh(), CollectorRegistry())
    index.start()
    return store, index


def _route(name: str, rule: dict, parent: str = "web", kind: str = "HTTPRoute") -> dict:
    return {"apiVersion": GW, "kind": kind, "metadata": {"name": name, "namespace": NS},
            "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": parent}],
                     "rules": [rule]}}


GOOD_RULE = {"matches": [{"path": {"type": "PathPrefix", "value": "/ok"}}],
             "backendRefs": [{"name": "b", "port": 80}]}


def _rule(**fields) -> dict:
    rule = copy.deepcopy(GOOD_RULE)
    rule.update(fields)
    return rule


def _modifier(**fields) -> dict:
    return _rule(filters=[{"type": "RequestHeaderModifier", "requestHeaderModifier": fields}])


#: (case, rule, field named, value named)
BAD_VALUES = [
    ("path-not-absolute", _rule(matches=[{"path": {"type": "PathPrefix", "value": "ok"}}]),
     "spec.rules[0].matches[0].path.value", "'ok'"),
    ("path-exact-dotdot", _rule(matches=[{"path": {"type": "Exact", "value": "/a/../b"}}]),
     "spec.rules[0].matches[0].path.value", "'/a/../b'"),
    ("path-query", _rule(matches=[{"path": {"value": "/a?b"}}]),
     "spec.rules[0].matches[0].path.value", "'/a?b'"),
    ("path-type", _rule(matches=[{"path": {"type": "Glob", "value": "/a"}}]),
     "spec.rules[0].matches[0].path.type", "'Glob'"),
    ("path-regex", _rule(matches=[{"path": {"type": "RegularExpression", "value": "/(a"}}]),
     "spec.rules[0].matches[0].path.value", "'/(a'"),
    ("header-regex", _rule(matches=[{"headers": [
        {"name": "x", "type": "RegularExpression", "value": "(?<n>a)\\k<n>"}]}]),
     "spec.rules[0].matches[0].headers[0].value", "'(?<n>a)\\\\k<n>'"),
    ("header-name", _rule(matches=[{"headers": [{"name": "bad header", "value": "v"}]}]),
     "spec.rules[0].matches[0].headers[0].name", "'bad header'"),
    ("header-name-pseudo", _rule(matches=[{"headers": [{"name": ":path", "value": "/"}]}]),
     "spec.rules[0].matches[0].headers[0].name", "':path'"),
    ("method", _rule(matches=[{"method": "FETCH"}]),
     "spec.rules[0].matches[0].method", "'FETCH'"),
    ("weight-negative", _rule(backendRefs=[{"name": "b", "port": 80, "weight": -1}]),
     "spec.rules[0].backendRefs[0].weight", "-1"),
    ("weight-too-big", _rule(backendRefs=[{"name": "b", "port": 80, "weight": 1_000_001}]),
     "spec.rules[0].backendRefs[0].weight", "1000001"),
    ("weight-not-int", _rule(backendRefs=[{"name": "b", "port": 80, "weight": "5"}]),
     "spec.rules[0].backendRefs[0].weight", "'5'"),
    ("timeout-unparsable", _rule(timeouts={"request": "10 seconds"}),
     "spec.rules[0].timeouts.request", "'10 seconds'"),
    ("timeout-out-of-range", _rule(timeouts={"request": "99999999999999h"}),
     "spec.rules[0].timeouts.request", "'99999999999999h'"),
    ("timeout-backend-longer", _rule(timeouts={"request": "1s", "backendRequest": "2s"}),
     "spec.rules[0].timeouts.backendRequest", "'2s'"),
    ("port-zero", _rule(backendRefs=[{"name": "b", "port": 0}]),
     "spec.rules[0].backendRefs[0].port", "0"),
    ("port-too-big", _rule(backendRefs=[{"name": "b", "port": 65536}]),
     "spec.rules[0].backendRefs[0].port", "65536"),
    ("port-missing", _rule(backendRefs=[{"name": "b"}]),
     "spec.rules[0].backendRefs[0].port", "None"),
    ("modifier-name", _modifier(set=[{"name": "a b", "value": "v"}]),
     "spec.rules[0].filters[0].requestHeaderModifier.set[0].name", "'a b'"),
    ("modifier-duplicate", _modifier(add=[{"name": "x-a", "value": "1"},
                                          {"name": "X-A", "value": "2"}]),
     "spec.rules[0].filters[0].requestHeaderModifier.add[1].name", "'X-A'"),
    ("modifier-remove-duplicate", _modifier(remove=["x-a", "x-a"]),
     "spec.rules[0].filters[0].requestHeaderModifier.remove[1]", "'x-a'"),
    ("modifier-host", _modifier(set=[{"name": "Host", "value": "h"}]),
     "spec.rules[0].filters[0].requestHeaderModifier.set[0].name", "'Host'"),
    ("modifier-value-crlf", _modifier(set=[{"name": "x-a", "value": "a\r\nb: c"}]),
     "spec.rules[0].filters[0].requestHeaderModifier.set[0].value", "'a\\r\\nb: c'"),
    ("retry-negative", _rule(retry={"attempts": -1}),
     "spec.rules[0].retry.attempts", "-1"),
    ("retry-code", _rule(retry={"attempts": 1, "codes": [200]}),
     "spec.rules[0].retry.codes[0]", "200"),
    ("retry-zero-backoff", _rule(retry={"attempts": 1, "backoff": "0s"}),
     "spec.rules[0].retry.backoff", "'0s'"),
]


@pytest.mark.parametrize("case,rule,field,value", BAD_VALUES, ids=[c[0] for c in BAD_VALUES])
def test_bad_value_is_not_accepted_and_named_and_left_out(case, rule, field, value):
    good = _route("good", GOOD_RULE, parent="other")
    base_store, base_index = _world(good)
    base, _ = resources.build(build_model(base_store, base_index, NS, "wp"))
    store, index = _world(good, _route("bad", rule))
    model = build_model(store, index, NS, "wp")
    built, problems = resources.build(model)
    # the bad route is left out: everything built is what it is without it
    assert {t: sorted(v) for t, v in built.items()} == {t: sorted(v) for t, v in base.items()}
    for t in built:
        for n in built[t]:
            assert json_format.MessageToDict(built[t][n]) == json_format.MessageToDict(base[t][n])
    (warning,) = [p for p in model.problems if f"HTTPRoute {NS}/bad" in p]
    assert f"field '{field}' value {value}" in warning, warning
    st = statuses(store)["httproutes"]
    accepted = st[f"{NS}/bad"]["parents"][0]["conditions"][0]
    assert (accepted["type"], accepted["status"], accepted["reason"]) == (
        "Accepted", "False", "UnsupportedValue")
    assert f"field '{field}' value {value}" in accepted["message"], accepted["message"]
    assert st[f"{NS}/good"]["parents"][0]["conditions"][0]["status"] == "True"


def test_good_values_pass_every_rule():
    rule = _rule(matches=[{"path": {"type": "Exact", "value": "/a/b.c"},
                           "headers": [{"name": "x-Env", "value": "prod"},
                                       {"name": "x-re", "type": "RegularExpression",
                                        "value": "v[0-9]+"}],
                           "queryParams": [{"name": "q", "value": "1"}], "method": "GET"}],
                 backendRefs=[{"name": "b", "port": 80, "weight": 1_000_000},
                              {"name": "other", "port": 80, "weight": 0}],
                 filters=[{"type": "RequestHeaderModifier", "requestHeaderModifier": {
                     "set": [{"name": "x-a", "value": "1"}], "add": [{"name": "x-a",
                                                                      "value": "2"}],
                     "remove": ["x-b"]}}],
                 timeouts={"request": "1m30s", "backendRequest": "500ms"},
                 retry={"attempts": 0, "codes": [503], "backoff": "100ms"})
    assert gwvalues.route_errors(_route("ok", rule)) == []
    assert gwvalues.parse_duration("1h30m") == 5400.0
    assert gwvalues.parse_duration("1s500ms") == 1.5
    store, index = _world(_route("ok", rule))
    model = build_model(store, index, NS, "wp")
    resources.build(model)
    assert not [p for p in model.problems if "ok" in p], model.problems


def _bad_structure():
    def spec_with(**fields):
        route = _route("malformed", GOOD_RULE)
        route["spec"].update(fields)
        return route
    no_name = _route("malformed", GOOD_RULE)
    del no_name["spec"]["parentRefs"][0]["name"]
    path_not_map = _route("malformed", _rule(matches=[{"path": "/a"}]))
    rules_not_list = spec_with(rules={"matches": []})
    timeouts_not_map = _route("malformed", _rule(timeouts="10s"))
    backends_not_list = _route("malformed", _rule(backendRefs=7))
    modifier_not_map = _route("malformed", _rule(filters=[
        {"type": "RequestHeaderModifier", "requestHeaderModifier": ["x"]}]))
    return [
        ("parentRefs-not-a-list", spec_with(parentRefs={"name": "web"}),
         "field 'spec.parentRefs' value {'name': 'web'}: must be a list", False),
        ("parentRefs-entry-not-a-map", spec_with(parentRefs=["web"]),
         "field 'spec.parentRefs[0]' value 'web': must be a map", False),
        ("parentRefs-missing-name", no_name,
         "field 'spec.parentRefs[0].name' value None: is required", True),
        ("rules-not-a-list", rules_not_list, "field 'spec.rules' value", True),
        ("path-not-a-map", path_not_map,
         "field 'spec.rules[0].matches[0].path' value '/a': must be a map", True),
        ("timeouts-not-a-map", timeouts_not_map,
         "field 'spec.rules[0].timeouts' value '10s': must be a map", True),
        ("backendRefs-not-a-list", backends_not_list,
         "field 'spec.rules[0].backendRefs' value 7: must be a list", True),
        ("modifier-not-a-map", modifier_not_map,
         "field 'spec.rules[0].filters[0].requestHeaderModifier' value ['x']", True),
    ]


@pytest.mark.parametrize("case,route,text,has_parent", _bad_structure(),
                         ids=[c[0] for c in _bad_structure()])
def test_malformed_route_structure_is_named_never_raised(case, route, text, has_parent):
    good = _route("good", GOOD_RULE, parent="other")
    store, index = _world(good, route)
    model = build_model(store, index, NS, "wp")
    built, _ = resources.build(model)  # never raises
    (warning,) = [p for p in model.problems if f"HTTPRoute {NS}/malformed" in p]
    assert text in warning, warning
    routes = [r for rc in built[resources.ROUTE_TYPE].values()
              for vh in json_format.MessageToDict(rc).get("virtualHosts", [])
              for r in vh.get("routes", [])]
    assert any(r.get("name", "").startswith(f"{NS}.good.") for r in routes)  # still served
    assert not any(r.get("name", "").startswith(f"{NS}.malformed.") for r in routes)
    st = statuses(store)
    if has_parent:
        accepted = st["httproutes"][f"{NS}/malformed"]["parents"][0]["conditions"][0]
        assert (accepted["status"], accepted["reason"]) == ("False", "UnsupportedValue")
        assert text in accepted["message"]
    else:  # no parent to report under: listed as invalid, and shown by status --waypoints
        assert f"{NS}/malformed" not in st["httproutes"]
        assert text in st["invalid"][f"HTTPRoute {NS}/malformed"]
        view = mesh_view(MeshParts(index=index, waypoints=WaypointConfigs(store, index)))
        (row,) = [r for r in view["waypoints"] if r["name"] == "(no parent)"]
        assert text in row["routes"][0]
        assert f"HTTPRoute {NS}/malformed: Accepted=False(UnsupportedValue)" in render(
            view, ["waypoints"])
    index.stop()


def _gateway(**spec_fields) -> dict:
    gw = copy.deepcopy(GATEWAY)
    gw["spec"].update(spec_fields)
    return gw


BAD_GATEWAYS = [
    ("listeners-not-a-list", _gateway(listeners=15008),
     "field 'spec.listeners' value 15008: must be a list"),
    ("listener-not-a-map", _gateway(listeners=["mesh"]),
     "field 'spec.listeners[0]' value 'mesh': must be a map"),
    ("listener-port", _gateway(listeners=[{"name": "mesh", "port": 70000,
                                           "protocol": "HBONE"}]),
     "field 'spec.listeners[0].port' value 70000: must be a port number"),
    ("listener-protocol", _gateway(listeners=[{"name": "mesh", "port": 15008,
                                               "protocol": "HB ONE"}]),
     "field 'spec.listeners[0].protocol' value 'HB ONE'"),
    ("listener-name-twice", _gateway(listeners=[
        {"name": "mesh", "port": 15008, "protocol": "HBONE"},
        {"name": "mesh", "port": 15009, "protocol": "HBONE"}]),
     "field 'spec.listeners[1].name' value 'mesh': is the name of another listener"),
]


@pytest.mark.parametrize("case,gateway,text", BAD_GATEWAYS, ids=[c[0] for c in BAD_GATEWAYS])
def test_malformed_gateway_is_not_accepted_and_serves_nothing_routed(case, gateway, text):
    store, index = _world(_route("good", GOOD_RULE), gateway=gateway)
    model = build_model(store, index, NS, "wp")
    assert not model.found and model.services == []
    resources.build(model)  # the fixed listeners and clusters only; never raises
    (warning,) = [p for p in model.problems if f"Gateway {NS}/wp" in p]
    assert "is not accepted" in warning and text in warning, warning
    st = statuses(store)["gateways"][f"{NS}/wp"]
    conds = {c["type"]: c for c in st["conditions"]}
    assert (conds["Accepted"]["status"], conds["Accepted"]["reason"]) == ("False", "Invalid")
    assert text in conds["Accepted"]["message"]
    assert conds["Programmed"]["status"] == "False" and st["addresses"] == []
    # the incremental model says the same
    configs = WaypointConfigs(store, index)
    assert not configs.config(NS, "wp", resources.Options()).found
    index.stop()


def test_bad_route_of_another_parent_is_not_warned_by_this_waypoint():
    """A route attached elsewhere (a Service not bound here) is not this waypoint's to
    report: its status says it, the waypoint's log does not."""
    store, index = _world(_route("elsewhere", _rule(retry={"attempts": -1}), parent="b"))
    model = build_model(store, index, NS, "wp")
    assert not [p for p in model.problems if "elsewhere" in p], model.problems
    accepted = statuses(store)["httproutes"][f"{NS}/elsewhere"]["parents"][0]["conditions"][0]
    assert (accepted["status"], accepted["reason"]) == ("False", "UnsupportedValue")
    index.stop()


def test_message_is_bounded():
    errors = [f"field 'spec.rules[{i}].x' value {'v' * 60!r}: why" for i in range(100)]
    text = gwvalues.message(errors)
    assert len(text) <= gwvalues.MAX_MESSAGE + 20 and text.endswith("more")


def test_unknown_and_unsupported_rule_fields_are_one_warning_each():
    """``bogusField`` and ``sessionPersistence`` in an HTTPRoute rule (and an unknown
    field in a match) were ignored without a word, the route ``Accepted=True``
    (newuser finding); there is no API server in the YAML directory to prune them. Each
    is one warning naming the route and the field, the route's status says
    ``Accepted=False`` / ``UnsupportedValue`` naming them (issue 25's bad input), and
    the rest of the route is still served, the fields ignored."""
    rule = dict(GOOD_RULE, bogusField=1, sessionPersistence={"sessionName": "s"},
                matches=[{"path": {"type": "PathPrefix", "value": "/ok"}, "pathh": {}}])
    store, index = _world(_route("extra", rule))
    model = build_model(store, index, NS, "wp")
    _built, problems = resources.build(model)
    mine = sorted({p for p in problems if f"HTTPRoute {NS}/extra" in p})
    assert mine == [
        f"HTTPRoute {NS}/extra: field 'spec.rules[0].bogusField' is not supported: ignored",
        f"HTTPRoute {NS}/extra: field 'spec.rules[0].matches[0].pathh' is not supported: "
        "ignored",
        f"HTTPRoute {NS}/extra: field 'spec.rules[0].sessionPersistence' is not supported: "
        "ignored"], mine
    accepted = statuses(store)["httproutes"][f"{NS}/extra"]["parents"][0]["conditions"][0]
    assert (accepted["status"], accepted["reason"]) == ("False", "UnsupportedValue")
    assert "'spec.rules[0].bogusField' is not supported" in accepted["message"]
    routes = [r["name"] for rc in _built[ROUTES].values()
              for vh in json_format.MessageToDict(rc).get("virtualHosts", [])
              for r in vh.get("routes", [])]
    assert f"{NS}.extra.0.0" in routes, routes


def test_gateway_fields_a_waypoint_ignores_are_one_warning_each():
    """``spec.addresses``, an unknown field and a second (HTTP) listener on an accepted
    waypoint Gateway were ignored without a word (newuser finding): one warning each,
    the Gateway still served (its status already says ``UnsupportedProtocol`` for the
    listener)."""
    gateway = copy.deepcopy(GATEWAY)
    gateway["spec"]["addresses"] = [{"type": "IPAddress", "value": "10.0.0.9"}]
    gateway["spec"]["bogus"] = 1
    gateway["spec"]["listeners"].append({"name": "extra", "port": 8080, "protocol": "HTTP"})
    store, index = _world(gateway=gateway)
    model = build_model(store, index, NS, "wp")
    assert model.found
    mine = [p for p in model.problems if p.startswith(f"Gateway {NS}/wp: ")]
    assert mine == [
        f"Gateway {NS}/wp: field 'spec.addresses' is not supported for a waypoint: ignored",
        f"Gateway {NS}/wp: field 'spec.bogus' is not supported for a waypoint: ignored",
        f"Gateway {NS}/wp: field 'spec.listeners[1]' ('extra', port 8080, protocol 'HTTP') "
        "is not supported (a waypoint has one HBONE listener on 15008): ignored"], mine
