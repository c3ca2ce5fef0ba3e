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
  A member pod outside the mesh (its workload's tunnel protocol not HBONE) gets instead a
  plaintext ``<podIP>:<targetPort>`` socket address, as istiod gives it.
  ``connect_originate``: ORIGINAL_DST to port 15008 of the destination, HTTP/2 with
  ``allow_connect``, TLS 1.3 with the waypoint's certificate; the peer's URI SAN must start
  with ``spiffe://<trust domain>/`` or ``spiffe://<trust domain>/ns/<waypoint namespace>/sa/``
  (istiod lists both; Envoy accepts either).

Deliberate differences (``docs/waypoint.md``): HTTP chains take their routes by RDS (one
``RouteConfiguration`` per chain, named as the chain) where istiod inlines them, so a
route change is one small push; the filter state uses Envoy's ``envoy.string`` factory
(stock Envoy, as istiod does for proxies before 1.29.2) instead of Istio's own; the
``istio.*`` telemetry filters (peer metadata, stats) are not configured. Access logs:
:class:`AccessLog` (istiod's meshConfig file log, where istiod puts it).

Building: :class:`Assembler` keeps one waypoint's resources across changes and rebuilds
only the services it is told changed; a service's resources are copies of per-shape
prototypes (:meth:`ParseCache.shape`, parsed once from the dicts above) with their names
set, so ``json_format`` runs once per shape, not per service. A full build makes each
service's chains and IP range entry inside ``main_internal``'s own listener and matcher
(no second copy). Versions: a message parsed or assembled whole gets its content hash
(:func:`version_of`); a prototype copy gets :func:`derived_version` of the prototype's
content hash and the values set, and an endpoint assignment that of its endpoints, so a
service's resources are not serialized once more just to be versioned.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
import hashlib
from typing import Any, Callable, Iterable

from envoy.config.cluster.v3 import cluster_pb2
from envoy.extensions.access_loggers.file.v3 import file_pb2  # noqa: F401
from envoy.extensions.formatter.req_without_query.v3 import (  # noqa: F401
    req_without_query_pb2)
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
from xds.core.v3 import extension_pb2 as xds_extension_pb2
from xds.type.matcher.v3 import ip_pb2, matcher_pb2  # noqa: F401

from ambient.waypoint.options import (  # noqa: F401 - re-exported: resources.Options etc.
    CLUSTER_TYPE, DEFAULT_ACCESS_LOG_FORMAT, DEFAULT_ACCESS_LOG_JSON, ENDPOINT_TYPE,
    ENVOY_TYPES, LISTENER_TYPE, ROUTE_TYPE, SECRET_TYPE, TYPE_URL_PREFIX, XFCC_ANNOTATION,
    AccessLog, Options, any_of as _any, valid_ip)
from ambient.waypoint import tcproute
from ambient.waypoint.httproute import DEFAULT_RETRY, HTTP_KINDS, RouteBuilder
from ambient.waypoint.model import BoundService, ServicePort, WaypointModel, backend_subset
from ambient.waypoint.rbac import rbac_filters


CONNECT_TERMINATE = "connect_terminate"
MAIN_INTERNAL = "main_internal"
CONNECT_ORIGINATE = "connect_originate"
ENCAP = "encap"
HBONE_PORT = 15008
ORIGINAL_DST_KEY = "envoy.filters.listener.original_dst"
LOCAL_IP_STATE = "envoy.filters.listener.original_dst.local_ip"
CERT_SECRET, ROOT_SECRET = "default", "ROOTCA"

_T = TYPE_URL_PREFIX
_MAX = 4294967295
_HEALTHY = 1  # envoy.config.core.v3.HealthStatus.HEALTHY






NO_ROUTE_FILTER = {"response_flag_filter": {"flags": ["NR"]}}
UPSTREAM_FAILURE_FILTER = {"response_flag_filter": {"flags": ["UF"]}}
ERROR_STATUS_FILTER = {"status_code_filter": {"comparison": {
    "op": "GE", "value": {"default_value": 400, "runtime_key": "istio.io/unset"}}}}


def _logs(opts: Options, flt: dict | None = None) -> list[dict]:
    return opts.access_log.entries(flt) if opts.access_log is not None else []


def cluster_name(subset: str, port: int, hostname: str) -> str:
    """istiod's ``BuildSubsetKey(inbound-vip, subset, host, port)``."""
    return f"inbound-vip|{port}|{subset}|{hostname}"




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
        http_filters=[connect_authority, _router()],
        **_opt("access_log", _logs(opts, ERROR_STATUS_FILTER)))
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
        **_opt("access_log", _logs(opts, NO_ROUTE_FILTER)),
    }


