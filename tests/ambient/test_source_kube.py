"""The Kubernetes source against a faithful fake API server (tests/ambient/fake_apiserver.py;
no real API server can run here): list, watch, bookmarks, 410 relist, backoff, 404 kinds,
pods/status annotation patch."""

from __future__ import annotations

import asyncio

import pytest
from kubernetes_asyncio import client as kclient

from ambient import source_kube
from ambient.source_kube import KubernetesSource
from ambient.store import ObjectStore
from tests.ambient.builders import ns, pod, service
from tests.ambient.fake_apiserver import FakeApiServer
from tests.helpers import eventually


@pytest.fixture
async def fake():
    server = FakeApiServer()
    await server.start()
    yield server
    await server.stop()


def make_source(fake, store, monkeypatch, kinds=("Namespace", "Pod", "Service")):
    monkeypatch.setattr(source_kube, "BACKOFF_START", 0.05)
    cfg = kclient.Configuration(host=fake.url)
    return KubernetesSource(store, api_client=kclient.ApiClient(cfg), kinds=list(kinds),
                            watch_timeout=2, sync_timeout=5)


async def test_list_watch_delete_bookmark_and_patch(fake, monkeypatch):
    await fake.put("/api/v1/namespaces", ns("demo"))
    await fake.put("/api/v1/pods", pod("a", "demo"))
    await fake.put("/api/v1/services", service("s", "demo"))
    store = ObjectStore()
    src = make_source(fake, store, monkeypatch,
                      kinds=("Namespace", "Pod", "Service", "AuthorizationPolicy"))
    try:
        await src.start()
        assert src.is_synced()  # AuthorizationPolicy 404 counts as an empty, synced kind
        assert store.get("Pod", "demo", "a")["kind"] == "Pod"
        assert store.get("Service", "demo", "s")["apiVersion"] == "v1"
        assert "404" in src.errors["AuthorizationPolicy"]
        await fake.put("/api/v1/pods", pod("b", "demo", ip="1.2.3.5"))
        await eventually(lambda: store.get("Pod", "demo", "b") is not None)
        await fake.delete("/api/v1/pods", "demo", "a")
        await eventually(lambda: store.get("Pod", "demo", "a") is None)
        assert any("allowWatchBookmarks=true" in r for r in fake.requests)
        patched = await src.patch_pod_annotations("demo", "b", {
            "ambient.istio.io/redirection": "enabled"})
        assert patched["metadata"]["annotations"]["ambient.istio.io/redirection"] == "enabled"
        await eventually(lambda: (store.get("Pod", "demo", "b")["metadata"].get("annotations")
                                  or {}).get("ambient.istio.io/redirection") == "enabled")
        with pytest.raises(kclient.exceptions.ApiException) as err:
            await src.patch_pod_annotations("demo", "missing", {"x": "y"})
        assert err.value.status == 404
    finally:
        await src.stop()
        await src.api.close()


async def test_410_gone_relists_and_catches_missed_deletes(fake, monkeypatch):
    await fake.put("/api/v1/pods", pod("a", "demo"))
    await fake.put("/api/v1/pods", pod("b", "demo", ip="1.2.3.5"))
    store = ObjectStore()
    src = make_source(fake, store, monkeypatch, kinds=("Pod",))
    try:
        await src.start()
        assert src.relists["Pod"] == 1
        # the client is disconnected, "a" is deleted while history is compacted away
        await fake.compact_and_drop_watches()
        fake.objects["/api/v1/pods"].pop(("demo", "a"))
        fake.rv += 5
        fake.compacted = fake.rv
        await eventually(lambda: src.relists["Pod"] >= 2)
        await eventually(lambda: store.get("Pod", "demo", "a") is None)
        assert store.get("Pod", "demo", "b") is not None
    finally:
        await src.stop()
        await src.api.close()


async def test_list_errors_back_off_and_recover_and_bad_objects_are_skipped(fake, monkeypatch):
    fake.fail_lists = 2
    bad = pod("bad", "demo")
    bad["metadata"]["labels"] = {"app": 3}
    await fake.put("/api/v1/pods", bad)
    await fake.put("/api/v1/pods", pod("good", "demo"))
    store = ObjectStore()
    src = make_source(fake, store, monkeypatch, kinds=("Pod",))
    try:
        await src.start()
        assert src.is_synced()
        assert store.get("Pod", "demo", "good") is not None
        assert store.get("Pod", "demo", "bad") is None
        assert store.rejected.labels("files", "invalid")._value.get() == 1
        assert sum(r.startswith("GET /api/v1/pods?") and "watch" not in r
                   for r in fake.requests) == 3
    finally:
        await src.stop()
        await src.api.close()


async def test_unreachable_api_server_is_not_ready_but_does_not_raise(monkeypatch):
    store = ObjectStore()
    monkeypatch.setattr(source_kube, "BACKOFF_START", 0.05)
    cfg = kclient.Configuration(host="http://127.0.0.1:9")  # discard port: refused
    src = KubernetesSource(store, api_client=kclient.ApiClient(cfg), kinds=["Pod"],
                           sync_timeout=0.3)
    try:
        await src.start()
        assert not src.is_synced() and src.errors["Pod"]
    finally:
        await src.stop()
        await src.api.close()
