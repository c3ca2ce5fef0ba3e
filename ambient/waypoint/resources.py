"""A waypoint's Envoy resources (LDS, CDS, EDS, RDS) from its :class:`~.model.WaypointModel`,
laid out as istiod lays out a waypoint's (``buildWaypointInbound``, ``buildWaypointInboundClusters``),
so config dumps read the same:

Listeners
  ``connect_terminate``: HBONE on ``<bind>:15008``: TLS 1.3 with the waypoint's own certificate
  (SDS ``default``, validated against ``ROOTCA``, client certificate required, URI SAN in the
  trust domain), ALPN ``h2``; an HTTP connection manager accepting ``CONNECT``
  (``allow_connect``) whose only route sends the tunnel to the ``main_internal`` cluster; the
  ``connect_authority`` filter stores the CONNECT ``:authority`` (the destination
  ``VIP:port``), the client address and the peer's URI SAN in the filter state, shared with
  the internal connection.
  ``main_internal``: an internal listener (``original_dst`` takes the destination from that
  filter state); a ``filter_chain_matcher`` on destination IP (each bound service's VIPs)
  then port picks one chain per service port, named as the cluster it feeds:
  ``inbound-vip|<port>|http|<host>`` (HTTP connection manager with the RBAC filters of
  the policies aimed at the service or the whole waypoint, then the router; routes by RDS)
  or ``inbound-vip|<port>|tcp|<host>`` (RBAC network filters, TCP proxy); ports whose
  protocol is not declared get both, chosen by the HTTP inspector; workload addresses
  bound to the waypoint go to ``direct-http`` / ``direct-tcp``.
  ``connect_originate``: an internal listener whose TCP proxy tunnels to the endpoint
  (``%DOWNSTREAM_LOCAL_ADDRESS%`` as the CONNECT authority) through the ``connect_originate``
  cluster.

Clusters
  ``main_internal``, ``encap``: static, to the internal listeners of those names.
  ``inbound-vip|<port>|<http|tcp>|<host>``: EDS (over ADS); each endpoint is the internal
  address of ``connect_originate`` carrying ``envoy.filters.listener.original_dst``
  metadata ``{"local": "<podIP>:<targetPort>"}`` passed through to that listener.
  ``connect_originate``: ORIGINAL_DST to port 15008 of the destination, HTTP/2 with
  ``allow_connect``, TLS 1.3 with the waypoint's certificate; the peer's URI SAN must start
  with ``spiffe://<trust domain>/ns/<waypoint namespace>/sa/`` (istiod's check).

Deliberate differences (``docs/waypoint.md``): HTTP chains take their routes by RDS (one
``RouteConfiguration`` per chain, named as the chain) where istiod inlines them, so a
route change is one small push; the filter state uses Envoy's ``envoy.string`` factory
(stock Envoy, as istiod does for proxies before 1.29.2) instead of Istio's own; the
``istio.*`` telemetry filters (peer metadata, stats) are not configured.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import threading
from typing import Any, Iterable

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.http.header_mutation.v3 import header_mutation_pb2  # noqa: F401
from envoy.extensions.filters.http.rbac.v3 import rbac_pb2  # noqa: F401
from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401
from envoy.extensions.filters.http.set_filter_state.v3 import set_filter_state_pb2  # noqa: F401
from envoy.extensions.filters.listener.http_inspector.v3 import http_inspector_pb2  # noqa: F401
from envoy.extensions.filters.listener.original_dst.v3 import original_dst_pb2  # noqa: F401
from envoy.extensions.filters.network.http_connection_manager.v3 import (  # noqa: F401
    http_connection_manager_pb2)
from envoy.extensions.filters.network.rbac.v3 import rbac_pb2 as net_rbac_pb2  # noqa: F401
from envoy.extensions.filters.network.set_filter_state.v3 import (  # noqa: F401
    set_filter_state_pb2 as net_sfs_pb2)
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2  # noqa: F401
from envoy.extensions.matching.common_inputs.network.v3 import network_inputs_pb2  # noqa: F401
from envoy.extensions.transport_sockets.internal_upstream.v3 import (  # noqa: F401
    internal_upstream_pb2)
from envoy.extensions.transport_sockets.raw_buffer.v3 import raw_buffer_pb2  # noqa: F401
from envoy.extensions.transport_sockets.tls.v3 import secret_pb2, tls_pb2  # noqa: F401
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2  # noqa: F401
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2  # noqa: F401
from google.protobuf import json_format, wrappers_pb2  # noqa: F401
from google.protobuf.message import Message
from xds.type.matcher.v3 import ip_pb2, matcher_pb2  # noqa: F401

from ambient.waypoint.httproute import DEFAULT_RETRY, RouteBuilder
from ambient.waypoint.model import BoundService, ServicePort, WaypointModel
from ambient.waypoint.rbac import rbac_filters

LISTENER_TYPE = "type.googleapis.com/envoy.config.listener.v3.Listener"
CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
ROUTE_TYPE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
SECRET_TYPE = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
ENVOY_TYPES = (CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE, SECRET_TYPE)

CONNECT_TERMINATE = "connect_terminate"
MAIN_INTERNAL = "main_internal"
CONNECT_ORIGINATE = "connect_originate"
ENCAP = "encap"
HBONE_PORT = 15008
ORIGINAL_DST_KEY = "envoy.filters.listener.original_dst"
LOCAL_IP_STATE = "envoy.filters.listener.original_dst.local_ip"
XFCC_ANNOTATION = "ambient.istio.io/xfcc-include-client-identity"
CERT_SECRET, ROOT_SECRET = "default", "ROOTCA"

_T = "type.googleapis.com/"
_MAX = 4294967295


@dataclasses.dataclass
class Options:
    """Per-proxy choices: ``bind`` the address ``connect_terminate`` listens on (istiod:
    the wildcard), ``xfcc`` whether the HTTP chains add ``x-forwarded-client-cert`` with
    the caller's identity (the ``ambient.istio.io/xfcc-include-client-identity`` annotation)."""

    bind: str = "0.0.0.0"
    xfcc: bool = False


