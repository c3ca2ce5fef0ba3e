"""Running pods follow their enablement live: labels in, enrolled; labels out, removed.

Upstream's informer handlers (``istio/istio:cni/pkg/nodeagent/informers.go``,
``docs/enrollment.md``): on a Namespace whose ambient selection changed, every pod of that
namespace is
re-checked; on a Pod update the pod is; a pod of this node that should be ambient
(``cni.enablement.pod_matches`` plus the excluded namespaces) but is not enrolled is
added to the mesh with its netns found through ``/proc`` (``NetServer.getNetns`` ->
``rescanPod``: the netns of a process whose cgroup names the pod UID and that holds the
pod IP, :func:`cni.podnetns.scan`); an enrolled pod that should no longer be is removed
with ``is_delete=False`` (it keeps running, so its in-pod rules must go). The same
happens once at start for every pod of this node (upstream enqueues every namespace
when its informer syncs), so a namespace labelled while the agent was down, or a pod
that came up while no agent could enroll it, is enrolled as soon as the agent runs.

An enrolled pod whose phase becomes Succeeded or Failed is removed from ztunnel at once
with ``is_delete=True`` (upstream: "job pod that we captured and just terminated").

An enrolled pod whose Pod object is deleted is removed the same way (upstream's
informer: a Pod delete is ``RemovePodFromMesh(pod, isDelete=true)``), so a pod whose
CNI DEL never came does not stay ``enabled`` with a proxy in ztunnel.

What is not done here, as upstream: a pod whose process can't be found (not running
yet, or not on this node) is left to its CNI ADD, which enrolls it when its sandbox is
created; terminal pods (phase Succeeded or
Failed), host-network pods and ztunnel's own pods are never enrolled here.

Our addition: a pod whose CNI ADD the agent answered "not ambient" is remembered with
its netns and IPs (``Enrollment.note_sandbox``), so a podman-style pod, whose Pod object
usually carries no IP and whose processes sit in a ``libpod-<container id>`` cgroup
rather than a kubelet one, is found without a scan.

The store calls :meth:`LivePods.on_events` on the event loop inside its transaction;
it only records which pods to look at and schedules one reconcile task, which batches
every pod that became ambient into a single ``/proc`` scan (off the loop).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from typing import Awaitable, Callable, Iterable, Mapping, Protocol, Sequence

from agent.core.retryqueue import RetryQueue

from cni import enablement
from cni.enablement import TERMINAL_PHASES, on_this_node
from cni import podnetns
from cni.enrollment.dataplane import RunBlocking
from cni.enrollment.records import PodRecord
from cni.events import CniPodEvent, EnrollmentError
from cni.podips import pod_status_ips as pod_ips
from cni.sourceapi import PodStore, StoreChange

log = logging.getLogger(__name__)

BACKOFF_INITIAL, BACKOFF_MAX = 0.2, 30.0  # of live work the queue retries (seconds)


class LiveEnrollment(Protocol):
    """What the watch asks of enrollment (:class:`cni.enrollment.reconciler.Enrollment`
    has it): the enrolled pods' records by UID (read only), enroll a pod found running
    (an ADD-shaped event with the netns found, ``live=True``), remove pod ``uid`` (as a CNI DEL does with
    ``is_delete``), whether an enrollment of ``uid`` runs now, the sandbox a "not
    ambient" CNI ADD reported for ``uid`` (``(netns path, ips)``), and a known pod's
    current IPs (the probe set follows them)."""

    @property
    def records(self) -> Mapping[str, PodRecord]: ...

    async def enroll(self, event: CniPodEvent, *, live: bool = False) -> None: ...

    async def remove(self, uid: str, *, is_delete: bool) -> None: ...

    def enrolling(self, uid: str) -> bool: ...

    def sandbox(self, key: str) -> tuple[str, list[str]] | None: ...

    def pod_ips_seen(self, uid: str, ips: list[str]) -> None: ...


class LivePods:
    """Reconciles running pods of this node with their enablement, for ``enrollment``
    (:class:`LiveEnrollment`).

    ``store`` is the config source's store (:class:`cni.sourceapi.PodStore`);
    ``host_netns`` the node netns's ``(st_ino, st_dev)`` (skipped by ``/proc`` scans);
    ``run_blocking`` the agent's executor; ``observe(old, new)`` is told of every Pod
    and Namespace change (the enrollment's metrics); ``node_name`` this node;
    ``files_source`` True when Pod objects come from the directory source (a Pod there
    may have no ``spec.nodeName``: it is then taken as a pod of this node, if a process
    of it runs here).
    """

    def __init__(self, enrollment: LiveEnrollment, store: PodStore, *,
                 host_netns: tuple[int, int], run_blocking: RunBlocking,
                 observe: Callable[[object, object], None], node_name: str,
                 exclude_namespaces: Iterable[str], system_namespace: str,
                 proc_dir: str, files_source: bool):
        self.enrollment = enrollment
        self.store = store
        self.host_netns = host_netns
        self.run_blocking = run_blocking
        self.observe = observe
        self.node_name = node_name
        self.exclude = set(exclude_namespaces or ())
        self.system_namespace = system_namespace
        self.proc_dir = proc_dir
        self.files_source = files_source
        self._dirty: set[str] = set()
        self._deleted: set[str] = set()  # uids whose Pod object the store deleted
        self._task: asyncio.Task | None = None
        self._unsubscribe: Callable[[], None] | None = None
        # live (un)enrollments run through one keyed queue (at most one per pod at a
        # time): uid -> ("join" | "leave", the work; True when done)
        self._work: dict[str, tuple[str, Callable[[], Awaitable[bool]]]] = {}
        self.queue = RetryQueue(self._run_work, initial=BACKOFF_INITIAL, maximum=BACKOFF_MAX,
                                name="live-pods")
        self.stats = {"enrolled_live": 0, "removed_live": 0, "removed_terminal": 0,
                      "removed_deleted": 0,
                      "not_found": 0, "scans": 0}

    # --- lifecycle ---

    def start(self) -> None:
        """Subscribe to the store and look at every pod once (upstream's initial sync)."""
        self._unsubscribe = self.store.subscribe(self.on_events)
        try:
            self._dirty |= {uid for uid in (_uid(p) for p in self.store.list("Pod")) if uid}
        except Exception as e:  # noqa: BLE001 - a broken store must not stop the agent
            log.warning("config source pod list failed: %s", e)
        self._schedule()

    async def stop(self, grace: float) -> None:
        """Stop following the store; let removals and enrollments in flight finish
        (a half-done one would leave a pod half in the mesh) for up to ``grace`` s."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=grace)
            self._task = None
        await self.queue.drain(grace)
        self._work.clear()

    def busy(self) -> bool:
        """True while a live enrollment or removal (or a pending look) is in progress."""
        return bool(self._dirty or self._work
                    or (self._task is not None and not self._task.done()))

    # --- change feed ---

    def on_events(self, events: Sequence[StoreChange]) -> None:
        """Store listener: note the pods a Pod or Namespace change touches. A Pod
        delete of an enrolled pod removes it from ztunnel; a Namespace counts only when
        its labels changed (or it appeared or went away)."""
        for ev in events:
            if ev.kind in ("Pod", "Namespace"):
                self.observe(ev.old, ev.new)
            if ev.kind == "Pod":
                uid = _uid(ev.new) if ev.new is not None else ""
                if uid:
                    self._dirty.add(uid)
                    self._deleted.discard(uid)
                elif _uid(ev.old) in self.enrollment.records:
                    self._deleted.add(_uid(ev.old))
                    self._dirty.add(_uid(ev.old))
            elif ev.kind == "Namespace" and _labels(ev.old) != _labels(ev.new):
                try:
                    pods = self.store.list("Pod", ev.name)
                except Exception as e:  # noqa: BLE001
                    log.warning("config source pod list of namespace %s failed: %s", ev.name, e)
                    continue
                self._dirty |= {uid for uid in (_uid(p) for p in pods) if uid}
                # enrolled pods whose Pod object is gone still follow their namespace
                self._dirty |= {u for u, r in self.enrollment.records.items()
                                if r.namespace == ev.name}
        if self._dirty:
            self._schedule()

    def _schedule(self) -> None:
        if self._dirty and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._reconcile(),
                                                                name="livepods-reconcile")

    # --- decisions ---

    def should_be_ambient(self, pod: dict) -> bool | None:
        """The enablement decision for a Pod object as the CNI ADD would make it now;
        None when it can't be made (malformed selector or object): then nothing changes."""
        try:
            return enablement.object_is_ambient(pod, self.store, self.exclude)
        except Exception as e:  # noqa: BLE001 - a bad object must not break the watcher
            meta = pod.get("metadata") or {}
            log.warning("pod %s/%s: cannot re-check enablement: %s", meta.get("namespace"),
                        meta.get("name"), e)
            return None

    def _candidate(self, pod: dict) -> str:
        """Why a pod that should be ambient is not enrolled live, or "" when it is one."""
        meta = pod.get("metadata") or {}
        if not on_this_node(pod, self.node_name, self.files_source):
            node = (pod.get("spec") or {}).get("nodeName")
            return f"runs on node {node!r}" if node else "not scheduled"
        if _phase(pod) in TERMINAL_PHASES:
            return "terminal"
        if (meta.get("namespace") == self.system_namespace
                and (meta.get("labels") or {}).get("app") == "ztunnel"):
            return "a ztunnel pod"
        if not pod_ips(pod) and self.enrollment.sandbox(_uid(pod)) is None:
            return "no pod IP yet"
        return ""

    # --- reconcile ---

    async def _reconcile(self) -> None:
        """Drain the dirty set: removals first (they are cheap), then one ``/proc`` scan
        for every pod that should join, then their enrollments, concurrently."""
        while self._dirty:
            uids, self._dirty = self._dirty, set()
            join: dict[str, dict] = {}
            for uid in uids:
                try:
                    self._look_at(uid, join)
                except Exception:  # noqa: BLE001 - one bad pod must not stop the others
                    log.exception("live reconcile of pod %s failed", uid)
            if join:
                await self._join(join)

    def _look_at(self, uid: str, join: dict[str, dict]) -> None:
        records = self.enrollment.records
        pod = self.store.pod_by_uid(uid)
        if pod is None:
            rec = records.get(uid)
            if rec is not None and uid in self._deleted:
                self._deleted.discard(uid)
                self._leave(uid, "Pod object deleted", terminal=True, stat="removed_deleted")
                return
            self._deleted.discard(uid)
            # an enrolled pod without a Pod object: only its namespace can say no
            if rec is not None and rec.namespace in self.exclude:
                self._leave(uid, f"namespace {rec.namespace} is excluded")
            return
        if uid in records:
            phase = _phase(pod)
            if phase in TERMINAL_PHASES:
                self._leave(uid, f"pod phase is {phase}", terminal=True)
            elif self.should_be_ambient(pod) is False:
                self._leave(uid, "no longer ambient")
            else:
                self.enrollment.pod_ips_seen(uid, pod_ips(pod))
            return
        if not on_this_node(pod, self.node_name, self.files_source):
            return  # most pods of a cluster: skipped before any decision
        if (self.should_be_ambient(pod) is not True or self._doing(uid) == "join"
                or self.enrollment.enrolling(uid)):
            return
        why_not = self._candidate(pod)
        if why_not:
            meta = pod.get("metadata") or {}
            log.debug("pod %s/%s is ambient but not enrolled live: %s", meta.get("namespace"),
                      meta.get("name"), why_not)
            return
        join[uid] = pod

    def _doing(self, uid: str) -> str:
        """``"join"`` or ``"leave"`` while such work for pod ``uid`` is queued or runs."""
        work = self._work.get(uid)
        return work[0] if work is not None and uid in self.queue else ""

    def _queue_work(self, uid: str, kind: str, work: Callable[[], Awaitable[bool]]) -> None:
        """Run ``work`` for pod ``uid`` now through the queue, replacing (and cancelling)
        other work of that pod queued or in flight."""
        self.queue.forget(uid)
        self._work[uid] = (kind, work)
        self.queue.add(uid, now=True)

    async def _run_work(self, uid: str) -> bool:
        """The queue's ``process``: the pod's queued work; True when done."""
        entry = self._work.get(uid)
        if entry is None:
            return True
        done = await entry[1]()
        if done and self._work.get(uid) is entry:
            del self._work[uid]
        return done

    def _leave(self, uid: str, why: str, terminal: bool = False,
               stat: str = "removed_terminal") -> None:
        if self._doing(uid) == "leave":
            return
        if terminal:
            self._queue_work(uid, "leave", lambda: self._terminated(uid, why, stat))
        else:
            self._queue_work(uid, "leave", lambda: self._leave_mesh(uid, why))

    async def _leave_mesh(self, uid: str, why: str) -> bool:
        """Remove a running pod that is no longer ambient. Always True (done): a removal
        that failed part-way has forgotten the pod already, so there is nothing to retry."""
        rec = self.enrollment.records.get(uid)
        if rec is None:
            return True
        pod = self.store.pod_by_uid(uid)
        if pod is not None and self.should_be_ambient(pod) is not False:
            return True  # changed back meanwhile
        log.info("%s: %s; removing it from the mesh", rec.label(), why)
        try:
            await self.enrollment.remove(uid, is_delete=False)
            self.stats["removed_live"] += 1
        except EnrollmentError as e:
            log.warning("un-enrolling %s: %s", rec.label(), e)
        return True

    async def _terminated(self, uid: str, why: str, stat: str = "removed_terminal") -> bool:
        """An enrolled pod whose phase became Succeeded or Failed (a Job's pod), or whose
        Pod object was deleted: its processes are gone or going but the sandbox (and the
        CNI DEL) may come much later or never, so, as upstream's informer
        (``RemovePodFromMesh(oldPod, isDelete=true)``), it leaves ztunnel at once: probe
        entries (by owner, so also when the terminal status dropped its IPs), ZDS delete,
        annotation, record. In-pod rules stay with the netns, as on a CNI DEL.
        ``stat`` is the :attr:`stats` key counted."""
        rec = self.enrollment.records.get(uid)
        if rec is None:
            return True
        log.info("%s: %s; removing it from ztunnel", rec.label(), why)
        try:
            await self.enrollment.remove(uid, is_delete=True)
            self.stats[stat] += 1
        except EnrollmentError as e:
            log.warning("removing terminated %s: %s", rec.label(), e)
        return True  # as _leave_mesh: nothing left to retry

    async def _join(self, pods: dict[str, dict]) -> None:
        """Find the netns of ``pods`` and enroll those found: the sandbox its CNI ADD
        reported when the agent saw one (still there), else one ``/proc`` scan for all."""
        wanted: dict[str, list[str]] = {}
        paths: dict[str, str] = {}
        for uid, pod in pods.items():
            seen = self.enrollment.sandbox(uid)
            if seen is not None and os.path.exists(seen[0]):
                paths[uid], wanted[uid] = seen[0], pod_ips(pod) or seen[1]
            else:
                wanted[uid] = pod_ips(pod)
        host = self.host_netns
        missing = {uid: ips for uid, ips in wanted.items() if uid not in paths and ips}

        def scan() -> dict[str, str]:
            found = podnetns.scan(self.proc_dir, missing, host)
            for hit in found.values():
                os.close(hit.fd)  # enroll() reopens the path and checks it at the end
            return {uid: hit.path for uid, hit in found.items()}
        if missing:
            self.stats["scans"] += 1
            try:
                paths.update(await self.run_blocking(scan))
            except Exception as e:  # noqa: BLE001
                log.error("scanning %s for pod netns failed: %s", self.proc_dir, e)
        for uid, pod in pods.items():
            meta = pod.get("metadata") or {}
            if uid not in paths:
                self.stats["not_found"] += 1
                log.info("pod %s/%s (uid %s) is ambient but no process of it runs on this "
                         "node (or none holds its IP %s); it is enrolled at its CNI ADD",
                         meta.get("namespace"), meta.get("name"), uid, ", ".join(wanted[uid]))
                continue
            event = CniPodEvent(command="ADD", container_id=uid, netns=paths[uid],
                                pod_name=str(meta.get("name") or ""),
                                pod_namespace=str(meta.get("namespace") or ""), pod_uid=uid,
                                ips=wanted[uid])
            self._queue_work(uid, "join", functools.partial(self._enroll, event))

    async def _enroll(self, event: CniPodEvent) -> bool:
        """Enroll a running pod. Always True (done): a retryable failure is retried by the
        enrollment itself, a rules failure is final for the pod, as upstream."""
        label = f"{event.pod_namespace}/{event.pod_name} (uid {event.pod_uid})"
        log.info("%s: running pod is now ambient; enrolling it (netns %s)", label, event.netns)
        try:
            await self.enrollment.enroll(event, live=True)
            self.stats["enrolled_live"] += 1
            log.info("%s: enrolled live", label)
        except EnrollmentError as e:
            # retryable failures (ztunnel, probe set, annotation) are retried by the
            # enrollment itself; rule failures are final for this pod, as upstream
            log.warning("live enrollment of %s: %s", label, e)
        return True


def _phase(pod: dict) -> str:
    status = pod.get("status")
    return str(status.get("phase") or "") if isinstance(status, dict) else ""


def _uid(obj: dict | None) -> str:
    uid = ((obj or {}).get("metadata") or {}).get("uid")
    return uid if isinstance(uid, str) else ""


def _labels(obj: dict | None) -> dict:
    return ((obj or {}).get("metadata") or {}).get("labels") or {}
