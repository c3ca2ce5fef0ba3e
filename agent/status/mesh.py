"""The mesh as this agent's index serves it: workloads, services, policies, waypoints.

The operator's equivalent of ``istioctl ztunnel-config workloads|services|policies``
(which reads ztunnel's ``/config_dump``), taken from the source instead: the ambient
index's ``Address`` and ``Authorization`` resources, which are exactly what the workload
xDS server sends. Each workload row also says what this node does with it: whether the
enrollment holds a record for it (``enrolled``: its status, or ``-``) and whether a
connected ztunnel holds it over ZDS (``ztunnel``).

Two halves:

- :func:`mesh_view` (server side, in the ``/debug/mesh`` document): plain JSON rows.
- :func:`render` (``ambient-agent status``): tables, filtered by section, namespace and node.

Row shapes (all values JSON scalars or lists of strings):

- workload: ``namespace``, ``name``, ``kind`` (Pod, WorkloadEntry, ServiceEntry,
  EndpointSlice, from the uid), ``ips``, ``node``, ``protocol`` (HBONE / TCP),
  ``status`` (Healthy / Unhealthy), ``identity`` (``spiffe://...``), ``waypoint``,
  ``services`` (``namespace/hostname``), ``enrolled``, ``ztunnel`` (bool), ``uid``.
- service: ``namespace``, ``name``, ``hostname``, ``vips``, ``ports`` (``80->8080``;
  ``80->named`` for a named targetPort, resolved per pod),
  ``endpoints`` (workloads selecting it), ``waypoint``.
- policy: ``namespace``, ``name``, ``scope``, ``action``, ``rules``, ``dry_run``.
- waypoint: ``namespace``, ``name``, ``ips``, ``bound`` (services and workloads using it),
  ``gateway`` (its Gateway's conditions, ``Programmed=True``...), ``routes`` (each
  HTTPRoute attached to a bound Service: ``ns/name: Accepted=...,ResolvedRefs=...``; a
  GRPCRoute or TCPRoute the same, prefixed ``GRPCRoute`` / ``TCPRoute``).
"""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import Any, Iterable, Mapping, Protocol

from agent.status.report import table

SECTIONS = ("workloads", "services", "policies", "waypoints")


# --- server side ---------------------------------------------------------------------------

def _ip(raw: bytes) -> str:
    try:
        return str(ipaddress.ip_address(raw))
    except ValueError:
        return raw.hex()


def _gateway(gw: Any) -> str:
    if gw is None:
        return ""
    kind = gw.WhichOneof("destination")
    if kind == "hostname":
        return f"{gw.hostname.namespace}/{gw.hostname.hostname}"
    if kind == "address":
        return _ip(gw.address.address)
    return ""


class MeshIndex(Protocol):
    """What the view reads of the ambient index (``ambient.api.AmbientIndex`` has it): its
    ``Address`` and ``Authorization`` resources by name, as protobuf messages.

    The view uses only the generic message API (``HasField``, ``WhichOneof``, fields) and
    takes enum value names from each message's own descriptor (:func:`_enum_name`), so
    the status component never imports the index's generated modules."""

    def addresses(self) -> Mapping[str, Any]: ...

    def authorizations(self) -> Mapping[str, Any]: ...


def _enum_name(message: Any, field: str) -> str:
    """The name of the enum value in ``message.<field>`` (``"HBONE"``, ``"HEALTHY"``,
    ``"ALLOW"``), read from the message's descriptor; the number when the value is not
    one the descriptor knows (a newer peer)."""
    number = getattr(message, field)
    value = message.DESCRIPTOR.fields_by_name[field].enum_type.values_by_number.get(number)
    return value.name if value is not None else str(number)


def _kind(uid: str) -> str:
    for kind in ("WorkloadEntry", "ServiceEntry", "EndpointSlice", "Pod"):
        if f"/{kind}/" in uid:
            return kind
    return "?"


class EnrolledPods(Protocol):
    """What the view reads of enrollment (``cni.enrollment.Enrollment`` has it): its
    records by pod UID, each with ``namespace``, ``name``, ``ips`` and ``status``."""

    def pods(self) -> Mapping[str, Any]: ...


class DebugState(Protocol):
    """A component's ``/debug`` document (the ZDS server's lists its connections)."""

    def debug_state(self) -> Any: ...


@dataclasses.dataclass(frozen=True)
class MeshParts:
    """The components ``/debug/mesh`` reads, as ``agent.daemon`` wired them (None: not
    running in this agent)."""

    index: MeshIndex | None = None
    enrollment: EnrolledPods | None = None
    zds: DebugState | None = None
    waypoints: "WaypointStatus | None" = None


