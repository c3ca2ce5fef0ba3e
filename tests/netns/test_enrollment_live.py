"""Running pods follow their labels live (``cni.enrollment.watch``) and the redirection annotation is
written through the config source (``cni.annotate``), end to end: the real files config
source (``ambient.source`` over a YAML directory watched with inotify) and the real
ambient index, real netns pods on a bridge, a real process inside each pod's netns in a
real cgroup named like the kubelet's (``tests/netns/podproc.py``: what the agent's
``/proc`` scan reads), real rules, the real ZDS server and the ZDS ztunnel stand-in
(agent.demo.fake_ztunnel, on a thread of its own: ztunnel can't run here). Host probe rules go into
a scratch "node" netns. No Kubernetes API here (tests/kube/ covers the PATCH path)."""

from __future__ import annotations

import asyncio
import os
import secrets
import time

import pytest
import yaml
from pyroute2 import netns as pr_netns

from agent.core.config import load
from agent.core.lifecycle import AgentContext
from ambient import index as ambient_index
from ambient import source as ambient_source
from ambient import workload_pb2 as wl
from agent.enrollment_zds import ZdsServerChannel
from cni.enrollment import Enrollment
from cni.events import CniPodEvent
from agent.demo.fake_ztunnel_thread import FakeZtunnelThread
from tests.netns.podproc import PodProcesses, cgroup_root
from tests.netns.test_enrollment_rules import snapshot
from zds.server import ZdsServer

REDIRECTION = "ambient.istio.io/redirection"
NODE = "node-live"


@pytest.fixture
def node_netns():
    name = "tn" + secrets.token_hex(3)
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


def pod_obj(pod, ns, labels=None, node=NODE, ip=None):
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod.name, "namespace": ns, "uid": pod.uid,
                         "labels": labels or {}},
            "spec": {"nodeName": node, "serviceAccountName": "sa"},
            "status": {"phase": "Running", "podIP": ip or pod.ip,
                       "podIPs": [{"ip": ip or pod.ip}]}}


def ns_obj(name, labels=None):
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "labels": labels or {}}}


def write(path, *objs):
    tmp = path.with_suffix(".tmp")  # not a wanted suffix: the source ignores it
    tmp.write_text(yaml.safe_dump_all(list(objs)))
    os.rename(tmp, path)


class Agent:
    """config source + ambient index + ZDS + enrollment, as the daemon wires them."""

    def __init__(self, state_dir, config_dir, node_netns):
        sd = str(state_dir)
        self.config = load({"state_dir": sd, "config_file": os.devnull}, env={}).replace(
            config_dir=str(config_dir), node_name=NODE,
            ztunnel_uds_address=os.path.join(sd, "zds.sock"), ztunnel_wait=2.0,
            host_rules_netns=node_netns, ambient_ipv6=False)
        self.ztunnels: list[FakeZtunnelThread] = []

    async def start(self):
        self.ctx = AgentContext(self.config)
        self.source = self.ctx.add(ambient_source.build(self.ctx))
        self.index = self.ctx.add(ambient_index.build(self.ctx, self.source.store))
        self.zds = self.ctx.add(ZdsServer(self.config.ztunnel_uds_address, ztunnel_wait=2.0))
        self.enrollment = self.ctx.add(Enrollment(self.ctx, zds=ZdsServerChannel(self.zds),
                                                  source=self.source))
        for c in (self.source, self.index, self.zds):
            await c.start()
        return self

    async def start_enrollment(self):
        await self.enrollment.start()

    async def ztunnel(self) -> FakeZtunnelThread:
        zt = await asyncio.to_thread(FakeZtunnelThread(self.config.ztunnel_uds_address).start)
        self.ztunnels.append(zt)
        return zt

    def status(self, uid):
        rec = self.enrollment.pods().get(uid)
        return rec.status if rec is not None else None

    def annotation(self, ns, name):
        pod = self.source.store.get("Pod", ns, name)
        return ((pod or {}).get("metadata", {}).get("annotations") or {}).get(REDIRECTION)

    def tunnel(self, ns, name):
        return self.index.index.address(f"Kubernetes//Pod/{ns}/{name}").workload.tunnel_protocol

    async def kill(self):
        """What a SIGKILL leaves: rules, sets and state files stay."""
        for zt in self.ztunnels:
            zt.close()
        self.ztunnels.clear()
        self.enrollment.retries.kill()
        if self.enrollment.live is not None:
            await self.enrollment.live.stop(0.5)
        await self.zds.stop(0.5)
        await self.index.stop(0.5)
        await self.source.stop(0.5)
        self.ctx.executor.shutdown(wait=False)

    async def stop(self):
        for zt in self.ztunnels:
            zt.close()
        await self.enrollment.stop(1.0)
        await self.zds.stop(0.5)
        await self.index.stop(0.5)
        await self.source.stop(0.5)
        self.ctx.executor.shutdown(wait=False)


