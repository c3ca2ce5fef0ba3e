"""Translated AuthorizationPolicies, judged by ztunnel's own RBAC semantics.

For every case the policies go through the real store + index (as they would reach
ztunnel over xDS, serialized and parsed again) and are evaluated by
:mod:`tests.ambient.ztunnel_rbac`, a port of ztunnel's ``src/rbac.rs`` / ``assert_rbac``.
The expected answer comes from :func:`kube_allows`, written from the AuthorizationPolicy
reference (istio.io docs "Authorization Policy": DENY before ALLOW, no ALLOW policy means
allow, an empty rule matches everything, fields of a source/operation are ANDed, values of
a field ORed, ``notX`` negates, ``from``/``to`` need one matching entry, every ``when``
must hold; AUDIT never changes the decision), restricted to what ztunnel sees of a
connection: the peer's SPIFFE identity, source IP, destination IP and port. Conditions
outside that (HTTP attributes, trust domains, which the workload API's ``Match`` cannot
carry, unknown keys, fields of the wrong shape, values that do not convert such as
``ports: ["http"]`` or ``ipBlocks: ["nope"]``) follow the L4-enforcement rule: a DENY takes
them as true (denies more), an ALLOW rule having any never matches (allows less). A policy
that can't be read at the top fails closed as a whole: ``rules`` that is not a list makes
an ALLOW match nothing and a DENY match everything, an unknown ``action`` denies everything,
an unreadable selector selects the whole namespace.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import itertools
import logging
from typing import Any

import pytest

from ambient import authorization_pb2 as az
from tests.ambient.builders import Harness, pod
from tests.ambient.ztunnel_rbac import Connection, Identity, PolicyStore

ROOT = "istio-system"
POD_NS = "ns"
POD_LABELS = {"app": "web", "tier": "front"}
POD_UID = "cluster0//Pod/ns/web"

IDENTITIES = [None, Identity("cluster.local", "ns-a", "sa1"),
              Identity("cluster.local", "ns-b", "x"), Identity("cluster.local", "ns", "sa-only"),
              Identity("other.td", "ns-a", "sa1")]
SRC_IPS = ["10.0.0.5", "192.168.1.9", "2001:db8::5"]
DST_IPS = ["1.2.3.4", "1.2.3.9"]
DST_PORTS = [80, 8080, 9090]
CONNECTIONS = [Connection((src, 40000), (dst, port), ident) for ident, src, dst, port in
               itertools.product(IDENTITIES, SRC_IPS, DST_IPS, DST_PORTS)]

# --- the reference: AuthorizationPolicy semantics on what a connection shows -----------

HTTP_SOURCE = {"requestPrincipals", "notRequestPrincipals", "remoteIpBlocks",
               "notRemoteIpBlocks", "trustDomains", "notTrustDomains"}
HTTP_OPERATION = {"hosts", "notHosts", "methods", "notMethods", "paths", "notPaths"}
UNKNOWN = None  # a condition ztunnel cannot evaluate


def _str_match(pattern: str, value: str | None) -> bool | None:
    if pattern == "":
        return UNKNOWN  # names no peer: a value that does not convert
    if value is None:
        return False
    if pattern == "*":
        return value != ""
    if pattern.startswith("*"):
        return value.endswith(pattern[1:])
    if pattern.endswith("*"):
        return value.startswith(pattern[:-1])
    return value == pattern


def _ip_match(pattern: str, ip: str) -> bool | None:
    try:
        net = ipaddress.ip_network(pattern, strict=False)
    except ValueError:
        return UNKNOWN
    addr = ipaddress.ip_address(ip)
    return addr.version == net.version and addr in net


def _port_match(pattern: str, port: int) -> bool | None:
    if not (pattern.isdigit() and 0 < int(pattern) <= 65535):
        return UNKNOWN
    return int(pattern) == port


def _sa_match(pattern: str, policy_ns: str, ident: Identity | None) -> bool | None:
    ns, sep, sa = pattern.partition("/")
    if not sep:
        ns, sa = policy_ns, pattern
    if not (ns and sa):
        return UNKNOWN
    return ident is not None and (ident.namespace, ident.service_account) == (ns, sa)


def _any(a: dict, results: list[bool | None]) -> bool | None:
    """Some value of a list matches (Kleene OR; sticky for ALLOW)."""
    return _or(a, results)


def _not(value: bool | None) -> bool | None:
    return UNKNOWN if value is UNKNOWN else not value


def _field(a: dict, key: str, values: Any, tests: dict, http: set[str]) -> bool | None:
    """One source/operation field: ``tests`` maps a positive field name to its test."""
    if key in http:
        return UNKNOWN if values else True
    negative = key.startswith("not") and key[3:4].isupper()
    base = key[3].lower() + key[4:] if negative else key
    if base not in tests or not isinstance(values, (list, type(None))):
        return UNKNOWN
    if not values:
        return True
    hit = _any(a, [tests[base](str(v)) for v in values])
    return _not(hit) if negative else hit


def _and(a: dict, *parts: bool | None) -> bool | None:
    """Kleene AND; with ``a["sticky"]`` (ALLOW) any unknown part makes the whole unknown,
    so a rule with an unchecked condition anywhere never allows."""
    if a["sticky"] and any(p is UNKNOWN for p in parts):
        return UNKNOWN
    if any(p is False for p in parts):
        return False
    return UNKNOWN if any(p is UNKNOWN for p in parts) else True


def _or(a: dict, parts: list[bool | None]) -> bool | None:
    if a["sticky"] and any(p is UNKNOWN for p in parts):
        return UNKNOWN
    if any(p is True for p in parts):
        return True
    return UNKNOWN if any(p is UNKNOWN for p in parts) else False


def _attrs(conn: Connection, sticky: bool) -> dict[str, Any]:
    ident = conn.src_identity
    return {"sticky": sticky, "principal": None if ident is None else
            f"{ident.trust_domain}/ns/{ident.namespace}/sa/{ident.service_account}",
            "namespace": None if ident is None else ident.namespace, "ident": ident,
            "src": conn.src[0], "dst": conn.dst[0], "port": conn.dst[1]}


def _source(src: Any, a: dict, policy_ns: str) -> bool | None:
    if not isinstance(src, dict) or not src:
        return UNKNOWN  # Istio's validation rejects an empty or missing source
    tests = {"principals": lambda v: _str_match(v, a["principal"]),
             "namespaces": lambda v: _str_match(v, a["namespace"]),
             "ipBlocks": lambda v: _ip_match(v, a["src"]),
             "serviceAccounts": lambda v: _sa_match(v, policy_ns, a["ident"])}
    return _and(a, *(_field(a, k, v, tests, HTTP_SOURCE) for k, v in src.items()))


def _operation(op: Any, a: dict) -> bool | None:
    if not isinstance(op, dict) or not op:
        return UNKNOWN
    tests = {"ports": lambda v: _port_match(v, a["port"])}
    return _and(a, *(_field(a, k, v, tests, HTTP_OPERATION) for k, v in op.items()))


def _condition(cond: Any, a: dict) -> bool | None:
    if not isinstance(cond, dict) or set(cond) - {"key", "values", "notValues"}:
        return UNKNOWN
    tests = {"source.ip": lambda v: _ip_match(v, a["src"]),
             "destination.ip": lambda v: _ip_match(v, a["dst"]),
             "destination.port": lambda v: _port_match(v, a["port"]),
             "source.namespace": lambda v: _str_match(v, a["namespace"]),
             "source.principal": lambda v: _str_match(v, a["principal"])}
    test = tests.get(cond.get("key"))
    values, not_values = cond.get("values"), cond.get("notValues")
    if test is None or not (values or not_values):
        return UNKNOWN
    if not isinstance(values, (list, type(None))) or \
            not isinstance(not_values, (list, type(None))):
        return UNKNOWN
    return _and(a, _any(a, [test(str(v)) for v in values]) if values else True,
                _not(_any(a, [test(str(v)) for v in not_values])) if not_values else True)


def _entries(a: dict, rule: dict, key: str, inner: str, evaluate) -> bool | None:
    raw = rule.get(key)
    if raw is None or raw == []:
        return True
    if not isinstance(raw, list):
        return UNKNOWN
    out = []
    for item in raw:
        if not isinstance(item, dict) or set(item) - {inner}:
            out.append(UNKNOWN)
        else:
            out.append(evaluate(item.get(inner)))
    return _or(a, out)


def rule_matches(rule: Any, conn: Connection, policy_ns: str, sticky: bool) -> bool | None:
    """Three-valued: True, False, or UNKNOWN when the answer needs what ztunnel can't see."""
    if not isinstance(rule, dict) or set(rule) - {"from", "to", "when"}:
        return UNKNOWN
    a = _attrs(conn, sticky)
    when = rule.get("when") or []
    return _and(a, _entries(a, rule, "from", "source", lambda s: _source(s, a, policy_ns)),
                _entries(a, rule, "to", "operation", lambda o: _operation(o, a)),
                *([UNKNOWN] if not isinstance(when, list) else
                  [_condition(c, a) for c in when]))


