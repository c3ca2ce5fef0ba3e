"""The bootstrap a waypoint Envoy starts with (``ambient-agent waypoint bootstrap``).

The node is what ``pilot-agent proxy waypoint`` sends istiod, so a stock Istio waypoint
pod and a bare Envoy look the same to the agent: id
``waypoint~<IP>~<pod>.<ns>~<ns>.svc.<domain>``, metadata ``NAMESPACE``, ``NAME``,
``CLUSTER_ID``, ``SERVICE_ACCOUNT``, ``WORKLOAD_NAME``, ``ISTIO_VERSION``, ``LABELS``
(with ``gateway.networking.k8s.io/gateway-name`` and ``gateway.istio.io/managed``) and
``PROXY_CONFIG``; everything else comes over ADS from the ``xds-grpc`` cluster (the
agent's xDS port; TLS with the mesh root and a bearer token on the TLS port). The
``envoy.bootstrap.internal_listener`` extension is on (the ``main_internal`` and
``connect_originate`` listeners are internal), admin on a local port.

Stats: the ``stats_tags`` of Istio's proxy bootstrap (``use_all_default_tags`` off), so
the ``;``-delimited stat prefixes istiod configures (``inbound_0.0.0.0_<port>;`` for the
HTTP chains, ``<cluster>;`` alt stat names) become the same Prometheus labels
(``http_conn_manager_prefix``, ``cluster_name``, ``response_code`` ...) as on an Istio
waypoint. Istio's inclusion list (only ``reporter=`` and a few prefixes) is not applied:
its ``istio_requests_total`` family comes from the ``istio.stats`` filter, an Istio
proxy extension a stock Envoy does not have, so the per-chain Envoy stats stay visible.
"""

from __future__ import annotations

import dataclasses
from typing import Any

MANAGED_LABEL = "gateway.istio.io/managed"
GATEWAY_NAME_LABEL = "gateway.networking.k8s.io/gateway-name"
ISTIO_VERSION = "1.29.0"


#: Istio's proxy bootstrap ``stats_config.stats_tags`` (the fixed ones, in its order)
STATS_TAGS: list[dict[str, str]] = [
    {"tag_name": "cluster_name", "regex": "^cluster(\\.(.+);)"},
    {"tag_name": "http_conn_manager_prefix",
     "regex": "^http\\.(((?:[_.[:digit:]\\w]*|[_\\[\\]aAbBcCdDeEfF[:digit:]\\w\\:]*));\\.)"},
    {"tag_name": "thread_name", "regex": "^server(\\.(.+))\\.watchdog"},
    {"tag_name": "tcp_prefix", "regex": "^tcp\\.((.*?)\\.)\\w+?$"},
    {"tag_name": "response_code", "regex": "_rq(_(\\d{3}))$"},
    {"tag_name": "response_code_class", "regex": "_rq(_(\\dxx))$"},
    {"tag_name": "http_conn_manager_listener_prefix",
     "regex": "^listener(?=\\.).*?\\.http\\.(((?:[_.[:digit:]]*|[_\\[\\]aAbBcCdDeEfF[:digit:]]*))\\.)"},
    {"tag_name": "listener_address",
     "regex": "^listener\\.(((?:[_.[:digit:]]*|[_\\[\\]aAbBcCdDeEfF[:digit:]]*))\\.)"},
    {"tag_name": "mongo_prefix",
     "regex": "^mongo\\.(.+?)\\.(collection|cmd|cx_|op_|delays_|decoding_)(.*?)$"},
    {"tag_name": "cache", "regex": "(cache\\.(.+?)\\.)"},
    {"tag_name": "component", "regex": "(component\\.(.+?)\\.)"},
    {"tag_name": "tag", "regex": "(tag\\.(.+?);\\.)"},
    {"tag_name": "wasm_filter", "regex": "(wasm_filter\\.(.+?)\\.)"},
    {"tag_name": "authz_enforce_result", "regex": "rbac(\\.(allowed|denied))"},
    {"tag_name": "authz_dry_run_action", "regex": "(\\.istio_dry_run_(allow|deny)_)"},
    {"tag_name": "authz_dry_run_result", "regex": "(\\.shadow_(allowed|denied))"},
]


