"""The enrollment component end to end: real netns pods on a bridge, real rules, the real
ZDS server (``zds.server.ZdsServer``) and a ztunnel stand-in speaking real ZDS
(agent.demo.fake_ztunnel on a thread of its own, since ztunnel can't run here). Host probe rules
and sets go into a scratch "node" netns (setting ``host_rules_netns``) so the real
host is never touched. The config source, where used, is a minimal in-memory
ObjectStore (the ``ambient.api.ObjectStore`` read side), no Kubernetes API here.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import subprocess

import pytest
from pyroute2 import netns as pr_netns

from agent.core.config import load
from agent.core.lifecycle import AgentContext, Component
from agent.enrollment_zds import ZdsServerChannel
from cni.enrollment import Enrollment, EnrollmentError
from cni.events import CniPodEvent
from agent.demo.fake_ztunnel_thread import FakeZtunnelThread
from tests.netns.test_enrollment_rules import dial, snapshot
from zds.server import ZdsServer


class FakeConfigSource(Component):
    """In-memory stand-in for the ``config-source`` component (pods by uid)."""

    name = "config-source"

    def kube_api(self):
        return None  # no Kubernetes API: Events are not written

    def __init__(self):
        self.store = self
        self.pods: dict[str, dict] = {}

    def pod_by_uid(self, uid):
        return self.pods.get(uid)

    def get(self, kind, namespace, name):
        return None

    def list(self, kind, namespace=None):
        return list(self.pods.values()) if kind == "Pod" else []

    def subscribe(self, listener):
        """Nothing to announce: tests set ``pods`` before the enrollment starts and
        change them only through enroll/unenroll calls."""
        return lambda: None


@pytest.fixture
def node_netns():
    name = "tn" + secrets.token_hex(3)
    pr_netns.create(name)
    try:
        yield f"/var/run/netns/{name}"
    finally:
        pr_netns.remove(name)


class Harness:
    def __init__(self, state_dir, node_netns, **overrides):
        self.state_dir = str(state_dir)
        self.config = load({}, env={}).replace(
            state_dir=self.state_dir, ztunnel_uds_address=os.path.join(self.state_dir, "zds.sock"),
            ztunnel_wait=2.0, host_rules_netns=node_netns, ambient_ipv6=False, **overrides)
        self.ztunnels: list[FakeZtunnelThread] = []

    async def start(self, source: FakeConfigSource | None = None):
        self.ctx = AgentContext(self.config)
        if source is not None:
            self.ctx.add(source)
        self.zds = self.ctx.add(ZdsServer(self.config.ztunnel_uds_address, ztunnel_wait=2.0))
        self.enrollment = self.ctx.add(Enrollment(self.ctx, zds=ZdsServerChannel(self.zds),
                                                  source=source))
        await self.zds.start()
        await self.enrollment.start()
        return self

    async def ztunnel(self, **kw) -> FakeZtunnelThread:
        zt = await asyncio.to_thread(FakeZtunnelThread(self.config.ztunnel_uds_address, **kw).start)
        self.ztunnels.append(zt)
        return zt

    async def kill(self):
        """What a SIGKILL leaves: no component stop hooks ran (rules, sets, state files
        stay); only the process's sockets are gone."""
        for zt in self.ztunnels:
            zt.close()
        self.ztunnels.clear()
        self.enrollment.retries.kill()
        await self.zds.stop(0.5)
        self.ctx.executor.shutdown(wait=False)

    async def stop(self):
        for zt in self.ztunnels:
            zt.close()
        await self.enrollment.stop(1.0)
        await self.zds.stop(0.5)
        self.ctx.executor.shutdown(wait=False)


def event(pod, command="ADD", **kw) -> CniPodEvent:
    return CniPodEvent(command=command, container_id="c-" + pod.name, netns=pod.netns_path,
                       pod_name=pod.name, pod_namespace="default", pod_uid=pod.uid,
                       ips=[pod.ip], **kw)


async def host_entries(h: Harness) -> dict[str, str]:
    return await asyncio.to_thread(h.enrollment.host_rules.entries)