class WaypointStatus(Protocol):
    """The waypoint configurations' status (``ambient.waypoint.service.WaypointConfigs``):
    ``{"gateways": {"ns/name": {"conditions", "addresses"}}, "httproutes": {"ns/name":
    {"parents": [{"parentRef", "conditions"}]}}}``, as istiod's Gateway controller
    reports them."""

    def status_view(self) -> dict: ...


def mesh_view(parts: MeshParts) -> dict[str, Any]:
    """The ``/debug/mesh`` document from the running components (index, enrollment,
    ZDS); a missing component leaves its columns empty, a missing index gives
    ``{"error": ...}``."""
    index = parts.index
    if index is None:
        return {"error": "no ambient index in this agent", "missing": True}
    enrolled = _enrollment(parts.enrollment)
    held = _held(parts.zds)
    workloads, services = [], []
    for _name, addr in sorted(index.addresses().items()):
        if addr.HasField("workload"):
            w = addr.workload
            ips = [_ip(a) for a in w.addresses]
            rec = enrolled.get((w.namespace, w.name)) or next(
                (r for ip in ips for r in [enrolled.get(ip)] if r), None)
            workloads.append({
                "namespace": w.namespace, "name": w.name, "kind": _kind(w.uid), "ips": ips,
                "node": w.node, "protocol": _enum_name(w, "tunnel_protocol")
                if w.tunnel_protocol else "TCP",
                "status": "Healthy" if _enum_name(w, "status") == "HEALTHY" else "Unhealthy",
                "identity": f"spiffe://{w.trust_domain or 'cluster.local'}/ns/{w.namespace}"
                            f"/sa/{w.service_account or 'default'}",
                "waypoint": _gateway(w.waypoint) if w.HasField("waypoint") else "",
                "services": sorted(w.services), "uid": w.uid,
                "enrolled": rec["status"] if rec else "",
                "ztunnel": bool(rec and rec["uid"] in held)})
        elif addr.HasField("service"):
            s = addr.service
            services.append({
                "namespace": s.namespace, "name": s.name, "hostname": s.hostname,
                "vips": [_ip(a.address) for a in s.addresses],
                # target 0: a named targetPort, which each pod resolves to its own number
                # (the workload's ports; showing the service port there was wrong)
                "ports": [f"{p.service_port}->{p.target_port or 'named'}" for p in s.ports],
                "endpoints": 0, "waypoint": _gateway(s.waypoint) if s.HasField("waypoint")
                else ""})
    by_host = {f"{s['namespace']}/{s['hostname']}": s for s in services}
    for w in workloads:
        for key in w["services"]:
            if key in by_host:
                by_host[key]["endpoints"] += 1
    policies = []
    for _name, pol in sorted(index.authorizations().items()):
        policies.append({"namespace": pol.namespace, "name": pol.name,
                         "scope": _enum_name(pol, "scope"), "action": _enum_name(pol, "action"),
                         "rules": sum(len(g.rules) for g in pol.groups),
                         "dry_run": pol.dry_run})
    waypoints = _waypoints(index, workloads, services, _status(parts.waypoints))
    return {"workloads": workloads, "services": services, "policies": policies,
            "waypoints": waypoints}


def _status(component: WaypointStatus | None) -> dict:
    if component is None:
        return {}
    try:
        return component.status_view()
    except Exception:  # noqa: BLE001 - the view never fails for one component
        return {}


def _conditions(conditions: list[dict]) -> str:
    return ",".join(f"{c.get('type')}={c.get('status')}" + (
        f"({c.get('reason')})" if c.get("status") != "True" else "") for c in conditions)


