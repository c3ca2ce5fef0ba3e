"""What one waypoint serves, read from the ambient index and the config store: the
services bound to it (VIPs, ports with their protocol, endpoints per port), the
workloads bound to it, and the AuthorizationPolicies aimed at it.

Istio's ``findWaypointResources`` / ``ServicesForWaypoint`` / ``WorkloadsForWaypoint``
give the same sets; here the binding itself is the index's (``index.waypoint_resources``,
the ``istio.io/use-waypoint`` rules of :mod:`ambient.waypoints`), so ztunnel and the
waypoint always agree on who is bound.

Protocols follow Istio's port rules: a Service port's ``appProtocol``, else its name's
prefix before ``-`` (``http``, ``http2``, ``grpc``, ``tcp`` ...), else *unsupported*
(sniffed: the waypoint has both an HTTP and a TCP chain for it); a ServiceEntry port's
``protocol``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import Iterable

from ambient import workload_pb2 as wl
from ambient.api import AmbientIndex, ObjectStore
from ambient.objects import meta, spec
from ambient.waypoint.httproute import Attached, attached_routes

HTTP_PROTOCOLS = frozenset({"HTTP", "HTTP2", "GRPC", "GRPC-WEB"})
HTTP2_PROTOCOLS = frozenset({"HTTP2", "GRPC"})
TCP_PROTOCOLS = frozenset({"TCP", "TLS", "HTTPS", "MONGO", "REDIS", "MYSQL"})

_APP_PROTOCOLS = {"http": "HTTP", "http2": "HTTP2", "grpc": "GRPC", "grpc-web": "GRPC-WEB",
                  "kubernetes.io/h2c": "HTTP2", "kubernetes.io/ws": "HTTP",
                  "kubernetes.io/wss": "HTTPS", "https": "HTTPS", "tls": "TLS", "tcp": "TCP",
                  "mongo": "MONGO", "redis": "REDIS", "mysql": "MYSQL", "udp": "UDP",
                  "h2c": "HTTP2"}

GATEWAY_GROUP = "gateway.networking.k8s.io"


def port_protocol(app_protocol: object, name: object) -> str:
    """Istio's protocol of a Service port: ``appProtocol``, else the name's prefix, else
    ``UNSUPPORTED`` (sniffed)."""
    for value in (app_protocol, str(name or "").split("-", 1)[0]):
        if isinstance(value, str) and value:
            found = _APP_PROTOCOLS.get(value.lower())
            if found:
                return found
    return "UNSUPPORTED"


@dataclasses.dataclass(frozen=True)
class ServicePort:
    """One port of a bound service: ``port`` (the service port), ``protocol`` (upper-case
    Istio protocol name or ``UNSUPPORTED``)."""

    port: int
    protocol: str
    name: str = ""

    @property
    def http(self) -> bool:
        return self.protocol in HTTP_PROTOCOLS or self.protocol == "UNSUPPORTED"

    @property
    def tcp(self) -> bool:
        return self.protocol not in HTTP_PROTOCOLS

    @property
    def http2(self) -> bool:
        return self.protocol in HTTP2_PROTOCOLS


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """A healthy member workload: ``ip`` text, ``port`` the target port, ``uid``;
    ``hbone`` whether it is reached over HBONE (its workload's ``tunnel_protocol``, as
    istiod's endpoint builder decides; a pod outside the mesh gets plaintext)."""

    ip: str
    port: int
    uid: str
    hbone: bool = True


@dataclasses.dataclass
class BoundService:
    """A service bound to the waypoint. ``key`` is its index name ``namespace/hostname``;
    ``kind`` ``Service`` or ``ServiceEntry`` (``name`` is that object's name)."""

    namespace: str
    name: str
    hostname: str
    kind: str
    vips: tuple[str, ...]
    ports: tuple[ServicePort, ...]
    endpoints: dict[int, tuple[Endpoint, ...]]  # service port -> members

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.hostname}"


@dataclasses.dataclass
class TargetedPolicy:
    """An AuthorizationPolicy aimed at this waypoint: ``scope`` is ``None`` for the whole
    waypoint (targetRefs to the Gateway or the ``istio-waypoint`` GatewayClass) or the
    ``namespace/hostname`` key of the one service it targets."""

    policy: dict
    scope: str | None


