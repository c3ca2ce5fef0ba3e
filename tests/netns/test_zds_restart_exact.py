"""Agent restart with enrolled pods, against the ztunnel-exact ZDS peer (needs root).

The agent runs as a real ``ambient-agent run`` process (files source, host probe rules
in a scratch netns) and pods are real netns on a bridge, enrolled through the CNI event
socket as the plugin does. ztunnel is :class:`tests.ztunnel_exact.zds.ZtunnelZds`,
written from ztunnel's ``src/inpod/`` (not from ``agent/demo/fake_ztunnel.py``): it shuts every proxy
not named before ``SnapshotSent``, so a snapshot that misses a live pod shows up as a
drained proxy. Both peers retry connect in a tight loop, so they connect the moment the
restarted agent's socket exists.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import pytest
import yaml

from agent.demo.envoy import free_port
from tests.agent.test_run_signals import ROOT_ONLY, node_netns  # noqa: F401 (fixture)
from tests.ztunnel_exact.zds import ZtunnelZds

pytestmark = ROOT_ONLY

NODE = "node-restart"
NS = "restart"


def pod_object(pod, *, labels=None, host_network=False, node=NODE) -> dict:
    spec = {"nodeName": node, "serviceAccountName": "sa",
            "containers": [{"name": "app", "image": "app"}]}
    if host_network:
        spec["hostNetwork"] = True
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod.name, "namespace": NS, "uid": pod.uid,
                         "labels": labels or {}},
            "spec": spec,
            "status": {"phase": "Running", "podIP": pod.ip, "podIPs": [{"ip": pod.ip}]}}


def write_cluster(config_dir, objects: list[dict]) -> None:
    namespace = {"apiVersion": "v1", "kind": "Namespace",
                 "metadata": {"name": NS, "labels": {"istio.io/dataplane-mode": "ambient"}}}
    tmp = os.path.join(config_dir, ".cluster.tmp")
    with open(tmp, "w") as f:
        yaml.safe_dump_all([namespace, *objects], f)
    os.replace(tmp, os.path.join(config_dir, "cluster.yaml"))  # one atomic change


class AgentProcess:
    """``ambient-agent run`` on the given state/config dirs, free ports, IPv4 only."""

    def __init__(self, state, config_dir, node_netns):
        self.state, self.config_dir, self.node_netns = state, config_dir, node_netns
        self.zds_path = str(state / "zds.sock")
        self.event_socket = str(state / "pluginevent.sock")
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0

    def start(self) -> "AgentProcess":
        argv = [sys.executable, "-m", "agent.cli", "run", "--state-dir", str(self.state),
                "--config-dir", str(self.config_dir), "--node-name", NODE,
                "--xds-tls-port", "0", "--host-rules-netns", self.node_netns,
                "--ambient-ipv6", "false", "--log-level", "warn",
                "--ztunnel-uds-address", self.zds_path,
                "--status-port", str(free_port()), "--health-port", str(free_port()),
                "--monitoring-port", "0",
                "--xds-port", str(free_port())]
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        return self

    def wait_events(self, timeout: float = 180.0) -> None:
        """Until the CNI event server accepts a connection. Components start in order and
        the event server after enrollment, whose start runs the whole restart recovery:
        once it accepts, recovery is done. A socket file alone says nothing (a SIGKILLed
        agent leaves its file behind). ``timeout`` only bounds a hang."""
        deadline = time.monotonic() + timeout
        while True:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                try:
                    probe.connect(self.event_socket)
                    return
                except OSError:
                    pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("agent did not come up: " + self.output())
            time.sleep(0.05)

    def output(self) -> str:
        if self.proc is None:
            return ""
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.communicate()[0] or ""

    def kill(self) -> None:
        """SIGKILL: no stop hook runs (rules, sets, records and the socket file stay)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
            self.proc.communicate()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc.communicate()


async def cni_add(agent: AgentProcess, pod) -> tuple[int, str]:
    event = {"command": "ADD", "container_id": "c-" + pod.name, "netns": pod.netns_path,
             "pod_name": pod.name, "pod_namespace": NS, "pod_uid": pod.uid, "ips": [pod.ip]}
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=agent.event_socket)
                                     ) as session:
        async with session.post("http://agent/cmdadd", data=json.dumps(event)) as resp:
            return resp.status, await resp.text()


def in_pod_rules(pod) -> bool:
    return "ISTIO" in pod.exec("iptables-save").stdout


@pytest.fixture
def zds_peers():
    peers: list[ZtunnelZds] = []
    yield peers
    for peer in peers:
        peer.stop()