def policy_matches(spec: dict, conn: Connection, policy_ns: str, action: str) -> bool:
    rules = spec.get("rules") or []
    if not isinstance(rules, list):
        return action == "DENY"  # unreadable rules: an ALLOW allows nothing, a DENY all
    for rule in rules:
        hit = rule_matches(rule, conn, policy_ns, sticky=action == "ALLOW")
        if action == "DENY" and hit is not False:
            return True  # an unknown condition may hold: deny more
        if action == "ALLOW" and hit is True:
            return True  # a rule needing an unknown condition never allows: allow less
    return False


def applies(obj: dict, namespace: str, labels: dict) -> bool:
    ns = obj["metadata"]["namespace"]
    if ns not in (namespace, ROOT):
        return False
    selector = obj["spec"].get("selector")
    match_labels = selector.get("matchLabels") if isinstance(selector, dict) else selector
    if not isinstance(match_labels, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in match_labels.items()):
        return True  # none, or one that can't be read: the whole namespace
    return all(labels.get(k) == v for k, v in match_labels.items())


def kube_allows(policies: list[dict], conn: Connection) -> bool:
    """Istio's decision for the pod ``ns/web`` at L4 (see the module docstring)."""
    mine = [p for p in policies if applies(p, POD_NS, POD_LABELS)]
    by_action = {a: [p for p in mine if (p["spec"].get("action") or "ALLOW") == a]
                 for a in ("ALLOW", "DENY", "AUDIT")}
    if any((p["spec"].get("action") or "ALLOW") not in ("ALLOW", "DENY", "AUDIT", "CUSTOM")
           for p in mine):
        return False  # an action that can't be read denies everything
    ns_of = lambda p: p["metadata"]["namespace"]  # noqa: E731
    if any(policy_matches(p["spec"], conn, ns_of(p), "DENY") for p in by_action["DENY"]):
        return False
    if not by_action["ALLOW"]:
        return True
    return any(policy_matches(p["spec"], conn, ns_of(p), "ALLOW") for p in by_action["ALLOW"])


