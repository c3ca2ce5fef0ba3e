"""Node-proxy impersonation on the embedded CA (``CertificateService._impersonation_ok``):
a trusted node account gets a pod's identity only when a scheduled pod with that identity
runs on the node; the rules of upstream ``security/pkg/server/ca/node_auth.go`` (pods
without ``spec.nodeName`` are on no node; the caller pod's UID and service account must
match its token)."""

from __future__ import annotations

import pytest

from agent.tlsport.authn import Caller
from agent.sds.ca_server import CertificateService
from agent.core.spiffe import Identity
from ambient.store import ObjectStore

TD = "cluster.local"
ZTUNNEL = Identity(TD, "istio-system", "ztunnel")
TARGET = f"spiffe://{TD}/ns/bank/sa/ledger"


def pod(ns, name, sa, node, uid="", phase="Running"):
    spec = {"serviceAccountName": sa, "containers": [{"name": "c"}]}
    if node is not None:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"namespace": ns, "name": name, "uid": uid or f"uid-{name}"},
            "spec": spec, "status": {"phase": phase}}


def service(objs, node_name="node-a"):
    store = ObjectStore()
    store.apply([(o, "test") for o in objs], origin="test")
    return CertificateService(None, None, TD, None, ["istio-system/ztunnel"],
                              lambda: store, node_name)


def by_token(name="zt", uid="uid-zt"):
    return Caller((ZTUNNEL,), "TokenReview", pod_name=name, pod_uid=uid)


ZT_POD = pod("istio-system", "zt", "ztunnel", "node-a")


def test_pod_of_this_node_may_be_impersonated():
    svc = service([ZT_POD, pod("bank", "l1", "ledger", "node-a")])
    assert svc._impersonation_ok(by_token(), TARGET) == ""
    assert svc._impersonation_ok(Caller((ZTUNNEL,), "client certificate"), TARGET) == ""


@pytest.mark.parametrize("node", [None, ""])
def test_unscheduled_pod_is_on_no_node(node):
    svc = service([ZT_POD, pod("bank", "l1", "ledger", node, phase="Pending")])
    assert "no pod with identity" in svc._impersonation_ok(by_token(), TARGET)
    assert "no pod with identity" in svc._impersonation_ok(
        Caller((ZTUNNEL,), "client certificate"), TARGET)


def test_pod_of_another_node_is_refused():
    svc = service([ZT_POD, pod("bank", "l1", "ledger", "node-b")])
    assert "no pod with identity" in svc._impersonation_ok(by_token(), TARGET)


def test_caller_pod_must_be_scheduled_here_and_match_its_token():
    target = pod("bank", "l1", "ledger", "node-a")
    unscheduled = pod("istio-system", "zt", "ztunnel", None)
    assert "runs on node (none)" in service([unscheduled, target])._impersonation_ok(
        by_token(), TARGET)
    no_uid = pod("istio-system", "zt", "ztunnel", "node-a")
    no_uid["metadata"]["uid"] = ""
    assert "UID does not match" in service([no_uid, target])._impersonation_ok(
        by_token(), TARGET)
    other_sa = pod("istio-system", "zt", "default", "node-a")
    assert "does not run as" in service([other_sa, target])._impersonation_ok(
        by_token(), TARGET)


def test_without_node_name_the_callers_node_decides():
    objs = [ZT_POD, pod("bank", "l1", "ledger", "node-b")]
    assert "no pod with identity" in service(objs, node_name="")._impersonation_ok(
        by_token(), TARGET)
    objs = [ZT_POD, pod("bank", "l1", "ledger", "node-a")]
    assert service(objs, node_name="")._impersonation_ok(by_token(), TARGET) == ""


def test_untrusted_caller_and_foreign_trust_domain_are_refused():
    svc = service([ZT_POD, pod("bank", "l1", "ledger", "node-a")])
    other = Caller((Identity(TD, "bank", "ledger"),), "client certificate")
    assert "ca_trusted_node_accounts" in svc._impersonation_ok(other, TARGET)
    assert "trust domain" in svc._impersonation_ok(by_token(), "spiffe://evil/ns/bank/sa/ledger")


def workload_entry(ns, name, sa, registered_by):
    annotations = {"ambient.istio.io/registered-by": registered_by} if registered_by else {}
    return {"apiVersion": "networking.istio.io/v1", "kind": "WorkloadEntry",
            "metadata": {"namespace": ns, "name": name, "annotations": annotations},
            "spec": {"address": "10.0.0.9", "serviceAccount": sa}}


def test_registered_workload_entry_of_this_node_may_be_impersonated():
    """Hosts without Kubernetes (cni/registration_kube.py): the pod is a WorkloadEntry
    annotated with the node that registered it; only that node's ztunnel gets its
    identity, and only for the entry's service account."""
    caller = Caller((ZTUNNEL,), "bearer token")
    assert service([workload_entry("bank", "l1-node-a", "ledger", "node-a")]
                   )._impersonation_ok(caller, TARGET) == ""
    for objs in ([workload_entry("bank", "l1-node-b", "ledger", "node-b")],
                 [workload_entry("bank", "l1-node-a", "other", "node-a")],
                 [workload_entry("bank", "vm", "ledger", "")]):  # not registered by a node
        assert "no pod with identity" in service(objs)._impersonation_ok(caller, TARGET)