def cluster_name(subset: str, port: int, hostname: str) -> str:
    """istiod's ``BuildSubsetKey(inbound-vip, subset, host, port)``."""
    return f"inbound-vip|{port}|{subset}|{hostname}"


def _any(type_name: str, **fields: Any) -> dict:
    return {"@type": _T + type_name, **fields}


def _sds(name: str) -> dict:
    return {"name": name, "sds_config": {"ads": {}, "resource_api_version": "V3"}}


def _tls_common(trust_domain: str, san_prefixes: list[str]) -> dict:
    return {
        "tls_params": {"tls_minimum_protocol_version": "TLSv1_3",
                       "tls_maximum_protocol_version": "TLSv1_3"},
        "alpn_protocols": ["h2"],
        "tls_certificate_sds_secret_configs": [_sds(CERT_SECRET)],
        "combined_validation_context": {
            "default_validation_context": {"match_typed_subject_alt_names": [
                {"san_type": "URI", "matcher": {"prefix": p}} for p in san_prefixes]},
            "validation_context_sds_secret_config": _sds(ROOT_SECRET)},
    }


def _fs_value(key: str, fmt: str, factory: str = "") -> dict:
    out: dict[str, Any] = {"object_key": key, "format_string": {"text_format_source": {
        "inline_string": fmt}}, "shared_with_upstream": "ONCE"}
    if factory:
        out["factory_key"] = factory
    return out


def _router() -> dict:
    return {"name": "envoy.filters.http.router",
            "typed_config": _any("envoy.extensions.filters.http.router.v3.Router")}


def _internal_upstream(passthrough: bool) -> dict:
    inner = {"name": "raw_buffer",
             "typed_config": _any("envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer")}
    cfg: dict[str, Any] = {"transport_socket": inner}
    if passthrough:
        cfg["passthrough_metadata"] = [
            {"kind": {"host": {}}, "name": ORIGINAL_DST_KEY},
            {"kind": {"host": {}}, "name": "istio"}]
    return {"name": "internal_upstream", "typed_config": _any(
        "envoy.extensions.transport_sockets.internal_upstream.v3.InternalUpstreamTransport",
        **cfg)}