# --- the cases -------------------------------------------------------------------------

def ap(name: str, action: str = "ALLOW", rules: Any = None, namespace: str = POD_NS,
       selector: dict | None = None, **extra) -> dict:
    spec: dict = {"action": action, **extra}
    if rules is not None:
        spec["rules"] = rules
    if selector is not None:
        spec["selector"] = {"matchLabels": selector}
    return {"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
            "metadata": {"name": name, "namespace": namespace,
                         "creationTimestamp": "2024-01-01T00:00:00Z"},
            "spec": spec}


P_B = "cluster.local/ns/ns-b/sa/x"
GET = {"operation": {"methods": ["GET"]}}


@dataclasses.dataclass
class Case:
    id: str
    policies: list[dict]


CASES = [
    # ALLOW, L4 only
    Case("allow-no-rules-denies-all", [ap("a")]),
    Case("allow-empty-rule-allows-all", [ap("a", rules=[{}])]),
    Case("allow-principal-exact", [ap("a", rules=[{"from": [{"source": {"principals": [P_B]}}]}])]),
    Case("allow-principal-prefix-suffix-presence", [ap("a", rules=[
        {"from": [{"source": {"principals": ["cluster.local/ns/ns-a/*"]}}]},
        {"from": [{"source": {"principals": ["*/sa/x"]}}]}]),
        ap("b", rules=[{"from": [{"source": {"principals": ["*"]}}]}])]),
    Case("allow-namespaces-and-ports", [ap("a", rules=[
        {"from": [{"source": {"namespaces": ["ns-a"]}}], "to": [{"operation": {"ports": ["80"]}}]}])]),
    Case("allow-not-namespaces", [ap("a", rules=[{"from": [{"source": {"notNamespaces": ["ns-a"]}}]}])]),
    Case("allow-service-accounts", [ap("a", rules=[
        {"from": [{"source": {"serviceAccounts": ["ns-a/sa1", "sa-only"]}}]}])]),
    Case("allow-not-service-accounts", [ap("a", rules=[
        {"from": [{"source": {"notServiceAccounts": ["ns-b/x"]}}]}])]),
    Case("allow-ip-blocks-v4-v6", [ap("a", rules=[
        {"from": [{"source": {"ipBlocks": ["10.0.0.0/8", "2001:db8::/32"]}}]}])]),
    Case("allow-not-ip-blocks", [ap("a", rules=[{"from": [{"source": {"notIpBlocks": ["10.0.0.5"]}}]}])]),
    Case("allow-not-ports", [ap("a", rules=[{"to": [{"operation": {"notPorts": ["9090", "80"]}}]}])]),
    Case("allow-two-sources-or", [ap("a", rules=[{"from": [
        {"source": {"namespaces": ["ns-a"]}}, {"source": {"ipBlocks": ["192.168.0.0/16"]}}]}])]),
    Case("allow-source-fields-and", [ap("a", rules=[{"from": [
        {"source": {"namespaces": ["ns-a"], "ipBlocks": ["10.0.0.0/8"]}}]}])]),
    Case("allow-when-l4-keys", [ap("a", rules=[{"when": [
        {"key": "source.namespace", "values": ["ns-a", "ns"]},
        {"key": "destination.port", "notValues": ["9090"]},
        {"key": "destination.ip", "values": ["1.2.3.4"]},
        {"key": "source.ip", "values": ["10.0.0.0/8", "2001:db8::/64"]}]}])]),
    Case("allow-when-principal", [ap("a", rules=[{"when": [
        {"key": "source.principal", "values": ["*"], "notValues": ["other.td/*"]}]}])]),
    Case("allow-invalid-values-match-nothing", [ap("a", rules=[
        {"to": [{"operation": {"ports": ["http"]}}]},
        {"from": [{"source": {"ipBlocks": ["not-an-ip"], "namespaces": ["ns-a"]}}]},
        {"from": [{"source": {"namespaces": ["ns-b"]}}], "to": [{"operation": {"notPorts": ["x"]}}]}])]),
    Case("allow-two-policies-or", [ap("a", rules=[{"from": [{"source": {"namespaces": ["ns-a"]}}]}]),
                                   ap("b", rules=[{"to": [{"operation": {"ports": ["9090"]}}]}])]),
    Case("allow-root-namespace-mesh-wide", [ap("mesh", namespace=ROOT, rules=[
        {"from": [{"source": {"namespaces": ["ns-b"]}}]}])]),
    Case("allow-selector-matches", [ap("a", selector={"app": "web"}, rules=[
        {"to": [{"operation": {"ports": ["8080"]}}]}])]),
    Case("allow-selector-other-pod", [ap("a", selector={"app": "db"})]),
    Case("allow-other-namespace-ignored", [ap("a", namespace="elsewhere")]),
    # ALLOW with HTTP attributes: allow less
    Case("allow-l7-only-allows-nothing", [ap("a", rules=[{"to": [GET]}])]),
    Case("allow-mixed-rule-dropped", [ap("a", rules=[
        {"from": [{"source": {"namespaces": ["ns-a"]}}], "to": [GET]},
        {"to": [{"operation": {"ports": ["9090"]}}]}])]),
    Case("allow-request-principals-dropped", [ap("a", rules=[
        {"from": [{"source": {"principals": ["*"], "requestPrincipals": ["*"]}}]}])]),
    Case("allow-l7-when-dropped", [ap("a", rules=[
        {"from": [{"source": {"namespaces": ["ns-a"]}}],
         "when": [{"key": "request.headers[x-user]", "values": ["bob"]}]}])]),
    Case("allow-l7-entry-in-or", [ap("a", rules=[{"to": [GET, {"operation": {"ports": ["80"]}}]}])]),
    Case("allow-trust-domains-dropped", [ap("a", rules=[
        {"from": [{"source": {"trustDomains": ["other.td"]}}]},
        {"from": [{"source": {"namespaces": ["ns"]}}]}])]),
    Case("allow-unknown-field-dropped", [ap("a", rules=[
        {"from": [{"source": {"namespaces": ["ns-a"], "principalz": ["x"]}}]},
        {"to": [{"operation": {"ports": ["80"]}}], "unless": [{"key": "x"}]}])]),
    Case("allow-malformed-parts-dropped", [ap("a", rules=[
        {"from": [{"source": {"namespaces": "ns-a"}}]},
        {"from": "ns-a"}, {"to": [{"operation": {}}]}, "not-a-rule",
        {"when": [{"key": "source.ip"}]},
        {"to": [{"operation": {"ports": ["8080"]}}]}])]),
    # DENY, L4 only
    Case("deny-no-rules-no-effect", [ap("d", "DENY")]),
    Case("deny-empty-rule-denies-all", [ap("d", "DENY", rules=[{}])]),
    Case("deny-principal-and-port", [ap("d", "DENY", rules=[
        {"from": [{"source": {"principals": [P_B]}}], "to": [{"operation": {"ports": ["8080"]}}]}])]),
    Case("deny-plaintext", [ap("d", "DENY", rules=[{"from": [{"source": {"notPrincipals": ["*"]}}]}])]),
    Case("deny-ip-and-not-port", [ap("d", "DENY", rules=[
        {"from": [{"source": {"ipBlocks": ["192.168.0.0/16"]}}],
         "to": [{"operation": {"notPorts": ["80"]}}]}])]),
    Case("deny-when-destination-ip", [ap("d", "DENY", rules=[
        {"when": [{"key": "destination.ip", "values": ["1.2.3.9/32"]}]}])]),
    Case("deny-invalid-port-denies-all", [ap("d", "DENY", rules=[{"to": [{"operation": {"ports": ["http"]}}]}])]),
    Case("deny-invalid-values-widen", [ap("d", "DENY", rules=[
        {"to": [{"operation": {"ports": ["8080", "eighty"]}}],
         "from": [{"source": {"namespaces": ["ns-b"]}}]},
        {"from": [{"source": {"ipBlocks": ["not-an-ip"], "principals": [P_B]}}]},
        {"from": [{"source": {"notNamespaces": ["ns-a", ""]}}], "to": [{"operation": {"notPorts": ["x", "80"]}}]},
        {"when": [{"key": "destination.port", "values": ["99999"]},
                  {"key": "source.ip", "values": ["10.0.0.0/8"]}]}])]),
    # a policy that can't be read at the top: closed, never dropped
    Case("allow-rules-mapping-allows-nothing", [ap("a", selector={"app": "web"}, rules={
        "from": [{"source": {"principals": [P_B]}}]})]),
    Case("allow-rules-string-beside-good-allow", [ap("a", rules="x"), ap("b", rules=[{}])]),
    Case("deny-rules-string-denies-all", [ap("d", "DENY", rules="x"), ap("a", rules=[{}])]),
    Case("deny-rules-mapping-denies-all", [ap("d", "DENY", selector={"app": "web"},
                                              rules={"to": [{"operation": {"ports": ["80"]}}]})]),
    Case("unknown-action-denies-all", [ap("x", "DENNY", rules=[{"to": [{"operation": {"ports": ["80"]}}]}]),
                                       ap("a", rules=[{}])]),
    Case("deny-bad-selector-widens-to-namespace", [ap("d", "DENY", selector={"app": 3}, rules=[
        {"to": [{"operation": {"ports": ["80"]}}]}])]),
    Case("allow-bad-selector-widens-to-namespace", [
        ap("a", selector={"app": ["db"]}, rules=[{"from": [{"source": {"namespaces": ["ns-a"]}}]}])]),
    # DENY with HTTP attributes: deny more
    Case("deny-l7-only-denies-all", [ap("d", "DENY", rules=[{"to": [GET]}])]),
    Case("deny-issue-example", [ap("d", "DENY", rules=[
        {"from": [{"source": {"principals": [P_B]}}],
         "to": [{"operation": {"methods": ["GET"], "ports": ["8080"]}}]}])]),
    Case("deny-from-principal-to-methods-only", [ap("d", "DENY", rules=[
        {"from": [{"source": {"principals": [P_B]}}], "to": [GET]}])]),
    Case("deny-l7-when-keeps-from", [ap("d", "DENY", rules=[
        {"from": [{"source": {"namespaces": ["ns-a"]}}],
         "when": [{"key": "request.auth.claims[iss]", "values": ["x"]}]}])]),
    Case("deny-request-principals-and-namespace", [ap("d", "DENY", rules=[
        {"from": [{"source": {"namespaces": ["ns-b"], "notRequestPrincipals": ["*"]}}]}])]),
    Case("deny-l7-entry-in-or-widens-clause", [ap("d", "DENY", rules=[
        {"from": [{"source": {"namespaces": ["ns-a"]}}],
         "to": [{"operation": {"ports": ["80"]}}, {"operation": {"paths": ["/admin"]}}]}])]),
    Case("deny-remote-ip-blocks-only", [ap("d", "DENY", selector={"app": "web"}, rules=[
        {"from": [{"source": {"remoteIpBlocks": ["1.1.1.1"]}}]}])]),
    Case("deny-connection-sni", [ap("d", "DENY", rules=[
        {"to": [{"operation": {"ports": ["9090"]}}],
         "when": [{"key": "connection.sni", "values": ["x.example"]}]}])]),
    Case("deny-unknown-and-malformed-deny-more", [ap("d", "DENY", rules=[
        {"from": [{"source": {"namespaces": ["ns-b"], "principalz": ["x"]}}]},
        {"to": [{"operation": {"ports": "9090"}}], "from": [{"source": {"ipBlocks": ["10.0.0.0/8"]}}]}])]),
    Case("deny-trust-domains", [ap("d", "DENY", rules=[
        {"from": [{"source": {"trustDomains": ["other.td"]}}], "to": [{"operation": {"ports": ["80"]}}]}])]),
    Case("deny-root-namespace-l7", [ap("d", "DENY", namespace=ROOT, rules=[
        {"to": [{"operation": {"ports": ["9090"], "paths": ["/x"]}}]}])]),
    # AUDIT never decides; DENY + ALLOW combined
    Case("audit-alone", [ap("au", "AUDIT", rules=[{}])]),
    Case("audit-with-allow", [ap("au", "AUDIT", rules=[{"to": [GET]}]),
                              ap("a", rules=[{"from": [{"source": {"namespaces": ["ns-a"]}}]}])]),
    Case("deny-beats-allow", [ap("a", rules=[{}]),
                              ap("d", "DENY", rules=[{"from": [{"source": {"namespaces": ["ns-a"]}}]}])]),
    Case("deny-l7-beats-allow-l4", [ap("a", rules=[{"to": [{"operation": {"ports": ["80", "8080"]}}]}]),
                                    ap("d", "DENY", rules=[{"to": [{"operation": {"ports": ["8080"],
                                                                                  "methods": ["POST"]}}]}])]),
    Case("allow-l7-plus-deny-l4-plus-audit", [
        ap("a", rules=[{"to": [GET]}, {"from": [{"source": {"principals": ["*"]}}]}]),
        ap("d", "DENY", rules=[{"from": [{"source": {"ipBlocks": ["2001:db8::/32"]}}]}]),
        ap("au", "AUDIT", rules=[{"from": [{"source": {"namespaces": ["ns-b"]}}]}])]),
]


