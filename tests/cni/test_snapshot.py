"""Component ``cni-snapshot`` over the real files config source (a YAML directory watched
with inotify): the snapshot is written at start, follows label edits, is 0600, not
rewritten when nothing changed, kept at stop (removed when safe upgrade is disabled),
and a failed write is reported without stopping the agent."""

from __future__ import annotations

import asyncio
import json
import os
import stat

import yaml

from agent.core import config as agent_config
from agent.core.lifecycle import AgentContext
from ambient import source as ambient_source
from cni import plugin_request, snapshot
from tests.helpers import eventually

AMBIENT = {"istio.io/dataplane-mode": "ambient"}


def write(path, *objs):
    tmp = str(path) + ".tmp"
    with open(tmp, "w") as f:
        yaml.safe_dump_all(list(objs), f)
    os.replace(tmp, path)


def objects(ns_labels):
    return [{"apiVersion": "v1", "kind": "Namespace",
             "metadata": {"name": "shop", "labels": ns_labels}},
            {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": "cart", "namespace": "shop", "uid": "u-cart"},
             "spec": {"nodeName": "n1"}, "status": {"phase": "Running"}},
            {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": "far", "namespace": "shop", "uid": "u-far"},
             "spec": {"nodeName": "n2"}}]


async def start(tmp_path, **extra):
    cluster = tmp_path / "cluster"
    cluster.mkdir(exist_ok=True)
    cfg = agent_config.load({"state_dir": str(tmp_path / "state"), "config_dir": str(cluster),
                             "config_file": os.devnull, "node_name": "n1"}, env={})
    ctx = AgentContext(cfg.replace(**extra) if extra else cfg)
    source = ctx.add(ambient_source.build(ctx))
    writer = ctx.add(snapshot.build(ctx, source))
    await source.start()
    await writer.start()
    return ctx, source, writer, cluster


def read(writer):
    with open(writer.path) as f:
        return json.load(f)


async def test_written_at_start_follows_edits_and_stays(tmp_path):
    cluster = tmp_path / "cluster"
    cluster.mkdir()
    write(cluster / "all.yaml", *objects({}))
    ctx, source, writer, _ = await start(tmp_path)
    try:
        assert writer.path == str(tmp_path / "state" / plugin_request.SNAPSHOT_NAME)
        assert writer.ready() == (True, "")
        snap = read(writer)
        assert (snap["pods"], snap["namespaces"]) == ({"u-cart": False}, {"shop": False})
        assert stat.S_IMODE(os.stat(writer.path).st_mode) == 0o600
        # the namespace is labelled ambient: the plugin's answer changes within ~0.1 s
        write(cluster / "all.yaml", *objects(AMBIENT))
        await eventually(lambda: read(writer)["namespaces"] == {"shop": True})
        assert read(writer)["pods"] == {"u-cart": True}
        assert read(writer)["excluded_namespaces"] == ["kube-system"]
        # the file is replaced before the writer counts it: wait for the write to finish
        await eventually(lambda: not writer._task or writer._task.done())
        writes = writer.writes
        # a change that alters no decision: not rewritten
        objs = objects(AMBIENT)
        objs[1]["metadata"]["labels"] = {"app": "cart"}
        write(cluster / "all.yaml", *objs)
        await eventually(lambda: source.store.get("Pod", "shop", "cart")["metadata"].get(
            "labels") == {"app": "cart"})
        await eventually(lambda: not writer._task or writer._task.done())
        assert writer.writes == writes
        # another node's pod changes: not even a rebuild (pod events are constant at scale)
        objs[2]["metadata"]["labels"] = {"app": "far"}
        write(cluster / "all.yaml", *objs)
        await eventually(lambda: source.store.get("Pod", "shop", "far")["metadata"].get(
            "labels") == {"app": "far"})
        assert writer._task.done() and not writer._dirty
    finally:
        await writer.stop(1)
        await source.stop(1)
        ctx.executor.shutdown(wait=False)
    assert read(writer)["pods"] == {"u-cart": True}  # kept for the plugin


async def test_removed_at_stop_when_safe_upgrade_disabled(tmp_path):
    ctx, source, writer, _ = await start(tmp_path, ambient_disable_safe_upgrade=True)
    try:
        assert read(writer)["pods"] == {}
    finally:
        await writer.stop(1)
        await source.stop(1)
        ctx.executor.shutdown(wait=False)
    assert not os.path.exists(writer.path)


async def test_failed_write_is_reported_and_retried_with_the_next_change(tmp_path, caplog):
    cluster = tmp_path / "cluster"
    cluster.mkdir()
    write(cluster / "all.yaml", *objects({}))
    blocked = tmp_path / "state" / plugin_request.SNAPSHOT_NAME
    os.makedirs(blocked)  # a directory where the file belongs: rename fails
    ctx, source, writer, _ = await start(tmp_path)
    try:
        ok, why = writer.ready()
        assert not ok and "cannot write" in why and str(blocked) in why
        assert "the plugin keeps the previous snapshot" in caplog.text
        os.rmdir(blocked)
        write(cluster / "all.yaml", *objects(AMBIENT))
        await eventually(lambda: writer.ready()[0])
        assert read(writer)["namespaces"] == {"shop": True}
    finally:
        await writer.stop(1)
        await source.stop(1)
        ctx.executor.shutdown(wait=False)


