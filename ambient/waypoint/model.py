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

import bisect
import dataclasses
import functools
import ipaddress
import socket
from typing import Iterable, NamedTuple

from ambient import workload_pb2 as wl
from ambient.api import AmbientIndex, ObjectStore
from ambient.objects import meta, spec
from ambient.waypoint import gwvalues
from ambient.waypoint.httproute import Attached, attached_routes

HTTP_PROTOCOLS = frozenset({"HTTP", "HTTP2", "GRPC", "GRPC-WEB"})
HTTP2_PROTOCOLS = frozenset({"HTTP2", "GRPC"})

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


def backend_subset(port: ServicePort) -> str:
    """The cluster subset a route backend's port is reached by (istiod's ``portToSubset``)."""
    return "http" if port.http else "tcp"


class Endpoint(NamedTuple):
    """A healthy member workload: ``ip`` text, ``port`` the target port, ``uid``;
    ``hbone`` whether it is reached over HBONE (its workload's ``tunnel_protocol``, as
    istiod's endpoint builder decides; a pod outside the mesh gets plaintext). A named
    tuple: one is made per member and port on every build (a frozen dataclass costs
    several times more to make)."""

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

    @functools.cached_property
    def key(self) -> str:
        # made once: every step of a build looks services up by it
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

    ``found`` is False when no Gateway ``namespace/name`` exists or it is not accepted
    (:func:`accepted_gateway`; the config is then
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
    #: service key -> HTTPRoutes, GRPCRoutes and TCPRoutes attached to it (parentRefs kind
    #: Service), oldest first
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
        """The ``inbound-vip|<port>|<subset>|<host>`` cluster of a route backend, or None
        when that Service (or port) is unknown; ``subset`` as istiod's ``portToSubset``:
        ``http`` for an HTTP or undeclared port, else ``tcp``."""
        svc = self.backends.get(f"{namespace}/{name}.{namespace}.svc.{self.domain}")
        found = next((p for p in svc.ports if p.port == port), None) if svc else None
        if svc is None or found is None:
            return None
        return f"inbound-vip|{port}|{backend_subset(found)}|{svc.hostname}"


def _ip(raw: bytes) -> str | None:
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw)
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
        out.append(_service_port(sp.service_port, proto, name))
    return tuple(out)


_PORTS: dict[tuple[int, str, str], ServicePort] = {}


def _service_port(number: int, protocol: str, name: str) -> ServicePort:
    """The one :class:`ServicePort` of these values (immutable, so shared by every service
    that has it: most services have the same few ports; bounded, 10,000 kept)."""
    key = (number, protocol, name)
    found = _PORTS.get(key)
    if found is None:
        if len(_PORTS) >= 10_000:
            _PORTS.clear()
        found = _PORTS[key] = ServicePort(number, protocol, name)
    return found


def _endpoints(index: AmbientIndex, svc: wl.Service) -> dict[int, tuple[Endpoint, ...]]:
    key = f"{svc.namespace}/{svc.hostname}"
    # each healthy member once: (ip, uid, hbone, its target port per service port)
    members: list[tuple[str, str, bool, dict[int, int]]] = []
    for name in sorted(index.lookup(key)):
        if name == key:  # the service itself (lookup lists it first)
            continue
        address = index.address(name)
        if address is None or address.WhichOneof("type") != "workload":
            continue
        w = address.workload
        if w.status != wl.HEALTHY or not w.addresses:
            continue
        ip = _ip(w.addresses[0])
        if ip is None:
            continue
        targets: dict[int, int] = {}
        if key in w.services:
            for p in w.services[key].ports:
                targets.setdefault(p.service_port, p.target_port)
        members.append((ip, w.uid, w.tunnel_protocol == wl.HBONE, targets))
    out: dict[int, tuple[Endpoint, ...]] = {}
    for sp in svc.ports:
        number = sp.service_port
        default = sp.target_port or number
        out[number] = tuple(Endpoint(ip, targets.get(number) or default, uid, hbone)
                            for ip, uid, hbone, targets in members)
    return out


def _targets(policy: dict) -> list[dict]:
    s = spec(policy)
    refs = s.get("targetRefs")
    out = [r for r in refs if isinstance(r, dict)] if isinstance(refs, list) else []
    if isinstance(s.get("targetRef"), dict):
        out.append(s["targetRef"])
    return out


def targeted_policies(store: ObjectStore, model: WaypointModel, root_namespace: str,
                      by_object: dict[tuple[str, str, str], BoundService] | None = None
                      ) -> list[TargetedPolicy]:
    """The AuthorizationPolicies aimed at this waypoint, as upstream binds them:
    ``targetRefs`` (or ``targetRef``) to the Gateway (same namespace), to the
    ``istio-waypoint`` GatewayClass (policy in the root namespace), to a bound Service
    (group ``""``/``core``) or ServiceEntry (group ``networking.istio.io``) in the
    policy's namespace. Unknown kinds are a problem (named) and bind nothing."""
    if by_object is None:
        by_object = {(s.kind, s.namespace, s.name): s for s in model.services}
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