def _ztunnel_view(h: Harness) -> tuple[PolicyStore, list[str]]:
    """What ztunnel holds after xDS: every Authorization (bytes round-tripped) and the
    workload's policy keys."""
    sent = []
    for auth in h.index.authorizations().values():
        wire = az.Authorization()
        wire.ParseFromString(auth.SerializeToString(deterministic=True))
        sent.append(wire)
    return PolicyStore(sent), list(h.workload(POD_UID).authorization_policies)


def test_case_table_is_big_enough():
    policies = [p for c in CASES for p in c.policies]
    actions = {p["spec"]["action"] for p in policies}
    assert len(policies) >= 40 and actions == {"ALLOW", "DENY", "AUDIT", "DENNY"}
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_ztunnel_decision_matches_policy_semantics(case: Case):
    h = Harness(pod("web", POD_NS, labels=POD_LABELS, sa="web"), *case.policies)
    store, keys = _ztunnel_view(h)
    wrong = []
    for conn in CONNECTIONS:
        want = kube_allows(case.policies, conn)
        got = store.assert_rbac(POD_NS, keys, conn)
        if want != got:
            wrong.append(f"{conn}: policy says {'allow' if want else 'deny'}, ztunnel would "
                         f"{'allow' if got else 'deny'}")
    assert not wrong, f"{len(wrong)} of {len(CONNECTIONS)} connections differ:\n" + \
        "\n".join(wrong[:10])


