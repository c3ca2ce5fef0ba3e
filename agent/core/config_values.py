"""The value parsers of the settings table (:mod:`agent.core.config`).

Each parser takes what a flag, an environment variable or a YAML config file gave (a
string, or a YAML scalar/list/mapping) and returns the typed value, or raises
``ValueError`` with a short reason; :func:`agent.core.config.load` turns that into a
:class:`agent.core.config.ConfigError` naming the setting, the value and where it came
from. A parser's return annotation is the setting's type: ``scripts/gen_config_fields.py``
reads it to write the typed :class:`agent.core.config_fields.Settings`, so every parser
(and every inner function a parser factory returns) must annotate it.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
from typing import Any, Callable

from agent.core.appprobes import parse_probers


_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: Any) -> float:
    """Parse a Go-style duration (``"24h"``, ``"1h30m"``, ``"250ms"``) or a number of seconds.

    Returns seconds as a float. Raises ValueError for anything else or a negative value.
    """
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 30s, 5m, 24h")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = str(value).strip()
        try:
            seconds = float(text)
        except ValueError:
            pos, seconds = 0, 0.0
            for m in _DURATION_RE.finditer(text):
                if m.start() != pos:
                    break
                seconds += float(m.group(1)) * _DURATION_UNITS[m.group(2)]
                pos = m.end()
            if pos != len(text) or not text:
                raise ValueError("expected a duration such as 30s, 5m, 24h") from None
    if not math.isfinite(seconds):
        raise ValueError("expected a finite duration such as 30s, 5m, 24h")
    if seconds < 0:
        raise ValueError("duration must not be negative")
    return seconds


def parse_bool(value: Any) -> bool:
    """Accept YAML booleans and the strings true/false/1/0/yes/no/on/off (any case)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def parse_port(value: Any) -> int:
    """A TCP port 0..65535 (0 lets the kernel choose, useful in tests)."""
    if isinstance(value, bool):
        raise ValueError("expected a port number")
    try:
        port = int(str(value).strip())
    except ValueError:
        raise ValueError("expected a port number") from None
    if not 0 <= port <= 65535:
        raise ValueError("port must be between 0 and 65535")
    return port


def parse_count(value: Any) -> int:
    """A whole number >= 0 (connection caps: 0 means "as many as the fd budget allows")."""
    if isinstance(value, bool):
        raise ValueError("expected a whole number")
    try:
        number = int(str(value).strip())
    except ValueError:
        raise ValueError("expected a whole number") from None
    if number < 0:
        raise ValueError("must not be negative")
    return number


def parse_str(value: Any) -> str:
    """A string as it is (None: empty). A YAML list or mapping is rejected, and so is a
    YAML boolean or number: an unquoted ``on``, ``no`` or ``true`` in a config file is
    read as a boolean, ``0777`` as the number 511, so the text the user wrote is gone
    (``node_name: on`` became ``"True"``); the error says to quote it."""
    if isinstance(value, (dict, list, tuple)):
        raise ValueError("expected a string")
    if isinstance(value, bool):
        raise ValueError(f"expected a string: YAML read the unquoted value as the boolean "
                         f"{str(value).lower()} (it does so with on/off/yes/no/true/false); "
                         "quote it")
    if isinstance(value, (int, float)):
        raise ValueError(f"expected a string: YAML read the unquoted value as the number "
                         f"{value} (a leading 0 is octal there: 0777 is 511); quote it")
    return "" if value is None else str(value)


def parse_path(value: Any) -> str:
    """An absolute path (relative ones resolved against the working directory), or empty."""
    text = parse_str(value)
    return os.path.abspath(text) if text else ""


def parse_list(value: Any) -> tuple[str, ...]:
    """A comma-separated string or a YAML list of strings; a tuple, so a loaded
    :class:`agent.core.config.Config` can't be changed through it."""
    if isinstance(value, (list, tuple)):
        items = [parse_str(v).strip() for v in value]
        return tuple(item for item in items if item)
    return tuple(p.strip() for p in parse_str(value).split(",") if p.strip())


def parse_existing_file(value: Any) -> str:
    """An absolute path to a readable regular file, or empty (= not set).

    For settings whose file is read at start (certificates, keys, tokens, kubeconfig):
    a typo fails ``load`` with "no such file" instead of a component failing later.
    """
    path = parse_path(value)
    if not path:
        return ""
    if not os.path.exists(path):
        raise ValueError("no such file")
    if os.path.isdir(path):
        raise ValueError("is a directory, expected a file")
    if not os.access(path, os.R_OK):
        raise ValueError("file is not readable")
    return path


def parse_dir_path(value: Any) -> str:
    """An absolute directory path that need not exist yet (the agent creates it), but if
    something exists there it must be a directory; or empty (= not set)."""
    path = parse_path(value)
    if path and os.path.exists(path) and not os.path.isdir(path):
        raise ValueError("exists and is not a directory")
    return path


