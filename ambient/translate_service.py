"""Kubernetes Service and Istio ServiceEntry -> ``istio.workload.Service`` (``docs/ambient.md``),
plus the per-workload port mapping (which service ports a workload lists).

The functions here see one object at a time. What depends on other objects — waypoint
binding, ``canonical`` and hostname dedup — is filled in by the index on the
:class:`ServiceInfo` these functions return.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
from typing import Any

from ambient import workload_pb2 as wl
from ambient.objects import (Mesh, TranslateError, annotations_of, field, labels, meta, spec,
                             str_map)

log = logging.getLogger(__name__)

TRAFFIC_DISTRIBUTION = "networking.istio.io/traffic-distribution"
LB = wl.LoadBalancing


@dataclasses.dataclass
class PortInfo:
    """One service port as the membership rules need it (not all of it is sent)."""

    port: int
    target_port: int          # numeric target (0 = named / resolved per workload)
    name: str = ""
    target_name: str = ""     # k8s named targetPort
    se_target_zero: bool = False  # ServiceEntry port without targetPort


@dataclasses.dataclass
class ServiceInfo:
    """A translated service candidate for one hostname.

    ``key`` is ``namespace/hostname`` (the resource name); ``source`` is ``Service`` or
    ``ServiceEntry`` (or ``LocalService``); ``created`` the creationTimestamp string (ISO 8601
    sorts chronologically); ``selector`` selects member pods/WorkloadEntries in ``namespace``
    (None = selector-less).
    """

    key: str
    namespace: str
    name: str
    hostname: str
    source: str
    created: str
    proto: wl.Service
    selector: dict[str, str] | None
    ports: list[PortInfo]
    labels: dict[str, str]
    annotations: dict[str, str]
    visibility_public: bool = True

    @property
    def source_key(self) -> tuple[str, str, str]:
        return self.source, self.namespace, self.name


def app_protocol(name: str, app_proto: str | None) -> wl.AppProtocol:
    """``appProtocol`` else port-name prefix -> AppProtocol."""
    value = (app_proto or "").lower()
    if value:
        if value in ("http", "http1", "http/1.1"):
            return wl.HTTP11
        if value in ("http2", "kubernetes.io/h2c", "h2c"):
            return wl.HTTP2
        if value == "grpc":
            return wl.GRPC
        if value in ("tls", "https"):
            return wl.TLS
        if value == "tcp":
            return wl.TCP
    prefix = name.lower().split("-", 1)[0]
    return {"http": wl.HTTP11, "http2": wl.HTTP2, "grpc": wl.GRPC, "tls": wl.TLS,
            "https": wl.TLS, "tcp": wl.TCP}.get(prefix, wl.UNKNOWN)


def _se_protocol(protocol: str | None) -> wl.AppProtocol:
    return {"HTTP": wl.HTTP11, "HTTP2": wl.HTTP2, "GRPC": wl.GRPC, "TLS": wl.TLS,
            "HTTPS": wl.TLS, "TCP": wl.TCP}.get((protocol or "").upper(), wl.UNKNOWN)


def _port_number(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 65535:
        raise TranslateError(f"field {path!r} must be a port number 1..65535, got {value!r}")
    return value


def traffic_distribution_lb(value: str | None) -> wl.LoadBalancing | None:
    """PreferClose/PreferSameZone/PreferSameNode -> LoadBalancing; unknown -> None."""
    if value in ("PreferClose", "PreferSameZone"):
        return LB(routing_preference=[LB.NETWORK, LB.REGION, LB.ZONE], mode=LB.FAILOVER)
    if value == "PreferSameNode":
        return LB(routing_preference=[LB.NETWORK, LB.REGION, LB.ZONE, LB.SUBZONE, LB.NODE],
                  mode=LB.FAILOVER)
    return None


def _network_address(text: str, network: str, path: str) -> wl.NetworkAddress:
    try:
        net = ipaddress.ip_network(text.strip(), strict=False)
    except ValueError:
        raise TranslateError(f"field {path!r} is not an IP address or CIDR: {text!r}") from None
    if "/" in text and net.prefixlen != net.max_prefixlen:
        return wl.NetworkAddress(network=network, address=net.network_address.packed,
                                 length=net.prefixlen)
    return wl.NetworkAddress(network=network, address=net.network_address.packed)


def ip_families(svc: dict, addresses: list[wl.NetworkAddress]) -> wl.IPFamilies:
    """``Service.ip_families`` (an ``IPFamilies`` value) for one Kubernetes Service.

    ``spec.ipFamilies`` decides, as in istiod's ``constructService``
    (pilot/pkg/serviceregistry/ambient/services.go): two entries -> DUAL, one -> IPV4_ONLY or
    IPV6_ONLY. That holds for headless Services too (``clusterIP: None``), which have no
    address to look at. When the field is absent — raw YAML in the files source; the API
    server always stores it — it is filled as the API server would from the allocated
    ``clusterIPs`` (one family per address); absent with no address (headless) stays
    AUTOMATIC, as istiod sends for an empty list.

    Raises TranslateError for an entry other than ``IPv4``/``IPv6`` or a repeated family
    (the API server rejects both).
    """
    raw = field(svc, "spec.ipFamilies", list)
    if raw:
        seen: list[str] = []
        for i, family in enumerate(raw):
            if family not in ("IPv4", "IPv6"):
                raise TranslateError(f"field 'spec.ipFamilies[{i}]' must be IPv4 or IPv6, "
                                     f"got {family!r}")
            if family in seen:
                raise TranslateError(f"field 'spec.ipFamilies[{i}]' repeats {family!r}")
            seen.append(family)
        if len(seen) == 2:
            return wl.DUAL
        return wl.IPV4_ONLY if seen[0] == "IPv4" else wl.IPV6_ONLY
    sizes = {len(a.address) for a in addresses}
    if len(sizes) == 2:
        return wl.DUAL
    if sizes:
        return wl.IPV4_ONLY if sizes.pop() == 4 else wl.IPV6_ONLY
    return wl.AUTOMATIC


def k8s_service(svc: dict, mesh: Mesh, namespace_obj: dict | None) -> ServiceInfo | None:
    """One Kubernetes Service -> ServiceInfo; None for ``type: ExternalName``.

    Raises TranslateError naming the first malformed field.
    """
    m, s = meta(svc), spec(svc)
    if s.get("type") == "ExternalName":
        return None
    ns, name = m["namespace"], m["name"]
    host = f"{name}.{ns}.svc.{mesh.domain_suffix}"
    proto = wl.Service(name=name, namespace=ns, hostname=host)
    ips = field(svc, "spec.clusterIPs", list)
    # each address is reported under the field it came from
    named = ([(ip, f"spec.clusterIPs[{i}]") for i, ip in enumerate(ips)] if ips
             else [(field(svc, "spec.clusterIP", str), "spec.clusterIP")]
             if s.get("clusterIP") else [])
    for ip, where in named:
        if not ip or ip == "None":
            continue
        proto.addresses.append(_network_address(str(ip), mesh.network, where))
    proto.ip_families = ip_families(svc, proto.addresses)
    ports: list[PortInfo] = []
    for i, p in enumerate(field(svc, "spec.ports", list, [])):
        if not isinstance(p, dict):
            raise TranslateError(f"field 'spec.ports[{i}]' must be a mapping, got {p!r}")
        # every port is sent, UDP and SCTP too, as istiod's constructService does
        port = _port_number(p.get("port"), f"spec.ports[{i}].port")
        pname = p.get("name") or ""
        target = p.get("targetPort", port)  # the API server defaults targetPort to port
        if isinstance(target, str) and not target.isdigit():
            info = PortInfo(port, 0, pname, target_name=target)
        else:
            info = PortInfo(port, _port_number(int(target), f"spec.ports[{i}].targetPort"), pname)
        ports.append(info)
        proto.ports.append(wl.Port(service_port=port, target_port=info.target_port,
                                   app_protocol=app_protocol(pname, p.get("appProtocol"))))
    lb = None
    if s.get("internalTrafficPolicy") == "Local":
        lb = LB(routing_preference=[LB.NODE], mode=LB.STRICT)
    else:
        td = (s.get("trafficDistribution") or annotations_of(svc).get(TRAFFIC_DISTRIBUTION)
              or (annotations_of(namespace_obj).get(TRAFFIC_DISTRIBUTION) if namespace_obj else None))
        lb = traffic_distribution_lb(td)
    if s.get("publishNotReadyAddresses") is True:
        lb = lb or LB()
        lb.health_policy = LB.ALLOW_ALL
    if lb is not None:
        proto.load_balancing.CopyFrom(lb)
    proto.canonical = True
    selector = str_map(s.get("selector"), "spec.selector") or None
    return ServiceInfo(f"{ns}/{host}", ns, name, host, "Service",
                       m.get("creationTimestamp") or "", proto, selector, ports,
                       dict(labels(svc)), dict(annotations_of(svc)))


def service_entry_services(se: dict, mesh: Mesh, namespace_obj: dict | None) -> list[ServiceInfo]:
    """One ServiceEntry -> one ServiceInfo per ``spec.hosts`` entry."""
    m = meta(se)
    ns, name = m["namespace"], m["name"]
    hosts = field(se, "spec.hosts", list, [])
    if not hosts or not all(isinstance(h, str) and h for h in hosts):
        raise TranslateError(f"field 'spec.hosts' must be a non-empty list of hostnames, "
                             f"got {hosts!r}")
    addresses = [_network_address(str(a), mesh.network, f"spec.addresses[{i}]")
                 for i, a in enumerate(field(se, "spec.addresses", list, []))]
    ports: list[PortInfo] = []
    proto_ports: list[wl.Port] = []
    for i, p in enumerate(field(se, "spec.ports", list, [])):
        if not isinstance(p, dict):
            raise TranslateError(f"field 'spec.ports[{i}]' must be a mapping, got {p!r}")
        number = _port_number(p.get("number"), f"spec.ports[{i}].number")
        target = p.get("targetPort") or 0
        if target:
            target = _port_number(target, f"spec.ports[{i}].targetPort")
        ports.append(PortInfo(number, target or number, p.get("name") or "",
                              se_target_zero=not target))
        proto_ports.append(wl.Port(service_port=number, target_port=target or number,
                                   app_protocol=_se_protocol(p.get("protocol"))))
    s = spec(se)
    lb: wl.LoadBalancing | None
    if s.get("resolution") == "NONE":
        lb = LB(mode=LB.PASSTHROUGH, health_policy=LB.ALLOW_ALL)
    else:
        lb = traffic_distribution_lb(
            annotations_of(se).get(TRAFFIC_DISTRIBUTION)
            or (annotations_of(namespace_obj).get(TRAFFIC_DISTRIBUTION) if namespace_obj else None))
    selector = str_map(field(se, "spec.workloadSelector.labels", dict), "spec.workloadSelector")
    sans = [str(x) for x in field(se, "spec.subjectAltNames", list, [])]
    public = (s.get("exportTo") or ["*"]) != ["."]
    auto = auto_allocated(se, mesh.network) if should_auto_allocate(se) else {}
    out = []
    for host in hosts:
        host_addresses = addresses
        if (not host_addresses and s.get("resolution") != "NONE"
                and (not host.startswith("*") or s.get("resolution") == "DYNAMIC_DNS")):
            host_addresses = auto.get(host, [])
        proto = wl.Service(name=name, namespace=ns, hostname=host, addresses=host_addresses,
                           ports=proto_ports, subject_alt_names=sans)
        if lb is not None:
            proto.load_balancing.CopyFrom(lb)
        if not public:
            proto.visibility = wl.Service.NAMESPACE
        out.append(ServiceInfo(f"{ns}/{host}", ns, name, host, "ServiceEntry",
                               m.get("creationTimestamp") or "", proto, selector or None, ports,
                               dict(labels(se)), dict(annotations_of(se)), public))
    return out


AUTOALLOCATE_LABEL = "networking.istio.io/enable-autoallocate-ip"


def should_auto_allocate(se: dict) -> bool:
    """Whether a ServiceEntry takes the addresses allocated to it, as istiod's
    ``ShouldV2AutoAllocateIP``: not ``resolution: NONE``, no ``spec.addresses`` of its
    own, and not opted out with the label ``networking.istio.io/enable-autoallocate-ip:
    "false"`` (any case). (istiod's switch ``PILOT_ENABLE_IP_AUTOALLOCATE`` is on by
    default; the agent has no such switch and reads whatever allocation was written.)"""
    s = spec(se)
    if s.get("resolution") == "NONE" or s.get("addresses"):
        return False
    return str(labels(se).get(AUTOALLOCATE_LABEL, "")).lower() != "false"


def auto_allocated(se: dict, network: str) -> dict[str, list[wl.NetworkAddress]]:
    """Hostname -> the addresses allocated to it, read from the ServiceEntry's
    ``status.addresses`` (entries ``{value: IP, host: hostname}``; istiod's IP allocator
    writes them from 240.240.0.0/16 and 2001:2::/48 by default). An entry whose value is
    not an IP is skipped, as istiod does, and named in a warning."""
    raw = (se.get("status") or {}).get("addresses") or []
    out: dict[str, list[wl.NetworkAddress]] = {}
    if not isinstance(raw, list):
        log.warning("ServiceEntry %s/%s: field 'status.addresses' must be a list, got %r; "
                    "no allocated address used", meta(se).get("namespace"),
                    meta(se).get("name"), raw)
        return out
    for i, entry in enumerate(raw):
        value = entry.get("value") if isinstance(entry, dict) else None
        try:
            ip = ipaddress.ip_address(str(value))
        except ValueError:
            log.warning("ServiceEntry %s/%s: field 'status.addresses[%d].value' is not an IP "
                        "address: %r; skipped", meta(se).get("namespace"),
                        meta(se).get("name"), i, value)
            continue
        host = str(entry.get("host") or "")
        out.setdefault(host, []).append(wl.NetworkAddress(network=network, address=ip.packed))
    return out


def workload_ports(info: ServiceInfo, named_ports: dict[str, int],
                   override_by_name: bool = False) -> wl.PortList:
    """The PortList a workload lists for one service.

    ``named_ports`` maps the workload's port names to numbers (TCP container ports, or a
    WorkloadEntry's ``spec.ports``, or a ServiceEntry endpoint's ``ports``). A Service port
    with a named targetPort the workload doesn't have is dropped. ``override_by_name``
    (WorkloadEntry, ServiceEntry endpoints): a workload port named like the service port wins
    over the numeric target; for pods only a ServiceEntry port without targetPort is
    resolved by name.
    """
    out = wl.PortList()
    for p in info.ports:
        if p.target_name:
            if p.target_name not in named_ports:
                continue
            target = named_ports[p.target_name]
        elif p.name and p.name in named_ports and (p.se_target_zero or override_by_name):
            target = named_ports[p.name]
        elif p.se_target_zero:
            target = p.port
        else:
            target = p.target_port
        out.ports.append(wl.Port(service_port=p.port, target_port=target))
    return out
