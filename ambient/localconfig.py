"""ztunnel's local-config format (``LOCAL_XDS_PATH``; ``docs/ambient.md``) as a config input.

A YAML document with top-level ``workloads``/``services``/``policies`` (and no ``kind``) is
ztunnel's serde model, not Kubernetes objects. The directory source turns each entry into
a store object of kind ``LocalWorkload``/``LocalService``/``LocalPolicy`` whose ``spec`` is
the entry; the index turns those 1:1 into protos with the functions here. Entries are
converted once at load time; a document with a bad entry loads nothing (ztunnel loads
its local-config file whole or not at all) and every bad entry is named in the log.
"""

from __future__ import annotations

import ipaddress
from typing import Any, Mapping, TypeVar

from google.protobuf import empty_pb2, wrappers_pb2

from ambient import authorization_pb2 as az
from ambient import workload_pb2 as wl
from ambient.objects import TranslateError

LOCAL_KEYS = frozenset({"workloads", "services", "policies"})
_SCOPES = {"Region": wl.LoadBalancing.REGION, "Zone": wl.LoadBalancing.ZONE,
           "Subzone": wl.LoadBalancing.SUBZONE, "Node": wl.LoadBalancing.NODE,
           "Cluster": wl.LoadBalancing.CLUSTER, "Network": wl.LoadBalancing.NETWORK}
_MODES = {"Standard": wl.LoadBalancing.UNSPECIFIED_MODE, "Strict": wl.LoadBalancing.STRICT,
          "Failover": wl.LoadBalancing.FAILOVER, "Passthrough": wl.LoadBalancing.PASSTHROUGH}
_WTYPES = {"deployment": wl.DEPLOYMENT, "cronjob": wl.CRONJOB, "pod": wl.POD, "job": wl.JOB}


def is_local_config(doc: Any) -> bool:
    return isinstance(doc, dict) and "kind" not in doc and bool(set(doc) & LOCAL_KEYS) \
        and set(doc) <= LOCAL_KEYS


def _req(entry: dict, key: str, kind: type, path: str) -> Any:
    value = entry.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise TranslateError(f"field '{path}.{key}' is required as {kind.__name__}, got {value!r}")
    return value


def _opt(entry: dict, key: str, kind: type, path: str, default: Any) -> Any:
    value = entry.get(key, default)
    if value is None:
        return default
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise TranslateError(f"field '{path}.{key}' must be {kind.__name__}, got {value!r}")
    return value


_E = TypeVar("_E")


def _enum(value: Any, table: Mapping[Any, _E], path: str) -> _E:
    if value not in table:
        raise TranslateError(f"field {path!r} must be one of {', '.join(table)}, got {value!r}")
    return table[value]


def network_address(text: str, path: str) -> wl.NetworkAddress:
    network, _, ip = str(text).rpartition("/")
    try:
        return wl.NetworkAddress(network=network, address=ipaddress.ip_address(ip).packed)
    except ValueError:
        raise TranslateError(f"field {path!r} must be 'network/IP', got {text!r}") from None


def gateway_address(entry: Any, path: str) -> wl.GatewayAddress:
    if not isinstance(entry, dict):
        raise TranslateError(f"field {path!r} must be a mapping, got {entry!r}")
    dest = _req(entry, "destination", str, path)
    port = _req(entry, "hboneMtlsPort", int, path)
    first, _, rest = dest.partition("/")
    try:
        ip = ipaddress.ip_address(rest).packed
        return wl.GatewayAddress(address=wl.NetworkAddress(network=first, address=ip),
                                 hbone_mtls_port=port)
    except ValueError:
        return wl.GatewayAddress(hostname=wl.NamespacedHostname(namespace=first, hostname=rest),
                                 hbone_mtls_port=port)


def _port_map(value: Any, path: str) -> list[wl.Port]:
    if not isinstance(value, dict):
        raise TranslateError(f"field {path!r} must map servicePort to targetPort, got {value!r}")
    out = []
    for k, v in value.items():
        try:
            out.append(wl.Port(service_port=int(k), target_port=int(v)))
        except (TypeError, ValueError):
            raise TranslateError(f"field '{path}.{k}' must be a port, got {v!r}") from None
    return out