async def test_enroll_traffic_and_unenroll(bridge, state_dir, node_netns):
    h = await Harness(state_dir, node_netns).start()
    try:
        zt = await h.ztunnel(open_listeners=True)
        a, b, c = [await asyncio.to_thread(bridge.add_pod, n) for n in ("ta", "tb", "tc")]
        before = snapshot(a)
        await asyncio.gather(h.enrollment.enroll(event(a)), h.enrollment.enroll(event(b)))
        assert zt.adds[a.uid] == os.stat(a.netns_path).st_ino
        state = h.enrollment.debug_state()["pods"]
        assert state[a.uid]["status"] == state[b.uid]["status"] == "enabled"
        assert await host_entries(h) == {a.ip: a.uid, b.ip: b.uid}
        assert os.path.exists(os.path.join(h.state_dir, "pods", f"{a.uid}.json"))

        # A -> B lands on ztunnel's outbound listener inside A, original dst recoverable
        client = await asyncio.to_thread(dial, a, b.ip, 8080)
        hit = await asyncio.to_thread(zt.wait_accepted, lambda x: (x.uid, x.port) == (a.uid, 15001))
        assert hit.original_dst == (b.ip, 8080)
        client.close()
        # unenrolled C -> B lands on ztunnel's inbound listener inside B
        client = await asyncio.to_thread(dial, c, b.ip, 8080)
        hit = await asyncio.to_thread(zt.wait_accepted, lambda x: (x.uid, x.port) == (b.uid, 15006))
        assert hit.original_dst == (b.ip, 8080)
        client.close()

        # re-ADD of an enrolled pod is harmless: rules not duplicated
        await h.enrollment.enroll(event(a))
        assert a.exec("iptables-save").stdout.count("-A PREROUTING -j ISTIO_PRERT") == 3

        await h.enrollment.unenroll(event(a, "DEL"))
        assert snapshot(a) == before
        assert await host_entries(h) == {b.ip: b.uid}
        assert await asyncio.to_thread(zt.wait, lambda: a.uid in zt.deleted)
        assert not os.path.exists(os.path.join(h.state_dir, "pods", f"{a.uid}.json"))
        # DEL after the netns is gone is fine
        await asyncio.to_thread(bridge.remove_pod, b)
        await h.enrollment.unenroll(event(b, "DEL"))
        assert await host_entries(h) == {}
    finally:
        await h.stop()


async def test_bad_input_errors_and_rollback(bridge, state_dir, node_netns):
    source = FakeConfigSource()
    h = await Harness(state_dir, node_netns).start(source)
    try:
        zt = await h.ztunnel()
        good, bad, gone = [await asyncio.to_thread(bridge.add_pod, n) for n in ("tg", "tx", "tz")]
        clean_bad = snapshot(bad)

        ev = event(good)
        ev.netns = "/var/run/netns/does-not-exist-" + secrets.token_hex(3)
        with pytest.raises(EnrollmentError, match="does-not-exist.*No such file"):
            await h.enrollment.enroll(ev)

        ev = event(good)
        ev.ips = []
        with pytest.raises(EnrollmentError, match="no pod IP"):
            await h.enrollment.enroll(ev)

        # iptables-restore failure: its stderr is in the error, nothing left behind
        source.pods[bad.uid] = {"metadata": {"uid": bad.uid, "name": bad.name,
                                             "namespace": "default", "annotations": {
                                                 "istio.io/reroute-virtual-interfaces": "bad if!"}}}
        with pytest.raises(EnrollmentError, match=r"rolled back.*Bad argument") as err:
            await h.enrollment.enroll(event(bad))
        assert "line" in str(err.value)
        assert snapshot(bad) == clean_bad
        assert h.enrollment.debug_state()["pods"][bad.uid]["status"] == "failed"

        # netns disappears while ztunnel is being told: rolled back, error says so
        def vanish(kind, payload):
            if kind == "add" and payload.uid == gone.uid:
                bridge.remove_pod(gone)
        zt.fake.on_request = vanish
        with pytest.raises(EnrollmentError, match="disappeared"):
            await h.enrollment.enroll(event(gone))
        assert gone.uid not in h.enrollment.pods()
        assert await asyncio.to_thread(zt.wait, lambda: gone.uid in zt.deleted)

        # the good pod is unaffected by all of the above
        await h.enrollment.enroll(event(good))
        assert h.enrollment.debug_state()["pods"][good.uid]["status"] == "enabled"
        assert await host_entries(h) == {good.ip: good.uid}
    finally:
        await h.stop()