def _circuit_breakers() -> dict:
    return {"thresholds": [{"max_connections": _MAX, "max_pending_requests": _MAX,
                            "max_requests": _MAX, "max_retries": _MAX,
                            "track_remaining": True}]}


def _internal_endpoints(listener: str) -> list[dict]:
    return [{"lb_endpoints": [{"endpoint": {"address": {"envoy_internal_address": {
        "server_listener_name": listener}}}}]}]


# ---------------------------------------------------------------- listeners

def connect_terminate(model: WaypointModel, opts: Options) -> dict:
    routes = [{"match": {"connect_matcher": {}}, "route": {
        "cluster": MAIN_INTERNAL,
        "upgrade_configs": [{"upgrade_type": "CONNECT", "connect_config": {}}]}}]
    connect_authority = {"name": "connect_authority", "typed_config": _any(
        "envoy.extensions.filters.http.set_filter_state.v3.Config", on_request_headers=[
            _fs_value(LOCAL_IP_STATE, "%REQ(:AUTHORITY)%"),
            _fs_value("io.istio.connect_authority", "%REQ(:AUTHORITY)%", "envoy.string"),
            _fs_value("envoy.filters.listener.original_dst.remote_ip",
                      "%DOWNSTREAM_REMOTE_ADDRESS%"),
            _fs_value("io.istio.peer_principal", "%DOWNSTREAM_PEER_URI_SAN%", "envoy.string"),
            _fs_value("io.istio.local_principal", "%DOWNSTREAM_LOCAL_URI_SAN%", "envoy.string"),
        ])}
    hcm = _any(
        "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        stat_prefix=CONNECT_TERMINATE,
        route_config={"name": "default", "virtual_hosts": [
            {"name": "default", "domains": ["*"], "routes": routes}]},
        set_current_client_cert_details={"subject": True, "uri": True, "dns": True},
        forward_client_cert_details="APPEND_FORWARD",
        use_remote_address=False,
        stream_idle_timeout="0s",
        upgrade_configs=[{"upgrade_type": "CONNECT"}],
        http2_protocol_options={"allow_connect": True, "max_concurrent_streams": 100,
                                "connection_keepalive": {"interval": "10s", "timeout": "20s"}},
        http_filters=[connect_authority, _router()])
    tls = _any("envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
               common_tls_context=_tls_common(model.trust_domain,
                                              [f"spiffe://{model.trust_domain}/"]),
               require_client_certificate=True)
    return {
        "name": CONNECT_TERMINATE,
        "address": {"socket_address": {"address": opts.bind, "port_value": HBONE_PORT}},
        "filter_chains": [{
            "name": "default",
            "transport_socket": {"name": "tls", "typed_config": tls},
            "filters": [{"name": "envoy.filters.network.http_connection_manager",
                         "typed_config": hcm}]}],
        "connection_balance_config": {"exact_balance": {}},
    }


def _policies_for(model: WaypointModel, svc: BoundService | None) -> list[dict]:
    return [p.policy for p in model.policies
            if p.scope is None or (svc is not None and p.scope == svc.key)]


