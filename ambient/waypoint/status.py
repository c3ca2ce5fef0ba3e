"""The status istiod's Gateway controller reports for the objects the waypoints read:
each HTTPRoute attached to a Service (``status.parents[]``) and each Gateway of class
``istio-waypoint`` (``status.conditions``, ``status.addresses``). Pure functions over the
config store; what writes them is the source's business (the YAML source shows them in
``ambient-agent status --waypoints``).

HTTPRoute, GRPCRoute and TCPRoute, one entry per distinct ``parentRef`` of kind Service
(istiod's ``createRouteStatus``, the same for the three kinds), ``controllerName``
``istio.io/gateway-controller``:

- ``Accepted``: True/``Accepted`` "Route was valid"; False/``NoMatchingParent`` "parent not
  found" when the Service does not exist; False/``UnsupportedValue`` naming the field when
  the route uses something the waypoint does not carry (the same texts the waypoint
  build warns with; the route is then still served without that part, never NACKed).
- ``ResolvedRefs``: True/``ResolvedRefs`` "All references resolved"; False/``InvalidKind``
  for a backend that is not a core Service, False/``BackendNotFound``
  "backend(<host>) not found" for a missing Service or port (istiod's texts).
- ``ResolvedWaypoints``: True "All waypoints resolved" (istiod adds it in ambient mode).

Gateway (class ``istio-waypoint``): ``Accepted`` True/``Accepted``; ``Programmed``
True/``Programmed`` with ``addresses`` the ClusterIPs of the Service named as the Gateway
(the waypoint's Service, as istiod's deployment controller names it), else
False/``AddressNotAssigned``.

Each condition is ``{"type", "status" ("True"/"False"), "reason", "message",
"observedGeneration"}`` as Kubernetes ``metav1.Condition`` (``lastTransitionTime`` is the
writer's: it changes only with the status).
"""

from __future__ import annotations

from typing import Any

from ambient.api import ObjectStore
from ambient.objects import meta, spec
from ambient.waypoint import tcproute
from ambient.waypoint.httproute import Attached, RouteBuilder

CONTROLLER = "istio.io/gateway-controller"
WAYPOINT_CLASS = "istio-waypoint"


def _cond(kind: str, ok: bool, reason: str, message: str, generation: int) -> dict:
    return {"type": kind, "status": "True" if ok else "False", "reason": reason,
            "message": message, "observedGeneration": generation}


def _service_ports(svc: dict) -> set[int]:
    return {p["port"] for p in spec(svc).get("ports") or []
            if isinstance(p, dict) and isinstance(p.get("port"), int)}


def route_status(store: ObjectStore, route: dict, domain: str = "cluster.local") -> dict:
    """``{"parents": [...]}`` for one HTTPRoute, GRPCRoute or TCPRoute (its ``kind``;
    parents of kind Service only; others are another controller's and are not listed)."""
    ns = meta(route).get("namespace", "")
    generation = int(meta(route).get("generation") or 0)
    refs = spec(route).get("parentRefs")
    # backend references, as istiod resolves them (the first failure is reported)
    ref_error: tuple[str, str] | None = None
    rules = spec(route).get("rules")
    for rule in rules if isinstance(rules, list) else []:
        for ref in (rule.get("backendRefs") or []) if isinstance(rule, dict) else []:
            if not isinstance(ref, dict) or ref_error is not None:
                continue
            kind, group = ref.get("kind") or "Service", ref.get("group") or ""
            if kind != "Service" or group not in ("", "core"):
                ref_error = ("InvalidKind", f"referencing unsupported backendRef: group "
                                            f"{group!r} kind {kind!r}")
                continue
            bns = str(ref.get("namespace") or ns)
            host = f"{ref.get('name')}.{bns}.svc.{domain}"
            svc = store.get("Service", bns, str(ref.get("name") or ""))
            if svc is None or (isinstance(ref.get("port"), int)
                               and ref["port"] not in _service_ports(svc)):
                ref_error = ("BackendNotFound", f"backend({host}) not found")
    parents: list[dict] = []
    seen: set[str] = set()
    for ref in refs if isinstance(refs, list) else []:
        if not isinstance(ref, dict) or ref.get("kind") != "Service" or \
                (ref.get("group") or "") not in ("", "core"):
            continue
        pns, pname = str(ref.get("namespace") or ns), str(ref.get("name") or "")
        key = f"{pns}/{pname}/{ref.get('port') or ''}"
        if key in seen:
            continue
        seen.add(key)
        svc = store.get("Service", pns, pname)
        if svc is None:
            accepted = _cond("Accepted", False, "NoMatchingParent", "parent not found",
                             generation)
        else:
            problems: list[str] = []
            ports = [ref["port"]] if isinstance(ref.get("port"), int) else \
                sorted(_service_ports(svc))
            for port in ports or [0]:
                if route.get("kind") == "TCPRoute":
                    tcproute.upstream([Attached(route, port)], port, lambda *_a: "x", problems)
                else:
                    RouteBuilder([Attached(route, port)], port, lambda *_a: "x",
                                 problems).routes()
            # backend problems are ResolvedRefs' (above), not the route's acceptance
            unsupported = list(dict.fromkeys(p for p in problems if "not supported" in p
                                             and ".backendRefs[" not in p))
            accepted = _cond("Accepted", False, "UnsupportedValue", "; ".join(unsupported),
                             generation) if unsupported else _cond(
                "Accepted", True, "Accepted", "Route was valid", generation)
        resolved = _cond("ResolvedRefs", False, ref_error[0], ref_error[1], generation) \
            if ref_error else _cond("ResolvedRefs", True, "ResolvedRefs",
                                    "All references resolved", generation)
        parents.append({
            "parentRef": {k: v for k, v in ref.items()
                          if k in ("group", "kind", "name", "namespace", "port",
                                   "sectionName")},
            "controllerName": CONTROLLER,
            "conditions": [accepted, resolved, _cond(
                "ResolvedWaypoints", True, "ResolvedWaypoints", "All waypoints resolved",
                generation)]})
    return {"parents": parents}


