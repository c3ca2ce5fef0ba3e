"""A CNI DEL during the pod's ADD, a pod whose loopback is down, an incomplete rollback.

Real netns pods on a bridge, real in-pod rules, the real ZDS server (no ztunnel
connects: enrollment waits up to ``ztunnel_wait``, as on a node whose ztunnel is not up
yet) and the real CNI event server over its Unix socket. Host probe rules go into a
scratch "node" netns (``host_rules_netns``), never the real host.
"""

from __future__ import annotations

import asyncio
import os
import time

import aiohttp
import pytest

from agent.enrollment_zds import ZdsServerChannel
from cni.enrollment import Enrollment, EnrollmentError
from cni.eventserver import CniEventServer
from cni.rules_common import RulesError
from cni.rules_iptables import IptablesBackend, detect_flavor
from tests.netns.test_enrollment_reconciler import (FakeConfigSource, Harness, event,
                                                    host_entries, node_netns)  # noqa: F401
from tests.netns.test_enrollment_rules import snapshot
from zds.server import ZdsServer

ZTUNNEL_WAIT = 30.0  # the default: the ADD would hold the pod's lock this long


async def start(h: Harness, backend=None, source=None) -> Harness:
    """Like ``Harness.start`` with a real ``cni-events`` server and a 30 s ztunnel wait."""
    from agent.core.lifecycle import AgentContext

    h.config = h.config.replace(ztunnel_wait=ZTUNNEL_WAIT,
                                cni_event_socket=os.path.join(h.state_dir, "pluginevent.sock"))
    h.ctx = AgentContext(h.config)
    if source is not None:
        h.ctx.add(source)
    h.zds = h.ctx.add(ZdsServer(h.config.ztunnel_uds_address, ztunnel_wait=ZTUNNEL_WAIT))
    h.enrollment = h.ctx.add(Enrollment(h.ctx, backend=backend, zds=ZdsServerChannel(h.zds),
                                        source=source))
    h.events = h.ctx.add(CniEventServer(h.ctx, h.config.cni_event_socket,
                                        store=source.store if source is not None else None,
                                        enrollment=h.enrollment))
    await h.zds.start()
    await h.enrollment.start()
    await h.events.start()
    return h


async def stop(h: Harness) -> None:
    await h.events.stop(1.0)
    await h.stop()


async def post(h: Harness, path: str, ev) -> tuple[int, str]:
    conn = aiohttp.UnixConnector(path=h.config.cni_event_socket)
    async with aiohttp.ClientSession(connector=conn) as s:
        async with s.post(f"http://localhost{path}", json=ev.to_json()) as r:
            return r.status, await r.text()


async def until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_cni_del_cancels_pending_add(bridge, state_dir, node_netns):
    """ADD waits for a ztunnel (rules applied, pod lock held); the DEL cancels it: the DEL
    answers before the plugin gives up (2 s), the ADD answers 500
    "pod deleted during enrollment", and nothing is left: rules, probe set, ZDS record,
    state file, locks."""
    h = await start(Harness(state_dir, node_netns))
    try:
        pod = await asyncio.to_thread(bridge.add_pod, "tc")
        before = snapshot(pod)
        add = asyncio.create_task(post(h, "/cmdadd", event(pod, ambient_default=True)))
        await until(lambda: pod.uid in h.zds.pods())  # rules in, waiting for a ztunnel
        assert ":ISTIO_OUTPUT" in pod.exec("iptables-save").stdout

        started = time.monotonic()
        status, body = await post(h, "/cmddel", event(pod, "DEL"))
        took = time.monotonic() - started
        assert status == 200, body
        # the plugin gives up after 2 s; the ADD alone would wait for a ztunnel far
        # longer. Under 1.5 s proves the DEL did not queue behind it, with room for a
        # loaded 2-core CI machine (0.5 s failed there once)
        assert took < 1.5, f"DEL took {took:.2f}s"
        status, body = await asyncio.wait_for(add, 1.0)
        assert status == 500
        assert "pod deleted during enrollment (CNI DEL); rolled back" in body, body

        assert snapshot(pod) == before
        assert await host_entries(h) == {}
        assert h.enrollment.pods() == {} and h.zds.pods() == []
        assert not os.path.exists(os.path.join(h.state_dir, "pods", f"{pod.uid}.json"))
        assert h.events.debug_state()["in_flight"] == {} and h.events._locks == {}
        assert h.enrollment._enrolling == {} and h.enrollment._aborted == set()
    finally:
        await stop(h)