def workload(entry: Any, path: str = "workload") -> wl.Workload:
    """A LocalWorkload entry -> Workload. Raises TranslateError naming the field."""
    if not isinstance(entry, dict):
        raise TranslateError(f"field {path!r} must be a mapping, got {entry!r}")
    w = wl.Workload(uid=_opt(entry, "uid", str, path, ""), name=_opt(entry, "name", str, path, ""),
                    namespace=_req(entry, "namespace", str, path),
                    service_account=_opt(entry, "serviceAccount", str, path, ""),
                    trust_domain=_opt(entry, "trustDomain", str, path, ""),
                    node=_opt(entry, "node", str, path, ""),
                    network=_opt(entry, "network", str, path, ""),
                    cluster_id=_opt(entry, "clusterId", str, path, ""),
                    hostname=_opt(entry, "hostname", str, path, ""),
                    workload_name=_opt(entry, "workloadName", str, path, ""),
                    canonical_name=_opt(entry, "canonicalName", str, path, ""),
                    canonical_revision=_opt(entry, "canonicalRevision", str, path, ""),
                    native_tunnel=_opt(entry, "nativeTunnel", bool, path, False))
    if not w.uid:
        w.uid = f"{w.cluster_id}//Pod/{w.namespace}/{w.name}"
    for i, ip in enumerate(_req(entry, "workloadIps", list, path)):
        try:
            w.addresses.append(ipaddress.ip_address(str(ip)).packed)
        except ValueError:
            raise TranslateError(f"field '{path}.workloadIps[{i}]' is not an IP: {ip!r}") from None
    w.tunnel_protocol = _enum(entry.get("protocol", "TCP"), {"TCP": wl.NONE, "HBONE": wl.HBONE},
                              f"{path}.protocol")
    w.network_mode = _enum(entry.get("networkMode", "Standard"),
                           {"Standard": wl.STANDARD, "HostNetwork": wl.HOST_NETWORK},
                           f"{path}.networkMode")
    w.status = _enum(entry.get("status", "Healthy"),
                     {"Healthy": wl.HEALTHY, "Unhealthy": wl.UNHEALTHY}, f"{path}.status")
    w.workload_type = _enum(str(entry.get("workloadType", "deployment")).lower(), _WTYPES,
                            f"{path}.workloadType")
    if "capacity" in entry:
        w.capacity.CopyFrom(wrappers_pb2.UInt32Value(value=_req(entry, "capacity", int, path)))
    if entry.get("applicationTunnel"):
        at = entry["applicationTunnel"]
        w.application_tunnel.protocol = _enum(at.get("protocol", "NONE"), {
            "NONE": wl.ApplicationTunnel.NONE, "PROXY": wl.ApplicationTunnel.PROXY},
            f"{path}.applicationTunnel.protocol")
        w.application_tunnel.port = int(at.get("port") or 0)
    for key, target in (("waypoint", w.waypoint), ("networkGateway", w.network_gateway)):
        if entry.get(key):
            target.CopyFrom(gateway_address(entry[key], f"{path}.{key}"))
    if entry.get("locality"):
        loc = entry["locality"]
        w.locality.CopyFrom(wl.Locality(region=str(loc.get("region", "")),
                                        zone=str(loc.get("zone", "")),
                                        subzone=str(loc.get("subzone", ""))))
    w.authorization_policies.extend(str(p) for p in
                                    _opt(entry, "authorizationPolicies", list, path, []))
    services = _req(entry, "services", dict, path)
    for key, ports in services.items():
        if "/" not in str(key):
            raise TranslateError(f"field '{path}.services' key must be namespace/hostname, "
                                 f"got {key!r}")
        w.services[str(key)].ports.extend(_port_map(ports or {}, f"{path}.services.{key}"))
    return w


