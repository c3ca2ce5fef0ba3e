"""Workload registration pieces without a runtime: identity from a CNI event and labels,
the state file (damaged input kept aside, bad entries skipped), podman event parsing,
and the local backend in a real object store."""

from __future__ import annotations

import json

import pytest

from ambient.store import ObjectStore
from cni import registration as reg_mod
from cni import registration_record as record_mod
from cni.events import CniPodEvent
from cni.registration import LocalBackend
from cni.registration_record import Registration, RegistrationError, RegistrationFile, identity
from cni.runtime_labels import PodmanLabels, labels_of_event

CID = "0bb0e6ce117756d1d98c364dbfe2cac7baa987f0fd0fedef0e8db918e94a6c42"


def event(**kw):
    base = dict(command="ADD", container_id=CID, netns="/run/netns/netns-x", pod_name="Web_1",
                ips=["10.233.7.2"])
    base.update(kw)
    return CniPodEvent(**base)


def test_identity_from_podman_event_and_labels():
    name, ns, sa, labels = identity(event(), {
        "app": "web", record_mod.NAMESPACE_LABEL: "shop", record_mod.SERVICE_ACCOUNT_LABEL: "web-sa",
        "bad key!": "x", "long": "v" * 64}, "default")
    assert (name, ns, sa) == ("web-1", "shop", "web-sa")
    assert labels == {"app": "web"}  # identity keys taken out, invalid labels dropped


def test_identity_defaults_and_errors():
    name, ns, sa, labels = identity(event(pod_name=""), {}, "hosts")
    assert (name, ns, sa, labels) == (CID[:12], "hosts", "default", {})
    with pytest.raises(RegistrationError, match="K8S_POD_NAME"):
        identity(event(pod_name="___"), {}, "default")
    with pytest.raises(RegistrationError, match=record_mod.NAMESPACE_LABEL):
        identity(event(), {record_mod.NAMESPACE_LABEL: "--"}, "default")


def test_registration_pod_is_running_and_ready():
    r = Registration(uid=CID, name="web", namespace="shop", service_account="sa", labels={},
                     ips=["10.0.0.5", "fd00::5"], netns="/run/netns/x", node="host-a")
    pod = r.pod()
    assert pod["metadata"]["uid"] == CID and pod["spec"]["nodeName"] == "host-a"
    assert pod["status"]["podIPs"] == [{"ip": "10.0.0.5"}, {"ip": "fd00::5"}]
    assert {"type": "Ready", "status": "True"} in pod["status"]["conditions"]


def test_state_file_damaged_is_kept_aside(tmp_path):
    f = RegistrationFile(str(tmp_path))
    f.path.write_text("{not json")
    assert f.load() == []
    assert (tmp_path / "registrations.json.bad").read_text() == "{not json"


def test_state_file_bad_entry_skipped_good_kept(tmp_path):
    f = RegistrationFile(str(tmp_path))
    good = Registration(uid=CID, name="web", namespace="shop", service_account="sa",
                        labels={"a": "b"}, ips=["10.0.0.5"], netns="/run/netns/x", node="n")
    f.path.write_text(json.dumps({"registrations": [
        {"uid": "x", "name": ""}, {**good.to_json(), "labels": {"a": 1}}, good.to_json()]}))
    assert f.load() == [good]
    f.save([good])
    assert oct(f.path.stat().st_mode & 0o777) == "0o600"


def test_podman_event_lines():
    line = {"ID": CID, "Name": "capc1", "Status": "create", "Type": "container",
            "Attributes": {"app": "hello", "io.buildah.version": "1.28.2", "n": 3}}
    assert labels_of_event(line) == ("create", CID, {"app": "hello"})
    assert labels_of_event({"Type": "image", "ID": "x", "Status": "tag"}) is None
    assert labels_of_event("garbage") is None


async def test_podman_labels_wait_for_create_event():
    src = PodmanLabels(None)
    assert await src.labels(CID, 0.05) is None
    src.note("create", CID, {"app": "web"})
    assert await src.labels(CID, 0) == {"app": "web"}
    src.note("remove", CID, {})
    assert await src.labels(CID, 0) is None


async def test_local_backend_keeps_foreign_annotations_and_moves_on_rename():
    store = ObjectStore()
    backend = LocalBackend(store)
    r = Registration(uid=CID, name="web", namespace="default", service_account="default",
                     labels={}, ips=["10.0.0.5"], netns="", node="n")
    await backend.put(r)
    pod = store.pod_by_uid(CID)
    pod = {**pod, "metadata": {**pod["metadata"], "annotations": {
        **pod["metadata"]["annotations"], "ambient.istio.io/redirection": "enabled"}}}
    store.apply([(pod, "overlay")], origin=reg_mod.LOCAL_ORIGIN)
    moved = Registration(**{**r.to_json(), "namespace": "shop", "ips": ["10.0.0.6"]})
    await backend.put(moved)
    assert store.get("Pod", "default", "web") is None
    now = store.get("Pod", "shop", "web")
    assert now["status"]["podIP"] == "10.0.0.6"
    assert now["metadata"]["annotations"]["ambient.istio.io/redirection"] == "enabled"
    # an operator's Pod of the same name stays authoritative
    store.apply([({"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": "db", "namespace": "shop", "uid": "other"}}, "f")],
                origin="/cluster/db.yaml")
    await backend.put(Registration(**{**r.to_json(), "uid": "c2", "name": "db",
                                      "namespace": "shop"}))
    assert store.get("Pod", "shop", "db")["metadata"]["uid"] == "other"
    await backend.delete(moved)
    assert store.pod_by_uid(CID) is None


def test_served_pod_is_named_as_its_workload_entry(tmp_path):
    """ZDS must name a registered pod as its workload is served (ztunnel matches the
    name): the WorkloadEntry backend serves ``<pod>-<node>``, the local backend the pod."""
    from agent.core.config import load
    from agent.core.lifecycle import AgentContext
    from ambient import source as ambient_source
    from cni.registration_kube import WorkloadEntryBackend

    cfg = load({"state_dir": str(tmp_path), "config_file": "/dev/null"}, env={}).replace(
        node_name="host-a")
    ctx = AgentContext(cfg)
    r = Registration(uid=CID, name="web", namespace="shop", service_account="sa", labels={},
                     ips=["10.0.0.5"], netns="/run/netns/x", node="host-a")
    source = ambient_source.build(ctx)
    for backend, want in ((WorkloadEntryBackend(cfg, source), "web-host-a"),
                          (LocalBackend(ObjectStore()), "web")):
        registrar = reg_mod.WorkloadRegistrar(ctx, backend, None)
        registrar.registrations[CID] = r
        pod = registrar.served_pod(CID)
        assert pod["metadata"]["name"] == want and pod["metadata"]["uid"] == CID
        assert registrar.served_pod("other") is None
    ctx.executor.shutdown(wait=False)
