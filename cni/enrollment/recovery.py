"""Restart recovery: re-adopt the pods enrolled before the agent restarted.

Upstream's ``Server.Start`` (``cni/pkg/nodeagent/server.go``) builds the initial snapshot
(every live enrolled pod, with its netns when found, ``ConstructInitialSnapshot`` in
``net.go``) *before* the ztunnel server runs, so the first snapshot a ztunnel gets names
every pod; ztunnel shuts every proxy not named before ``SnapshotSent``. Then the
informer's first events re-decide each pod. Here both happen in :meth:`Recovery.run`:
phase 1 decides and records, opens ZDS accepts; phase 2 does the slow per-pod work.

Each record is re-decided against its current Pod object as a fresh ADD would be
(:meth:`Recovery.verdict`): dropped when its netns and Pod object are both gone,
un-enrolled when it no longer qualifies. A kept pod whose netns can't be found is
reported (``netns-missing``) and retried, and it is still announced to ZDS without a
netns (``Keep``) so ztunnel doesn't drop it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Awaitable, Callable, Protocol

from agent.core.config import Config
from cni import annotate, enablement
from cni.enrollment.api import HostNetnsRefused, ZdsPod, ZdsRejected, ZtunnelUnavailable
from cni.enrollment.dataplane import RECOVER, Dataplane, pod_ref
from cni.enrollment.records import PodRecord, PodState, Step
from cni.events import CniPodEvent, EnrollmentError
from cni.kubeevents import REASON_NETNS_MISSING, PodEvents
from cni.podips import pod_status_ips
from cni.rules_common import RulesError
from cni.sourceapi import PodStore

log = logging.getLogger(__name__)

# verdicts of :meth:`Recovery.verdict`
KEEP, DROP, UNENROLL, UNENROLL_DELETED = "keep", "drop", "unenroll", "unenroll-deleted"


class RecoveredPods(Protocol):
    """What recovery asks of the enrollment it recovers for
    (:class:`cni.enrollment.reconciler.Enrollment` has it): take a recovered record
    (``adopt``: under the pod's lock the record becomes the pod's, ``reconcile(rec)`` runs
    and, when it returns False, the pod is queued for retry; returns the record's status
    afterwards) and remove a pod that no longer qualifies (``remove``: as a CNI DEL
    would with ``is_delete``, ``known`` its record)."""

    async def adopt(self, rec: PodRecord,
                    reconcile: Callable[[PodRecord], Awaitable[bool]]) -> str: ...

    async def remove(self, uid: str, *, is_delete: bool,
                     known: PodRecord | None = None) -> None: ...


class Recovery:
    """Restart recovery over ``pods`` (:class:`RecoveredPods`) and the parts it runs the
    pipeline with: ``dataplane`` (netns operations, ZDS channel, probe set, state dir,
    status writer, executor), ``config`` (``node_name``, ``config_source``,
    ``exclude_namespaces``, ``proc_dir``), ``store()`` (the config source's store or
    None), ``pods_known()`` (True once the source holds its full set of Pod objects),
    ``events`` (Kubernetes Events) and ``netns_missing`` (called once per pod counted in
    ``ambient_agent_recovery_netns_missing_total``)."""

    def __init__(self, pods: RecoveredPods, *, dataplane: Dataplane, config: Config,
                 store: Callable[[], PodStore | None], pods_known: Callable[[], bool],
                 events: PodEvents, netns_missing: Callable[[], None]):
        self.pods = pods
        self.dataplane = dataplane
        self.config = config
        self.store = store
        self.pods_known = pods_known
        self.events = events
        self.netns_missing = netns_missing

    async def run(self) -> dict[str, str]:
        """Re-adopt pods enrolled before a restart. Returns ``{uid: outcome}``:
        ``enabled``, ``netns-missing``, ``failed``/``pending`` (a step failed; retried),
        ``dropped`` (netns and Pod object both gone, or the recorded netns is the node's
        own, a hostNetwork pod's: forgotten, never announced, so ztunnel drains its
        proxy; no rules touched) or ``unenrolled`` (no longer qualifies).

        1. Candidates: persisted records and (Kubernetes mode) pods of this node annotated
           ``enabled``; each netns is looked up (recorded path if it still holds the pod
           IP, else a ``/proc`` scan).
        2. Each is re-decided against its current Pod object as a fresh ADD would be.
        3. Every kept pod is recorded in ZDS (``AddWorkload`` with its netns, ``Keep``
           without), then ZDS accepts are opened.
        4. Then, per kept pod: rules reconciled, probe set, status; pods that no longer
           qualify are un-enrolled; the probe set is reconciled against the kept pods.
        """
        d = self.dataplane
        refused: dict[str, str] = {}
        try:
            candidates = self.candidates()
            fds = await self._open_netns(candidates, refused) if candidates else {}
            try:
                verdicts = {uid: self.verdict(rec, uid in fds)
                            for uid, rec in candidates.items()}
                kept = [candidates[u] for u, (v, _) in verdicts.items() if v == KEEP]
                await self._announce(kept, fds)
            except BaseException:
                for fd in fds.values():
                    d.netns.close(fd)
                raise
        finally:
            if d.zds is not None:
                d.zds.open_accept()
        if not candidates:
            await self._reconcile_probe_set({})  # entries of pods gone while we were not
            return refused
        outcomes: dict[str, str] = dict(refused)
        try:
            kept_results = await asyncio.gather(*(self._recover_kept(rec, fds.pop(rec.uid, None))
                                                  for rec in kept))
        finally:
            for fd in fds.values():
                d.netns.close(fd)
        outcomes.update({rec.uid: s for rec, s in zip(kept, kept_results)})
        for uid, (verdict, why) in verdicts.items():
            if verdict != KEEP:
                outcomes[uid] = await self.leave(candidates[uid], verdict, why)
        # a pod whose netns is missing with its IPs known has no entries
        # (:meth:`_netns_missing`); one with IPs unknown keeps what it had
        await self._reconcile_probe_set({r.uid: r for r in kept
                                         if r.status != PodState.NETNS_MISSING
                                         or not self._recorded_gone(r)})
        counts: dict[str, int] = {}
        for s in outcomes.values():
            counts[s] = counts.get(s, 0) + 1
        log.info("restart recovery: %d pods (%s)", len(outcomes),
                 ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
        return outcomes

    async def _reconcile_probe_set(self, wanted: dict[str, PodRecord]) -> None:
        """Start of day: the probe sets in place against the pods we know
        (:meth:`HostProbeRules.sync`: known IPs upserted, entries owned by no known pod
        removed, never a flush). Logged, never fatal."""
        host_rules = self.dataplane.host_rules
        if host_rules is None:
            return
        try:
            pruned = await self.dataplane.run_blocking(
                host_rules.sync, {r.uid: r.ips for r in wanted.values()})
            if pruned:
                log.info("removed stale probe set entries: %s", ", ".join(pruned))
        except (RulesError, OSError, ValueError) as err:
            log.error("probe set reconcile at start: %s", err)

    def candidates(self) -> dict[str, PodRecord]:
        """Persisted records, plus pods of this node the config source says are enrolled."""
        wanted: dict[str, PodRecord] = {r.uid: r for r in self.dataplane.state.load()}
        for rec in self._enrolled_from_store():
            wanted.setdefault(rec.uid, rec)
        return wanted

    def _enrolled_from_store(self) -> list[PodRecord]:
        cfg = self.config
        store = self.store()
        if store is None or cfg.config_source != "kubernetes":
            return []
        out: list[PodRecord] = []
        try:
            pods = list(store.list("Pod"))
        except Exception as err:  # noqa: BLE001
            log.warning("config source pod list failed: %s", err)
            return out
        for pod in pods:
            meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
            annotations = meta.get("annotations") or {}
            if annotations.get(annotate.REDIRECTION_ANNOTATION) != "enabled" or not meta.get("uid"):
                continue
            if spec.get("nodeName") not in (None, "", cfg.node_name):
                continue
            out.append(PodRecord(uid=meta["uid"], name=meta.get("name", ""),
                                 namespace=meta.get("namespace", ""),
                                 service_account=spec.get("serviceAccountName") or "default",
                                 ips=pod_status_ips(pod), annotations=dict(annotations)))
        return out

    def _pod_objects_known(self) -> bool:
        """Whether the config source has its full set of Pod objects (first load / LIST
        done), so a missing Pod object means the pod is gone. No source: unknown."""
        try:
            return bool(self.pods_known())
        except Exception:  # noqa: BLE001 - an unreadable source knows nothing
            return False

    def verdict(self, rec: PodRecord, netns_alive: bool) -> tuple[str, str]:
        """Decide a recovered pod as a fresh CNI ADD would (``cni.enablement.decide``).
        Returns ``(verdict, reason)``: ``keep``; ``drop`` (no netns and no Pod object:
        the pod is gone); ``unenroll`` (the Pod object says it no longer qualifies:
        another node, terminal, host network, not ambient, excluded namespace; its
        in-pod rules are removed when its netns is alive); ``unenroll-deleted`` (the
        same, but its sandbox is gone or terminal: nothing to remove inside it).

        Only a Pod object with the record's UID is this pod's: a same-named pod with
        another UID is a new pod. Without a synced config source nothing is dropped."""
        cfg = self.config
        known = self._pod_objects_known()
        pod = None
        store = self.store()
        if store is not None:
            try:
                pod = store.pod_by_uid(rec.uid)
            except Exception as err:  # noqa: BLE001 - a broken store must not stop recovery
                log.warning("%s: config source lookup failed: %s", rec.label(), err)
                known = False
        if pod is None:
            if netns_alive:
                return KEEP, "netns alive, no Pod object (enrolled by the plugin config)"
            if known:
                return DROP, "netns gone and no Pod object"
            return KEEP, "netns not found; Pod objects not known yet (kept, retried)"
        meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
        gone = UNENROLL if netns_alive else UNENROLL_DELETED
        node = spec.get("nodeName")
        if node and node != cfg.node_name:
            return gone, f"its Pod object is on node {node}, not {cfg.node_name}"
        phase = (pod.get("status") or {}).get("phase")
        if phase in enablement.TERMINAL_PHASES:
            return UNENROLL_DELETED, f"pod is terminal (phase {phase})"
        event = CniPodEvent(command="ADD", container_id=rec.uid, netns=rec.netns,
                            pod_name=meta.get("name") or rec.name,
                            pod_namespace=meta.get("namespace") or rec.namespace,
                            pod_uid=rec.uid, ips=list(rec.ips))
        try:
            decision = enablement.decide(event, store, cfg.exclude_namespaces or (), pod=pod)
        except ValueError as err:  # a malformed selector: keep what was decided before
            log.warning("%s: cannot re-decide at restart: %s", rec.label(), err)
            return KEEP, f"cannot re-decide ({err})"
        if not decision.ambient:
            return gone, decision.reason
        return KEEP, decision.reason

    async def _open_netns(self, wanted: dict[str, PodRecord], refused: dict[str, str]
                          ) -> dict[str, int]:
        """``{uid: open netns fd}`` for the pods whose netns was found (caller closes);
        ``rec.netns`` is updated to where it was found. A pod whose netns is the node's
        own (:class:`HostNetnsRefused`: a hostNetwork pod's record) is taken out of
        ``wanted``, its record removed, ``refused[uid] = "dropped"``: neither
        reconciling nor un-enrolling may touch the host's rules."""
        found = await self.find_netns(wanted)
        fds: dict[str, int] = {}
        for uid, path in found.items():
            try:
                fds[uid] = self.dataplane.netns.open(path)
                wanted[uid].netns = path
            except HostNetnsRefused as err:
                rec = wanted.pop(uid)
                log.warning("%s: field 'netns': %s; record dropped, no rules touched",
                            rec.label(), err)
                self.dataplane.state.remove(uid)
                refused[uid] = "dropped"
            except OSError as err:
                log.warning("%s: netns %s: %s", wanted[uid].label(), path, err)
        return fds

    async def _announce(self, kept: list[PodRecord], fds: dict[str, int]) -> None:
        """Record every kept pod in ZDS before any ztunnel is accepted: ``AddWorkload``
        with its netns, ``Keep`` when its netns is not found (so ztunnel keeps a proxy
        it still runs)."""
        zds = self.dataplane.zds
        if zds is None:
            return
        for rec in kept:
            pod = ZdsPod(uid=rec.uid, name=rec.name, namespace=rec.namespace,
                         service_account=rec.service_account, netns_fd=fds.get(rec.uid))
            try:
                await zds.add(pod, wait_ack=False)
            except (ValueError, ZtunnelUnavailable, ZdsRejected) as err:
                log.error("%s: cannot record in ZDS at restart: %s", rec.label(), err)

    async def _recover_kept(self, rec: PodRecord, fd: int | None) -> str:
        """Phase 2 for a kept pod (already announced to ZDS): reconcile its rules, probe
        set, status; ``fd`` (closed here) is its netns, None when not found. Returns the
        record's status."""
        async def reconcile(rec: PodRecord) -> bool:
            if fd is None:
                if self._recorded_gone(rec):
                    await self._netns_missing(rec)
                else:  # no record of ours, or IPs unknown: the scan's "no" is weak
                    rec.fail(Step.NETNS, f"netns not found ({self.not_found_why(rec)})",
                             status=PodState.NETNS_MISSING)
                return False
            try:
                await self.dataplane.run(rec, fd, RECOVER)
                return True
            except EnrollmentError:
                return False
        try:
            return await self.pods.adopt(rec, reconcile)
        finally:
            if fd is not None:
                self.dataplane.netns.close(fd)

    @staticmethod
    def not_found_why(rec: PodRecord) -> str:
        """Why a kept pod's netns counts as not found, in words: its recorded path is
        gone, or it exists but holds none of the recorded IPs (a re-ADD with another IP,
        or a name re-used by another sandbox); and no process of the pod in ``/proc``."""
        if rec.netns and os.path.exists(rec.netns):
            ips = ", ".join(rec.ips) or "none recorded"
            where = f"recorded path {rec.netns} exists but holds none of the recorded IPs ({ips})"
        else:
            where = "recorded path gone"
        return f"{where}, and no process of this pod in /proc"

    @staticmethod
    def _recorded_gone(rec: PodRecord) -> bool:
        """The pod was recorded by us with a netns path and its IPs, and neither that path
        nor the ``/proc`` scan (by IP) finds it: its sandbox is gone (a reboot). A pod
        known only from an ``enabled`` annotation, or with no IPs yet, is not judged."""
        return bool(rec.netns and rec.ips)

    async def _netns_missing(self, rec: PodRecord) -> None:
        """A kept pod recorded with its netns and IPs whose netns was not found at
        restart (:meth:`_recorded_gone`; after a reboot its sandbox is gone; the
        runtime's next CNI ADD for it brings a new one). Make what is
        published match what is true: its IPs leave the probe set (nothing of it runs
        behind them, and an IP may be handed to another pod), its status annotation is
        removed (no rules redirect it), one Warning Event on the pod (Kubernetes mode)
        and one WARN line name it and the recorded netns, and
        ``ambient_agent_recovery_netns_missing_total`` counts it. It stays announced to
        ZDS without a netns (upstream keeps such a pod's UID in its snapshot, so ztunnel
        keeps any proxy it still runs) and is retried: found later, it is enrolled
        (rules, probe set, annotation written back); its Pod object gone, it is dropped
        (upstream forgets the pod at its delete). Never raises: each step logs its own
        failure."""
        d = self.dataplane
        why = (f"netns {rec.netns} not found at restart ({self.not_found_why(rec)}): "
               "removed from the node's probe "
               "set, status annotation removed; retried, and enrolled again when its "
               "sandbox appears")
        rec.fail(Step.NETNS, why, status=PodState.NETNS_MISSING)  # the one WARN line
        self.netns_missing()
        self.events.record(rec.namespace, rec.name, rec.uid, REASON_NETNS_MISSING, why)
        if d.host_rules is not None:
            try:
                await d.run_blocking(d.host_rules.remove_pod, rec.uid, rec.ips)
            except (RulesError, OSError, ValueError) as err:
                log.warning("%s: probe set entries: %s", rec.label(), err)
        rec.steps[Step.HOSTSET] = False
        rec.steps[Step.STATUS] = False
        d.status.ensure(pod_ref(rec), None)

    async def leave(self, rec: PodRecord, verdict: str, why: str) -> str:
        """Forget a dropped pod (probe set entries, record; never announced to ZDS) or
        un-enroll one that no longer qualifies (its rules too when its netns is alive)."""
        d = self.dataplane
        if verdict == DROP:
            log.info("%s: %s: dropped (ztunnel drains its proxy)", rec.label(), why)
            if rec.ips and d.host_rules is not None:
                try:
                    await d.run_blocking(d.host_rules.remove_pod, rec.uid, rec.ips)
                except (RulesError, OSError, ValueError) as err:
                    log.warning("%s: probe set entries: %s", rec.label(), err)
            d.state.remove(rec.uid)
            return "dropped"
        log.info("%s: %s: removing it from the mesh", rec.label(), why)
        try:
            await self.pods.remove(rec.uid, is_delete=verdict == UNENROLL_DELETED, known=rec)
        except EnrollmentError as err:
            log.warning("un-enrolling %s at restart: %s", rec.label(), err)
        return "unenrolled"

    async def find_netns(self, wanted: dict[str, PodRecord]) -> dict[str, str]:
        """``{uid: netns path}`` (:meth:`cni.enrollment.api.NetnsOps.find`, off the loop)."""
        d = self.dataplane
        return await d.run_blocking(
            d.netns.find, {u: (r.netns, list(r.ips)) for u, r in wanted.items()},
            self.config.proc_dir)