@dataclasses.dataclass
class WaypointModel:
    """Everything the Envoy resources of one waypoint are built from.

    ``found`` is False when no Gateway ``namespace/name`` exists (the config is then
    the fixed listeners and clusters only); ``problems`` are the warnings to log, each
    naming the object and the field.
    """

    namespace: str
    name: str
    trust_domain: str
    found: bool = False
    services: list[BoundService] = dataclasses.field(default_factory=list)
    workload_ips: list[str] = dataclasses.field(default_factory=list)
    policies: list[TargetedPolicy] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    annotations: dict[str, str] = dataclasses.field(default_factory=dict)
    #: service key -> HTTPRoutes attached to it (parentRefs kind Service)
    routes: dict[str, list[Attached]] = dataclasses.field(default_factory=dict)
    #: service key -> a Service some attached route sends to (bound or not)
    backends: dict[str, BoundService] = dataclasses.field(default_factory=dict)
    #: service key -> the backend ports attached routes name (only those get clusters)
    backend_ports: dict[str, set[int]] = dataclasses.field(default_factory=dict)
    domain: str = "cluster.local"

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def backend_cluster(self, namespace: str, name: str, port: int) -> str | None:
        """The ``inbound-vip|<port>|http|<host>`` cluster of a route backend, or None when
        that Service (or port) is unknown."""
        svc = self.backends.get(f"{namespace}/{name}.{namespace}.svc.{self.domain}")
        if svc is None or not any(p.port == port for p in svc.ports):
            return None
        return f"inbound-vip|{port}|http|{svc.hostname}"


def _ip(raw: bytes) -> str | None:
    try:
        return str(ipaddress.ip_address(raw))
    except ValueError:
        return None


def _source_object(store: ObjectStore, svc: wl.Service) -> tuple[str, dict | None]:
    """The Service or ServiceEntry an index service came from."""
    obj = store.get("Service", svc.namespace, svc.name)
    if obj is not None and svc.hostname.startswith(f"{svc.name}.{svc.namespace}.svc"):
        return "Service", obj
    for se in store.list("ServiceEntry", svc.namespace):
        hosts = spec(se).get("hosts") or []
        if isinstance(hosts, list) and svc.hostname in hosts:
            return "ServiceEntry", se
    return "Service", obj


def _ports(kind: str, obj: dict | None, svc: wl.Service) -> tuple[ServicePort, ...]:
    declared: dict[int, tuple[str, str]] = {}
    for p in (spec(obj).get("ports") or []) if obj else []:
        if not isinstance(p, dict):
            continue
        number = p.get("port") if kind == "Service" else p.get("number")
        if not isinstance(number, int):
            continue
        if kind == "Service":
            declared[number] = (port_protocol(p.get("appProtocol"), p.get("name")),
                                str(p.get("name") or ""))
        else:
            proto = str(p.get("protocol") or "").upper()
            declared[number] = (proto if proto else "UNSUPPORTED", str(p.get("name") or ""))
    out = []
    for sp in svc.ports:
        proto, name = declared.get(sp.service_port, ("UNSUPPORTED", ""))
        if proto == "UDP":
            continue  # waypoints carry no UDP (as istiod)
        out.append(ServicePort(sp.service_port, proto, name))
    return tuple(out)


def _endpoints(index: AmbientIndex, svc: wl.Service) -> dict[int, tuple[Endpoint, ...]]:
    key = f"{svc.namespace}/{svc.hostname}"
    members: list[wl.Workload] = []
    for name in sorted(index.lookup(key)):
        address = index.address(name)
        if address is not None and address.WhichOneof("type") == "workload":
            members.append(address.workload)
    out: dict[int, tuple[Endpoint, ...]] = {}
    for sp in svc.ports:
        eps = []
        for w in members:
            if w.status != wl.HEALTHY or not w.addresses:
                continue
            ip = _ip(w.addresses[0])
            if ip is None:
                continue
            target = 0
            plist = w.services.get(key)
            if plist is not None:
                target = next((p.target_port for p in plist.ports
                               if p.service_port == sp.service_port), 0)
            target = target or sp.target_port or sp.service_port
            eps.append(Endpoint(ip, target, w.uid, w.tunnel_protocol == wl.HBONE))
        out[sp.service_port] = tuple(eps)
    return out


def _targets(policy: dict) -> list[dict]:
    s = spec(policy)
    refs = s.get("targetRefs")
    out = [r for r in refs if isinstance(r, dict)] if isinstance(refs, list) else []
    if isinstance(s.get("targetRef"), dict):
        out.append(s["targetRef"])
    return out