def _opt(key: str, value: Any) -> dict:
    """``{key: value}`` when ``value`` is not empty, else ``{}`` (unset fields stay unset)."""
    return {key: value} if value else {}


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
        # istiod's inbound stat prefix, ';'-delimited (util.DelimitedStatsPrefix)
        "stat_prefix": f"inbound_0.0.0.0_{port.port};" if port else "direct_http",
        "use_remote_address": False,
        "normalize_path": True, "merge_slashes": True, "path_with_escaped_slashes_action":
            "KEEP_UNCHANGED",
        "http_filters": [*pre, *filters, _router()],
        "stream_idle_timeout": "0s",
        "upgrade_configs": [{"upgrade_type": "websocket"}],
        **_opt("access_log", _logs(opts)),
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
               problems: list[str], opts: Options | None = None) -> dict:
    filters, found = rbac_filters(_policies_for(model, svc), http=False)
    # name the chain: the same policy's HTTP rules are enforced on the HTTP chains, so a
    # bare "rule is dropped" read as if the policy were not enforced at all
    problems.extend(f"filter chain {name!r} (TCP, no HTTP attributes): {p}" for p in found)
    proxy = {"name": "envoy.filters.network.tcp_proxy", "typed_config": _any(
        "envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy", stat_prefix=cluster,
        cluster=cluster, **_opt("access_log", _logs(opts) if opts else []))}
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
    """What one bound service contributes: its ``main_internal`` chains and IP range
    entry, its clusters, endpoints and routes (messages with their versions), and the
    problems found."""

    chains: list[Message]
    range: Message | None  # xds.type.matcher.v3.IPMatcher.IPRangeMatcher
    sniffed: bool
    fixed_ports: set[int]
    resources: list[tuple[str, str, Message, str]]  # (type URL, name, message, version)
    problems: list[str]


def _policies_key(model: WaypointModel, svc: BoundService | None, wide: str) -> str:
    if svc is None or not any(p.scope == svc.key for p in model.policies):
        return wide
    return wide + repr([p.policy for p in model.policies if p.scope == svc.key])


def _hcm_tail(name: str) -> bytes:
    """The serialized ``HttpConnectionManager{rds{route_config_name}}``: appended to a
    shape's serialized HCM it sets the route name (protobuf merges a message field that
    occurs twice, so the concatenation parses as the shape with that name)."""
    hcm = http_connection_manager_pb2.HttpConnectionManager()
    hcm.rds.route_config_name = name
    return hcm.SerializeToString()


def derived_version(*parts: str) -> str:
    """The version of a message made from a prototype by setting fields: hex BLAKE2b-64
    of the prototype's own version (:func:`version_of`) and the values set, NUL-joined.
    Equal inputs give equal versions and any differing input a different one, as the
    content hash would, without serializing the message again (that costs as much as
    the push's own serialization)."""
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=8).hexdigest()


