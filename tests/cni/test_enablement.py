"""Istio's enablement rules (``docs/cni.md``)."""

import pytest

from agent.core.config_values import parse_list
from cni import enablement
from cni.events import CniPodEvent

AMBIENT = {"istio.io/dataplane-mode": "ambient"}


def pod(labels=None, annotations=None, host_network=False):
    return {"metadata": {"name": "p", "namespace": "ns", "labels": labels or {},
                         "annotations": annotations or {}}, "spec": {"hostNetwork": host_network}}


@pytest.mark.parametrize("p, ns_labels, want", [
    (pod(), AMBIENT, True),                                       # ns-labelled, pod unlabelled
    (pod(AMBIENT), {}, True),                                     # pod-labelled
    (pod(), {}, False),                                           # neither
    (pod(AMBIENT, {"sidecar.istio.io/status": "x"}), AMBIENT, False),  # sidecar pod
    (pod({"istio.io/dataplane-mode": "none"}), AMBIENT, False),   # opt-out in ambient ns
    (pod(AMBIENT, host_network=True), AMBIENT, False),            # host network
])
def test_matches(p, ns_labels, want):
    assert enablement.pod_matches(p, ns_labels)[0] is want


@pytest.mark.parametrize("text, want", [("", []), ("  ", []), (",,", []),
                                        (" a , b ", ["a", "b"]), ("a,,b", ["a", "b"])])
def test_split_exclude_namespaces(text, want):
    """Istio's SplitExcludeNamespaces, as the exclude_namespaces setting parses it."""
    assert tuple(want) == parse_list(text)


def test_label_selector_operators():
    m = enablement.label_selector_matches
    assert m({}, {"a": "1"}) and m(None, {})
    assert m({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1"]}]}, {"a": "1"})
    assert not m({"matchExpressions": [{"key": "a", "operator": "Exists"}]}, {})
    assert m({"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]}, {})
    with pytest.raises(ValueError, match="operator"):
        m({"matchExpressions": [{"key": "a", "operator": "Like"}]}, {})


def test_decide_without_store_uses_ambient_default_and_exclusion():
    ev = CniPodEvent("ADD", "cid", "/n", pod_namespace="kube-system", ambient_default=True)
    assert not enablement.decide(ev, None, ["kube-system"]).ambient
    ev.pod_namespace = ""
    assert enablement.decide(ev, None, ["kube-system"]).ambient
    ev.ambient_default = None
    assert not enablement.decide(ev, None, []).ambient