def gateway_status(store: ObjectStore, gateway: dict) -> dict:
    """``{"conditions": [...], "addresses": [...]}`` for one ``istio-waypoint`` Gateway."""
    ns, name = meta(gateway).get("namespace", ""), meta(gateway).get("name", "")
    generation = int(meta(gateway).get("generation") or 0)
    svc = store.get("Service", ns, name)
    ips: list[str] = []
    if svc is not None:
        s = spec(svc)
        ips = [ip for ip in (s.get("clusterIPs") or [s.get("clusterIP")])
               if isinstance(ip, str) and ip and ip != "None"]
    conditions = [_cond("Accepted", True, "Accepted", "Resource accepted", generation)]
    if ips:
        conditions.append(_cond("Programmed", True, "Programmed", "Resource programmed, "
                                f"assigned to service(s) {name}.{ns}.svc", generation))
    else:
        conditions.append(_cond("Programmed", False, "AddressNotAssigned",
                                f"no Service {ns}/{name} with a cluster IP for the waypoint",
                                generation))
    return {"conditions": conditions,
            "addresses": [{"type": "IPAddress", "value": ip} for ip in ips]}


#: route kind -> its key in :func:`statuses`
ROUTE_SECTIONS = {"HTTPRoute": "httproutes", "GRPCRoute": "grpcroutes", "TCPRoute": "tcproutes"}


def statuses(store: ObjectStore, domain: str = "cluster.local") -> dict[str, Any]:
    """Every waypoint Gateway's and Service-attached route's status:
    ``{"gateways": {"ns/name": status}, "httproutes": {"ns/name": status},
    "grpcroutes": {...}, "tcproutes": {...}}``."""
    gateways = {}
    for gw in store.list("Gateway"):
        if spec(gw).get("gatewayClassName") == WAYPOINT_CLASS:
            gateways[f"{meta(gw).get('namespace')}/{meta(gw).get('name')}"] = \
                gateway_status(store, gw)
    out: dict[str, Any] = {"gateways": dict(sorted(gateways.items()))}
    for kind, section in ROUTE_SECTIONS.items():
        routes = {}
        for route in store.list(kind):
            st = route_status(store, route, domain)
            if st["parents"]:
                routes[f"{meta(route).get('namespace')}/{meta(route).get('name')}"] = st
        out[section] = dict(sorted(routes.items()))
    return out


def summary(conditions: list[dict]) -> str:
    """``Accepted=True,ResolvedRefs=False(BackendNotFound)`` for a table cell."""
    return ",".join(f"{c['type']}={c['status']}" + (f"({c['reason']})" if c["status"] != "True"
                                                      else "") for c in conditions)
