"""Enrollment with the kubernetes config source against a real kube-apiserver.

The agent's pieces as the daemon wires them (``ambient.source`` with the kubernetes
backend, the real ZDS server, the real enrollment) authenticate with a token of the
DaemonSet's own ServiceAccount under deploy/kubernetes/rbac.yaml as shipped; tests play
the kubelet (Pods bound to a node name, their status with the IP of a real netns pod on a
bridge, and a real process in that netns in a cgroup named after the API server's pod
UID, tests/netns/podproc.py). ztunnel is the fake ztunnel (agent.demo.fake_ztunnel).
Host probe rules go into a scratch netns. Every test asserts that no 403 was logged,
except the one that runs with a ServiceAccount lacking the patch permission on purpose.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import time

import pytest
from pyroute2 import netns as pr_netns

from agent.core.config import load
from agent.core.lifecycle import AgentContext
from ambient import source as ambient_source
from ambient import source_kube
from cni import annotate
from cni import enrollment as enrollment_mod
from cni.enrollment import reconciler as reconciler_mod
from agent.enrollment_zds import ZdsServerChannel
from cni.enrollment import Enrollment
from cni.events import CniPodEvent
from tests.helpers import eventually
from tests.kube import cluster as kc
from agent.demo.fake_ztunnel_thread import FakeZtunnelThread
from tests.netns.podproc import PodProcesses, cgroup_root
from tests.netns.test_enrollment_rules import snapshot as full_snapshot
from zds.server import ZdsServer

pytestmark = pytest.mark.timeout(180)

REDIRECTION = "ambient.istio.io/redirection"
AMBIENT = {"istio.io/dataplane-mode": "ambient"}
LOGGERS = ("cni.annotate", "cni.enrollment", "ambient.source.kube")


def snapshot(pod) -> str:
    """Everything our rules could touch in the pod, without the IPv6 link-local address
    and routes the kernel adds on its own once the veth is up (timing, not ours)."""
    return "\n".join(line for line in full_snapshot(pod).splitlines() if "fe80:" not in line)


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch):
    monkeypatch.setattr(source_kube, "BACKOFF_START", 0.1)
    monkeypatch.setattr(source_kube, "BACKOFF_MAX", 1.0)
    monkeypatch.setattr(reconciler_mod, "BACKOFF_MAX", 1.0)
    monkeypatch.setattr(annotate, "BACKOFF_MAX", 1.0)


@pytest.fixture
def logs(caplog):
    caplog.set_level(logging.INFO)
    return caplog


_STATUS_403 = re.compile(r"\b403\b")  # the status, not "403" inside a pod UID's hex


def forbidden(caplog) -> list[str]:
    """The agent's log lines that report an HTTP 403 from the API server."""
    return [r.getMessage() for r in caplog.records
            if r.name.startswith(tuple(n + "." for n in LOGGERS)) or r.name in LOGGERS
            if _STATUS_403.search(r.getMessage())]


@pytest.fixture
def node_netns():
    name = "tk" + secrets.token_hex(3)
    pr_netns.create(name)
    try:
        yield f"/var/run/netns/{name}"
    finally:
        pr_netns.remove(name)


@pytest.fixture
def procs():
    root = cgroup_root()
    if root is None:
        pytest.skip("no writable cgroup hierarchy to put pod processes in")
    p = PodProcesses(root)
    try:
        yield p
    finally:
        p.close()


class KubeAgent:
    """config source (kubernetes) + ZDS + enrollment, as the daemon wires them."""

    def __init__(self, state_dir, kubeconfig, node, node_netns):
        sd = str(state_dir)
        self.config = load({"state_dir": sd, "config_file": os.devnull}, env={}).replace(
            config_source="kubernetes", kubeconfig=kubeconfig, node_name=node,
            ztunnel_uds_address=os.path.join(sd, "zds.sock"), ztunnel_wait=2.0,
            host_rules_netns=node_netns, ambient_ipv6=False)

    async def start(self):
        self.ctx = AgentContext(self.config)
        self.source = self.ctx.add(ambient_source.build(self.ctx))
        self.zds = self.ctx.add(ZdsServer(self.config.ztunnel_uds_address, ztunnel_wait=2.0))
        self.enrollment = self.ctx.add(Enrollment(self.ctx, zds=ZdsServerChannel(self.zds),
                                                  source=self.source))
        await self.source.start()
        assert self.source.ready() == (True, ""), self.source.debug_state()
        await self.zds.start()
        self.ztunnel = await asyncio.to_thread(
            FakeZtunnelThread(self.config.ztunnel_uds_address).start)
        await self.enrollment.start()
        return self

    def status(self, uid):
        rec = self.enrollment.pods().get(uid)
        return rec.status if rec is not None else None

    async def stop(self):
        self.ztunnel.close()
        await self.enrollment.stop(1.0)
        await self.zds.stop(0.5)
        await self.source.stop(0.5)
        self.ctx.executor.shutdown(wait=False)