def targeted_policies(store: ObjectStore, model: WaypointModel, root_namespace: str
                      ) -> list[TargetedPolicy]:
    """The AuthorizationPolicies aimed at this waypoint, as upstream binds them:
    ``targetRefs`` (or ``targetRef``) to the Gateway (same namespace), to the
    ``istio-waypoint`` GatewayClass (policy in the root namespace), to a bound Service
    (group ``""``/``core``) or ServiceEntry (group ``networking.istio.io``) in the
    policy's namespace. Unknown kinds are a problem (named) and bind nothing."""
    by_object: dict[tuple[str, str, str], BoundService] = {
        (s.kind, s.namespace, s.name): s for s in model.services}
    out = []
    for pol in sorted(store.list("AuthorizationPolicy"),
                      key=lambda p: (meta(p).get("namespace", ""), meta(p).get("name", ""))):
        ns, pname = meta(pol).get("namespace", ""), meta(pol).get("name", "")
        for i, ref in enumerate(_targets(pol)):
            kind, group, name = ref.get("kind"), ref.get("group") or "", str(ref.get("name") or "")
            ref_ns = ref.get("namespace") or ns
            if kind == "Gateway" and group == GATEWAY_GROUP:
                if ref_ns == model.namespace and name == model.name and ns == model.namespace:
                    out.append(TargetedPolicy(pol, None))
            elif kind == "GatewayClass" and group == GATEWAY_GROUP:
                if ns == root_namespace and name == "istio-waypoint":
                    out.append(TargetedPolicy(pol, None))
            elif kind == "Service" and group in ("", "core"):
                svc = by_object.get(("Service", ns, name))
                if svc is not None:
                    out.append(TargetedPolicy(pol, svc.key))
            elif kind == "ServiceEntry" and group == "networking.istio.io":
                svc = by_object.get(("ServiceEntry", ns, name))
                if svc is not None:
                    out.append(TargetedPolicy(pol, svc.key))
            else:
                model.problems.append(
                    f"AuthorizationPolicy {ns}/{pname}: field 'spec.targetRefs[{i}]' "
                    f"kind {kind!r} group {group!r} is not supported (Gateway, GatewayClass, "
                    f"Service, ServiceEntry): ignored")
    return out


def _service(store: ObjectStore, index: AmbientIndex, key: str) -> BoundService | None:
    address = index.address(key)
    if address is None or address.WhichOneof("type") != "service":
        return None
    svc = address.service
    src_kind, obj = _source_object(store, svc)
    vips = tuple(ip for ip in (_ip(a.address) for a in svc.addresses) if ip)
    return BoundService(svc.namespace, svc.name, svc.hostname, src_kind, vips,
                        _ports(src_kind, obj, svc), _endpoints(index, svc))


def _route_backends(store: ObjectStore, index: AmbientIndex, model: WaypointModel) -> None:
    bound = {s.key: s for s in model.services}
    for atts in model.routes.values():
        for att in atts:
            rns = meta(att.route).get("namespace", "")
            for rule in spec(att.route).get("rules") or []:
                for ref in (rule.get("backendRefs") or []) if isinstance(rule, dict) else []:
                    if not isinstance(ref, dict) or (ref.get("kind") or "Service") != "Service":
                        continue
                    bns = str(ref.get("namespace") or rns)
                    key = f"{bns}/{ref.get('name')}.{bns}.svc.{model.domain}"
                    if isinstance(ref.get("port"), int):
                        model.backend_ports.setdefault(key, set()).add(ref["port"])
                    if key in model.backends:
                        continue
                    svc = bound.get(key) or _service(store, index, key)
                    if svc is not None:
                        model.backends[key] = svc


def build_model(store: ObjectStore, index: AmbientIndex, namespace: str, name: str, *,
                trust_domain: str = "cluster.local",
                root_namespace: str = "istio-system",
                domain: str = "cluster.local") -> WaypointModel:
    """The :class:`WaypointModel` of Gateway ``namespace/name`` (never raises for bad
    objects: they become ``problems``)."""
    model = WaypointModel(namespace, name, trust_domain, domain=domain)
    gw = store.get("Gateway", namespace, name)
    if gw is None:
        model.problems.append(f"Gateway {namespace}/{name} does not exist: serving an empty "
                              f"waypoint configuration")
        return model
    model.found = True
    model.annotations = {str(k): str(v) for k, v in (meta(gw).get("annotations") or {}).items()}
    bound = sorted(index.waypoint_resources(namespace, name))
    for res in bound:
        address = index.address(res)
        if address is None:
            continue
        kind = address.WhichOneof("type")
        if kind == "service":
            bound_svc = _service(store, index, res)
            if bound_svc is not None:
                model.services.append(bound_svc)
        elif kind == "workload":
            model.workload_ips.extend(ip for ip in (_ip(a) for a in address.workload.addresses)
                                      if ip)
    model.services.sort(key=lambda s: s.key)
    model.policies = targeted_policies(store, model, root_namespace)
    model.routes = attached_routes(
        store, {(s.namespace, s.name): s.key for s in model.services if s.kind == "Service"},
        model.problems)
    _route_backends(store, index, model)
    return model


def policy_names(policies: Iterable[TargetedPolicy]) -> list[str]:
    return [f"{meta(p.policy).get('namespace')}/{meta(p.policy).get('name')}" for p in policies]