async def until(cond, timeout=5.0, step=0.01):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(step)
    return True


async def test_namespace_labelled_ambient_enrolls_running_pods_within_2s(
        bridge, state_dir, tmp_path, node_netns, procs):
    """The issue's done-when: a running pod in a namespace that is then labelled ambient is
    enrolled within 2 s, with no restart; un-labelling removes it (netns as before). Only
    pods of this node with a process here are enrolled; a pod labelled none stays out
    until its own label says ambient. The annotation goes through the files source's
    overlay (the index turns the pod HBONE), and the YAML files are never rewritten."""
    ns = "ns" + secrets.token_hex(3)
    a, none_pod, elsewhere = [await asyncio.to_thread(bridge.add_pod, n)
                              for n in ("ta", "tn", "te")]
    for p in (a, none_pod, elsewhere):
        await asyncio.to_thread(procs.start, p)
    clean = {p.uid: snapshot(p) for p in (a, none_pod)}
    cfg = tmp_path / "cluster"
    cfg.mkdir()
    write(cfg / "namespaces.yaml", ns_obj(ns))
    pods_file = cfg / "pods.yaml"
    write(pods_file, pod_obj(a, ns), pod_obj(none_pod, ns, {"istio.io/dataplane-mode": "none"}),
          pod_obj(elsewhere, ns, node="another-node"))
    agent = await Agent(state_dir, cfg, node_netns).start()
    try:
        zt = await agent.ztunnel()
        await agent.start_enrollment()
        await until(lambda: not agent.enrollment.live.busy())
        assert agent.enrollment.pods() == {}  # nothing is ambient yet
        pods_bytes = pods_file.read_bytes()

        started = time.monotonic()
        write(cfg / "namespaces.yaml", ns_obj(ns, {"istio.io/dataplane-mode": "ambient"}))
        assert await until(lambda: agent.status(a.uid) == "enabled", timeout=2.0), \
            agent.enrollment.debug_state()
        elapsed = time.monotonic() - started
        print(f"label -> enrolled: {elapsed * 1000:.0f} ms")
        assert elapsed < 2.0
        assert zt.adds[a.uid] == os.stat(a.netns_path).st_ino  # the pod's own netns
        assert "-A PREROUTING -j ISTIO_PRERT" in a.exec("iptables-save").stdout
        assert await asyncio.to_thread(agent.enrollment.host_rules.entries) == {a.ip: a.uid}
        assert agent.annotation(ns, a.name) == "enabled"
        assert agent.tunnel(ns, a.name) == wl.HBONE
        await until(lambda: not agent.enrollment.live.busy())
        assert set(agent.enrollment.pods()) == {a.uid}  # not `none`, not another node's
        assert pods_file.read_bytes() == pods_bytes

        # the pod's own label now says ambient: enrolled too
        write(pods_file, pod_obj(a, ns), pod_obj(none_pod, ns,
                                                 {"istio.io/dataplane-mode": "ambient"}),
              pod_obj(elsewhere, ns, node="another-node"))
        assert await until(lambda: agent.status(none_pod.uid) == "enabled", timeout=2.0)

        # the namespace loses its label: the pod only it selected leaves the mesh
        write(cfg / "namespaces.yaml", ns_obj(ns))
        assert await until(lambda: a.uid not in agent.enrollment.pods(), timeout=2.0)
        assert await until(lambda: not agent.enrollment.live.busy())
        assert snapshot(a) == clean[a.uid]
        assert a.uid in zt.deleted
        # a live removal writes the annotation in the background (retried until done)
        assert await until(lambda: agent.annotation(ns, a.name) is None)
        assert agent.tunnel(ns, a.name) == wl.NONE
        assert agent.status(none_pod.uid) == "enabled"
        # and `none` on the pod itself removes it too
        write(pods_file, pod_obj(a, ns), pod_obj(none_pod, ns,
                                                 {"istio.io/dataplane-mode": "none"}))
        assert await until(lambda: none_pod.uid not in agent.enrollment.pods(), timeout=2.0)
        assert await until(lambda: not agent.enrollment.live.busy())
        assert snapshot(none_pod) == clean[none_pod.uid]
        assert await until(lambda: agent.annotation(ns, none_pod.name) is None)
        assert await asyncio.to_thread(agent.enrollment.host_rules.entries) == {}
        assert agent.enrollment.debug_state()["live"]["enrolled_live"] == 2
    finally:
        await agent.stop()


