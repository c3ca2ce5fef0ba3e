"""A waypoint's Envoy resources from the agent against istiod's, for the same objects on one
API server (tests/oracle/harness.py: one kube-apiserver, one istiod, one agent).

Both servers are read by :class:`tests.oracle.envoy_ads.EnvoyAdsClient` with the node a
waypoint pod sends (``ambient/waypoint/bootstrap.py``, what ``pilot-agent proxy waypoint``
sends: ``waypoint~<IP>~<pod>.<ns>~<ns>.svc.cluster.local``, ``LABELS`` with
``gateway.networking.k8s.io/gateway-name``, ``CLUSTER_ID`` ...). istiod treats a proxy as a
waypoint by the node type and finds what it serves from the proxy's *service targets*: the
Pod named in the node id, with the node's IP, selected by the waypoint's Service
(``<gateway>.<ns>.svc.cluster.local``), the hostname the Gateway's ``status.addresses``
names. So the objects are those Istio's deployment controller and the kubelet leave:
Gateway (class ``istio-waypoint``), its Service, a running pod; EndpointSlices are written
as the endpoint-slice controller would (the test API server runs no controller manager,
and istiod's EDS reads slices).

The objects: Services ``web`` (HTTP 80, TCP 9000), ``web-v2`` (HTTP 80) and ``echo``
(gRPC 50051, TCP 9100) labelled ``istio.io/use-waypoint``; an HTTPRoute on ``web:80`` with a
path+header match and an 80/20 weighted default; a GRPCRoute on ``echo:50051`` (service +
method, service only with a header, method only, regular expressions, a 3:1 split); a
TCPRoute on ``web:9000`` splitting 90/10 over ``web:9000`` and ``echo:9100``; a DENY
AuthorizationPolicy aimed at the Gateway and an ALLOW one (principals, methods, paths;
namespaces + port) aimed at ``web``.

Compared by name and by the fields that decide behaviour (:func:`behaviour`): listener
names, ``main_internal``'s chain matcher (VIP -> port -> chain) and chains (their network
filters, RBAC rules, TCP proxy cluster, HCM path handling, upgrades and routes whether inline
or by RDS), ``connect_terminate``'s TLS and CONNECT route, cluster names, types, load
balancing, upstream SAN checks and protocol options, EDS endpoints. Telemetry (stats
prefixes, tracing, Istio's metadata-exchange and peer-metadata filters, access logs) is not
compared. A difference fails unless it is listed in docs/waypoint.md "Deliberate
differences from istiod" (:data:`DELIBERATE`, each with the predicate that admits it).
Under ``AMBIENT_REQUIRE_ISTIOD=1`` (CI) the suite fails instead of skipping.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from typing import Any

import pytest

from ambient.waypoint.bootstrap import BootstrapOptions, bootstrap
from tests.oracle import harness as h
from tests.oracle.envoy_ads import EnvoyAdsClient
from tests.oracle.states import AMBIENT, GW, ap, ns, pod, sa, slice_, svc, waypoint

pytestmark = pytest.mark.timeout(900)
DOCS = os.path.join(h.ROOT, "docs", "waypoint.md")
N = "wpo"
WAYPOINT_IP = "10.245.0.50"
CAPTURED = {"ambient.istio.io/redirection": "enabled"}
GW_GROUP = "gateway.networking.k8s.io"
# Istio's own filters (telemetry: peer metadata exchange, stats); a stock Envoy lacks them
TELEMETRY_FILTERS = {"istio.metadata_exchange", "waypoint_upstream_peer_metadata",
                     "waypoint_downstream_peer_metadata", "envoy.filters.http.grpc_stats",
                     "istio.stats", "envoy.filters.http.fault", "envoy.filters.http.cors"}


def objects() -> list[tuple]:
    use = {"istio.io/use-waypoint": "waypoint"}
    ops = [ns(N, AMBIENT), sa(N, "default"), sa(N, "web"), sa(N, "client")]
    ops += waypoint("waypoint", N, ip=WAYPOINT_IP)
    ops += [
        svc("web", N, {"app": "web"}, labels=use, ports=[
            {"name": "http", "port": 80, "targetPort": 8080},
            {"name": "tcp-db", "port": 9000, "targetPort": 9000}]),
        svc("web-v2", N, {"app": "web-v2"}, labels=use, ports=[
            {"name": "http", "port": 80, "targetPort": 8080}]),
        svc("echo", N, {"app": "echo"}, labels=use, ports=[
            {"name": "grpc", "port": 50051, "targetPort": 50051},
            {"name": "tcp-alt", "port": 9100, "targetPort": 9100}]),
        # web-0 and web-v2-0 are captured (the annotation the node agent writes): HBONE
        # endpoints; web-1 is not: a plaintext endpoint
        pod("web-0", N, ["10.245.0.10"], labels={"app": "web"}, service_account="web",
            annotations=CAPTURED),
        pod("web-1", N, ["10.245.0.11"], labels={"app": "web"}, service_account="web"),
        pod("web-v2-0", N, ["10.245.0.12"], labels={"app": "web-v2"}, service_account="web",
            annotations=CAPTURED),
        pod("echo-0", N, ["10.245.0.13"], labels={"app": "echo"}, service_account="web",
            annotations=CAPTURED),
        pod("client", N, ["10.245.0.20"], labels={"app": "client"}, service_account="client",
            annotations=CAPTURED),
    ]
    for name, svc_name, ips, ports in (
            ("web-1", "web", ["10.245.0.10", "10.245.0.11"],
             [{"name": "http", "port": 8080, "protocol": "TCP"},
              {"name": "tcp-db", "port": 9000, "protocol": "TCP"}]),
            ("web-v2-1", "web-v2", ["10.245.0.12"],
             [{"name": "http", "port": 8080, "protocol": "TCP"}]),
            ("echo-1", "echo", ["10.245.0.13"],
             [{"name": "grpc", "port": 50051, "protocol": "TCP"},
              {"name": "tcp-alt", "port": 9100, "protocol": "TCP"}])):
        ops.append(slice_(name, N, svc_name, [
            {"addresses": [ip], "conditions": {"ready": True},
             "targetRef": {"kind": "Pod", "namespace": N, "name": pod_name}}
            for ip, pod_name in zip(ips, (f"{svc_name}-0", f"{svc_name}-1"))], ports=ports))
    ops += [
        ("apply", {"apiVersion": GW, "kind": "HTTPRoute",
                   "metadata": {"name": "split", "namespace": N},
                   "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "web",
                                            "port": 80}],
                            "rules": [
                                {"matches": [{"path": {"type": "PathPrefix", "value": "/v2"},
                                              "headers": [{"name": "x-canary",
                                                           "value": "1"}]}],
                                 "backendRefs": [{"name": "web-v2", "port": 80}]},
                                {"backendRefs": [{"name": "web", "port": 80, "weight": 80},
                                                 {"name": "web-v2", "port": 80,
                                                  "weight": 20}]}]}}),
        ("apply", {"apiVersion": GW, "kind": "GRPCRoute",
                   "metadata": {"name": "calls", "namespace": N},
                   "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "echo",
                                            "port": 50051}],
                            "rules": [
                                {"matches": [{"method": {"service": "demo.Echo",
                                                         "method": "Say"}}],
                                 "backendRefs": [{"name": "echo", "port": 50051}]},
                                {"matches": [{"method": {"service": "demo.Echo"},
                                              "headers": [{"name": "x-canary",
                                                           "value": "yes"}]}],
                                 "filters": [{"type": "RequestHeaderModifier",
                                              "requestHeaderModifier": {"set": [
                                                  {"name": "x-routed", "value": "canary"}]}}],
                                 "backendRefs": [{"name": "echo", "port": 50051}]},
                                {"matches": [{"method": {"method": "Ping"}},
                                             {"method": {"type": "RegularExpression",
                                                         "service": "demo\\..*"}}],
                                 "backendRefs": [{"name": "echo", "port": 50051,
                                                  "weight": 3},
                                                 {"name": "web-v2", "port": 80,
                                                  "weight": 1}]}]}}),
        ("apply", {"apiVersion": f"{GW_GROUP}/v1alpha2", "kind": "TCPRoute",
                   "metadata": {"name": "db-split", "namespace": N},
                   "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "web",
                                            "port": 9000}],
                            "rules": [{"backendRefs": [
                                {"name": "web", "port": 9000, "weight": 90},
                                {"name": "echo", "port": 9100, "weight": 10}]}]}}),
        ap("gw-deny", N, {"targetRefs": [{"group": "gateway.networking.k8s.io",
                                          "kind": "Gateway", "name": "waypoint"}],
                          "action": "DENY",
                          "rules": [{"to": [{"operation": {"paths": ["/admin", "/admin/*"]}}]}]}),
        ap("web-allow", N, {"targetRefs": [{"group": "", "kind": "Service", "name": "web"}],
                            "action": "ALLOW", "rules": [
                                {"from": [{"source": {"principals": [
                                    "cluster.local/ns/wpo/sa/client"]}}],
                                 "to": [{"operation": {"methods": ["GET"],
                                                       "paths": ["/api/*", "/v2*"]}}]},
                                {"from": [{"source": {"namespaces": [N]}}],
                                 "to": [{"operation": {"ports": ["9000"]}}]}]}),
    ]
    return ops


# --------------------------------------------------------------------------- normalising

def _perm(p: Any) -> Any:
    """An RBAC permission/principal with logically empty nesting removed: an ``and``/``or``
    of one element is that element, nested ``and``s (``or``s) are one level (istiod wraps
    every rule as ``and_rules[or_rules[...]]``; Envoy's meaning is the same)."""
    if not isinstance(p, dict):
        return p
    for key, inner in (("and_rules", "rules"), ("or_rules", "rules"), ("and_ids", "ids"),
                       ("or_ids", "ids")):
        if key in p and len(p) == 1:
            items = [_perm(x) for x in p[key].get(inner, [])]
            flat: list = []
            for x in items:
                flat.extend(x[key][inner] if isinstance(x, dict) and list(x) == [key] else [x])
            return flat[0] if len(flat) == 1 else {key: {inner: flat}}
    if "not_rule" in p:
        return {"not_rule": _perm(p["not_rule"])}
    if "not_id" in p:
        return {"not_id": _perm(p["not_id"])}
    return p


def _rbac(tc: dict) -> dict:
    rules = tc.get("rules", {})
    return {"action": rules.get("action", "ALLOW"), "policies": {
        name: {"permissions": [_perm(x) for x in pol.get("permissions", [])],
               "principals": [_perm(x) for x in pol.get("principals", [])]}
        for name, pol in rules.get("policies", {}).items()}}


def _route(r: dict) -> dict:
    match = {k: v for k, v in r.get("match", {}).items()
             if not (k == "case_sensitive" and v is True)}
    out: dict[str, Any] = {"match": match}
    if "route" in r:
        act = r["route"]
        out["route"] = {k: act[k] for k in ("cluster", "weighted_clusters", "timeout",
                                            "prefix_rewrite", "host_rewrite_literal",
                                            "cluster_not_found_response_code") if k in act}
        rp = act.get("retry_policy")
        if rp:
            out["route"]["retry"] = {k: rp.get(k) for k in ("retry_on", "num_retries",
                                                             "per_try_timeout",
                                                             "retriable_status_codes")}
    for k in ("direct_response", "redirect", "request_headers_to_add",
              "request_headers_to_remove", "response_headers_to_add",
              "response_headers_to_remove"):
        if k in r:
            out[k] = r[k]
    return out


def _routes(rc: dict | None) -> Any:
    if rc is None:
        return None
    return [{"domains": vh.get("domains"), "routes": [_route(r) for r in vh.get("routes", [])]}
            for vh in rc.get("virtual_hosts", [])]


def _hcm(tc: dict, rds: dict) -> dict:
    rc = tc.get("route_config") if "route_config" in tc else rds.get(
        tc.get("rds", {}).get("route_config_name"))
    out = {k: tc.get(k) for k in ("normalize_path", "merge_slashes",
                                  "path_with_escaped_slashes_action", "use_remote_address",
                                  "stream_idle_timeout", "forward_client_cert_details",
                                  "http2_protocol_options")}
    out["upgrades"] = sorted(u.get("upgrade_type", "") for u in tc.get("upgrade_configs", []))
    out["http_filters"] = [(f["name"], _rbac(f["typed_config"])
                            if f["name"] == "envoy.filters.http.rbac" else
                            f.get("typed_config", {}).get("@type"))
                           for f in tc.get("http_filters", [])
                           if f["name"] not in TELEMETRY_FILTERS]
    out["routes"] = _routes(rc)
    return out


def _chain(fc: dict, rds: dict) -> dict:
    out = []
    for f in fc.get("filters", []):
        name, tc = f["name"], f.get("typed_config", {})
        if name in TELEMETRY_FILTERS:
            continue
        if name == "envoy.filters.network.rbac":
            out.append((name, _rbac(tc)))
        elif name == "envoy.filters.network.tcp_proxy":
            out.append((name, {k: tc.get(k) for k in ("cluster", "weighted_clusters",
                                                     "tunneling_config")}))
        elif name == "envoy.filters.network.http_connection_manager":
            out.append((name, _hcm(tc, rds)))
        else:
            out.append((name, tc))
    return {"match": fc.get("filter_chain_match"), "filters": out}


def _matcher(m: Any) -> Any:
    """``filter_chain_matcher`` as ``{ip range: {port: chain}}`` (order of ranges free)."""
    if not isinstance(m, dict):
        return m
    tree = m.get("matcher_tree", {})
    custom = tree.get("custom_match", {}).get("typed_config", {})
    if "range_matchers" in custom:
        out = {}
        for rm in custom["range_matchers"]:
            key = ",".join(sorted(f"{r['address_prefix']}/{r.get('prefix_len', 0)}"
                                  for r in rm.get("ranges", [])))
            out[key] = _matcher(rm.get("on_match", {}).get("matcher"))
        return {"ip": out, "no_match": _on_match(m.get("on_no_match"))}
    if "exact_match_map" in tree:
        return {tree["input"]["name"]: {k: _on_match(v)
                                        for k, v in tree["exact_match_map"]["map"].items()},
                "no_match": _on_match(m.get("on_no_match"))}
    return m


def _on_match(v: Any) -> Any:
    if not isinstance(v, dict):
        return v
    if "action" in v:
        return v["action"].get("name")
    return _matcher(v.get("matcher"))


def _sans(tls: dict) -> list:
    ctx = tls.get("common_tls_context", {})
    dvc = ctx.get("combined_validation_context", {}).get("default_validation_context", {})
    return sorted(json.dumps(s, sort_keys=True)
                  for s in dvc.get("match_typed_subject_alt_names", []))


def _tls(ts: dict | None) -> Any:
    if not ts:
        return None
    tc = ts.get("typed_config", {})
    if "common_tls_context" not in tc:
        return tc.get("@type")
    ctx = tc["common_tls_context"]
    return {"type": tc.get("@type"), "sans": _sans(tc), "alpn": ctx.get("alpn_protocols"),
            "tls_params": ctx.get("tls_params"),
            "certs": [s.get("name") for s in ctx.get("tls_certificate_sds_secret_configs", [])],
            "root": ctx.get("combined_validation_context", {}).get(
                "validation_context_sds_secret_config", {}).get("name"),
            "require_client_certificate": tc.get("require_client_certificate")}


def _listener(lst: dict, rds: dict) -> dict:
    out = {"address": lst.get("address"), "internal": "internal_listener" in lst,
           "listener_filters": sorted(f["name"] for f in lst.get("listener_filters", [])
                                      if f["name"] != "envoy.filters.listener.http_inspector"),
           "chain_matcher": _matcher(lst.get("filter_chain_matcher")),
           "chains": {fc.get("name", ""): {**_chain(fc, rds),
                                            "tls": _tls(fc.get("transport_socket"))}
                      for fc in lst.get("filter_chains", [])},
           "default_chain": _chain(lst["default_filter_chain"], rds)
           if "default_filter_chain" in lst else None}
    return out


def _cluster(c: dict) -> dict:
    opts = c.get("typed_extension_protocol_options", {}).get(
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions", {})
    return {"type": c.get("type"), "lb_policy": c.get("lb_policy", "ROUND_ROBIN"),
            "eds_service": c.get("eds_cluster_config", {}).get("service_name"),
            "connect_timeout": c.get("connect_timeout"),
            "panic_threshold": c.get("common_lb_config", {}).get("healthy_panic_threshold"),
            "original_dst_lb_config": c.get("original_dst_lb_config"),
            "load_assignment": c.get("load_assignment"),
            "transport": _tls(c.get("transport_socket")),
            "passthrough_metadata": c.get("transport_socket", {}).get("typed_config", {}).get(
                "passthrough_metadata"),
            "http_protocol": {k: v for k, v in opts.items() if k != "@type"} or None}


def _endpoints(cla: dict) -> list:
    out = []
    for group in cla.get("endpoints", []):
        for lb in group.get("lb_endpoints", []):
            addr = lb.get("endpoint", {}).get("address", {})
            out.append({"address": addr, "health": lb.get("health_status", "UNKNOWN"),
                        "metadata": lb.get("metadata", {}).get("filter_metadata", {}).get(
                            "envoy.filters.listener.original_dst"),
                        "weight": lb.get("load_balancing_weight", 1)})
    return sorted(out, key=lambda e: json.dumps(e, sort_keys=True))


def behaviour(view: dict) -> dict:
    """What decides behaviour in one server's LDS/CDS/EDS/RDS (see the module docstring);
    route configurations appear under the chain that uses them, inline or by RDS."""
    rds = view["RDS"]
    return {"LDS": {n: _listener(v, rds) for n, v in view["LDS"].items()},
            "CDS": {n: _cluster(v) for n, v in view["CDS"].items()},
            "EDS": {n: _endpoints(v) for n, v in view["EDS"].items()}}


# --------------------------------------------------------------------------- deliberate

def _catch_all_404(d: tuple) -> bool:
    """The agent ends an HTTPRoute's routes with ``prefix / -> 404``; istiod has none, and
    Envoy answers 404 itself when no route matches: the same answer."""
    path, istiod, agent = d
    if not (path.endswith(".routes") and isinstance(istiod, list) and isinstance(agent, list)):
        return False
    return (len(agent) == len(istiod) + 1 and agent[:-1] == istiod
            and agent[-1] == {"match": {"prefix": "/"}, "direct_response": {"status": 404}})


def _merge_slashes(d: tuple) -> bool:
    """The agent's HTTP chains merge repeated slashes before RBAC and routing (``//admin``
    is ``/admin``); istiod's default path normalisation (``BASE``) does not, so a DENY of
    ``/admin`` there misses ``//admin``. Admitted only in that direction."""
    path, istiod, agent = d
    return path.endswith(".merge_slashes") and istiod in (None, False) and agent is True


DELIBERATE = {"waypoint-no-route-404": _catch_all_404,
              "waypoint-merge-slashes": _merge_slashes}


def _documented_ids() -> set[str]:
    text = open(DOCS, encoding="utf-8").read()
    m = re.search(r"^## Deliberate differences from istiod\n(.*?)(?=^## |\Z)", text,
                  re.S | re.M)
    return set(re.findall(r"`([a-z0-9-]+)`", m.group(1))) if m else set()


def diff(a: Any, b: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += diff(a.get(k), b.get(k), f"{path}.{k}" if path else k)
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        out = []
        for i, (x, y) in enumerate(zip(a, b)):
            out += diff(x, y, f"{path}[{i}]")
        return out
    return [] if a == b else [(path, a, b)]


# --------------------------------------------------------------------------- the test

@pytest.fixture(scope="module")
def views(oracle):
    """Both servers' waypoint resources once the objects are loaded and both converged."""
    created: list = []
    for op in objects():
        oracle.loop.run(h.run_op(oracle.api, op, created))
    oracle.loop.run(oracle.converge())
    node = bootstrap(BootstrapOptions(namespace=N, gateway="waypoint", node_ip=WAYPOINT_IP,
                                      pod_name="waypoint-0",
                                      service_account="waypoint"))["node"]

    async def read() -> dict:
        clients = {side: EnvoyAdsClient(addr, node_id=node["id"], metadata=node["metadata"])
                   for side, addr in (("istiod", oracle.istiod_env["ISTIOD_XDS_ADDR"]),
                                      ("agent", f"127.0.0.1:{oracle.agent_xds}"))}
        try:
            for c in clients.values():
                await c.connect()
            deadline = time.monotonic() + 90
            while True:
                await asyncio.sleep(0.3)
                done = all(c.synced >= set(c.types) and not c.pending()
                           and c.quiet_for() > 3 and c.view()["EDS"] and
                           all(c.view()["EDS"].values()) for c in clients.values())
                if done or time.monotonic() > deadline:
                    break
            for side, c in clients.items():
                if c.error is not None:
                    raise AssertionError(f"{side} ended the waypoint stream: {c.error}")
            return {side: c.view() for side, c in clients.items()}
        finally:
            for c in clients.values():
                await c.close()
    try:
        yield oracle.loop.run(read())
    finally:
        oracle.loop.run(h.remove(oracle.api, (N,), created))


def _fmt(diffs: list) -> str:
    return "\n".join(f"  {p}: istiod={json.dumps(a, default=str)[:600]} "
                     f"agent={json.dumps(b, default=str)[:600]}" for p, a, b in diffs[:30])


def test_deliberate_differences_documented():
    missing = set(DELIBERATE) - _documented_ids()
    assert not missing, f"not in docs/waypoint.md 'Deliberate differences from istiod': {missing}"


@pytest.mark.parametrize("kind", ["LDS", "CDS", "EDS"])
def test_names_equal(views, kind):
    names = {side: sorted(v[kind]) for side, v in views.items()}
    assert names["istiod"], f"istiod served no {kind} for the waypoint: {views['istiod']}"
    assert names["istiod"] == names["agent"], names


def test_endpoints_not_empty(views):
    """Both sides know the member pods (else the EDS comparison compares nothing)."""
    for side, v in views.items():
        assert all(v["EDS"].values()), (side, {n: bool(x) for n, x in v["EDS"].items()})


@pytest.mark.parametrize("kind", ["LDS", "CDS", "EDS"])
def test_behaviour_equal(views, kind):
    a, b = behaviour(views["istiod"])[kind], behaviour(views["agent"])[kind]
    diffs = [d for d in diff(a, b, kind) if not any(p(d) for p in DELIBERATE.values())]
    assert not diffs, _fmt(diffs)


def test_rbac_and_routes_compared(views):
    """The comparison covers what it claims: both DENY and ALLOW RBAC filters on the HTTP
    chain of web:80 and its HTTPRoute's weighted clusters, on both sides."""
    for side, v in views.items():
        chain = behaviour(v)["LDS"]["main_internal"]["chains"][
            f"inbound-vip|80|http|web.{N}.svc.cluster.local"]
        hcm = dict(chain["filters"])["envoy.filters.network.http_connection_manager"]
        actions = [f[1]["action"] for f in hcm["http_filters"]
                   if f[0] == "envoy.filters.http.rbac"]
        assert actions == ["DENY", "ALLOW"], (side, actions)
        routes = hcm["routes"][0]["routes"]
        weighted = [r["route"]["weighted_clusters"] for r in routes
                    if "weighted_clusters" in r.get("route", {})]
        assert weighted and [c["weight"] for c in weighted[0]["clusters"]] == [80, 20], (
            side, routes)


def test_grpc_and_tcp_routes_compared(views):
    """The comparison covers the GRPCRoute's routes on echo:50051's HTTP chain (gRPC method
    matches as path matches, the 3:1 split) and the TCPRoute's weighted clusters on
    web:9000's TCP chain, on both sides."""
    for side, v in views.items():
        chains = behaviour(v)["LDS"]["main_internal"]["chains"]
        hcm = dict(chains[f"inbound-vip|50051|http|echo.{N}.svc.cluster.local"]["filters"])[
            "envoy.filters.network.http_connection_manager"]
        matches = [r["match"] for r in hcm["routes"][0]["routes"]]
        assert {"path": "/demo.Echo/Say"} in matches, (side, matches)
        assert any(m.get("path_separated_prefix") == "/demo.Echo" for m in matches), (side, matches)
        weighted = [r["route"]["weighted_clusters"] for r in hcm["routes"][0]["routes"]
                    if "weighted_clusters" in r.get("route", {})]
        assert weighted and [c["weight"] for c in weighted[0]["clusters"]] == [3, 1], side
        proxy = dict(chains[f"inbound-vip|9000|tcp|web.{N}.svc.cluster.local"]["filters"])[
            "envoy.filters.network.tcp_proxy"]
        assert [c["weight"] for c in proxy["weighted_clusters"]["clusters"]] == [90, 10], (
            side, proxy)
