"""Parse ``ISTIO_KUBE_APP_PROBERS``: the kubelet probes the injector rewrote to the status port.

A setting value parser of the core layer (``agent.core.config`` checks the value with it before
anything starts); the status server (``agent.status.probes``) runs the parsed probes. The
rules and messages follow upstream's ``pkg/istio-agent/health`` (docs/status.md).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Mapping

PATH_RE = re.compile(r"^/(app-health|app-lifecycle)/[^/]+/(livez|readyz|startupz|prestopz|poststartz)$")


class ProberConfigError(ValueError):
    """An ``ISTIO_KUBE_APP_PROBERS`` entry is invalid; the message names the path and field."""


@dataclasses.dataclass(frozen=True)
class AppProbe:
    """One rewritten probe.

    ``kind`` is ``"httpGet"``, ``"tcpSocket"`` or ``"grpc"``; ``port`` the app port;
    ``path`` (httpGet, always starting with ``/``), ``scheme`` (``"http"``/``"https"``),
    ``service`` (grpc; "" = overall health); ``timeout`` seconds (0 = not given).
    """

    kind: str
    port: int
    path: str = "/"
    scheme: str = "http"
    service: str = ""
    timeout: float = 0.0


def _lower_keys(obj: Mapping[str, Any]) -> dict[str, Any]:
    """Go decodes this JSON case-insensitively (``gRPC``, ``HttpGet``); normalise to lower case."""
    return {str(k).lower(): v for k, v in obj.items()}


def _int_port(path: str, kind: str, action: Mapping[str, Any]) -> int:
    port = action.get("port")
    if isinstance(port, bool) or not isinstance(port, int):
        raise ProberConfigError(f"invalid prober config for {path}: {kind}.port={port!r}: "
                                "the port must be int type")
    if not 1 <= port <= 65535:
        raise ProberConfigError(f"invalid prober config for {path}: {kind}.port={port}: "
                                "must be between 1 and 65535")
    return port


def _timeout(path: str, entry: Mapping[str, Any]) -> float:
    value = entry.get("timeoutseconds", 0)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ProberConfigError(f"invalid prober config for {path}: timeoutSeconds={value!r}: "
                                "must be a non-negative number")
    return float(value)


def parse_probe(path: str, entry: Any) -> AppProbe:
    """Validate one ``path -> prober`` entry. Raises :class:`ProberConfigError`."""
    if not PATH_RE.match(path):
        raise ProberConfigError(f"invalid path {path!r}: must match {PATH_RE.pattern}")
    if not isinstance(entry, dict):
        raise ProberConfigError(f"invalid prober config for {path}: expected an object, "
                                f"got {type(entry).__name__}")
    entry = _lower_keys(entry)
    kinds = [k for k in ("httpget", "tcpsocket", "grpc") if entry.get(k) is not None]
    if len(kinds) != 1:
        raise ProberConfigError(f"invalid prober config for {path}: invalid prober type, must be "
                                "one of type httpGet, tcpSocket or gRPC")
    kind, timeout = kinds[0], _timeout(path, entry)
    action = entry[kind]
    if not isinstance(action, dict):
        raise ProberConfigError(f"invalid prober config for {path}: {kind} must be an object")
    action = _lower_keys(action)
    if kind == "httpget":
        port = _int_port(path, "httpGet", action)
        probe_path = action.get("path") or "/"
        if not isinstance(probe_path, str):
            raise ProberConfigError(f"invalid prober config for {path}: httpGet.path="
                                    f"{probe_path!r}: must be a string")
        if not probe_path.startswith("/"):
            probe_path = "/" + probe_path
        scheme = "https" if action.get("scheme") == "HTTPS" else "http"
        return AppProbe("httpGet", port, path=probe_path, scheme=scheme, timeout=timeout)
    if kind == "tcpsocket":
        return AppProbe("tcpSocket", _int_port(path, "tcpSocket", action), timeout=timeout)
    grpc_port = action.get("port")
    if isinstance(grpc_port, bool) or not isinstance(grpc_port, int) or not 1 <= grpc_port <= 65535:
        raise ProberConfigError(f"invalid prober config for {path}: grpc.port={grpc_port!r}: "
                                "must be an integer 1..65535")
    service = action.get("service") or ""
    if not isinstance(service, str):
        raise ProberConfigError(f"invalid prober config for {path}: grpc.service={service!r}: "
                                "must be a string or null")
    return AppProbe("grpc", grpc_port, service=service, timeout=timeout)


def parse_probers(value: Any) -> dict[str, AppProbe]:
    """Parse the ``ISTIO_KUBE_APP_PROBERS`` value (a JSON string or already-decoded object).

    Returns ``{rewritten path: AppProbe}``; None or ``""`` → no probes. Raises
    :class:`ProberConfigError` (``failed to decode ...``, ``invalid path ...``,
    ``invalid prober type ...``, ``... must be int type``), the messages upstream's
    ``pkg/istio-agent/health`` gives.
    """
    if value is None or value == "":
        return {}
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ProberConfigError(f"failed to decode app prober config: {e}") from None
    if not isinstance(value, dict):
        raise ProberConfigError("failed to decode app prober config: expected a JSON object "
                                f"of path -> prober, got {type(value).__name__}")
    return {path: parse_probe(path, entry) for path, entry in value.items()}
