"""The plugin's decision while no agent answers: the real ``istio-cni`` plugin executed
through the launcher our installer writes (as a runtime runs it), reading enablement
snapshots built and written by the agent's own code (``cni.snapshot`` over a real
``ambient.store.ObjectStore``). Ambient pods get code 11 (try again later), every other
pod its prevResult; no usable snapshot is code 11 (fail closed)."""

from __future__ import annotations

import json
import os

import pytest

from ambient.store import ObjectStore
from cni import plugin_request
from cni.snapshot import build_snapshot, write_snapshot
from tests.cni.conftest import cni_env, net_conf, run_plugin, start_agent

NODE = "node-1"
AMBIENT = {"istio.io/dataplane-mode": "ambient"}


def pod(name, ns, uid, labels=None, node=NODE, phase="Running"):
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "uid": uid, "labels": labels or {}},
            "spec": {"nodeName": node} if node is not None else {},
            "status": {"phase": phase}}


def namespace(name, labels=None):
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "labels": labels or {}}}


def store_of(*objs):
    store = ObjectStore()
    store.apply([(o, "test") for o in objs], origin="test")
    return store


def write(run_dir, store, source="kubernetes", exclude=("kube-system",)):
    os.makedirs(run_dir, exist_ok=True)
    content = build_snapshot(store, node_name=NODE, source=source,
                             exclude_namespaces=list(exclude))
    write_snapshot(os.path.join(run_dir, plugin_request.SNAPSHOT_NAME), content)
    return content


def kube_args(ns, name, uid):
    return f"IgnoreUnknown=1;K8S_POD_NAMESPACE={ns};K8S_POD_NAME={name};K8S_POD_UID={uid}"


async def add(launcher, run_dir, args, container_id="c0ffee", **keys):
    conf = net_conf(run_dir, **keys)
    rc, out, err = await run_plugin(launcher, cni_env(args=args, container_id=container_id),
                                    conf)
    return rc, out, err, conf


def test_snapshot_content():
    store = store_of(
        namespace("amb", AMBIENT), namespace("plain"), namespace("kube-system", AMBIENT),
        pod("a", "amb", "u-a"), pod("opt-out", "amb", "u-o", {"istio.io/dataplane-mode": "none"}),
        pod("own", "plain", "u-own", AMBIENT), pod("p", "plain", "u-p"),
        pod("far", "amb", "u-far", node="node-2"), pod("done", "amb", "u-done",
                                                        phase="Succeeded"),
        pod("unscheduled", "amb", "u-uns", node=None))
    snap = build_snapshot(store, node_name=NODE, source="kubernetes",
                          exclude_namespaces=["kube-system"])
    assert snap == {"version": 1, "node": NODE, "source": "kubernetes",
                    "excluded_namespaces": ["kube-system"],
                    "namespaces": {"amb": True, "kube-system": False, "plain": False},
                    "pods": {"u-a": True, "u-o": False, "u-own": True, "u-p": False}}
    # the files source: a Pod without a node is a pod of this host
    files = build_snapshot(store, node_name=NODE, source="files", exclude_namespaces=[])
    assert files["pods"]["u-uns"] is True and "u-far" not in files["pods"]
    assert build_snapshot(None, node_name=NODE, source="files", exclude_namespaces=[])[
        "pods"] == {}


async def test_kubernetes_pods_without_the_agent(tmp_path, launcher):
    run = str(tmp_path / "run")
    write(run, store_of(namespace("amb", AMBIENT), namespace("plain"),
                        pod("a", "amb", "u-a"), pod("own", "plain", "u-own", AMBIENT),
                        pod("opt-out", "amb", "u-o", {"istio.io/dataplane-mode": "none"}),
                        pod("p", "plain", "u-p")))
    for ns, name, uid, ambient in [
            ("amb", "a", "u-a", True),            # known, ambient by its namespace
            ("plain", "own", "u-own", True),      # known, ambient by its own label
            ("amb", "opt-out", "u-o", False),     # known, labelled none
            ("plain", "p", "u-p", False),         # known, not ambient
            ("amb", "new", "u-new", True),        # created while the agent was down
            ("plain", "new2", "u-new2", False),
            ("kube-system", "k", "u-k", False),   # excluded (the agent's list)
            ("elsewhere", "x", "u-x", False)]:    # unknown namespace, no ambient_default
        rc, out, err, conf = await add(launcher, run, kube_args(ns, name, uid))
        if ambient:
            assert rc == 1 and out["code"] == plugin_request.ERR_TRY_AGAIN, (name, out)
            assert f"pod {ns}/{name} is ambient" in out["msg"]
            assert "cannot reach the node agent" in out["msg"] and "try again later" in out["msg"]
        else:
            assert rc == 0, (name, out, err)
            assert out["ips"] == conf["prevResult"]["ips"]  # prevResult passed through
            assert f"pod {ns}/{name} is not ambient" in err
    # an unknown namespace follows ambient_default, as the agent does without a Pod object
    rc, out, _, _ = await add(launcher, run, kube_args("elsewhere", "x", "u-x"),
                              ambient_default=True)
    assert rc == 1 and out["code"] == plugin_request.ERR_TRY_AGAIN


