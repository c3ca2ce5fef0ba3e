"""The light half of the waypoint configuration: the Envoy type URLs a waypoint stream
serves, the per-proxy :class:`Options` and the :class:`AccessLog` settings, with no
Envoy message types imported. The xDS server imports this at start; the resources
(``ambient.waypoint.resources``, ~0.1-0.2 s of Envoy protobuf imports) load with the
first waypoint stream (issue 28: they are not on a cold start's path to its first
Address push). ``resources`` re-exports every name here."""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import Any

LISTENER_TYPE = "type.googleapis.com/envoy.config.listener.v3.Listener"
CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
ROUTE_TYPE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
SECRET_TYPE = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
ENVOY_TYPES = (CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE, SECRET_TYPE)

XFCC_ANNOTATION = "ambient.istio.io/xfcc-include-client-identity"

TYPE_URL_PREFIX = "type.googleapis.com/"


@dataclasses.dataclass
class Options:
    """Per-proxy choices: ``bind`` the address ``connect_terminate`` listens on (istiod:
    the wildcard), ``xfcc`` whether the HTTP chains add ``x-forwarded-client-cert`` with
    the caller's identity (the ``ambient.istio.io/xfcc-include-client-identity`` annotation)."""

    bind: str = "0.0.0.0"
    xfcc: bool = False
    access_log: "AccessLog | None" = None


#: istiod's default text access-log format (``EnvoyTextLogFormat``, Istio 1.9 onwards)
DEFAULT_ACCESS_LOG_FORMAT = (
    '[%START_TIME%] "%REQ(:METHOD)% %REQ(X-ENVOY-ORIGINAL-PATH?:PATH)% %PROTOCOL%" '
    '%RESPONSE_CODE% %RESPONSE_FLAGS% %RESPONSE_CODE_DETAILS% '
    '%CONNECTION_TERMINATION_DETAILS% "%UPSTREAM_TRANSPORT_FAILURE_REASON%" '
    '%BYTES_RECEIVED% %BYTES_SENT% %DURATION% %RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)% '
    '"%REQ(X-FORWARDED-FOR)%" "%REQ(USER-AGENT)%" "%REQ(X-REQUEST-ID)%" '
    '"%REQ(:AUTHORITY)%" "%UPSTREAM_HOST%" %UPSTREAM_CLUSTER_RAW% %UPSTREAM_LOCAL_ADDRESS% '
    '%DOWNSTREAM_LOCAL_ADDRESS% %DOWNSTREAM_REMOTE_ADDRESS% %REQUESTED_SERVER_NAME% '
    '%ROUTE_NAME%\n')

#: istiod's default JSON access-log fields (``EnvoyJSONLogFormatIstio``)
DEFAULT_ACCESS_LOG_JSON = {
    "start_time": "%START_TIME%", "route_name": "%ROUTE_NAME%", "method": "%REQ(:METHOD)%",
    "path": "%REQ(X-ENVOY-ORIGINAL-PATH?:PATH)%", "protocol": "%PROTOCOL%",
    "response_code": "%RESPONSE_CODE%", "response_flags": "%RESPONSE_FLAGS%",
    "response_code_details": "%RESPONSE_CODE_DETAILS%",
    "connection_termination_details": "%CONNECTION_TERMINATION_DETAILS%",
    "bytes_received": "%BYTES_RECEIVED%", "bytes_sent": "%BYTES_SENT%",
    "duration": "%DURATION%", "upstream_service_time": "%RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)%",
    "x_forwarded_for": "%REQ(X-FORWARDED-FOR)%", "user_agent": "%REQ(USER-AGENT)%",
    "request_id": "%REQ(X-REQUEST-ID)%", "authority": "%REQ(:AUTHORITY)%",
    "upstream_host": "%UPSTREAM_HOST%", "upstream_cluster": "%UPSTREAM_CLUSTER_RAW%",
    "upstream_local_address": "%UPSTREAM_LOCAL_ADDRESS%",
    "downstream_local_address": "%DOWNSTREAM_LOCAL_ADDRESS%",
    "downstream_remote_address": "%DOWNSTREAM_REMOTE_ADDRESS%",
    "requested_server_name": "%REQUESTED_SERVER_NAME%",
    "upstream_transport_failure_reason": "%UPSTREAM_TRANSPORT_FAILURE_REASON%",
}


@dataclasses.dataclass(frozen=True)
class AccessLog:
    """The file access log istiod configures from meshConfig when no Telemetry resource
    applies: ``path`` (meshConfig ``accessLogFile``; empty: no access log, istiod's
    default), ``encoding`` ``TEXT`` or ``JSON`` (``accessLogEncoding``), ``format``
    (``accessLogFormat``: the text format, a newline added when missing, or a JSON object
    of field -> command; empty: istiod's default of that encoding).

    Where (as ``buildWaypointInbound`` does): every HTTP connection manager and TCP proxy of
    ``main_internal``'s chains, unfiltered; ``connect_terminate``'s HTTP connection manager
    for responses >= 400; ``connect_originate``'s TCP proxy for upstream connect failures
    (``UF``); each listener for connections no chain matched (``NR``).
    Raises ``ValueError`` naming the field for an unknown encoding or a JSON format that
    is not a JSON object of strings."""

    path: str = ""
    encoding: str = "TEXT"
    format: str = ""

    def __post_init__(self) -> None:
        if self.encoding.upper() not in ("TEXT", "JSON"):
            raise ValueError(f"access log encoding {self.encoding!r}: expected TEXT or JSON")
        if self.encoding.upper() == "JSON" and self.format:
            import json

            try:
                value = json.loads(self.format)
            except ValueError as e:
                raise ValueError(f"access log format (JSON encoding): not JSON: {e}") from None
            if not isinstance(value, dict) or not all(isinstance(v, str)
                                                      for v in value.values()):
                raise ValueError("access log format (JSON encoding): expected a JSON object "
                                 "of field name -> format command strings")

    def entries(self, flt: dict | None = None) -> list[dict]:
        """The ``access_log`` entries (``[]`` when off), with the AccessLogFilter ``flt``."""
        if not self.path:
            return []
        cfg: dict[str, Any] = {"path": self.path}
        if self.encoding.upper() == "JSON":
            import json

            fields = json.loads(self.format) if self.format else DEFAULT_ACCESS_LOG_JSON
            cfg["log_format"] = {"json_format": fields,
                                 "json_format_options": {"sort_properties": False}}
        else:
            text = self.format or DEFAULT_ACCESS_LOG_FORMAT
            if not text.endswith("\n"):
                text += "\n"
            cfg["log_format"] = {"text_format_source": {"inline_string": text}}
            if "%REQ_WITHOUT_QUERY" in text:
                cfg["log_format"]["formatters"] = [{
                    "name": "envoy.formatter.req_without_query", "typed_config": any_of(
                        "envoy.extensions.formatter.req_without_query.v3.ReqWithoutQuery")}]
        out: dict[str, Any] = {"name": "envoy.access_loggers.file", "typed_config": any_of(
            "envoy.extensions.access_loggers.file.v3.FileAccessLog", **cfg)}
        if flt is not None:
            out["filter"] = flt
        return [out]


def any_of(type_name: str, **fields: Any) -> dict:
    """A protobuf-JSON ``Any``: ``{"@type": type URL of ``type_name``, **fields}``."""
    return {"@type": TYPE_URL_PREFIX + type_name, **fields}


def valid_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False
