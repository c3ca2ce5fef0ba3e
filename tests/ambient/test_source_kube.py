"""The Kubernetes source against faults a real API server cannot be made to produce, served
by the fake of tests/ambient/fake_apiserver.py: objects that fail validation (the real
server validates them away), 5xx on LIST, malformed or oversized watch streams, watches
that end at once. Everything a real server does — list, watch, bookmarks, 410 after a
compaction, restart, 429, missing CRDs, the pods/status patch — is tested against a real
kube-apiserver in tests/kube/test_source_kube.py."""

from __future__ import annotations

import asyncio
import json

import pytest
from kubernetes_asyncio import client as kclient

from ambient import source_kube
from ambient.source_kube import KubernetesSource
from ambient.store import ObjectStore
from tests.ambient.builders import pod
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


async def test_malformed_and_oversized_watch_streams_reconnect_without_losing_objects(
        fake, monkeypatch, caplog):
    """A line that is not JSON, an event without type, an oversized event: each ends that
    watch (counted in errors), the source watches again from its last good version."""
    await fake.put("/api/v1/pods", pod("a", "demo"))
    store = ObjectStore()
    src = make_source(fake, store, monkeypatch, kinds=("Pod",))
    monkeypatch.setattr(source_kube, "MAX_EVENT_BYTES", 4096)
    try:
        await src.start()
        watches = src.stats["Pod"].watches
        for junk in (b"not json\n", b'{"object": {}}\n', b'{"type": "ADDED", "object": "' +
                     b"x" * 5000 + b'"}\n'):
            fake.inject = junk
            await eventually(lambda: fake.inject is None, what="junk sent")
            await eventually(lambda seen=watches: src.stats["Pod"].watches > seen, timeout=5,
                             what="a new watch after the bad stream")
            watches = src.stats["Pod"].watches
        await fake.put("/api/v1/pods", pod("b", "demo", ip="1.2.3.5"))
        await eventually(lambda: store.get("Pod", "demo", "b") is not None)
        assert store.get("Pod", "demo", "a") is not None
        assert src.relists["Pod"] == 1  # resumed from the last version, never relisted
        logged = "\n".join(r.getMessage() for r in caplog.records)
        for what in ("not JSON", "not a watch event", "larger than 4096 bytes"):
            assert what in logged, what
    finally:
        await src.stop()
        await src.api.close()


async def test_watch_error_event_other_than_410_backs_off_and_resumes(fake, monkeypatch):
    await fake.put("/api/v1/pods", pod("a", "demo"))
    store = ObjectStore()
    src = make_source(fake, store, monkeypatch, kinds=("Pod",))
    try:
        await src.start()
        fake.inject = (b'{"type": "ERROR", "object": {"kind": "Status", "code": 500, '
                       b'"message": "internal error"}}\n')
        await eventually(lambda: "500" in src.errors.get("Pod", ""), what="error recorded")
        await fake.put("/api/v1/pods", pod("b", "demo", ip="1.2.3.5"))
        await eventually(lambda: store.get("Pod", "demo", "b") is not None)
        assert src.relists["Pod"] == 1
    finally:
        await src.stop()
        await src.api.close()


async def test_watches_that_end_at_once_are_spaced_by_the_backoff(fake, monkeypatch):
    """A server that closes every watch immediately gets watches at the backoff's pace
    (0.05 s doubling to 0.4 s here), not a tight loop."""
    monkeypatch.setattr(source_kube, "BACKOFF_MAX", 0.4)
    fake.watch_closes_at_once = True
    store = ObjectStore()
    src = make_source(fake, store, monkeypatch, kinds=("Pod",))
    try:
        await src.start()
        await asyncio.sleep(2.0)
        n = src.stats["Pod"].watches
        assert 3 <= n <= 12, n  # 0.05+0.1+0.2+0.4+0.4+... (x1.0-1.2 jitter) within 2 s
    finally:
        await src.stop()
        await src.api.close()


async def test_one_read_of_events_is_applied_in_order_with_upserts_batched(fake, monkeypatch):
    """Events that arrive in one read: consecutive ADDED/MODIFIED ones are one store
    transaction; a DELETED one applies them first and is its own; a malformed line after
    them ends the watch only once the events before it are in the store."""
    await fake.put("/api/v1/pods", pod("a", "demo"))
    await fake.put("/api/v1/pods", pod("b", "demo", ip="1.2.3.5"))
    store = ObjectStore()
    src = make_source(fake, store, monkeypatch, kinds=("Pod",))
    transactions: list[list[tuple[str, str]]] = []
    store.subscribe(lambda events: transactions.append(
        [(e.name, "del" if e.new is None else e.new["metadata"]["labels"].get("v", ""))
         for e in events]))
    try:
        await src.start()
        await eventually(lambda: src.stats["Pod"].watches == 1, what="the watch")
        transactions.clear()  # the LIST's
        watches, reads = src.stats["Pod"].watches, src.stats["Pod"].watch_reads
        rv = str(fake.rv)

        def event(etype: str, name: str, v: str) -> bytes:
            obj = pod(name, "demo", labels={"v": v})
            obj["metadata"]["resourceVersion"] = rv
            return json.dumps({"type": etype, "object": obj}).encode() + b"\n"

        fake.inject = (event("MODIFIED", "a", "1") + event("MODIFIED", "b", "1")
                       + event("DELETED", "a", "1") + event("ADDED", "c", "1")
                       + event("MODIFIED", "c", "2") + b"not json\n")
        await eventually(lambda: src.stats["Pod"].watches > watches, timeout=5,
                         what="a new watch after the malformed line")
        assert [t for tx in transactions for t in tx] == [
            ("a", "1"), ("b", "1"), ("a", "del"), ("c", "1"), ("c", "2")]
        # the delete alone; the upserts around it batched (one write of the fake is one
        # read here: [[a, b], [del a], [c, c]]; a read split in two would still batch some)
        assert [("a", "del")] in transactions and len(transactions) < 5, transactions
        assert src.stats["Pod"].watch_reads > reads
        assert store.get("Pod", "demo", "a") is None
        assert store.get("Pod", "demo", "b")["metadata"]["labels"] == {"v": "1"}
        assert store.get("Pod", "demo", "c")["metadata"]["labels"] == {"v": "2"}
    finally:
        await src.stop()
        await src.api.close()
