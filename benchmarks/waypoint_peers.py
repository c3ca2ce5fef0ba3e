"""Hand-written Envoy bootstraps for the waypoint throughput row of ``bench_waypoint``.

Three Envoys besides the waypoint under test, all on unique loopback addresses:
- :func:`originator`: the source ztunnel's outbound part. A plaintext HTTP/1.1 listener
  (what ``wrk`` hits) routes to a TCP listener whose TCP proxy opens one HBONE tunnel per
  upstream connection: HTTP/2 ``CONNECT`` with ``:authority`` = the service ``VIP:port``,
  over mTLS with a SPIFFE client certificate from our CA, to the waypoint's 15008.
- :func:`destination`: the destination ztunnel's inbound part plus the app. TLS on
  ``<pod IP>:15008`` requiring a mesh client certificate, HTTP/2 ``CONNECT`` terminated
  into a TCP connection to ``<pod IP>:8080``, where a second listener answers every
  request with a direct 200 (the fastest app Envoy can be).
- :func:`static_waypoint`: the waypoint's chain written by hand as a static bootstrap
  (see its docstring), the reference the agent-configured waypoint is compared with.

Certificates and keys are files under the benchmark's temporary directory (0600).
"""

from __future__ import annotations

from typing import Any

_HCM = ("type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
        "HttpConnectionManager")
_TCP = "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_DTLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext"
_UTLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
_HTTP_OPTS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def addr(ip: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": ip, "port_value": port}}


def admin(port: int) -> dict[str, Any]:
    return {"address": addr("127.0.0.1", port)}


def tls_common(cert: str, key: str, ca: str) -> dict[str, Any]:
    """mTLS 1.3 only, ALPN h2, certificate chain/key/root from files."""
    return {"tls_params": {"tls_minimum_protocol_version": "TLSv1_3",
                           "tls_maximum_protocol_version": "TLSv1_3"},
            "alpn_protocols": ["h2"],
            "tls_certificates": [{"certificate_chain": {"filename": cert},
                                  "private_key": {"filename": key}}],
            "validation_context": {"trusted_ca": {"filename": ca}}}


def downstream_tls(cert: str, key: str, ca: str) -> dict[str, Any]:
    return {"name": "tls", "typed_config": {
        "@type": _DTLS, "require_client_certificate": True,
        "common_tls_context": tls_common(cert, key, ca)}}


def upstream_tls(cert: str, key: str, ca: str, san: str = "") -> dict[str, Any]:
    common = tls_common(cert, key, ca)
    if san:
        common["validation_context"]["match_typed_subject_alt_names"] = [
            {"san_type": "URI", "matcher": {"exact": san}}]
    return {"name": "tls", "typed_config": {"@type": _UTLS, "common_tls_context": common}}


def h2_options() -> dict[str, Any]:
    return {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": _HTTP_OPTS, "explicit_http_config": {"http2_protocol_options": {}}}}


def static_cluster(name: str, ip: str, port: int, **extra: Any) -> dict[str, Any]:
    return {"name": name, "type": "STATIC", "connect_timeout": "2s",
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": addr(ip, port)}}]}]}, **extra}


def originator(ip: str, paths: dict[str, tuple[int, int, tuple[str, int], str]],
               cert: str, key: str, ca: str, admin_port: int) -> dict[str, Any]:
    """One originator Envoy for several paths: ``paths[name] = (front port, tunnel port,
    (HBONE target IP, port), CONNECT authority)``; ``http://ip:front/`` -> HBONE
    ``CONNECT authority`` to the target."""
    listeners, clusters = [], []
    for name, (front_port, tunnel_port, target, authority) in paths.items():
        listeners.append({
            "name": f"front_{name}", "address": addr(ip, front_port),
            "filter_chains": [{"filters": [{"name": "hcm", "typed_config": {
                "@type": _HCM, "stat_prefix": f"front_{name}",
                "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"],
                                                    "routes": [
                    {"match": {"prefix": "/"}, "route": {"cluster": f"tunnel_{name}"}}]}]},
                "http_filters": [{"name": "router", "typed_config": {"@type": _ROUTER}}]}}]}]})
        listeners.append({
            "name": f"tunnel_{name}", "address": addr(ip, tunnel_port),
            "filter_chains": [{"filters": [{"name": "tcp", "typed_config": {
                "@type": _TCP, "stat_prefix": f"hbone_{name}", "cluster": f"hbone_{name}",
                "tunneling_config": {"hostname": authority}}}]}]})
        clusters.append(static_cluster(f"tunnel_{name}", ip, tunnel_port))
        clusters.append(static_cluster(f"hbone_{name}", *target,
                                       typed_extension_protocol_options=h2_options(),
                                       transport_socket=upstream_tls(cert, key, ca)))
    return {"admin": admin(admin_port),
            "static_resources": {"listeners": listeners, "clusters": clusters}}