def required(parse: Callable[[Any], str]) -> Callable[[Any], str]:
    """``parse``, refusing an empty result: for the paths the agent cannot do without
    (its state dir, sockets, the CNI directories). An empty ``--state-dir ''`` (or
    ``AMBIENT_AGENT_STATE_DIR=``) was read as "not set" and the agent wrote its CA, mesh
    root and sockets into the working directory before failing on an unnamed empty path.
    Raises ``ValueError``."""
    def parse_required(value: Any) -> str:
        path = parse(value)
        if not path:
            raise ValueError("must not be empty (leave the setting out for its default)")
        return path
    parse_required.__doc__ = f"{parse.__doc__} Not empty."
    parse_required.__name__ = parse.__name__  # what --help names the value (PATH, DIR)
    return parse_required


def parse_bind_address(value: Any) -> str:
    """An IPv4/IPv6 address to bind a listener to (``[::1]`` brackets allowed), or empty.

    ``localhost`` maps to ``127.0.0.1``; other host names are rejected because gRPC and
    aiohttp would resolve them at bind time and fail with an error blaming the port.
    """
    text = parse_str(value).strip()
    if not text:
        return ""
    if text.lower() == "localhost":
        return "127.0.0.1"
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise ValueError("expected an IPv4 or IPv6 address to bind "
                         "(such as 127.0.0.1, 0.0.0.0, ::)") from None


def ip_of(version: int | None, allow_empty: bool = False) -> Callable[[Any], str]:
    """A parser for an IP address of ``version`` (4, 6 or None for either)."""

    def parse(value: Any) -> str:
        text = parse_str(value).strip()
        if not text and allow_empty:
            return ""
        try:
            address = ipaddress.ip_address(text)
        except ValueError:
            raise ValueError(f"expected an IPv{version or '4 or IPv6'} address") from None
        if version and address.version != version:
            raise ValueError(f"expected an IPv{version} address, got IPv{address.version}")
        return str(address)

    return parse


#: Kubernetes names, without their length bounds (63 for a label, 253 for a subdomain)
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def check_namespace(name: str) -> str:
    """Raise ValueError unless ``name`` is a Kubernetes namespace name (DNS-1123 label:
    lowercase letters, digits and '-', at most 63 characters)."""
    if len(name) > 63 or not DNS_LABEL.fullmatch(name):
        raise ValueError(f"{name!r} is not a valid namespace name (DNS-1123 label: lowercase "
                         "letters, digits and '-', at most 63 characters)")
    return name


def parse_namespace(value: Any) -> str:
    """One Kubernetes namespace name (see :func:`check_namespace`)."""
    return check_namespace(parse_str(value).strip())


def parse_namespace_list(value: Any) -> tuple[str, ...]:
    """Like :func:`parse_list` (Istio's SplitExcludeNamespaces), each entry a namespace.
    An empty entry (``a,,b``, ``,,``) is refused: it is a typo, and dropping it silently
    turned ``,,`` into "no namespaces" (e.g. kube-system no longer excluded). An empty
    value (``""``, ``[]``) is the explicit "none"."""
    if isinstance(value, (list, tuple)):
        items = [parse_str(v).strip() for v in value]
    else:
        text = parse_str(value)
        items = [p.strip() for p in text.split(",")] if text.strip() else []
    if "" in items:
        raise ValueError("has an empty entry (nothing between two commas, or a leading or "
                         "trailing comma); give an empty value to mean no namespaces")
    return tuple(check_namespace(n) for n in items)


def parse_token_file(value: Any) -> str:
    """Like :func:`parse_existing_file`, for a bearer token: the file must hold one (not
    only whitespace), else every client would be refused with a token they can't know."""
    path = parse_existing_file(value)
    if path:
        try:
            with open(path, "rb") as f:
                data = f.read(1 << 16)
        except OSError as e:
            raise ValueError(e.strerror or str(e)) from None
        if not data.strip():
            raise ValueError("file is empty: no token to compare clients' bearer tokens with")
    return path


def parse_service_account(value: Any) -> str:
    """A Kubernetes service account name (DNS-1123 subdomain), or empty."""
    text = parse_str(value).strip()
    if text and (len(text) > 253 or not DNS_SUBDOMAIN.fullmatch(text)):
        raise ValueError("not a valid service account name (DNS-1123 subdomain: lowercase "
                         "letters, digits, '-' and '.')")
    return text


def parse_account_list(value: Any) -> tuple[str, ...]:
    """``namespace/serviceaccount`` entries (comma-separated or a YAML list)."""
    accounts = parse_list(value)
    for entry in accounts:
        ns, sep, sa = entry.partition("/")
        if not sep or not sa or "/" in sa:
            raise ValueError(f"entry {entry!r} is not namespace/serviceaccount")
        check_namespace(ns)
        if parse_service_account(sa) != sa:
            raise ValueError(f"entry {entry!r}: bad service account")
    return accounts


def parse_name(value: Any) -> str:
    """A non-empty name without whitespace or '/' (node name, cluster ID): these end up
    inside workload UIDs (``<cluster>//Pod/ns/name``) and CA requests."""
    text = parse_str(value).strip()
    if not text:
        raise ValueError("must not be empty")
    if "/" in text or any(c.isspace() for c in text):
        raise ValueError("must not contain '/' or whitespace")
    return text


