"""ztunnel's L4 authorization, ported from its source to judge what we send it.

A faithful port of istio/ztunnel ``src/rbac.rs`` (``Authorization::matches``,
``matches_internal``, ``StringMatch::matches``/``matches_principal``,
``ServiceAccountMatch::matches``, the ``TryFrom<XdsRbac>`` conversion) and of
``DemandProxyState::assert_rbac`` in ``src/state.rs`` with the scope bookkeeping of
``src/state/policy.rs`` (``PolicyStore::insert``), as of ztunnel commit 62d8265 (2026-08).
Written from reading that code, not from our translator, so a test can check "would ztunnel
allow this connection" for the protos our index emits.

The rules it encodes, in ztunnel's words and order:

- a policy with no rules (groups) matches nothing; a rule (group) matches when all of its
  clauses match; a rule with no clauses matches; a clause matches when any of its matches
  does; a clause with no matches matches; an empty match is skipped (never matches);
- inside a match every attribute kind must hold; per kind, a non-empty positive list needs
  one hit and a non-empty negative list needs no hit; empty lists impose nothing;
- principals are compared after stripping ``spiffe://`` (no identity: never matches);
  namespaces compare the peer identity's namespace ("" without identity);
  service accounts need an identity;
- conversion from xDS drops StringMatches without a match type and addresses that are not
  4 or 16 bytes or whose length exceeds the family's bits; ports are cast to u16;
- evaluation: policies of the destination workload's namespace (NAMESPACE scope), of the
  GLOBAL scope and the workload's ``authorization_policies`` keys; unknown keys skipped;
  dry-run policies never decide; any matching DENY denies; no ALLOW allows; a matching
  ALLOW allows; otherwise deny. ztunnel has no AUDIT action.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import Callable, Iterable, Sequence

from ambient import authorization_pb2 as az


@dataclasses.dataclass(frozen=True)
class Identity:
    """``Identity::Spiffe``."""

    trust_domain: str
    namespace: str
    service_account: str

    def __str__(self) -> str:  # Identity's Display / to_strng
        return f"spiffe://{self.trust_domain}/ns/{self.namespace}/sa/{self.service_account}"


@dataclasses.dataclass(frozen=True)
class Connection:
    """``rbac::Connection``: ``src``/``dst`` are (IP text, port)."""

    src: tuple[str, int]
    dst: tuple[str, int]
    src_identity: Identity | None = None


@dataclasses.dataclass(frozen=True)
class StringMatch:
    kind: str  # Prefix | Suffix | Exact | Presence
    value: str = ""

    def matches(self, check: str) -> bool:
        if self.kind == "Prefix":
            return check.startswith(self.value)
        if self.kind == "Suffix":
            return check.endswith(self.value)
        if self.kind == "Exact":
            return self.value == check
        return check != ""  # Presence

    def matches_principal(self, check: str) -> bool:
        if not check.startswith("spiffe://"):
            return False
        return self.matches(check[len("spiffe://"):])


@dataclasses.dataclass(frozen=True)
class ServiceAccountMatch:
    namespace: str
    service_account: str

    def matches(self, check: Identity | None) -> bool:
        return check is not None and (check.namespace, check.service_account) == (
            self.namespace, self.service_account)


@dataclasses.dataclass
class RbacMatch:
    namespaces: list[StringMatch] = dataclasses.field(default_factory=list)
    not_namespaces: list[StringMatch] = dataclasses.field(default_factory=list)
    service_accounts: list[ServiceAccountMatch] = dataclasses.field(default_factory=list)
    not_service_accounts: list[ServiceAccountMatch] = dataclasses.field(default_factory=list)
    principals: list[StringMatch] = dataclasses.field(default_factory=list)
    not_principals: list[StringMatch] = dataclasses.field(default_factory=list)
    source_ips: list[ipaddress._BaseNetwork] = dataclasses.field(default_factory=list)
    not_source_ips: list[ipaddress._BaseNetwork] = dataclasses.field(default_factory=list)
    destination_ips: list[ipaddress._BaseNetwork] = dataclasses.field(default_factory=list)
    not_destination_ips: list[ipaddress._BaseNetwork] = dataclasses.field(
        default_factory=list)
    destination_ports: list[int] = dataclasses.field(default_factory=list)
    not_destination_ports: list[int] = dataclasses.field(default_factory=list)

    def is_empty(self) -> bool:
        return not any(getattr(self, f.name) for f in dataclasses.fields(self))


@dataclasses.dataclass
class Authorization:
    name: str
    namespace: str
    scope: str  # Global | Namespace | WorkloadSelector
    action: str  # Allow | Deny
    rules: list[list[list[RbacMatch]]]
    dry_run: bool = False

    def to_key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def matches(self, conn: Connection) -> bool:
        ident = conn.src_identity
        id_text = str(ident) if ident is not None else ""
        ns = ident.namespace if ident is not None else ""
        if not self.rules:
            return False
        for rule in self.rules:
            rule_match = True
            for clause in rule:
                clause_match = False
                for mg in clause:
                    if mg.is_empty():
                        continue
                    m = True
                    m &= _internal(mg.destination_ips, mg.not_destination_ips,
                                   lambda i: _in(conn.dst[0], i))
                    m &= _internal(mg.source_ips, mg.not_source_ips,
                                   lambda i: _in(conn.src[0], i))
                    m &= _internal(mg.destination_ports, mg.not_destination_ports,
                                   lambda p: p == conn.dst[1])
                    m &= _internal(mg.service_accounts, mg.not_service_accounts,
                                   lambda p: p.matches(ident))
                    m &= _internal(mg.principals, mg.not_principals,
                                   lambda p: p.matches_principal(id_text))
                    m &= _internal(mg.namespaces, mg.not_namespaces, lambda p: p.matches(ns))
                    if m:
                        clause_match = True
                        break
                if not clause:
                    clause_match = True
                rule_match &= clause_match
                if not rule_match:
                    break
            if rule_match:
                return True
        return False


def _in(ip: str, net: ipaddress._BaseNetwork) -> bool:
    addr = ipaddress.ip_address(ip)
    return addr.version == net.version and addr in net


def _internal(positive: Sequence, negative: Sequence, predicate: Callable) -> bool:
    pm = True if not positive else any(predicate(p) for p in positive)
    nm = True if not negative else not any(predicate(n) for n in negative)
    return pm and nm


# --- conversion from the xDS proto (TryFrom<XdsRbac> for Authorization) ---

def _string_matches(items: Iterable[az.StringMatch]) -> list[StringMatch]:
    out = []
    for s in items:
        kind = s.WhichOneof("match_type")
        if kind is None:
            continue  # filter_map: a StringMatch without a match type is dropped
        out.append(StringMatch(kind.capitalize(), getattr(s, kind) if kind != "presence"
                               else ""))
    return out


def _addresses(items: Iterable[az.Address]) -> list[ipaddress._BaseNetwork]:
    out = []
    for a in items:
        if len(a.address) not in (4, 16):
            continue  # byte_to_ip fails -> filter_map drops it
        ip = ipaddress.ip_address(a.address)
        if a.length > ip.max_prefixlen:
            continue  # IpNet::new fails -> try_into().ok() drops it
        out.append(ipaddress.ip_network(f"{ip}/{a.length}", strict=False))
    return out


def from_xds(p: az.Authorization) -> Authorization:
    """``TryFrom<XdsRbac>``; raises ValueError for an unknown scope or action."""
    scopes = {az.GLOBAL: "Global", az.NAMESPACE: "Namespace",
              az.WORKLOAD_SELECTOR: "WorkloadSelector"}
    actions = {az.ALLOW: "Allow", az.DENY: "Deny"}
    if p.scope not in scopes or p.action not in actions:
        raise ValueError(f"unknown scope/action {p.scope}/{p.action}")
    rules = []
    for group in p.groups:
        clauses = []
        for clause in group.rules:
            matches = []
            for m in clause.matches:
                matches.append(RbacMatch(
                    namespaces=_string_matches(m.namespaces),
                    not_namespaces=_string_matches(m.not_namespaces),
                    service_accounts=[ServiceAccountMatch(s.namespace, s.serviceAccount)
                                      for s in m.service_accounts],
                    not_service_accounts=[ServiceAccountMatch(s.namespace, s.serviceAccount)
                                          for s in m.not_service_accounts],
                    principals=_string_matches(m.principals),
                    not_principals=_string_matches(m.not_principals),
                    source_ips=_addresses(m.source_ips),
                    not_source_ips=_addresses(m.not_source_ips),
                    destination_ips=_addresses(m.destination_ips),
                    not_destination_ips=_addresses(m.not_destination_ips),
                    destination_ports=[x & 0xFFFF for x in m.destination_ports],
                    not_destination_ports=[x & 0xFFFF for x in m.not_destination_ports]))
            clauses.append(matches)
        rules.append(clauses)
    return Authorization(p.name, p.namespace, scopes[p.scope], actions[p.action], rules,
                         p.dry_run)


class PolicyStore:
    """``PolicyStore``: policies by ``namespace/name`` and by scope namespace."""

    def __init__(self, policies: Iterable[az.Authorization] = ()):
        self.by_key: dict[str, Authorization] = {}
        self.by_namespace: dict[str, set[str]] = {}
        for p in policies:
            self.insert(from_xds(p))

    def insert(self, rbac: Authorization) -> None:
        key = rbac.to_key()
        self.by_key[key] = rbac
        if rbac.scope == "Global":
            self.by_namespace.setdefault("", set()).add(key)
        elif rbac.scope == "Namespace":
            self.by_namespace.setdefault(rbac.namespace, set()).add(key)

    def assert_rbac(self, workload_namespace: str, workload_policies: Iterable[str],
                    conn: Connection) -> bool:
        """True when ztunnel lets ``conn`` reach the workload."""
        keys = [*sorted(self.by_namespace.get(workload_namespace, ())),
                *sorted(self.by_namespace.get("", ())), *workload_policies]
        found = [self.by_key[k] for k in keys if k in self.by_key]
        allow = [p for p in found if p.action == "Allow" and not p.dry_run]
        deny = [p for p in found if p.action == "Deny" and not p.dry_run]
        if any(p.matches(conn) for p in deny):
            return False
        if not allow:
            return True
        return any(p.matches(conn) for p in allow)
