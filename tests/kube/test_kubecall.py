"""agent/core/kubecall.py against a real kube-apiserver: each error answer the agent's
callers decide on (404, 409, 403 as the DaemonSet's own ServiceAccount, 410 for a watch
from a compacted resourceVersion) becomes a :class:`KubeError` with the status, the
reason phrase and the API server's Status message; a 2xx answer is the decoded body."""

from __future__ import annotations

import asyncio
import json

import pytest
import yaml
from kubernetes_asyncio.client.exceptions import ApiException

from agent.core import kubecall
from agent.core.kubecall import KubeError
from tests.kube import cluster as kc


def configmap(ns: str, name: str, data: dict[str, str] | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": ns}, "data": data or {"k": "v"}}


def only(err: KubeError, status: int) -> list[bool]:
    """The predicates, in a fixed order; exactly the one for ``status`` is true."""
    got = [err.not_found, err.forbidden, err.conflict, err.gone, err.too_many_requests]
    want = [s == status for s in (404, 403, 409, 410, 429)]
    assert got == want, (status, got)
    return got


async def test_a_2xx_answer_is_the_decoded_body(kube_admin, kube_namespace):
    path = f"/api/v1/namespaces/{kube_namespace}/configmaps"
    created = await kubecall.call(kube_admin, "POST", path, timeout=10,
                                  body=configmap(kube_namespace, "a"))
    assert created["metadata"]["name"] == "a" and created["data"] == {"k": "v"}
    patched = await kubecall.call(kube_admin, "PATCH", f"{path}/a", timeout=10,
                                  body={"data": {"k": "w"}},
                                  content_type=kubecall.MERGE_PATCH)
    assert patched["data"] == {"k": "w"}
    raw = await kubecall.read(kube_admin, "GET", path, timeout=10,
                              query=[("fieldSelector", "metadata.name=a")])
    assert raw.startswith(b"{") and b'"ConfigMapList"' in raw


async def test_404_names_the_missing_object(kube_admin, kube_namespace):
    with pytest.raises(KubeError) as err:
        await kubecall.call(kube_admin, "GET",
                            f"/api/v1/namespaces/{kube_namespace}/configmaps/missing", timeout=10)
    e = err.value
    assert isinstance(e, ApiException)  # what code around the generated APIs catches
    only(e, 404)
    assert e.status == 404 and e.phrase == "Not Found" and e.status_reason == "NotFound"
    assert e.message == 'configmaps "missing" not found' and e.reason == e.message
    assert str(e) == 'HTTP 404: configmaps "missing" not found'
    assert e.retry_after == 0.0 and b'"code":404' in e.body


async def test_404_of_a_kind_not_served_raises_before_the_stream_opens(kube_admin):
    """A watch of an API group nobody serves (a CRD not installed): the answer is a 404
    before any stream (the config source treats the kind as empty)."""
    with pytest.raises(KubeError) as err:
        async with kubecall.stream(kube_admin, "/apis/nothing.example.com/v1/things",
                                   timeout=10, query=[("watch", "true")]):
            pytest.fail("a 404 must not yield a response")
    only(err.value, 404)


async def test_409_for_a_name_taken_and_for_a_stale_resource_version(kube_admin,
                                                                     kube_namespace):
    path = f"/api/v1/namespaces/{kube_namespace}/configmaps"
    first = await kubecall.call(kube_admin, "POST", path, timeout=10,
                                body=configmap(kube_namespace, "b"))
    with pytest.raises(KubeError) as taken:
        await kubecall.call(kube_admin, "POST", path, timeout=10,
                            body=configmap(kube_namespace, "b"))
    only(taken.value, 409)
    assert taken.value.status_reason == "AlreadyExists"
    assert taken.value.message == 'configmaps "b" already exists'
    # someone else changed it: a merge patch carrying the version it was computed from is
    # refused (the waypoint status writer's optimistic concurrency)
    await kubecall.call(kube_admin, "PATCH", f"{path}/b", timeout=10,
                        body={"data": {"k": "other"}}, content_type=kubecall.MERGE_PATCH)
    with pytest.raises(KubeError) as stale:
        await kubecall.call(kube_admin, "PATCH", f"{path}/b", timeout=10,
                            content_type=kubecall.MERGE_PATCH,
                            body={"metadata": {"resourceVersion":
                                               first["metadata"]["resourceVersion"]},
                                  "data": {"k": "mine"}})
    only(stale.value, 409)
    assert stale.value.status_reason == "Conflict"
    assert "the object has been modified" in stale.value.message


async def test_403_as_the_daemonsets_service_account_and_no_token_in_the_error(
        kube_admin, kube_namespace, agent_kubeconfig):
    """The agent's RBAC (deploy/kubernetes/rbac.yaml) grants list/watch of pods but not
    delete (repair's delete mode needs an added rule): the 403 names the ServiceAccount
    and the verb; nothing of the request's bearer token is in the error."""
    with open(agent_kubeconfig, encoding="utf-8") as f:
        token = yaml.safe_load(f)["users"][0]["user"]["token"]
    await kc.create_pod(kube_admin, "p", kube_namespace, kc.unique("node"))
    agent = await kc.client_from_kubeconfig(agent_kubeconfig)
    try:
        with pytest.raises(KubeError) as err:
            await kubecall.call(agent, "DELETE",
                                f"/api/v1/namespaces/{kube_namespace}/pods/p", timeout=10)
        # what it may do still works with the same client
        listed = await kubecall.call(agent, "GET", f"/api/v1/namespaces/{kube_namespace}/pods",
                                     timeout=10)
        assert [p["metadata"]["name"] for p in listed["items"]] == ["p"]
    finally:
        await agent.close()
    e = err.value
    only(e, 403)
    assert e.phrase == "Forbidden" and e.status_reason == "Forbidden"
    assert 'User "system:serviceaccount:istio-system:ambient-agent" cannot delete ' \
        'resource "pods"' in e.message, e.message
    assert str(e).startswith("HTTP 403: ") and "\n" not in str(e)
    seen = [str(e), repr(e), e.reason, e.message, e.body.decode(),
            " ".join(f"{k}: {v}" for k, v in (e.headers or {}).items())]
    assert not any(token in s for s in seen)


async def test_410_for_a_watch_from_a_compacted_resource_version(kube_cluster, kube_namespace):
    """With the watch cache off (the cache would serve a recent version from memory), a
    watch is served by etcd; once etcd compacted its history past a resourceVersion, a
    watch from it is refused as 410 (Status reason Expired), as the stream's first event
    or as the HTTP status: both become the same KubeError."""
    kube_cluster.apiserver_stop()
    kube_cluster.apiserver_start(extra_args="--watch-cache=false")
    try:
        api = await kube_cluster.admin_client()
        try:
            path = f"/api/v1/namespaces/{kube_namespace}/configmaps"
            created = await kubecall.call(api, "POST", path, timeout=10,
                                          body=configmap(kube_namespace, "c"))
            old_rv = created["metadata"]["resourceVersion"]
            for i in range(3):
                await kubecall.call(api, "PATCH", f"{path}/c", timeout=10,
                                    body={"data": {"k": str(i)}},
                                    content_type=kubecall.MERGE_PATCH)
            assert await kube_cluster.compact() > int(old_rv)
            query = [("watch", "true"), ("resourceVersion", old_rv), ("timeoutSeconds", 5)]
            with pytest.raises(KubeError) as err:
                async with kubecall.stream(api, path, timeout=30, query=query) as resp:
                    line = await asyncio.wait_for(resp.content.readline(), 30)
                    event = json.loads(line)
                    assert event["type"] == "ERROR", event
                    raise KubeError.from_status(event["object"])
        finally:
            await api.close()
    finally:
        kube_cluster.apiserver_stop()
        kube_cluster.apiserver_start()
    e = err.value
    only(e, 410)
    assert e.status_reason == "Expired" and "too old" in e.message, e
