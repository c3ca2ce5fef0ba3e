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
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

from ambient.api import ObjectStore
from ambient.objects import meta, spec

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


def _key(route: dict) -> tuple[str, str, str]:
    m = meta(route)
    return (str(m.get("creationTimestamp") or ""), str(m.get("namespace", "")),
            str(m.get("name", "")))


def attached_routes(store: ObjectStore, services: dict[tuple[str, str], str],
                    problems: list[str]) -> dict[str, list[Attached]]:
    """``{service key: [Attached]}`` for the HTTPRoutes whose ``parentRefs`` name a Service
    in ``services`` (``(namespace, name) -> key``), oldest first."""
    out: dict[str, list[Attached]] = {}
    for route in sorted(store.list("HTTPRoute"), key=_key):
        ns, name = meta(route).get("namespace", ""), meta(route).get("name", "")
        refs = spec(route).get("parentRefs")
        for i, ref in enumerate(refs if isinstance(refs, list) else []):
            if not isinstance(ref, dict):
                continue
            kind, group = ref.get("kind") or "Gateway", ref.get("group")
            group = "gateway.networking.k8s.io" if group is None and kind == "Gateway" else (
                group or "")
            if kind != "Service" or group not in ("", "core"):
                if kind != "Gateway":
                    problems.append(f"HTTPRoute {ns}/{name}: field 'spec.parentRefs[{i}]' kind "
                                    f"{kind!r} is not supported (Service): ignored")
                continue
            key = services.get((str(ref.get("namespace") or ns), str(ref.get("name"))))
            if key is None:
                continue
            port = ref.get("port")
            out.setdefault(key, []).append(Attached(route, port if isinstance(port, int) else 0))
    return out


def _string_match(kind: str, value: str) -> dict:
    return {"safe_regex": {"regex": value}} if kind == "RegularExpression" else {"exact": value}


class RouteBuilder:
    """Envoy routes for one HTTP chain from its attached routes. ``resolve(ns, name,
    port)`` gives the cluster name of a backend Service or None."""

    def __init__(self, attached: list[Attached], port: int,
                 resolve: Callable[[str, str, int], str | None], problems: list[str]):
        self.attached, self.port, self.resolve, self.problems = attached, port, resolve, problems

    def routes(self) -> list[dict]:
        ranked: list[tuple[tuple, dict]] = []
        for att in self.attached:
            if att.port and att.port != self.port:
                continue
            route = att.route
            ns, name = meta(route).get("namespace", ""), meta(route).get("name", "")
            rules = spec(route).get("rules")
            for r, rule in enumerate(rules if isinstance(rules, list) else [{}]):
                if not isinstance(rule, dict):
                    continue
                where = f"HTTPRoute {ns}/{name}: field 'spec.rules[{r}]"
                action = self._action(rule, ns, where)
                matches = rule.get("matches")
                if not isinstance(matches, list) or not matches:
                    matches = [{}]
                for m, match in enumerate(matches):
                    built = self._match(match if isinstance(match, dict) else {},
                                        f"{where}.matches[{m}]")
                    if built is None:
                        continue
                    envoy_match, rank = built
                    ranked.append(((*rank, *_key(route), r, m), {
                        "name": f"{ns}.{name}.{r}.{m}", "match": envoy_match, **action}))
        ranked.sort(key=lambda x: x[0])
        return [r for _, r in ranked]

    def _match(self, match: dict, where: str) -> tuple[dict, tuple] | None:
        out: dict[str, Any] = {}
        path = match.get("path") or {}
        ptype = path.get("type") or "PathPrefix"
        value = str(path.get("value") or "/")
        if ptype == "Exact":
            out["path"] = value
            prank: tuple = (0, 0)
        elif ptype == "PathPrefix":
            trimmed = value.rstrip("/")
            if trimmed:
                out["path_separated_prefix"] = trimmed
            else:
                out["prefix"] = "/"
            prank = (1, -len(trimmed))
        elif ptype == "RegularExpression":
            out["safe_regex"] = {"regex": value}
            prank = (2, 0)
        else:
            self.problems.append(f"{where}.path.type' {ptype!r} is not supported: match skipped")
            return None
        headers = []
        for h in match.get("headers") or []:
            if not isinstance(h, dict) or not h.get("name"):
                continue
            headers.append({"name": str(h["name"]).lower(), "string_match": _string_match(
                str(h.get("type") or "Exact"), str(h.get("value", "")))})
        method = match.get("method")
        if method:
            headers.append({"name": ":method", "string_match": {"exact": str(method)}})
        if headers:
            out["headers"] = headers
        query = []
        for q in match.get("queryParams") or []:
            if isinstance(q, dict) and q.get("name"):
                query.append({"name": str(q["name"]), "string_match": _string_match(
                    str(q.get("type") or "Exact"), str(q.get("value", "")))})
        if query:
            out["query_parameters"] = query
        rank = (*prank, 0 if method else 1, -len(match.get("headers") or []), -len(query))
        return out, rank

    def _action(self, rule: dict, ns: str, where: str) -> dict:
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
        timeouts = rule.get("timeouts") or {}
        if "direct_response" not in out:
            route["timeout"] = _duration(timeouts.get("request"), f"{where}.timeouts.request",
                                         self.problems) or "0s"
            per_try = _duration(timeouts.get("backendRequest"),
                                f"{where}.timeouts.backendRequest", self.problems)
            retry = rule.get("retry")
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


_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m(?!s))?(?:(\d+)s)?(?:(\d+)ms)?$")


def _duration(value: Any, where: str, problems: list[str]) -> str | None:
    """A Gateway API duration (``1h2m3s4ms``) as protobuf JSON seconds, or None."""
    if value is None or value == "":
        return None
    m = _DURATION.match(str(value))
    if not m or not any(m.groups()):
        problems.append(f"{where}' {value!r} is not a Gateway API duration: ignored")
        return None
    h, mi, s, ms = (int(g or 0) for g in m.groups())
    total = h * 3600 + mi * 60 + s + ms / 1000
    return f"{total:.3f}s"