def _waypoints(index: MeshIndex, workloads: list[dict], services: list[dict],
               status: dict | None = None) -> list[dict]:
    status = status or {}
    used: dict[str, list[str]] = {}
    for row in workloads + services:
        if row["waypoint"]:
            used.setdefault(row["waypoint"], []).append(
                f"{row['namespace']}/{row.get('hostname') or row['name']}")
    out = []
    for key, bound in sorted(used.items()):
        namespace, _, name = key.partition("/")
        hostname = name
        svc = next((s for s in services if s["namespace"] == namespace
                    and s["hostname"] == hostname), None)
        row = {"namespace": namespace if name else "", "name": (svc or {}).get("name")
               or name or key, "ips": (svc or {}).get("vips", []) if name else [key],
               "bound": sorted(bound)}
        # its Gateway: by name, or (a waypoint the index knows by address) by address
        gateways = status.get("gateways") or {}
        gkey = f"{row['namespace']}/{row['name']}"
        if gkey not in gateways:
            declared = status.get("declared_addresses") or {}
            gkey = next((k for k, g in gateways.items()
                         if any(a.get("value") in row["ips"] for a in g.get("addresses") or [])
                         or any(v in row["ips"] for v in declared.get(k) or [])), "")
        if gkey and not row["namespace"]:  # known to the index by address only
            row["namespace"], row["name"] = gkey.split("/", 1)
        gw = gateways.get(gkey) or {}
        row["gateway"] = f"{gkey}: {_conditions(gw.get('conditions') or [])}" if gw else ""
        routes = []
        for section, label in (("httproutes", ""), ("grpcroutes", "GRPCRoute "),
                               ("tcproutes", "TCPRoute ")):
            for rkey, rst in sorted((status.get(section) or {}).items()):
                for parent in rst.get("parents") or []:
                    ref = parent.get("parentRef") or {}
                    pns = ref.get("namespace") or rkey.split("/", 1)[0]
                    if any(b.startswith(f"{pns}/{ref.get('name')}.{pns}.svc.") for b in bound):
                        routes.append(f"{label}{rkey}: "
                                      f"{_conditions(parent.get('conditions') or [])}")
        row["routes"] = routes
        out.append(row)
    # routes whose parentRefs are too malformed to belong to any waypoint: one row each
    for rkey, text in sorted((status.get("invalid") or {}).items()):
        kind, _, nsname = rkey.partition(" ")
        out.append({"namespace": nsname.split("/", 1)[0], "name": "(no parent)", "ips": [],
                    "bound": [], "gateway": "",
                    "routes": [f"{kind} {nsname}: Accepted=False(UnsupportedValue) {text}"]})
    return out


def _enrollment(component: EnrolledPods | None) -> dict:
    """(namespace, name) and each IP -> {"uid", "status"} of the enrollment's records."""
    out: dict = {}
    if component is None:
        return out
    for uid, rec in component.pods().items():
        entry = {"uid": uid, "status": getattr(rec, "status", "") or "pending"}
        out[(rec.namespace, rec.name)] = entry
        for ip in rec.ips:
            out[ip] = entry
    return out


def _held(component: DebugState | None) -> set[str]:
    """UIDs that the newest ZDS connection holds (what ztunnel runs proxies for)."""
    if component is None:
        return set()
    try:
        state = component.debug_state()
    except Exception:  # noqa: BLE001 - the view never fails for one component
        return set()
    out: set[str] = set()
    for conn in state.get("connections") or []:
        if conn.get("latest"):
            out |= set((conn.get("holds") or {}).keys())
    return out


# --- client side ---------------------------------------------------------------------------

WORKLOAD_COLUMNS = ["namespace", "name", "kind", "ips", "node", "protocol", "status",
                    "waypoint", "enrolled", "ztunnel"]
SERVICE_COLUMNS = ["namespace", "name", "vips", "ports", "endpoints", "waypoint"]
POLICY_COLUMNS = ["namespace", "name", "scope", "action", "rules", "dry_run"]
WAYPOINT_COLUMNS = ["namespace", "name", "ips", "bound", "gateway", "routes"]
COLUMNS = {"workloads": WORKLOAD_COLUMNS, "services": SERVICE_COLUMNS,
           "policies": POLICY_COLUMNS, "waypoints": WAYPOINT_COLUMNS}


def select(view: dict, section: str, namespace: str | None = None,
           node: str | None = None) -> list[dict]:
    """The rows of one section, filtered: ``namespace`` on every section, ``node`` on
    workloads (and on nothing else: services and policies have no node)."""
    rows = [r for r in view.get(section) or [] if isinstance(r, dict)]
    if namespace:
        rows = [r for r in rows if r.get("namespace") == namespace]
    if node and section == "workloads":
        rows = [r for r in rows if r.get("node") == node]
    return rows


def render(view: dict, sections: Iterable[str] = SECTIONS, namespace: str | None = None,
           node: str | None = None, wide: bool = False) -> str:
    """Tables of the chosen sections (empty ones say so). ``wide`` adds the identity,
    services and uid of workloads."""
    if not isinstance(view, dict) or view.get("error"):
        return f"Mesh: unavailable ({(view or {}).get('error', 'no data')})"
    parts = []
    for section in sections:
        rows = select(view, section, namespace, node)
        columns = list(COLUMNS[section])
        if wide and section == "workloads":
            columns += ["identity", "services", "uid"]
        title = f"{section.capitalize()} ({len(rows)})"
        parts.append(f"{title}\n" + (table(rows, columns, unlimited=("uid", "identity"))
                                     if rows else "  none"))
    return "\n\n".join(parts)