_TRUST_DOMAIN = re.compile(r"[A-Za-z0-9._-]+")


def parse_trust_domain(value: Any) -> str:
    """A SPIFFE trust domain (letters, digits, '.', '-', '_'; SPIFFE ID )."""
    text = parse_str(value).strip()
    if not _TRUST_DOMAIN.fullmatch(text):
        raise ValueError("expected a SPIFFE trust domain such as cluster.local (letters, "
                         "digits, '.', '-', '_')")
    return text


def parse_signature_algorithm(value: Any) -> str:
    """``ECC_SIGNATURE_ALGORITHM``: empty or RSA (RSA 2048), ECDSA or EC (P-256)."""
    text = parse_str(value).strip()
    if text.upper() not in ("", "RSA", "ECDSA", "EC"):
        raise ValueError("unsupported signature algorithm (expected ECDSA, or empty for "
                         "RSA 2048)")
    return text


def positive(parse: Callable[[Any], float]) -> Callable[[Any], float]:
    """Wrap a number parser to reject zero (e.g. a certificate lifetime)."""

    def parse_positive(value: Any) -> float:
        number = parse(value)
        if number <= 0:
            raise ValueError("must be greater than zero")
        return number

    return parse_positive


MIN_CERT_TTL = 600.0  # seconds; agent.sds.ca_embedded.MIN_TTL is the same floor
MAX_CERT_TTL = 90 * 86400.0  # seconds; istiod's DefaultMaxWorkloadCertTTL (MAX_WORKLOAD_CERT_TTL)


def parse_cert_ttl(value: Any) -> float:
    """A workload certificate lifetime (a duration) of at least :data:`MIN_CERT_TTL`
    (10 min). Shorter lifetimes are refused: with NotBefore backdated 2 minutes for clock
    skew, a client that renews at half the certificate's span would renew immediately."""
    number = parse_duration(value)
    if number < MIN_CERT_TTL:
        raise ValueError(f"must be at least {MIN_CERT_TTL:g}s (10m): shorter certificates "
                         "would be renewed in a loop (NotBefore is backdated 2 minutes)")
    if number > MAX_CERT_TTL:
        raise ValueError("must be at most 90d (2160h), istiod's MAX_WORKLOAD_CERT_TTL "
                         "default: a workload certificate outliving that is not renewed "
                         "often enough to follow a root rotation")
    return number


def parse_file_name(value: Any) -> str:
    """A bare file name inside a configured directory (no '/'), or empty."""
    text = parse_str(value).strip()
    if "/" in text or text in (".", ".."):
        raise ValueError("expected a file name in the directory, not a path")
    return text


def parse_json(value: Any) -> Any:
    """A JSON document given as a string (as Istio's env vars are), or already-parsed YAML."""
    if value is None or value == "":
        return None
    if isinstance(value, (dict, list)):
        return value
    return json.loads(value)


def parse_app_probers(value: Any) -> Any:
    """``ISTIO_KUBE_APP_PROBERS``: JSON, checked now with the status server's own parser
    (:func:`agent.core.appprobes.parse_probers`) so a bad prober stops start-up before
    any component starts; returns the decoded JSON the status server parses again."""
    decoded = parse_json(value)
    parse_probers(decoded)  # ProberConfigError is a ValueError
    return decoded


def parse_ratio(value: Any) -> float:
    """A fraction strictly between 0 and 1."""
    try:
        ratio = float(parse_str(value))
    except ValueError:
        raise ValueError("expected a number between 0 and 1, such as 0.5") from None
    if not 0 < ratio < 1:
        raise ValueError("must be between 0 and 1 (exclusive)")
    return ratio


def parse_file_mode(value: Any) -> str:
    """An octal permission mode such as ``0600``; kept as the string given. A YAML number
    is refused (an unquoted ``0600`` is read as 384, ``660`` as six hundred and sixty:
    which one was meant cannot be told), asking for the quoted form."""
    if isinstance(value, int) and not isinstance(value, bool):
        raise ValueError(f"YAML read the unquoted mode as the number {value}: quote it, "
                         "such as '0600'")
    text = parse_str(value).strip()
    try:
        mode = int(text, 8)
    except ValueError:
        raise ValueError("expected an octal mode such as 0600") from None
    if not 0 <= mode <= 0o777:
        raise ValueError("mode must be between 0000 and 0777")
    return text


def parse_host_port(value: Any) -> str:
    """``host:port`` (``[v6]:port`` for IPv6), or empty."""
    text = parse_str(value).strip()
    if not text:
        return ""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("expected host:port")
    return text


def parse_log_level(value: Any) -> str:
    """A level spec for :func:`agent.core.logsetup.parse_levels`, validated now."""
    from agent.core.logsetup import parse_levels

    text = parse_str(value).strip() or "info"
    parse_levels(text)
    return text


def choice(*allowed: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = parse_str(value).strip().lower()
        if text not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}")
        return text

    parse.choices = allowed  # type: ignore[attr-defined]  # shown by `run --help`
    return parse

