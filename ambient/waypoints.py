"""Waypoints (Gateway API Gateways) and how objects bind to them (``docs/ambient.md``),
plus network gateways.

A Gateway is a waypoint once it has a ``status.addresses`` entry (its deployment is ready);
the class is not checked, as in Istio. Binding order for an object: instance of a waypoint
-> no waypoint; its own ``istio.io/use-waypoint`` label (``none`` opts out); else its
namespace's label; then the traffic-type filter and the allowed-namespaces check.
"""

from __future__ import annotations

import dataclasses
import ipaddress

from ambient import workload_pb2 as wl
from ambient.objects import annotations_of, labels, meta, selector_matches, spec, status

USE_WAYPOINT = "istio.io/use-waypoint"
USE_WAYPOINT_NS = "istio.io/use-waypoint-namespace"
USE_WAYPOINT_CANARY = "istio.io/use-waypoint-canary"
USE_WAYPOINT_CANARY_NS = "istio.io/use-waypoint-canary-namespace"
CANARY_WEIGHT = "istio.io/use-waypoint-canary-weight"
WAYPOINT_FOR = "istio.io/waypoint-for"
GATEWAY_NAME = "gateway.networking.k8s.io/gateway-name"
INBOUND_BINDING = "ambient.istio.io/waypoint-inbound-binding"
MANAGED = "gateway.istio.io/managed"
MANAGED_NO_WAYPOINT = ("istio.io-mesh-controller", "istio.io-eastwest-controller")
NETWORK_LABEL = "topology.istio.io/network"
HBONE_PORT = 15008
PROXY_LISTENER_PROTOCOL = "istio.io/PROXY"  # Istio's WaypointSandwichListenerProxyProtocol


@dataclasses.dataclass(frozen=True)
class Waypoint:
    """A ready waypoint. ``address`` is the serialized GatewayAddress (hashable, comparable)."""

    namespace: str
    name: str
    address: bytes
    traffic_type: str                       # service | workload | all | none
    allowed_from: str                       # All | Same | Selector
    allowed_selector: tuple[tuple[str, str], ...] = ()
    inbound_protocol: str | None = None     # NONE | PROXY (instances' application_tunnel)
    inbound_port: int = 0

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def gateway_address(self) -> wl.GatewayAddress:
        return wl.GatewayAddress.FromString(self.address)

    def allows(self, namespace: str, namespace_obj: dict | None) -> bool:
        if self.allowed_from == "All":
            return True
        if self.allowed_from == "Selector":
            return selector_matches(dict(self.allowed_selector),
                                    labels(namespace_obj) if namespace_obj else {})
        return namespace == self.namespace

    def accepts(self, what: str) -> bool:
        """``what`` is ``service`` or ``workload``."""
        return self.traffic_type in (what, "all")


def _allowed(gw: dict, protocol: str | None, port: int
             ) -> tuple[str, tuple[tuple[str, str], ...]]:
    """``allowedRoutes.namespaces`` (mode, selector) of the listener the inbound binding
    names, else of the HBONE/15008 listener; ``Same`` when neither exists.

    The bound listener, as Istio's ``findBoundListener``: the one on the binding's port,
    else for ``PROXY`` the one with protocol ``istio.io/PROXY``.
    """
    listeners = [li for li in (spec(gw).get("listeners") or []) if isinstance(li, dict)]
    chosen = None
    if protocol and port:
        chosen = next((li for li in listeners if li.get("port") == port), None)
    elif protocol == "PROXY":
        chosen = next((li for li in listeners
                       if li.get("protocol") == PROXY_LISTENER_PROTOCOL), None)
    if chosen is None:
        chosen = next((li for li in listeners if li.get("protocol") == "HBONE"
                       and li.get("port") == HBONE_PORT), None)
    namespaces = ((chosen or {}).get("allowedRoutes") or {}).get("namespaces") or {}
    mode = namespaces.get("from") or "Same"
    selector = ((namespaces.get("selector") or {}).get("matchLabels") or {})
    return mode, tuple(sorted((str(k), str(v)) for k, v in selector.items()))