def _service_parts(model: WaypointModel, opts: Options, svc: BoundService,
                   cache: "ParseCache", wide: str,
                   staged: tuple[Message, Message] | None = None) -> _Parts:
    """One service's parts, built as messages from per-shape prototypes (the chain, the
    cluster and the default route of a port differ from service to service only by their
    names: the shape is parsed once from its dict, then copied and named). ``staged``:
    the ``(Listener, IPMatcher)`` the chains and the range entry are made in (see
    :func:`main_internal`); else they are messages of their own."""
    into = staged[0].filter_chains if staged is not None else None
    problems: list[str] = []
    chains: list[Message] = []
    port_map: list[tuple[str, Message | str]] = []  # port -> OnMatch, or the chain's name
    sniffed, fixed_ports = False, set()
    res: list[tuple[str, str, Message, str]] = []
    pkey = _policies_key(model, svc, wide)
    hostname = svc.hostname
    for port in svc.ports:
        number = port.port
        http_name = f"inbound-vip|{number}|http|{hostname}"
        tcp_name = f"inbound-vip|{number}|tcp|{hostname}"
        http, tcp = port.http, port.tcp
        if http and tcp:  # UNSUPPORTED: sniffed
            chains.append(_named_http_chain(model, opts, svc, port, http_name, cache, pkey,
                                            problems, into))
            chains.append(_named_tcp_chain(model, opts, svc, tcp_name, cache, pkey, problems,
                                           number, into))
            port_map.append((str(number), cache.parse(
                matcher_pb2.Matcher.OnMatch, _app_protocol_matcher(http_name, tcp_name))))
            sniffed = True
        elif http:
            chains.append(_named_http_chain(model, opts, svc, port, http_name, cache, pkey,
                                            problems, into))
            port_map.append((str(number), http_name))
            fixed_ports.add(number)
        else:
            chains.append(_named_tcp_chain(model, opts, svc, tcp_name, cache, pkey, problems,
                                           number, into))
            port_map.append((str(number), tcp_name))
            fixed_ports.add(number)
        eps = svc.endpoints.get(number, ())
        if http:
            cluster, version = _named_cluster_v(http_name, port, "http", cache)
            res.append((CLUSTER_TYPE, http_name, cluster, version))
            res.append((ENDPOINT_TYPE, http_name, *_endpoints_message_v(http_name, eps)))
            res.append((ROUTE_TYPE, http_name, *_route_message_v(http_name, port, model, svc,
                                                                cache, problems)))
        if tcp:
            cluster, version = _named_cluster_v(tcp_name, port, "tcp", cache)
            res.append((CLUSTER_TYPE, tcp_name, cluster, version))
            res.append((ENDPOINT_TYPE, tcp_name, *_endpoints_message_v(tcp_name, eps)))
    entry = None
    if port_map and svc.vips:
        entry = staged[1].range_matchers.add() if staged is not None \
            else ip_pb2.IPMatcher.IPRangeMatcher()
        # the port matcher of this set of ports, chain names left out, copied in one call
        fixed = tuple(key for key, on_match in port_map if isinstance(on_match, str))
        entry.CopyFrom(cache.shape(("range", fixed), lambda: (_range_prototype(cache, fixed),
                                                              []))[0])
        for v in svc.vips:
            r = entry.ranges.add(address_prefix=v)
            r.prefix_len.value = 128 if ":" in v else 32
        entries = entry.on_match.matcher.matcher_tree.exact_match_map.map
        for key, on_match in port_map:
            if isinstance(on_match, str):
                action = entries[key].action
                action.name = on_match
                action.typed_config.value = wrappers_pb2.StringValue(
                    value=on_match).SerializeToString()
            else:
                entries[key].CopyFrom(on_match)
    return _Parts(chains, entry, sniffed, fixed_ports, res, problems)


_STRING_VALUE_URL = _T + "google.protobuf.StringValue"


def _range_prototype(cache: "ParseCache", fixed_ports: tuple[str, ...]) -> Message:
    """An ``IPRangeMatcher`` without ranges whose ``on_match`` matches the destination port:
    for each of ``fixed_ports`` an action with the chain name left empty (the packed
    ``StringValue``'s type set); the caller adds the VIPs and names the chains."""
    out = ip_pb2.IPMatcher.IPRangeMatcher()
    tree = out.on_match.matcher.matcher_tree
    tree.input.CopyFrom(cache.shape(("port-input",), lambda: (cache.parse(
        xds_extension_pb2.TypedExtensionConfig, {"name": "port", "typed_config": _any(
            "envoy.extensions.matching.common_inputs.network.v3.DestinationPortInput")}),
        []))[0])
    for key in fixed_ports:
        _set_chain_action(tree.exact_match_map.map[key].action, "")
    return out