async def test_restart_100_pods_first_snapshot_names_every_live_pod(
        bridge, state_dir, tmp_path, node_netns, zds_peers):  # noqa: F811
    """Issue 13 item 2/3, issue 17 item 7: 100 pods stay enrolled across a SIGKILL of the
    agent; while it is down one pod is deleted (netns and Pod object gone), one is
    relabelled ``istio.io/dataplane-mode=none`` and one becomes ``hostNetwork``. The
    restarted agent's first snapshot to each ztunnel names exactly the 100 live pods:
    the long-running ztunnel keeps all 100 proxies and drains only the 3 others; a
    ztunnel connecting at the earliest moment starts all 100. The deleted pod's record
    is gone, the two that no longer qualify are un-enrolled (records gone, in-pod rules
    removed from their live netns)."""
    config_dir = tmp_path / "cluster"
    config_dir.mkdir()
    pods = [await asyncio.to_thread(bridge.add_pod, "tz") for _ in range(103)]
    live, (deleted, relabelled, host_net) = pods[:100], pods[100:]
    write_cluster(config_dir, [pod_object(p) for p in pods])

    old = ZtunnelZds(str(state_dir / "zds.sock"), connect_retry=0.001).start()
    zds_peers.append(old)
    agent = AgentProcess(state_dir, config_dir, node_netns).start()
    try:
        await asyncio.to_thread(agent.wait_events)
        results = await asyncio.gather(*(cni_add(agent, p) for p in pods))
        assert all(status == 200 and '"ambient": true' in text for status, text in results), \
            [r for r in results if r[0] != 200][:3]
        assert await asyncio.to_thread(old.wait, lambda: len(old.proxies) == 103)
        assert old.shut == []

        await asyncio.to_thread(agent.kill)
        await asyncio.to_thread(bridge.remove_pod, deleted)
        write_cluster(config_dir, [pod_object(p) for p in live]
                      + [pod_object(relabelled, labels={"istio.io/dataplane-mode": "none"}),
                         pod_object(host_net, host_network=True)])

        fresh = ZtunnelZds(str(state_dir / "zds.sock"), connect_retry=0.001).start()
        zds_peers.append(fresh)
        agent = AgentProcess(state_dir, config_dir, node_netns).start()
        live_uids = {p.uid for p in live}
        await asyncio.to_thread(agent.wait_events)  # restart recovery done
        assert await asyncio.to_thread(fresh.wait, lambda: fresh.snapshots, 60), agent.output()
        assert await asyncio.to_thread(old.wait, lambda: len(old.snapshots) == 2, 30)

        first = fresh.snapshots[0]
        assert first.names == live_uids
        assert first.adds == 100 and first.keeps == 0
        assert set(fresh.proxies) == live_uids and fresh.shut == [] and fresh.fatal is None
        assert fresh.ready()

        after_restart = old.snapshots[1]
        assert after_restart.names == live_uids
        assert sorted(old.shut) == sorted((p.uid, "not in snapshot")
                                          for p in (deleted, relabelled, host_net))
        assert set(old.proxies) == live_uids and old.fatal is None
        # the long-running peer's proxies were kept: same netns, same fd, no replacement
        assert all(old.proxies[p.uid].connection == 1 for p in live)

        # the agent's side: dropped and un-enrolled records are gone, rules removed
        def records() -> set[str]:
            return {f[:-5] for f in os.listdir(state_dir / "pods") if f.endswith(".json")}
        assert records() == live_uids  # recovery (done above) dropped or un-enrolled the rest
        for pod in (relabelled, host_net):
            assert not await asyncio.to_thread(in_pod_rules, pod)
        assert await asyncio.to_thread(in_pod_rules, live[0])
        # nothing more was sent to either peer for the live pods after the snapshot
        await asyncio.sleep(0.3)
        assert set(old.proxies) == live_uids and len(old.shut) == 3
    finally:
        agent.stop()


async def test_restart_keeps_pod_whose_netns_is_gone_while_its_pod_object_exists(
        bridge, state_dir, tmp_path, node_netns, zds_peers):  # noqa: F811
    """Only a pod whose netns *and* Pod object are both gone is dropped. A pod whose netns
    can't be found but whose Pod object still says ambient is announced as ``Keep`` (so
    ztunnel keeps whatever proxy it runs) and retried; a pod whose netns is alive but
    has no Pod object (enrolled by the plugin's ``ambient_default``) is kept too."""
    config_dir = tmp_path / "cluster"
    config_dir.mkdir()
    a, b, c = [await asyncio.to_thread(bridge.add_pod, "tk") for _ in range(3)]
    write_cluster(config_dir, [pod_object(p) for p in (a, b, c)])
    zt = ZtunnelZds(str(state_dir / "zds.sock"), connect_retry=0.001).start()
    zds_peers.append(zt)
    agent = AgentProcess(state_dir, config_dir, node_netns).start()
    try:
        await asyncio.to_thread(agent.wait_events)
        assert [s for s, _ in await asyncio.gather(*(cni_add(agent, p) for p in (a, b, c)))
                ] == [200] * 3
        agent.kill()
        await asyncio.to_thread(bridge.remove_pod, b)       # netns gone, Pod object stays
        write_cluster(config_dir, [pod_object(p) for p in (a, b)])  # c: no Pod object
        agent = AgentProcess(state_dir, config_dir, node_netns).start()
        await asyncio.to_thread(agent.wait_events)  # restart recovery done
        assert await asyncio.to_thread(zt.wait, lambda: len(zt.snapshots) == 2, 60), \
            agent.output()
        snap = zt.snapshots[1]
        assert snap.names == {a.uid, b.uid, c.uid}
        assert snap.adds == 2 and snap.keeps == 1
        assert zt.shut == []
    finally:
        agent.stop()
