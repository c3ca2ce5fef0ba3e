"""A CNI ADD for a pod of an ambient namespace whose Pod object the agent does not have
(yet): the real ``istio-cni`` plugin (through the launcher our installer writes) against
the agent's event server over a real ``ambient.store.ObjectStore``. The ADD fails closed
with code 11 (try again later) naming the missing Pod object, as upstream's plugin fails
the ADD while it cannot get the Pod; the runtime's retry after the object arrived
enrolls the pod. Pods of other namespaces keep the old decision."""

from __future__ import annotations

from ambient.store import ObjectStore
from cni import plugin_request
from tests.cni.conftest import cni_env, net_conf, run_plugin, start_agent

AMBIENT = {"istio.io/dataplane-mode": "ambient"}


def namespace(name, labels=None):
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "labels": labels or {}}}


def pod(name, ns, uid, labels=None):
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "uid": uid, "labels": labels or {}},
            "spec": {}, "status": {"phase": "Running"}}


def kube_args(ns, name, uid):
    return f"IgnoreUnknown=1;K8S_POD_NAMESPACE={ns};K8S_POD_NAME={name};K8S_POD_UID={uid}"


async def add(launcher, run_dir, args, container_id, **keys):
    return await run_plugin(launcher, cni_env(args=args, container_id=container_id),
                            net_conf(run_dir, **keys))


async def test_ambient_namespace_without_pod_object_is_held_then_enrolled(state_dir, launcher):
    agent = await start_agent(state_dir)
    store = ObjectStore()
    store.apply([(namespace("amb", AMBIENT), "test"), (namespace("plain"), "test"),
                 (namespace("opt", {"istio.io/dataplane-mode": "none"}), "test")],
                origin="test")
    agent.set_store(store)
    try:
        rc, out, _ = await add(launcher, agent.run_dir, kube_args("amb", "ghost", "g-uid"),
                               "c-ghost")
        assert rc == 1 and out["code"] == plugin_request.ERR_TRY_AGAIN, out
        assert "Pod object amb/ghost is not known yet" in out["msg"], out["msg"]
        assert "try again later" in out["msg"]
        assert agent.enroller.enrolled == []
        assert agent.server.debug_state()["add_held"] == 1

        # non-ambient namespaces, and a namespace the agent has no object for: as before
        for ns in ("plain", "opt", "unknown"):
            rc, out, err = await add(launcher, agent.run_dir, kube_args(ns, "p", f"u-{ns}"),
                                     f"c-{ns}")
            assert rc == 0, (ns, out, err)
        # the network's ambient_default still enrolls without the object
        rc, out, err = await add(launcher, agent.run_dir, kube_args("amb", "d", "d-uid"),
                                 "c-d", ambient_default=True)
        assert rc == 0, (out, err)
        assert [e.pod_uid for e in agent.enroller.enrolled] == ["d-uid"]

        # the runtime retries once the object reached the store: enrolled; a pod of that
        # namespace that opts out by its own label is let through
        store.apply([(pod("ghost", "amb", "g-uid"), "test"),
                     (pod("out", "amb", "o-uid", {"istio.io/dataplane-mode": "none"}), "test")],
                    origin="test")
        rc, out, err = await add(launcher, agent.run_dir, kube_args("amb", "ghost", "g-uid"),
                                 "c-ghost")
        assert rc == 0, (out, err)
        rc, out, err = await add(launcher, agent.run_dir, kube_args("amb", "out", "o-uid"),
                                 "c-out")
        assert rc == 0, (out, err)
        assert [e.pod_uid for e in agent.enroller.enrolled] == ["d-uid", "g-uid"]
    finally:
        await agent.server.stop(1)
        agent.ctx.executor.shutdown(wait=False)