async def test_ztunnel_nack_is_retried_until_enrolled(bridge, state_dir, node_netns):
    h = await Harness(state_dir, node_netns).start()
    try:
        zt = await h.ztunnel(nack="proxy start failed")
        pod = await asyncio.to_thread(bridge.add_pod, "tp")
        with pytest.raises(EnrollmentError, match="proxy start failed.*will retry") as err:
            await h.enrollment.enroll(event(pod))
        assert err.value.retryable
        assert h.enrollment.debug_state()["pods"][pod.uid]["status"] == "pending"
        assert ":ISTIO_OUTPUT" in pod.exec("iptables-save").stdout  # fail closed
        zt.nack = ""
        for _ in range(100):
            if h.enrollment.debug_state()["pods"][pod.uid]["status"] == "enabled":
                break
            await asyncio.sleep(0.05)
        assert h.enrollment.debug_state()["pods"][pod.uid]["status"] == "enabled"
        assert await host_entries(h) == {pod.ip: pod.uid}
    finally:
        await h.stop()


async def test_no_ztunnel_is_a_retryable_error(bridge, state_dir, node_netns):
    h = Harness(state_dir, node_netns)
    h.config = h.config.replace(ztunnel_wait=0.3)
    await h.start()
    try:
        pod = await asyncio.to_thread(bridge.add_pod, "tp")
        with pytest.raises(EnrollmentError, match="no ztunnel connected to .* s; retry") as err:
            await h.enrollment.enroll(event(pod))
        assert err.value.retryable
    finally:
        await h.stop()


async def test_restart_recovers_20_pods(bridge, state_dir, node_netns):
    h = await Harness(state_dir, node_netns).start()
    pods = [await asyncio.to_thread(bridge.add_pod, "tr") for _ in range(20)]
    await h.ztunnel()
    await asyncio.gather(*(h.enrollment.enroll(event(p)) for p in pods))
    saves = {p.uid: p.exec("iptables-save").stdout for p in pods}
    await h.kill()

    h2 = await Harness(state_dir, node_netns).start()
    try:
        status = h2.enrollment.debug_state()["pods"]
        assert {u: s["status"] for u, s in status.items()} == {p.uid: "enabled" for p in pods}
        zt = await h2.ztunnel()
        assert await asyncio.to_thread(zt.wait, lambda: zt.snapshot_uids is not None)
        assert zt.snapshot_uids == {p.uid for p in pods}
        assert all(zt.adds[p.uid] == os.stat(p.netns_path).st_ino for p in pods)
        for p in pods:  # rules reconciled in place, nothing duplicated
            save = p.exec("iptables-save").stdout
            assert save.count("-A PREROUTING -j ISTIO_PRERT") == 3
            assert _rules(save) == _rules(saves[p.uid])
        assert await host_entries(h2) == {p.ip: p.uid for p in pods}
    finally:
        await h2.stop()


async def test_restart_reports_pod_whose_netns_is_gone(bridge, state_dir, node_netns):
    h = await Harness(state_dir, node_netns).start()
    kept, lost = [await asyncio.to_thread(bridge.add_pod, n) for n in ("tk", "tl")]
    await h.ztunnel()
    await h.enrollment.enroll(event(kept))
    await h.enrollment.enroll(event(lost))
    await h.kill()
    await asyncio.to_thread(bridge.remove_pod, lost)

    h2 = await Harness(state_dir, node_netns).start()
    try:
        status = h2.enrollment.debug_state()["pods"]
        assert status[kept.uid]["status"] == "enabled"
        assert status[lost.uid]["status"] == "netns-missing"
        assert "not found at restart" in status[lost.uid]["error"]
        # issue 26: the lost pod's IP leaves the node's probe set, the kept one's stays
        entries = await asyncio.to_thread(h2.enrollment.host_rules.entries)
        assert entries.get(kept.ip) == kept.uid and lost.ip not in entries
        assert h2.ctx.registry.get_sample_value(
            "ambient_agent_recovery_netns_missing_total") == 1.0
        zt = await h2.ztunnel()
        assert await asyncio.to_thread(zt.wait, lambda: zt.snapshot_uids is not None)
        assert zt.snapshot_uids == {kept.uid, lost.uid}  # Keep for the lost one
        assert zt.adds[lost.uid] is None
    finally:
        await h2.stop()