def service(entry: Any, path: str = "service") -> wl.Service:
    """A LocalService entry -> Service. Raises TranslateError naming the field."""
    if not isinstance(entry, dict):
        raise TranslateError(f"field {path!r} must be a mapping, got {entry!r}")
    s = wl.Service(name=_req(entry, "name", str, path), namespace=_req(entry, "namespace", str, path),
                   hostname=_req(entry, "hostname", str, path),
                   canonical=_opt(entry, "canonical", bool, path, False))
    for i, vip in enumerate(_req(entry, "vips", list, path)):
        s.addresses.append(network_address(vip, f"{path}.vips[{i}]"))
    for i, c in enumerate(_opt(entry, "cidrVips", list, path, [])):
        try:
            net = ipaddress.ip_network(str(c.get("cidr")), strict=False)
        except (ValueError, AttributeError):
            raise TranslateError(f"field '{path}.cidrVips[{i}].cidr' is not a CIDR: {c!r}") \
                from None
        s.addresses.append(wl.NetworkAddress(network=str(c.get("network") or ""),
                                             address=net.network_address.packed,
                                             length=net.prefixlen))
    s.ports.extend(_port_map(_req(entry, "ports", dict, path), f"{path}.ports"))
    s.subject_alt_names.extend(str(x) for x in _opt(entry, "subjectAltNames", list, path, []))
    if entry.get("waypoint"):
        s.waypoint.CopyFrom(gateway_address(entry["waypoint"], f"{path}.waypoint"))
    for i, ww in enumerate(_opt(entry, "weightedWaypoints", list, path, [])):
        s.weighted_waypoints.append(wl.WeightedWaypoint(
            destination=gateway_address((ww or {}).get("destination"),
                                        f"{path}.weightedWaypoints[{i}].destination"),
            weight=int((ww or {}).get("weight") or 0)))
    lb = entry.get("loadBalancer")
    if lb:
        s.load_balancing.routing_preference.extend(
            _enum(x, _SCOPES, f"{path}.loadBalancer.routingPreferences")
            for x in lb.get("routingPreferences") or [])
        s.load_balancing.mode = _enum(lb.get("mode", "Standard"), _MODES,
                                      f"{path}.loadBalancer.mode")
        s.load_balancing.health_policy = _enum(
            lb.get("healthPolicy", "OnlyHealthy"),
            {"OnlyHealthy": wl.LoadBalancing.ONLY_HEALTHY, "AllowAll": wl.LoadBalancing.ALLOW_ALL},
            f"{path}.loadBalancer.healthPolicy")
    if entry.get("ipFamilies"):
        s.ip_families = _enum(entry["ipFamilies"], {"Dual": wl.DUAL, "IPv4": wl.IPV4_ONLY,
                                                    "IPv6": wl.IPV6_ONLY}, f"{path}.ipFamilies")
    s.visibility = _enum(entry.get("visibility", "Public"), {
        "Public": wl.Service.PUBLIC, "Namespace": wl.Service.NAMESPACE}, f"{path}.visibility")
    return s


def _string_match(value: Any, path: str) -> az.StringMatch:
    if isinstance(value, dict) and len(value) == 1:
        (k, v), = value.items()
        if k in ("Exact", "Prefix", "Suffix") and isinstance(v, str):
            return az.StringMatch(**{k.lower(): v})
        if k == "Presence":
            return az.StringMatch(presence=empty_pb2.Empty())
    raise TranslateError(f"field {path!r} must be {{Exact|Prefix|Suffix: string}} or "
                         f"{{Presence: []}}, got {value!r}")


def _cidr(value: Any, path: str) -> az.Address:
    try:
        net = ipaddress.ip_network(str(value), strict=False)
    except ValueError:
        # ztunnel's serde fails the whole file on an IpNet it can't parse
        raise TranslateError(f"field {path!r} must be an IP or CIDR, got {value!r}") from None
    return az.Address(address=net.network_address.packed, length=net.prefixlen)


def _sa_match(value: Any, path: str) -> az.ServiceAccountMatch:
    if isinstance(value, dict) and set(value) == {"namespace", "serviceAccount"} and \
            all(isinstance(v, str) for v in value.values()):
        return az.ServiceAccountMatch(namespace=value["namespace"],
                                      serviceAccount=value["serviceAccount"])
    raise TranslateError(f"field {path!r} must be {{namespace: string, serviceAccount: "
                         f"string}}, got {value!r}")


