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
import logging
from typing import Any, Mapping, TypeVar

from google.protobuf import empty_pb2, wrappers_pb2

from ambient import authorization_pb2 as az
from ambient import workload_pb2 as wl
from ambient.objects import TranslateError

log = logging.getLogger(__name__)

LOCAL_KEYS = frozenset({"workloads", "services", "policies"})


class Tagged(dict):
    """A YAML node written with a local tag (``!Exact a``, ``!Presence []``, ``!Allow``):
    ``{"tag": "Exact", "value": "a", "node": "scalar"|"sequence"|"mapping", "plain_empty":
    bool}``. ztunnel's YAML reader (serde_yaml 0.9) reads an enum *only* from a tag or,
    for a unit variant, a plain scalar naming it; a one-key mapping such as ``{Exact: a}``
    is refused. A dict subclass so that it copies and compares like the rest of a spec;
    only the YAML loader makes one, so no mapping written in a file can pose as one."""

    @property
    def tag(self) -> str:
        return str(self["tag"])

    @property
    def value(self) -> Any:
        return self["value"]


WORKLOAD_KEYS = ("workloadIps", "waypoint", "networkGateway", "protocol", "networkMode", "uid",
                 "name", "namespace", "trustDomain", "serviceAccount", "network",
                 "workloadName", "workloadType", "canonicalName", "canonicalRevision",
                 "hostname", "node", "nativeTunnel", "applicationTunnel",
                 "authorizationPolicies", "status", "clusterId", "locality", "services",
                 "capacity")
SERVICE_KEYS = ("name", "namespace", "hostname", "vips", "cidrVips", "ports", "endpoints",
                "subjectAltNames", "waypoint", "weightedWaypoints", "loadBalancer",
                "ipFamilies", "canonical", "visibility")


