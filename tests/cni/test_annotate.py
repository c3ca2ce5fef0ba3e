"""``cni.annotate.RedirectionStatus``: the write policy of the redirection annotation
(skip when unchanged, 404 = nothing to do, failures logged with the pod's name and
retried with backoff, a newer write supersedes a retry). The annotator here is the real
files source (``ambient.source_files.DirectorySource``) wrapped so that it fails on
demand with the HTTP statuses an API server gives (the real API server's 403 is
covered by the tests under tests/kube/)."""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import CollectorRegistry

from ambient.source_files import DirectorySource
from ambient.store import ObjectStore
from cni import annotate
from cni.annotate import PodAnnotator, PodRef, RedirectionStatus
from tests.helpers import eventually

POD = """apiVersion: v1
kind: Pod
metadata: {name: a, namespace: demo, uid: u-1}
spec: {nodeName: n1}
"""


class ApiError(Exception):
    """Shaped like kubernetes_asyncio's ApiException: ``status`` and ``reason``."""

    def __init__(self, status, reason):
        super().__init__(f"({status})\nReason: {reason}\nHTTP response headers: ...")
        self.status, self.reason = status, reason


class Failing:
    """The files source, failing the next ``failures`` writes with ``status``."""

    def __init__(self, source, failures=0, status=403, reason="Forbidden"):
        self.source, self.failures, self.status, self.reason = source, failures, status, reason
        self.calls = 0

    async def patch_pod_annotations(self, namespace, name, annotations):
        self.calls += 1
        if self.failures:
            self.failures -= 1
            raise ApiError(self.status, self.reason)
        return await self.source.patch_pod_annotations(namespace, name, annotations)


async def source(tmp_path):
    async def run_blocking(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
    (tmp_path / "pod.yaml").write_text(POD)
    store = ObjectStore(CollectorRegistry())
    src = DirectorySource(store, str(tmp_path), run_blocking, debounce_ms=10)
    await src.start()
    return src, store


def stored(store):
    return (store.get("Pod", "demo", "a")["metadata"].get("annotations") or {}).get(
        annotate.REDIRECTION_ANNOTATION)


REF = PodRef(uid="u-1", namespace="demo", name="a")


async def test_protocol_is_what_both_sources_offer(tmp_path):
    from ambient.source import ConfigSource
    from ambient.source_kube import KubernetesSource
    src, store = await source(tmp_path)
    try:
        assert isinstance(src, PodAnnotator)
        assert isinstance(ConfigSource(store, src), PodAnnotator)
        assert isinstance(KubernetesSource(store), PodAnnotator)
        assert not isinstance(store, PodAnnotator)  # the seam enrollment once looked for
    finally:
        await src.stop()


async def test_failures_are_logged_with_the_pod_and_retried_with_backoff(
        tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(annotate, "BACKOFF_INITIAL", 0.01)
    src, store = await source(tmp_path)
    failing = Failing(src, failures=3)
    status = RedirectionStatus(lambda: failing,
                               lambda ref: stored(store))
    try:
        caplog.set_level(logging.INFO, logger="cni.annotate")
        assert await status.write(REF, "enabled") is False  # one attempt, reported
        assert "demo/a (uid u-1): writing annotation ambient.istio.io/redirection=enabled " \
               "failed: 403 Forbidden" in caplog.text
        assert "HTTP response headers" not in caplog.text  # one line, no header dump
        status.ensure(REF, "enabled")
        await eventually(lambda: stored(store) == "enabled")
        assert failing.calls == 4 and status.failures == 3
        await eventually(lambda: not status.pending_retries())
        assert "written after retrying" in caplog.text
        # unchanged: no write at all (a restarted agent does not re-PATCH every pod)
        assert await status.write(REF, "enabled") is True and failing.calls == 4
    finally:
        await status.close()
        await src.stop()


async def test_not_found_is_nothing_to_do_and_newer_write_supersedes_a_retry(
        tmp_path, monkeypatch):
    monkeypatch.setattr(annotate, "BACKOFF_INITIAL", 0.05)
    src, store = await source(tmp_path)
    failing = Failing(src, failures=1000, status=500, reason="Internal Server Error")
    status = RedirectionStatus(lambda: failing, lambda ref: stored(store))
    try:
        gone = PodRef(uid="u-9", namespace="demo", name="gone")
        failing.failures = 0
        assert await status.write(gone, None) is True  # PodNotFound (LookupError)
        assert await status.write(gone, "enabled") is True
        failing.failures, failing.status = 1, 404
        assert await status.write(REF, "enabled") is True  # the API's 404
        assert stored(store) is None

        failing.failures = 0
        assert await status.write(REF, "enabled") is True
        failing.failures, failing.status = 1000, 409
        status.ensure(REF, None)  # an un-enrollment whose write keeps failing...
        await eventually(lambda: failing.calls >= 4)
        assert REF.uid in status.pending_retries()
        failing.failures = 0  # ...superseded by a re-enrollment's write
        assert await status.write(REF, "enabled") is True  # (already there: no call)
        assert not status.pending_retries() and stored(store) == "enabled"
        calls = failing.calls
        await asyncio.sleep(0.3)
        assert failing.calls == calls and stored(store) == "enabled"
        # no config source (or one that can't annotate): nothing to write
        assert await RedirectionStatus(lambda: None).write(REF, "enabled") is True
    finally:
        await status.close()
        await src.stop()
