"""A pod whose phase becomes Succeeded or Failed leaves ztunnel at once (issue 17 item 8),
as upstream's informer does for a captured Job pod that terminated
(``RemovePodFromMesh(oldPod, isDelete=true)``), not only at its CNI DEL, which may come
much later (the sandbox of a finished Job pod can stay for a long time).

The real files config source over a YAML directory (inotify), the real ambient index,
real netns pods, real rules, the real ZDS server with the ZDS ztunnel stand-in; host
probe sets in a scratch "node" netns.
"""

from __future__ import annotations

import asyncio
import os
import secrets

import pytest

from tests.netns.test_enrollment_live import (Agent, node_netns, ns_obj,  # noqa: F401
                                              pod_obj, until, write)
from cni.events import CniPodEvent

AMBIENT = {"istio.io/dataplane-mode": "ambient"}


def finished(obj: dict, phase: str) -> dict:
    """The Pod as the API shows a finished pod: terminal phase and, for some termination
    updates, no IP at all (kubernetes#125370, which upstream works around)."""
    obj = dict(obj)
    obj["status"] = {"phase": phase}
    return obj


def add_event(pod, ns) -> CniPodEvent:
    return CniPodEvent(command="ADD", container_id="c-" + pod.name, netns=pod.netns_path,
                       pod_name=pod.name, pod_namespace=ns, pod_uid=pod.uid, ips=[pod.ip])


@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
async def test_terminal_pod_is_removed_from_ztunnel_at_once(bridge, state_dir, tmp_path,
                                                           node_netns, phase):
    ns = "ns" + secrets.token_hex(3)
    job, other = [await asyncio.to_thread(bridge.add_pod, n) for n in ("tj", "to")]
    cfg = tmp_path / "cluster"
    cfg.mkdir()
    write(cfg / "namespaces.yaml", ns_obj(ns, AMBIENT))
    pods_file = cfg / "pods.yaml"
    write(pods_file, pod_obj(job, ns), pod_obj(other, ns))
    agent = await Agent(state_dir, cfg, node_netns).start()
    try:
        zt = await agent.ztunnel()
        await agent.start_enrollment()
        for p in (job, other):
            await agent.enrollment.enroll(add_event(p, ns))
        assert await asyncio.to_thread(agent.enrollment.host_rules.entries) == {
            job.ip: job.uid, other.ip: other.uid}

        write(pods_file, finished(pod_obj(job, ns), phase), pod_obj(other, ns))
        assert await until(lambda: job.uid not in agent.enrollment.pods(), timeout=2.0), \
            agent.enrollment.debug_state()
        assert await asyncio.to_thread(zt.wait, lambda: job.uid in zt.deleted, 2.0)
        assert await until(lambda: not agent.enrollment.live.busy())
        assert await asyncio.to_thread(agent.enrollment.host_rules.entries) == {
            other.ip: other.uid}
        assert not os.path.exists(os.path.join(agent.config.state_dir, "pods",
                                               f"{job.uid}.json"))
        assert agent.annotation(ns, job.name) is None
        # as for a CNI DEL, the in-pod rules are left to go with the netns
        assert ":ISTIO_OUTPUT" in job.exec("iptables-save").stdout
        assert agent.status(other.uid) == "enabled" and other.uid not in zt.deleted
        assert agent.enrollment.debug_state()["live"]["removed_terminal"] == 1

        # the runtime's CNI DEL that follows later is harmless
        ev = add_event(job, ns)
        ev.command = "DEL"
        await agent.enrollment.unenroll(ev, is_delete=True)
        assert agent.status(other.uid) == "enabled"
    finally:
        await agent.stop()


async def test_pod_that_terminated_while_the_agent_was_down_is_removed_at_start(
        bridge, state_dir, tmp_path, node_netns):
    """The state file still names the pod; its Pod object says Succeeded: the restarted
    agent removes it from ztunnel right after recovery (no CNI DEL needed)."""
    ns = "ns" + secrets.token_hex(3)
    job = await asyncio.to_thread(bridge.add_pod, "tj")
    cfg = tmp_path / "cluster"
    cfg.mkdir()
    write(cfg / "namespaces.yaml", ns_obj(ns, AMBIENT))
    pods_file = cfg / "pods.yaml"
    write(pods_file, pod_obj(job, ns))
    agent = await Agent(state_dir, cfg, node_netns).start()
    await agent.ztunnel()
    await agent.start_enrollment()
    await agent.enrollment.enroll(add_event(job, ns))
    await agent.kill()

    write(pods_file, finished(pod_obj(job, ns), "Succeeded"))
    agent = await Agent(state_dir, cfg, node_netns).start()
    try:
        zt = await agent.ztunnel()
        await agent.start_enrollment()
        assert await until(lambda: job.uid not in agent.enrollment.pods(), timeout=2.0)
        assert await until(lambda: not agent.enrollment.live.busy())
        assert await asyncio.to_thread(agent.enrollment.host_rules.entries) == {}
        assert await asyncio.to_thread(zt.wait, lambda: job.uid in zt.deleted, 2.0)
        assert job.uid not in agent.zds.pods()
    finally:
        await agent.stop()
