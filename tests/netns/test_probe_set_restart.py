"""The host probe set across agent restarts (issue 17 item 6): reconciled in place, never
flushed; a pod whose IPs arrive after start gets its entry; a DEL removes a pod's
entries by owner even when its IPs are unknown.

Real agents (the enrollment component with the real ZDS server and the ZDS ztunnel
stand-in) on real netns pods; the probe sets and SNAT rules live in a scratch "node"
netns (``host_rules_netns``), never the host. The set is read by an independent
:class:`cni.hostrules.HostProbeRules` on the same netns (netlink for ipset, ``nft -j``
for nftables) polling in a tight loop while the agent restarts.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from cni.hostrules import HostProbeRules
from tests.netns.test_enrollment_reconciler import (Harness, StoreSource, _until, event,
                                                    host_entries, node_netns)  # noqa: F401


class SetPoller:
    """Reads the probe set as fast as it can on a thread: ``samples`` counts reads,
    ``missing`` the reads in which ``ip`` was absent or not owned by ``uid``."""

    def __init__(self, backend: str, netns: str, ip: str, uid: str):
        self.reader = HostProbeRules(backend=backend, ipv6=False, netns=netns)
        self.ip, self.uid = ip, uid
        self.samples = self.missing = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="set-poller")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                entries = self.reader.entries()
            except Exception as e:  # noqa: BLE001 - recorded, asserted on
                self.errors.append(repr(e))
                continue
            self.samples += 1
            if entries.get(self.ip) != self.uid:
                self.missing += 1

    def __enter__(self) -> "SetPoller":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.reader.close()


async def _reads(poller: SetPoller, count: int, timeout: float = 10.0) -> None:
    """Wait until the poller has read the set ``count`` more times (a loaded machine
    makes each ``nft`` read slow; time alone would not prove the window was watched)."""
    target, deadline = poller.samples + count, time.monotonic() + timeout
    while poller.samples < target and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("how", ["stop", "kill"])
@pytest.mark.parametrize("backend", ["iptables", "nftables"])
async def test_entry_never_absent_across_restart(bridge, state_dir, node_netns, backend, how):
    """Agent 1 enrolls a pod; agent 2 starts on the same state dir (after a graceful stop
    or a SIGKILL-like end of agent 1). Every read of the set during the whole restart
    finds the pod's entry; before the fix the start-of-day flush emptied it for the
    ~100 ms until recovery re-added it (kubelet probes failed in that window)."""
    native = backend == "nftables"
    h1 = await Harness(state_dir, node_netns, native_nftables=native).start()
    pod = await asyncio.to_thread(bridge.add_pod, "tp")
    await h1.ztunnel()
    await h1.enrollment.enroll(event(pod))
    assert await host_entries(h1) == {pod.ip: pod.uid}
    with SetPoller(backend, node_netns, pod.ip, pod.uid) as poller:
        await _reads(poller, 5)
        await (h1.stop() if how == "stop" else h1.kill())
        h2 = await Harness(state_dir, node_netns, native_nftables=native).start()
        try:
            assert h2.enrollment.debug_state()["backend"] == backend
            await _reads(poller, 5)  # keep reading after recovery settled
        finally:
            await h2.stop()
    assert not poller.errors, poller.errors[:3]
    assert poller.samples >= 10, poller.samples
    assert poller.missing == 0, f"entry absent in {poller.missing} of {poller.samples} reads"


def _pod_obj(pod, ips=()):
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod.name, "namespace": "default", "uid": pod.uid,
                         "labels": {"istio.io/dataplane-mode": "ambient"},
                         "annotations": {"ambient.istio.io/redirection": "enabled"}},
            "spec": {"nodeName": ""},
            "status": {"podIPs": [{"ip": ip} for ip in ips]} if ips else {}}


async def test_pods_without_ips_at_start_keep_and_get_entries(bridge, state_dir, node_netns):
    """Kubernetes mode, no state files: two pods annotated ``enabled`` whose
    ``status.podIPs`` are still empty (kubelet restarted). A keeps the entry an earlier
    run gave it, a foreign stale entry goes; B, with no entry yet, gets one as soon as
    its Pod object lists its IP; a DEL for A without IPs (the agent never learnt them)
    removes A's entry by owner."""
    a, b = [await asyncio.to_thread(bridge.add_pod, n) for n in ("ta", "tb")]
    earlier = HostProbeRules(backend="iptables", ipv6=False, netns=node_netns)
    await asyncio.to_thread(earlier.setup)
    await asyncio.to_thread(earlier.add_pod, a.uid, [a.ip])
    await asyncio.to_thread(earlier.add_pod, "uid-of-a-pod-long-gone", ["10.254.0.9"])
    earlier.close()

    source = StoreSource()
    source.put(_pod_obj(a), _pod_obj(b))
    h = await Harness(state_dir, node_netns, config_source="kubernetes").start(source)
    try:
        assert await host_entries(h) == {a.ip: a.uid}
        assert h.enrollment.pods()[b.uid].ips == []

        source.put(_pod_obj(b, [f"::ffff:{b.ip}"]))  # kubelet publishes B's IP
        assert await _until(lambda: h.enrollment.pods()[b.uid].ips == [b.ip])
        for _ in range(100):
            if b.ip in await host_entries(h):
                break
            await asyncio.sleep(0.05)
        assert await host_entries(h) == {a.ip: a.uid, b.ip: b.uid}

        ev = event(a, "DEL")
        ev.ips = []
        await h.enrollment.unenroll(ev, is_delete=True)
        assert await host_entries(h) == {b.ip: b.uid}
    finally:
        await h.stop()


async def test_restart_removes_only_foreign_stale_entries(bridge, state_dir, node_netns):
    """State dir kept, one pod enrolled, and entries an earlier agent left for pods that
    are gone: after the restart exactly the known pod's entry is left, and a pod
    un-enrolled while no agent ran (its record gone) is not resurrected."""
    h1 = await Harness(state_dir, node_netns).start()
    kept, gone = [await asyncio.to_thread(bridge.add_pod, n) for n in ("tk", "tg")]
    await h1.ztunnel()
    await h1.enrollment.enroll(event(kept))
    await h1.enrollment.enroll(event(gone))
    await h1.kill()
    os.unlink(os.path.join(state_dir, "pods", f"{gone.uid}.json"))
    started = time.monotonic()
    h2 = await Harness(state_dir, node_netns).start()
    try:
        assert time.monotonic() - started < 10
        assert await host_entries(h2) == {kept.ip: kept.uid}
    finally:
        await h2.stop()