def destination(pod_ip: str, cert: str, key: str, ca: str, admin_port: int,
                app_port: int = 8080) -> dict[str, Any]:
    """HBONE terminator on ``pod_ip:15008`` in front of a direct-response app."""
    inbound = {"name": "hbone_in", "address": addr(pod_ip, 15008), "filter_chains": [{
        "transport_socket": downstream_tls(cert, key, ca),
        "filters": [{"name": "hcm", "typed_config": {
            "@type": _HCM, "stat_prefix": "hbone_in", "codec_type": "HTTP2",
            "http2_protocol_options": {"allow_connect": True},
            "upgrade_configs": [{"upgrade_type": "CONNECT"}],
            "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
                {"match": {"connect_matcher": {}},
                 "route": {"cluster": "app",
                           "upgrade_configs": [{"upgrade_type": "CONNECT",
                                                "connect_config": {}}]}}]}]},
            "http_filters": [{"name": "router", "typed_config": {"@type": _ROUTER}}]}}]}]}
    app = {"name": "app", "address": addr(pod_ip, app_port), "filter_chains": [{"filters": [{
        "name": "hcm", "typed_config": {
            "@type": _HCM, "stat_prefix": "app",
            "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
                {"match": {"prefix": "/"},
                 "direct_response": {"status": 200, "body": {"inline_string": "ok\n"}}}]}]},
            "http_filters": [{"name": "router", "typed_config": {"@type": _ROUTER}}]}}]}]}
    return {"admin": admin(admin_port),
            "static_resources": {"listeners": [inbound, app],
                                 "clusters": [static_cluster("app", pod_ip, app_port)]}}


_SFS_HTTP = "type.googleapis.com/envoy.extensions.filters.http.set_filter_state.v3.Config"
_RBAC = "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC"
_ODST = "type.googleapis.com/envoy.extensions.filters.listener.original_dst.v3.OriginalDst"
_INTERNAL_UP = ("type.googleapis.com/envoy.extensions.transport_sockets.internal_upstream.v3."
                "InternalUpstreamTransport")
_RAW = "type.googleapis.com/envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer"
_ODST_KEY = "envoy.filters.listener.original_dst"


def _internal_upstream(passthrough: bool = False) -> dict[str, Any]:
    cfg: dict[str, Any] = {"@type": _INTERNAL_UP, "transport_socket": {
        "name": "raw", "typed_config": {"@type": _RAW}}}
    if passthrough:  # the endpoint's original-destination metadata rides into the listener
        cfg["passthrough_metadata"] = [{"kind": {"host": {}}, "name": _ODST_KEY}]
    return {"name": "internal_upstream", "typed_config": cfg}


def _filter_state(key: str, value: str) -> dict[str, Any]:
    entry: dict[str, Any] = {"object_key": key, "shared_with_upstream": "ONCE",
                             "format_string": {"text_format_source": {"inline_string": value}}}
    if key.startswith("io.istio."):
        entry["factory_key"] = "envoy.string"
    return entry


