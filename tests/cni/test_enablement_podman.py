"""Pods without Kubernetes (podman): the CNI event carries only ``K8S_POD_NAME=<container
name>`` and the container ID, so the Pod object is the one whose ``metadata.uid`` is that
container ID (cni/enablement.py ``find_pod``, cni/enrollment/reconciler.py record). Uses the real
:class:`ambient.store.ObjectStore`, the real event server socket and the real
:class:`cni.enrollment.Enrollment` record building."""

from __future__ import annotations

from ambient.store import ObjectStore
from cni import enablement
from cni.enrollment import Enrollment
from cni.events import CniPodEvent
from agent.core.lifecycle import AgentContext, Component
from tests.cni.conftest import make_config
from tests.cni.test_eventserver import namespace, post

CID = "4f1c" * 16  # a podman container ID: 64 hex digits
AMBIENT = {"istio.io/dataplane-mode": "ambient"}


class ConfigSource(Component):
    """The config source enrollment reads its pods from (only the store)."""

    name = "config-source"

    def kube_api(self):
        return None  # no Kubernetes API: Events are not written

    def __init__(self, store):
        self.store = store


def pod(name, ns, uid, sa="default", labels=None):
    return {"kind": "Pod", "metadata": {"name": name, "namespace": ns, "uid": uid,
                                        "labels": labels or {}},
            "spec": {"serviceAccountName": sa}}


def store_with(*objects) -> ObjectStore:
    store = ObjectStore()
    store.apply([(o, "test") for o in objects])
    return store


def podman_event(cid=CID, **kw) -> CniPodEvent:
    """What istio-cni posts for ``podman start``: no namespace, no UID."""
    return CniPodEvent("ADD", cid, "/run/netns/netns-x", pod_name="client-1a2b",
                       ips=["10.77.1.2"], **kw)


def test_pod_object_found_by_container_id_decides():
    store = store_with(namespace("demo", AMBIENT), namespace("legacy"),
                       pod("client", "demo", CID, "client"), pod("legacy", "legacy", "b" * 64))
    d = enablement.decide(podman_event(), store, ["kube-system"])
    assert d.ambient and d.pod["metadata"]["name"] == "client", d
    # the Pod object wins over the plugin config's ambient_default
    d = enablement.decide(podman_event("b" * 64, ambient_default=True), store, [])
    assert not d.ambient and d.pod["metadata"]["namespace"] == "legacy", d


def test_excluded_namespace_of_the_pod_object_applies():
    store = store_with(namespace("kube-system", AMBIENT),
                       pod("dns", "kube-system", CID, labels=AMBIENT))
    d = enablement.decide(podman_event(ambient_default=True), store, ["kube-system"])
    assert not d.ambient and d.reason == "namespace kube-system is excluded"


def test_no_pod_object_falls_back_to_ambient_default():
    store = store_with(namespace("demo", AMBIENT), pod("other", "demo", "c" * 64))
    assert enablement.find_pod(store, podman_event()) is None
    assert enablement.decide(podman_event(ambient_default=True), store, []).ambient
    assert not enablement.decide(podman_event(), store, []).ambient


def test_kubernetes_event_is_not_matched_by_container_id():
    """An event with a namespace (Kubernetes runtime) names its pod by namespace/name or
    UID; a Pod whose uid happens to equal the container ID is not it."""
    store = store_with(pod("client", "demo", CID))
    ev = CniPodEvent("ADD", CID, "/n", pod_name="web", pod_namespace="demo", ips=["10.0.0.1"])
    assert enablement.find_pod(store, ev) is None
    ev = CniPodEvent("ADD", CID, "/n", pod_name="web", pod_namespace="demo",
                     pod_uid="u-1", ips=["10.0.0.1"])
    assert enablement.find_pod(store, ev) is None


async def test_event_server_decides_podman_pod_by_container_id(cni_agent):
    cni_agent.set_store(store_with(namespace("demo", AMBIENT), namespace("legacy"),
                                   pod("client", "demo", CID), pod("legacy", "legacy", "b" * 64)))
    body = podman_event().to_json()
    status, text = await post(cni_agent, "/cmdadd", body=body)
    assert status == 200 and '"ambient": true' in text, text
    status, text = await post(cni_agent, "/cmdadd", body={**body, "container_id": "b" * 64,
                                                          "ambient_default": True})
    assert status == 200 and '"ambient": false' in text, text
    assert [e.key for e in cni_agent.enroller.enrolled] == [CID]


def test_enrollment_record_takes_pod_name_namespace_and_sa_from_the_pod_object(tmp_path):
    ctx = AgentContext(make_config(tmp_path / "state"))
    try:
        source = ConfigSource(store_with(pod("client", "demo", CID, "client-sa")))
        rec = Enrollment(ctx, source=source)._record_from_event(podman_event())
        assert (rec.uid, rec.namespace, rec.name, rec.service_account) == \
            (CID, "demo", "client", "client-sa")
        # no Pod object: named by container (ID and name), default service account
        rec = Enrollment(ctx, source=source)._record_from_event(podman_event("d" * 64))
        assert (rec.uid, rec.namespace, rec.name, rec.service_account) == \
            ("d" * 64, "", "client-1a2b", "default")
    finally:
        ctx.executor.shutdown(wait=False)