def _http_chain(model: WaypointModel, opts: Options, svc: BoundService | None,
                port: ServicePort | None, name: str, problems: list[str]) -> dict:
    filters, found = rbac_filters(_policies_for(model, svc), http=True)
    problems.extend(found)
    pre = []
    if opts.xfcc:
        pre.append({"name": "istio.waypoint.xfcc_client_identity", "typed_config": _any(
            "envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            mutations={"request_mutations": [{"append": {"header": {
                "key": "x-forwarded-client-cert",
                "value": "By=%FILTER_STATE(io.istio.local_principal:PLAIN)%;"
                         "URI=%FILTER_STATE(io.istio.peer_principal:PLAIN)%"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}}]})})
    hcm: dict[str, Any] = {
        "stat_prefix": f"inbound_0.0.0.0_{port.port}" if port else "direct_http",
        "use_remote_address": False,
        "normalize_path": True, "merge_slashes": True, "path_with_escaped_slashes_action":
            "KEEP_UNCHANGED",
        "http_filters": [*pre, *filters, _router()],
        "stream_idle_timeout": "0s",
        "upgrade_configs": [{"upgrade_type": "websocket"}],
    }
    if svc is not None:
        hcm["rds"] = {"route_config_name": name,
                      "config_source": {"ads": {}, "resource_api_version": "V3"}}
    else:
        hcm["route_config"] = {"name": name, "validate_clusters": False, "virtual_hosts": [
            {"name": "inbound|http|0", "domains": ["*"], "routes": [
                {"name": "default", "match": {"prefix": "/"},
                 "route": {"cluster": ENCAP, "timeout": "0s",
                           "retry_policy": DEFAULT_RETRY}}]}]}
    if port is not None and port.http2:
        hcm["http2_protocol_options"] = {}
    typed = _any("envoy.extensions.filters.network.http_connection_manager.v3."
                 "HttpConnectionManager", **hcm)
    pre_net = [] if svc is not None else [_local_ip_filter()]
    return {"name": name, "filters": [
        *pre_net,
        {"name": "envoy.filters.network.http_connection_manager", "typed_config": typed}]}


def _tcp_chain(model: WaypointModel, svc: BoundService | None, cluster: str, name: str,
               problems: list[str]) -> dict:
    filters, found = rbac_filters(_policies_for(model, svc), http=False)
    problems.extend(found)
    proxy = {"name": "envoy.filters.network.tcp_proxy", "typed_config": _any(
        "envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy", stat_prefix=cluster,
        cluster=cluster)}
    pre = [_local_ip_filter()] if svc is None else []
    return {"name": name, "filters": [*pre, *filters, proxy]}


def _local_ip_filter() -> dict:
    """``connect_authority`` of the direct chains: the tunnel's destination (set by
    ``connect_terminate``) passed on to ``connect_originate`` through ``encap``."""
    return {"name": "connect_authority", "typed_config": _any(
        "envoy.extensions.filters.network.set_filter_state.v3.Config",
        on_new_connection=[_fs_value(
            LOCAL_IP_STATE, f"%FILTER_STATE({LOCAL_IP_STATE}:PLAIN)%")])}


def _chain_action(name: str) -> dict:
    return {"action": {"name": name, "typed_config": _any("google.protobuf.StringValue",
                                                          value=name)}}


def _app_protocol_matcher(http_chain: str, tcp_chain: str) -> dict:
    """Istio's ``match.NewAppProtocol``: sniffed HTTP -> the HTTP chain, else TCP."""
    to_http = _chain_action(http_chain)
    return {"matcher": {
        "matcher_tree": {
            "input": {"name": "application-protocol", "typed_config": _any(
                "envoy.extensions.matching.common_inputs.network.v3.ApplicationProtocolInput")},
            "exact_match_map": {"map": {"'h2c'": to_http, "'http/1.1'": to_http,
                                        "'http/1.0'": to_http}}},
        "on_no_match": _chain_action(tcp_chain)}}


def _cidr(ip: str) -> dict:
    return {"address_prefix": ip, "prefix_len": 128 if ":" in ip else 32}


@dataclasses.dataclass
class _Parts:
    """What one bound service contributes, parsed: its ``main_internal`` chains and IP
    range entry, its clusters, endpoints and routes, and the problems found building them."""

    chains: list[Message]
    range: dict | None
    sniffed: bool
    fixed_ports: set[int]
    resources: list[tuple[str, str, Message]]  # (type URL, name, message)
    problems: list[str]


