"""Gateway API ``TCPRoute`` attached to a Service (``parentRefs`` kind Service) -> the
upstream of that service's waypoint TCP chains, as istiod builds it
(``convertTCPRoute`` into VirtualService TCP routes, then ``buildWaypointNetworkFilters``
/ ``getWaypointTCPRoutes`` for the chain of a bound service's TCP port):

- the routes attached to the service whose parentRef names this port or no port; the
  oldest one (``creationTimestamp``, then ``namespace/name``) decides, and of it only the
  first rule (a TCPRoute rule has no matches, so istiod's first matching rule is always
  the first); later rules and routes are reported, not used;
- ``backendRefs``: Services with ``port`` and ``weight`` (default 1); a weight of 0 drops
  the backend; one backend left -> the TCP proxy's ``cluster``, several ->
  ``weighted_clusters`` (Envoy picks one per connection, by weight);
- the cluster of a backend is ``inbound-vip|<port>|<tcp or http>|<host>`` (istiod's
  ``portToSubset``: ``http`` for an HTTP or undeclared backend port, else ``tcp``);
- no backend with a weight, or none that resolves: istiod's placeholder cluster
  ``outbound|65535|zero-weight|internal.cluster.local``, which no proxy has, so each
  connection is closed (the Gateway API's "reject the connection"); Envoy accepts a TCP
  proxy naming an unknown cluster (it is looked up per connection), so nothing is NACKed.

Unsupported (one warning naming the route and the field): a backend kind other than
Service, a backend without ``port``, a weight that is not a non-negative integer.
"""

from __future__ import annotations

from typing import Any, Callable

from ambient.objects import meta, spec

#: istiod's destination for a TCPRoute rule without a backend of weight > 0
ZERO_WEIGHT_CLUSTER = "outbound|65535|zero-weight|internal.cluster.local"


def upstream(attached: list, port: int, resolve: Callable[[str, str, int], str | None],
             problems: list[str]) -> dict[str, Any] | None:
    """The TCP proxy's cluster specifier for the chain of service port ``port``:
    ``{"cluster": name}`` or ``{"weighted_clusters": {"clusters": [{"name", "weight"}]}}``,
    or None when no TCPRoute applies (the chain keeps its own cluster). ``attached`` are
    the service's :class:`ambient.waypoint.httproute.Attached` (oldest first, any kind);
    ``resolve(ns, name, port)`` the cluster of a backend Service port or None."""
    chosen = None
    for att in attached:
        if att.kind != "TCPRoute" or (att.port and att.port != port):
            continue
        if chosen is None:
            chosen = att
            continue
        problems.append(f"TCPRoute {_name(att.route)}: is not used for port {port}: "
                        f"TCPRoute {_name(chosen.route)} is older (istiod uses the oldest)")
    if chosen is None:
        return None
    route = chosen.route
    ns = meta(route).get("namespace", "")
    rules = spec(route).get("rules")
    rules = [r for r in rules if isinstance(r, dict)] if isinstance(rules, list) else []
    for r in range(1, len(rules)):
        problems.append(f"TCPRoute {_name(route)}: field 'spec.rules[{r}]' is not used "
                        f"(istiod uses a TCPRoute's first rule)")
    clusters: list[dict] = []
    for b, ref in enumerate((rules[0].get("backendRefs") or []) if rules else []):
        where = f"TCPRoute {_name(route)}: field 'spec.rules[0].backendRefs[{b}]"
        if not isinstance(ref, dict):
            continue
        kind, group = ref.get("kind") or "Service", ref.get("group") or ""
        weight = ref.get("weight", 1)
        if kind != "Service" or group not in ("", "core"):
            problems.append(f"{where}' kind {kind!r} is not supported (Service): backend "
                            f"dropped")
            continue
        if not isinstance(weight, int) or isinstance(weight, bool) or weight < 0:
            problems.append(f"{where}.weight' {weight!r} is not a weight: dropped")
            continue
        bport = ref.get("port")
        if not isinstance(bport, int):
            problems.append(f"{where}.port' is required for a Service: dropped")
            continue
        if weight == 0:
            continue
        cluster = resolve(str(ref.get("namespace") or ns), str(ref.get("name")), bport)
        if cluster is None:
            problems.append(f"{where}' Service {ref.get('name')!r} port {bport} does not "
                            f"resolve: dropped")
            continue
        clusters.append({"name": cluster, "weight": weight})
    if not clusters:
        return {"cluster": ZERO_WEIGHT_CLUSTER}
    if len(clusters) == 1:
        return {"cluster": clusters[0]["name"]}
    return {"weighted_clusters": {"clusters": clusters}}


def _name(route: dict) -> str:
    return f"{meta(route).get('namespace', '')}/{meta(route).get('name', '')}"