async def test_nftables_backend_end_to_end(bridge, state_dir, node_netns):
    h = Harness(state_dir, node_netns)
    h.config = h.config.replace(native_nftables=True)
    await h.start()
    try:
        zt = await h.ztunnel(open_listeners=True)
        a, b = [await asyncio.to_thread(bridge.add_pod, n) for n in ("ta", "tb")]
        before = snapshot(a)
        await h.enrollment.enroll(event(a))
        await h.enrollment.enroll(event(b))
        assert h.enrollment.debug_state()["backend"] == "nftables"
        client = await asyncio.to_thread(dial, a, b.ip, 8080)
        hit = await asyncio.to_thread(zt.wait_accepted, lambda x: (x.uid, x.port) == (a.uid, 15001))
        assert hit.original_dst == (b.ip, 8080)
        client.close()
        # DNS capture (on by default): UDP/53 from A lands on ztunnel's 15053
        await asyncio.to_thread(a.run, _send_dns, b.ip)
        hit = await asyncio.to_thread(zt.wait_accepted, lambda x: (x.uid, x.port, x.protocol)
                                      == (a.uid, 15053, "udp"))
        assert hit.data == b"q"
        assert await host_entries(h) == {a.ip: a.uid, b.ip: b.uid}
        await h.enrollment.unenroll(event(a, "DEL"))
        assert snapshot(a) == before
    finally:
        await h.stop()


def _send_dns(host):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(b"q", (host, 53))


def _rules(save: str) -> list[str]:
    return sorted(ln for ln in save.splitlines() if ln.startswith(("-A", ":ISTIO")))


def _node_rules(node_netns: str) -> str:
    name = os.path.basename(node_netns)
    save = subprocess.run(["ip", "netns", "exec", name, "iptables-save"], capture_output=True,
                          text=True, check=True).stdout
    return "\n".join(_rules(save))


@pytest.mark.parametrize("decommission", [False, True])
async def test_stop_keeps_host_rules_unless_safe_upgrade_disabled(state_dir, node_netns,
                                                                  decommission):
    """Host probe rules survive a restart; with AMBIENT_DISABLE_SAFE_UPGRADE
    (the node is being decommissioned) the agent removes them at stop."""
    h = await Harness(state_dir, node_netns,
                      ambient_disable_safe_upgrade=decommission).start()
    assert "ISTIO" in _node_rules(node_netns)
    await h.stop()
    assert ("ISTIO" in _node_rules(node_netns)) is not decommission


async def test_cni_del_keeps_in_pod_rules_as_upstream(bridge, state_dir, node_netns):
    """CNI DEL = upstream RemovePodFromMesh(isDelete=true): the sandbox's netns
    is being destroyed, so its rules are left to go with it; probe set entry, ZDS and
    the persisted record are removed. Un-enrollment of a live pod (is_delete=False) is
    the full removal."""
    h = await Harness(state_dir, node_netns).start()
    try:
        zt = await h.ztunnel()
        pod, live = [await asyncio.to_thread(bridge.add_pod, n) for n in ("td", "tl")]
        before = snapshot(live)
        await h.enrollment.enroll(event(pod))
        await h.enrollment.enroll(event(live))
        await h.enrollment.unenroll(event(pod, "DEL"), is_delete=True)
        assert ":ISTIO_OUTPUT" in pod.exec("iptables-save").stdout  # left to the netns
        assert await host_entries(h) == {live.ip: live.uid}
        assert await asyncio.to_thread(zt.wait, lambda: pod.uid in zt.deleted)
        assert pod.uid not in h.enrollment.pods()
        assert not os.path.exists(os.path.join(h.state_dir, "pods", f"{pod.uid}.json"))
        await h.enrollment.unenroll(event(pod, "DEL"), is_delete=True)  # repeated DEL: fine
        await h.enrollment.unenroll(event(live, "DEL"), is_delete=False)
        assert snapshot(live) == before
        assert await host_entries(h) == {}
    finally:
        await h.stop()


class StoreSource(Component):
    """``config-source`` over the real ``ambient.store.ObjectStore`` (change events
    included); objects are put in directly, as a files/Kubernetes backend would."""

    name = "config-source"

    def kube_api(self):
        return None  # no Kubernetes API: Events are not written

    def __init__(self):
        from ambient.store import ObjectStore
        self.store = ObjectStore()

    def put(self, *objs):
        self.store.apply([(o, "test") for o in objs], origin="test")