def _service_parts(model: WaypointModel, opts: Options, svc: BoundService,
                   cache: "ParseCache") -> _Parts:
    problems: list[str] = []
    chains: list[dict] = []
    port_map: dict[str, dict] = {}
    sniffed, fixed_ports = False, set()
    res: list[tuple[str, str, Message]] = []
    for port in svc.ports:
        http_name = cluster_name("http", port.port, svc.hostname)
        tcp_name = cluster_name("tcp", port.port, svc.hostname)
        if port.protocol == "UNSUPPORTED":
            chains.append(_http_chain(model, opts, svc, port, http_name, problems))
            chains.append(_tcp_chain(model, svc, tcp_name, tcp_name, problems))
            port_map[str(port.port)] = _app_protocol_matcher(http_name, tcp_name)
            sniffed = True
        elif port.http:
            chains.append(_http_chain(model, opts, svc, port, http_name, problems))
            port_map[str(port.port)] = _chain_action(http_name)
            fixed_ports.add(port.port)
        else:
            chains.append(_tcp_chain(model, svc, tcp_name, tcp_name, problems))
            port_map[str(port.port)] = _chain_action(tcp_name)
            fixed_ports.add(port.port)
        for subset in ("http", "tcp"):
            if (subset == "http" and not port.http) or (subset == "tcp" and not port.tcp):
                continue
            name = cluster_name(subset, port.port, svc.hostname)
            res.append((CLUSTER_TYPE, name, cache.parse(
                cluster_pb2.Cluster, _vip_cluster(name, port, subset))))
            res.append((ENDPOINT_TYPE, name, cache.parse(
                endpoint_pb2.ClusterLoadAssignment,
                _endpoints(name, svc.endpoints.get(port.port, ())))))
            if subset == "http":
                res.append((ROUTE_TYPE, name, cache.parse(
                    route_pb2.RouteConfiguration,
                    _route_config(name, name, port.port, model, svc, problems))))
    entry = None
    if port_map and svc.vips:
        entry = {"ranges": [_cidr(v) for v in svc.vips], "on_match": {"matcher": {
            "matcher_tree": {
                "input": {"name": "port", "typed_config": _any(
                    "envoy.extensions.matching.common_inputs.network.v3."
                    "DestinationPortInput")},
                "exact_match_map": {"map": port_map}}}}}
    parsed = [cache.parse(listener_components_pb2.FilterChain, c) for c in chains]
    return _Parts(parsed, entry, sniffed, fixed_ports, res, problems)


def main_internal(model: WaypointModel, opts: Options, parts: list[_Parts],
                  cache: "ParseCache", problems: list[str]) -> Message:
    chains: list[Message] = [c for p in parts for c in p.chains]
    ranges: list[dict] = [p.range for p in parts if p.range is not None]
    sniffed = any(p.sniffed for p in parts)
    fixed_ports: set[int] = set().union(*(p.fixed_ports for p in parts))
    chains.append(cache.parse(listener_components_pb2.FilterChain,
                              _tcp_chain(model, None, ENCAP, "direct-tcp", problems)))
    chains.append(cache.parse(listener_components_pb2.FilterChain,
                              _http_chain(model, opts, None, None, "direct-http", problems)))
    if model.workload_ips:
        ranges.append({"ranges": [_cidr(ip) for ip in sorted(set(model.workload_ips))],
                       "on_match": _app_protocol_matcher("direct-http", "direct-tcp")})
        sniffed = True
    listener_filters: list[dict] = [{"name": "envoy.filters.listener.original_dst",
                                     "typed_config": _any("envoy.extensions.filters.listener."
                                                          "original_dst.v3.OriginalDst")}]
    if sniffed:
        inspector: dict[str, Any] = {"name": "envoy.filters.listener.http_inspector",
                                     "typed_config": _any("envoy.extensions.filters.listener."
                                                          "http_inspector.v3.HttpInspector")}
        if fixed_ports and not model.workload_ips:
            inspector["filter_disabled"] = {"or_match": {"rules": [
                {"destination_port_range": {"start": p, "end": p + 1}}
                for p in sorted(fixed_ports)]}} if len(fixed_ports) > 1 else {
                "destination_port_range": {"start": min(fixed_ports),
                                           "end": min(fixed_ports) + 1}}
        listener_filters.append(inspector)
    out: dict[str, Any] = {
        "name": MAIN_INTERNAL, "internal_listener": {},
        "listener_filters": listener_filters, "traffic_direction": "INBOUND"}
    if ranges:
        out["filter_chain_matcher"] = {"matcher_tree": {
            "input": {"name": "ip", "typed_config": _any(
                "envoy.extensions.matching.common_inputs.network.v3.DestinationIPInput")},
            "custom_match": {"name": "ip", "typed_config": _any(
                "xds.type.matcher.v3.IPMatcher", range_matchers=ranges)}}}
    else:
        # no service bound: nothing may be matched (a matcher with no match closes)
        out["filter_chain_matcher"] = {"matcher_tree": {
            "input": {"name": "port", "typed_config": _any(
                "envoy.extensions.matching.common_inputs.network.v3.DestinationPortInput")},
            "exact_match_map": {"map": {"0": _chain_action("direct-tcp")}}}}
    listener = listener_pb2.Listener()
    listener.CopyFrom(cache.parse(listener_pb2.Listener, out))
    listener.filter_chains.extend(chains)
    return listener


