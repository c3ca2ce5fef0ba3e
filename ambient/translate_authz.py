"""AuthorizationPolicy and PeerAuthentication -> ``istio.security.Authorization``
(spec ambient-wds.md §3.9, §3.10).

ztunnel enforces L4 only. L7 attributes follow Istio: an ALLOW rule containing any is
dropped whole (stricter than asked), a DENY rule keeps its L4 parts (denies more than
asked; an L7-only DENY rule becomes a no-op). Each translation returns the reason text
Istio puts in the policy status so the index can log it once.
"""

from __future__ import annotations

import ipaddress
import logging
from typing import Any

from google.protobuf import empty_pb2

from ambient import authorization_pb2 as az
from ambient.objects import TranslateError, annotations, field, meta, spec, str_map

log = logging.getLogger("ambient.authz")

STATIC_STRICT = "istio_converted_static_strict"
CONVERTED_PREFIX = "converted_peer_authentication_"

L7_OPERATION = ("hosts", "notHosts", "methods", "notMethods", "paths", "notPaths")
L7_SOURCE = ("requestPrincipals", "notRequestPrincipals", "remoteIpBlocks",
             "notRemoteIpBlocks")
L4_WHEN = ("source.namespace", "source.principal", "source.ip", "destination.port",
           "destination.ip")
KNOWN_RULE_KEYS = {"from", "to", "when"}
KNOWN_SOURCE_KEYS = {"principals", "notPrincipals", "namespaces", "notNamespaces", "ipBlocks",
                     "notIpBlocks", "serviceAccounts", "notServiceAccounts", *L7_SOURCE}
KNOWN_OPERATION_KEYS = {"ports", "notPorts", *L7_OPERATION}


def string_match(value: str) -> az.StringMatch:
    """``*`` -> presence, ``*x`` -> suffix, ``x*`` -> prefix, else exact (§3.9)."""
    if value == "*":
        return az.StringMatch(presence=empty_pb2.Empty())
    if value.startswith("*"):
        return az.StringMatch(suffix=value[1:])
    if value.endswith("*"):
        return az.StringMatch(prefix=value[:-1])
    return az.StringMatch(exact=value)


def cidr(value: str) -> az.Address | None:
    """IP -> /32 or /128, CIDR -> its prefix; None for anything else (dropped, like ztunnel)."""
    try:
        net = ipaddress.ip_network(str(value).strip(), strict=False)
    except ValueError:
        return None
    return az.Address(address=net.network_address.packed, length=net.prefixlen)


def ports(values: list) -> list[int]:
    """Numeric ports only; ``"http"`` or > 65535 are dropped (§3.9)."""
    out = []
    for v in values:
        text = str(v).strip()
        if text.isdigit() and 0 < int(text) <= 65535:
            out.append(int(text))
    return out


def _strings(container: dict, key: str, path: str) -> list[str]:
    value = container.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise TranslateError(f"field {path}.{key!r} must be a list, got {value!r}")
    return [str(v) for v in value]


def _source_match(src: dict, policy_ns: str, path: str) -> az.Match:
    m = az.Match()
    for key, target in (("principals", m.principals), ("notPrincipals", m.not_principals),
                        ("namespaces", m.namespaces), ("notNamespaces", m.not_namespaces)):
        target.extend(string_match(v) for v in _strings(src, key, path))
    for key, target in (("ipBlocks", m.source_ips), ("notIpBlocks", m.not_source_ips)):
        target.extend(a for a in (cidr(v) for v in _strings(src, key, path)) if a)
    for key, target in (("serviceAccounts", m.service_accounts),
                        ("notServiceAccounts", m.not_service_accounts)):
        for v in _strings(src, key, path):
            ns, _, sa = v.rpartition("/")
            target.append(az.ServiceAccountMatch(namespace=ns or policy_ns, serviceAccount=sa))
    return m


def _when_match(cond: dict, path: str) -> az.Match:
    m = az.Match()
    key = cond.get("key")
    values, not_values = _strings(cond, "values", path), _strings(cond, "notValues", path)
    if key == "source.namespace":
        m.namespaces.extend(map(string_match, values))
        m.not_namespaces.extend(map(string_match, not_values))
    elif key == "source.principal":
        m.principals.extend(map(string_match, values))
        m.not_principals.extend(map(string_match, not_values))
    elif key in ("source.ip", "destination.ip"):
        pos, neg = ((m.source_ips, m.not_source_ips) if key == "source.ip"
                    else (m.destination_ips, m.not_destination_ips))
        pos.extend(a for a in map(cidr, values) if a)
        neg.extend(a for a in map(cidr, not_values) if a)
    elif key == "destination.port":
        m.destination_ports.extend(ports(values))
        m.not_destination_ports.extend(ports(not_values))
    return m