def test_table_exercises_both_outcomes_per_action():
    """Guard against a vacuous table: each action's cases decide both ways somewhere, and
    the L7 DENY cases really deny (the bug: they denied nothing)."""
    outcomes: dict[str, set[bool]] = {}
    for case in CASES:
        for p in case.policies:
            decisions = {kube_allows(case.policies, c) for c in CONNECTIONS}
            outcomes.setdefault(p["spec"]["action"], set()).update(decisions)
    assert outcomes == {"ALLOW": {True, False}, "DENY": {True, False},
                        "AUDIT": {True, False}, "DENNY": {False}}
    l7_only = next(c for c in CASES if c.id == "deny-l7-only-denies-all")
    assert not any(kube_allows(l7_only.policies, c) for c in CONNECTIONS)


def test_reference_port_agrees_with_ztunnels_own_tests():
    """A few of ztunnel's rbac.rs unit tests, replayed on the port (empty policy shapes,
    nesting, string matches)."""
    from tests.ambient.ztunnel_rbac import Authorization, RbacMatch, StringMatch
    plain = Connection(("127.0.0.1", 1234), ("127.0.0.2", 8080))
    tls = Connection(("127.0.0.1", 1234), ("127.0.0.2", 8080),
                     Identity("td", "namespace", "account"))
    pol = lambda rules: Authorization("p", "namespace", "Global", "Allow", rules)  # noqa: E731
    assert not pol([[[RbacMatch()]]]).matches(plain)
    assert pol([[[]]]).matches(plain) and pol([[]]).matches(plain)
    assert not pol([]).matches(plain)
    ns = pol([[[RbacMatch(namespaces=[StringMatch("Exact", "namespace")])]]])
    assert (ns.matches(plain), ns.matches(tls)) == (False, True)
    notns = pol([[[RbacMatch(not_namespaces=[StringMatch("Exact", "namespace")])]]])
    assert (notns.matches(plain), notns.matches(tls)) == (True, False)
    pr = pol([[[RbacMatch(principals=[StringMatch("Exact", "td/ns/namespace/sa/account")])]]])
    assert (pr.matches(plain), pr.matches(tls)) == (False, True)
    assert StringMatch("Presence").matches("foo") and not StringMatch("Presence").matches("")
    assert not StringMatch("Prefix", "foo").matches("") and StringMatch("Suffix", "o").matches("fo")


