"""Gateway API ``GRPCRoute`` matches as Envoy route matches, the way istiod converts a
GRPCRoute to VirtualService HTTP routes (``convertGRPCRoute``, ``createGRPCURIMatch``,
``createGRPCHeadersMatch``). gRPC calls are HTTP/2 ``POST /<service>/<method>``, so:

- ``method`` ``type: Exact`` (the default): service and method -> path exactly
  ``/<service>/<method>``; service only -> path prefix ``/<service>/`` (as istiod's route
  translation emits it: ``path_separated_prefix`` ``/<service>``); method only ->
  path regex ``/[^/]+/<method>``;
- ``type: RegularExpression``: service and method -> regex ``/<service>/<method>``;
  service only -> regex ``/<service>/.+``; method only -> regex ``/[^/]+/<method>``;
- no ``method``: no path condition (every path);
- ``headers`` (``Exact``, the default, or ``RegularExpression``) -> header matches.

The rest of a rule (``backendRefs`` with weights, ``RequestHeaderModifier`` /
``ResponseHeaderModifier`` filters) is the HTTPRoute builder's
(:class:`ambient.waypoint.httproute.RouteBuilder`); a GRPCRoute has no timeouts or
retries of its own, so its routes get istiod's default retry policy. Ranks follow
istiod's ``sortHTTPRoutes``: exact path, then prefix, then regex (each longer first), then
no path condition; then more headers.

Unsupported (one warning naming the route and the field, the part skipped): a method
match with neither service nor method, an unknown match type, a regular expression Envoy
would reject (:mod:`ambient.waypoint.regex`), ``sessionPersistence``, ``RequestMirror`` and
``ExtensionRef`` filters (the builder's filter check).
"""

from __future__ import annotations

from typing import Any

from ambient.waypoint import regex

#: rule fields the waypoint carries (others are named in a warning)
RULE_FIELDS = frozenset({"name", "matches", "filters", "backendRefs"})


def check_rule(rule: dict, where: str, problems: list[str]) -> None:
    """One warning for each rule field of ``rule`` the waypoint does not carry."""
    for key in sorted(rule):
        if key not in RULE_FIELDS:
            problems.append(f"{where}.{key}' is not supported for GRPCRoute: ignored")


def _regex_ok(pattern: str, where: str, problems: list[str]) -> bool:
    why = regex.problem(pattern)
    if why is None:
        return True
    problems.append(f"{where} regex {pattern!r} is not supported: it {why}: match skipped")
    return False


def _string(kind: str, value: str) -> dict:
    return {"safe_regex": {"regex": value}} if kind == "RegularExpression" else {"exact": value}


def match(m: dict, where: str, problems: list[str]) -> tuple[dict, tuple] | None:
    """``(Envoy RouteMatch dict, rank)`` of one GRPCRoute match, or None (skipped, with a
    problem) when it cannot be carried. ``rank`` sorts as the HTTPRoute builder's ranks."""
    out: dict[str, Any] = {}
    method = m.get("method")
    rank: tuple
    if isinstance(method, dict):
        mtype = str(method.get("type") or "Exact")
        svc, meth = method.get("service"), method.get("method")
        svc = str(svc) if svc else None
        meth = str(meth) if meth else None
        if svc is None and meth is None:
            problems.append(f"{where}.method' needs 'service' or 'method': match skipped")
            return None
        if mtype == "Exact":
            if meth is None:
                # istiod's route translation turns a prefix ending in "/" into a
                # path-separated prefix: "/<service>" and everything under "/<service>/"
                out["path_separated_prefix"] = f"/{svc}"
                rank = (1, -len(f"/{svc}/"))
            elif svc is None:
                out["safe_regex"] = {"regex": f"/[^/]+/{meth}"}
                rank = (2, -len(out["safe_regex"]["regex"]))
                if not _regex_ok(out["safe_regex"]["regex"], f"{where}.method.method'",
                                 problems):
                    return None
            else:
                out["path"] = f"/{svc}/{meth}"
                rank = (0, -len(out["path"]))
        elif mtype == "RegularExpression":
            pattern = (f"/{svc}/.+" if meth is None else
                       f"/[^/]+/{meth}" if svc is None else f"/{svc}/{meth}")
            if not _regex_ok(pattern, f"{where}.method'", problems):
                return None
            out["safe_regex"] = {"regex": pattern}
            rank = (2, -len(pattern))
        else:
            problems.append(f"{where}.method.type' {mtype!r} is not supported: match skipped")
            return None
    else:
        out["prefix"] = "/"
        rank = (3, 0)
    headers = []
    for h in m.get("headers") or []:
        if not isinstance(h, dict) or not h.get("name"):
            continue
        htype = str(h.get("type") or "Exact")
        if htype not in ("Exact", "RegularExpression"):
            problems.append(f"{where}.headers' type {htype!r} is not supported: match skipped")
            return None
        if htype == "RegularExpression" and not _regex_ok(
                str(h.get("value", "")), f"{where}.headers.value'", problems):
            return None
        headers.append({"name": str(h["name"]).lower(),
                        "string_match": _string(htype, str(h.get("value", "")))})
    if headers:
        out["headers"] = headers
    # (path rank, path length, no HTTP method condition, -headers, -query parameters)
    return out, (*rank, 1, -len(headers), 0)
