"""`ambient-agent run --config-source kubernetes` as a real process against the real
kube-apiserver, with a kubeconfig holding a token of the DaemonSet's ServiceAccount (so
only deploy/kubernetes/rbac.yaml's permissions): ready once synced, serves a pod's
workload and its service over workload xDS, follows changes, writes a waypoint Gateway's
status (it is the only agent, so the Lease holder), and never logs a 403.
(The xDS side is read with the repository's delta xDS client; the xDS server itself is
tested against ztunnel elsewhere — here the point is the Kubernetes source under the
agent.)"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import aiohttp
import pytest

from agent.demo.envoy import free_port
from ambient.xds.client import DeltaXdsClient
from tests.kube import cluster as kc

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def node_netns():
    """A scratch netns for the agent's host probe rules (never this machine's own)."""
    from pyroute2 import netns

    name = "tkube" + os.urandom(3).hex()
    netns.create(name)
    try:
        yield f"/var/run/netns/{name}"
    finally:
        netns.remove(name)


async def test_agent_process_serves_kubernetes_pods_over_xds_as_its_service_account(
        kube_admin, kube_namespace, agent_kubeconfig, tmp_path, node_netns):
    node = kc.unique("node")
    await kc.create_node(kube_admin, node)
    await kc.apply(kube_admin, {"apiVersion": "v1", "kind": "Service",
                                "metadata": {"name": "web", "namespace": kube_namespace},
                                "spec": {"selector": {"app": "web"},
                                         "ports": [{"name": "http", "port": 80,
                                                    "targetPort": 8080}]}})
    await kc.run_pod(kube_admin, "web-0", kube_namespace, node, ["10.252.0.1"],
                     labels={"app": "web"})
    svc = await kc.request(kube_admin, "GET",
                           f"/api/v1/namespaces/{kube_namespace}/services/web")
    state = tmp_path / "state"
    xds_port, health_port = free_port(), free_port()
    argv = [sys.executable, "-m", "agent.cli", "run", "--state-dir", str(state),
            "--config-source", "kubernetes", "--kubeconfig", agent_kubeconfig,
            "--node-name", node, "--xds-port", str(xds_port), "--xds-tls-port", "0",
            "--status-port", str(free_port()), "--health-port", str(health_port),
            "--monitoring-port", "0",
            "--host-rules-netns", node_netns, "--log-level", "info"]
    env = dict(os.environ, ZTUNNEL_UDS_ADDRESS=str(state / "ztunnel" / "ztunnel.sock"))
    env.pop("KUBECONFIG", None)
    log_path = tmp_path / "agent.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    client = None
    try:
        async with aiohttp.ClientSession() as http:
            async def ready() -> bool:
                try:
                    async with http.get(f"http://127.0.0.1:{health_port}/readyz") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False
            deadline = time.monotonic() + 60
            while not await ready():
                assert proc.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, log_path.read_text()
                await asyncio.sleep(0.2)
        client = DeltaXdsClient(f"127.0.0.1:{xds_port}", metadata={"NODE_NAME": node})
        await client.connect()
        await client.wait_synced(timeout=30)
        pod_name = f"Kubernetes//Pod/{kube_namespace}/web-0"
        svc_name = f"{kube_namespace}/web.{kube_namespace}.svc.cluster.local"
        await client.wait_for(pod_name, timeout=30)
        await client.wait_for(svc_name, timeout=30)
        w = client.resources()[pod_name].workload
        assert w.addresses == [bytes([10, 252, 0, 1])]
        assert w.node == node
        assert w.service_account == "default"
        s = client.resources()[svc_name].service
        vips = {bytes(a.address) for a in s.addresses}
        assert bytes(int(x) for x in svc["spec"]["clusterIP"].split(".")) in vips
        # a change in the cluster reaches ztunnel's view through the agent
        await kc.run_pod(kube_admin, "web-1", kube_namespace, node, ["10.252.0.2"],
                         labels={"app": "web"})
        await client.wait_for(f"Kubernetes//Pod/{kube_namespace}/web-1", timeout=30)
        await kc.delete_pod(kube_admin, kube_namespace, "web-0")
        await client.wait_for(pod_name, timeout=30, present=False)
        # the agent (the only one, so the Lease holder) writes a waypoint Gateway's status
        await kc.apply(kube_admin, {
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
            "metadata": {"name": "wp", "namespace": kube_namespace},
            "spec": {"gatewayClassName": "istio-waypoint",
                     "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE"}]}})
        path = f"/apis/gateway.networking.k8s.io/v1/namespaces/{kube_namespace}/gateways/wp"
        deadline = time.monotonic() + 60
        while not ((await kc.request(kube_admin, "GET", path)).get("status") or {}).get(
                "conditions"):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            await asyncio.sleep(0.2)
        conditions = (await kc.request(kube_admin, "GET", path))["status"]["conditions"]
        assert {c["type"]: c["reason"] for c in conditions} == {
            "Accepted": "Accepted", "Programmed": "AddressNotUsable",
            "ResolvedRefs": "ResolvedRefs"}
    finally:
        if client is not None:
            await client.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        await kc.delete_node(kube_admin, node)
    out = log_path.read_text()
    assert proc.returncode == 0, out
    assert " 403 " not in out and "Forbidden" not in out and "forbidden" not in out, out