async def api_annotation(admin, ns, name):
    pod = await kc.request(admin, "GET", f"/api/v1/namespaces/{ns}/pods/{name}")
    return (pod["metadata"].get("annotations") or {}).get(REDIRECTION)


async def label_namespace(admin, ns, labels):
    await kc.request(admin, "PATCH", f"/api/v1/namespaces/{ns}",
                     body={"metadata": {"labels": labels}},
                     content_type="application/merge-patch+json")


async def label_pod(admin, ns, name, labels):
    await kc.request(admin, "PATCH", f"/api/v1/namespaces/{ns}/pods/{name}",
                     body={"metadata": {"labels": labels}},
                     content_type="application/merge-patch+json")


async def until_api(admin, ns, name, value, timeout=10.0):
    deadline = time.monotonic() + timeout
    while await api_annotation(admin, ns, name) != value:
        if time.monotonic() > deadline:
            raise AssertionError(f"annotation of {ns}/{name} never became {value!r}")
        await asyncio.sleep(0.05)


def cni_add(pod, ns, name, uid) -> CniPodEvent:
    return CniPodEvent(command="ADD", container_id="c-" + pod.name, netns=pod.netns_path,
                       pod_name=name, pod_namespace=ns, pod_uid=uid, ips=[pod.ip])


async def test_annotation_written_through_the_api_on_enrollment_and_removed_after(
        kube_admin, kube_namespace, agent_kubeconfig, bridge, state_dir, node_netns, logs):
    """CNI ADD of an ambient pod: the agent (DaemonSet token) PATCHes pods/status with
    ``enabled``; the pod's own label then says ``none``: it is removed from the mesh live
    and the annotation is removed through the API. No 403 anywhere."""
    node = kc.unique("node")
    await label_namespace(kube_admin, kube_namespace, AMBIENT)
    netpod = await asyncio.to_thread(bridge.add_pod, "tk")
    created = await kc.run_pod(kube_admin, "web", kube_namespace, node, [netpod.ip])
    uid = created["metadata"]["uid"]
    clean = snapshot(netpod)
    agent = await KubeAgent(state_dir, agent_kubeconfig, node, node_netns).start()
    try:
        await agent.enrollment.enroll(cni_add(netpod, kube_namespace, "web", uid))
        assert agent.status(uid) == "enabled"
        assert await api_annotation(kube_admin, kube_namespace, "web") == "enabled"
        assert (agent.source.store.pod_by_uid(uid)["metadata"]["annotations"][REDIRECTION]
                == "enabled")  # the store took the PATCH response at once

        await label_pod(kube_admin, kube_namespace, "web", {"istio.io/dataplane-mode": "none"})
        await eventually(lambda: uid not in agent.enrollment.pods(), timeout=10)
        await until_api(kube_admin, kube_namespace, "web", None)
        await eventually(lambda: not agent.enrollment.live.busy())
        assert snapshot(netpod) == clean
        assert uid in agent.ztunnel.deleted
        assert not forbidden(logs), forbidden(logs)
    finally:
        await agent.stop()


async def test_namespace_labelled_ambient_enrolls_a_running_pod_within_2s(
        kube_admin, kube_namespace, agent_kubeconfig, bridge, state_dir, node_netns, procs,
        logs):
    """The issue's done-when against the real API server: a running pod (its process in
    the pod's cgroup and netns) in a namespace that is then labelled ambient is enrolled
    within 2 s, with no restart, and annotated through the API; a pod of another node is
    not touched. Removing the label removes it again."""
    node = kc.unique("node")
    netpod, other = [await asyncio.to_thread(bridge.add_pod, n) for n in ("tk", "to")]
    created = await kc.run_pod(kube_admin, "web", kube_namespace, node, [netpod.ip])
    uid = created["metadata"]["uid"]
    far = await kc.run_pod(kube_admin, "far", kube_namespace, kc.unique("node"), [other.ip])
    await asyncio.to_thread(procs.start, netpod, uid)
    await asyncio.to_thread(procs.start, other, far["metadata"]["uid"])
    clean = snapshot(netpod)
    agent = await KubeAgent(state_dir, agent_kubeconfig, node, node_netns).start()
    try:
        await eventually(lambda: not agent.enrollment.live.busy())
        assert agent.enrollment.pods() == {}

        started = time.monotonic()
        await label_namespace(kube_admin, kube_namespace, AMBIENT)
        await eventually(lambda: agent.status(uid) == "enabled", timeout=2.0)
        elapsed = time.monotonic() - started
        print(f"kubectl label ns -> enrolled: {elapsed * 1000:.0f} ms")
        assert agent.ztunnel.adds[uid] == os.stat(netpod.netns_path).st_ino
        assert "-A PREROUTING -j ISTIO_PRERT" in netpod.exec("iptables-save").stdout
        await until_api(kube_admin, kube_namespace, "web", "enabled", timeout=5)
        await eventually(lambda: not agent.enrollment.live.busy())
        assert set(agent.enrollment.pods()) == {uid}  # not the other node's pod
        assert await api_annotation(kube_admin, kube_namespace, "far") is None

        await label_namespace(kube_admin, kube_namespace, {"istio.io/dataplane-mode": None})
        await eventually(lambda: uid not in agent.enrollment.pods(), timeout=5)
        await until_api(kube_admin, kube_namespace, "web", None)
        await eventually(lambda: not agent.enrollment.live.busy())
        assert snapshot(netpod) == clean
        assert not forbidden(logs), forbidden(logs)
    finally:
        await agent.stop()