def connect_originate_listener() -> dict:
    return {
        "name": CONNECT_ORIGINATE, "use_original_dst": False, "internal_listener": {},
        "listener_filters": [{"name": "envoy.filters.listener.original_dst",
                              "typed_config": _any("envoy.extensions.filters.listener."
                                                   "original_dst.v3.OriginalDst")}],
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.tcp_proxy",
                                        "typed_config": _any(
            "envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
            stat_prefix=CONNECT_ORIGINATE, cluster=CONNECT_ORIGINATE,
            tunneling_config={"hostname": "%DOWNSTREAM_LOCAL_ADDRESS%"})}]}],
    }


# ---------------------------------------------------------------- clusters

def _static_internal(name: str, listener: str) -> dict:
    return {"name": name, "type": "STATIC", "circuit_breakers": _circuit_breakers(),
            "load_assignment": {"cluster_name": name, "endpoints": _internal_endpoints(listener)},
            "transport_socket": _internal_upstream(False), "alt_stat_name": name + ";",
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _any(
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    common_http_protocol_options={"idle_timeout": "300s"},
                    use_downstream_protocol_config={"http_protocol_options": {},
                                                    "http2_protocol_options": {}})}}


def _vip_cluster(name: str, port: ServicePort, subset: str) -> dict:
    out: dict[str, Any] = {
        "name": name, "type": "EDS", "connect_timeout": "10s", "lb_policy": "LEAST_REQUEST",
        "eds_cluster_config": {"service_name": name, "eds_config": {
            "ads": {}, "resource_api_version": "V3", "initial_fetch_timeout": "0s"}},
        "circuit_breakers": _circuit_breakers(),
        "common_lb_config": {"healthy_panic_threshold": {}},
        "transport_socket": _internal_upstream(True), "alt_stat_name": name + ";"}
    if subset == "http" and port.http2:
        out["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _any(
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                explicit_http_config={"http2_protocol_options": {}})}
    return out


def connect_originate_cluster(model: WaypointModel) -> dict:
    prefix = f"spiffe://{model.trust_domain}/ns/{model.namespace}/sa/"
    # as istiod: the trust domain's prefix and the namespace's; Envoy accepts a SAN matching
    # either, so any workload of the trust domain is reachable (route backends elsewhere too)
    tls = _any("envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
               common_tls_context=_tls_common(model.trust_domain,
                                              [f"spiffe://{model.trust_domain}/", prefix]))
    return {
        "name": CONNECT_ORIGINATE, "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "10s", "cleanup_interval": "60s",
        "circuit_breakers": _circuit_breakers(),
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _any(
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                common_http_protocol_options={"idle_timeout": "3600s"},
                explicit_http_config={"http2_protocol_options": {"allow_connect": True}})},
        "original_dst_lb_config": {
            "upstream_port_override": HBONE_PORT,
            "metadata_key": {"key": ORIGINAL_DST_KEY, "path": [{"key": "waypoint"}]}},
        "transport_socket": {"name": "tls", "typed_config": tls},
        "alt_stat_name": CONNECT_ORIGINATE + ";",
    }