def _u16(value: Any, path: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 65535:
        return value
    raise TranslateError(f"field {path!r} must be a port 0-65535, got {value!r}")


MATCH_KEYS = ("namespaces", "notNamespaces", "serviceAccounts", "notServiceAccounts",
              "principals", "notPrincipals", "sourceIps", "notSourceIps", "destinationIps",
              "notDestinationIps", "destinationPorts", "notDestinationPorts")
POLICY_KEYS = ("name", "namespace", "scope", "action", "rules", "dryRun")


def _match(entry: Any, path: str) -> az.Match:
    """One ``RbacMatch``. Every value must convert; an unknown key is an error.

    ztunnel's serde ignores unknown keys here (``RbacMatch`` lacks
    ``deny_unknown_fields``), which silently widens or empties the match, so a typo such
    as ``sourceIp`` would change who is allowed. We refuse the key instead, which makes the
    whole document fail to load (see :func:`to_objects`), as any other error does in ztunnel.
    """
    if not isinstance(entry, dict):
        raise TranslateError(f"field {path!r} must be a mapping, got {entry!r}")
    m = az.Match()
    convert = {"namespaces": (m.namespaces, _string_match),
               "notNamespaces": (m.not_namespaces, _string_match),
               "principals": (m.principals, _string_match),
               "notPrincipals": (m.not_principals, _string_match),
               "sourceIps": (m.source_ips, _cidr), "notSourceIps": (m.not_source_ips, _cidr),
               "destinationIps": (m.destination_ips, _cidr),
               "notDestinationIps": (m.not_destination_ips, _cidr),
               "serviceAccounts": (m.service_accounts, _sa_match),
               "notServiceAccounts": (m.not_service_accounts, _sa_match),
               "destinationPorts": (m.destination_ports, _u16),
               "notDestinationPorts": (m.not_destination_ports, _u16)}
    for key, value in entry.items():
        sub = f"{path}.{key}"
        if key not in convert:
            raise TranslateError(f"unknown match field {sub!r} (known: {', '.join(MATCH_KEYS)})")
        if not isinstance(value, list):
            raise TranslateError(f"field {sub!r} must be a list, got {value!r}")
        target, fn = convert[key]
        target.extend(fn(v, f"{sub}[{i}]") for i, v in enumerate(value))
    return m


def policy(entry: Any, path: str = "policy") -> az.Authorization:
    """A LocalPolicy entry -> Authorization. All six keys are required and no other is
    allowed, as ztunnel's ``Authorization`` (``deny_unknown_fields``); ``rules`` is a list
    of rules, each a list of clauses, each a list of matches. Raises TranslateError."""
    if not isinstance(entry, dict):
        raise TranslateError(f"field {path!r} must be a mapping, got {entry!r}")
    extra = [k for k in entry if k not in POLICY_KEYS]
    if extra:
        raise TranslateError(f"unknown policy field {path}.{extra[0]!r} "
                             f"(known: {', '.join(POLICY_KEYS)})")
    out = az.Authorization(
        name=_req(entry, "name", str, path), namespace=_req(entry, "namespace", str, path),
        scope=_enum(entry.get("scope"), {"Global": az.GLOBAL, "Namespace": az.NAMESPACE,
                                         "WorkloadSelector": az.WORKLOAD_SELECTOR},
                    f"{path}.scope"),
        action=_enum(entry.get("action"), {"Allow": az.ALLOW, "Deny": az.DENY}, f"{path}.action"),
        dry_run=_req(entry, "dryRun", bool, path))
    for i, rule in enumerate(_req(entry, "rules", list, path)):
        if not isinstance(rule, list):
            raise TranslateError(f"field '{path}.rules[{i}]' must be a list of clauses, "
                                 f"got {rule!r}")
        group = out.groups.add()
        for j, clause in enumerate(rule):
            if not isinstance(clause, list):
                raise TranslateError(f"field '{path}.rules[{i}][{j}]' must be a list of "
                                     f"matches, got {clause!r}")
            rules = group.rules.add()
            for k, match in enumerate(clause):
                rules.matches.append(_match(match, f"{path}.rules[{i}][{j}][{k}]"))
    return out


def to_objects(doc: dict) -> list[tuple[dict | None, str, str]]:
    """Split a local-config document into store objects, all or nothing.

    Returns ``(object or None, label, error)`` per entry: ``label`` names the entry
    (``workloads[2] default/local``), ``error`` is empty when the entry converted. Never
    raises. When any entry fails, only the error rows are returned: ztunnel deserializes
    the file as one ``LocalConfig`` and loads nothing of it on any error, and loading the
    rest would be a silent allow whenever the bad entry is a policy (a missing DENY, or a
    missing ALLOW that was the only one for a workload).
    """
    out: list[tuple[dict | None, str, str]] = []
    for key, kind, convert in (("workloads", "LocalWorkload", workload),
                               ("services", "LocalService", service),
                               ("policies", "LocalPolicy", policy)):
        entries = doc.get(key) or []
        if not isinstance(entries, list):
            out.append((None, key, f"field {key!r} must be a list, got {entries!r}"))
            continue
        for i, entry in enumerate(entries):
            label = f"{key}[{i}]"
            try:
                msg = convert(entry, label)
            except TranslateError as e:
                out.append((None, label, str(e)))
                continue
            except (TypeError, ValueError, AttributeError, KeyError) as e:
                # a field of an unexpected shape the converters don't check one by one
                # (``applicationTunnel: "x"``, ``protocol: [1]``): skip this entry only
                out.append((None, label, f"malformed entry: {type(e).__name__}: {e}"))
                continue
            name = getattr(msg, {"LocalWorkload": "uid", "LocalService": "hostname",
                                 "LocalPolicy": "name"}[kind])
            obj = {"apiVersion": "ztunnel.local/v1", "kind": kind,
                   "metadata": {"name": name.replace("/", "~"), "namespace": msg.namespace},
                   "spec": entry}
            out.append((obj, f"{label} {msg.namespace}/{name}", ""))
    if any(obj is None for obj, _, _ in out):
        return [row for row in out if row[0] is None]
    return out