def _service(store: ObjectStore, index: AmbientIndex, key: str,
             address: wl.Address | None = None) -> BoundService | None:
    """The bound service of index name ``key`` (``address``: its Address when the caller
    already parsed it), or None when that is no service."""
    if address is None:
        address = index.address(key)
    if address is None or address.WhichOneof("type") != "service":
        return None
    svc = address.service
    src_kind, obj = _source_object(store, svc)
    vips = tuple(ip for ip in (_ip(a.address) for a in svc.addresses) if ip)
    return BoundService(svc.namespace, svc.name, svc.hostname, src_kind, vips,
                        _ports(src_kind, obj, svc), _endpoints(index, svc))


def _route_backends(store: ObjectStore, index: AmbientIndex, model: WaypointModel,
                    bound: dict[str, BoundService] | None = None) -> None:
    if bound is None:
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


def accepted_gateway(store: ObjectStore, namespace: str, name: str,
                     problems: list[str]) -> dict | None:
    """Gateway ``namespace/name`` when it exists and its ``spec`` is one the Gateway API
    CRD accepts (:func:`ambient.waypoint.gwvalues.gateway_errors`); else None and one
    problem: a Gateway the API server would refuse is served as a missing one (the fixed
    listeners and clusters only, nothing routed), and its status says why."""
    gw = store.get("Gateway", namespace, name)
    if gw is None:
        problems.append(f"Gateway {namespace}/{name} does not exist: serving an empty "
                        f"waypoint configuration")
        return None
    errors = gwvalues.gateway_errors(gw)
    if errors:
        problems.append(f"Gateway {namespace}/{name} is not accepted ({gwvalues.message(errors)})"
                        f": serving an empty waypoint configuration")
        return None
    problems.extend(f"Gateway {namespace}/{name}: {text}"
                    for text in gwvalues.gateway_ignored(gw))
    return gw


def _annotations(gw: dict) -> dict[str, str]:
    found = meta(gw).get("annotations")
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}


def build_model(store: ObjectStore, index: AmbientIndex, namespace: str, name: str, *,
                trust_domain: str = "cluster.local",
                root_namespace: str = "istio-system",
                domain: str = "cluster.local") -> WaypointModel:
    """The :class:`WaypointModel` of Gateway ``namespace/name`` (never raises for bad
    objects: they become ``problems``)."""
    model = WaypointModel(namespace, name, trust_domain, domain=domain)
    gw = accepted_gateway(store, namespace, name, model.problems)
    if gw is None:
        return model
    model.found = True
    model.annotations = _annotations(gw)
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


