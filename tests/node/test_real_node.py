"""The shipped DaemonSet on a real node: kubelet + containerd + runc, the controller manager
and the scheduler, against a real kube-apiserver (tests/node/realnode.py says what runs
where). Nothing plays a Kubernetes part here: the DaemonSet controller makes the agent's
pod, the scheduler binds the test's pods, the kubelet runs both through containerd's CRI,
containerd runs the CNI chain the agent installed into it.

The ztunnel is ``agent.demo.fake_ztunnel.FakeZtunnel`` (ztunnel's side of ZDS, with its
in-pod listeners open) on the DaemonSet's ZDS socket path: no real ztunnel is needed to
see what the agent hands it and what it takes away.

Needs root, Go (first build of the node binaries), containerd, runc, the CNI plugins and
the agent's image in podman's store (``scripts/build-image.sh``); skipped otherwise, and
failed instead under ``AMBIENT_REQUIRE_NODE=1`` (CI).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest

from agent.core.netns import run_in_netns_thread
from tests.kube import cluster as kc
from tests.node import scenario as sc
from tests.node.conftest import unavailable
from tests.node.realnode import RealNode

pytestmark = [pytest.mark.root, pytest.mark.timeout(900)]


async def test_kubelet_runs_api_pods_through_containerd(node_bin, tmp_path):
    """The node by itself: Ready, a pod created through the API is scheduled, run by
    the kubelet through containerd on the bridge network, its httpGet readiness probe
    passes, and deleting it tears the sandbox down."""
    node = RealNode(node_bin)
    try:
        await sc.start(node, tmp_path / "cluster")
        api = await node.cluster.admin_client()
        try:
            await sc.namespace(api, "plain", ambient=False)
            await sc.create_pod(api, sc.app_pod("web", "plain"))
            pod = await sc.until("pod plain/web Ready",
                                 lambda: _ready_pod(api, "plain", "web"), node)
            assert pod["spec"]["nodeName"] == node.name
            assert pod["status"]["podIP"].startswith(node.pod_subnet.rsplit(".", 1)[0])
            netns = sc.pod_netns(node, pod["metadata"]["uid"])
            assert not sc.has_inpod_rules(await asyncio.to_thread(sc.rules_in, netns))
            await kc.request(api, "DELETE", "/api/v1/namespaces/plain/pods/web")

            async def sandbox_gone():
                return not await asyncio.to_thread(sc.sandbox_pid, node, pod["metadata"]["uid"])
            await sc.until("the sandbox torn down", sandbox_gone, node, timeout=60)
        finally:
            await sc.delete_everything(api, node, ["plain"])
            await api.close()
    finally:
        errors = node.close()
    assert not errors, errors


async def _ready_pod(api, ns: str, name: str):
    pod = await sc.get_pod(api, ns, name)
    return pod if sc.ready(pod) else None


async def test_daemonset_on_a_real_node(node_bin, tmp_path):
    """deploy/kubernetes/ applied as shipped (CNI host dirs pointed at the node's) →
    the controller manager creates the agent's pod, the kubelet runs it with the spec's
    mounts, probes and security context, and the agent chains istio-cni into the node's
    CNI config. Then, for pods created through the API:

    - an ambient-namespace pod comes up annotated ``ambient.istio.io/redirection: enabled``,
      with the in-pod rules in its netns, held by the (fake) ztunnel; its kubelet
      readiness probe passes, arriving from the host probe SNAT address (httpd's log
      names the client), while pod-to-pod traffic to it is captured to ztunnel's inbound;
    - a pod in a plain namespace gets neither annotation nor rules nor a ztunnel hold;
    - ``kubectl rollout restart`` of the DaemonSet replaces the agent's pod, and every
      enrolled pod keeps its rules, its annotation and its place in ztunnel (the new
      agent's snapshot names it; nothing was deleted or drained); a pod created after
      the restart is enrolled by the new agent.
    """
    from agent.demo.fake_ztunnel import FakeZtunnel

    node = RealNode(node_bin)
    zt = zt_task = None
    try:
        ds = sc.agent_daemonset(node)
        try:
            await asyncio.to_thread(sc.import_agent_image_prepare_check)
        except LookupError as e:
            unavailable(str(e))
        await sc.start(node, tmp_path / "cluster")
        await asyncio.to_thread(sc.import_agent_image, node)
        api = await node.cluster.admin_client()
        namespaces = ["mesh", "plain", ds["metadata"]["namespace"]]
        try:
            # --- the reference ztunnel on the DaemonSet's ZDS socket path ---
            settings = sc.agent_settings()
            zt = FakeZtunnel(str(node.host_path(settings["ztunnel_uds_address"])),
                             open_listeners=True)
            zt_task = asyncio.create_task(zt.run())

            # --- the DaemonSet, as shipped ---
            t0 = time.monotonic()
            await sc.deploy_agent(api, node, ds)

            async def agent_ready():
                pods = await sc.agent_pods(api, ds)
                return pods[0] if len(pods) == 1 and sc.ready(pods[0]) else None
            agent = await sc.until("the agent's pod Ready", agent_ready, node, timeout=180,
                                   interval=0.5)
            agent_ready_s = time.monotonic() - t0
            assert agent["spec"]["nodeName"] == node.name
            assert agent["metadata"]["ownerReferences"][0]["kind"] == "DaemonSet"
            spec = agent["spec"]
            shipped = sc.agent_daemonset(node)["spec"]["template"]["spec"]
            assert spec["containers"][0]["securityContext"] == \
                shipped["containers"][0]["securityContext"]
            assert spec["hostNetwork"] and spec["hostPID"]
            conflist = node.cni_conf_dir / "10-kn.conflist"
            await sc.until("istio-cni chained into the node's conflist",
                           lambda: asyncio.to_thread(sc.chained, conflist), node, timeout=60)
            assert (node.cni_bin_dir / "istio-cni").exists()
            await zt.wait_snapshot(timeout=60)

            # --- pods through the API ---
            await sc.namespace(api, "mesh", ambient=True)
            await sc.namespace(api, "plain", ambient=False)
            await sc.create_pod(api, sc.app_pod("web", "mesh"))
            await sc.create_pod(api, sc.app_pod("web", "plain"))
            mesh = await sc.until("mesh/web Ready", lambda: _ready_pod(api, "mesh", "web"),
                                  node, timeout=120)
            plain = await sc.until("plain/web Ready", lambda: _ready_pod(api, "plain", "web"),
                                   node, timeout=120)
            mesh_uid, plain_uid = mesh["metadata"]["uid"], plain["metadata"]["uid"]
            assert (mesh["metadata"].get("annotations") or {}).get(sc.REDIRECTION) == "enabled"
            assert sc.REDIRECTION not in (plain["metadata"].get("annotations") or {})
            mesh_ns, plain_ns = sc.pod_netns(node, mesh_uid), sc.pod_netns(node, plain_uid)
            mesh_rules = await asyncio.to_thread(sc.rules_in, mesh_ns)
            assert sc.has_inpod_rules(mesh_rules), mesh_rules
            assert not sc.has_inpod_rules(await asyncio.to_thread(sc.rules_in, plain_ns))
            held = await zt.wait_for_pod(mesh_uid, timeout=30)
            assert (held.name, held.namespace) == ("web", "mesh")
            assert plain_uid not in zt.pods

            # the kubelet's probe of the ambient pod came through the host probe SNAT
            log = sc.container_log(node, mesh)
            assert sc.PROBE_SNAT_V4 in log, log[-2000:]
            # ... while traffic from another pod is captured to ztunnel's inbound
            mesh_ip = mesh["status"]["podIP"]

            def dial():
                try:
                    with socket.create_connection((mesh_ip, sc.APP_PORT), timeout=3) as s:
                        s.recv(100)
                except OSError:
                    pass
            await asyncio.to_thread(run_in_netns_thread, plain_ns, dial)
            hit = await asyncio.wait_for(zt.accepted.get(), 10)
            assert hit.uid == mesh_uid and hit.port in (15006, 15008), hit

            # --- kubectl rollout restart of the DaemonSet ---
            sessions, snapshots = zt.sessions, zt.snapshots
            inode = zt.adds.get(mesh_uid)
            await asyncio.to_thread(sc.kubectl, node, "-n", ds["metadata"]["namespace"],
                                    "rollout", "restart", "daemonset/ambient-agent")
            old = agent["metadata"]["uid"]

            async def replaced():
                pods = await sc.agent_pods(api, ds)
                return pods[0] if (len(pods) == 1 and pods[0]["metadata"]["uid"] != old
                                   and sc.ready(pods[0])) else None
            t0 = time.monotonic()
            new_agent = await sc.until("the restarted agent's pod Ready", replaced, node,
                                       timeout=180, interval=0.5)
            restart_s = time.monotonic() - t0
            await zt.wait_snapshot(timeout=60, count=snapshots + 1)
            assert zt.sessions > sessions
            assert mesh_uid in zt.snapshot_uids, zt.snapshot_uids
            assert mesh_uid in zt.pods and mesh_uid not in zt.deleted, zt.deleted
            assert zt.adds.get(mesh_uid) == inode  # the same netns, never re-added
            assert sc.has_inpod_rules(await asyncio.to_thread(sc.rules_in, mesh_ns))
            mesh = await sc.get_pod(api, "mesh", "web")
            assert mesh["metadata"]["uid"] == mesh_uid and sc.ready(mesh)
            assert mesh["metadata"]["annotations"].get(sc.REDIRECTION) == "enabled"
            assert sc.chained(conflist)
            # the new agent enrolls a new pod
            await sc.create_pod(api, sc.app_pod("web2", "mesh"))
            web2 = await sc.until("mesh/web2 Ready", lambda: _ready_pod(api, "mesh", "web2"),
                                  node, timeout=120)
            assert web2["metadata"]["annotations"].get(sc.REDIRECTION) == "enabled"
            await zt.wait_for_pod(web2["metadata"]["uid"], timeout=30)
            assert new_agent["metadata"]["name"] != agent["metadata"]["name"]
            print(f"agent Ready {agent_ready_s:.1f}s after apply; rollout restart "
                  f"{restart_s:.1f}s")
        finally:
            node.remember_netns()
            await sc.delete_everything(api, node, namespaces)
            await api.close()
    finally:
        if zt is not None:
            zt.stop()
            if zt_task is not None:
                await asyncio.wait_for(asyncio.gather(zt_task, return_exceptions=True), 10)
        errors = node.close()
    assert not errors, errors
    assert not os.path.exists(node.netns_path)