def _rule_l7(rule: dict) -> set[str]:
    found = set()
    for entry in rule.get("to") or []:
        op = (entry or {}).get("operation") or {}
        found.update(k for k in L7_OPERATION if op.get(k))
    for entry in rule.get("from") or []:
        src = (entry or {}).get("source") or {}
        found.update(k for k in L7_SOURCE if src.get(k))
    for cond in rule.get("when") or []:
        key = (cond or {}).get("key")
        if key not in L4_WHEN:
            found.add(str(key))
    return found


def _group(rule: dict, policy_ns: str, path: str) -> az.Group:
    group = az.Group()
    to = field(rule, "to", list, [])
    if to:
        clause = group.rules.add()
        for j, entry in enumerate(to):
            op = field(entry or {}, "operation", dict, {}) if isinstance(entry, dict) else None
            if op is None:
                raise TranslateError(f"field {path}.to[{j}] must be a mapping, got {entry!r}")
            clause.matches.append(az.Match(
                destination_ports=ports(_strings(op, "ports", f"{path}.to[{j}]")),
                not_destination_ports=ports(_strings(op, "notPorts", f"{path}.to[{j}]"))))
    frm = field(rule, "from", list, [])
    if frm:
        clause = group.rules.add()
        for j, entry in enumerate(frm):
            if not isinstance(entry, dict):
                raise TranslateError(f"field {path}.from[{j}] must be a mapping, got {entry!r}")
            src = field(entry, "source", dict, {})
            clause.matches.append(_source_match(src, policy_ns, f"{path}.from[{j}].source"))
    for j, cond in enumerate(field(rule, "when", list, [])):
        if not isinstance(cond, dict):
            raise TranslateError(f"field {path}.when[{j}] must be a mapping, got {cond!r}")
        group.rules.add().matches.append(_when_match(cond, f"{path}.when[{j}]"))
    return group


def unknown_fields(policy: dict) -> list[str]:
    """Rule/source/operation keys this translator doesn't know (logged, then ignored)."""
    found = []
    for i, rule in enumerate(spec(policy).get("rules") or []):
        if not isinstance(rule, dict):
            continue
        found += [f"rules[{i}].{k}" for k in rule if k not in KNOWN_RULE_KEYS]
        for j, entry in enumerate(rule.get("from") or []):
            src = (entry or {}).get("source") if isinstance(entry, dict) else None
            found += [f"rules[{i}].from[{j}].source.{k}" for k in (src or {})
                      if k not in KNOWN_SOURCE_KEYS]
        for j, entry in enumerate(rule.get("to") or []):
            op = (entry or {}).get("operation") if isinstance(entry, dict) else None
            found += [f"rules[{i}].to[{j}].operation.{k}" for k in (op or {})
                      if k not in KNOWN_OPERATION_KEYS]
    return found


def authorization_policy(policy: dict, root_ns: str
                         ) -> tuple[az.Authorization | None, str]:
    """One AuthorizationPolicy -> (Authorization or None, status note).

    None when the policy is for waypoints (``targetRef(s)``), has action AUDIT/CUSTOM, or is
    a dry-run policy (not enabled here, as Istio's default). Raises TranslateError naming a
    malformed field.
    """
    m, s = meta(policy), spec(policy)
    ns, name = m["namespace"], m["name"]
    if s.get("targetRef") or s.get("targetRefs"):
        return None, "targets a waypoint: enforced there, not by ztunnel"
    action = s.get("action") or "ALLOW"
    if action not in ("ALLOW", "DENY"):
        return None, f"ztunnel does not support the {action} action"
    if annotations(policy).get("istio.io/dry-run", "").lower() == "true":
        return None, "dry-run policies are not supported (UnsupportedValue)"
    selector = field(policy, "spec.selector", dict)
    if selector is not None:
        str_map(selector.get("matchLabels"), "spec.selector.matchLabels")
        scope = az.WORKLOAD_SELECTOR
    else:
        scope = az.GLOBAL if ns == root_ns else az.NAMESPACE
    out = az.Authorization(name=name, namespace=ns, scope=scope,
                           action=az.ALLOW if action == "ALLOW" else az.DENY)
    l7_all: set[str] = set()
    for i, rule in enumerate(field(policy, "spec.rules", list, [])):
        if rule is None:
            rule = {}
        if not isinstance(rule, dict):
            raise TranslateError(f"field spec.rules[{i}] must be a mapping, got {rule!r}")
        l7 = _rule_l7(rule)
        l7_all |= l7
        if l7 and action == "ALLOW":
            continue  # the whole rule is dropped: allowing less than asked is the safe side
        out.groups.append(_group(rule, ns, f"spec.rules[{i}]"))
    note = ""
    if l7_all:
        note = (f"ztunnel does not support HTTP attributes (found: {', '.join(sorted(l7_all))}). "
                "In ambient mode you must use a waypoint proxy to enforce HTTP rules. ")
        if action == "ALLOW":
            note += "Within an ALLOW policy, rules matching HTTP attributes are omitted. " \
                    "This will be more restrictive than requested."
        elif any(g.rules and all(not _match_set(mm) for c in g.rules for mm in c.matches)
                 for g in out.groups):
            note += "Within a DENY policy, rules with HTTP attributes have no effect."
        else:
            note += "Within a DENY policy, rules matching HTTP attributes are enforced without " \
                    "the HTTP rules. This will be more restrictive than requested."
    return out, note


