"""Parse ``ISTIO_PROMETHEUS_ANNOTATIONS``: the application metrics endpoints the status server merges.

A setting value parser of the core layer (``agent.core.config`` checks the value with it before
anything starts); the merge itself is ``agent.status.metrics_merge`` (docs/status.md).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

# Ports of the agent and Envoy: scraping them as an "application" would scrape ourselves.
RESERVED_PORTS = frozenset({15000, 15001, 15004, 15006, 15008, 15020, 15021, 15053, 15090})


class AnnotationsError(ValueError):
    """``ISTIO_PROMETHEUS_ANNOTATIONS`` is unusable; the message names the field and value."""


@dataclasses.dataclass(frozen=True)
class ScrapeTarget:
    """One application metrics endpoint: ``http://<host>:<port><path>``."""

    port: int
    path: str = "/metrics"


def _target_port(value: Any, status_port: int, where: str) -> int:
    """Ports compare numerically, so ``015020`` is the status port too (recursion guard)."""
    text = str(value).strip()
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise AnnotationsError(f"{where}.port={value!r}: must be an integer 1..65535")
    port = int(text)
    if port == status_port or port in RESERVED_PORTS:
        raise AnnotationsError(f"{where}.port={value!r}: port {port} is reserved for the "
                               "agent/Envoy and would scrape itself")
    return port


def parse_annotations(value: Any, status_port: int, given: bool = False) -> list[ScrapeTarget]:
    """Normalise ``ISTIO_PROMETHEUS_ANNOTATIONS`` (a JSON string or decoded object) to targets.

    ``given`` says the variable was set (a set-but-empty value is an error).
    Returns [] when app scraping is off (unset, or ``scrape == "false"``). With no
    ``targets`` one target is synthesised from ``port`` (default 80) and ``path``
    (default ``/metrics``). Upstream quirk decided deliberately: when ``targets`` is given
    the targets are scraped, never a differing legacy top-level port. Raises
    :class:`AnnotationsError`.
    """
    if value is None or value == "":
        if given:
            raise AnnotationsError("value is empty: expected a JSON object such as "
                                   '{"scrape":"true","port":"8080","path":"/metrics"}')
        return []
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise AnnotationsError(f"failed to decode JSON: {e}") from None
    if not isinstance(value, dict):
        raise AnnotationsError(f"expected a JSON object, got {type(value).__name__}")
    if str(value.get("scrape", "true")).strip().lower() == "false":
        return []
    raw_targets = value.get("targets")
    if raw_targets in (None, []):
        raw_targets = [{"port": value.get("port") or "80", "path": value.get("path") or ""}]
    if not isinstance(raw_targets, list):
        raise AnnotationsError(f"targets={raw_targets!r}: must be a list of {{port, path}}")
    targets = []
    for i, t in enumerate(raw_targets):
        where = f"targets[{i}]"
        if not isinstance(t, dict):
            raise AnnotationsError(f"{where}={t!r}: must be an object with port and path")
        path = str(t.get("path") or "/metrics")
        if not path.startswith("/"):
            path = "/" + path
        targets.append(ScrapeTarget(_target_port(t.get("port"), status_port, where), path))
    return targets