def test_problems_are_reported_and_http_note_names_the_widening():
    from ambient.translate_authz import authorization_policy
    t = authorization_policy(ap("d", "DENY", rules=[
        {"to": [GET]}, {"from": [{"source": {"namespaces": "ns-a"}}]}]), ROOT)
    assert "methods" in t.note and "denies every connection" in t.note
    assert t.problems and "spec.rules[1].from[0].source.namespaces must be a list" in \
        t.problems[0] and "denies more" in t.problems[0]
    t = authorization_policy(ap("a", rules=[{"from": [{"source": {"principalz": ["x"]}}]}]),
                             ROOT)
    assert len(t.policy.groups) == 0 and "unknown field spec.rules[0].from[0].source" \
        ".principalz" in t.problems[0] and "allows less" in t.problems[0]
    t = authorization_policy(ap("x", "DENNY"), ROOT)
    assert t.policy.action == az.DENY and "field 'spec.action'" in t.problems[0] and \
        "'DENNY'" in t.problems[0]


@pytest.mark.parametrize("policy, field, value, groups", [
    (ap("allow-only-a", selector={"app": "web"},
        rules={"from": [{"source": {"principals": ["cluster.local/ns/demo/sa/sa-1"]}}]}),
     "spec.rules", "{'from': [", 0),
    (ap("deny-x", "DENY", rules="x"), "spec.rules", "'x'", 1),
    (ap("deny-eighty", "DENY", rules=[{"to": [{"operation": {"ports": ["eighty"]}}]}]),
     "spec.rules[0].to[0].operation.ports[0]", "'eighty'", 1),
    (ap("sel", "DENY", selector={"app": 3}), "spec.selector.matchLabels", "{'app': 3}", 0),
    (ap("act", "DENNY"), "spec.action", "'DENNY'", 1),
])
def test_unreadable_policy_is_sent_closed_with_one_warning(caplog, policy, field, value, groups):
    """The reported fail-open: a policy whose rules are a mapping (or a string, or a DENY
    whose only port is not a number) was skipped or sent denying nothing. It is sent, closed,
    and one WARN names the policy, the field and the value."""
    caplog.set_level(logging.INFO, logger="ambient")
    h = Harness(pod("web", POD_NS, labels=POD_LABELS, sa="web"), policy)
    key = f"{POD_NS}/{policy['metadata']['name']}"
    sent = h.index.authorizations()[key]
    assert len(sent.groups) == groups and all(not g.rules for g in sent.groups)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert warned[0].startswith(f"AuthorizationPolicy {key}: ") and field in warned[0] and \
        value in warned[0], warned[0]
    if policy["spec"].get("selector", {}).get("matchLabels") == {"app": "web"}:
        assert key in h.workload(POD_UID).authorization_policies  # default-deny for it


def test_logged_values_are_escaped_and_bounded(caplog):
    caplog.set_level(logging.WARNING, logger="ambient")
    Harness(pod("web", POD_NS, labels=POD_LABELS, sa="web"),
            ap("d", "DENY", rules=[{"to": [{"operation": {"ports": ["\x1b[31m" + "9" * 5000]}}]}]))
    (line,) = [r.getMessage() for r in caplog.records]
    assert "\x1b" not in line and len(line) < 1200
