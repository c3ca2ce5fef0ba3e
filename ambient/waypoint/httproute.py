"""Gateway API ``HTTPRoute`` attached to a Service (``parentRefs`` kind ``Service``, the
GAMMA mesh binding) -> the routes of that service's waypoint HTTP chains.

Implemented as the Gateway API specifies and istiod converts it:

- ``parentRefs``: group ``""``/``core``, kind ``Service``, ``namespace`` (default: the
  route's), optional ``port`` (only that service port; else every HTTP port); a route
  attached to a service bound to this waypoint replaces that chain's default route, and
  a request matching none of its rules gets 404;
- ``matches`` (ORed): ``path`` (``PathPrefix`` by path element, the default, value
  default ``/``; ``Exact``; ``RegularExpression``), ``headers`` and ``queryParams``
  (``Exact``, the default, or ``RegularExpression``), ``method``; ordered by the spec's
  precedence: exact path, then longest prefix, then method, then most headers, then most
  query parameters, then the oldest route (``creationTimestamp``), then ``namespace/name``;
- ``backendRefs``: Services (group ``""``, kind ``Service``, ``port`` required) with
  ``weight`` (default 1; weight 0 sends nothing); a backend that does not resolve is
  dropped with a warning and when none is left the rule answers 500, as the spec says;
- ``filters``: ``RequestHeaderModifier`` and ``ResponseHeaderModifier`` (``set``, ``add``,
  ``remove``); ``timeouts.request`` (route timeout) and ``timeouts.backendRequest``
  (per try); ``retry`` (``attempts``, ``codes``, ``backoff``).

Anything else (another filter type, a parent or backend kind other than Service, a match
type not listed) is one warning naming the route and the field; the part is skipped, never
turned into a resource Envoy would reject.

The same builder carries ``GRPCRoute`` (its matches from :mod:`ambient.waypoint.grpcroute`):
istiod converts both kinds to VirtualService HTTP routes of the same host, one merged
VirtualService per kind, each sorted by the precedence above, and a waypoint's route table
is those VirtualServices one after the other, oldest first. So the routes here are grouped
by kind, the group whose oldest route is older first. :func:`attached_routes` also lists
the ``TCPRoute`` s (:mod:`ambient.waypoint.tcproute` reads them for the TCP chains).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ambient.api import ObjectStore
from ambient.objects import meta, spec
from ambient.waypoint import grpcroute, gwvalues, regex

#: the route kinds a waypoint reads, attached to a Service by ``parentRefs``
ROUTE_KINDS = ("HTTPRoute", "GRPCRoute", "TCPRoute")
#: the kinds whose rules become the HTTP chains' routes
HTTP_KINDS = ("HTTPRoute", "GRPCRoute")
#: the HTTPRoute rule fields the waypoint carries (``name`` only names the rule); any
#: other (``sessionPersistence``, a misspelling) is one warning and ignored
RULE_FIELDS = frozenset({"name", "matches", "filters", "backendRefs", "timeouts", "retry"})
#: the same for the match fields
MATCH_FIELDS = frozenset({"path", "headers", "queryParams", "method"})
#: istiod's default retry policy of a route (``route.DefaultRetryPolicy``): two retries on
#: connection failures, refused streams and retriable codes, never the same host twice
DEFAULT_RETRY: dict[str, Any] = {
    "retry_on": "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes",
    "num_retries": 2, "host_selection_retry_max_attempts": 5,
    "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts",
                              "typed_config": {
                                  "@type": "type.googleapis.com/envoy.extensions.retry.host."
                                           "previous_hosts.v3.PreviousHostsPredicate"}}]}


@dataclasses.dataclass
class Attached:
    """One route attached to ``service`` (``namespace/hostname``), ``port`` 0 for all."""

    route: dict
    port: int

    @property
    def kind(self) -> str:
        return str(self.route.get("kind") or "HTTPRoute")


def _key(route: dict) -> tuple[str, str, str]:
    m = meta(route)
    return (str(m.get("creationTimestamp") or ""), str(m.get("namespace", "")),
            str(m.get("name", "")))


def attached_routes(store: ObjectStore, services: dict[tuple[str, str], str],
                    problems: list[str]) -> dict[str, list[Attached]]:
    """``{service key: [Attached]}`` for the routes (:data:`ROUTE_KINDS`) whose
    ``parentRefs`` name a Service in ``services`` (``(namespace, name) -> key``), oldest
    first (kinds mixed; :attr:`Attached.kind` tells them apart). A route with a value the
    Gateway API CRD refuses or Envoy would NACK (:func:`ambient.waypoint.gwvalues.route_errors`)
    attaches nowhere: one problem names the field and the value, its status says
    ``Accepted=False``, and the other routes are built as if it did not exist."""
    out: dict[str, list[Attached]] = {}
    routes = [r for kind in ROUTE_KINDS for r in store.list(kind)]
    for route in sorted(routes, key=_key):
        rkind = str(route.get("kind") or "HTTPRoute")
        ns, name = meta(route).get("namespace", ""), meta(route).get("name", "")
        errors = gwvalues.route_errors(route)
        refs = spec(route).get("parentRefs") if isinstance(spec(route), dict) else None
        if errors:
            # named by this waypoint when it would have attached here (or cannot tell)
            if not isinstance(refs, list) or any(
                    not isinstance(r, dict) or not isinstance(r.get("name"), str)
                    or services.get(
                        (str(r.get("namespace") or ns), str(r.get("name")))) is not None
                    for r in refs):
                problems.append(f"{rkind} {ns}/{name}: not accepted, not served: "
                                f"{gwvalues.message(errors)}")
            continue
        for i, ref in enumerate(refs if isinstance(refs, list) else []):
            if not isinstance(ref, dict):
                continue
            kind, group = ref.get("kind") or "Gateway", ref.get("group")
            group = "gateway.networking.k8s.io" if group is None and kind == "Gateway" else (
                group or "")
            if kind != "Service" or group not in ("", "core"):
                if kind != "Gateway":
                    problems.append(f"{rkind} {ns}/{name}: field 'spec.parentRefs[{i}]' kind "
                                    f"{kind!r} is not supported (Service): ignored")
                continue
            key = services.get((str(ref.get("namespace") or ns), str(ref.get("name"))))
            if key is None:
                continue
            port = ref.get("port")
            out.setdefault(key, []).append(Attached(route, port if isinstance(port, int) else 0))
    return out


def regex_ok(value: str, where: str, problems: list[str]) -> bool:
    """Whether Envoy takes ``value`` as a route regex; if not, a problem naming the field
    ``where`` (``...field 'x.y'``) and the match is skipped by the caller."""
    why = regex.problem(value)
    if why is None:
        return True
    problems.append(f"{where} {value!r} is not supported: it {why}: match skipped")
    return False


def _string_match(kind: str, value: str) -> dict:
    return {"safe_regex": {"regex": value}} if kind == "RegularExpression" else {"exact": value}


class RouteBuilder:
    """Envoy routes for one HTTP chain from its attached routes. ``resolve(ns, name,
    port)`` gives the cluster name of a backend Service or None."""

    def __init__(self, attached: list[Attached], port: int,
                 resolve: Callable[[str, str, int], str | None], problems: list[str]):
        self.attached, self.port, self.resolve, self.problems = attached, port, resolve, problems

    def routes(self) -> list[dict]:
        """The Envoy routes of this chain: per kind (:data:`HTTP_KINDS`) sorted by the
        precedence, the kinds in the order of their oldest route (module docstring)."""
        groups: dict[str, list[tuple[tuple, dict]]] = {}
        for att in self.attached:
            if att.kind not in HTTP_KINDS or (att.port and att.port != self.port):
                continue
            ranked = groups.setdefault(att.kind, [])
            route = att.route
            ns, name = meta(route).get("namespace", ""), meta(route).get("name", "")
            rules = spec(route).get("rules")
            for r, rule in enumerate(rules if isinstance(rules, list) else [{}]):
                if not isinstance(rule, dict):
                    continue
                where = f"{att.kind} {ns}/{name}: field 'spec.rules[{r}]"
                if att.kind == "GRPCRoute":
                    grpcroute.check_rule(rule, where, self.problems)
                else:
                    _check_fields(rule, RULE_FIELDS, where, self.problems)
                action = self._action(rule, ns, where, grpc=att.kind == "GRPCRoute")
                found = rule.get("matches")
                matches: list = found if isinstance(found, list) and found else []
                catch_all = not matches
                if catch_all:
                    matches = [{}]
                for m, match in enumerate(matches):
                    match = match if isinstance(match, dict) else {}
                    built = grpcroute.match(match, f"{where}.matches[{m}]", self.problems) \
                        if att.kind == "GRPCRoute" else self._match(match, f"{where}.matches[{m}]")
                    if built is None:
                        continue
                    envoy_match, rank = built
                    if catch_all:  # a rule without matches sorts last (istiod's sort)
                        rank = (9,)
                    ranked.append(((*rank, *_key(route), r, m), {
                        "name": f"{ns}.{name}.{r}.{m}", "match": envoy_match, **action}))
        out: list[dict] = []
        # groups were filled in route age order: the first kind seen has the oldest route
        for ranked in groups.values():
            ranked.sort(key=lambda x: x[0])
            out.extend(r for _, r in ranked)
        return out

    def _match(self, match: dict, where: str) -> tuple[dict, tuple] | None:
        _check_fields(match, MATCH_FIELDS, where, self.problems)
        out: dict[str, Any] = {}
        path = match.get("path") or {}
        ptype = path.get("type") or "PathPrefix"
        value = str(path.get("value") or "/")
        if ptype == "Exact":
            out["path"] = value
            prank: tuple = (0, -len(value))
        elif ptype == "PathPrefix":
            trimmed = value.rstrip("/")
            if trimmed:
                out["path_separated_prefix"] = trimmed
            else:
                out["prefix"] = "/"
            prank = (1, -len(trimmed))
        elif ptype == "RegularExpression":
            if not regex_ok(value, f"{where}.path.value'", self.problems):
                return None
            out["safe_regex"] = {"regex": value}
            prank = (2, -len(value))
        else:
            self.problems.append(f"{where}.path.type' {ptype!r} is not supported: match skipped")
            return None
        headers = []
        for i, h in enumerate(match.get("headers") or []):
            if not isinstance(h, dict) or not h.get("name"):
                continue
            if h.get("type") == "RegularExpression" and not regex_ok(
                    str(h.get("value", "")), f"{where}.headers[{i}].value'", self.problems):
                return None
            headers.append({"name": str(h["name"]).lower(), "string_match": _string_match(
                str(h.get("type") or "Exact"), str(h.get("value", "")))})
        method = match.get("method")
        if method:
            headers.append({"name": ":method", "string_match": {"exact": str(method)}})
        if headers:
            out["headers"] = headers
        query = []
        for i, q in enumerate(match.get("queryParams") or []):
            if isinstance(q, dict) and q.get("type") == "RegularExpression" and not regex_ok(
                    str(q.get("value", "")), f"{where}.queryParams[{i}].value'", self.problems):
                return None
            if isinstance(q, dict) and q.get("name"):
                query.append({"name": str(q["name"]), "string_match": _string_match(
                    str(q.get("type") or "Exact"), str(q.get("value", "")))})
        if query:
            out["query_parameters"] = query
        rank = (*prank, 0 if method else 1, -len(match.get("headers") or []), -len(query))
        return out, rank

    def _action(self, rule: dict, ns: str, where: str, grpc: bool = False) -> dict:
        out: dict[str, Any] = {}
        clusters = []
        for b, ref in enumerate(rule.get("backendRefs") or []):
            bwhere = f"{where}.backendRefs[{b}]"
            if not isinstance(ref, dict):
                continue
            kind, group = ref.get("kind") or "Service", ref.get("group") or ""
            weight = ref.get("weight", 1)
            if kind != "Service" or group not in ("", "core"):
                self.problems.append(f"{bwhere}' kind {kind!r} is not supported (Service): "
                                     f"backend dropped")
                continue
            if not isinstance(weight, int) or weight < 0:
                self.problems.append(f"{bwhere}.weight' {weight!r} is not a weight: dropped")
                continue
            port = ref.get("port")
            if not isinstance(port, int):
                self.problems.append(f"{bwhere}.port' is required for a Service: dropped")
                continue
            cluster = self.resolve(str(ref.get("namespace") or ns), str(ref.get("name")), port)
            if cluster is None:
                self.problems.append(f"{bwhere}' Service {ref.get('name')!r} port {port} does "
                                     f"not resolve: dropped")
                continue
            if weight:
                clusters.append({"name": cluster, "weight": weight})
            self._filters(ref.get("filters"), f"{bwhere}.filters", out, backend=True)
        route: dict[str, Any] = {}
        if not clusters:
            out["direct_response"] = {"status": 500}
        elif len(clusters) == 1:
            route["cluster"] = clusters[0]["name"]
        else:
            route["weighted_clusters"] = {"clusters": clusters}
        self._filters(rule.get("filters"), f"{where}.filters", out, backend=False)
        timeouts = (rule.get("timeouts") or {}) if not grpc else {}
        if "direct_response" not in out:
            route["timeout"] = _duration(timeouts.get("request"), f"{where}.timeouts.request",
                                         self.problems) or "0s"
            per_try = _duration(timeouts.get("backendRequest"),
                                f"{where}.timeouts.backendRequest", self.problems)
            retry = rule.get("retry") if not grpc else None
            route["cluster_not_found_response_code"] = "INTERNAL_SERVER_ERROR"
            if not isinstance(retry, dict) and not per_try:
                route["retry_policy"] = DEFAULT_RETRY
            if isinstance(retry, dict) or per_try:
                policy: dict[str, Any] = {"retry_on": "connect-failure,refused-stream,unavailable,"
                                                      "cancelled,retriable-status-codes"}
                if isinstance(retry, dict):
                    attempts = retry.get("attempts")
                    if isinstance(attempts, int) and attempts >= 0:
                        policy["num_retries"] = attempts
                    codes = [c for c in retry.get("codes") or [] if isinstance(c, int)]
                    if codes:
                        policy["retriable_status_codes"] = codes
                    backoff = _duration(retry.get("backoff"), f"{where}.retry.backoff",
                                        self.problems)
                    if backoff:
                        policy["retry_back_off"] = {"base_interval": backoff}
                if per_try:
                    policy["per_try_timeout"] = per_try
                route["retry_policy"] = policy
            out["route"] = route
        return out

    def _filters(self, filters: Any, where: str, out: dict, backend: bool) -> None:
        for f, flt in enumerate(filters if isinstance(filters, list) else []):
            if not isinstance(flt, dict):
                continue
            ftype = flt.get("type")
            if ftype == "RequestHeaderModifier" and not backend:
                _headers(flt.get("requestHeaderModifier") or {}, out, "request")
            elif ftype == "ResponseHeaderModifier" and not backend:
                _headers(flt.get("responseHeaderModifier") or {}, out, "response")
            else:
                self.problems.append(f"{where}[{f}].type' {ftype!r} is not supported here: "
                                     f"filter skipped")


def _check_fields(obj: dict, known: frozenset[str], where: str, problems: list[str]) -> None:
    """One warning for each field of ``obj`` (a rule or a match) not in ``known``: the
    YAML directory has no API server to prune unknown fields, and a field the waypoint
    does not carry must not pass unseen."""
    for key in sorted(k for k in obj if k not in known):
        problems.append(f"{where}.{key}' is not supported: ignored")


def _headers(mod: dict, out: dict, side: str) -> None:
    add = out.setdefault(f"{side}_headers_to_add", [])
    for h in mod.get("set") or []:
        if isinstance(h, dict) and h.get("name"):
            add.append({"header": {"key": str(h["name"]), "value": str(h.get("value", ""))},
                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"})
    for h in mod.get("add") or []:
        if isinstance(h, dict) and h.get("name"):
            add.append({"header": {"key": str(h["name"]), "value": str(h.get("value", ""))},
                        "append_action": "APPEND_IF_EXISTS_OR_ADD"})
    if not add:
        out.pop(f"{side}_headers_to_add")
    remove = [str(n) for n in mod.get("remove") or [] if isinstance(n, str)]
    if remove:
        out.setdefault(f"{side}_headers_to_remove", []).extend(remove)


def _duration(value: Any, where: str, problems: list[str]) -> str | None:
    """A Gateway API duration (``1h2m3s4ms``, :func:`ambient.waypoint.gwvalues.parse_duration`)
    as protobuf JSON seconds, or None (absent; one that does not parse is a problem, though
    :func:`attached_routes` already left such a route out)."""
    if value is None or value == "":
        return None
    total = gwvalues.parse_duration(value)
    if total is None:
        problems.append(f"{where}' {value!r} is not a Gateway API duration: ignored")
        return None
    return f"{total:.3f}s"
