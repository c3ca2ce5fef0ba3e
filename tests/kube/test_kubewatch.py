"""agent/core/kubewatch.py against a real kube-apiserver: events arrive deserialized as
the library's models with the caller's client, which stays usable after the watch."""

from __future__ import annotations

import asyncio

import pytest

from agent.core import kubewatch
from tests.kube import cluster as kc

pytestmark = pytest.mark.timeout(120)


async def test_watch_streams_typed_events_and_leaves_the_client_open(kube_admin,
                                                                   kube_namespace):
    from kubernetes_asyncio import client as kclient

    core = kclient.CoreV1Api(kube_admin)
    listed = await core.list_namespaced_config_map(kube_namespace)
    name = kc.unique("cm")
    seen = []

    async def follow():
        async with kubewatch.Watch(core.api_client) as w:
            async for event in w.stream(core.list_namespaced_config_map, kube_namespace,
                                        resource_version=listed.metadata.resource_version,
                                        timeout_seconds=30):
                seen.append((event["type"], event["object"]))
                if event["object"].metadata.name == name:
                    return

    task = asyncio.create_task(follow())
    await kc.request(kube_admin, "POST", f"/api/v1/namespaces/{kube_namespace}/configmaps",
                     body={"apiVersion": "v1", "kind": "ConfigMap",
                           "metadata": {"name": name}, "data": {"k": "v"}})
    await asyncio.wait_for(task, 60)
    kind, obj = seen[-1]
    assert kind == "ADDED" and isinstance(obj, kclient.V1ConfigMap) and obj.data == {"k": "v"}
    # the shared client was not closed by the watch: it still reads
    again = await core.read_namespaced_config_map(name, kube_namespace)
    assert again.data == {"k": "v"}
