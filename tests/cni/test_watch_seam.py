"""The running-pods watch (``cni.enrollment.watch.LivePods``) against its own protocol,
``LiveEnrollment``, implemented here by a recorder: no ``Enrollment``, no root. A pod
that stops being ambient is removed by UID with ``is_delete=False``, a deleted or
terminated one with ``is_delete=True``; no CNI event is made up for a removal, and a
newer decision for a pod replaces the older in the watch's keyed queue."""

from __future__ import annotations

import asyncio

from cni.enrollment.records import PodRecord
from cni.enrollment.watch import LivePods
from cni.events import CniPodEvent
from tests.cni.enrollment_fakes import FakeSource
from tests.helpers import eventually


class Recorder:
    """A ``LiveEnrollment``: records by UID and every call made on it."""

    def __init__(self) -> None:
        self.records: dict[str, PodRecord] = {}
        self.calls: list[tuple] = []
        self.remove_gate: asyncio.Event | None = None

    async def enroll(self, event: CniPodEvent, *, live: bool = False) -> None:
        self.calls.append(("enroll", event.key, event.netns, live))

    async def remove(self, uid: str, *, is_delete: bool) -> None:
        if self.remove_gate is not None:
            await self.remove_gate.wait()
        self.calls.append(("remove", uid, is_delete))
        self.records.pop(uid, None)

    def enrolling(self, uid: str) -> bool:
        return False

    def sandbox(self, key: str) -> tuple[str, list[str]] | None:
        return None

    def pod_ips_seen(self, uid: str, ips: list[str]) -> None:
        self.calls.append(("ips", uid, tuple(ips)))


def pod(uid: str, mode: str | None = "ambient", phase: str = "Running") -> dict:
    labels = {"istio.io/dataplane-mode": mode} if mode else {}
    return {"kind": "Pod", "metadata": {"uid": uid, "name": "web-" + uid, "namespace": "shop",
                                        "labels": labels},
            "spec": {"nodeName": "node-1"},
            "status": {"phase": phase, "podIPs": [{"ip": "10.1.0.9"}]}}


async def start(source: FakeSource, rec: Recorder) -> LivePods:
    async def run_blocking(fn, *args):
        return fn(*args)
    live = LivePods(rec, source.store, host_netns=(1, 1), run_blocking=run_blocking,
                    observe=lambda old, new: None, node_name="node-1", exclude_namespaces=(),
                    system_namespace="istio-system", proc_dir="/nonexistent-proc",
                    files_source=False)
    live.start()
    await eventually(lambda: not live.busy())
    return live


async def test_removals_go_by_uid_with_the_right_is_delete():
    source, rec = FakeSource(), Recorder()
    for uid in ("a", "b", "c"):
        source.pods[uid] = pod(uid)
        rec.records[uid] = PodRecord(uid=uid, name="web-" + uid, namespace="shop",
                                     ips=["10.1.0.9"])
    live = await start(source, rec)
    try:
        assert ("ips", "a", ("10.1.0.9",)) in rec.calls  # known pods: IPs followed only
        rec.calls.clear()
        source.update(pod("a", mode="none"))  # labelled out: leaves, keeps running
        source.delete("b")  # Pod object deleted
        source.update(pod("c", phase="Succeeded"))  # a Job's pod finished
        await eventually(lambda: not live.busy() and len(rec.calls) == 3)
        assert sorted(rec.calls) == [("remove", "a", False), ("remove", "b", True),
                                     ("remove", "c", True)]
        assert live.stats["removed_live"] == 1 and live.stats["removed_deleted"] == 1
        assert live.stats["removed_terminal"] == 1 and rec.records == {}
    finally:
        await live.stop(1.0)


async def test_one_removal_per_pod_at_a_time_and_stop_lets_it_finish():
    source, rec = FakeSource(), Recorder()
    source.pods["a"] = pod("a")
    rec.records["a"] = PodRecord(uid="a", name="web-a", namespace="shop", ips=["10.1.0.9"])
    live = await start(source, rec)
    rec.remove_gate = asyncio.Event()
    source.update(pod("a", mode="none"))
    await eventually(lambda: "a" in live.queue)
    source.update(pod("a", mode="none"))  # a second change while the removal waits
    await eventually(lambda: not live._dirty)
    assert list(live.queue.pending()) == ["a"]  # still the one removal
    stopping = asyncio.ensure_future(live.stop(5.0))
    await asyncio.sleep(0)
    assert not stopping.done()  # stop waits for the removal in flight
    rec.remove_gate.set()
    await stopping
    assert rec.calls[-1] == ("remove", "a", False)
    assert [c for c in rec.calls if c[0] == "remove"] == [("remove", "a", False)]
