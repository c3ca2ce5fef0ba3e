"""The files source's annotation overlay (``DirectorySource.patch_pod_annotations``) on a
real tmp directory with real inotify watching: the agent's annotation reaches the store
and the index, survives reloads of the Pod's file, never rewrites the file, and is
dropped with the Pod."""

from __future__ import annotations

import asyncio
import textwrap

import pytest
from prometheus_client import CollectorRegistry

from ambient import workload_pb2 as wl
from ambient.index import AmbientIndex
from ambient.objects import Mesh
from ambient.source_files import DirectorySource, PodNotFound
from ambient.store import ObjectStore
from tests.helpers import eventually

REDIRECTION = "ambient.istio.io/redirection"
POD = textwrap.dedent("""\
    apiVersion: v1
    kind: Pod
    metadata: {name: a, namespace: demo, uid: %s, labels: {app: %s}%s}
    spec: {nodeName: n1, serviceAccountName: sa}
    status: {podIP: 10.0.0.1, phase: Running}
    """)


async def run_blocking(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def annotations(store):
    pod = store.get("Pod", "demo", "a")
    return None if pod is None else pod["metadata"].get("annotations")


async def test_overlay_reaches_the_index_and_survives_reloads(tmp_path):
    registry = CollectorRegistry()
    store = ObjectStore(registry)
    path = tmp_path / "pods.yaml"
    path.write_text(POD % ("u-1", "one", ", annotations: {team: x}"))
    src = DirectorySource(store, str(tmp_path), run_blocking, debounce_ms=10)
    index = AmbientIndex(store, Mesh(cluster_id="c"), registry)
    await src.start()
    index.start()
    try:
        assert index.address("c//Pod/demo/a").workload.tunnel_protocol == wl.NONE
        before = path.read_bytes()
        pod = await src.patch_pod_annotations("demo", "a", {REDIRECTION: "enabled"})
        assert pod["metadata"]["annotations"] == {"team": "x", REDIRECTION: "enabled"}
        assert annotations(store) == {"team": "x", REDIRECTION: "enabled"}
        assert index.address("c//Pod/demo/a").workload.tunnel_protocol == wl.HBONE
        assert path.read_bytes() == before  # the operator's file is never rewritten
        assert src.overlay() == {"demo/a": {REDIRECTION: "enabled"}}

        # the operator edits the file (labels and its own annotation): the overlay stays
        path.write_text(POD % ("u-1", "two", ", annotations: {team: y}"))
        await eventually(lambda: store.get("Pod", "demo", "a")["metadata"]["labels"]
                         == {"app": "two"})
        assert annotations(store) == {"team": "y", REDIRECTION: "enabled"}
        assert index.address("c//Pod/demo/a").workload.tunnel_protocol == wl.HBONE

        # removal (un-enrollment) also wins over a value written in the file
        path.write_text(POD % ("u-1", "two", f", annotations: {{{REDIRECTION}: enabled}}"))
        await eventually(lambda: annotations(store) == {REDIRECTION: "enabled"}
                         and store.get("Pod", "demo", "a")["metadata"]["labels"]
                         == {"app": "two"})
        await src.patch_pod_annotations("demo", "a", {REDIRECTION: None})
        assert annotations(store) == {}
        path.write_text(POD % ("u-1", "three", f", annotations: {{{REDIRECTION}: enabled}}"))
        await eventually(lambda: store.get("Pod", "demo", "a")["metadata"]["labels"]
                         == {"app": "three"})
        assert annotations(store) == {}
        assert index.address("c//Pod/demo/a").workload.tunnel_protocol == wl.NONE
    finally:
        await src.stop()
        index.stop()


async def test_overlay_dropped_with_its_pod_and_not_applied_to_a_new_pod(tmp_path):
    store = ObjectStore(CollectorRegistry())
    path = tmp_path / "pods.yaml"
    path.write_text(POD % ("u-1", "one", ""))
    src = DirectorySource(store, str(tmp_path), run_blocking, debounce_ms=10)
    await src.start()
    try:
        await src.patch_pod_annotations("demo", "a", {REDIRECTION: "enabled"})
        # same name, another pod (new uid): it was never enrolled
        path.write_text(POD % ("u-2", "one", ""))
        await eventually(lambda: store.get("Pod", "demo", "a")["metadata"]["uid"] == "u-2")
        assert not annotations(store)
        assert src.overlay() == {}
        await src.patch_pod_annotations("demo", "a", {REDIRECTION: "enabled"})
        path.unlink()
        await eventually(lambda: store.get("Pod", "demo", "a") is None)
        assert src.overlay() == {}
        path.write_text(POD % ("u-2", "one", ""))  # back: a fresh pod object, no overlay
        await eventually(lambda: store.get("Pod", "demo", "a") is not None)
        assert not annotations(store)
        with pytest.raises(PodNotFound, match="pod demo/missing not found"):
            await src.patch_pod_annotations("demo", "missing", {REDIRECTION: "enabled"})
    finally:
        await src.stop()


def test_patch_response_older_than_the_watch_is_not_applied():
    """The kubernetes path: a PATCH response is applied to the store at once, unless the
    watch already brought a newer version (etcd resourceVersions only grow)."""
    from ambient.source import _older
    pod = {"metadata": {"resourceVersion": "120"}}
    assert _older(pod, {"metadata": {"resourceVersion": "121"}})
    assert not _older(pod, {"metadata": {"resourceVersion": "119"}})
    assert not _older(pod, {"metadata": {"resourceVersion": "120"}})
    assert not _older(pod, None)
    assert not _older(pod, {"metadata": {"resourceVersion": "opaque"}})