def _set_chain_action(action: Message, name: str) -> None:
    """Set ``action`` (a ``TypedExtensionConfig``) to pick the filter chain ``name``: the
    name, and a ``StringValue`` of it packed (what ``Any.Pack`` writes, without its
    per-call Python work)."""
    action.name = name
    typed = action.typed_config
    typed.type_url = _STRING_VALUE_URL
    typed.value = wrappers_pb2.StringValue(value=name).SerializeToString()


def _named_http_chain(model: WaypointModel, opts: Options, svc: BoundService,
                      port: ServicePort, name: str, cache: "ParseCache", pkey: str,
                      problems: list[str], into: Any = None) -> Message:
    def make() -> tuple[Message, list[str]]:
        found: list[str] = []
        proto = cache.parse(listener_components_pb2.FilterChain,
                            _http_chain(model, opts, svc, port, "", found))
        return proto, found
    proto, found = cache.shape(("http", port.port, port.http2, opts.xfcc, opts.access_log, pkey),
                               make)
    problems.extend(found)
    chain = into.add() if into is not None else listener_components_pb2.FilterChain()
    chain.CopyFrom(proto)
    chain.name = name
    typed = chain.filters[-1].typed_config
    typed.value = typed.value + _hcm_tail(name)
    return chain


def _named_tcp_chain(model: WaypointModel, opts: Options, svc: BoundService, name: str,
                     cache: "ParseCache", pkey: str, problems: list[str],
                     port: int = 0, into: Any = None) -> Message:
    """One TCP chain (made in the repeated field ``into`` when given)."""
    attached = model.routes.get(svc.key)
    routed = tcproute.upstream(attached, port, model.backend_cluster, problems) \
        if attached else None
    if routed is not None:
        # a TCPRoute decides the upstream: this chain is not the shape's (few such chains)
        chain_dict = _tcp_chain(model, svc, name, name, problems, opts)
        proxy = chain_dict["filters"][-1]["typed_config"]
        del proxy["cluster"]
        proxy.update(routed)
        parsed = cache.parse(listener_components_pb2.FilterChain, chain_dict)
        if into is None:
            return parsed
        chain = into.add()
        chain.CopyFrom(parsed)
        return chain

    def make() -> tuple[Message, list[str]]:
        found: list[str] = []
        return cache.parse(listener_components_pb2.FilterChain,
                           _tcp_chain(model, svc, "", "", found, opts)), found
    proto, found = cache.shape(("tcp", pkey, opts.access_log), make)
    problems.extend(found)
    chain = into.add() if into is not None else listener_components_pb2.FilterChain()
    chain.CopyFrom(proto)
    chain.name = name
    # the shape's TcpProxy with the names set (a scalar that occurs twice: the last wins)
    typed = chain.filters[-1].typed_config
    typed.value = typed.value + tcp_proxy_pb2.TcpProxy(
        stat_prefix=name, cluster=name).SerializeToString()
    return chain


def _named_cluster_v(name: str, port: ServicePort, subset: str, cache: "ParseCache"
                     ) -> tuple[Message, str]:
    """The ``inbound-vip`` cluster ``name`` and its version: the shape's prototype with
    the name, the EDS service name and the stat name set."""
    proto, version = cache.shape_version(("cluster", subset, port.http2), lambda: (
        cache.parse(cluster_pb2.Cluster, _vip_cluster("", port, subset)), []))
    out = cluster_pb2.Cluster()
    out.CopyFrom(proto)
    out.name = name
    out.eds_cluster_config.service_name = name
    out.alt_stat_name = name + ";"
    return out, derived_version(version, name)


