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
- ``ResolvedRefs``: True/``ResolvedRefs`` "All references resolved"; False/``InvalidFilter``
  'unsupported filter type "<type>"' for a filter type istiod does not convert either
  (``ExtensionRef`` ...: istiod fails the route's conversion and reports it here, leaving
  ``Accepted`` True; a filter istiod converts but the waypoint does not carry, e.g.
  ``URLRewrite``, is the ``UnsupportedValue`` above); False/``InvalidKind``
  for a backend that is not a core Service, False/``BackendNotFound``
  "backend(<host>) not found" for a missing Service or port (istiod's texts).
- ``ResolvedWaypoints`` (istiod adds it in ambient mode; always True, only its message
  changes): "All waypoints resolved"; "parent not found" without the Service; istiod's
  "istio.io/use-waypoint label missing from parent and parent namespace; ..." when neither
  the Service nor its namespace carries ``istio.io/use-waypoint`` (a value ``none`` counts
  as missing).

Gateway (class ``istio-waypoint``), as istiod's ``reportGatewayStatus`` and
``ResolveGatewayInstances`` report it for the Service named as the Gateway (the waypoint's
Service, as istiod's deployment controller names it; ``<name>.<ns>.svc.<domain>``, port
15008): ``Accepted`` True/``Accepted`` "Resource accepted"; ``ResolvedRefs``
True/``ResolvedRefs`` "All references resolved"; ``Programmed`` True/``Programmed``
"Resource programmed, assigned to service(s) <host>:15008" when the Service has port 15008
and an EndpointSlice with an endpoint, with ``addresses`` its ClusterIPs then the hostname
(the class's address type is unset, so both), else False/``AddressNotUsable`` (no Service,
no port 15008) or False/``AddressNotAssigned`` (no endpoints) with istiod's "Failed to
assign to any requested addresses: ..." texts and no addresses. ``listeners``: one entry
per listener; the single HBONE listener on 15008 is Accepted, any other is
False/``UnsupportedProtocol``; ``attachedRoutes`` is 0 (routes attach to Services).

Cross-namespace ``backendRefs``: istiod does not check ReferenceGrants for routes whose
parent is a Service (``route_collections.go`` converts mesh routes with
``enforceRefGrant = !mesh``), so neither does this module: such a backend resolves and is
routed to like a same-namespace one.

Each condition is ``{"type", "status" ("True"/"False"), "reason", "message",
"observedGeneration"}`` as Kubernetes ``metav1.Condition`` (``lastTransitionTime`` is the
writer's: it changes only with the status).
"""

from __future__ import annotations

from typing import Any

from ambient import waypoints as wpmod
from ambient.api import ObjectStore
from ambient.objects import labels, meta, selector_matches, spec, status as status_of
from ambient.waypoint import gwvalues, tcproute
from ambient.waypoints import HBONE_PORT
from ambient.waypoint.httproute import Attached, RouteBuilder

CONTROLLER = "istio.io/gateway-controller"
WAYPOINT_CLASS = "istio-waypoint"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
USE_WAYPOINT_LABEL = "istio.io/use-waypoint"
#: route kind -> the filter types istiod converts (conversion.go convertHTTPRoute,
#: convertGRPCRoute); any other type fails the conversion there
ISTIOD_FILTERS = {
    "HTTPRoute": frozenset({"RequestHeaderModifier", "ResponseHeaderModifier",
                            "RequestRedirect", "RequestMirror", "URLRewrite", "CORS"}),
    "GRPCRoute": frozenset({"RequestHeaderModifier", "ResponseHeaderModifier",
                            "RequestMirror"}),
}
MISSING_WAYPOINT_LABEL = ("istio.io/use-waypoint label missing from parent and parent namespace; "
                          "in ambient mode, route will not be respected")


def _cond(kind: str, ok: bool, reason: str, message: str, generation: int) -> dict:
    return {"type": kind, "status": "True" if ok else "False", "reason": reason,
            "message": message, "observedGeneration": generation}


def _service_ports(svc: dict) -> set[int]:
    return {p["port"] for p in spec(svc).get("ports") or []
            if isinstance(p, dict) and isinstance(p.get("port"), int)}


def _uses_waypoint(obj: dict | None, absent: bool = False) -> bool:
    """``istio.io/use-waypoint`` set (and not ``none``) on ``obj``; ``absent`` when None."""
    if obj is None:
        return absent
    value = (meta(obj).get("labels") or {}).get(USE_WAYPOINT_LABEL, "")
    return bool(value) and value.lower() != "none"


def route_status(store: ObjectStore, route: dict, domain: str = "cluster.local") -> dict:
    """``{"parents": [...]}`` for one HTTPRoute, GRPCRoute or TCPRoute (its ``kind``;
    parents of kind Service only; others are another controller's and are not listed)."""
    ns = meta(route).get("namespace", "")
    generation = _generation(route)
    # values the CRD refuses or Envoy would NACK: the route is not accepted (and not built)
    errors = gwvalues.route_errors(route)
    body = spec(route) if isinstance(spec(route), dict) else {}
    refs = body.get("parentRefs")
    # backend references, as istiod resolves them (the first failure is reported)
    ref_error: tuple[str, str] | None = None
    rules = body.get("rules")
    # a filter type istiod does not know is a hard conversion error there: reported under
    # ResolvedRefs (InvalidFilter), not as the route's acceptance
    hard_error: tuple[str, str] | None = None
    unknown_filters: set[str] = set()
    known = ISTIOD_FILTERS.get(str(route.get("kind") or "HTTPRoute"), frozenset())
    for r, rule in enumerate(rules if isinstance(rules, list) else []):
        filters = rule.get("filters") if isinstance(rule, dict) else None
        for f, flt in enumerate(filters if isinstance(filters, list) else []):
            ftype = flt.get("type") if isinstance(flt, dict) else None
            if ftype not in known:
                unknown_filters.add(f"spec.rules[{r}].filters[{f}].type'")
                hard_error = hard_error or ("InvalidFilter", f'unsupported filter type "{ftype}"')
    for rule in rules if isinstance(rules, list) else []:
        found = rule.get("backendRefs") if isinstance(rule, dict) else None
        for ref in found if isinstance(found, list) else []:
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
        svc = store.get("Service", pns, pname) if pname else None
        waypoints = "All waypoints resolved"
        if errors:
            accepted = _cond("Accepted", False, "UnsupportedValue", gwvalues.message(errors),
                             generation)
            if svc is None:
                waypoints = "parent not found"
        elif svc is None:
            accepted = _cond("Accepted", False, "NoMatchingParent",
                             f'parent service: "{pname}" not found', generation)
            waypoints = "parent not found"
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
            unsupported = list(dict.fromkeys(
                p for p in problems if "not supported" in p and ".backendRefs[" not in p
                and not any(u in p for u in unknown_filters)))
            accepted = _cond("Accepted", False, "UnsupportedValue", "; ".join(unsupported),
                             generation) if unsupported else _cond(
                "Accepted", True, "Accepted", "Route was valid", generation)
        if svc is not None and not _uses_waypoint(svc) and not _uses_waypoint(
                store.get("Namespace", "", pns), absent=True):
            waypoints = MISSING_WAYPOINT_LABEL
        error = hard_error or ref_error
        resolved = _cond("ResolvedRefs", False, error[0], error[1], generation) \
            if error else _cond("ResolvedRefs", True, "ResolvedRefs",
                                    "All references resolved", generation)
        parents.append({
            "parentRef": {k: v for k, v in ref.items()
                          if k in ("group", "kind", "name", "namespace", "port",
                                   "sectionName")},
            "controllerName": CONTROLLER,
            "conditions": [accepted, resolved, _cond(
                "ResolvedWaypoints", True, "ResolvedWaypoints", waypoints, generation)]})
    return {"parents": parents}


def _generation(obj: dict) -> int:
    value = meta(obj).get("generation")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _has_instances(store: ObjectStore, svc: dict) -> bool:
    """True when an EndpointSlice of Service ``svc`` lists an endpoint; with no
    EndpointSlice of it at all (the YAML directory, where no controller writes them),
    when a running pod with an IP matches the Service's selector, which is what the
    EndpointSlice controller would list (the shipped example's waypoint was never
    ``Programmed`` while ``status --services`` showed its endpoint: newuser finding)."""
    ns, name = meta(svc).get("namespace", ""), meta(svc).get("name", "")
    slices = [sl for sl in store.list("EndpointSlice", ns)
              if (meta(sl).get("labels") or {}).get(SERVICE_NAME_LABEL) == name]
    if slices:
        return any(isinstance(e, dict) and e.get("addresses")
                   for sl in slices for e in sl.get("endpoints") or [])
    selector = spec(svc).get("selector")
    if not isinstance(selector, dict):
        return False
    return any(selector_matches(selector, labels(pod)) and status_of(pod).get("podIP")
               and status_of(pod).get("phase") == "Running"
               and not meta(pod).get("deletionTimestamp")
               for pod in store.list("Pod", ns))


def _listener_status(listener: dict, valid: bool) -> dict:
    ok = "No errors found"
    accepted = _cond("Accepted", True, "Accepted", ok, 0) if valid else _cond(
        "Accepted", False, "UnsupportedProtocol",
        f'Expected a single listener on port {HBONE_PORT} with protocol "HBONE"', 0)
    return {"name": listener.get("name"), "attachedRoutes": 0,
            "supportedKinds": [] if valid else [
                {"group": "gateway.networking.k8s.io", "kind": "HTTPRoute"},
                {"group": "gateway.networking.k8s.io", "kind": "GRPCRoute"}],
            "conditions": [accepted, _cond("Conflicted", False, "NoConflicts", ok, 0),
                           _cond("Programmed", True, "Programmed", ok, 0),
                           _cond("ResolvedRefs", True, "ResolvedRefs", ok, 0)]}


def gateway_status(store: ObjectStore, gateway: dict, domain: str = "cluster.local") -> dict:
    """``{"conditions", "addresses", "listeners"}`` for one ``istio-waypoint`` Gateway."""
    ns, name = meta(gateway).get("namespace", ""), meta(gateway).get("name", "")
    generation = _generation(gateway)
    errors = gwvalues.gateway_errors(gateway)
    host = f"{name}.{ns}.svc.{domain}"
    svc = store.get("Service", ns, name)
    addresses: list[dict] = []
    if svc is None:
        programmed = _cond("Programmed", False, "AddressNotUsable",
                           f"Failed to assign to any requested addresses: hostname "
                           f"\"{host}\" not found", generation)
    elif not _has_instances(store, svc):
        programmed = _cond("Programmed", False, "AddressNotAssigned",
                           f"Failed to assign to any requested addresses: no instances found "
                           f"for hostname \"{host}\"", generation)
    elif HBONE_PORT not in _service_ports(svc):
        programmed = _cond("Programmed", False, "AddressNotUsable",
                           f"Failed to assign to any requested addresses: port {HBONE_PORT} "
                           f"not found for hostname \"{host}\"", generation)
    else:
        programmed = _cond("Programmed", True, "Programmed", f"Resource programmed, assigned "
                           f"to service(s) {host}:{HBONE_PORT}", generation)
        s = spec(svc)
        addresses = [{"type": "IPAddress", "value": ip}
                     for ip in (s.get("clusterIPs") or [s.get("clusterIP")])
                     if isinstance(ip, str) and ip and ip != "None"]
        addresses.append({"type": "Hostname", "value": host})
    found = spec(gateway).get("listeners") if isinstance(spec(gateway), dict) else None
    listeners = [x for x in found if isinstance(x, dict)] if isinstance(found, list) else []
    served = gwvalues.hbone_listener(listeners)
    out_listeners = []
    for x in listeners:
        st = _listener_status(x, x is served)
        for c in st["conditions"]:
            c["observedGeneration"] = generation
        out_listeners.append(st)
    if errors:  # served as a missing Gateway (model.accepted_gateway): nothing programmed
        addresses = []
        programmed = _cond("Programmed", False, "Invalid", "Gateway is not accepted",
                           generation)
    accepted = _cond("Accepted", False, "Invalid", gwvalues.message(errors), generation) \
        if errors else _cond("Accepted", True, "Accepted", "Resource accepted", generation)
    return {"conditions": [accepted,
                           programmed,
                           _cond("ResolvedRefs", True, "ResolvedRefs", "All references resolved",
                                 generation)],
            "addresses": addresses, "listeners": out_listeners}


#: the condition istiod's ambient index writes on a Service bound (or failing to bind) to a
#: waypoint (``pilot/pkg/model/service.go`` ``WaypointBound``)
WAYPOINT_BOUND = "istio.io/WaypointBound"
INGRESS_USE_WAYPOINT = "istio.io/ingress-use-waypoint"


def service_waypoint_condition(store: ObjectStore, svc: dict) -> dict | None:
    """The ``istio.io/WaypointBound`` condition of one Service, as istiod's
    ``ServiceInfo.GetConditions`` and ``fetchWaypointForTarget`` decide it, or None when the
    Service asks for no waypoint (no ``istio.io/use-waypoint`` on it or its namespace, or
    ``none``; or it is a waypoint / east-west gateway itself):

    - the named Gateway is no waypoint (it does not exist, or has no ``status.addresses``
      yet): False / ``WaypointIsNotReady`` / ``waypoint "<ns>/<name>" is not ready``;
    - its allowed namespaces exclude the Service's: False / ``AttachmentDenied``;
    - it does not take service traffic (``istio.io/waypoint-for``): False /
      ``UnsupportedTrafficType``;
    - else True / ``WaypointAccepted`` / ``Successfully attached to waypoint <ns>/<name>``
      (and istiod's sentence on ``istio.io/ingress-use-waypoint``).

    ``status`` is ``"True"``/``"False"``; ``observedGeneration`` the Service's, left out
    when it has none (the API server drops a zero ``observedGeneration`` of a
    ``metav1.Condition``, and Services carry no ``generation``: a zero would make the
    written status differ from the desired one on every pass)."""
    cond = _service_waypoint_condition(store, svc)
    if cond is not None and not cond["observedGeneration"]:
        del cond["observedGeneration"]
    return cond


def _service_waypoint_condition(store: ObjectStore, svc: dict) -> dict | None:
    labels_ = meta(svc).get("labels")
    labels_ = labels_ if isinstance(labels_, dict) else {}
    if labels_.get(wpmod.MANAGED) in wpmod.MANAGED_NO_WAYPOINT:
        return None
    ns = str(meta(svc).get("namespace") or "")
    ns_obj = store.get("Namespace", "", ns)
    ref = wpmod.use_waypoint_ref(labels_, ns, ns_obj)
    if ref is None:
        return None
    key = f"{ref[0]}/{ref[1]}"
    generation = _generation(svc)
    gw = store.get("Gateway", ref[0], ref[1])
    wp = None
    if gw is not None:
        cls = spec(gw).get("gatewayClassName") if isinstance(spec(gw), dict) else None
        try:
            wp = wpmod.waypoint_from_gateway(
                gw, store.get("GatewayClass", "", str(cls)) if cls else None, "")
        except (TypeError, ValueError, AttributeError, KeyError):
            wp = None  # a malformed Gateway is no waypoint (its own status says why)
    if wp is None:
        return _cond(WAYPOINT_BOUND, False, "WaypointIsNotReady",
                     f'waypoint "{key}" is not ready', generation)
    if not wp.allows(ns, ns_obj):
        return _cond(WAYPOINT_BOUND, False, "AttachmentDenied",
                     f'we are not permitted to attach to waypoint "{key}" (missing '
                     f'allowedRoutes?)', generation)
    if not wp.accepts("service"):
        return _cond(WAYPOINT_BOUND, False, "UnsupportedTrafficType",
                     f'attempting to bind to traffic type "service" which the waypoint '
                     f'"{key}" does not support', generation)
    message = f"Successfully attached to waypoint {key}"
    ingress = labels_.get(INGRESS_USE_WAYPOINT)
    if ingress is None and ns_obj is not None:
        ns_labels = meta(ns_obj).get("labels") or {}
        ingress = ns_labels.get(INGRESS_USE_WAYPOINT) if isinstance(ns_labels, dict) else None
    if ingress is not None and str(ingress).lower() == "true":
        message += ". Ingress traffic will traverse the waypoint"
    elif ingress is not None:
        message += (". Ingress traffic is not using the waypoint, set the "
                    "istio.io/ingress-use-waypoint label to true if desired.")
    return _cond(WAYPOINT_BOUND, True, "WaypointAccepted", message, generation)


#: route kind -> its key in :func:`statuses`
ROUTE_SECTIONS = {"HTTPRoute": "httproutes", "GRPCRoute": "grpcroutes", "TCPRoute": "tcproutes"}


def statuses(store: ObjectStore, domain: str = "cluster.local") -> dict[str, Any]:
    """Every waypoint Gateway's and Service-attached route's status:
    ``{"gateways": {"ns/name": status}, "httproutes": {"ns/name": status},
    "grpcroutes": {...}, "tcproutes": {...}, "invalid": {"Kind ns/name": errors},
    "services": {"ns/name": {"conditions": [istio.io/WaypointBound]}}}`` (``invalid``:
    routes too malformed to have a parent status; ``services``: every Service asking
    for a waypoint, :func:`service_waypoint_condition`), and ``declared_addresses``:
    ``{"ns/name": [values]}`` of each Gateway object's own ``status.addresses`` (what a
    YAML file declares for a waypoint addressed by IP; read by ``status --waypoints`` to
    find the Gateway of such a waypoint, never written)."""
    gateways, declared = {}, {}
    for gw in store.list("Gateway"):
        if spec(gw).get("gatewayClassName") == WAYPOINT_CLASS:
            key = f"{meta(gw).get('namespace')}/{meta(gw).get('name')}"
            gateways[key] = gateway_status(store, gw, domain)
            found = status_of(gw).get("addresses")
            declared[key] = [str(a.get("value")) for a in found
                             if isinstance(a, dict) and a.get("value")] \
                if isinstance(found, list) else []
    out: dict[str, Any] = {"gateways": dict(sorted(gateways.items())),
                           "declared_addresses": declared}
    invalid: dict[str, str] = {}
    for kind, section in ROUTE_SECTIONS.items():
        routes = {}
        for route in store.list(kind):
            nsname = f"{meta(route).get('namespace')}/{meta(route).get('name')}"
            st = route_status(store, route, domain)
            if st["parents"]:
                routes[nsname] = st
            elif _unattributable(route):
                errors = gwvalues.route_errors(route)
                if errors:
                    invalid[f"{kind} {nsname}"] = gwvalues.message(errors)
        out[section] = dict(sorted(routes.items()))
    out["invalid"] = dict(sorted(invalid.items()))
    services = {}
    for svc in store.list("Service"):
        cond = service_waypoint_condition(store, svc)
        if cond is not None:
            services[f"{meta(svc).get('namespace')}/{meta(svc).get('name')}"] = {
                "conditions": [cond]}
    out["services"] = dict(sorted(services.items()))
    return out


def _unattributable(route: dict) -> bool:
    """True when the route's ``parentRefs`` are too malformed to tell whether it is
    attached to a Service (not a list, or an entry not a map): its errors cannot be
    written as a parent status, so :func:`statuses` lists them under ``invalid``."""
    body = spec(route) if isinstance(spec(route), dict) else {}
    refs = body.get("parentRefs")
    return not isinstance(refs, list) or any(not isinstance(r, dict) for r in refs)


def summary(conditions: list[dict]) -> str:
    """``Accepted=True,ResolvedRefs=False(BackendNotFound)`` for a table cell."""
    return ",".join(f"{c['type']}={c['status']}" + (f"({c['reason']})" if c["status"] != "True"
                                                      else "") for c in conditions)