@dataclasses.dataclass
class BootstrapOptions:
    """``namespace``/``gateway``: the Gateway served; ``xds_host``/``xds_port``: the
    agent; ``ca_pem``: the mesh root (TLS port; empty = plaintext); ``token``: bearer token
    sent on the TLS port (also accepted on the plaintext port's ``xds_token_file``);
    ``server_name``: the SNI / name checked in the agent's certificate."""

    namespace: str
    gateway: str
    xds_host: str = "127.0.0.1"
    xds_port: int = 15010
    ca_pem: str = ""
    token: str = ""
    server_name: str = "istiod.istio-system.svc"
    admin_port: int = 15000
    node_ip: str = "127.0.0.1"
    pod_name: str = ""
    service_account: str = ""
    cluster_id: str = "Kubernetes"
    domain: str = "cluster.local"
    hbone_bind: str = ""
    delta: bool = True


def bootstrap(o: BootstrapOptions) -> dict[str, Any]:
    """The bootstrap as a JSON-ready dict."""
    pod = o.pod_name or f"{o.gateway}-0"
    labels = {GATEWAY_NAME_LABEL: o.gateway, MANAGED_LABEL: "istio.io-mesh-controller",
              "istio.io/dataplane-mode": "none"}
    metadata: dict[str, Any] = {
        "NAMESPACE": o.namespace, "NAME": pod, "CLUSTER_ID": o.cluster_id,
        "SERVICE_ACCOUNT": o.service_account or o.gateway, "WORKLOAD_NAME": o.gateway,
        "ISTIO_VERSION": ISTIO_VERSION, "LABELS": labels, "INSTANCE_IPS": o.node_ip,
        "PROXY_CONFIG": {"proxyMetadata": {}},
    }
    if o.hbone_bind:
        metadata["AMBIENT_HBONE_BIND_ADDRESS"] = o.hbone_bind
    grpc_service: dict[str, Any] = {"envoy_grpc": {"cluster_name": "xds-grpc"}}
    if o.token:
        grpc_service["initial_metadata"] = [{"key": "authorization",
                                             "value": f"Bearer {o.token}"}]
    xds_cluster: dict[str, Any] = {
        "name": "xds-grpc", "type": "STRICT_DNS", "connect_timeout": "1s",
        "dns_lookup_family": "V4_PREFERRED",
        "load_assignment": {"cluster_name": "xds-grpc", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": o.xds_host,
                                                         "port_value": o.xds_port}}}}]}]},
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3."
                         "HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {
                    "connection_keepalive": {"interval": "30s", "timeout": "10s"}}}}},
    }
    if o.ca_pem:
        xds_cluster["transport_socket"] = {"name": "envoy.transport_sockets.tls", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."
                     "UpstreamTlsContext",
            "sni": o.server_name,
            "common_tls_context": {"alpn_protocols": ["h2"], "validation_context": {
                "trusted_ca": {"inline_string": o.ca_pem},
                "match_typed_subject_alt_names": [
                    {"san_type": "DNS", "matcher": {"exact": o.server_name}}]}}}}
    ads = {"api_type": "DELTA_GRPC" if o.delta else "GRPC", "transport_api_version": "V3",
           "set_node_on_first_message_only": True, "grpc_services": [grpc_service]}
    dyn = {"ads": {}, "resource_api_version": "V3", "initial_fetch_timeout": "0s"}
    return {
        "node": {"id": f"waypoint~{o.node_ip}~{pod}.{o.namespace}~{o.namespace}.svc.{o.domain}",
                 "cluster": f"{o.gateway}.{o.namespace}", "metadata": metadata},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1",
                                                 "port_value": o.admin_port}}},
        "bootstrap_extensions": [{
            "name": "envoy.bootstrap.internal_listener",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.bootstrap."
                                      "internal_listener.v3.InternalListener",
                             "buffer_size_kb": 64}}],
        "dynamic_resources": {"ads_config": ads, "lds_config": dyn, "cds_config": dyn},
        "stats_config": {"use_all_default_tags": False,
                         "stats_tags": [dict(t) for t in STATS_TAGS]},
        "static_resources": {"clusters": [xds_cluster]},
        "layered_runtime": {"layers": [{"name": "global", "static_layer": {
            "envoy.reloadable_features.http_reject_path_with_fragment": False,
            "overload.global_downstream_max_connections": 2147483647}}]},
    }