def _pod_obj(pod, ns, labels=None):
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod.name, "namespace": ns, "uid": pod.uid,
                         "labels": labels or {}}, "spec": {"serviceAccountName": "sa"}}


def _ns_obj(name, labels=None):
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "labels": labels or {}}}


async def _until(cond, timeout=5.0):
    for _ in range(int(timeout / 0.02)):
        if cond():
            return True
        await asyncio.sleep(0.02)
    return cond()


async def test_pod_that_stops_being_ambient_is_unenrolled(bridge, state_dir, node_netns):
    """Upstream's informer Pod/Namespace Update: a running enrolled pod whose
    labels (or its namespace's) stop selecting it is removed with isDelete=false: its
    in-pod rules, routing, probe entry and ZDS proxy all go, the netns is as before.
    Unrelated changes, and a pod still ambient, change nothing."""
    source = StoreSource()
    ns = "ns" + secrets.token_hex(3)
    h = await Harness(state_dir, node_netns).start(source)
    try:
        zt = await h.ztunnel()
        by_pod, by_ns, other, keeper = [await asyncio.to_thread(bridge.add_pod, n)
                                        for n in ("ta", "tb", "tc", "tk")]
        clean = {p.uid: snapshot(p) for p in (by_pod, by_ns)}
        source.put(_ns_obj(ns, {"istio.io/dataplane-mode": "ambient"}),
                   _pod_obj(by_pod, ns, {"istio.io/dataplane-mode": "ambient"}),
                   _pod_obj(by_ns, ns), _pod_obj(other, ns),
                   _pod_obj(keeper, ns, {"istio.io/dataplane-mode": "ambient"}))
        for p in (by_pod, by_ns, other, keeper):
            ev = event(p)
            ev.pod_namespace = ns
            await h.enrollment.enroll(ev)
        assert set(h.enrollment.pods()) == {by_pod.uid, by_ns.uid, other.uid, keeper.uid}

        # a label that doesn't change the decision: nothing happens
        source.put(_pod_obj(other, ns, {"app": "x"}))
        await asyncio.sleep(0.2)
        assert other.uid in h.enrollment.pods()

        source.put(_pod_obj(by_pod, ns, {"istio.io/dataplane-mode": "none"}))
        assert await _until(lambda: by_pod.uid not in h.enrollment.pods())
        assert await _until(lambda: not h.enrollment.live.busy())
        assert snapshot(by_pod) == clean[by_pod.uid]
        assert by_pod.uid in zt.deleted
        assert by_pod.ip not in await host_entries(h)

        # the namespace loses its label: the pods only it selected leave; a pod whose
        # own label says ambient stays
        source.put(_ns_obj(ns))
        assert await _until(lambda: set(h.enrollment.pods()) == {keeper.uid})
        assert await _until(lambda: not h.enrollment.live.busy())
        assert snapshot(by_ns) == clean[by_ns.uid]
        assert await host_entries(h) == {keeper.ip: keeper.uid}
        assert {by_ns.uid, other.uid} <= set(zt.deleted) and keeper.uid not in zt.deleted
        assert h.enrollment.debug_state()["pods"][keeper.uid]["status"] == "enabled"
    finally:
        await h.stop()


async def test_native_nftables_kept_on_iptables_says_why_once(state_dir, node_netns, caplog):
    """A newuser finding: with native_nftables true and our iptables probe ipset present
    in the node netns (documented: the agent stays on iptables), nothing said why."""
    import logging

    from cni.hostrules import HostProbeRules

    other = HostProbeRules(backend="iptables", ipv6=False, netns=node_netns)
    await asyncio.to_thread(other.setup)  # an iptables agent's host rules and probe set
    h = Harness(state_dir, node_netns)
    h.config = h.config.replace(native_nftables=True)
    try:
        with caplog.at_level(logging.WARNING, logger="cni.enrollment.reconciler"):
            await h.start()
        state = h.enrollment.debug_state()
        assert state["backend"] != "nftables"
        notes = [r.getMessage() for r in caplog.records
                 if "native_nftables is true but the agent stays on iptables" in r.getMessage()]
        assert len(notes) == 1 and "istio-inpod-probes-v4" in notes[0], notes
        assert state["backend_note"] == notes[0]
    finally:
        await h.stop()
        await asyncio.to_thread(other.teardown)
