"""Attestation steps without root: cgroup text → pod UID (kubelet's cgroupfs and systemd
layouts, v1 and v2), a fixture /proc tree, Pod → identity. The real-cgroup end-to-end
test is tests/peers/test_sds_attest.py."""

from __future__ import annotations

import pytest

from agent.sds.attest import (AttestationError, PeerCred, PodAttestor, identity_of_pod,
                              pod_uid_from_cgroup, pod_uid_of_pid)
from tests.sds.store import DictStore, pod

UID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"


@pytest.mark.parametrize("text", [
    f"0::/kubepods/besteffort/pod{UID}/abc123\n",
    "12:memory:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
    f"{UID.replace('-', '_')}.slice/cri-containerd-abc.scope\n0::/\n",
    f"4:memory:/kubepods/pod{UID}/ctr\n1:cpu:/kubepods/pod{UID}/ctr\n",
])
def test_pod_uid_from_cgroup_layouts(text):
    assert pod_uid_from_cgroup(text) == UID


def test_not_a_pod_or_ambiguous():
    assert pod_uid_from_cgroup("0::/user.slice/session-1.scope\n") == ""
    other = "11111111-2222-3333-4444-555555555555"
    with pytest.raises(AttestationError, match="several pods or containers"):
        pod_uid_from_cgroup(f"1:cpu:/kubepods/pod{UID}/x\n2:memory:/kubepods/pod{other}/y\n")


def test_proc_fixture_and_identity(tmp_path):
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cgroup").write_text(f"0::/kubepods/burstable/pod{UID}/c\n")
    assert pod_uid_of_pid(42, str(tmp_path)) == UID
    with pytest.raises(AttestationError, match="pid 43"):
        pod_uid_of_pid(43, str(tmp_path))
    store = DictStore([pod(UID, "shop", "cart", node="n1")])
    attestor = PodAttestor(lambda: store, "example.org", "n1")
    assert attestor.identify(PeerCred(42, 0, 0, UID)).spiffe_id == \
        "spiffe://example.org/ns/shop/sa/cart"
    with pytest.raises(AttestationError, match="unknown"):
        attestor.identify(PeerCred(42, 0, 0, "ffffffff-ffff-ffff-ffff-ffffffffffff"))
    with pytest.raises(AttestationError, match="no config source"):
        PodAttestor(lambda: None, "td", "n1").identify(PeerCred(42, 0, 0, UID))
    assert identity_of_pod({"metadata": {"namespace": "n"}, "spec": {}}, "td").service_account \
        == "default"


def test_pod_bound_to_another_node_or_none_is_refused():
    """A pod object saying it runs elsewhere (or is not scheduled) gets no identity; the
    message names the pod, its node and ours."""
    other = "11111111-2222-3333-4444-555555555555"
    pending = "22222222-3333-4444-5555-666666666666"
    store = DictStore([pod(UID, "shop", "cart", name="cart-1", node="n2"),
                       pod(pending, "shop", "cart", name="cart-2", node=""),
                       pod(other, "shop", "cart", name="cart-3", node="n1")])
    attestor = PodAttestor(lambda: store, "td", "n1")
    with pytest.raises(AttestationError, match=r"pod shop/cart-1 \(uid " + UID +
                       r"\) is bound to node 'n2', not to this node 'n1'"):
        attestor.identify(PeerCred(42, 0, 0, UID))
    with pytest.raises(AttestationError, match="cart-2.*not bound to any node"):
        attestor.identify(PeerCred(43, 0, 0, pending))
    assert attestor.identify(PeerCred(44, 0, 0, other)).namespace == "shop"