def _endpoints(name: str, eps: Iterable) -> dict:
    lb = []
    for ep in eps:
        if not getattr(ep, "hbone", True):
            # outside the mesh: plaintext to the pod itself (istiod's endpoint builder)
            lb.append({"endpoint": {"address": {"socket_address": {
                "address": ep.ip, "port_value": ep.port}}},
                "health_status": "HEALTHY", "load_balancing_weight": 1})
            continue
        target = f"[{ep.ip}]:{ep.port}" if ":" in ep.ip else f"{ep.ip}:{ep.port}"
        lb.append({"endpoint": {"address": {"envoy_internal_address": {
            "server_listener_name": CONNECT_ORIGINATE, "endpoint_id": target}}},
            "health_status": "HEALTHY",
            "metadata": {"filter_metadata": {ORIGINAL_DST_KEY: {"local": target}}},
            "load_balancing_weight": 1})
    return {"cluster_name": name, "endpoints": [{"lb_endpoints": lb}] if lb else []}


def _route_config(name: str, cluster: str, port: int, model: WaypointModel | None = None,
                  svc: BoundService | None = None, problems: list[str] | None = None) -> dict:
    attached = model.routes.get(svc.key) if model is not None and svc is not None else None
    if attached and any(not a.port or a.port == port for a in attached):
        assert model is not None
        routes = RouteBuilder(attached, port, model.backend_cluster,
                              problems if problems is not None else []).routes()
        # no rule matched: 404 (Gateway API), as istiod's route for an attached route
        routes.append({"name": "no-route", "match": {"prefix": "/"},
                       "direct_response": {"status": 404}})
        return {"name": name, "validate_clusters": False, "virtual_hosts": [{
            "name": f"inbound|http|{port}", "domains": ["*"], "routes": routes}]}
    return {"name": name, "validate_clusters": False, "virtual_hosts": [{
        "name": f"inbound|http|{port}", "domains": ["*"], "routes": [{
            "name": "default", "match": {"prefix": "/"},
            "route": {"cluster": cluster, "timeout": "0s", "retry_policy": DEFAULT_RETRY,
                      "max_stream_duration": {"max_stream_duration": "0s",
                                              "grpc_timeout_header_max": "0s"}},
            "decorator": {"operation": f"{cluster.split('|')[-1]}:{port}/*"}}]}]}


_PARSE = {LISTENER_TYPE: listener_pb2.Listener, CLUSTER_TYPE: cluster_pb2.Cluster,
          ENDPOINT_TYPE: endpoint_pb2.ClusterLoadAssignment,
          ROUTE_TYPE: route_pb2.RouteConfiguration, SECRET_TYPE: secret_pb2.Secret}


def to_message(type_url: str, value: dict) -> Message:
    """A resource dict (protobuf JSON form) as its message; raises ``json_format.ParseError``."""
    return json_format.ParseDict(value, _PARSE[type_url]())


class ParseCache:
    """Parsed messages by the text of the dict they came from, and each service's parsed
    parts by the inputs they came from (both bounded, least recently used out), so a
    rebuild after one change re-parses only what changed: ``json_format`` parsing costs
    ~100x serializing, and all but one service are usually unchanged. Cached messages
    are shared: never mutate one (copy it)."""

    def __init__(self, limit: int = 50_000):
        self.limit = limit
        self._items: dict[tuple[type, str], Message] = {}
        self._parts: dict[tuple, _Parts] = {}
        self.hits = self.misses = 0
        self.lock = threading.Lock()  # one build at a time (builds run on a worker thread)

    def parse(self, cls: type, value: dict) -> Message:
        # the dicts are built by this module in a fixed order: repr is a faithful key
        key = (cls, repr(value))
        msg = self._items.pop(key, None)
        if msg is None:
            self.misses += 1
            msg = json_format.ParseDict(value, cls())
            if len(self._items) >= self.limit:
                self._items.pop(next(iter(self._items)))
        else:
            self.hits += 1
        self._items[key] = msg
        return msg

    def service_parts(self, model: WaypointModel, opts: Options, svc: BoundService,
                      policies_text: str) -> _Parts:
        routes = model.routes.get(svc.key)
        key = (repr(svc), policies_text, opts.bind, opts.xfcc, model.trust_domain,
               model.namespace, repr([a.route for a in routes]) if routes else "",
               repr(sorted((k, b.ports) for k, b in model.backends.items())) if routes else "")
        parts = self._parts.pop(key, None)
        if parts is None:
            parts = _service_parts(model, opts, svc, self)
            if len(self._parts) >= self.limit // 10:
                self._parts.pop(next(iter(self._parts)))
        self._parts[key] = parts
        return parts