class ModelState:
    """One Gateway's :class:`WaypointModel` kept across changes, so a change costs what it
    touches: :meth:`mark` records changed index names (service keys ``ns/hostname`` and
    workload names), :meth:`mark_policies` / :meth:`mark_routes` the store kinds the index
    does not announce, :meth:`mark_all` everything (the Gateway itself changed, or the
    source of a change is unknown). :meth:`refresh` re-reads only what was marked and
    returns ``(model, changed)``: ``changed`` the service keys whose :class:`BoundService`,
    scoped policies or attached routes differ from the last model, or None when all may
    (the first build, :meth:`mark_all`). The model is the same one :func:`build_model`
    returns for the same store and index."""

    def __init__(self, store: ObjectStore, index: AmbientIndex, namespace: str, name: str, *,
                 trust_domain: str = "cluster.local", root_namespace: str = "istio-system",
                 domain: str = "cluster.local"):
        self.store, self.index = store, index
        self.namespace, self.name = namespace, name
        self.trust_domain, self.root_namespace, self.domain = trust_domain, root_namespace, domain
        self._full = True
        self._dirty: set[str] = set()
        self._policies_dirty = self._routes_dirty = True
        self._services: dict[str, BoundService] = {}
        self._workloads: dict[str, tuple[str, ...]] = {}  # bound workload name -> its IPs
        self._members: dict[str, set[str]] = {}  # workload name -> bound service keys
        self._sorted: list[BoundService] | None = None
        self._keys: list[str] = []
        self._by_object: dict[tuple[str, str, str], BoundService] = {}
        self._svc_names: dict[tuple[str, str], str] = {}
        self._backend_names: set[str] = set()
        self._model: WaypointModel | None = None

    def mark(self, names: Iterable[str]) -> None:
        self._dirty.update(names)

    def mark_policies(self) -> None:
        self._policies_dirty = True

    def mark_routes(self) -> None:
        self._routes_dirty = True

    def mark_all(self) -> None:
        self._full = True

    @property
    def pending(self) -> bool:
        return (self._full or bool(self._dirty) or self._policies_dirty or self._routes_dirty
                or self._model is None)

    def _set_service(self, key: str, svc: BoundService | None) -> None:
        old = self._services.get(key)
        if old is not None:
            for eps in old.endpoints.values():
                for ep in eps:
                    keys = self._members.get(ep.uid)
                    if keys is not None:
                        keys.discard(key)
                        if not keys:
                            del self._members[ep.uid]
        if svc is None:
            self._services.pop(key, None)
        else:
            self._services[key] = svc
            for eps in svc.endpoints.values():
                for ep in eps:
                    self._members.setdefault(ep.uid, set()).add(key)
        if (old is None) != (svc is None):
            self._sorted = None

    def refresh(self) -> tuple[WaypointModel, set[str] | None]:
        if not self.pending and self._model is not None:
            return self._model, set()
        old = self._model
        model = WaypointModel(self.namespace, self.name, self.trust_domain, domain=self.domain)
        problems: list[str] = []
        gw = accepted_gateway(self.store, self.namespace, self.name, problems)
        changed: set[str] | None = set()
        dirty_names: Iterable[str] = self._dirty
        if gw is None or self._full or old is None or not old.found:
            changed, dirty_names = None, ()
            self._services.clear()
            self._workloads.clear()
            self._members.clear()
            self._sorted = None
        self._full, self._dirty = False, set()
        if gw is None:
            model.problems.extend(problems)
            self._model = model
            return model, None
        model.found = True
        model.annotations = _annotations(gw)
        bound = self.index.waypoint_resources(self.namespace, self.name)
        # service keys to re-read -> their Address when _refresh_name already parsed it
        todo: dict[str, wl.Address | None] = {}
        backends_touched = False
        for res in (bound if changed is None else dirty_names):
            self._refresh_name(res, bound, todo)
            if old is not None and res in self._backend_names:
                backends_touched = True
        for key, address in todo.items():
            self._set_service(key, _service(self.store, self.index, key, address)
                              if key in bound else None)
        membership = self._sorted is None
        if self._sorted is None:
            self._keys = sorted(self._services)
            self._sorted = [self._services[k] for k in self._keys]
            self._by_object = {(s.kind, s.namespace, s.name): s for s in self._sorted}
            self._svc_names = {(s.namespace, s.name): s.key for s in self._sorted
                               if s.kind == "Service"}
        elif todo:  # the same services, some of them changed: copy on write
            self._sorted = list(self._sorted)
            for key in todo:
                if key in self._services:
                    self._sorted[bisect.bisect_left(self._keys, key)] = self._services[key]
        model.services = self._sorted
        model.workload_ips = [ip for k in sorted(self._workloads) for ip in self._workloads[k]]
        if changed is not None:
            changed.update(todo)
        if (old is None or changed is None or self._policies_dirty or self._routes_dirty
                or membership or backends_touched):
            model.policies = targeted_policies(self.store, model, self.root_namespace,
                                               self._by_object)
            model.routes = attached_routes(self.store, self._svc_names, model.problems)
            _route_backends(self.store, self.index, model, self._services)
            if changed is not None and old is not None:
                changed |= _scopes_changed(old.policies, model.policies)
                for key in set(old.routes) | set(model.routes):
                    if [a.route for a in old.routes.get(key, [])] != \
                            [a.route for a in model.routes.get(key, [])]:
                        changed.add(key)
                if old.backends != model.backends:
                    changed |= set(model.routes) | set(old.routes)
            self._backend_names = set(model.backends) | {
                ep.uid for b in model.backends.values() for eps in b.endpoints.values()
                for ep in eps}
        else:
            model.policies, model.routes = old.policies, old.routes
            model.backends, model.problems = old.backends, list(old.problems)
            model.backend_ports = old.backend_ports
        self._policies_dirty = self._routes_dirty = False
        self._model = model
        return model, changed

    def _refresh_name(self, res: str, bound: set[str],
                      todo_services: dict[str, wl.Address | None]) -> None:
        """Re-read one index name: a bound (or formerly bound) service goes to
        ``todo_services``; a workload updates the bound workload IPs and marks the
        services it is (or was) a member of."""
        if res in self._services:
            todo_services.setdefault(res, None)
        for key in self._members.get(res, ()):
            todo_services.setdefault(key, None)
        address = self.index.address(res)
        if address is None:
            self._workloads.pop(res, None)
            return
        kind = address.WhichOneof("type")
        if kind == "service":
            if res in bound:
                todo_services[res] = address
        elif kind == "workload":
            if res in bound:
                self._workloads[res] = tuple(
                    ip for ip in (_ip(a) for a in address.workload.addresses) if ip)
            else:
                self._workloads.pop(res, None)
            for key in address.workload.services:
                if key in self._services:
                    todo_services.setdefault(key, None)


def _scopes_changed(old: list[TargetedPolicy], new: list[TargetedPolicy]) -> set[str]:
    """Service keys whose scoped policies differ (a waypoint-wide change is the
    resources' business: it changes every chain)."""
    def by_scope(items: list[TargetedPolicy]) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for p in items:
            if p.scope is not None:
                out.setdefault(p.scope, []).append(p.policy)
        return out
    a, b = by_scope(old), by_scope(new)
    return {k for k in set(a) | set(b) if a.get(k) != b.get(k)}