def waypoint_from_gateway(gw: dict, gateway_class: dict | None, network: str) -> Waypoint | None:
    """Gateway -> Waypoint, or None while it has no usable ``status.addresses`` entry."""
    addrs = [a for a in (status(gw).get("addresses") or []) if isinstance(a, dict)]
    ns, name = meta(gw)["namespace"], meta(gw)["name"]
    address = None
    hostname = next((a.get("value") for a in addrs if a.get("type") == "Hostname"
                     and a.get("value")), None)
    if hostname:
        address = wl.GatewayAddress(hostname=wl.NamespacedHostname(namespace=ns,
                                                                   hostname=hostname),
                                    hbone_mtls_port=HBONE_PORT)
    else:
        for a in addrs:
            if a.get("type", "IPAddress") == "IPAddress":
                try:
                    ip = ipaddress.ip_address(str(a.get("value"))).packed
                except ValueError:
                    continue
                address = wl.GatewayAddress(address=wl.NetworkAddress(network=network,
                                                                      address=ip),
                                            hbone_mtls_port=HBONE_PORT)
                break
    if address is None:
        return None
    class_labels = labels(gateway_class) if gateway_class else {}
    class_ann = annotations_of(gateway_class) if gateway_class else {}
    traffic = labels(gw).get(WAYPOINT_FOR) or class_labels.get(WAYPOINT_FOR) or "service"
    binding = annotations_of(gw).get(INBOUND_BINDING) or class_ann.get(INBOUND_BINDING)
    protocol, port = None, 0
    if binding:
        head, _, tail = binding.partition("/")
        if head in ("NONE", "PROXY"):
            protocol = head
            port = int(tail) if tail.isdigit() else 0
    mode, selector = _allowed(gw, protocol, port)
    return Waypoint(ns, name, address.SerializeToString(deterministic=True), traffic, mode,
                    selector, protocol, port)


def network_gateway(gw: dict, network_label: str = NETWORK_LABEL) -> tuple[str, bytes] | None:
    """An ``istio-remote`` Gateway labelled with a network -> (network, GatewayAddress bytes)
    that every workload of that network gets as ``network_gateway``."""
    network = labels(gw).get(network_label)
    if not network or spec(gw).get("gatewayClassName") != "istio-remote":
        return None
    listener = next((li for li in (spec(gw).get("listeners") or [])
                     if isinstance(li, dict) and li.get("protocol") == "HBONE"), None)
    addrs = [a for a in (status(gw).get("addresses") or []) if isinstance(a, dict)]
    if listener is None or not addrs or not isinstance(listener.get("port"), int):
        return None
    value, kind = str(addrs[0].get("value", "")), addrs[0].get("type", "IPAddress")
    port = listener["port"]
    if kind == "Hostname":
        address = wl.GatewayAddress(hostname=wl.NamespacedHostname(
            namespace=meta(gw)["namespace"], hostname=value), hbone_mtls_port=port)
    else:
        try:
            ip = ipaddress.ip_address(value).packed
        except ValueError:
            return None
        address = wl.GatewayAddress(address=wl.NetworkAddress(network=network, address=ip),
                                    hbone_mtls_port=port)
    return network, address.SerializeToString(deterministic=True)


def use_waypoint_ref(obj_labels: dict[str, str], obj_ns: str,
                     namespace_obj: dict | None) -> tuple[str, str] | None:
    """The ``(namespace, name)`` an object asks for, or None (unset or ``none``)."""
    value = obj_labels.get(USE_WAYPOINT)
    if value is not None:
        if value == "none":
            return None
        return obj_labels.get(USE_WAYPOINT_NS) or obj_ns, value
    ns_labels = labels(namespace_obj) if namespace_obj else {}
    value = ns_labels.get(USE_WAYPOINT)
    if value is None or value == "none":
        return None
    return ns_labels.get(USE_WAYPOINT_NS) or obj_ns, value


def resolve(ref: tuple[str, str] | None, what: str, obj_ns: str, namespace_obj: dict | None,
            waypoints: dict[str, Waypoint]) -> Waypoint | None:
    """A usable waypoint for ``ref``: ready, accepting ``what``, allowing ``obj_ns``."""
    if ref is None:
        return None
    wp = waypoints.get(f"{ref[0]}/{ref[1]}")
    if wp is None or not wp.accepts(what) or not wp.allows(obj_ns, namespace_obj):
        return None
    return wp


def instance_of(obj_labels: dict[str, str], obj_ns: str,
                waypoints: dict[str, Waypoint]) -> Waypoint | None:
    """The waypoint this pod/WorkloadEntry is an instance of, or None."""
    name = obj_labels.get(GATEWAY_NAME)
    return waypoints.get(f"{obj_ns}/{name}") if name else None


def canary(obj_labels: dict[str, str], obj_annotations: dict[str, str], obj_ns: str,
           namespace_obj: dict | None, primary: Waypoint,
           waypoints: dict[str, Waypoint]) -> list[wl.WeightedWaypoint]:
    """``weighted_waypoints`` for a canary split, or [] when any part is unusable."""
    name = obj_labels.get(USE_WAYPOINT_CANARY)
    if not name:
        return []
    weight_text = obj_annotations.get(CANARY_WEIGHT, "0")
    if not weight_text.isdigit() or not 0 <= int(weight_text) <= 100:
        return []
    ref = (obj_labels.get(USE_WAYPOINT_CANARY_NS) or obj_ns, name)
    wp = resolve(ref, "service", obj_ns, namespace_obj, waypoints)
    if wp is None or wp.key == primary.key:
        return []
    weight = int(weight_text)
    return [wl.WeightedWaypoint(destination=primary.gateway_address(), weight=100 - weight),
            wl.WeightedWaypoint(destination=wp.gateway_address(), weight=weight)]
