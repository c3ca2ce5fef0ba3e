"""The values and the shape of Gateway API objects a waypoint reads, checked before anything
is built from them: the rules of the Gateway API CRD schema (its OpenAPI patterns, bounds
and CEL rules, ``gateway.networking.k8s.io`` v1.2 ``standard`` channel) and the values
Envoy itself would refuse, each rule one function below citing its source.

A route or Gateway breaking one is *not accepted*: in Kubernetes the API server would have
refused it (so it never reaches istiod), in the YAML directory it would otherwise become
a ``RouteConfiguration`` Envoy NACKs as a whole, taking every other route of the
waypoint down with it. So :func:`route_errors` lists what is wrong, the waypoint build
leaves that route out (one WARN naming the field and the value), and the route's status
is ``Accepted=False`` / ``UnsupportedValue`` with the same text
(:mod:`ambient.waypoint.status`). :func:`gateway_errors` does the same for a Gateway's
``listeners`` (``Accepted=False`` / ``Invalid``).

Every error is one string ``field 'spec.rules[0].matches[0].path.value' value 'x': why``
(the field path as ``kubectl explain`` spells it, the value as Python ``repr``
shortened to 80 characters). Nothing here raises for any input: a value of the wrong
type is an error like any other.
"""

from __future__ import annotations

import re
from typing import Any, TypeGuard

from ambient.waypoint import regex
from ambient.waypoints import HBONE_PORT

#: RFC 7230 ``token`` (tchar+): Gateway API ``HTTPHeaderName``'s pattern, Envoy's
#: ``HTTP_HEADER_NAME`` well-known regex for header matchers and header mutations
_TOKEN = re.compile(r"^[A-Za-z0-9!#$%&'*+\-.^_`|~]+$")
#: Gateway API ``Duration`` (GEP-2257): one to four ``<1-5 digits><unit>`` parts
_DURATION_PART = re.compile(r"([0-9]{1,5})(h|ms|m|s)")
_DURATION = re.compile(r"^(?:[0-9]{1,5}(?:h|ms|m|s)){1,4}$")
_UNIT_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
#: Gateway API ``ProtocolType``'s pattern (a name, or a domain-prefixed name)
_PROTOCOL = re.compile(r"^[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?$|"
                       r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/"
                       r"[A-Za-z0-9]+$")
#: Gateway API ``SectionName`` / DNS-1123 subdomain (listener names)
_SECTION = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
#: Gateway API ``HTTPMethod`` enum
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE",
                     "PATCH"})
MAX_WEIGHT = 1_000_000
MAX_HEADER_VALUE = 4096
MAX_MESSAGE = 1000  # characters of the joined errors in one status message