async def test_unenroll_cancels_enroll_but_not_other_cancellations(bridge, state_dir,
                                                                   node_netns):
    """The component API directly: ``unenroll(is_delete=True)`` aborts a pending
    ``enroll`` (EnrollmentError); a plain task cancel (shutdown) stays a cancellation but
    is rolled back too."""
    h = await start(Harness(state_dir, node_netns))
    try:
        a, b = [await asyncio.to_thread(bridge.add_pod, n) for n in ("ta", "tb")]
        clean_a, clean_b = snapshot(a), snapshot(b)
        enroll_a = asyncio.create_task(h.enrollment.enroll(event(a)))
        await until(lambda: a.uid in h.zds.pods())
        started = time.monotonic()
        await h.enrollment.unenroll(event(a, "DEL"), is_delete=True)
        assert time.monotonic() - started < 1.5  # not behind the ztunnel wait (see above)
        with pytest.raises(EnrollmentError, match="pod deleted during enrollment"):
            await enroll_a
        assert snapshot(a) == clean_a

        enroll_b = asyncio.create_task(h.enrollment.enroll(event(b)))
        await until(lambda: b.uid in h.zds.pods())
        enroll_b.cancel()
        with pytest.raises(asyncio.CancelledError):
            await enroll_b
        assert snapshot(b) == clean_b
        assert h.enrollment.pods() == {} and h.zds.pods() == []
        assert h.enrollment.abort_enroll(b.uid) is None  # nothing in flight
    finally:
        await stop(h)


async def test_loopback_down_is_named(bridge, state_dir, node_netns):
    h = await start(Harness(state_dir, node_netns))
    try:
        pod = await asyncio.to_thread(bridge.add_pod, "tl")
        pod.exec("ip", "link", "set", "lo", "down")
        before = snapshot(pod)
        status, body = await post(h, "/cmdadd", event(pod, ambient_default=True))
        assert status == 500
        assert (f"default/{pod.name} (uid {pod.uid}): loopback interface 'lo' in the pod "
                f"netns {pod.netns_path} is down") in body, body
        assert "nothing was applied" in body and "Network is down" not in body
        assert snapshot(pod) == before
    finally:
        await stop(h)


class UndeletableRules(IptablesBackend):
    """The real iptables backend, except that deleting fails (fault injection: a real
    rollback failure can't be provoked on demand)."""

    def delete(self, ipv6: bool, routing: bool = True, during=None) -> None:
        raise RulesError("iptables-restore: simulated failure while deleting")

    def drop_tables(self, ipv6: bool, tables, routing: bool = True, during=None) -> None:
        raise RulesError("iptables-restore: simulated failure while deleting")


async def test_failed_rollback_is_not_called_rolled_back(bridge, state_dir, node_netns):
    source = FakeConfigSource()
    backend = UndeletableRules(detect_flavor(str(state_dir)))
    h = await start(Harness(state_dir, node_netns), backend=backend, source=source)
    try:
        pod = await asyncio.to_thread(bridge.add_pod, "tr")
        # an interface name iptables rejects: the apply fails inside iptables-restore
        source.pods[pod.uid] = {"metadata": {"uid": pod.uid, "name": pod.name,
                                             "namespace": "default", "annotations": {
                                                 "istio.io/reroute-virtual-interfaces": "bad if!"}}}
        with pytest.raises(EnrollmentError) as err:
            await h.enrollment.enroll(event(pod))
        msg = str(err.value)
        assert "in-pod rules failed (rollback incomplete: in-pod rules: iptables-restore: " \
               "simulated failure while deleting)" in msg, msg
        assert "rolled back" not in msg
    finally:
        await stop(h)