async def test_previous_snapshot_kept_until_the_source_has_loaded(tmp_path):
    """An agent whose config source has not loaded yet (a Kubernetes source before its
    first LIST) must not replace the previous run's snapshot with an empty one: the plugin
    would then let that run's ambient pods through unmeshed while no agent answers."""
    cluster = tmp_path / "cluster"
    cluster.mkdir()
    write(cluster / "objs.yaml", *objects(AMBIENT))
    cfg = agent_config.load({"state_dir": str(tmp_path / "state"), "config_dir": str(cluster),
                             "config_file": os.devnull, "node_name": "n1"}, env={})
    ctx = AgentContext(cfg)
    source = ctx.add(ambient_source.build(ctx))
    writer = ctx.add(snapshot.build(ctx, source))
    os.makedirs(os.path.dirname(writer.path), exist_ok=True)
    previous = {"version": 1, "excluded_namespaces": [], "namespaces": {"shop": True},
                "pods": {"u-old": True}}
    with open(writer.path, "w") as f:
        json.dump(previous, f)
    try:
        await writer.start()  # the source has not loaded anything yet
        assert not source.ready()[0]
        await asyncio.sleep(3 * snapshot.DEBOUNCE)
        assert read(writer) == previous
        assert writer.ready()[0] is False
        await source.start()
        await eventually(lambda: read(writer)["pods"] == {"u-cart": True})
        assert writer.ready() == (True, "")
    finally:
        await writer.stop(1)
        await source.stop(1)
        ctx.executor.shutdown(wait=False)


def _records(caplog, level):
    return [r for r in caplog.records if r.name == "cni.snapshot" and r.levelno == level]


async def _stale_then_caught_up(tmp_path, caplog, cluster, writer, block, unblock):
    """Shared body: after a good write, ``block()`` makes writes fail; a change then
    leaves the file stale (not ready, reason naming file and error, one ERROR);
    ``unblock()`` and, with no further change, the file catches up (one INFO)."""
    import logging
    caplog.set_level(logging.DEBUG, logger="cni.snapshot")
    await eventually(lambda: writer.ready() == (True, ""))
    assert read(writer)["namespaces"] == {"shop": False}
    block()
    write(cluster / "all.yaml", *objects(AMBIENT))
    await eventually(lambda: not writer.ready()[0], timeout=20, what="not ready while stale")
    ok, why = writer.ready()
    assert "cannot write" in why and writer.path in why, why
    assert writer.debug_state()["stale"] is True
    # retried with backoff meanwhile, logged as ERROR only once
    await eventually(lambda: writer.debug_state()["retry_delay"] >= 4, timeout=30,
                     what="two retries")
    assert len(_records(caplog, logging.ERROR)) == 1
    assert not writer.ready()[0]
    unblock()
    # no change: the retry alone catches the file up
    await eventually(lambda: writer.ready() == (True, ""), timeout=40, what="caught up")
    assert read(writer)["namespaces"] == {"shop": True}
    assert read(writer)["pods"] == {"u-cart": True}
    infos = [r for r in _records(caplog, logging.INFO) if "current again" in r.getMessage()]
    assert len(infos) == 1 and len(_records(caplog, logging.ERROR)) == 1
    assert writer.debug_state()["retry_delay"] == snapshot.RETRY_FIRST


async def test_stale_snapshot_is_not_ready_and_retried_until_written(tmp_path, caplog):
    """A write failing after a good one (here: a directory where the file goes, rename
    fails) was logged once and never retried, and ``ready`` stayed True."""
    cluster = tmp_path / "cluster"
    cluster.mkdir()
    write(cluster / "all.yaml", *objects({}))
    ctx, source, writer, _ = await start(tmp_path)

    def block():
        os.unlink(writer.path)
        os.mkdir(writer.path)
        open(os.path.join(writer.path, "keep"), "w").close()  # rename over it fails

    def unblock():
        os.unlink(os.path.join(writer.path, "keep"))
        os.rmdir(writer.path)

    try:
        await _stale_then_caught_up(tmp_path, caplog, cluster, writer, block, unblock)
    finally:
        await writer.stop(1)
        await source.stop(1)
        ctx.executor.shutdown(wait=False)


async def test_enospc_snapshot_is_not_ready_and_caught_up_after_space_freed(tmp_path, caplog):
    """The tester's case: the state dir is a small tmpfs, filled (ENOSPC), then freed."""
    import errno
    import subprocess
    import pytest
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    state = tmp_path / "state"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700",
                    f"snaptest-{os.getpid()}", str(state)], check=True)
    filler = state / "filler"
    try:
        cluster = tmp_path / "cluster"
        cluster.mkdir()
        write(cluster / "all.yaml", *objects({}))
        ctx, source, writer, _ = await start(tmp_path)

        def block():
            with open(filler, "wb", buffering=0) as f:
                try:
                    while True:
                        f.write(b"x" * 4096)
                except OSError as e:
                    assert e.errno == errno.ENOSPC

        try:
            await _stale_then_caught_up(tmp_path, caplog, cluster, writer, block,
                                        lambda: os.unlink(filler))
            assert "No space left" in caplog.text
        finally:
            await writer.stop(1)
            await source.stop(1)
            ctx.executor.shutdown(wait=False)
    finally:
        subprocess.run(["umount", str(state)], check=False)