def build(model: WaypointModel, opts: Options | None = None, cache: ParseCache | None = None
          ) -> tuple[dict[str, dict[str, Message]], list[str]]:
    """``({type URL: {name: message}}, problems)`` for LDS, CDS, EDS and RDS (secrets are
    the server's: they need the CA). Never raises for bad objects: they are problems.
    ``cache`` (kept across builds) makes a rebuild cost what changed."""
    opts = opts or Options()
    cache = cache or ParseCache()
    with cache.lock:
        return _build(model, opts, cache)


def _build(model: WaypointModel, opts: Options, cache: ParseCache
           ) -> tuple[dict[str, dict[str, Message]], list[str]]:
    problems = list(model.problems)
    out: dict[str, dict[str, Message]] = {t: {} for t in ENVOY_TYPES}
    waypoint_wide = repr([p.policy for p in model.policies if p.scope is None])
    parts = []
    for svc in model.services:
        scoped = repr([p.policy for p in model.policies if p.scope == svc.key])
        part = cache.service_parts(model, opts, svc, waypoint_wide + scoped)
        problems.extend(part.problems)
        parts.append(part)
    listeners = [cache.parse(listener_pb2.Listener, connect_terminate(model, opts)),
                 main_internal(model, opts, parts, cache, problems),
                 cache.parse(listener_pb2.Listener, connect_originate_listener())]
    for lst in listeners:
        out[LISTENER_TYPE][lst.name] = lst
    for item in (_static_internal(MAIN_INTERNAL, MAIN_INTERNAL),
                 _static_internal(ENCAP, CONNECT_ORIGINATE), connect_originate_cluster(model)):
        out[CLUSTER_TYPE][item["name"]] = cache.parse(cluster_pb2.Cluster, item)
    for part in parts:
        for type_url, name, msg in part.resources:
            out[type_url][name] = msg
    for backend in model.backends.values():
        wanted = model.backend_ports.get(backend.key)
        for port in backend.ports:
            if wanted is not None and port.port not in wanted:
                continue
            name = cluster_name("http", port.port, backend.hostname)
            if name not in out[CLUSTER_TYPE]:
                out[CLUSTER_TYPE][name] = cache.parse(cluster_pb2.Cluster,
                                                      _vip_cluster(name, port, "http"))
                out[ENDPOINT_TYPE][name] = cache.parse(
                    endpoint_pb2.ClusterLoadAssignment,
                    _endpoints(name, backend.endpoints.get(port.port, ())))
    return out, list(dict.fromkeys(problems))


def secrets(cert_chain: bytes, key: bytes, root: bytes) -> dict[str, Message]:
    """The SDS secrets ``default`` (the waypoint's chain and key) and ``ROOTCA``."""
    return {
        CERT_SECRET: to_message(SECRET_TYPE, {"name": CERT_SECRET, "tls_certificate": {
            "certificate_chain": {"inline_bytes": _b64(cert_chain)},
            "private_key": {"inline_bytes": _b64(key)}}}),
        ROOT_SECRET: to_message(SECRET_TYPE, {"name": ROOT_SECRET, "validation_context": {
            "trusted_ca": {"inline_bytes": _b64(root)}}}),
    }


def _b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()


def valid_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False