def _endpoints_message(name: str, eps: Iterable) -> Message:
    """What :func:`_endpoints` describes, built directly."""
    out = endpoint_pb2.ClusterLoadAssignment(cluster_name=name)
    group = None
    for ep in eps:
        if group is None:
            group = out.endpoints.add()
        lb = group.lb_endpoints.add(health_status=_HEALTHY)
        if not getattr(ep, "hbone", True):
            # outside the mesh: plaintext to the pod itself (istiod's endpoint builder)
            sock = lb.endpoint.address.socket_address
            sock.address, sock.port_value = ep.ip, ep.port
            lb.load_balancing_weight.value = 1
            continue
        target = f"[{ep.ip}]:{ep.port}" if ":" in ep.ip else f"{ep.ip}:{ep.port}"
        internal = lb.endpoint.address.envoy_internal_address
        internal.server_listener_name = CONNECT_ORIGINATE
        internal.endpoint_id = target
        lb.metadata.filter_metadata[ORIGINAL_DST_KEY].fields["local"].string_value = target
        lb.load_balancing_weight.value = 1
    return out


_ENDPOINTS_SCHEME = "cla/1"  # bump when _endpoints_message changes what it writes


def _endpoints_message_v(name: str, eps: Iterable) -> tuple[Message, str]:
    """:func:`_endpoints_message` and its version (from the name and each endpoint's IP,
    port and HBONE flag: all the message is made of)."""
    eps = tuple(eps)
    return _endpoints_message(name, eps), derived_version(
        _ENDPOINTS_SCHEME, name, repr([(e.ip, e.port, getattr(e, "hbone", True)) for e in eps]))


def _route_message_v(name: str, port: ServicePort, model: WaypointModel, svc: BoundService,
                     cache: "ParseCache", problems: list[str]) -> tuple[Message, str]:
    attached = model.routes.get(svc.key)
    if attached and _http_routed(attached, port.port):
        msg = cache.parse(route_pb2.RouteConfiguration,
                          _route_config(name, name, port.port, model, svc, problems))
        return msg, version_of(msg)
    proto, version = cache.shape_version(("route", port.port), lambda: (cache.parse(
        route_pb2.RouteConfiguration, _route_config("", "", port.port)), []))
    out = route_pb2.RouteConfiguration()
    out.CopyFrom(proto)
    out.name = name
    route = out.virtual_hosts[0].routes[0]
    route.route.cluster = name
    operation = f"{svc.hostname}:{port.port}/*"
    route.decorator.operation = operation
    return out, derived_version(version, name, operation)


def main_internal(model: WaypointModel, opts: Options, parts: list[_Parts],
                  cache: "ParseCache", problems: list[str],
                  staged: tuple[Message, Message] | None = None) -> Message:
    """The ``main_internal`` listener of ``parts`` (in the services' order). ``staged``:
    ``(listener, IPMatcher)`` already holding every part's chains and range entries (the
    full build makes them there, saving a copy of each); else they are copied in, and
    each part is pointed at its copies afterwards, so a part never keeps an older
    listener alive."""
    sniffed = any(p.sniffed for p in parts)
    fixed_ports: set[int] = set().union(*(p.fixed_ports for p in parts))
    direct = [cache.parse(listener_components_pb2.FilterChain,
                          _tcp_chain(model, None, ENCAP, "direct-tcp", problems, opts)),
              cache.parse(listener_components_pb2.FilterChain,
                          _http_chain(model, opts, None, None, "direct-http", problems))]
    if staged is not None:
        listener, matcher = staged
    else:
        listener, matcher = listener_pb2.Listener(), ip_pb2.IPMatcher()
        listener.filter_chains.extend(c for p in parts for c in p.chains)
        matcher.range_matchers.extend(p.range for p in parts if p.range is not None)
        i = k = 0
        for p in parts:
            n = len(p.chains)
            p.chains = list(listener.filter_chains[i:i + n])
            i += n
            if p.range is not None:
                p.range = matcher.range_matchers[k]
                k += 1
    if model.workload_ips:
        matcher.range_matchers.append(cache.parse(ip_pb2.IPMatcher.IPRangeMatcher, {
            "ranges": [_cidr(ip) for ip in sorted(set(model.workload_ips))],
            "on_match": _app_protocol_matcher("direct-http", "direct-tcp")}))
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
        "listener_filters": listener_filters, "traffic_direction": "INBOUND",
        **_opt("access_log", _logs(opts, NO_ROUTE_FILTER))}
    if matcher.range_matchers:
        out["filter_chain_matcher"] = {"matcher_tree": {
            "input": {"name": "ip", "typed_config": _any(
                "envoy.extensions.matching.common_inputs.network.v3.DestinationIPInput")},
            "custom_match": {"name": "ip", "typed_config": _any(
                "xds.type.matcher.v3.IPMatcher")}}}
    else:
        # no service bound: nothing may be matched (a matcher with no match closes)
        out["filter_chain_matcher"] = {"matcher_tree": {
            "input": {"name": "port", "typed_config": _any(
                "envoy.extensions.matching.common_inputs.network.v3.DestinationPortInput")},
            "exact_match_map": {"map": {"0": _chain_action("direct-tcp")}}}}
    # the chains are the only repeated field both hold: merging keeps theirs, then the rest
    listener.MergeFrom(cache.parse(listener_pb2.Listener, out))
    if matcher.range_matchers:
        # deterministic: the map order inside would otherwise follow how the entries were
        # made (staged or copied), and the listener's version hashes these bytes
        listener.filter_chain_matcher.matcher_tree.custom_match.typed_config.Pack(
            matcher, deterministic=True)
    listener.filter_chains.extend(direct)
    return listener