READ_ONLY_RULES = [r for r in kc.manifest("rbac.yaml")[1]["rules"]
                   if "pods/status" not in r["resources"]]


async def test_forbidden_patch_is_logged_with_the_pod_and_retried_until_granted(
        kube_cluster, kube_admin, kube_namespace, bridge, state_dir, node_netns, logs,
        tmp_path):
    """An identity that may read everything but not patch pods/status: the enrollment's
    annotation write gets a real 403, logged with the pod's name; the pod stays pending
    (rules in, fail closed), the agent keeps retrying with backoff and does not crash;
    once the permission is granted the annotation is written and the pod is enabled."""
    sa, role = "limited", kc.unique("ambient-limited")
    await kc.create_service_account(kube_admin, kube_namespace, sa)
    subject = [{"kind": "ServiceAccount", "name": sa, "namespace": kube_namespace}]
    await kc.apply(kube_admin, {"apiVersion": "rbac.authorization.k8s.io/v1",
                                "kind": "ClusterRole", "metadata": {"name": role},
                                "rules": READ_ONLY_RULES})
    await kc.apply(kube_admin, {"apiVersion": "rbac.authorization.k8s.io/v1",
                                "kind": "ClusterRoleBinding", "metadata": {"name": role},
                                "roleRef": {"apiGroup": "rbac.authorization.k8s.io",
                                            "kind": "ClusterRole", "name": role},
                                "subjects": subject})
    token = await kc.service_account_token(kube_admin, kube_namespace, sa)
    kubeconfig = kc.kubeconfig_for_token(kube_cluster, token, str(tmp_path / "limited"))
    node = kc.unique("node")
    await label_namespace(kube_admin, kube_namespace, AMBIENT)
    netpod = await asyncio.to_thread(bridge.add_pod, "tk")
    created = await kc.run_pod(kube_admin, "web", kube_namespace, node, [netpod.ip])
    uid = created["metadata"]["uid"]
    agent = await KubeAgent(state_dir, kubeconfig, node, node_netns).start()
    try:
        with pytest.raises(enrollment_mod.EnrollmentError) as err:
            await agent.enrollment.enroll(cni_add(netpod, kube_namespace, "web", uid))
        assert err.value.retryable and "status annotation" in str(err.value)
        assert agent.status(uid) == "pending"
        assert "-A PREROUTING -j ISTIO_PRERT" in netpod.exec("iptables-save").stdout
        assert any(f"{kube_namespace}/web (uid {uid}): writing annotation "
                   f"{REDIRECTION}=enabled failed: 403" in m for m in forbidden(logs))
        await eventually(lambda: agent.enrollment.pods()[uid].attempts >= 2, timeout=10)

        await kc.apply(kube_admin, {"apiVersion": "rbac.authorization.k8s.io/v1",
                                    "kind": "ClusterRole", "metadata": {"name": role},
                                    "rules": kc.manifest("rbac.yaml")[1]["rules"]})
        await eventually(lambda: agent.status(uid) == "enabled", timeout=10)
        assert await api_annotation(kube_admin, kube_namespace, "web") == "enabled"
    finally:
        await agent.stop()
        for _kind, plural in (("ClusterRoleBinding", "clusterrolebindings"),
                             ("ClusterRole", "clusterroles")):
            try:
                await kc.request(kube_admin, "DELETE",
                                 f"/apis/rbac.authorization.k8s.io/v1/{plural}/{role}")
            except kc.ApiException:
                pass
