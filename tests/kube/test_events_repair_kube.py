"""Kubernetes Events and repair against a real kube-apiserver (``cni/kubeevents.py``).

The agent's pieces as the daemon wires them (kubernetes config source, real ZDS server,
real enrollment), authenticated as the DaemonSet's ServiceAccount under
deploy/kubernetes/rbac.yaml as shipped (the delete mode's extra permission is granted by
the test, as docs/operating.md tells an operator to). Pods are real netns on a bridge;
host probe rules go into a scratch netns. A retryable failure is the real one: no
ztunnel connects to the ZDS socket, so every attempt waits ``ztunnel_wait`` and fails.

- every enrollment failure is a Warning Event on the pod; the same failure again bumps
  the Event's count instead of writing another;
- retries reaching the report threshold write the exhaustion Event and, with
  ``repair_enabled`` + ``repair_label_pods``, the pod gets upstream's label through
  pods/status and a ``LabelBrokenPod`` Event; with ``repair_delete_pods`` it is deleted
  (preconditions: its UID and resourceVersion) and gets ``DeleteBrokenPod``;
- with repair off (the default) the pod is reported but left alone; no 403 anywhere.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from agent.core.config import load
from agent.core.lifecycle import AgentContext
from agent.enrollment_zds import ZdsServerChannel
from ambient import source as ambient_source
from cni import kubeevents
from cni.enrollment import Enrollment
from cni.enrollment import reconciler as reconciler_mod
from cni.events import CniPodEvent, EnrollmentError
from tests.helpers import eventually
from tests.kube import cluster as kc
from tests.kube.test_enrollment_kube import (AMBIENT, fast_retries, forbidden,  # noqa: F401
                                             label_namespace, logs, node_netns)
from zds.server import ZdsServer

pytestmark = pytest.mark.timeout(180)


class Agent:
    """config source + ZDS (no ztunnel ever connects) + enrollment."""

    def __init__(self, state_dir, kubeconfig, node, node_netns, **overrides):
        sd = str(state_dir)
        self.config = load({"state_dir": sd, "config_file": os.devnull}, env={}).replace(
            config_source="kubernetes", kubeconfig=kubeconfig, node_name=node,
            ztunnel_uds_address=os.path.join(sd, "zds.sock"), ztunnel_wait=0.3,
            host_rules_netns=node_netns, ambient_ipv6=False, **overrides)

    async def start(self):
        self.ctx = AgentContext(self.config)
        self.source = self.ctx.add(ambient_source.build(self.ctx))
        self.zds = self.ctx.add(ZdsServer(self.config.ztunnel_uds_address, ztunnel_wait=0.3))
        self.enrollment = self.ctx.add(Enrollment(self.ctx, zds=ZdsServerChannel(self.zds),
                                                  source=self.source))
        await self.source.start()
        await self.zds.start()
        await self.enrollment.start()
        return self

    async def stop(self):
        await self.enrollment.stop(1.0)
        await self.zds.stop(0.5)
        await self.source.stop(0.5)
        self.ctx.executor.shutdown(wait=False)


async def pod_events(admin, ns, uid) -> list[dict]:
    doc = await kc.request(admin, "GET", f"/api/v1/namespaces/{ns}/events",
                           query=[("fieldSelector", f"involvedObject.uid={uid}")])
    return doc.get("items") or []


def reasons(events) -> dict[str, dict]:
    return {e["reason"]: e for e in events}


@pytest.fixture
def report_soon(monkeypatch):
    monkeypatch.setattr(reconciler_mod, "RETRY_REPORT_AFTER", 2)


async def _until_events(admin, ns, uid, wanted: set[str], timeout=30.0) -> dict[str, dict]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        got = reasons(await pod_events(admin, ns, uid))
        if wanted <= set(got):
            return got
        if loop.time() > deadline:
            raise AssertionError(f"events {sorted(wanted)} not all written: {sorted(got)}")
        await asyncio.sleep(0.2)


async def test_failure_event_counted_on_repeat(kube_admin, kube_namespace, agent_kubeconfig,
                                               state_dir, node_netns, logs):
    node = kc.unique("node")
    await label_namespace(kube_admin, kube_namespace, AMBIENT)
    created = await kc.run_pod(kube_admin, "web", kube_namespace, node, ["10.250.0.9"])
    uid = created["metadata"]["uid"]
    agent = await Agent(state_dir, agent_kubeconfig, node, node_netns).start()
    try:
        event = CniPodEvent(command="ADD", container_id="c-web", netns="/var/run/netns/gone-x",
                            pod_name="web", pod_namespace=kube_namespace, pod_uid=uid,
                            ips=["10.250.0.9"])
        for _ in range(2):
            with pytest.raises(EnrollmentError, match="netns path"):
                await agent.enrollment.enroll(event)
        await eventually(lambda: agent.enrollment.events.stats["patched"] >= 1, timeout=20)
        [ev] = await pod_events(kube_admin, kube_namespace, uid)
        assert ev["reason"] == kubeevents.REASON_FAILED and ev["type"] == "Warning"
        assert "netns path '/var/run/netns/gone-x'" in ev["message"]
        assert ev["count"] == 2 and ev["source"] == {"component": "ambient-agent", "host": node}
        assert ev["involvedObject"]["name"] == "web"
        assert not forbidden(logs), forbidden(logs)
    finally:
        await agent.stop()


@pytest.mark.parametrize("mode", ["off", "label", "delete"])
async def test_retries_exhausted_event_and_repair(kube_admin, kube_namespace, agent_kubeconfig,
                                                  bridge, state_dir, node_netns, logs,
                                                  report_soon, mode):
    node = kc.unique("node")
    await label_namespace(kube_admin, kube_namespace, AMBIENT)
    netpod = await asyncio.to_thread(bridge.add_pod, "te")
    created = await kc.run_pod(kube_admin, "api", kube_namespace, node, [netpod.ip])
    uid = created["metadata"]["uid"]
    overrides = {"off": {}, "label": {"repair_enabled": True, "repair_label_pods": True},
                 "delete": {"repair_enabled": True, "repair_delete_pods": True}}[mode]
    role = kc.unique("repair")
    if mode == "delete":  # what docs/operating.md tells an operator to grant for this mode
        await kc.request(kube_admin, "POST", "/apis/rbac.authorization.k8s.io/v1/clusterroles",
                         body={"metadata": {"name": role}, "rules": [
                             {"apiGroups": [""], "resources": ["pods"], "verbs": ["delete"]}]})
        await kc.request(kube_admin, "POST",
                         "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
                         body={"metadata": {"name": role},
                               "roleRef": {"apiGroup": "rbac.authorization.k8s.io",
                                           "kind": "ClusterRole", "name": role},
                               "subjects": [{"kind": "ServiceAccount", "name": "ambient-agent",
                                             "namespace": kc.AGENT_NAMESPACE}]})
    agent = await Agent(state_dir, agent_kubeconfig, node, node_netns, **overrides).start()
    try:
        with pytest.raises(EnrollmentError):
            await agent.enrollment.enroll(CniPodEvent(
                command="ADD", container_id="c-api", netns=netpod.netns_path, pod_name="api",
                pod_namespace=kube_namespace, pod_uid=uid, ips=[netpod.ip]))
        wanted = {kubeevents.REASON_FAILED, kubeevents.REASON_EXHAUSTED}
        if mode == "label":
            wanted.add(kubeevents.REASON_LABEL)
        elif mode == "delete":
            wanted.add(kubeevents.REASON_DELETE)
        got = await _until_events(kube_admin, kube_namespace, uid, wanted)
        assert "retries failed" in got[kubeevents.REASON_EXHAUSTED]["message"]
        pod = await kc.request(kube_admin, "GET", f"/api/v1/namespaces/{kube_namespace}/pods/api")
        labels = pod["metadata"].get("labels") or {}
        repaired = agent.ctx.registry.get_sample_value(
            "istio_cni_repair_pods_repaired_total", {"type": mode, "result": "success"})
        if mode == "off":
            assert "cni.istio.io/uninitialized" not in labels
            assert not pod["metadata"].get("deletionTimestamp")
            assert set(got) == wanted
        elif mode == "label":
            assert labels.get("cni.istio.io/uninitialized") == "true"
            assert got[kubeevents.REASON_LABEL]["source"]["component"] == "cni-repair"
            assert got[kubeevents.REASON_LABEL]["message"] == "pod detected as broken, labeled"
            assert repaired == 1.0
        else:
            assert pod["metadata"].get("deletionTimestamp")  # no kubelet finishes it here
            assert got[kubeevents.REASON_DELETE]["message"] == "pod detected as broken, deleted"
            assert repaired == 1.0
        assert not forbidden(logs), forbidden(logs)
    finally:
        await agent.stop()
        if mode == "delete":
            for kind in ("clusterrolebindings", "clusterroles"):
                await kc.request(kube_admin, "DELETE",
                                 f"/apis/rbac.authorization.k8s.io/v1/{kind}/{role}")


async def test_recorded_pod_without_netns_after_reboot(kube_admin, kube_namespace,
                                                       agent_kubeconfig, state_dir, node_netns,
                                                       logs):
    """Issue 26: a pod recorded and annotated ``enabled`` by the previous run whose netns
    is gone after a reboot (recorded path absent, no process of it in /proc). At start:
    its annotation is removed, one ``AmbientPodNetnsMissing`` Warning Event names the
    netns, the counter counts it, and the probe set entry the previous run gave it (in
    the scratch node netns) is gone. Upstream's node agent logs such a pod once and
    keeps it; the annotation it leaves says ``enabled`` for a pod no rule redirects."""
    from cni.enrollment.records import PodRecord, PodStateStore
    from cni.hostrules import HostProbeRules

    node = kc.unique("node")
    await label_namespace(kube_admin, kube_namespace, AMBIENT)
    ip = "10.250.0.23"
    created = await kc.run_pod(kube_admin, "rebooted", kube_namespace, node, [ip],
                               annotations={"ambient.istio.io/redirection": "enabled"})
    uid = created["metadata"]["uid"]
    gone = f"/var/run/netns/gone-{uid[:8]}"
    PodStateStore(str(state_dir)).save(PodRecord(
        uid=uid, name="rebooted", namespace=kube_namespace, service_account="default",
        netns=gone, ips=[ip], annotations={"ambient.istio.io/redirection": "enabled"}))
    previous = HostProbeRules(ipv6=False, netns=node_netns)  # what the last run left
    await asyncio.to_thread(previous.setup)
    await asyncio.to_thread(previous.add_pod, uid, [ip])
    previous.close()
    agent = await Agent(state_dir, agent_kubeconfig, node, node_netns).start()
    try:
        got = await _until_events(kube_admin, kube_namespace, uid,
                                  {kubeevents.REASON_NETNS_MISSING})
        ev = got[kubeevents.REASON_NETNS_MISSING]
        assert ev["type"] == "Warning" and gone in ev["message"]

        async def annotation():
            pod = await kc.request(kube_admin, "GET",
                                   f"/api/v1/namespaces/{kube_namespace}/pods/rebooted")
            return (pod["metadata"].get("annotations") or {}).get(
                "ambient.istio.io/redirection")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while await annotation() is not None:
            assert loop.time() < deadline, "status annotation still there"
            await asyncio.sleep(0.2)
        assert agent.ctx.registry.get_sample_value(
            "ambient_agent_recovery_netns_missing_total") == 1.0
        entries = await asyncio.to_thread(agent.enrollment.host_rules.entries)
        assert ip not in entries
        assert agent.enrollment.pods()[uid].status == "netns-missing"
        assert not forbidden(logs), forbidden(logs)
    finally:
        await agent.stop()