def connect_originate_listener(opts: Options | None = None) -> dict:
    opts = opts or Options()
    return {
        "name": CONNECT_ORIGINATE, "use_original_dst": False, "internal_listener": {},
        "listener_filters": [{"name": "envoy.filters.listener.original_dst",
                              "typed_config": _any("envoy.extensions.filters.listener."
                                                   "original_dst.v3.OriginalDst")}],
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.tcp_proxy",
                                        "typed_config": _any(
            "envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
            stat_prefix=CONNECT_ORIGINATE, cluster=CONNECT_ORIGINATE,
            tunneling_config={"hostname": "%DOWNSTREAM_LOCAL_ADDRESS%"},
            **_opt("access_log", _logs(opts, UPSTREAM_FAILURE_FILTER)))}]}],
        **_opt("access_log", _logs(opts, NO_ROUTE_FILTER)),
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


def _http_routed(attached: list, port: int) -> bool:
    """Whether an HTTPRoute or GRPCRoute attached to the service applies to ``port``."""
    return any(a.kind in HTTP_KINDS and (not a.port or a.port == port) for a in attached)


def _route_config(name: str, cluster: str, port: int, model: WaypointModel | None = None,
                  svc: BoundService | None = None, problems: list[str] | None = None) -> dict:
    attached = model.routes.get(svc.key) if model is not None and svc is not None else None
    if attached and _http_routed(attached, port):
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
    """Parsed messages by the text of the dict they came from, and prototypes by their
    shape (both bounded, least recently used out), so only the first service of a shape
    pays ``json_format`` parsing (~1000x serializing). Cached messages are shared: never
    mutate one (copy it)."""

    def __init__(self, limit: int = 50_000):
        self.limit = limit
        self._items: dict[tuple[type, str], Message] = {}
        self._shapes: dict[tuple, tuple[Message, list[str]]] = {}
        self._versions: dict[tuple, tuple[Message, str]] = {}
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

    def shape(self, key: tuple, make: Callable[[], tuple[Message, list[str]]]
              ) -> tuple[Message, list[str]]:
        """The prototype of ``key`` (and the problems found making it), made once."""
        found = self._shapes.get(key)
        if found is None:
            found = make()
            if len(self._shapes) >= self.limit // 10:
                self._shapes.pop(next(iter(self._shapes)))
            self._shapes[key] = found
        return found

    def shape_version(self, key: tuple, make: Callable[[], tuple[Message, list[str]]]
                      ) -> tuple[Message, str]:
        """The prototype of ``key`` and its content hash (:func:`version_of`), made once;
        what :func:`derived_version` starts from."""
        found = self._versions.get(key)
        if found is None:
            proto = self.shape(key, make)[0]
            found = (proto, version_of(proto))
            if len(self._versions) >= self.limit // 10:
                self._versions.pop(next(iter(self._versions)))
            self._versions[key] = found
        return found


