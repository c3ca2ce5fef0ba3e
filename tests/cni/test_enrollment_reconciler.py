"""The enrollment reconciler and its pipeline without root: the real :class:`Enrollment`,
:class:`Dataplane`, :class:`RetryQueue` and :class:`Recovery` over the protocol fakes of
``tests/cni/enrollment_fakes.py`` (netns table, ZDS server, probe set, config source).

What needs a kernel (rules really in a netns, a real ztunnel-side ZDS peer, ``/proc``
scans) is ``tests/netns/test_enrollment_*.py``; these tests pin the decisions: which
failure policy rolls back, what is retried and how fast, what a CNI DEL during an ADD
leaves, what restart recovery keeps, drops and un-enrolls.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading

import pytest

from agent.core.config import load
from agent.core.lifecycle import AgentContext
from cni.rules_nftables import NftablesBackend  # never run: the fake netns applies no rules
from cni import annotate
from cni.enrollment import Enrollment, EnrollmentError, PodState, Step
from cni.enrollment import reconciler as reconciler_mod
from cni.enrollment.kernel import LoopbackDown
from cni.enrollment.records import PodStateStore
from cni.enrollment.recovery import Recovery
from cni.events import CniPodEvent
from cni.rules_common import RulesError
from tests.cni.enrollment_fakes import FakeNetns, FakeProbeSet, FakeSource, FakeZds
from tests.helpers import ManualClock

UID, NETNS, IP = "uid-a", "/run/netns/pod-a", "10.1.0.5"


class Rig:
    """An :class:`Enrollment` over fakes; ``netns``/``zds``/``probes`` are inspectable."""

    def __init__(self, state_dir, zds: FakeZds | None = None, source: FakeSource | None = None):
        self.config = load({}, env={}).replace(state_dir=str(state_dir), ambient_ipv6=False,
                                               node_name="node-1")
        self.ctx = AgentContext(self.config, max_workers=2)
        if source is not None:
            self.ctx.add(source)
        self.netns, self.probes = FakeNetns(), FakeProbeSet()
        self.zds = zds if zds is not None else FakeZds()
        self.enrollment = Enrollment(self.ctx, backend=NftablesBackend(), host_rules=self.probes,
                                     zds=self.zds, netns=self.netns, source=source)
        self.enrollment.retries.initial = 0.01  # the doubling is what is tested

    def close(self) -> None:
        self.enrollment.retries.kill()
        self.enrollment.probe_updates.kill()
        self.ctx.executor.shutdown(wait=False)


@pytest.fixture
async def rig(state_dir):
    r = Rig(state_dir)
    r.netns.create(NETNS)
    yield r
    r.close()


def event(uid=UID, netns=NETNS, ip=IP, command="ADD") -> CniPodEvent:
    return CniPodEvent(command=command, container_id="c-" + uid, netns=netns,
                       pod_name="web", pod_namespace="shop", pod_uid=uid, ips=[ip])


async def until(cond, timeout=5.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


async def test_add_success_runs_every_step_and_persists(rig, state_dir):
    await rig.enrollment.enroll(event())
    rec = rig.enrollment.pods()[UID]
    assert rec.status is PodState.ENABLED and rec.error == ""
    assert rec.steps == {Step.RULES: True, Step.ZDS: True, Step.HOSTSET: True, Step.STATE: True,
                         Step.STATUS: True}
    assert rig.netns.rules_at(NETNS) is not None
    pod, wait_ack = rig.zds.adds[-1]
    assert (pod.uid, pod.name, pod.namespace, wait_ack) == (UID, "web", "shop", True)
    assert pod.netns_fd is not None
    assert rig.probes.entries == {UID: {IP}}
    assert rig.netns.open_fds == {}  # the netns fd was closed
    saved = json.loads((state_dir / "pods" / f"{UID}.json").read_text())
    assert saved == {"uid": UID, "name": "web", "namespace": "shop", "service_account": "default",
                     "netns": NETNS, "ips": [IP], "annotations": {}}
    assert rig.enrollment.debug_state()["pods"][UID]["status"] == "enabled"
    assert UID not in rig.enrollment.retries


async def test_add_rules_failure_rolls_back_and_is_not_retried(rig, state_dir):
    rig.netns.apply_error = RulesError("iptables-restore: line 3 failed")
    with pytest.raises(EnrollmentError) as err:
        await rig.enrollment.enroll(event())
    assert not err.value.retryable
    assert "in-pod rules failed (rolled back): iptables-restore: line 3 failed" in str(err.value)
    assert rig.netns.rules_at(NETNS) is None  # the half-applied ruleset was deleted
    assert rig.netns.deleted and isinstance(rig.netns.deleted[0], int)
    rec = rig.enrollment.pods()[UID]
    assert rec.status is PodState.FAILED and rec.steps[Step.RULES] is False
    assert rig.zds.adds == [] and rig.probes.entries == {}
    assert UID not in rig.enrollment.retries
    assert not (state_dir / "pods" / f"{UID}.json").exists()


async def test_add_rules_failure_whose_rollback_fails_says_so(rig):
    rig.netns.apply_error = RulesError("restore failed")
    rig.netns.delete_error = RulesError("delete failed")
    with pytest.raises(EnrollmentError, match=r"rollback incomplete: in-pod rules: delete "
                                              r"failed\): restore failed"):
        await rig.enrollment.enroll(event())


async def test_add_with_loopback_down_applies_and_rolls_back_nothing(rig):
    rig.netns.apply_error = LoopbackDown("loopback interface 'lo' in the pod netns is down")
    with pytest.raises(EnrollmentError, match="is down; nothing was applied"):
        await rig.enrollment.enroll(event())
    assert rig.netns.deleted == [] and rig.netns.rules == {}


async def test_add_of_missing_netns_fails_naming_the_path(rig):
    with pytest.raises(EnrollmentError, match=r"netns path '/run/netns/gone': No such file"):
        await rig.enrollment.enroll(event(netns="/run/netns/gone"))
    assert rig.enrollment.pods()[UID].error.startswith("netns: ")


async def test_zds_unavailable_keeps_rules_and_retries_with_backoff(state_dir):
    r = Rig(state_dir, zds=FakeZds(ztunnel=False))
    clock = ManualClock()
    r.enrollment.retries.clock, r.enrollment.retries.sleep = clock.time, clock.sleep
    try:
        r.netns.create(NETNS)
        with pytest.raises(EnrollmentError) as err:
            await r.enrollment.enroll(event())
        assert err.value.retryable and "no ztunnel connected to /fake/ztunnel.sock" in str(err.value)
        rec = r.enrollment.pods()[UID]
        assert rec.status is PodState.PENDING and rec.error.startswith("zds: ")
        assert r.netns.rules_at(NETNS) is not None  # fail closed: the rules stay
        assert UID in r.enrollment.retries
        # retried with doubling delays (0.01, 0.02, 0.04, ...): each attempt one add, at
        # exactly its due time on the queue's clock. The clock is a manual one: the
        # delays are checked exactly and a loaded machine can't stretch or shrink them.
        times: list[float] = []
        original = r.zds.add

        async def timed_add(pod, wait_ack=True, ztunnel_wait=None):
            times.append(clock.now)
            await original(pod, wait_ack, ztunnel_wait)
        r.zds.add = timed_add  # type: ignore[method-assign]
        for n in range(1, 5):
            await until(lambda: clock.sleepers)  # the queue waits for the next due key
            assert r.enrollment.retries.pending()[UID] == pytest.approx(0.01 * 2 ** (n - 1))
            await clock.advance_to_next_sleeper()
            await until(lambda n=n: len(times) >= n)
        assert times == pytest.approx([0.01, 0.03, 0.07, 0.15]), times
        r.zds.ztunnel = True  # a ztunnel connects: the next retry enrolls the pod
        assert await clock.advance_to_next_sleeper() == pytest.approx(0.31)
        await until(lambda: r.enrollment.pods()[UID].status == PodState.ENABLED)
        assert r.enrollment.pods()[UID].attempts >= 4
        await until(lambda: UID not in r.enrollment.retries)
        assert r.probes.entries == {UID: {IP}}
    finally:
        r.close()


def test_backoff_is_capped(state_dir):
    async def main():
        r = Rig(state_dir)
        try:
            q = r.enrollment.retries
            q.initial, q.maximum = 0.2, reconciler_mod.BACKOFF_MAX
            delays = []
            for _ in range(10):
                delays.append(q.backoff("k"))
                q._failures["k"] = q._failures.get("k", 0) + 1
            assert delays[:4] == [0.2, 0.4, 0.8, 1.6] and delays[-1] == 30.0
            q.forget("k")
            assert q.backoff("k") == 0.2  # a fresh ADD starts over
        finally:
            r.close()
    asyncio.run(main())


async def test_zds_nack_is_retried_and_named(rig):
    rig.zds.nack = "no such pod"
    with pytest.raises(EnrollmentError, match=r"ztunnel did not accept the pod \(ZdsNack: "
                                              r"ztunnel rejected pod uid-a: no such pod\)"):
        await rig.enrollment.enroll(event())
    await until(lambda: rig.enrollment.pods()[UID].status == PodState.ENABLED)


async def test_probe_set_failure_is_retried(rig):
    rig.probes.add_error = RulesError("ipset: busy")
    with pytest.raises(EnrollmentError, match="host probe set: ipset: busy; will retry"):
        await rig.enrollment.enroll(event())
    assert rig.enrollment.pods()[UID].status is PodState.PENDING
    await until(lambda: rig.enrollment.pods()[UID].status == PodState.ENABLED)


async def test_retry_with_rules_failure_keeps_retrying(state_dir):
    """The RETRY policy: a rules failure on a retry fails that attempt (no rollback)."""
    r = Rig(state_dir, zds=FakeZds(ztunnel=False))
    try:
        r.netns.create(NETNS)
        with pytest.raises(EnrollmentError):
            await r.enrollment.enroll(event())
        r.netns.apply_error = RulesError("transient")
        await until(lambda: r.enrollment.pods()[UID].error == "rules: transient")
        assert r.netns.deleted == []  # nothing rolled back by a retry
        r.zds.ztunnel = True
        await until(lambda: r.enrollment.pods()[UID].status == PodState.ENABLED)
    finally:
        r.close()


async def test_del_during_add_cancels_and_rolls_back(rig, state_dir):
    rig.zds.hold = asyncio.Event()  # the ADD waits for ztunnel's ack
    add = asyncio.create_task(rig.enrollment.enroll(event()))
    await asyncio.wait_for(rig.zds.adding.wait(), 5)
    assert rig.enrollment.enrolling(UID)
    await rig.enrollment.unenroll(event(command="DEL"), is_delete=True)
    with pytest.raises(EnrollmentError, match=r"pod deleted during enrollment \(CNI DEL\); "
                                              r"rolled back"):
        await add
    assert rig.netns.rules_at(NETNS) is None  # the ADD's rules were rolled back
    assert UID not in rig.zds.pods and rig.zds.deletes.count(UID) >= 1
    assert rig.enrollment.pods() == {} and rig.probes.entries == {}
    assert rig.enrollment._enrolling == {} and rig.enrollment._aborted == set()
    assert UID not in rig.enrollment.retries
    assert not (state_dir / "pods" / f"{UID}.json").exists()


async def test_del_cancels_a_pending_retry(state_dir):
    r = Rig(state_dir, zds=FakeZds(ztunnel=False))
    try:
        r.netns.create(NETNS)
        with pytest.raises(EnrollmentError):
            await r.enrollment.enroll(event())
        assert UID in r.enrollment.retries
        await r.enrollment.unenroll(event(command="DEL"), is_delete=True)
        assert UID not in r.enrollment.retries and r.enrollment.pods() == {}
        adds = len(r.zds.adds)
        await asyncio.sleep(0.1)
        assert len(r.zds.adds) == adds  # no retry after the DEL
    finally:
        r.close()


async def test_label_removal_unenroll_removes_rules_and_everything(rig, state_dir):
    await rig.enrollment.enroll(event())
    await rig.enrollment.unenroll(event(command="DEL"), is_delete=False)
    assert rig.netns.deleted == [NETNS]  # by path: the live pod's rules and routing go
    assert rig.netns.rules_at(NETNS) is None
    assert UID in rig.zds.deletes and rig.probes.entries == {}
    assert rig.enrollment.pods() == {}
    assert not (state_dir / "pods" / f"{UID}.json").exists()


async def test_cni_del_leaves_rules_to_the_dying_netns(rig):
    await rig.enrollment.enroll(event())
    await rig.enrollment.unenroll(event(command="DEL"), is_delete=True)
    assert rig.netns.deleted == []  # as upstream: not deleted, the netns goes away
    assert UID in rig.zds.deletes and rig.probes.entries == {}


async def test_unenroll_reports_a_failed_step_after_trying_all(rig):
    await rig.enrollment.enroll(event())
    rig.netns.delete_error = RulesError("nft: busy")
    with pytest.raises(EnrollmentError, match="removal incomplete: in-pod rules: nft: busy"):
        await rig.enrollment.unenroll(event(command="DEL"), is_delete=False)
    assert UID in rig.zds.deletes and rig.probes.entries == {}


async def test_unenroll_of_vanished_netns_is_clean(rig):
    await rig.enrollment.enroll(event())
    rig.netns.destroy(NETNS)
    await rig.enrollment.unenroll(event(command="DEL"), is_delete=False)
    assert rig.enrollment.pods() == {}


def _pod(uid, name, node="node-1", labels=None, phase="Running") -> dict:
    return {"kind": "Pod", "metadata": {"uid": uid, "name": name, "namespace": "shop",
                                        "labels": labels or {"istio.io/dataplane-mode": "ambient"}},
            "spec": {"nodeName": node}, "status": {"phase": phase, "podIPs": []}}


def _write_record(state_dir, uid, netns, ip, **extra):
    """A state file in the format every released agent writes (``cni/enrollment/records.py``)."""
    d = state_dir / "pods"
    d.mkdir(mode=0o700, exist_ok=True)
    data = {"uid": uid, "name": uid.split("-")[1], "namespace": "shop",
            "service_account": "sa-" + uid, "netns": netns, "ips": [ip],
            "annotations": {"ambient.istio.io/redirection": "enabled"}, **extra}
    (d / f"{uid}.json").write_text(json.dumps(data))


def test_records_written_by_the_previous_version_load(state_dir):
    """Files written before states and steps became enums: the same seven keys, an old
    file's IPv4-mapped address, a file missing optional keys, one with an unknown key
    and one malformed file (skipped, the others load)."""
    _write_record(state_dir, "uid-a", "/run/netns/a", "10.1.0.1")
    _write_record(state_dir, "uid-b", "/proc/42/ns/net", "::ffff:10.1.0.2", future_key=1)
    (state_dir / "pods" / "uid-c.json").write_text(json.dumps({"uid": "uid-c"}))
    (state_dir / "pods" / "broken.json").write_text("{not json")
    records = {r.uid: r for r in PodStateStore(str(state_dir)).load()}
    assert sorted(records) == ["uid-a", "uid-b", "uid-c"]
    a = records["uid-a"]
    assert (a.name, a.namespace, a.service_account, a.netns, a.ips) == \
        ("a", "shop", "sa-uid-a", "/run/netns/a", ["10.1.0.1"])
    assert a.annotations == {"ambient.istio.io/redirection": "enabled"}
    assert a.status is PodState.PENDING and a.status == "pending" and a.steps == {}
    assert records["uid-b"].ips == ["10.1.0.2"]
    assert records["uid-c"].service_account == "default" and records["uid-c"].ips == []
    # and what this version writes reads back the same, in the same seven keys
    store = PodStateStore(str(state_dir))
    store.save(a)
    assert set(json.loads((state_dir / "pods" / "uid-a.json").read_text())) == \
        {"uid", "name", "namespace", "service_account", "netns", "ips", "annotations"}
    assert os.stat(state_dir / "pods" / "uid-a.json").st_mode & 0o777 == 0o600


async def test_restart_recovery_decisions(state_dir):
    """Each record re-decided as a fresh ADD: kept (netns alive), kept as netns-missing
    (Pod object there, netns not found), found elsewhere by the scan, dropped (netns and
    Pod object gone), un-enrolled (its Pod object is on another node now / no longer
    ambient). Every kept pod is announced to ZDS before accepts open."""
    source = FakeSource(synced=True)
    r = Rig(state_dir, source=source)
    try:
        for uid, ip in [("uid-keep", "10.1.0.1"), ("uid-missing", "10.1.0.2"),
                        ("uid-moved", "10.1.0.3"), ("uid-gone", "10.1.0.4"),
                        ("uid-elsewhere", "10.1.0.5"), ("uid-optout", "10.1.0.6")]:
            _write_record(state_dir, uid, f"/run/netns/{uid}", ip)
        for uid in ("uid-keep", "uid-elsewhere", "uid-optout"):
            r.netns.create(f"/run/netns/{uid}")
        r.netns.create("/proc/77/ns/net")
        r.netns.moved["uid-moved"] = "/proc/77/ns/net"
        source.pods = {u: _pod(u, u) for u in ("uid-keep", "uid-missing", "uid-moved")}
        source.pods["uid-elsewhere"] = _pod("uid-elsewhere", "elsewhere", node="node-2")
        source.pods["uid-optout"] = _pod("uid-optout", "optout",
                                         labels={"istio.io/dataplane-mode": "none"})
        r.probes.entries["uid-stale"] = {"10.9.9.9"}  # a pod gone while we were down

        outcomes = await r.enrollment.recover()

        assert outcomes == {"uid-keep": "enabled", "uid-missing": "netns-missing",
                            "uid-moved": "enabled", "uid-gone": "dropped",
                            "uid-elsewhere": "unenrolled", "uid-optout": "unenrolled"}
        assert r.zds.accepting
        announced = [(p.uid, p.netns_fd is not None, ack) for p, ack in r.zds.adds]
        assert announced[:r.zds.adds_before_accept] == [
            ("uid-keep", True, False), ("uid-missing", False, False), ("uid-moved", True, False)]
        assert len(announced) == 3  # recovered pods are not announced twice
        assert r.enrollment.pods()["uid-moved"].netns == "/proc/77/ns/net"
        assert "uid-gone" not in r.zds.pods  # never announced: ztunnel drains it
        for uid in ("uid-elsewhere", "uid-optout"):  # their rules go, their netns stays
            assert f"/run/netns/{uid}" in r.netns.deleted and uid in r.zds.deletes
        # the missing pod's IP leaves the probe set (issue 26), counted once
        assert set(r.probes.entries) == {"uid-keep", "uid-moved"}
        assert r.ctx.registry.get_sample_value(
            "ambient_agent_recovery_netns_missing_total") == 1.0
        assert "uid-missing" in r.enrollment.retries
        assert sorted(p.name for p in (state_dir / "pods").iterdir()) == [
            "uid-keep.json", "uid-missing.json", "uid-moved.json"]
        # the missing pod's Pod object goes too: its retry drops it
        del source.pods["uid-missing"]
        await until(lambda: "uid-missing" not in r.enrollment.pods())
        assert "uid-missing" in r.zds.deletes and "uid-missing" not in r.enrollment.retries
    finally:
        r.close()


async def test_recovery_netns_missing_reports_and_reenrolls_when_found(state_dir, caplog):
    """Issue 26: a recorded pod whose netns is not found at restart (a reboot) leaves the
    probe set (an entry an earlier run gave it goes), is counted, logged once naming its
    netns, its annotation is asked to be removed, and it stays announced to ZDS without
    a netns; when its netns appears, the retry enrolls it: entries back, ``enabled``."""
    source = FakeSource(synced=True)
    r = Rig(state_dir, source=source)
    try:
        _write_record(state_dir, "uid-lost", "/run/netns/lost", "10.1.0.7")
        source.pods = {"uid-lost": _pod("uid-lost", "lost")}
        r.probes.entries["uid-lost"] = {"10.1.0.7"}  # what the previous run left
        with caplog.at_level("WARNING"):
            assert await r.enrollment.recover() == {"uid-lost": "netns-missing"}
        assert r.probes.entries.get("uid-lost", set()) == set()
        assert r.ctx.registry.get_sample_value(
            "ambient_agent_recovery_netns_missing_total") == 1.0
        warns = [m.getMessage() for m in caplog.records if "not found at restart" in
                 m.getMessage()]
        assert len(warns) == 1 and "shop/lost" in warns[0] and "/run/netns/lost" in warns[0]
        assert [(p.uid, p.netns_fd) for p, _ in r.zds.adds] == [("uid-lost", None)]
        # its sandbox turns up (a late /proc): the retry enrolls it
        r.netns.create("/proc/88/ns/net")
        r.netns.moved["uid-lost"] = "/proc/88/ns/net"
        await until(lambda: r.enrollment.pods()["uid-lost"].status is PodState.ENABLED)
        assert r.probes.entries["uid-lost"] == {"10.1.0.7"}
        assert r.enrollment.pods()["uid-lost"].steps[Step.STATUS] is True
    finally:
        r.close()


async def test_recovery_drops_a_record_naming_the_host_netns(state_dir, caplog):
    """A record of a hostNetwork pod (its netns is the node's): recovery never enters it,
    neither to reconcile nor to un-enroll (the host's ``ISTIO_*`` chains would go); the
    record is dropped with one WARN naming the pod."""
    source = FakeSource(synced=True)
    r = Rig(state_dir, source=source)
    try:
        for uid in ("uid-hostnet", "uid-hostkeep"):
            _write_record(state_dir, uid, "/proc/1/ns/net", "10.0.0.1")
        r.netns.create("/proc/1/ns/net")
        r.netns.host_paths.add("/proc/1/ns/net")
        source.pods = {"uid-hostnet": _pod("uid-hostnet", "hostnet",
                                           labels={"istio.io/dataplane-mode": "none"}),
                       "uid-hostkeep": _pod("uid-hostkeep", "hostkeep")}
        with caplog.at_level("WARNING", logger="cni.enrollment.recovery"):
            outcomes = await r.enrollment.recover()
        assert outcomes == {"uid-hostnet": "dropped", "uid-hostkeep": "dropped"}
        assert r.netns.deleted == [] and r.netns.applied == []
        assert r.zds.adds == [] and r.zds.deletes == []
        assert r.enrollment.pods() == {} and "uid-hostkeep" not in r.enrollment.retries
        assert not (state_dir / "pods" / "uid-hostnet.json").exists()
        assert not (state_dir / "pods" / "uid-hostkeep.json").exists()
        warns = [m.getMessage() for m in caplog.records if m.levelname == "WARNING"]
        assert len(warns) == 2
        assert any("shop/hostnet" in w for w in warns) and any("shop/hostkeep" in w for w in warns)
    finally:
        r.close()


async def test_recovery_without_synced_source_drops_nothing(state_dir):
    r = Rig(state_dir, source=FakeSource(synced=False))
    try:
        _write_record(state_dir, "uid-gone", "/run/netns/gone", "10.1.0.4")
        assert await r.enrollment.recover() == {"uid-gone": "netns-missing"}
        assert r.zds.accepting and [p.uid for p, _ in r.zds.adds] == ["uid-gone"]
    finally:
        r.close()


async def test_recovery_rules_failure_continues_with_the_other_steps(state_dir):
    """The RECOVER policy: the rules failure is recorded, ZDS (already told), probe set
    and status still run; nothing is rolled back."""
    r = Rig(state_dir)
    try:
        _write_record(state_dir, "uid-a", "/run/netns/a", "10.1.0.1")
        r.netns.create("/run/netns/a")
        r.netns.apply_error = RulesError("nft: no such table")
        await r.enrollment.recover()
        rec = r.enrollment.pods()["uid-a"]
        assert r.probes.entries == {"uid-a": {"10.1.0.1"}} and r.netns.deleted == []
        assert rec.steps[Step.RULES] is False and rec.steps[Step.HOSTSET] is True
    finally:
        r.close()


async def test_recovery_opens_accepts_with_nothing_to_recover(state_dir):
    r = Rig(state_dir)
    try:
        r.probes.entries["uid-stale"] = {"10.9.9.9"}
        assert await r.enrollment.recover() == {}
        assert r.zds.accepting and r.probes.entries == {}
    finally:
        r.close()


async def test_start_and_stop_over_fakes(state_dir):
    r = Rig(state_dir)
    try:
        await r.enrollment.start()
        assert r.enrollment.ready() == (True, "") and r.probes.set_up and r.zds.accepting
        assert r.enrollment.add_blocker() == ""
        r.zds.ztunnel = False
        assert "no ztunnel connected on /fake/ztunnel.sock" in r.enrollment.add_blocker()
        await r.enrollment.stop(1.0)
        assert r.probes.closed
    finally:
        r.close()


async def test_no_zds_channel_is_a_retryable_failure(state_dir):
    config = load({}, env={}).replace(state_dir=str(state_dir), ambient_ipv6=False)
    ctx = AgentContext(config, max_workers=2)
    netns = FakeNetns()
    netns.create(NETNS)
    e = Enrollment(ctx, backend=NftablesBackend(), host_rules=FakeProbeSet(), netns=netns)
    try:
        with pytest.raises(EnrollmentError, match="this agent runs no ZDS server") as err:
            await e.enroll(event())
        assert err.value.retryable
    finally:
        e.retries.kill()
        ctx.executor.shutdown(wait=False)


async def test_label_removal_through_the_store_watch_unenrolls(state_dir):
    """The watch (``cni/enrollment/watch.py``) over a store: an enrolled pod whose Pod object
    loses its ambient label is un-enrolled as a live pod (rules removed, netns kept)."""
    source = FakeSource()
    r = Rig(state_dir, source=source)
    try:
        r.netns.create(NETNS)
        pod = _pod(UID, "web")
        pod["status"]["podIPs"] = [{"ip": IP}]
        source.pods[UID] = pod
        await r.enrollment.start()
        await r.enrollment.enroll(event())
        assert r.enrollment.pods()[UID].status is PodState.ENABLED
        source.update({**pod, "metadata": {**pod["metadata"],
                                           "labels": {"istio.io/dataplane-mode": "none"}}})
        await until(lambda: UID not in r.enrollment.pods())
        await until(lambda: not r.enrollment.live.busy())
        assert r.netns.deleted == [NETNS] and r.netns.rules_at(NETNS) is None
        assert UID in r.zds.deletes and r.probes.entries == {}
        assert r.enrollment.live.stats["removed_live"] == 1
        await r.enrollment.stop(1.0)
    finally:
        r.close()


async def test_pod_delete_through_the_store_watch_removes_it_from_ztunnel(state_dir):
    """A Pod object deleted while its CNI DEL is lost (upstream's informer: a Pod delete
    is ``RemovePodFromMesh(pod, isDelete=true)``): the pod leaves ztunnel (ZDS delete),
    its probe entries and record go; its rules are left to the netns, as on a CNI DEL.
    A delete of a Pod the agent never enrolled changes nothing."""
    source = FakeSource()
    r = Rig(state_dir, source=source)
    try:
        r.netns.create(NETNS)
        pod = _pod(UID, "web")
        pod["status"]["podIPs"] = [{"ip": IP}]
        source.pods[UID] = pod
        source.pods["uid-other"] = _pod("uid-other", "other", node="node-2")
        await r.enrollment.start()
        await r.enrollment.enroll(event())
        assert r.enrollment.pods()[UID].status is PodState.ENABLED
        source.delete("uid-other")
        source.delete(UID)
        await until(lambda: UID not in r.enrollment.pods())
        await until(lambda: not r.enrollment.live.busy())
        assert r.zds.deletes == [UID] and r.probes.entries == {}
        assert r.netns.deleted == [] and r.netns.rules_at(NETNS) is not None
        assert not (state_dir / "pods" / f"{UID}.json").exists()
        assert r.enrollment.live.stats["removed_deleted"] == 1
        await r.enrollment.stop(1.0)
    finally:
        r.close()


async def test_pod_zds_cannot_describe_fails_once_and_is_not_retried(rig):
    """The ZDS channel refusing the pod itself (ValueError: e.g. its AddWorkload would
    exceed ztunnel's 1,024-byte receive buffer) fails that ADD, named, without a retry."""
    async def refuse(pod, wait_ack=True, ztunnel_wait=None):
        raise ValueError("AddWorkload of pod 'uid-a' would be 1130 bytes, over ztunnel's "
                         "1024-byte receive buffer")
    rig.zds.add = refuse  # type: ignore[method-assign]
    with pytest.raises(EnrollmentError) as err:
        await rig.enrollment.enroll(event())
    assert not err.value.retryable
    assert "cannot be handed to ztunnel: AddWorkload of pod 'uid-a' would be 1130" in str(err.value)
    rec = rig.enrollment.pods()[UID]
    assert rec.status is PodState.FAILED and rec.error.startswith("zds: ")
    assert UID not in rig.enrollment.retries


def _stage_counts(rig) -> dict[str, tuple[float, float]]:
    """``{stage: (count, sum seconds)}`` of ``ambient_agent_cni_add_stage_seconds``."""
    out: dict[str, tuple[float, float]] = {}
    for metric in rig.ctx.registry.collect():
        if metric.name != "ambient_agent_cni_add_stage_seconds":
            continue
        for s in metric.samples:
            stage = s.labels.get("stage")
            count, total = out.get(stage, (0.0, 0.0))
            if s.name.endswith("_count"):
                count = s.value
            elif s.name.endswith("_sum"):
                total = s.value
            out[stage] = (count, total)
    return out


async def test_add_stage_histogram_times_each_stage_of_an_add(rig):
    """Each stage of an ADD is observed once, with the time it took (the ZDS wait held
    for ~50 ms shows in ``zds`` and nowhere else); a retry is not an ADD and adds nothing."""
    clock = ManualClock()  # stage durations on a clock that moves only while ZDS is held
    rig.enrollment.dataplane.clock = clock.time
    rig.zds.hold = asyncio.Event()
    task = asyncio.create_task(rig.enrollment.enroll(event()))
    await rig.zds.adding.wait()
    clock.advance(0.05)
    rig.zds.hold.set()
    await task
    stages = _stage_counts(rig)
    assert {s for s, (n, _) in stages.items() if n} == {
        "netns", "rules", "zds", "hostset", "state", "status"}
    assert all(n == 1 for n, _ in stages.values() if n)
    assert stages["zds"][1] == pytest.approx(0.05)
    # the probe set entry runs beside the ZDS add, so it may have seen the clock move
    assert all(total == 0 for s, (_, total) in stages.items() if s not in ("zds", "hostset"))

    # a failing ZDS step: observed (the failed stage counts), and so are the probe set
    # entry, the record and the status written beside it
    rig.zds.nack = "no"
    rig.netns.create("/run/netns/pod-b")
    with pytest.raises(EnrollmentError):
        await rig.enrollment.enroll(event(uid="uid-b", netns="/run/netns/pod-b"))
    after = _stage_counts(rig)
    assert after["zds"][0] == 2 and after["hostset"][0] == 2
    assert after["state"][0] == 2 and after["status"][0] == 2
    await until(lambda: rig.enrollment.pods()["uid-b"].status is PodState.ENABLED)
    assert _stage_counts(rig)["zds"][0] == 2  # the background retry is not an ADD


async def test_probe_set_entry_is_made_while_ztunnel_acks(rig):
    """The host probe set entry does not wait for ztunnel's ACK (it runs beside it); the
    pod is reported enabled only once both are done, and a probe set failure still fails
    the ADD retryably after the ACK."""
    rig.zds.hold = asyncio.Event()
    add = asyncio.create_task(rig.enrollment.enroll(event()))
    await asyncio.wait_for(rig.zds.adding.wait(), 5)
    await until(lambda: rig.probes.entries == {UID: {IP}})
    assert rig.enrollment.pods()[UID].status is not PodState.ENABLED
    rig.zds.hold.set()
    await add
    assert rig.enrollment.pods()[UID].status is PodState.ENABLED

    rig.zds.hold = asyncio.Event()
    rig.zds.adding.clear()
    rig.probes.add_error = RulesError("ipset: busy")
    rig.netns.create("/run/netns/pod-c")
    add = asyncio.create_task(rig.enrollment.enroll(event(uid="uid-c", netns="/run/netns/pod-c")))
    await asyncio.wait_for(rig.zds.adding.wait(), 5)
    rig.zds.hold.set()
    with pytest.raises(EnrollmentError, match="host probe set: ipset: busy; will retry"):
        await add
    assert rig.zds.pods["uid-c"]  # acked: the pod stays with ztunnel, pending, retried


async def test_changed_pod_ips_reach_the_probe_set_through_the_queue_and_are_retried(rig):
    """A known pod's new IPs (the watch's ``pod_ips_seen``) go to the probe set through the
    keyed ``probe_updates`` queue; a failed update is retried after the backoff (on the
    queue's manual clock), not dropped with a warning."""
    clock = ManualClock()
    q = rig.enrollment.probe_updates
    q.clock, q.sleep = clock.time, clock.sleep
    await rig.enrollment.enroll(event())
    assert rig.probes.entries[UID] == {IP}
    rig.probes.add_error = RulesError("ipset: busy")
    rig.enrollment.pod_ips_seen(UID, [IP, "fd00::5"])
    await until(lambda: clock.sleepers)  # the first attempt failed: waiting its backoff
    assert UID in q and rig.probes.entries[UID] == {IP}
    assert q.pending()[UID] == pytest.approx(reconciler_mod.BACKOFF_INITIAL)
    await clock.advance_to_next_sleeper()
    await until(lambda: UID not in q)
    assert rig.probes.entries[UID] == {IP, "fd00::5"}
    rig.enrollment.pod_ips_seen(UID, [IP])  # already there: nothing queued
    assert UID not in q


class RecoveredPodsRecorder:
    """A ``cni.enrollment.recovery.RecoveredPods`` that records what recovery asks: the
    records it adopts (running their reconcile) and the removals by UID."""

    def __init__(self) -> None:
        self.adopted: dict[str, bool] = {}
        self.removed: list[tuple[str, bool, str]] = []

    async def adopt(self, rec, reconcile) -> str:
        self.adopted[rec.uid] = await reconcile(rec)
        return rec.status

    async def remove(self, uid: str, *, is_delete: bool, known=None) -> None:
        self.removed.append((uid, is_delete, known.netns if known is not None else ""))


async def test_recovery_needs_only_its_protocol(state_dir):
    """Restart recovery over ``RecoveredPods`` alone (adopt, remove) and the parts it is
    handed: a kept pod is adopted and reconciled, one whose Pod object says it no longer
    qualifies is removed by UID with its record (live netns: ``is_delete=False``; netns
    gone: ``True``), one gone entirely is dropped without a removal call."""
    source = FakeSource(synced=True)
    r = Rig(state_dir, source=source)
    try:
        for uid, ip in [("uid-keep", "10.1.0.1"), ("uid-optout", "10.1.0.2"),
                        ("uid-optout-gone", "10.1.0.3"), ("uid-gone", "10.1.0.4")]:
            _write_record(state_dir, uid, f"/run/netns/{uid}", ip)
        for uid in ("uid-keep", "uid-optout"):
            r.netns.create(f"/run/netns/{uid}")
        source.pods = {"uid-keep": _pod("uid-keep", "keep")}
        for uid in ("uid-optout", "uid-optout-gone"):
            source.pods[uid] = _pod(uid, uid, labels={"istio.io/dataplane-mode": "none"})
        pods, counted = RecoveredPodsRecorder(), []
        recovery = Recovery(pods, dataplane=r.enrollment.dataplane, config=r.config,
                            store=lambda: source, pods_known=lambda: True,
                            events=r.enrollment.events,
                            netns_missing=lambda: counted.append(1))

        outcomes = await recovery.run()

        assert outcomes == {"uid-keep": "enabled", "uid-optout": "unenrolled",
                            "uid-optout-gone": "unenrolled", "uid-gone": "dropped"}
        assert pods.adopted == {"uid-keep": True}
        assert sorted(pods.removed) == [("uid-optout", False, "/run/netns/uid-optout"),
                                        ("uid-optout-gone", True, "/run/netns/uid-optout-gone")]
        assert counted == [] and r.zds.accepting
    finally:
        r.close()


class StatusWrites:
    """Replaces the dataplane's status write: records ``(value, ztunnel had acked)`` of
    each write as it starts; a write of a value in ``hold`` waits for that event; a
    write of a value in ``fail`` fails (returns False, as a refused PATCH does).
    ``in_flight_max``: the most writes of one pod in flight at once."""

    def __init__(self, rig):
        self.rig, self.writes, self.done = rig, [], []
        self.hold: dict[str | None, asyncio.Event] = {}
        self.fail: set[str | None] = set()
        self.in_flight = self.in_flight_max = 0
        self.rules_in: list[bool] = []  # whether the in-pod rules were in at each write
        rig.enrollment.dataplane.set_status = self  # type: ignore[method-assign]

    async def __call__(self, rec, value):
        self.writes.append((value, rec.steps.get(Step.ZDS) is True))
        self.rules_in.append(rec.steps.get(Step.RULES) is True)
        self.in_flight += 1
        self.in_flight_max = max(self.in_flight_max, self.in_flight)
        try:
            if value in self.hold:
                await self.hold[value].wait()
        finally:
            self.in_flight -= 1
        if value in self.fail:
            return False
        self.done.append(value)
        return True


async def test_status_is_written_while_ztunnel_acks(rig):
    """A CNI ADD writes the record and the ``enabled`` status while ztunnel's ACK is
    awaited; the pod is reported enabled only once the ACK came too."""
    writes = StatusWrites(rig)
    rig.zds.hold = asyncio.Event()
    add = asyncio.create_task(rig.enrollment.enroll(event()))
    await asyncio.wait_for(rig.zds.adding.wait(), 5)
    await until(lambda: writes.done == ["enabled"])
    assert writes.writes == [("enabled", False)]  # before the ACK
    assert rig.enrollment.pods()[UID].status is not PodState.ENABLED
    assert not add.done()
    rig.zds.hold.set()
    await add
    assert rig.enrollment.pods()[UID].status is PodState.ENABLED
    assert writes.writes == [("enabled", False)]


async def test_status_written_beside_a_failed_ack_becomes_pending_after_it(rig):
    """ztunnel refusing the pod while ``enabled`` is being written: ``pending`` is
    written only once that write is done (never both in flight), the ADD fails
    retryably, and the background retry writes ``enabled`` again once ztunnel takes it."""
    writes = StatusWrites(rig)
    writes.hold["enabled"] = asyncio.Event()
    rig.zds.nack = "no"
    add = asyncio.create_task(rig.enrollment.enroll(event()))
    await until(lambda: writes.writes == [("enabled", False)])
    await until(lambda: rig.enrollment.pods()[UID].steps.get(Step.ZDS) is False)
    await asyncio.sleep(0.05)  # the NACK is in: nothing else may be written meanwhile
    assert writes.writes == [("enabled", False)] and not add.done()
    rig.zds.nack = None
    writes.hold["enabled"].set()
    with pytest.raises(EnrollmentError, match="ztunnel did not accept") as err:
        await add
    assert err.value.retryable
    assert writes.done[:2] == ["enabled", "pending"]
    await until(lambda: rig.enrollment.pods()[UID].status is PodState.ENABLED)
    assert writes.done[-1] == "enabled"


async def test_status_written_beside_the_hand_off_is_removed_when_zds_cannot_take_the_pod(rig):
    """A pod ZDS can't describe fails for good; the ``enabled`` written beside the
    hand-off is removed again."""
    writes = StatusWrites(rig)

    async def refuse(pod, wait_ack=True, ztunnel_wait=None):
        await asyncio.sleep(0.02)
        raise ValueError("too large")
    rig.zds.add = refuse  # type: ignore[method-assign]
    with pytest.raises(EnrollmentError, match="cannot be handed to ztunnel"):
        await rig.enrollment.enroll(event())
    assert writes.done == ["enabled", None]


async def test_status_written_beside_the_hand_off_is_removed_by_a_del_during_the_add(rig):
    """A CNI DEL cancelling the ADD while ztunnel's ACK is awaited: the rollback
    removes the ``enabled`` written meanwhile, after that write finished."""
    writes = StatusWrites(rig)
    rig.zds.hold = asyncio.Event()
    add = asyncio.create_task(rig.enrollment.enroll(event()))
    await until(lambda: writes.done == ["enabled"])
    task = rig.enrollment.abort_enroll(UID)
    assert task is not None
    with pytest.raises(EnrollmentError, match="pod deleted during enrollment"):
        await add
    assert writes.done[-1] is None
    assert UID not in rig.enrollment.pods()


def _held_rules(rig) -> threading.Event:
    """Make the next in-pod rules apply wait (on its worker thread) for the event returned."""
    release = threading.Event()
    rig.netns.applying.clear()
    rig.netns.hold = release
    return release


async def test_status_and_record_are_written_while_the_rules_are_applied(rig, state_dir):
    """A CNI ADD starts the record and the ``enabled`` status beside the in-pod rules
    (the runtime runs none of the pod's containers before the ADD is answered); the ADD
    is answered only once the rules, the ACK and the write are all done."""
    writes = StatusWrites(rig)
    release = _held_rules(rig)
    add = asyncio.create_task(rig.enrollment.enroll(event()))
    try:
        await until(lambda: rig.netns.applying.is_set() and writes.done == ["enabled"])
        assert (state_dir / "pods" / f"{UID}.json").exists()  # the record came first
        assert writes.rules_in == [False]  # written while the rules were being applied
        assert rig.zds.adds == [] and not add.done()
    finally:
        release.set()
    await add
    assert rig.enrollment.pods()[UID].status is PodState.ENABLED
    assert writes.writes == [("enabled", False)] and writes.in_flight_max == 1


async def test_a_live_enrollment_writes_the_status_only_after_the_rules(rig):
    """A running pod the watch enrolls (``live=True``) keeps the status after its rules
    (its traffic flows meanwhile: peers must not see ``enabled`` before it is
    redirected); it is still written while ztunnel's ACK is awaited."""
    writes = StatusWrites(rig)
    release = _held_rules(rig)
    rig.zds.hold = asyncio.Event()
    add = asyncio.create_task(rig.enrollment.enroll(event(), live=True))
    try:
        await until(rig.netns.applying.is_set)
        await asyncio.sleep(0.05)
        assert writes.writes == []
    finally:
        release.set()
    await until(lambda: writes.done == ["enabled"])
    assert writes.rules_in == [True] and writes.writes == [("enabled", False)]
    rig.zds.hold.set()
    await add
    assert rig.enrollment.pods()[UID].status is PodState.ENABLED


async def test_rules_failing_after_the_status_was_written_remove_it_and_the_record(
        rig, state_dir):
    """The rules fail once ``enabled`` and the record are written beside them: the
    rules are rolled back, the annotation removed, the record deleted, the ADD fails
    for good (as a rules failure does), and ztunnel never heard of the pod."""
    writes = StatusWrites(rig)
    release = _held_rules(rig)
    add = asyncio.create_task(rig.enrollment.enroll(event()))
    try:
        await until(lambda: writes.done == ["enabled"])
        assert (state_dir / "pods" / f"{UID}.json").exists()
        rig.netns.apply_error = RulesError("iptables-restore: line 3 failed")
    finally:
        release.set()
    with pytest.raises(EnrollmentError) as err:
        await add
    assert not err.value.retryable
    assert "in-pod rules failed (rolled back): iptables-restore: line 3 failed" in str(err.value)
    assert writes.done == ["enabled", None] and writes.in_flight_max == 1
    assert not (state_dir / "pods" / f"{UID}.json").exists()
    assert rig.netns.rules_at(NETNS) is None
    rec = rig.enrollment.pods()[UID]
    assert rec.status is PodState.FAILED and rec.error.startswith("rules: ")
    assert rec.steps[Step.STATUS] is False and rec.steps[Step.STATE] is False
    assert rig.zds.adds == [] and rig.probes.entries == {}
    assert UID not in rig.enrollment.retries


async def test_rules_failing_while_the_status_is_being_written_remove_it_after_the_write(
        rig, state_dir):
    """The rules fail while the ``enabled`` PATCH is still in flight: the removal waits
    for that write (never two writes of one pod in flight), then the ADD fails."""
    writes = StatusWrites(rig)
    writes.hold["enabled"] = asyncio.Event()
    rig.netns.apply_error = RulesError("restore failed")
    add = asyncio.create_task(rig.enrollment.enroll(event()))
    await until(lambda: rig.netns.rules_at(NETNS) is None and rig.netns.deleted)
    await asyncio.sleep(0.05)  # rolled back: nothing else may be written meanwhile
    assert writes.writes == [("enabled", False)] and not add.done()
    writes.hold["enabled"].set()
    with pytest.raises(EnrollmentError, match=r"in-pod rules failed \(rolled back\)"):
        await add
    assert writes.done == ["enabled", None] and writes.in_flight_max == 1
    assert not (state_dir / "pods" / f"{UID}.json").exists()


class RefusingAnnotator:
    """A :class:`cni.annotate.PodAnnotator` holding the annotation per pod; a write of a
    value in ``refuse`` fails with a 503 (the API server unavailable)."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, str], str | None] = {}
        self.refuse: set[str | None] = set()

    async def patch_pod_annotations(self, namespace, name, annotations):
        value = annotations[annotate.REDIRECTION_ANNOTATION]
        if value in self.refuse:
            error = RuntimeError("service unavailable")
            error.status = 503  # type: ignore[attr-defined]
            raise error
        self.values[namespace, name] = value
        return {}

    def current(self, ref) -> str | None:
        return self.values.get((ref.namespace, ref.name))


async def test_rules_failure_whose_status_removal_fails_says_so_and_retries_it(rig):
    """The removal of an ``enabled`` written beside failed rules fails: the ADD's error
    says so, and the removal is retried in the background until written."""
    api = RefusingAnnotator()
    status = annotate.RedirectionStatus(lambda: api, api.current)
    status.retries.initial = 0.01
    rig.enrollment.dataplane.status = status
    api.refuse.add(None)
    rig.netns.apply_error = RulesError("restore failed")
    try:
        with pytest.raises(EnrollmentError, match=r"rollback incomplete: status annotation: "
                                                  r"not removed yet \(retried in the "
                                                  r"background\)"):
            await rig.enrollment.enroll(event())
        assert api.values == {("shop", "web"): "enabled"}
        assert status.pending_retries() == {UID: "retrying"}
        api.refuse.clear()
        await until(lambda: api.values == {("shop", "web"): None})
        await until(lambda: status.pending_retries() == {})
    finally:
        await status.close()


async def test_loopback_down_with_the_status_written_removes_it(rig, state_dir):
    """``lo`` down (nothing applied) once the record and ``enabled`` were written beside
    the rules: both are undone and the ADD fails, saying nothing was applied."""
    writes = StatusWrites(rig)
    release = _held_rules(rig)
    add = asyncio.create_task(rig.enrollment.enroll(event()))
    try:
        await until(lambda: writes.done == ["enabled"])
        rig.netns.apply_error = LoopbackDown("loopback interface 'lo' in the pod netns is down")
    finally:
        release.set()
    with pytest.raises(EnrollmentError, match="is down; nothing was applied$"):
        await add
    assert writes.done == ["enabled", None]
    assert not (state_dir / "pods" / f"{UID}.json").exists()
    assert rig.netns.deleted == []


async def test_status_write_failing_while_the_rules_succeed_fails_the_add_retryably(rig):
    """The ``enabled`` PATCH beside the rules fails (an API error) while the rules and
    ztunnel succeed: the ADD fails retryably, as upstream fails it when the annotation
    can't be written; the rules stay (fail closed), the pod stays with ztunnel, pending,
    and the retry writes the status."""
    writes = StatusWrites(rig)
    writes.fail.add("enabled")
    with pytest.raises(EnrollmentError, match="could not write status annotation; will "
                                              "retry") as err:
        await rig.enrollment.enroll(event())
    assert err.value.retryable
    rec = rig.enrollment.pods()[UID]
    assert rec.status is PodState.PENDING and rec.steps[Step.STATUS] is False
    assert rec.steps[Step.RULES] and rec.steps[Step.ZDS]
    assert rig.netns.rules_at(NETNS) is not None and UID in rig.zds.pods
    writes.fail.clear()
    await until(lambda: rig.enrollment.pods()[UID].status is PodState.ENABLED)
    assert writes.done == ["enabled"] and writes.in_flight_max == 1


async def test_del_while_the_rules_and_the_status_are_in_flight_undoes_both(rig, state_dir):
    """A CNI DEL cancelling the ADD while its rules are applied and its ``enabled`` PATCH
    is in flight: the rollback waits for both, then removes the rules, the annotation
    and the record."""
    writes = StatusWrites(rig)
    writes.hold["enabled"] = asyncio.Event()
    release = _held_rules(rig)
    add = asyncio.create_task(rig.enrollment.enroll(event()))
    await until(lambda: rig.netns.applying.is_set() and writes.writes)
    task = rig.enrollment.abort_enroll(UID)
    assert task is not None
    release.set()
    await asyncio.sleep(0.05)
    assert not add.done() and writes.writes == [("enabled", False)]  # waits for the write
    writes.hold["enabled"].set()
    with pytest.raises(EnrollmentError, match="pod deleted during enrollment"):
        await add
    assert writes.done == ["enabled", None] and writes.in_flight_max == 1
    assert rig.netns.rules_at(NETNS) is None
    assert not (state_dir / "pods" / f"{UID}.json").exists()
    assert UID not in rig.enrollment.pods()