def static_waypoint(wp_ip: str, vip: str, pod_ip: str, cert: str, key: str, ca: str,
                    admin_port: int, *, client_principal: str, server_san: str,
                    service_port: int = 80, target_port: int = 8080) -> dict[str, Any]:
    """The waypoint's chain for one HTTP service, written by hand as a static bootstrap.

    The same chain the agent's xDS gives the waypoint (``ambient.waypoint.resources``):
    ``connect_terminate`` (TLS 1.3 with the waypoint's certificate, client certificate
    from the mesh root required; HTTP/2 CONNECT; the ``:authority`` and the peer's URI SAN
    kept as filter state) -> internal listener ``main_internal`` (original destination
    from that filter state; the service's ``VIP:port`` picks its filter chain: HTTP
    connection manager with the RBAC filter allowing ``client_principal`` GET on any
    path, route with the same retry policy) -> a cluster whose one endpoint is the pod,
    reached through internal listener ``connect_originate`` (TCP proxy opening HBONE to
    ``pod:15008`` over mTLS, the server's SAN checked). Left out: what this request never
    touches (the fallback chains for unmatched destinations), the filter state only
    telemetry reads (authority, remote address, local principal), access log and stats
    tags, and what is dynamic there (SDS, EDS, RDS; files and inline resources here).
    """
    terminate = {
        "name": "connect_terminate", "address": addr(wp_ip, 15008),
        "filter_chains": [{
            "transport_socket": downstream_tls(cert, key, ca),
            "filters": [{"name": "hcm", "typed_config": {
                "@type": _HCM, "stat_prefix": "connect_terminate", "codec_type": "HTTP2",
                "http2_protocol_options": {"allow_connect": True,
                                           "max_concurrent_streams": 100},
                "upgrade_configs": [{"upgrade_type": "CONNECT"}],
                "stream_idle_timeout": "0s",
                # the app sees the caller's identity, as through the agent's config
                "forward_client_cert_details": "APPEND_FORWARD",
                "set_current_client_cert_details": {"subject": True, "dns": True, "uri": True},
                "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
                    {"match": {"connect_matcher": {}},
                     "route": {"cluster": "main_internal",
                               "upgrade_configs": [{"upgrade_type": "CONNECT",
                                                    "connect_config": {}}]}}]}]},
                "http_filters": [
                    {"name": "authority", "typed_config": {"@type": _SFS_HTTP,
                                                           "on_request_headers": [
                        _filter_state(f"{_ODST_KEY}.local_ip", "%REQ(:AUTHORITY)%"),
                        _filter_state("io.istio.peer_principal",
                                      "%DOWNSTREAM_PEER_URI_SAN%")]}},
                    {"name": "router", "typed_config": {"@type": _ROUTER}}]}}]}]}
    service_chain = {
        "name": "service", "filter_chain_match": {
            "prefix_ranges": [{"address_prefix": vip, "prefix_len": 32}],
            "destination_port": service_port},
        "filters": [{"name": "hcm", "typed_config": {
            "@type": _HCM, "stat_prefix": "service", "stream_idle_timeout": "0s",
            "normalize_path": True, "merge_slashes": True,
            "route_config": {"virtual_hosts": [{"name": "svc", "domains": ["*"], "routes": [
                {"match": {"prefix": "/"},
                 "route": {"cluster": "service", "timeout": "0s", "retry_policy": {
                     "retry_on": "connect-failure,refused-stream,unavailable,cancelled,"
                                 "retriable-status-codes", "num_retries": 2}}}]}]},
            "http_filters": [
                {"name": "rbac", "typed_config": {"@type": _RBAC, "rules": {"policies": {
                    "allow-client": {
                        "permissions": [{"and_rules": {"rules": [
                            {"header": {"name": ":method", "string_match": {"exact": "GET"}}},
                            {"url_path": {"path": {"prefix": "/"}}}]}}],
                        "principals": [{"filter_state": {
                            "key": "io.istio.peer_principal",
                            "string_match": {"exact": f"spiffe://{client_principal}"}}}]}}}}},
                {"name": "router", "typed_config": {"@type": _ROUTER}}]}}]}
    main_internal = {"name": "main_internal", "internal_listener": {},
                     "listener_filters": [{"name": "odst", "typed_config": {"@type": _ODST}}],
                     "filter_chains": [service_chain]}
    originate = {"name": "connect_originate", "internal_listener": {},
                 "listener_filters": [{"name": "odst", "typed_config": {"@type": _ODST}}],
                 "filter_chains": [{"filters": [{"name": "tcp", "typed_config": {
                     "@type": _TCP, "stat_prefix": "connect_originate",
                     "cluster": "connect_originate",
                     "tunneling_config": {"hostname": "%DOWNSTREAM_LOCAL_ADDRESS%"}}}]}]}
    internal_ep = {"cluster_name": "main_internal", "endpoints": [{"lb_endpoints": [{
        "endpoint": {"address": {"envoy_internal_address": {
            "server_listener_name": "main_internal"}}}}]}]}
    service_ep = {"cluster_name": "service", "endpoints": [{"lb_endpoints": [{
        "endpoint": {"address": {"envoy_internal_address": {
            "server_listener_name": "connect_originate",
            "endpoint_id": f"{pod_ip}:{target_port}"}}},
        "metadata": {"filter_metadata": {_ODST_KEY: {"local": f"{pod_ip}:{target_port}"}}}}]}]}
    clusters = [
        {"name": "main_internal", "type": "STATIC", "load_assignment": internal_ep,
         "transport_socket": _internal_upstream()},
        {"name": "service", "type": "STATIC", "lb_policy": "LEAST_REQUEST",
         "load_assignment": service_ep, "transport_socket": _internal_upstream(True)},
        {"name": "connect_originate", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
         "connect_timeout": "10s",
         # the pod's address, restored by connect_originate's original_dst filter
         "original_dst_lb_config": {"upstream_port_override": 15008},
         "typed_extension_protocol_options": {
             "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                 "@type": _HTTP_OPTS,
                 "explicit_http_config": {"http2_protocol_options": {"allow_connect": True}}}},
         "transport_socket": upstream_tls(cert, key, ca, server_san)},
    ]
    return {
        "admin": admin(admin_port),
        "bootstrap_extensions": [{"name": "envoy.bootstrap.internal_listener", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3."
                     "InternalListener", "buffer_size_kb": 64}}],
        "static_resources": {"listeners": [terminate, main_internal, originate],
                             "clusters": clusters}}
