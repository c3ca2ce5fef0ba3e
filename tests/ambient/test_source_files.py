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
    objects, errors = parse_file(str(f))
    kinds = [o.get("kind") for o, _ in objects]
    assert kinds == ["Pod", "Service", "Service", "LocalWorkload"]
    assert "#1.items[1] Service ?/7" not in objects[2][1]  # where names the document and item
    assert objects[2][1].startswith(f"{f}#1.items[1]")
    assert len(errors) == 1 and "workloads[1]" in errors[0][0] and "namespace" in errors[0][1]


def test_parse_syntax_error_keeps_earlier_documents(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text(POD % ("a", "u-a", "10.0.0.1") + "---\nkind: [unclosed\n")
    objects, errors = parse_file(str(f))
    assert [o["metadata"]["name"] for o, _ in objects] == ["a"]
    assert "malformed YAML at line" in errors[0][1]
    j = tmp_path / "x.json"
    j.write_text("{nope")
    assert "malformed JSON" in parse_file(str(j))[1][0][1]


@pytest.mark.asyncio
async def test_directory_source_loads_watches_and_reports_bad_objects(tmp_path, caplog):
    registry = CollectorRegistry()
    store = ObjectStore(registry)
    directory = tmp_path / "cluster"  # created by start()
    src = DirectorySource(store, str(directory), run_blocking, debounce_ms=10)
    index = AmbientIndex(store, Mesh(cluster_id="c"), registry, derive_hbone_from_labels=True)
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
        assert registry.get_sample_value("ambient_config_objects_rejected_total",
                                         {"source": "files", "reason": "duplicate-uid"}) == 1
        index.start()
        assert index.address("c//Pod/demo/a") is not None
        assert index.address("c//Pod/demo/b") is None  # invalid IP: skipped by the index
        assert registry.get_sample_value("ambient_index_rejected_total", {"kind": "Pod"}) == 1

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
    assert [o["metadata"]["name"] for o, _ in objects] == ["ok"]
    assert [w for w, _ in errors] == [f"{tmp_path}/local.yaml#0 workloads[0]",
                                      f"{tmp_path}/local.yaml#0 workloads[1]"]
    assert all("malformed entry" in e for _, e in errors)
    registry = CollectorRegistry()
    store = ObjectStore(registry)
    src = DirectorySource(store, str(tmp_path), run_blocking)
    await src.start()
    try:
        assert store.get("LocalWorkload", "a", "ok") is not None
        assert store.get("Pod", "demo", "a") is not None
        assert registry.get_sample_value("ambient_config_objects_rejected_total",
                                         {"source": "files", "reason": "invalid"}) == 3
    finally:
        await src.stop()


@pytest.mark.asyncio
async def test_watch_survives_the_directory_being_removed_and_recreated(tmp_path):
    """The removed directory's inotify watch never fires again: the source used to stay
    deaf after ``rm -r config_dir`` (now it re-watches), even with a file at the path."""
    directory = tmp_path / "cluster"
    store = ObjectStore()
    src = DirectorySource(store, str(directory), run_blocking, debounce_ms=10)
    await src.start()
    try:
        (directory / "a.yaml").write_text(POD % ("a", "u-a", "10.0.0.1"))
        await eventually(lambda: store.get("Pod", "demo", "a") is not None)
        shutil.rmtree(directory)
        await eventually(lambda: store.get("Pod", "demo", "a") is None)
        directory.write_text("a file where the directory was")
        await asyncio.sleep(1.2)  # one failed recreation attempt
        directory.unlink()
        directory.mkdir(exist_ok=True)
        (directory / "b.yaml").write_text(POD % ("b", "u-b", "10.0.0.2"))
        await eventually(lambda: store.get("Pod", "demo", "b") is not None)
        assert not src._task.done()
    finally:
        await src.stop()