def version_of(msg: Message) -> str:
    """Hex BLAKE2b-64 of the deterministic serialization (the workload types' rule)."""
    return hashlib.blake2b(msg.SerializeToString(deterministic=True), digest_size=8).hexdigest()


Versioned = dict[str, dict[str, tuple[str, Message]]]


class Assembler:
    """One waypoint's resources kept across builds, for one :class:`Options`: each bound
    service's parts are rebuilt only when :meth:`update` names the service as changed (or
    the waypoint-wide policies, the options, the trust domain changed), the versions
    (content hashes) are computed only for new messages, and ``main_internal`` is rebuilt
    only when a chain or an address range changed. An HTTPRoute change therefore costs
    its own service's route, whatever the number of services."""

    def __init__(self, opts: Options, cache: ParseCache):
        self.opts, self.cache = opts, cache
        self._parts: dict[str, _Parts] = {}
        self._out: Versioned = {t: {} for t in ENVOY_TYPES}
        self._fixed_key: tuple | None = None
        self._wide: str | None = None
        self._main_key: tuple | None = None
        self._backend_names: set[str] = set()
        self._with_problems: dict[str, list[str]] = {}
        self._handed: set[str] = set()

    def _writable(self, type_url: str) -> dict[str, tuple[str, Message]]:
        """``_out[type_url]``, copied first if a returned configuration holds it (streams
        read those on the event loop while the next build runs on the worker thread)."""
        if type_url in self._handed:
            self._handed.discard(type_url)
            self._out[type_url] = dict(self._out[type_url])
        return self._out[type_url]

    def _put(self, type_url: str, name: str, msg: Message, version: str | None = None) -> None:
        """Hold ``msg`` under ``name`` with ``version`` (None: its content hash)."""
        old = self._out[type_url].get(name)
        if old is not None and old[1] is msg:
            return
        self._writable(type_url)[name] = (version or version_of(msg), msg)

    def _drop(self, type_url: str, name: str) -> None:
        if name in self._out[type_url]:
            del self._writable(type_url)[name]

    def update(self, model: WaypointModel, changed: set[str] | None
               ) -> tuple[Versioned, list[str]]:
        """``({type URL: {name: (version, message)}}, problems)`` of ``model``;
        ``changed`` the service keys that may differ since the last call (None: any)."""
        with self.cache.lock:
            return self._update(model, changed)

    def _update(self, model: WaypointModel, changed: set[str] | None
                ) -> tuple[Versioned, list[str]]:
        opts, cache = self.opts, self.cache
        problems = list(model.problems)
        wide = repr([p.policy for p in model.policies if p.scope is None])
        fixed_key = (model.trust_domain, model.namespace, opts.bind, opts.xfcc, opts.access_log)
        if changed is None or wide != self._wide or fixed_key != self._fixed_key:
            changed = None
        if fixed_key != self._fixed_key:
            self._fixed_key = fixed_key
            for lst in (connect_terminate(model, opts), connect_originate_listener(opts)):
                self._put(LISTENER_TYPE, lst["name"], cache.parse(listener_pb2.Listener, lst))
            for item in (_static_internal(MAIN_INTERNAL, MAIN_INTERNAL),
                         _static_internal(ENCAP, CONNECT_ORIGINATE),
                         connect_originate_cluster(model)):
                self._put(CLUSTER_TYPE, item["name"], cache.parse(cluster_pb2.Cluster, item))
        self._wide = wide
        if changed is None:
            by_key = {s.key: s for s in model.services}
            todo = list(by_key) + [k for k in self._parts if k not in by_key]
        else:
            todo = sorted(changed)
            by_key = {s.key: s for s in _find(model.services, changed)}
        layout_changed = changed is None
        # a full build makes the chains and range entries in main_internal's own messages
        staged = (listener_pb2.Listener(), ip_pb2.IPMatcher()) if changed is None else None
        for key in todo:
            svc = by_key.get(key)
            old = self._parts.pop(key, None)
            held = {(t, n): (m, v) for t, n, m, v in old.resources} \
                if old is not None else {}
            self._with_problems.pop(key, None)
            part = _service_parts(model, opts, svc, cache, wide, staged) \
                if svc is not None else None
            if part is not None:
                self._parts[key] = part
                if part.problems:
                    self._with_problems[key] = part.problems
                for i, (type_url, name, msg, version) in enumerate(part.resources):
                    before = held.pop((type_url, name), None)
                    if before is not None and before[1] == version:  # unchanged: keep it
                        part.resources[i] = (type_url, name, *before)
                    else:
                        self._put(type_url, name, msg, version)
            for type_url, name in held:  # what the service no longer has
                self._drop(type_url, name)
            if part is None:
                layout_changed = layout_changed or old is not None
                continue
            if old is None or old.chains != part.chains or old.range != part.range:
                layout_changed = True
        main_key = (tuple(model.workload_ips), len(self._parts))
        if layout_changed or main_key != self._main_key:
            self._main_key = main_key
            parts = [self._parts[s.key] for s in model.services if s.key in self._parts]
            self._put(LISTENER_TYPE, MAIN_INTERNAL,
                      main_internal(model, opts, parts, cache, problems, staged))
        # the clusters of route backends that are not bound here (few: rebuilt each time,
        # kept when equal so their versions and objects stay)
        backends: dict[str, tuple[tuple[Message, str], tuple[Message, str]]] = {}
        for backend in model.backends.values():
            # only the ports the routes name (all when a reference names none), as istiod
            wanted = model.backend_ports.get(backend.key)
            for port in backend.ports:
                if wanted is not None and port.port not in wanted:
                    continue
                subset = backend_subset(port)
                name = cluster_name(subset, port.port, backend.hostname)
                if name in backends or (name not in self._backend_names
                                        and name in self._out[CLUSTER_TYPE]):
                    continue
                backends[name] = (_named_cluster_v(name, port, subset, cache),
                                  _endpoints_message_v(name, backend.endpoints.get(port.port,
                                                                                   ())))
        for name in self._backend_names - set(backends):
            self._drop(CLUSTER_TYPE, name)
            self._drop(ENDPOINT_TYPE, name)
        for name, pair in backends.items():
            for type_url, (msg, version) in zip((CLUSTER_TYPE, ENDPOINT_TYPE), pair):
                current = self._out[type_url].get(name)
                if current is None or current[0] != version:
                    self._put(type_url, name, msg, version)
        self._backend_names = set(backends)
        for found in self._with_problems.values():
            problems.extend(found)
        self._handed = set(self._out)
        return dict(self._out), list(dict.fromkeys(problems))


def _find(services: list[BoundService], keys: Iterable[str]) -> list[BoundService]:
    """The services of the key-sorted list ``services`` whose key is in ``keys``."""
    out = []
    for key in keys:
        i = bisect.bisect_left(services, key, key=lambda s: s.key)
        if i < len(services) and services[i].key == key:
            out.append(services[i])
    return out


def build(model: WaypointModel, opts: Options | None = None, cache: ParseCache | None = None
          ) -> tuple[dict[str, dict[str, Message]], list[str]]:
    """``({type URL: {name: message}}, problems)`` for LDS, CDS, EDS and RDS (secrets are
    the server's: they need the CA). Never raises for bad objects: they are problems.
    (One full build; :class:`Assembler` keeps the resources across changes.)"""
    built, problems = Assembler(opts or Options(), cache or ParseCache()).update(model, None)
    return {t: {n: m for n, (_v, m) in items.items()} for t, items in built.items()}, problems


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