def _v(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _err(where: str, value: Any, why: str) -> str:
    return f"field '{where}' value {_v(value)}: {why}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _list(obj: dict, key: str, where: str, errors: list[str]) -> list:
    """``obj[key]`` when it is a list (absent or null: ``[]``); else an error naming the
    field and ``[]``: every Gateway API list field is ``type: array``."""
    value = obj.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        errors.append(_err(f"{where}.{key}" if where else key, value, "must be a list"))
        return []
    return value


def _maps(items: list, where: str, errors: list[str]) -> list[tuple[int, dict]]:
    """The ``(index, entry)`` of the entries that are maps; an error for each that is not
    (the entries of every list read here are ``type: object``)."""
    out = []
    for i, item in enumerate(items):
        if isinstance(item, dict):
            out.append((i, item))
        else:
            errors.append(_err(f"{where}[{i}]", item, "must be a map"))
    return out


def _map(obj: dict, key: str, where: str, errors: list[str]) -> dict:
    value = obj.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        errors.append(_err(f"{where}.{key}", value, "must be a map"))
        return {}
    return value


# ---------------------------------------------------------------- single values
def check_path(ptype: Any, value: Any, where: str, errors: list[str]) -> None:
    """``HTTPPathMatch``: ``type`` one of ``Exact``, ``PathPrefix`` (the default),
    ``RegularExpression``; ``value`` at most 1024 characters. For ``Exact`` and
    ``PathPrefix`` the CRD's CEL rules: it must start with ``/`` and contain none of
    ``//``, ``/./``, ``/../``, ``%2f``, ``%2F``, ``#``, nor end in ``/..`` or ``/.``; and
    no ``?`` (Envoy's ``path_separated_prefix`` is ``^[^?#]+[^?#/]$``, a NACK otherwise; a
    query never matches an exact path). ``RegularExpression``: a pattern Envoy's RE2
    compiles within its program size limit (:mod:`ambient.waypoint.regex`)."""
    if ptype is None:
        ptype = "PathPrefix"
    if ptype not in ("Exact", "PathPrefix", "RegularExpression"):
        errors.append(_err(f"{where}.type", ptype, "must be Exact, PathPrefix or "
                                                   "RegularExpression"))
        return
    if value is None:
        return  # default "/"
    if not isinstance(value, str):
        errors.append(_err(f"{where}.value", value, "must be a string"))
        return
    if len(value) > 1024:
        errors.append(_err(f"{where}.value", value, "is longer than 1024 characters"))
        return
    if ptype == "RegularExpression":
        why = regex.problem(value)
        if why is not None:
            errors.append(_err(f"{where}.value", value, f"{why} (Envoy compiles it)"))
        return
    if not value.startswith("/"):
        errors.append(_err(f"{where}.value", value, "must be an absolute path (start with '/')"))
        return
    for bad in ("//", "/./", "/../", "%2f", "%2F", "#", "?"):
        if bad in value:
            errors.append(_err(f"{where}.value", value, f"must not contain {bad!r}"))
            return
    if value.endswith("/..") or value.endswith("/."):
        errors.append(_err(f"{where}.value", value, "must not end with '/..' or '/.'"))


def check_header_name(name: Any, where: str, errors: list[str]) -> TypeGuard[str]:
    """``HTTPHeaderName``: 1-256 characters of an RFC 7230 ``token`` (``tchar``: letters,
    digits and ``!#$%&'*+-.^_`|~``); Envoy validates header matcher and mutation names
    against the same rule (``HTTP_HEADER_NAME``) and NACKs the route otherwise. Pseudo
    headers (``:path``) are not tokens, so they are refused too."""
    if not isinstance(name, str) or not name:
        errors.append(_err(where, name, "must be a non-empty header name"))
        return False
    if len(name) > 256 or not _TOKEN.match(name):
        errors.append(_err(where, name, "is not an RFC 7230 token (a valid header name)"))
        return False
    return True


def check_header_value(value: Any, where: str, errors: list[str], *,
                       required: bool = True) -> None:
    """``HTTPHeaderValue`` / a header match value: a string of 1-4096 characters
    (``minLength: 1`` where ``required``), without NUL, CR or LF (Envoy's
    ``HTTP_HEADER_VALUE`` rule: a NACK otherwise)."""
    if value is None and not required:
        return
    if not isinstance(value, str) or (required and not value):
        errors.append(_err(where, value, "must be a non-empty string"))
        return
    if len(value) > MAX_HEADER_VALUE:
        errors.append(_err(where, value, f"is longer than {MAX_HEADER_VALUE} characters"))
    elif any(c in value for c in "\0\r\n"):
        errors.append(_err(where, value, "contains NUL, CR or LF (Envoy refuses it)"))


def parse_duration(value: Any) -> float | None:
    """Seconds of a Gateway API ``Duration`` (GEP-2257: ``^([0-9]{1,5}(h|m|s|ms)){1,4}$``,
    e.g. ``1h30m``, ``500ms``), or None when ``value`` is not one. The pattern bounds it
    to 4 x 99999 h, well inside protobuf ``Duration``'s (and so Envoy's) range of
    315,576,000,000 s."""
    if not isinstance(value, str) or not _DURATION.match(value):
        return None
    return sum(int(n) * _UNIT_SECONDS[u] for n, u in _DURATION_PART.findall(value))


def check_duration(value: Any, where: str, errors: list[str]) -> float | None:
    """A ``Duration`` field (absent: None); an error when it does not parse."""
    if value is None:
        return None
    seconds = parse_duration(value)
    if seconds is None:
        errors.append(_err(where, value, "is not a Gateway API duration (1 to 4 parts of "
                                         "up to 5 digits and h, m, s or ms, e.g. '1m30s')"))
    return seconds


def check_port(value: Any, where: str, errors: list[str]) -> None:
    """``PortNumber``: an integer 1-65535."""
    if not _is_int(value) or not 1 <= value <= 65535:
        errors.append(_err(where, value, "must be a port number 1-65535"))


# ---------------------------------------------------------------- route parts
def check_parent_refs(spec: dict, where: str, errors: list[str]) -> None:
    """``spec.parentRefs``: a list (at most 32) of maps, each with ``name`` (a non-empty
    string: the CRD requires it) and an optional ``port`` 1-65535 and string
    ``namespace``, ``kind``, ``group``, ``sectionName``."""
    refs = _list(spec, "parentRefs", where, errors)
    if len(refs) > 32:
        errors.append(_err(f"{where}.parentRefs", f"{len(refs)} entries", "at most 32"))
    for i, ref in _maps(refs, f"{where}.parentRefs", errors):
        here = f"{where}.parentRefs[{i}]"
        name = ref.get("name")
        if not isinstance(name, str) or not name:
            errors.append(_err(f"{here}.name", name, "is required (a non-empty string)"))
        for key in ("namespace", "kind", "group", "sectionName"):
            if key in ref and ref[key] is not None and not isinstance(ref[key], str):
                errors.append(_err(f"{here}.{key}", ref[key], "must be a string"))
        if ref.get("port") is not None:
            check_port(ref["port"], f"{here}.port", errors)


def check_backend_refs(rule: dict, where: str, errors: list[str]) -> None:
    """``backendRefs``: maps with ``name`` (required); ``port`` 1-65535 and required when
    the reference is a core Service (the CRD's CEL rule "Must have port for Service
    reference"); ``weight`` an integer 0-1,000,000 (``Minimum``/``Maximum``; Envoy's
    weighted cluster weights are uint32, a sum over 2^32 is a NACK)."""
    for b, ref in _maps(_list(rule, "backendRefs", where, errors), f"{where}.backendRefs",
                        errors):
        here = f"{where}.backendRefs[{b}]"
        name = ref.get("name")
        if not isinstance(name, str) or not name:
            errors.append(_err(f"{here}.name", name, "is required (a non-empty string)"))
        kind, group = ref.get("kind") or "Service", ref.get("group") or ""
        if ref.get("port") is not None:
            check_port(ref["port"], f"{here}.port", errors)
        elif kind == "Service" and group in ("", "core"):
            errors.append(_err(f"{here}.port", None, "is required for a Service backend"))
        weight = ref.get("weight")
        if weight is not None and (not _is_int(weight) or not 0 <= weight <= MAX_WEIGHT):
            errors.append(_err(f"{here}.weight", weight,
                               f"must be an integer 0-{MAX_WEIGHT}"))
        _check_filters(ref, here, errors)


def check_header_modifier(mod: Any, where: str, errors: list[str]) -> None:
    """``HTTPHeaderFilter`` (Request/ResponseHeaderModifier): ``set`` and ``add`` lists
    (at most 16) of ``{name, value}`` with a valid, unique name (the CRD's
    ``listType=map`` keyed by ``name``; names compare case-insensitively, as the spec says
    header names do) and a valid value; ``remove`` (at most 16) unique valid names. Envoy
    refuses to add or remove ``host`` (``':-prefixed' or host headers may not be
    modified``), a NACK of the route table."""
    if not isinstance(mod, dict):
        errors.append(_err(where, mod, "must be a map"))
        return
    for key in ("set", "add"):
        items = _list(mod, key, where, errors)
        if len(items) > 16:
            errors.append(_err(f"{where}.{key}", f"{len(items)} entries", "at most 16"))
        seen: set[str] = set()
        for i, h in _maps(items, f"{where}.{key}", errors):
            name = h.get("name")
            if check_header_name(name, f"{where}.{key}[{i}].name", errors):
                if name.lower() in seen:
                    errors.append(_err(f"{where}.{key}[{i}].name", name,
                                       f"is named twice in {key}"))
                elif name.lower() == "host":
                    errors.append(_err(f"{where}.{key}[{i}].name", name,
                                       "Envoy refuses to modify the host header"))
                seen.add(name.lower())
            check_header_value(h.get("value"), f"{where}.{key}[{i}].value", errors)
    removed = _list(mod, "remove", where, errors)
    if len(removed) > 16:
        errors.append(_err(f"{where}.remove", f"{len(removed)} entries", "at most 16"))
    gone: set[str] = set()
    for i, name in enumerate(removed):
        if check_header_name(name, f"{where}.remove[{i}]", errors):
            if name.lower() in gone:
                errors.append(_err(f"{where}.remove[{i}]", name, "is named twice in remove"))
            elif name.lower() == "host":
                errors.append(_err(f"{where}.remove[{i}]", name,
                                   "Envoy refuses to remove the host header"))
            gone.add(name.lower())


_MODIFIERS = {"RequestHeaderModifier": "requestHeaderModifier",
              "ResponseHeaderModifier": "responseHeaderModifier"}


def _check_filters(obj: dict, where: str, errors: list[str]) -> None:
    """``filters``: maps with a string ``type``; the header modifiers' contents
    (:func:`check_header_modifier`). Other filter types are the builder's and status's
    (unsupported, reported there)."""
    for f, flt in _maps(_list(obj, "filters", where, errors), f"{where}.filters", errors):
        ftype = flt.get("type")
        if not isinstance(ftype, str):
            errors.append(_err(f"{where}.filters[{f}].type", ftype, "must be a string"))
            continue
        field = _MODIFIERS.get(ftype)
        if field is not None and flt.get(field) is not None:
            check_header_modifier(flt[field], f"{where}.filters[{f}].{field}", errors)


def _check_header_matches(match: dict, key: str, where: str, errors: list[str]) -> None:
    """``headers`` / ``queryParams`` of a match: maps with a valid unique ``name``
    (``listType=map`` keyed by name), ``type`` ``Exact`` (default) or
    ``RegularExpression`` (a pattern RE2 compiles within Envoy's limit), a string
    ``value``."""
    seen: set[str] = set()
    for i, h in _maps(_list(match, key, where, errors), f"{where}.{key}", errors):
        here = f"{where}.{key}[{i}]"
        name = h.get("name")
        if check_header_name(name, f"{here}.name", errors):
            folded = name.lower() if key == "headers" else name
            if folded in seen:
                errors.append(_err(f"{here}.name", name, f"is named twice in {key}"))
            seen.add(folded)
        htype = h.get("type") or "Exact"
        value = h.get("value")
        if htype not in ("Exact", "RegularExpression"):
            errors.append(_err(f"{here}.type", htype, "must be Exact or RegularExpression"))
        elif not isinstance(value, str):
            errors.append(_err(f"{here}.value", value, "must be a string"))
        elif htype == "RegularExpression":
            why = regex.problem(value)
            if why is not None:
                errors.append(_err(f"{here}.value", value, f"{why} (Envoy compiles it)"))
        else:
            check_header_value(value, f"{here}.value", errors)


def _check_match(match: dict, where: str, errors: list[str], kind: str) -> None:
    if kind == "HTTPRoute":
        path = match.get("path")
        if path is not None:
            if isinstance(path, dict):
                check_path(path.get("type"), path.get("value"), f"{where}.path", errors)
            else:
                errors.append(_err(f"{where}.path", path, "must be a map"))
        method = match.get("method")
        if method is not None and method not in METHODS:
            errors.append(_err(f"{where}.method", method,
                               "must be one of " + ", ".join(sorted(METHODS))))
        _check_header_matches(match, "queryParams", where, errors)
    elif kind == "GRPCRoute":
        method = match.get("method")
        if method is not None and not isinstance(method, dict):
            errors.append(_err(f"{where}.method", method, "must be a map"))
        elif isinstance(method, dict):
            for key in ("service", "method"):
                value = method.get(key)
                if value is not None and not isinstance(value, str):
                    errors.append(_err(f"{where}.method.{key}", value, "must be a string"))
    _check_header_matches(match, "headers", where, errors)


def check_timeouts(rule: dict, where: str, errors: list[str]) -> None:
    """``timeouts.request`` and ``timeouts.backendRequest``: Gateway API durations
    (:func:`parse_duration`); the CRD's CEL rule "backendRequest timeout cannot be longer
    than request timeout" (a request timeout of ``0s`` is none)."""
    timeouts = _map(rule, "timeouts", where, errors)
    request = check_duration(timeouts.get("request"), f"{where}.timeouts.request", errors)
    backend = check_duration(timeouts.get("backendRequest"),
                             f"{where}.timeouts.backendRequest", errors)
    if request and backend is not None and backend > request:
        errors.append(_err(f"{where}.timeouts.backendRequest", timeouts["backendRequest"],
                           f"is longer than timeouts.request {timeouts['request']!r}"))


def check_retry(rule: dict, where: str, errors: list[str]) -> None:
    """``retry``: ``attempts`` an integer >= 0 (Envoy's ``num_retries`` is a uint32),
    ``codes`` integers 400-599 (``HTTPRouteRetryStatusCode``), ``backoff`` a duration
    longer than zero (the CRD takes ``0s``, but Envoy's ``retry_back_off.base_interval``
    must be more than 0: the whole RouteConfiguration was NACKed)."""
    retry = _map(rule, "retry", where, errors)
    attempts = retry.get("attempts")
    if attempts is not None and (not _is_int(attempts) or not 0 <= attempts < 2**32):
        errors.append(_err(f"{where}.retry.attempts", attempts,
                           "must be a non-negative integer"))
    for i, code in enumerate(_list(retry, "codes", f"{where}.retry", errors)):
        if not _is_int(code) or not 400 <= code <= 599:
            errors.append(_err(f"{where}.retry.codes[{i}]", code,
                               "must be an HTTP status code 400-599"))
    backoff = check_duration(retry.get("backoff"), f"{where}.retry.backoff", errors)
    if backoff is not None and backoff <= 0:
        errors.append(_err(f"{where}.retry.backoff", retry["backoff"],
                           "must be longer than 0s (Envoy's retry base interval)"))


def route_errors(route: dict) -> list[str]:
    """Everything in an HTTPRoute, GRPCRoute or TCPRoute (its ``kind``) the CRD schema
    refuses or Envoy would NACK, as error strings (empty: the route may be built).
    Covers ``spec`` and ``spec.parentRefs`` (:func:`check_parent_refs`), ``spec.rules``
    (a list of maps, at most 16), each rule's ``matches`` (at most 64), ``backendRefs``,
    ``filters``, and for HTTPRoute ``timeouts`` and ``retry``."""
    errors: list[str] = []
    kind = str(route.get("kind") or "HTTPRoute")
    spec = route.get("spec")
    if spec is None:
        spec = {}
    if not isinstance(spec, dict):
        return [_err("spec", spec, "must be a map")]
    check_parent_refs(spec, "spec", errors)
    rules = _list(spec, "rules", "spec", errors)
    if len(rules) > 16:
        errors.append(_err("spec.rules", f"{len(rules)} entries", "at most 16"))
    for r, rule in _maps(rules, "spec.rules", errors):
        where = f"spec.rules[{r}]"
        check_backend_refs(rule, where, errors)
        if kind == "TCPRoute":
            continue
        matches = _list(rule, "matches", where, errors)
        if len(matches) > 64:
            errors.append(_err(f"{where}.matches", f"{len(matches)} entries", "at most 64"))
        for m, match in _maps(matches, f"{where}.matches", errors):
            _check_match(match, f"{where}.matches[{m}]", errors, kind)
        _check_filters(rule, where, errors)
        if kind == "HTTPRoute":
            check_timeouts(rule, where, errors)
            check_retry(rule, where, errors)
    return errors


def gateway_errors(gateway: dict) -> list[str]:
    """What in a Gateway's ``spec`` the CRD refuses: ``listeners`` a list (1-64) of maps,
    each with a unique ``name`` (``SectionName``, a DNS-1123 subdomain), ``port``
    1-65535 and ``protocol`` a ``ProtocolType`` (a name, or ``domain/name``);
    ``gatewayClassName`` a non-empty string."""
    errors: list[str] = []
    spec = gateway.get("spec")
    if spec is None:
        spec = {}
    if not isinstance(spec, dict):
        return [_err("spec", spec, "must be a map")]
    cls = spec.get("gatewayClassName")
    if not isinstance(cls, str) or not cls:
        errors.append(_err("spec.gatewayClassName", cls, "is required (a non-empty string)"))
    listeners = _list(spec, "listeners", "spec", errors)
    if len(listeners) > 64:
        errors.append(_err("spec.listeners", f"{len(listeners)} entries", "at most 64"))
    names: set[str] = set()
    for i, listener in _maps(listeners, "spec.listeners", errors):
        here = f"spec.listeners[{i}]"
        name = listener.get("name")
        if not isinstance(name, str) or len(name) > 253 or not _SECTION.match(name):
            errors.append(_err(f"{here}.name", name, "must be a DNS-1123 subdomain name"))
        elif name in names:
            errors.append(_err(f"{here}.name", name, "is the name of another listener"))
        else:
            names.add(name)
        check_port(listener.get("port"), f"{here}.port", errors)
        protocol = listener.get("protocol")
        if not isinstance(protocol, str) or len(protocol) > 255 or \
                not _PROTOCOL.match(protocol):
            errors.append(_err(f"{here}.protocol", protocol,
                               "must be a protocol name (e.g. HBONE, HTTP)"))
    return errors


#: the Gateway ``spec`` fields a waypoint reads (``addresses`` and ``infrastructure`` are
#: the Gateway API's, but a waypoint's address comes from its Service: ignored, warned)
GATEWAY_FIELDS = frozenset({"gatewayClassName", "listeners"})


def hbone_listener(listeners: list) -> dict | None:
    """The listener a waypoint serves: the single one on port 15008 with protocol
    ``HBONE``; None when there is none or more than one (istiod's rule)."""
    hbone = [x for x in listeners if isinstance(x, dict) and x.get("port") == HBONE_PORT
             and x.get("protocol") == "HBONE"]
    return hbone[0] if len(hbone) == 1 else None


def gateway_ignored(gateway: dict) -> list[str]:
    """What in an accepted waypoint Gateway's ``spec`` is ignored, one text per field:
    a field other than :data:`GATEWAY_FIELDS`, and each listener but the one on port
    15008 with protocol ``HBONE`` (its status says ``UnsupportedProtocol``, as
    istiod's). In Kubernetes these reach the Gateway's status only; in the YAML
    directory they would pass unseen."""
    spec = gateway.get("spec")
    if not isinstance(spec, dict):
        return []
    out = [f"field 'spec.{key}' is not supported for a waypoint: ignored"
           for key in sorted(k for k in spec if k not in GATEWAY_FIELDS)]
    found = spec.get("listeners")
    listeners: list = found if isinstance(found, list) else []
    served = hbone_listener(listeners)
    for i, x in enumerate(listeners):
        if isinstance(x, dict) and x is not served:
            out.append(f"field 'spec.listeners[{i}]' ({_v(x.get('name'))}, port "
                       f"{_v(x.get('port'))}, protocol {_v(x.get('protocol'))}) is not "
                       f"supported (a waypoint has one HBONE listener on {HBONE_PORT}): "
                       f"ignored")
    return out


def message(errors: list[str]) -> str:
    """The errors as one status message / log text, at most :data:`MAX_MESSAGE`
    characters (the count of the rest said)."""
    out = ""
    for i, e in enumerate(errors):
        part = e if not out else f"; {e}"
        if len(out) + len(part) > MAX_MESSAGE:
            return f"{out}; and {len(errors) - i} more"
        out += part
    return out
