"""Small, defensive accessors for Kubernetes-shaped dicts and the shared mesh settings.

Translation code reads objects only through these helpers so a wrong type in one field
(``labels: 3``, ``ports: "80"``) becomes :class:`TranslateError` naming the field, never
an AttributeError deep in the index.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
from typing import Any


class TranslateError(ValueError):
    """An object can't be translated; the message names the field and the value."""


@dataclasses.dataclass(frozen=True)
class Mesh:
    """Global inputs of the mapping rules (``docs/ambient.md``).

    ``network`` is the configured network; the index overrides it with the system
    namespace's ``topology.istio.io/network`` label when present.
    """

    cluster_id: str = "Kubernetes"
    domain_suffix: str = "cluster.local"
    root_namespace: str = "istio-system"
    trust_domain: str = "cluster.local"
    network: str = ""

    @property
    def sent_trust_domain(self) -> str:
        """``Workload.trust_domain``: elided when it is ``cluster.local``."""
        return "" if self.trust_domain == "cluster.local" else self.trust_domain


def meta(obj: dict) -> dict:
    return obj.get("metadata") or {}


def labels(obj: dict) -> dict[str, str]:
    return meta(obj).get("labels") or {}


def annotations_of(obj: dict) -> dict[str, str]:
    """``metadata.annotations`` of ``obj`` ({} when absent)."""
    return meta(obj).get("annotations") or {}


def spec(obj: dict) -> dict:
    return obj.get("spec") or {}


def status(obj: dict) -> dict:
    return obj.get("status") or {}


def field(obj: dict, path: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    """``obj[a][b]...`` for ``path = "a.b"``; missing -> ``default``; wrong type -> error."""
    cur: Any = obj
    for part in path.split("."):
        if not isinstance(cur, dict):
            raise TranslateError(f"field {path!r} must be inside a mapping, got {cur!r}")
        cur = cur.get(part)
        if cur is None:
            return default
    if isinstance(kind, type) and kind is int and isinstance(cur, bool):
        raise TranslateError(f"field {path!r} must be an integer, got {cur!r}")
    if not isinstance(cur, kind):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise TranslateError(f"field {path!r} must be {names}, got {cur!r}")
    return cur


def str_map(value: Any, path: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise TranslateError(f"field {path!r} must map strings to strings, got {value!r}")
    return value


def selector_matches(selector: dict[str, str] | None, labels_: dict[str, str]) -> bool:
    """Kubernetes equality selector: non-empty and a subset of ``labels_``."""
    if not selector:
        return False
    return all(labels_.get(k) == v for k, v in selector.items())


def _packed(text: str) -> bytes:
    """``ipaddress.ip_address(text).packed``; ValueError as it raises. The C parser first
    (every pod change parses its IPs: ``ipaddress`` is ~20x slower); whatever it refuses
    (a zone index, odd forms) goes to ``ipaddress``, which decides and words the error.
    Both refuse leading zeros in an IPv4 octet, so they accept the same dotted forms."""
    try:
        return socket.inet_pton(socket.AF_INET6 if ":" in text else socket.AF_INET, text)
    except (OSError, ValueError):  # ValueError: an embedded NUL
        return ipaddress.ip_address(text).packed


def ip_bytes(text: Any, path: str) -> bytes:
    """IP string -> 4 or 16 raw bytes (the form Workload.addresses carries)."""
    try:
        return _packed(str(text).strip())
    except ValueError:
        raise TranslateError(f"field {path!r} is not an IP address: {text!r}") from None


def parse_ip_or_none(text: Any) -> bytes | None:
    try:
        return _packed(str(text).strip())
    except ValueError:
        return None


def ip_text(raw: bytes) -> str:
    """4 or 16 raw bytes -> the address as ``str(ipaddress.ip_address(raw))`` writes it
    (IPv4 through the C formatter, which writes it the same; IPv6 through ``ipaddress``,
    whose text for some forms, e.g. IPv4-mapped ones, differs from ``inet_ntop``'s)."""
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw)
    return str(ipaddress.ip_address(raw))




def pod_ips(pod: dict) -> list[str]:
    """``status.podIPs[].ip`` if non-empty, else ``status.podIP``."""
    st = status(pod)
    ips = st.get("podIPs")
    if isinstance(ips, list) and ips:
        out = []
        for i, entry in enumerate(ips):
            ip = entry.get("ip") if isinstance(entry, dict) else None
            if not isinstance(ip, str):
                raise TranslateError(f"field 'status.podIPs[{i}].ip' must be a string, got {ip!r}")
            out.append(ip)
        return out
    ip = st.get("podIP")
    if ip in (None, ""):
        return []
    if not isinstance(ip, str):
        raise TranslateError(f"field 'status.podIP' must be a string, got {ip!r}")
    return [ip]