async def test_container_named_pods_without_the_agent(tmp_path, launcher):
    """podman-style events (no K8S_POD_NAMESPACE/UID): the container ID names the pod,
    a Pod object with that uid decides; an unknown container follows ambient_default."""
    run = str(tmp_path / "run")
    write(run, store_of(namespace("demo", AMBIENT), pod("web", "demo", "cid-web", node=None),
                        pod("legacy", "legacy", "cid-legacy", node=None)), source="files")
    podman_args = "IgnoreUnknown=1;K8S_POD_NAME=web-container"
    rc, out, _, _ = await add(launcher, run, podman_args, container_id="cid-web")
    assert rc == 1 and out["code"] == plugin_request.ERR_TRY_AGAIN and "pod cid-web is ambient" in out["msg"]
    rc, _, err, _ = await add(launcher, run, podman_args, container_id="cid-legacy")
    assert rc == 0 and "not ambient" in err
    rc, _, _, _ = await add(launcher, run, podman_args, container_id="cid-unknown")
    assert rc == 0
    rc, out, _, _ = await add(launcher, run, podman_args, container_id="cid-unknown",
                              ambient_default=True)
    assert rc == 1 and out["code"] == plugin_request.ERR_TRY_AGAIN


@pytest.mark.parametrize("content, why", [
    (None, "cannot read"),
    (b"{not json", "not valid JSON"),
    (json.dumps({"version": 2, "pods": {}, "namespaces": {}, "excluded_namespaces": []}),
     "field 'version' must be 1"),
    (json.dumps({"version": 1, "pods": {"u": "yes"}, "namespaces": {},
                 "excluded_namespaces": []}), "field 'pods' must map names to booleans"),
    (json.dumps({"version": 1, "pods": {}, "namespaces": [], "excluded_namespaces": []}),
     "field 'namespaces' must map"),
    (json.dumps({"version": 1, "pods": {}, "namespaces": {}}), "excluded_namespaces"),
    (b" " * (plugin_request.SNAPSHOT_MAX_BYTES + 1), "larger than"),
])
async def test_no_usable_snapshot_fails_closed(tmp_path, launcher, content, why):
    run = tmp_path / "run"
    run.mkdir()
    if content is not None:
        (run / plugin_request.SNAPSHOT_NAME).write_bytes(content.encode() if isinstance(content, str)
                                                 else content)
    rc, out, _, _ = await add(launcher, str(run), kube_args("plain", "p", "u-p"))
    assert rc == 1 and out["code"] == plugin_request.ERR_TRY_AGAIN
    assert "no usable enablement snapshot" in out["msg"] and why in out["msg"]


async def test_agent_draining_or_timing_out_still_lets_non_ambient_pods_through(
        state_dir, launcher):
    """The agent answers 503 "shutting down" while it stops, or does not answer in time:
    the snapshot decides, as when it is gone."""
    agent = await start_agent(state_dir)
    try:
        write(agent.run_dir, store_of(namespace("amb", AMBIENT), namespace("plain")))
        agent.ctx.draining = True
        rc, out, err, _ = await add(launcher, agent.run_dir, kube_args("plain", "p", "u-p"))
        assert rc == 0 and "is shutting down" in err
        rc, out, _, _ = await add(launcher, agent.run_dir, kube_args("amb", "a", "u-a"))
        assert rc == 1 and out["code"] == plugin_request.ERR_TRY_AGAIN and "shutting down" in out["msg"]
        agent.ctx.draining = False
        agent.enroller.delay = 2.0
        # the agent (no Pod object, ambient_default) enrolls, slowly: the snapshot knows
        # the namespace is not ambient
        rc, out, err, _ = await add(launcher, agent.run_dir, kube_args("plain", "p", "u-p"),
                                    agent_timeout=0.3, ambient_default=True)
        assert rc == 0 and "did not answer within 0.3s" in err
    finally:
        await agent.server.stop(1)
        agent.ctx.executor.shutdown(wait=False)