def _match_set(m: az.Match) -> bool:
    return m.ByteSize() > 0


# --- PeerAuthentication (§3.10) ---

MODES = ("UNSET", "STRICT", "PERMISSIVE", "DISABLE")


def pa_mode(value: Any, path: str = "spec.mtls.mode") -> str:
    mode = value or "UNSET"
    if mode not in MODES:
        raise TranslateError(f"field {path!r} must be one of {', '.join(MODES)}, got {value!r}")
    return mode


def pa_top_mode(pa: dict) -> str:
    return pa_mode(field(pa, "spec.mtls.mode", str))


def pa_port_modes(pa: dict) -> dict[int, str]:
    raw = field(pa, "spec.portLevelMtls", dict, {})
    out = {}
    for port, entry in raw.items():
        text = str(port)
        if not text.isdigit() or not 0 < int(text) <= 65535:
            raise TranslateError(f"field 'spec.portLevelMtls' key must be a port, got {port!r}")
        mode = pa_mode((entry or {}).get("mode") if isinstance(entry, dict) else None,
                       f"spec.portLevelMtls.{port}.mode")
        out[int(text)] = mode
    return out


def static_strict(root_ns: str) -> az.Authorization:
    """``<root>/istio_converted_static_strict``: deny plaintext for workloads listing it."""
    return az.Authorization(
        name=STATIC_STRICT, namespace=root_ns, scope=az.WORKLOAD_SELECTOR, action=az.DENY,
        groups=[az.Group(rules=[az.Rules(matches=[az.Match(
            not_principals=[az.StringMatch(presence=empty_pb2.Empty())])])])])


def converted_peer_authentication(pa: dict, inherited: str) -> az.Authorization | None:
    """A selector PeerAuthentication with ``portLevelMtls`` -> DENY policy, or None.

    ``inherited`` is the namespace mode, else the mesh mode, for a top mode of UNSET.
    """
    if field(pa, "spec.selector", dict) is None:
        return None
    port_modes = pa_port_modes(pa)
    if not port_modes:
        return None
    top = pa_top_mode(pa)
    presence = az.StringMatch(presence=empty_pb2.Empty())
    groups: list[az.Group] = []
    if top == "STRICT" or (top == "UNSET" and inherited == "STRICT"):
        exceptions = sorted(p for p, mode in port_modes.items()
                            if mode in ("PERMISSIVE", "DISABLE"))
        if exceptions:
            group = az.Group(rules=[az.Rules(matches=[az.Match(not_principals=[presence])])])
            for p in exceptions:
                group.rules.append(az.Rules(matches=[az.Match(not_destination_ports=[p])]))
            groups.append(group)
    else:
        for p in sorted(p for p, mode in port_modes.items() if mode == "STRICT"):
            groups.append(az.Group(rules=[az.Rules(matches=[az.Match(
                destination_ports=[p], not_principals=[presence])])]))
    if not groups:
        return None
    return az.Authorization(name=CONVERTED_PREFIX + meta(pa)["name"],
                            namespace=meta(pa)["namespace"], scope=az.WORKLOAD_SELECTOR,
                            action=az.DENY, groups=groups)
