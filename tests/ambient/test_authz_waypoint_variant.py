"""The L4 widening of a selector DENY policy whose rules are all HTTP stays only where no
waypoint is bound: a workload behind a waypoint (its own ``istio.io/use-waypoint`` or a
service's) lists the policy's ``~waypoint-bound`` variant without those rules (upstream's
translation never fires them at ztunnel; the waypoint enforces HTTP rules aimed at it),
and follows its binding as it changes. Checked with ztunnel's RBAC semantics
(``tests/ambient/ztunnel_rbac.py``)."""

from __future__ import annotations

from ambient import translate_authz as tz
from tests.ambient.builders import Harness, ns, pod, policy, service, waypoint

AMBIENT = {"istio.io/dataplane-mode": "ambient"}
CAPTURED = {"ambient.istio.io/redirection": "enabled"}
DENY_PATHS = policy("deny-admin", selector={"matchLabels": {"app": "web"}}, action="DENY",
                    rules=[{"to": [{"operation": {"paths": ["/admin"]}}]},
                           {"to": [{"operation": {"ports": ["9999"]}}]}])


def test_bound_workloads_list_the_variant_and_unbound_the_widened_policy():
    h = Harness(ns("ns", AMBIENT), waypoint("wp"),
                service("web", selector={"app": "web"}, labels={"istio.io/use-waypoint": "wp"}),
                pod("bound", labels={"app": "web"}, annotations=CAPTURED, ip="10.0.1.1"),
                pod("free", labels={"app": "other-web"}, annotations=CAPTURED, ip="10.0.1.2"),
                DENY_PATHS,
                policy("deny-admin-2", selector={"matchLabels": {"app": "other-web"}},
                       action="DENY", rules=[{"to": [{"operation": {"paths": ["/admin"]}}]}]))
    bound = h.workload("cluster0//Pod/ns/bound")
    assert list(bound.authorization_policies) == ["ns/deny-admin" + tz.WAYPOINT_VARIANT]
    free = h.workload("cluster0//Pod/ns/free")
    assert list(free.authorization_policies) == ["ns/deny-admin-2"]
    widened = h.index.authorization("ns/deny-admin")
    variant = h.index.authorization("ns/deny-admin" + tz.WAYPOINT_VARIANT)
    assert widened is not None and variant is not None
    # the widened policy has an empty group (every connection); the variant keeps only
    # the L4 rule (port 9999)
    assert len(widened.groups) == 2 and any(not g.rules for g in widened.groups)
    assert len(variant.groups) == 1 and variant.groups[0].rules[0].matches[0].destination_ports == [9999]
    assert variant.name == "deny-admin" + tz.WAYPOINT_VARIANT and variant.namespace == "ns"


def test_binding_changes_switch_the_listed_policy_and_deletes_remove_the_variant():
    h = Harness(ns("ns", AMBIENT), waypoint("wp"),
                service("web", selector={"app": "web"}),
                pod("p", labels={"app": "web"}, annotations=CAPTURED, ip="10.0.1.1"),
                DENY_PATHS)
    assert list(h.workload("cluster0//Pod/ns/p").authorization_policies) == ["ns/deny-admin"]
    h.apply(service("web", selector={"app": "web"}, labels={"istio.io/use-waypoint": "wp"}))
    assert list(h.workload("cluster0//Pod/ns/p").authorization_policies) == [
        "ns/deny-admin" + tz.WAYPOINT_VARIANT]
    h.apply(pod("p", labels={"app": "web", "istio.io/use-waypoint": "none"},
                annotations=CAPTURED, ip="10.0.1.1"))
    # the pod opts out of a workload waypoint, but its service still has one
    assert list(h.workload("cluster0//Pod/ns/p").authorization_policies) == [
        "ns/deny-admin" + tz.WAYPOINT_VARIANT]
    change = h.delete("AuthorizationPolicy", "ns", "deny-admin")
    assert {"ns/deny-admin", "ns/deny-admin" + tz.WAYPOINT_VARIANT} <= change.authorizations_removed
    assert list(h.workload("cluster0//Pod/ns/p").authorization_policies) == []


def test_policies_without_widened_rules_have_no_variant():
    h = Harness(ns("ns", AMBIENT),
                policy("l4", selector={"matchLabels": {"app": "web"}}, action="DENY",
                       rules=[{"to": [{"operation": {"ports": ["9999"]}}]}]),
                policy("nsw", action="DENY", rules=[{"to": [{"operation": {"paths": ["/x"]}}]}]))
    names = set(h.index.authorization_names())
    assert "ns/l4" in names and "ns/nsw" in names
    assert not any(n.endswith(tz.WAYPOINT_VARIANT) for n in names)
