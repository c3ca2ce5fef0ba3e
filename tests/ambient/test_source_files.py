"""The directory source on a real tmp directory with real inotify watching (watchfiles)."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import textwrap

import pytest
from prometheus_client import CollectorRegistry

from ambient.index import AmbientIndex
from ambient.objects import Mesh
from ambient.source_files import DirectorySource, parse_file
from ambient.store import ObjectStore
from tests.helpers import eventually


async def run_blocking(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


POD = textwrap.dedent("""\
    apiVersion: v1
    kind: Pod
    metadata: {name: %s, namespace: demo, uid: %s}
    spec: {nodeName: n1, serviceAccountName: sa}
    status: {podIP: %s, phase: Running}
    """)


def test_parse_multi_doc_list_local_config_and_bad_objects(tmp_path, caplog):
    f = tmp_path / "all.yaml"
    f.write_text(POD % ("a", "u-a", "10.0.0.1") + "---\n" + textwrap.dedent("""\
        apiVersion: v1
        kind: List
        items:
        - {apiVersion: v1, kind: Service, metadata: {name: s, namespace: demo}, spec: {}}
        - {apiVersion: v1, kind: Service, metadata: {name: 7}}
        ---
        workloads:
        - {uid: w1, name: local, namespace: default, workloadIps: ["127.0.0.1"], services: {}}
        - {name: broken, workloadIps: ["x"], services: {}}
        policies: []
        """))
    parsed = parse_file(str(f))
    objects, errors = parsed
    kinds = [o.get("kind") for o, _ in objects]
    # the local-config document has a bad entry: it loads nothing, as in ztunnel
    assert kinds == ["Pod", "Service", "Service"]
    assert "#1.items[1] Service ?/7" not in objects[2][1]  # where names the document and item
    assert objects[2][1].startswith(f"{f}#1.items[1]")
    assert len(errors) == 1 and "workloads[1]" in errors[0][0] and "namespace" in errors[0][1]
    assert parsed.broken_kind == "local-config" and "document #2 rejected whole" in \
        parsed.broken


def test_parse_syntax_error_keeps_earlier_documents(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text(POD % ("a", "u-a", "10.0.0.1") + "---\nkind: [unclosed\n")
    parsed = parse_file(str(f))
    assert [o["metadata"]["name"] for o, _ in parsed.objects] == ["a"]
    assert "malformed YAML at line 8" in parsed.broken and parsed.broken_kind == "syntax"
    j = tmp_path / "x.json"
    j.write_text("{nope")
    assert "malformed JSON at line 1" in parse_file(str(j)).broken


@pytest.mark.asyncio
async def test_directory_source_loads_watches_and_reports_bad_objects(tmp_path, caplog):
    registry = CollectorRegistry()
    store = ObjectStore(registry)
    directory = tmp_path / "cluster"  # created by start()
    src = DirectorySource(store, str(directory), run_blocking, debounce_ms=10)
    index = AmbientIndex(store, Mesh(cluster_id="c"), registry)
    try:
        directory.mkdir()
        (directory / "sub").mkdir()
        (directory / "sub" / "pods.yml").write_text(
            POD % ("a", "u-a", "10.0.0.1") + "---\n" + POD % ("b", "u-b", "not-an-ip")
            + "---\n" + POD % ("dup", "u-a", "10.0.0.3")
            + "---\n" + json.dumps({"kind": "Pod", "metadata": {"name": "c", "labels": 5}}))
        (directory / "notes.txt").write_text("ignored")
        await src.start()
        assert src.loaded
        assert store.pod_by_uid("u-a")["metadata"]["name"] == "a"
        assert store.get("Pod", "demo", "dup") is None  # duplicate uid skipped
        assert store.get("Pod", "default", "c") is None  # labels of the wrong type
        assert "duplicate-uid" in caplog.text or "already used" in caplog.text
        assert "metadata.labels" in caplog.text
        assert registry.get_sample_value("ambient_agent_config_objects_rejected_total",
                                         {"source": "files", "reason": "duplicate-uid"}) == 1
        index.start()
        assert index.address("c//Pod/demo/a") is not None
        assert index.address("c//Pod/demo/b") is None  # invalid IP: skipped by the index
        assert registry.get_sample_value("ambient_agent_index_rejected_total", {"kind": "Pod"}) == 1

        changes = []
        index.subscribe(changes.append)
        # a new file: upsert
        (directory / "new.yaml").write_text(POD % ("n", "u-n", "10.0.0.9"))
        await eventually(lambda: index.address("c//Pod/demo/n") is not None)
        assert any("c//Pod/demo/n" in c.addresses_changed for c in changes)
        # an edit: only what changed is announced
        changes.clear()
        (directory / "new.yaml").write_text(POD % ("n", "u-n", "10.0.0.10"))
        await eventually(lambda: any(c.addresses_changed for c in changes))
        assert set().union(*(c.addresses_changed for c in changes)) == {"c//Pod/demo/n"}
        # a reload is logged with what the file holds now (store-rejected objects too)
        caplog.set_level(logging.INFO, logger="ambient")
        caplog.clear()
        (directory / "mixed.yaml").write_text(
            POD % ("m", "u-m", "10.0.0.11") + "---\n" + POD % ("m2", "u-a", "10.0.0.12"))
        await eventually(lambda: "mixed.yaml reloaded" in caplog.text)
        assert "mixed.yaml reloaded: 1 objects, 1 skipped" in caplog.text
        # deleting the file deletes its objects
        (directory / "new.yaml").unlink()
        await eventually(lambda: index.address("c//Pod/demo/n") is None)
        assert store.pod_by_uid("u-n") is None
        # the source survived all of it
        assert store.get("Pod", "demo", "a") is not None
    finally:
        await src.stop()
        index.stop()


@pytest.mark.asyncio
async def test_creates_missing_directory(tmp_path):
    store = ObjectStore()
    src = DirectorySource(store, str(tmp_path / "a" / "b"), run_blocking)
    await src.start()
    try:
        assert (tmp_path / "a" / "b").is_dir()
        assert len(store) == 0
    finally:
        await src.stop()


@pytest.mark.asyncio
async def test_oddly_shaped_entries_are_skipped_and_the_source_still_starts(tmp_path):
    """Fields of an unexpected shape (not just a wrong scalar) used to raise out of
    parse_file (AttributeError/TypeError) and fail DirectorySource.start."""
    (tmp_path / "local.yaml").write_text(textwrap.dedent("""\
        workloads:
        - {namespace: a, workloadIps: ["10.0.0.1"], services: {}, applicationTunnel: x}
        - {namespace: a, workloadIps: ["10.0.0.2"], services: {}, protocol: [1]}
        - {uid: ok, namespace: a, workloadIps: ["10.0.0.3"], services: {}}
        """))
    (tmp_path / "pods.yaml").write_text(
        "kind: Pod\nmetadata: {name: p, namespace: 5}\n---\n" + POD % ("a", "u-a", "10.0.0.1"))
    objects, errors = parse_file(str(tmp_path / "local.yaml"))
    assert objects == []  # the document loads whole or not at all
    assert [w for w, _ in errors] == [f"{tmp_path}/local.yaml#0 workloads[0]",
                                      f"{tmp_path}/local.yaml#0 workloads[1]"]
    assert "workloads[0].applicationTunnel" in errors[0][1]
    assert "workloads[1].protocol" in errors[1][1]
    registry = CollectorRegistry()
    store = ObjectStore(registry)
    src = DirectorySource(store, str(tmp_path), run_blocking, registry=registry)
    await src.start()
    try:
        assert store.get("LocalWorkload", "a", "ok") is None
        assert store.get("Pod", "demo", "a") is not None
        assert registry.get_sample_value("ambient_agent_config_objects_rejected_total",
                                         {"source": "files", "reason": "invalid"}) == 3
        assert registry.get_sample_value("ambient_agent_config_file_errors_total",
                                         {"reason": "local-config"}) == 1
    finally:
        await src.stop()


@pytest.mark.asyncio
async def test_removed_directory_keeps_its_objects_and_is_resumed_not_recreated(tmp_path,
                                                                                  caplog):
    """``rm -r config_dir`` while running used to drop every object (unmeshing the pods)
    and re-create the directory empty. Now the objects stay, one WARN names the directory,
    nothing is created at the path (not even over a file sitting there), and once the
    directory is back it is read again (the removed inotify watch never fires again, so
    the source re-watches)."""
    caplog.set_level(logging.INFO, logger="ambient.source_files")
    directory = tmp_path / "cluster"
    store = ObjectStore()
    src = DirectorySource(store, str(directory), run_blocking, debounce_ms=10)
    await src.start()
    try:
        (directory / "a.yaml").write_text(POD % ("a", "u-a", "10.0.0.1"))
        await eventually(lambda: store.get("Pod", "demo", "a") is not None)
        shutil.rmtree(directory)
        await eventually(lambda: src.directory_missing, timeout=30)
        assert store.get("Pod", "demo", "a") is not None
        removed = [r for r in caplog.records if "was removed" in r.getMessage()]
        assert len(removed) == 1 and removed[0].levelno == logging.WARNING
        assert str(directory) in removed[0].getMessage()
        directory.write_text("a file where the directory was")
        # the source polls once a second: after three polls the file is still a file
        await asyncio.sleep(3.5)
        assert directory.is_file() and store.get("Pod", "demo", "a") is not None
        directory.unlink()
        await asyncio.sleep(1.5)
        assert not directory.exists()
        directory.mkdir()
        (directory / "b.yaml").write_text(POD % ("b", "u-b", "10.0.0.2"))
        await eventually(lambda: store.get("Pod", "demo", "b") is not None, timeout=30)
        # the directory that came back is the truth: a.yaml is not in it
        await eventually(lambda: store.get("Pod", "demo", "a") is None, timeout=30)
        assert not src._task.done() and not src.directory_missing
        assert len([r for r in caplog.records if "was removed" in r.getMessage()]) == 1
        # and it is watched again
        (directory / "c.yaml").write_text(POD % ("c", "u-c", "10.0.0.3"))
        await eventually(lambda: store.get("Pod", "demo", "c") is not None, timeout=30)
    finally:
        await src.stop()


NS_AMBIENT = "apiVersion: v1\nkind: Namespace\nmetadata: {name: demo, labels: " \
    "{istio.io/dataplane-mode: ambient}}\n"


@pytest.mark.asyncio
async def test_syntax_error_keeps_the_files_last_good_objects(tmp_path, caplog):
    """An editor saving a half-written file (one line broken) used to withdraw every object
    after the bad line: pods vanished from xDS and an enrolled pod's workload lost its
    tunnel. The file's last good objects now stay until it parses again (WARNING naming
    file, line and reason; ambient_agent_config_files_stale / ambient_agent_config_file_errors_total)."""
    registry = CollectorRegistry()
    store = ObjectStore(registry)
    src = DirectorySource(store, str(tmp_path), run_blocking, debounce_ms=10,
                          registry=registry)
    index = AmbientIndex(store, Mesh(cluster_id="c"), registry)
    f = tmp_path / "pods.yaml"
    # pod b as the node agent leaves an enrolled pod: annotated captured (HBONE)
    enrolled_b = (POD % ("b", "u-b", "10.0.0.2")).replace(
        "uid: u-b}", "uid: u-b, annotations: {ambient.istio.io/redirection: enabled}}")
    good = NS_AMBIENT + "---\n" + POD % ("a", "u-a", "10.0.0.1") + "---\n" + enrolled_b
    f.write_text(good)
    stale = lambda: registry.get_sample_value("ambient_agent_config_files_stale")  # noqa: E731
    try:
        await src.start()
        index.start()
        from ambient import workload_pb2 as wl
        assert index.address("c//Pod/demo/b").workload.tunnel_protocol == wl.HBONE
        caplog.set_level(logging.INFO, logger="ambient")
        caplog.clear()
        # line 3 of the file broken mid-edit: the namespace and both pods stay
        f.write_text(good.replace("labels: {istio.io", "labels: [istio.io", 1))
        await eventually(lambda: stale() == 1, what="file marked stale")
        warning = [r for r in caplog.records if "keeping its 3 objects" in r.getMessage()]
        assert warning and warning[0].levelno == logging.WARNING
        assert str(f) in warning[0].getMessage() and "line 3" in warning[0].getMessage()
        assert store.get("Pod", "demo", "b") is not None
        assert index.address("c//Pod/demo/b").workload.tunnel_protocol == wl.HBONE
        assert registry.get_sample_value("ambient_agent_config_file_errors_total",
                                         {"reason": "syntax"}) == 1
        # fixed (and edited): the new content applies and the file is no longer stale
        f.write_text(NS_AMBIENT + "---\n" + POD % ("a", "u-a", "10.0.0.1"))
        await eventually(lambda: stale() == 0 and store.get("Pod", "demo", "b") is None)
        assert "parses again" in caplog.text
        assert store.get("Pod", "demo", "a") is not None
        # a file first seen broken has no good version: what parsed loads
        (tmp_path / "new.yaml").write_text(POD % ("n", "u-n", "10.0.0.9") + "---\nkind: [x\n")
        await eventually(lambda: store.get("Pod", "demo", "n") is not None)
        assert stale() == 0 and "no earlier good version" in caplog.text
    finally:
        await src.stop()
        index.stop()


@pytest.mark.parametrize("cached", [False, True])
def test_a_key_given_twice_breaks_the_file_naming_both_lines(tmp_path, cached):
    """``name`` given twice in one document used to load the second value unseen (PyYAML
    keeps the last key); kubectl and ztunnel refuse such a file, so the files source
    treats it as not parsing (the file's last good objects stay, as for a syntax
    error), naming the key and both lines. Chunked parse (with a cache) and the whole
    parse say the same; a ``<<`` merge overridden by the mapping's own key is not a
    duplicate."""
    f = tmp_path / "ns.yaml"
    f.write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: a}\n---\n"
                 "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: b\n  name: c\n")
    parsed = parse_file(str(f), {} if cached else None)
    assert parsed.broken == "malformed YAML at line 9: key 'name' given twice (first at line 8)"
    assert parsed.broken_kind == "syntax"
    f.write_text("apiVersion: v1\nkind: Namespace\nmetadata:\n  <<: {name: a}\n  name: b\n")
    parsed = parse_file(str(f), {} if cached else None)
    assert not parsed.broken and [o["metadata"]["name"] for o, _ in parsed.objects] == ["b"]


@pytest.mark.asyncio
async def test_a_key_given_twice_keeps_the_files_last_good_objects(tmp_path, caplog):
    """Through the source: a duplicate key saved into a good file keeps its objects
    (one WARNING naming file, line and key), and the fixed file applies."""
    store = ObjectStore(CollectorRegistry())
    src = DirectorySource(store, str(tmp_path), run_blocking, debounce_ms=10,
                          registry=CollectorRegistry())
    f = tmp_path / "pods.yaml"
    good = NS_AMBIENT + "---\n" + POD % ("a", "u-a", "10.0.0.1")
    f.write_text(good)
    try:
        await src.start()
        caplog.set_level(logging.INFO, logger="ambient")
        f.write_text(good + "metadata: {name: other}\n")
        await eventually(lambda: "given twice" in caplog.text, what="the duplicate named")
        warning = [r for r in caplog.records if "given twice" in r.getMessage()]
        assert len(warning) == 1 and warning[0].levelno == logging.WARNING
        assert "keeping its 2 objects" in warning[0].getMessage()
        assert "key 'metadata' given twice (first at line" in warning[0].getMessage()
        assert store.get("Pod", "demo", "a") is not None
        f.write_text(good.replace("u-a", "u-a2"))
        await eventually(lambda: store.get("Pod", "demo", "a")["metadata"]["uid"] == "u-a2",
                         what="the fixed file applied")
        assert "config file %s parses again" % f in caplog.text
    finally:
        await src.stop()


async def test_names_kubernetes_would_refuse_are_skipped_with_one_warning(tmp_path, caplog):
    """A hand-written Pod named ``UPPER_bad`` was loaded (newuser finding); an API server
    refuses it (DNS-1123 subdomain), so the files source does too, naming the object."""
    directory = tmp_path / "cluster"
    directory.mkdir()
    (directory / "pods.yaml").write_text(
        POD % ("UPPER_bad", "u-bad", "10.0.0.7") + "---\n" + POD % ("good.v1", "u-ok", "10.0.0.8")
        + "---\n" + json.dumps({"kind": "List", "items": [
            {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "9lives",
                                                                 "namespace": "demo"},
             "spec": {"selector": {"app": "x"}}},
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "a.b"}},
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "Demo"}}]}))
    store = ObjectStore(CollectorRegistry())
    src = DirectorySource(store, str(directory), run_blocking, debounce_ms=10)
    caplog.set_level(logging.WARNING)
    try:
        await src.start()
        assert store.pod_by_uid("u-ok") is not None
        assert store.pod_by_uid("u-bad") is None
        assert store.get("Service", "demo", "9lives") is None
        assert store.get("Namespace", "", "a.b") is None
        assert store.get("Pod", "Demo", "p") is None
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        bad = [w for w in warnings if "UPPER_bad" in w]
        assert len(bad) == 1 and "not a valid Pod name" in bad[0] and "pods.yaml#0" in bad[0]
        assert sum("not a valid Service name" in w for w in warnings) == 1
        assert sum("not a valid Namespace name" in w for w in warnings) == 1
        assert sum("'metadata.namespace' 'Demo'" in w for w in warnings) == 1
    finally:
        await src.stop()


async def test_labels_and_service_accounts_kubernetes_would_refuse_are_skipped(tmp_path, caplog):
    """A Pod with ``labels: {app: "x\\ny"}`` and a serviceAccountName carrying a forged log
    line was served to ztunnel (newuser finding 9), and an invalid name's ESC bytes reached
    the log raw. Such objects are skipped with one WARN each; nothing logged is raw."""
    directory = tmp_path / "cluster"
    directory.mkdir()

    def pod(name: str, uid: str, labels: dict, sa: str = "sa") -> dict:
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": "demo", "uid": uid, "labels": labels},
                "spec": {"nodeName": "n1", "serviceAccountName": sa},
                "status": {"podIP": "10.0.0.7", "phase": "Running"}}
    objs = [pod("nl-value", "u1", {"app": "x\ny"}),
            pod("forged-sa", "u2", {"app": "x"}, "sa\nFAKE 2026-12-02 INFO forged line"),
            pod("long-value", "u3", {"app": "v" * 64}),
            pod("bad-key", "u4", {"-app": "x"}),
            pod("bad-prefix", "u5", {"Example.com/app": "x"}),
            pod("evil\x1b[2J", "u6", {}),
            {"apiVersion": "networking.istio.io/v1", "kind": "WorkloadEntry",
             "metadata": {"name": "we", "namespace": "demo"},
             "spec": {"address": "10.0.0.9", "labels": {"app": "a b"}}},
            pod("ok", "u-ok", {"app": "x", "example.com/tier": "front-1.0", "e": ""},
                "sa.v1-x")]
    (directory / "pods.yaml").write_text("\n---\n".join(json.dumps(o) for o in objs))
    store = ObjectStore(CollectorRegistry())
    src = DirectorySource(store, str(directory), run_blocking, debounce_ms=10)
    caplog.set_level(logging.WARNING)
    try:
        await src.start()
        assert store.pod_by_uid("u-ok") is not None
        assert [store.pod_by_uid(f"u{i}") for i in range(1, 7)] == [None] * 6
        assert store.get("WorkloadEntry", "demo", "we") is None
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 7, warnings
        for w in warnings:
            assert "\x1b" not in w and "\n" not in w and len(w) < 2000, w
        one = lambda needle: [w for w in warnings if needle in w]  # noqa: E731
        assert len(one("'metadata.labels.app' value 'x\\ny'")) == 1
        assert len(one("'spec.serviceAccountName' 'sa\\nFAKE")) == 1
        assert len(one("'metadata.labels' key '-app'")) == 1
        assert len(one("'metadata.labels' key 'Example.com/app'")) == 1
        assert len(one("'spec.labels.app' value 'a b'")) == 1
        assert len(one("Pod demo/'evil\\x1b[2J'")) == 1
    finally:
        await src.stop()