async def test_pods_that_became_ambient_while_the_agent_was_down_are_enrolled_at_start(
        bridge, state_dir, tmp_path, node_netns, procs):
    """Upstream enqueues every namespace when its informer syncs: at start, a running pod
    of an ambient namespace that no agent enrolled (labelled while the agent was down) is
    enrolled; the annotation written by the enrollment comes back after a restart (the
    overlay is in memory, the enrollment record restores it)."""
    ns = "ns" + secrets.token_hex(3)
    a = await asyncio.to_thread(bridge.add_pod, "ta")
    await asyncio.to_thread(procs.start, a)
    cfg = tmp_path / "cluster"
    cfg.mkdir()
    write(cfg / "all.yaml", ns_obj(ns, {"istio.io/dataplane-mode": "ambient"}), pod_obj(a, ns))
    agent = await Agent(state_dir, cfg, node_netns).start()
    try:
        await agent.ztunnel()
        await agent.start_enrollment()
        assert await until(lambda: agent.status(a.uid) == "enabled", timeout=2.0)
        assert agent.annotation(ns, a.name) == "enabled"
    finally:
        await agent.kill()
    agent = await Agent(state_dir, cfg, node_netns).start()
    try:
        assert agent.annotation(ns, a.name) is None  # a fresh source: no overlay yet
        await agent.start_enrollment()  # recovery restores it
        zt = await agent.ztunnel()
        assert agent.status(a.uid) == "enabled"
        assert agent.annotation(ns, a.name) == "enabled"
        assert agent.tunnel(ns, a.name) == wl.HBONE
        assert await asyncio.to_thread(zt.wait, lambda: zt.snapshot_uids is not None)
        assert zt.snapshot_uids == {a.uid}
        await until(lambda: not agent.enrollment.live.busy())
        assert agent.enrollment.debug_state()["live"]["enrolled_live"] == 0  # recovered
        assert a.exec("iptables-save").stdout.count("-A PREROUTING -j ISTIO_PRERT") == 3  # not duplicated
    finally:
        await agent.stop()


async def test_pod_whose_process_is_not_found_is_left_to_its_cni_add(
        bridge, state_dir, tmp_path, node_netns, procs):
    """A pod with no process here (not started yet), and a process claiming the pod from a
    netns that lacks the pod's IP (the scan's IP check), are not enrolled live; the
    pod's CNI ADD enrolls it as usual, with its annotation."""
    ns = "ns" + secrets.token_hex(3)
    a, decoy = [await asyncio.to_thread(bridge.add_pod, n) for n in ("ta", "td")]
    await asyncio.to_thread(procs.start, decoy, a.uid)  # in pod A's cgroup, decoy's netns
    cfg = tmp_path / "cluster"
    cfg.mkdir()
    write(cfg / "all.yaml", ns_obj(ns, {"istio.io/dataplane-mode": "ambient"}), pod_obj(a, ns))
    agent = await Agent(state_dir, cfg, node_netns).start()
    try:
        await agent.ztunnel()
        await agent.start_enrollment()
        assert await until(lambda: agent.enrollment.debug_state()["live"]["not_found"] == 1)
        await until(lambda: not agent.enrollment.live.busy())
        assert agent.enrollment.pods() == {}
        assert "ISTIO" not in decoy.exec("iptables-save").stdout
        await agent.enrollment.enroll(CniPodEvent(
            command="ADD", container_id="c-" + a.name, netns=a.netns_path, pod_name=a.name,
            pod_namespace=ns, pod_uid=a.uid, ips=[a.ip]))
        assert agent.status(a.uid) == "enabled"
        assert agent.annotation(ns, a.name) == "enabled"
    finally:
        await agent.stop()