def _no_tag(value: Any, path: str) -> None:
    """ztunnel's ``LocalWorkload`` flattens ``Workload`` in, so serde buffers every workload
    field before reading it, and that buffer refuses a YAML tag anywhere inside (only
    ``services``, a field of ``LocalWorkload`` itself, is read directly)."""
    if isinstance(value, Tagged):
        raise TranslateError(f"field {path!r}: a YAML tag (!{value.tag}) is refused here by "
                             f"ztunnel (a workload's fields take plain values: "
                             f"'protocol: HBONE')")
    if isinstance(value, dict):
        for k, v in value.items():
            _no_tag(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _no_tag(v, f"{path}[{i}]")


def _only(entry: dict, allowed: tuple[str, ...], path: str) -> None:
    """ztunnel's ``deny_unknown_fields``: a key it does not know fails the document."""
    for key in entry:
        if key not in allowed:
            raise TranslateError(f"unknown field '{path}.{key}' (ztunnel refuses it; known: "
                                 f"{', '.join(allowed)})")
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
    """A unit enum variant as serde_yaml reads one: a plain scalar naming it, or its tag
    with nothing after it (``!Allow``)."""
    if isinstance(value, Tagged):
        if value.tag in table and value["plain_empty"]:
            return table[value.tag]
        raise TranslateError(f"field {path!r} must be one of {', '.join(table)}, got the tag "
                             f"!{value.tag} with {value.value!r}")
    if not isinstance(value, str) or value not in table:
        raise TranslateError(f"field {path!r} must be one of {', '.join(table)}, got {value!r}")
    return table[value]


def _u16(value: Any, path: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 65535:
        return value
    raise TranslateError(f"field {path!r} must be a port 0-65535, got {value!r}")


def network_address(text: Any, path: str) -> wl.NetworkAddress:
    """``network/IP`` split at the first ``/`` as ztunnel's ``NetworkAddress`` (an empty
    network is ``/IP``; a bare IP is refused)."""
    network, sep, ip = text.partition("/") if isinstance(text, str) else ("", "", "")
    try:
        if not sep:
            raise ValueError
        return wl.NetworkAddress(network=network, address=ipaddress.ip_address(ip).packed)
    except ValueError:
        raise TranslateError(f"field {path!r} must be 'network/IP' (an empty network is "
                             f"'/IP'), got {text!r}") from None


def gateway_address(entry: Any, path: str) -> wl.GatewayAddress:
    """``{destination: network/IP | namespace/hostname, hboneMtlsPort}``, nothing else."""
    if not isinstance(entry, dict) or isinstance(entry, Tagged):
        raise TranslateError(f"field {path!r} must be a mapping, got {entry!r}")
    _only(entry, ("destination", "hboneMtlsPort"), path)
    dest = _req(entry, "destination", str, path)
    port = _u16(entry.get("hboneMtlsPort"), f"{path}.hboneMtlsPort")
    first, sep, rest = dest.partition("/")
    if not sep:
        raise TranslateError(f"field '{path}.destination' must be 'network/IP' or "
                             f"'namespace/hostname', got {dest!r}")
    try:
        ip = ipaddress.ip_address(rest).packed
        return wl.GatewayAddress(address=wl.NetworkAddress(network=first, address=ip),
                                 hbone_mtls_port=port)
    except ValueError:
        return wl.GatewayAddress(hostname=wl.NamespacedHostname(namespace=first, hostname=rest),
                                 hbone_mtls_port=port)


def _port_map(value: Any, path: str) -> list[wl.Port]:
    """ztunnel's ``HashMap<u16, u16>``: integer keys and values (a quoted ``"80"`` is a
    string to serde_yaml, not a port); null is an empty map."""
    if value is None:
        return []
    if not isinstance(value, dict) or isinstance(value, Tagged):
        raise TranslateError(f"field {path!r} must map servicePort to targetPort, got {value!r}")
    return [wl.Port(service_port=_u16(k, f"{path} key {k!r}"),
                    target_port=_u16(v, f"{path}.{k}")) for k, v in value.items()]


def _locality(value: Any, path: str) -> wl.Locality:
    """ztunnel's ``Locality``: ``region``, ``zone`` and ``subzone`` all required (other
    keys are ignored, as its struct allows)."""
    if not isinstance(value, dict) or isinstance(value, Tagged):
        raise TranslateError(f"field {path!r} must be a mapping, got {value!r}")
    return wl.Locality(region=_req(value, "region", str, path),
                       zone=_req(value, "zone", str, path),
                       subzone=_req(value, "subzone", str, path))


def workload(entry: Any, path: str = "workload") -> wl.Workload:
    """A LocalWorkload entry -> Workload. Raises TranslateError naming the field."""
    if not isinstance(entry, dict) or isinstance(entry, Tagged):
        raise TranslateError(f"field {path!r} must be a mapping, got {entry!r}")
    _only(entry, WORKLOAD_KEYS, path)
    for key, value in entry.items():
        if key != "services":
            _no_tag(value, f"{path}.{key}")
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
    # ztunnel keeps workloadType as any string; the workload API has four values
    wtype = _opt(entry, "workloadType", str, path, "")
    w.workload_type = _WTYPES.get(wtype.lower(), wl.DEPLOYMENT)
    if wtype and wtype.lower() not in _WTYPES:
        log.warning("field '%s.workloadType' %r has no workload-API value (%s); sent as "
                    "deployment", path, wtype, ", ".join(_WTYPES))
    if entry.get("capacity") is not None:
        capacity = entry["capacity"]
        if isinstance(capacity, bool) or not isinstance(capacity, int) \
                or not 0 <= capacity < 2 ** 32:
            raise TranslateError(f"field '{path}.capacity' must be an unsigned 32-bit number, "
                                 f"got {capacity!r}")
        w.capacity.CopyFrom(wrappers_pb2.UInt32Value(value=capacity))
    at = entry.get("applicationTunnel")
    if at is not None:
        at_path = f"{path}.applicationTunnel"
        if not isinstance(at, dict) or isinstance(at, Tagged):
            raise TranslateError(f"field {at_path!r} must be a mapping, got {at!r}")
        _only(at, ("protocol", "port"), at_path)
        w.application_tunnel.protocol = _enum(at.get("protocol"), {
            "NONE": wl.ApplicationTunnel.NONE, "PROXY": wl.ApplicationTunnel.PROXY},
            f"{at_path}.protocol")
        if at.get("port") is not None:
            w.application_tunnel.port = _u16(at["port"], f"{at_path}.port")
    for key, target in (("waypoint", w.waypoint), ("networkGateway", w.network_gateway)):
        if entry.get(key) is not None:
            target.CopyFrom(gateway_address(entry[key], f"{path}.{key}"))
    if entry.get("locality") is not None:
        w.locality.CopyFrom(_locality(entry["locality"], f"{path}.locality"))
    for i, p in enumerate(_opt(entry, "authorizationPolicies", list, path, [])):
        if not isinstance(p, str):
            raise TranslateError(f"field '{path}.authorizationPolicies[{i}]' must be a "
                                 f"string, got {p!r}")
        w.authorization_policies.append(p)
    services = _req(entry, "services", dict, path)
    for key, ports in services.items():
        if not isinstance(key, str) or "/" not in key:
            raise TranslateError(f"field '{path}.services' key must be namespace/hostname, "
                                 f"got {key!r}")
        w.services[key].ports.extend(_port_map(ports, f"{path}.services.{key}"))
    return w


def _ip_net(value: Any, path: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """An ``ipnet::IpNet``: ``address/length`` (host bits allowed; a bare IP is refused)."""
    try:
        if not isinstance(value, str) or "/" not in value:
            raise ValueError
        return ipaddress.ip_network(value, strict=False)
    except ValueError:
        raise TranslateError(f"field {path!r} must be an IP network 'address/length', "
                             f"got {value!r}") from None


def _endpoints(value: Any, path: str) -> int:
    """Validate ztunnel's ``endpoints`` map (uid -> ``{workloadUid, port, status}``);
    returns how many. The workload API carries endpoints through the workloads'
    ``services``, so they are checked, not sent."""
    if value is None:
        return 0
    if not isinstance(value, dict) or isinstance(value, Tagged):
        raise TranslateError(f"field {path!r} must map workload uids to endpoints, "
                             f"got {value!r}")
    for uid, ep in value.items():
        sub = f"{path}.{uid}"
        if not isinstance(ep, dict) or isinstance(ep, Tagged):
            raise TranslateError(f"field {sub!r} must be a mapping, got {ep!r}")
        _only(ep, ("workloadUid", "port", "status"), sub)
        _req(ep, "workloadUid", str, sub)
        if "port" not in ep:
            raise TranslateError(f"field '{sub}.port' is required")
        _port_map(ep["port"], f"{sub}.port")
        _enum(ep.get("status"), {"Healthy": 0, "Unhealthy": 1}, f"{sub}.status")
    return len(value)


def service(entry: Any, path: str = "service") -> wl.Service:
    """A LocalService entry -> Service, as ztunnel's ``Service`` reads it
    (``deny_unknown_fields``; ``name``, ``namespace``, ``hostname``, ``vips`` and ``ports``
    required). Raises TranslateError naming the field."""
    if not isinstance(entry, dict) or isinstance(entry, Tagged):
        raise TranslateError(f"field {path!r} must be a mapping, got {entry!r}")
    _only(entry, SERVICE_KEYS, path)
    s = wl.Service(name=_req(entry, "name", str, path), namespace=_req(entry, "namespace", str, path),
                   hostname=_req(entry, "hostname", str, path),
                   canonical=_opt(entry, "canonical", bool, path, False))
    for i, vip in enumerate(_req(entry, "vips", list, path)):
        s.addresses.append(network_address(vip, f"{path}.vips[{i}]"))
    for i, c in enumerate(_opt(entry, "cidrVips", list, path, [])):
        sub = f"{path}.cidrVips[{i}]"
        if not isinstance(c, dict) or isinstance(c, Tagged):
            raise TranslateError(f"field {sub!r} must be {{network, cidr}}, got {c!r}")
        network = _req(c, "network", str, sub)
        net = _ip_net(c.get("cidr"), f"{sub}.cidr")
        s.addresses.append(wl.NetworkAddress(network=network, address=net.network_address.packed,
                                             length=net.prefixlen))
    if "ports" not in entry:
        raise TranslateError(f"field '{path}.ports' is required")
    s.ports.extend(_port_map(entry["ports"], f"{path}.ports"))
    if _endpoints(entry.get("endpoints"), f"{path}.endpoints"):
        log.warning("field '%s.endpoints' is not sent: the workload API takes a service's "
                    "endpoints from the workloads that list it (their 'services')", path)
    for i, san in enumerate(_opt(entry, "subjectAltNames", list, path, [])):
        if not isinstance(san, str):
            raise TranslateError(f"field '{path}.subjectAltNames[{i}]' must be a string, "
                                 f"got {san!r}")
        s.subject_alt_names.append(san)
    if entry.get("waypoint") is not None:
        s.waypoint.CopyFrom(gateway_address(entry["waypoint"], f"{path}.waypoint"))
    for i, ww in enumerate(_opt(entry, "weightedWaypoints", list, path, [])):
        sub = f"{path}.weightedWaypoints[{i}]"
        if not isinstance(ww, dict) or isinstance(ww, Tagged):
            raise TranslateError(f"field {sub!r} must be {{destination, weight}}, got {ww!r}")
        _only(ww, ("destination", "weight"), sub)
        weight = ww.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, int) or not 0 <= weight < 2 ** 32:
            raise TranslateError(f"field '{sub}.weight' must be an unsigned 32-bit number, "
                                 f"got {weight!r}")
        s.weighted_waypoints.append(wl.WeightedWaypoint(
            destination=gateway_address(ww.get("destination"), f"{sub}.destination"),
            weight=weight))
    lb = entry.get("loadBalancer")
    if lb is not None:
        sub = f"{path}.loadBalancer"
        if not isinstance(lb, dict) or isinstance(lb, Tagged):
            raise TranslateError(f"field {sub!r} must be a mapping, got {lb!r}")
        _only(lb, ("routingPreferences", "mode", "healthPolicy"), sub)
        s.load_balancing.routing_preference.extend(
            _enum(x, _SCOPES, f"{sub}.routingPreferences[{i}]")
            for i, x in enumerate(_req(lb, "routingPreferences", list, sub)))
        s.load_balancing.mode = _enum(lb.get("mode"), _MODES, f"{sub}.mode")
        s.load_balancing.health_policy = _enum(
            lb.get("healthPolicy"),
            {"OnlyHealthy": wl.LoadBalancing.ONLY_HEALTHY, "AllowAll": wl.LoadBalancing.ALLOW_ALL},
            f"{sub}.healthPolicy")
    if entry.get("ipFamilies") is not None:
        s.ip_families = _enum(entry["ipFamilies"], {"Dual": wl.DUAL, "IPv4": wl.IPV4_ONLY,
                                                    "IPv6": wl.IPV6_ONLY}, f"{path}.ipFamilies")
    s.visibility = _enum(entry.get("visibility", "Public"), {
        "Public": wl.Service.PUBLIC, "Namespace": wl.Service.NAMESPACE}, f"{path}.visibility")
    return s


def _string_match(value: Any, path: str) -> az.StringMatch:
    """ztunnel's ``StringMatch`` as serde_yaml reads it: a YAML tag, ``!Exact a``,
    ``!Prefix a``, ``!Suffix a`` (a scalar) or ``!Presence []`` / ``!Presence`` (nothing).
    The one-key mapping ``{Exact: a}`` is refused, as ztunnel refuses it."""
    if isinstance(value, Tagged):
        tag, inner = value.tag, value.value
        if tag in ("Exact", "Prefix", "Suffix") and value["node"] == "scalar":
            return az.StringMatch(**{tag.lower(): str(inner)})
        if tag == "Presence" and (value["plain_empty"] or inner == []):
            return az.StringMatch(presence=empty_pb2.Empty())
        raise TranslateError(f"field {path!r}: the tag !{tag} with {inner!r} is not a "
                             f"StringMatch (!Exact|!Prefix|!Suffix <string>, !Presence [])")
    if isinstance(value, dict) and len(value) == 1:
        (k, v), = value.items()
        raise TranslateError(f"field {path!r} must be a YAML tag, '!{k} {v}', not the mapping "
                             f"{{{k}: {v}}} (ztunnel reads StringMatch only as a tag)")
    raise TranslateError(f"field {path!r} must be !Exact|!Prefix|!Suffix <string> or "
                         f"!Presence [], got {value!r}")


def _cidr(value: Any, path: str) -> az.Address:
    # ztunnel's serde fails the whole file on an IpNet it can't parse
    net = _ip_net(value, path)
    return az.Address(address=net.network_address.packed, length=net.prefixlen)


def _sa_match(value: Any, path: str) -> az.ServiceAccountMatch:
    if isinstance(value, dict) and set(value) == {"namespace", "serviceAccount"} and \
            all(isinstance(v, str) for v in value.values()):
        return az.ServiceAccountMatch(namespace=value["namespace"],
                                      serviceAccount=value["serviceAccount"])
    raise TranslateError(f"field {path!r} must be {{namespace: string, serviceAccount: "
                         f"string}}, got {value!r}")


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
    if not isinstance(entry, dict) or isinstance(entry, Tagged):
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
    if not isinstance(entry, dict) or isinstance(entry, Tagged):
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
