"""AuthorizationPolicy and PeerAuthentication -> ``istio.security.Authorization``
(``docs/ambient.md``; istiod's pilot/pkg/serviceregistry/ambient/authorization.go).

ztunnel enforces L4 only, so a rule is cut down to what a connection shows (peer identity,
source/destination IP, destination port) and the cut always errs on the closed side:

- ALLOW allows *less*: a rule with any condition ztunnel cannot check (an HTTP attribute
  such as ``methods``/``paths``/``requestPrincipals``/``request.headers[...]``, a
  ``trustDomains`` list, a key this translator does not know, a field of the wrong shape,
  a value that does not convert such as ``ports: ["eighty"]``) is dropped whole. An ALLOW
  left without rules still exists and matches nothing, so the workloads it selects accept
  nothing (istiod does the same).
- DENY denies *more*: such conditions are taken as true (a positive list holding a value
  that does not convert imposes nothing; such a value is left out of a negative list), the
  L4 conditions of the rule are kept, and a rule whose conditions were all of that kind
  denies every connection the policy selects. This is the Envoy TCP-filter semantics
  istiod's validation warns about ("will deny all traffic to TCP ports under its scope due
  to the use of only HTTP attributes in a DENY rule"). istiod's ambient translation
  instead sends empty matches, which ztunnel skips, so there the DENY never fires; we do
  not copy that fail-open.
- A policy that can't be read at the top still exists, closed: ``spec.rules`` that is not
  a list makes an ALLOW match nothing and a DENY match every connection; an ``action``
  that is not ALLOW/DENY/AUDIT/CUSTOM is a DENY of every connection; a ``spec.selector``
  that is not a mapping of strings widens the policy to its namespace (the mesh in the
  root namespace). A schema-checking API server refuses such objects; the files source
  and schema-less CRDs do not, and dropping the policy would allow what it should stop.

How ztunnel evaluates what we send (src/rbac.rs ``Authorization::matches``): a policy
with no groups matches nothing; a group matches when every clause does; a group with no
clauses matches everything; a clause matches when any of its matches does, and a clause
with no matches matches; an empty ``Match`` is skipped (matches nothing); inside a match
every attribute must hold, an empty list imposes nothing. So an unconstrained clause is
left out (an empty match would make it match nothing). Each translation returns the
reason text to log once, as istiod writes it into the policy's status.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
from typing import Any, Iterator

from google.protobuf import empty_pb2

from ambient import authorization_pb2 as az
from agent.core.yamlsafe import short_repr, short_text
from ambient.objects import annotations_of, meta, spec

log = logging.getLogger(__name__)

STATIC_STRICT = "istio_converted_static_strict"
#: name suffix of the variant of a selector policy that workloads bound to a waypoint list
WAYPOINT_VARIANT = "~waypoint-bound"
CONVERTED_PREFIX = "converted_peer_authentication_"

L7_OPERATION = ("hosts", "notHosts", "methods", "notMethods", "paths", "notPaths")
L7_SOURCE = ("requestPrincipals", "notRequestPrincipals", "remoteIpBlocks",
             "notRemoteIpBlocks")
# Identity attributes istiod's ambient translation does not carry to ztunnel.
UNSENT_SOURCE = ("trustDomains", "notTrustDomains")
L4_WHEN = ("source.namespace", "source.principal", "source.ip", "destination.port",
           "destination.ip")
L4_SOURCE = ("principals", "notPrincipals", "namespaces", "notNamespaces", "ipBlocks",
             "notIpBlocks", "serviceAccounts", "notServiceAccounts")
L4_OPERATION = ("ports", "notPorts")
KNOWN_RULE_KEYS = {"from", "to", "when"}


def string_match(value: str) -> az.StringMatch:
    """``*`` -> presence, ``*x`` -> suffix, ``x*`` -> prefix, else exact."""
    if value == "*":
        return az.StringMatch(presence=empty_pb2.Empty())
    if value.startswith("*"):
        return az.StringMatch(suffix=value[1:])
    if value.endswith("*"):
        return az.StringMatch(prefix=value[:-1])
    return az.StringMatch(exact=value)


def cidr(value: str) -> az.Address | None:
    """IP -> /32 or /128, CIDR -> its prefix; None for anything else (matches nothing)."""
    try:
        net = ipaddress.ip_network(str(value).strip(), strict=False)
    except ValueError:
        return None
    return az.Address(address=net.network_address.packed, length=net.prefixlen)


def port(value: Any) -> int | None:
    """A numeric port 1-65535; None for ``"http"``, 0 or > 65535 (they match nothing)."""
    text = str(value).strip()
    return int(text) if text.isdigit() and 0 < int(text) <= 65535 else None


def ports(values: list) -> list[int]:
    """Numeric ports only; ``"http"`` or > 65535 are dropped."""
    return [p for p in map(port, values) if p is not None]


def service_account(value: str, policy_ns: str) -> az.ServiceAccountMatch | None:
    """``ns/sa`` or ``sa`` (the policy's namespace), split at the first ``/`` as istiod."""
    ns, sep, sa = value.partition("/")
    if not sep:
        ns, sa = policy_ns, value
    if not ns or not sa:
        return None
    return az.ServiceAccountMatch(namespace=ns, serviceAccount=sa)


def _identity_match(value: str) -> az.StringMatch | None:
    # "" can't name a principal or namespace; ztunnel would match it against the empty
    # namespace of a plaintext peer, which is not what the policy says
    return string_match(value) if value else None


HTTP, UNSENT, UNKNOWN, MALFORMED = "http", "unsent", "unknown", "malformed"
# what a value of each L4 list must be (named in the MALFORMED reason)
NAME, IP, SA = "a non-empty string", "an IP address or CIDR", "'namespace/name' or 'name'"
PORT = "a port number 1-65535"


@dataclasses.dataclass
class _Entry:
    """One ``from[i].source``, ``to[i].operation`` or ``when[i]`` as ztunnel can see it.

    ``unchecked`` lists the conditions ztunnel cannot check as ``(kind, name)``: kind
    HTTP (name: the attribute, ``methods``, ``request.headers[x]``), UNSENT (identity
    attributes istiod does not send: ``trustDomains``), UNKNOWN (name: the field's path)
    or MALFORMED (name: ``path must be ..., got value``).
    """

    match: az.Match = dataclasses.field(default_factory=az.Match)
    unchecked: list[tuple[str, str]] = dataclasses.field(default_factory=list)


def _malformed(where: str, what: str, value: Any) -> _Entry:
    return _Entry(unchecked=[(MALFORMED, f"{where} must be {what}, got {short_repr(value)}")])


class _Reader:
    """Reads one rule into clauses of entries; records what ztunnel can't check instead
    of raising, so one bad field never withdraws the whole policy."""

    def __init__(self, policy_ns: str, path: str):
        self.policy_ns = policy_ns
        self.path = path

    @staticmethod
    def _values(container: dict, key: str, path: str, entry: _Entry) -> list[str] | None:
        value = container.get(key)
        if value is None:
            return None
        if not isinstance(value, list):
            entry.unchecked.append((MALFORMED, f"{path}.{key} must be a list, got "
                                               f"{short_repr(value)}"))
            return None
        return [str(v) for v in value]

    def _fill(self, entry: _Entry, container: dict, path: str, fields: tuple) -> None:
        """Convert each ``(key, target, convert, positive, what)``. A value that does not
        convert is MALFORMED (the ALLOW rule is dropped); a positive list holding one is
        left unconstrained and a negative list keeps its other values, so what a DENY
        keeps matches at least every connection the policy names."""
        for key, target, convert, positive, what in fields:
            values = self._values(container, key, path, entry)
            if not values:
                continue
            converted = [convert(v) for v in values]
            bad = [(j, v) for j, (v, c) in enumerate(zip(values, converted)) if c is None]
            for j, v in bad:
                entry.unchecked.append((MALFORMED, f"{path}.{key}[{j}] must be {what}, "
                                                   f"got {short_repr(v)}"))
            if bad and positive:
                continue
            target.extend(c for c in converted if c is not None)

    @staticmethod
    def _extra_keys(entry: _Entry, container: dict, path: str, l4: tuple, http: tuple,
                    unsent: tuple = ()) -> None:
        for key, value in container.items():
            if key in l4 or ((key in http or key in unsent) and not value):
                continue
            kind = HTTP if key in http else UNSENT if key in unsent else UNKNOWN
            entry.unchecked.append((kind, key if kind != UNKNOWN else f"{path}.{key}"))

    def source(self, src: Any, path: str) -> _Entry:
        if not isinstance(src, dict):
            return _malformed(path, "a mapping", src)
        if not src:
            return _Entry(unchecked=[(MALFORMED, f"{path} must not be empty")])
        entry = _Entry()
        m = entry.match
        self._extra_keys(entry, src, path, L4_SOURCE, L7_SOURCE, UNSENT_SOURCE)
        sa = lambda v: service_account(v, self.policy_ns)  # noqa: E731
        self._fill(entry, src, path, (
            ("principals", m.principals, _identity_match, True, NAME),
            ("notPrincipals", m.not_principals, _identity_match, False, NAME),
            ("namespaces", m.namespaces, _identity_match, True, NAME),
            ("notNamespaces", m.not_namespaces, _identity_match, False, NAME),
            ("ipBlocks", m.source_ips, cidr, True, IP),
            ("notIpBlocks", m.not_source_ips, cidr, False, IP),
            ("serviceAccounts", m.service_accounts, sa, True, SA),
            ("notServiceAccounts", m.not_service_accounts, sa, False, SA)))
        return entry

    def operation(self, op: Any, path: str) -> _Entry:
        if not isinstance(op, dict):
            return _malformed(path, "a mapping", op)
        if not op:
            return _Entry(unchecked=[(MALFORMED, f"{path} must not be empty")])
        entry = _Entry()
        self._extra_keys(entry, op, path, L4_OPERATION, L7_OPERATION)
        self._fill(entry, op, path, (
            ("ports", entry.match.destination_ports, port, True, PORT),
            ("notPorts", entry.match.not_destination_ports, port, False, PORT)))
        return entry

    def condition(self, cond: Any, path: str) -> _Entry:
        if not isinstance(cond, dict):
            return _malformed(path, "a mapping", cond)
        entry = _Entry()
        key = cond.get("key")
        for k in cond:
            if k not in ("key", "values", "notValues"):
                entry.unchecked.append((UNKNOWN, f"{path}.{k}"))
        if key not in L4_WHEN:
            entry.unchecked.append((HTTP, str(key)) if isinstance(key, str) and key else
                                   (MALFORMED, f"{path}.key must be a non-empty string, "
                                               f"got {key!r}"))
            return entry
        if not cond.get("values") and not cond.get("notValues"):
            entry.unchecked.append((MALFORMED, f"{path} ({key}) has neither values nor "
                                               "notValues"))
            return entry
        m = entry.match
        pos, neg, convert, what = {
            "source.namespace": (m.namespaces, m.not_namespaces, _identity_match, NAME),
            "source.principal": (m.principals, m.not_principals, _identity_match, NAME),
            "source.ip": (m.source_ips, m.not_source_ips, cidr, IP),
            "destination.ip": (m.destination_ips, m.not_destination_ips, cidr, IP),
            "destination.port": (m.destination_ports, m.not_destination_ports, port, PORT),
        }[key]
        self._fill(entry, cond, path, (("values", pos, convert, True, what),
                                       ("notValues", neg, convert, False, what)))
        return entry

    def _clause(self, rule: dict, key: str, read: Any, inner: str) -> list[_Entry] | None:
        """The entries of ``from``/``to`` (None when the rule has none)."""
        raw = rule.get(key)
        if raw is None or raw == []:
            return None
        if not isinstance(raw, list):
            return [_malformed(f"{self.path}.{key}", "a list", raw)]
        out = []
        for j, item in enumerate(raw):
            where = f"{self.path}.{key}[{j}]"
            if not isinstance(item, dict):
                out.append(_malformed(where, "a mapping", item))
                continue
            entry = read(item.get(inner), f"{where}.{inner}")
            entry.unchecked.extend((UNKNOWN, f"{where}.{k}") for k in item if k != inner)
            out.append(entry)
        return out

    def rule(self, rule: Any) -> list[list[_Entry]]:
        """Clauses of one rule: ``to``, ``from``, then one per ``when`` (istiod's order).

        A rule that is not a mapping yields one clause whose only entry is malformed.
        """
        if not isinstance(rule, dict):
            return [[_malformed(self.path, "a mapping", rule)]]
        clauses = []
        for key, read, inner in (("to", self.operation, "operation"),
                                 ("from", self.source, "source")):
            entries = self._clause(rule, key, read, inner)
            if entries is not None:
                clauses.append(entries)
        when = rule.get("when")
        if isinstance(when, list):
            clauses.extend([self.condition(c, f"{self.path}.when[{j}]")]
                           for j, c in enumerate(when))
        elif when is not None:
            clauses.append([_malformed(f"{self.path}.when", "a list", when)])
        extra = [(UNKNOWN, f"{self.path}.{k}") for k in rule if k not in KNOWN_RULE_KEYS]
        if extra:
            clauses.append([_Entry(unchecked=extra)])
        return clauses


def _group(clauses: list[list[_Entry]], action: str) -> az.Group | None:
    """One translated rule, or None when it is not sent (see the module docstring)."""
    if action == "ALLOW" and any(e.unchecked for c in clauses for e in c):
        return None
    group = az.Group()
    for clause in clauses:
        if any(e.match.ByteSize() == 0 for e in clause):
            continue  # some entry holds (for DENY: may hold) for every connection
        group.rules.add().matches.extend(e.match for e in clause)
    return group


@dataclasses.dataclass
class PolicyTranslation:
    """What :func:`authorization_policy` produced.

    ``policy`` is None when nothing is sent to ztunnel (waypoint, AUDIT/CUSTOM, dry-run).
    ``note`` is the status text about HTTP attributes (log at info); ``problems`` name
    unknown or malformed fields and what was done about them (log at warning).
    Unpacks as ``policy, note``.
    """

    policy: az.Authorization | None
    note: str = ""
    problems: list[str] = dataclasses.field(default_factory=list)
    #: for a WORKLOAD_SELECTOR DENY policy with rules widened to every connection: the
    #: same policy without them, named ``<name>~waypoint-bound``, for the workloads bound
    #: to a waypoint (their HTTP rules belong to the waypoint; upstream's translation
    #: never fires such rules at ztunnel)
    waypoint_variant: az.Authorization | None = None

    def __iter__(self) -> Iterator[az.Authorization | str | None]:
        return iter((self.policy, self.note))


def _selector_scope(s: dict, ns: str, root_ns: str, problems: list[str]) -> az.Scope:
    """WORKLOAD_SELECTOR for a readable ``spec.selector``; without one, or when it can't be
    read (a problem is recorded), NAMESPACE, or GLOBAL in the root namespace."""
    wide = az.GLOBAL if ns == root_ns else az.NAMESPACE
    if "selector" not in s or s["selector"] is None:
        return wide
    selector = s["selector"]
    labels = selector.get("matchLabels") if isinstance(selector, dict) else None
    if isinstance(selector, dict) and (labels is None or (isinstance(labels, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels.items()))):
        return az.WORKLOAD_SELECTOR
    where, value = (("spec.selector.matchLabels", labels) if isinstance(selector, dict)
                    else ("spec.selector", selector))
    problems.append(f"field {where!r} must map strings to strings, got {short_repr(value)} "
                    "(applied to every workload of " +
                    ("the mesh)" if wide == az.GLOBAL else f"namespace {ns})"))
    return wide


def authorization_policy(policy: dict, root_ns: str) -> PolicyTranslation:
    """One AuthorizationPolicy -> :class:`PolicyTranslation`.

    Nothing is sent when the policy is for waypoints (``targetRef(s)``), has action
    AUDIT/CUSTOM, or is a dry-run policy (not enabled here, as Istio's default). Never
    raises on a bad field: an unreadable ``action``, ``spec.selector`` or ``spec.rules``,
    and unknown or malformed parts of a rule, fail closed as the module docstring says
    and are listed in ``problems`` (one text per rule or top-level field).
    """
    m, s = meta(policy), spec(policy)
    ns, name = m["namespace"], m["name"]
    if s.get("targetRef") or s.get("targetRefs"):
        return PolicyTranslation(None, "targets a waypoint: enforced there, not by ztunnel")
    action = s.get("action")
    action = "ALLOW" if action is None or action == "" else action
    if action in ("AUDIT", "CUSTOM"):
        return PolicyTranslation(None, f"ztunnel does not support the {action} action")
    if annotations_of(policy).get("istio.io/dry-run", "").lower() == "true":
        return PolicyTranslation(None, "dry-run policies are not supported (UnsupportedValue)")
    problems: list[str] = []
    scope = _selector_scope(s, ns, root_ns, problems)
    if action not in ("ALLOW", "DENY"):
        problems.append(f"field 'spec.action' must be one of ALLOW, DENY, AUDIT, CUSTOM, "
                        f"got {short_repr(action)} (enforced as a DENY of every connection)")
        out = az.Authorization(name=name, namespace=ns, scope=scope, action=az.DENY)
        out.groups.add()  # a group with no clauses matches every connection
        return PolicyTranslation(out, "", problems)
    out = az.Authorization(name=name, namespace=ns, scope=scope,
                           action=az.ALLOW if action == "ALLOW" else az.DENY)
    rules = s.get("rules")
    if rules is not None and not isinstance(rules, list):
        problems.append(f"field 'spec.rules' must be a list, got {short_repr(rules)} " + (
            "(this ALLOW allows nothing)" if action == "ALLOW" else
            "(this DENY denies every connection)"))
        if action == "DENY":
            out.groups.add()
        return PolicyTranslation(out, "", problems)
    http: set[str] = set()
    widened = False  # some DENY rule lost every condition and now matches everything
    widened_groups: list[int] = []
    for i, rule in enumerate(rules or []):
        clauses = _Reader(ns, f"spec.rules[{i}]").rule(rule)
        unchecked = [u for c in clauses for e in c for u in e.unchecked]
        http.update(name for kind, name in unchecked if kind in (HTTP, UNSENT))
        group = _group(clauses, action)
        if group is not None:
            out.groups.append(group)
            if action == "DENY" and not group.rules and bool(unchecked):
                widened = True
                widened_groups.append(len(out.groups) - 1)
        bad = [("unknown field " + name) if kind == UNKNOWN else name
               for kind, name in unchecked if kind in (UNKNOWN, MALFORMED)]
        if bad:
            problems.append("; ".join(bad) + (
                " (rule dropped: this ALLOW allows less)" if action == "ALLOW" else
                " (condition taken as matching: this DENY denies more)"))
    note = ""
    if http:
        note = (f"ztunnel does not support HTTP attributes (found: {', '.join(sorted(http))}). "
                "In ambient mode you must use a waypoint proxy to enforce HTTP rules. ")
        if action == "ALLOW":
            note += ("Within an ALLOW policy, rules matching HTTP attributes are omitted. "
                     "This will be more restrictive than requested.")
        else:
            note += ("DENY policy with HTTP attributes is enforced without the HTTP rules. "
                     "This will be more restrictive than requested.")
            if widened:
                note += (" A rule with only HTTP attributes denies every connection to the "
                         "workloads the policy selects" + (
                             " that no waypoint serves." if scope == az.WORKLOAD_SELECTOR
                             else "."))
    variant = None
    if widened_groups and scope == az.WORKLOAD_SELECTOR:
        variant = az.Authorization()
        variant.CopyFrom(out)
        variant.name = name + WAYPOINT_VARIANT
        del variant.groups[:]
        variant.groups.extend(g for i, g in enumerate(out.groups) if i not in widened_groups)
    return PolicyTranslation(out, note, problems, variant)


def deny_everything(policy: dict, root_ns: str) -> az.Authorization:
    """A DENY of every connection in the policy's namespace (the mesh in ``root_ns``): what
    stands for a policy whose translation failed unexpectedly."""
    ns = meta(policy)["namespace"]
    out = az.Authorization(name=meta(policy)["name"], namespace=ns, action=az.DENY,
                           scope=az.GLOBAL if ns == root_ns else az.NAMESPACE)
    out.groups.add()
    return out


# --- PeerAuthentication ---

MODES = ("UNSET", "STRICT", "PERMISSIVE", "DISABLE")


@dataclasses.dataclass
class PeerAuthn:
    """A PeerAuthentication as the index uses it, read so that nothing fails open.

    ``selector``: None for a namespace-wide (mesh-wide in the root namespace) object, else
    its ``matchLabels`` (``{}`` selects every workload). ``mode``: one of :data:`MODES`.
    ``ports``: port (1-65535) -> mode. ``forced``: the selector could not be read, so the
    object is a STRICT namespace-wide policy that beats the readable ones there.
    ``problems``: one text per unreadable field, naming it and its value (escaped, bounded).

    istiod never sees such objects (its CRD schema and webhook reject them); the CRDs in
    ``deploy/crds/`` carry no schema and the files source has none, so here an unreadable
    value is treated as STRICT for what it covers: a bad ``spec.mtls`` -> top mode STRICT; a
    bad port entry's mode -> that port STRICT; a ``portLevelMtls`` that is not a map or has
    a key that is not a port (its coverage unknown) -> STRICT on every port; a bad selector
    -> STRICT for the whole namespace.
    """

    selector: dict[str, str] | None
    mode: str
    ports: dict[int, str]
    forced: bool = False
    problems: list[str] = dataclasses.field(default_factory=list)


def _shown(value: Any) -> str:
    return short_text(repr(value), 120)


def _read_mode(container: Any, path: str, problems: list[str]) -> str:
    if container is None:
        return "UNSET"
    if not isinstance(container, dict):
        problems.append(f"field {path!r} must be a mapping, got {_shown(container)}; "
                        "read as STRICT")
        return "STRICT"
    value = container.get("mode")
    if value is None or value == "":
        return "UNSET"
    if value not in MODES:
        problems.append(f"field '{path}.mode' must be one of {', '.join(MODES)}, got "
                        f"{_shown(value)}; read as STRICT")
        return "STRICT"
    return str(value)


def read_peer_authentication(pa: dict) -> PeerAuthn:
    """``pa`` -> :class:`PeerAuthn`; never raises for any shape of ``spec``."""
    problems: list[str] = []
    raw_spec = pa.get("spec")
    sp = raw_spec if isinstance(raw_spec, dict) else {}
    if raw_spec is not None and not isinstance(raw_spec, dict):
        problems.append(f"field 'spec' must be a mapping, got {_shown(raw_spec)}; read as "
                        "STRICT for its namespace")
        return PeerAuthn(None, "STRICT", {}, True, problems)
    selector: dict[str, str] | None = None
    forced = False
    sel = sp.get("selector")
    if sel is not None:
        labels = sel.get("matchLabels") if isinstance(sel, dict) else None
        if not isinstance(sel, dict) or (labels is not None and not (
                isinstance(labels, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in labels.items()))):
            bad = ("spec.selector", sel) if not isinstance(sel, dict) else \
                ("spec.selector.matchLabels", labels)
            problems.append(f"field {bad[0]!r} must map strings to strings, got "
                            f"{_shown(bad[1])}; read as STRICT for its namespace")
            forced = True
        else:
            selector = dict(labels or {})
    mode = _read_mode(sp.get("mtls"), "spec.mtls", problems)
    ports: dict[int, str] = {}
    every_port = False
    raw = sp.get("portLevelMtls")
    if raw is not None and not isinstance(raw, dict):
        problems.append(f"field 'spec.portLevelMtls' must map ports to {{mode}}, got "
                        f"{_shown(raw)}; read as STRICT on every port")
        every_port = True
    for port, entry in (raw.items() if isinstance(raw, dict) else ()):
        text = str(port)
        if isinstance(port, bool) or not text.isdigit() or not 0 < int(text) <= 65535:
            problems.append(f"field 'spec.portLevelMtls' key must be a port (1-65535), got "
                            f"{_shown(port)}; read as STRICT on every port")
            every_port = True
            continue
        ports[int(text)] = _read_mode(entry, f"spec.portLevelMtls.{text}", problems)
    if forced:
        return PeerAuthn(None, "STRICT", {}, True, problems)
    if every_port:
        return PeerAuthn(selector, "STRICT", {}, False, problems)
    return PeerAuthn(selector, mode, ports, False, problems)


def pa_top_mode(pa: dict) -> str:
    """The top mode of ``pa`` (:func:`read_peer_authentication`: unreadable -> STRICT)."""
    return read_peer_authentication(pa).mode


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
    read = read_peer_authentication(pa)
    if read.selector is None:
        return None
    port_modes = read.ports
    if not port_modes:
        return None
    top = read.mode
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
