"""The enrollment reconciler: component ``enrollment`` (``docs/enrollment.md``).

Keyed by pod UID (``CniPodEvent.key``). Desired state = pods that should be ambient
(CNI ADDs the event server accepted, plus pods the config source says are enrolled);
actual state = in-pod rules present, ZDS acked, probe set entry, status. The steps and
their failure policies are :mod:`cni.enrollment.dataplane`; a pod whose enrollment failed
in a retryable way is retried through one keyed retry queue
(:mod:`agent.core.retryqueue`, exponential backoff 0.2 s doubling to 30 s, per pod);
restart recovery is :mod:`cni.enrollment.recovery`; running pods following their labels
is :mod:`cni.enrollment.watch`. Upstream: ``cni/pkg/nodeagent/net.go`` (``NetServer``)
and ``informers.go`` (the retry queue).

A pod is reported enrolled only when every step succeeded. One lock per pod serializes
its ADD, DEL, retries and probe set updates; a CNI DEL cancels the pod's ADD in flight
(:meth:`Enrollment.abort_enroll`), which rolls back what it did.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
from typing import Awaitable, Callable

from agent.core import netns as netns_mod
from agent.core.lifecycle import AgentContext, Component
from cni import annotate, rules_detect
from cni.enrollment import metrics as metrics_mod
from cni.enrollment import recovery as recovery_mod
from cni.enrollment.api import (HostNetnsRefused, NetnsOps, ProbeSet, RegisteredPods,
                                ZdsChannel)
from cni.enrollment.dataplane import ADD, LIVE, RETRY, Dataplane, FailurePolicy, \
    rollback_outcome
from cni.enrollment.kernel import KernelNetns, ipset_exists
from cni.enrollment.records import PodRecord, PodState, PodStateStore, Step
from agent.core.retryqueue import RetryQueue
from cni.enrollment.watch import LivePods
from cni.events import CniPodEvent, EnrollmentError
from cni.kubeevents import REASON_EXHAUSTED, REASON_FAILED, PodEvents
from cni.hostrules import HostProbeRules
from cni.rules_common import RuleOptions, RulesError
from cni.rules_detect import Backend as RulesBackend
from cni.rules_iptables import IptablesBackend, detect_flavor
from cni.rules_nftables import NftablesBackend
from cni.sourceapi import PodSource, PodStore

PROBE_SET_V4 = "istio-inpod-probes-v4"  # HostProbeRules' default set: iptables host rules

log = logging.getLogger(__name__)

STATUS_ANNOTATION = annotate.REDIRECTION_ANNOTATION
BACKOFF_INITIAL, BACKOFF_MAX = 0.2, 30.0
# Failed background retries after which a pod is reported (Kubernetes Event) and, with
# repair_enabled, repaired: 0.2 s doubling reaches the 30 s cap at the 8th (~50 s in).
RETRY_REPORT_AFTER = 8
SANDBOXES_MAX = 4096  # not-ambient pods remembered for live enrollment (a node's worth)
# A CNI ADD is answered this long before the plugin would give up (its event's
# ``timeout``): time for the answer to travel and for the work before the ZDS wait.
ANSWER_MARGIN = 0.5


class Enrollment(Component):
    """The reconciler. Public API for the CNI event server: :meth:`enroll`,
    :meth:`unenroll`; for tools and tests: :meth:`pods`, :meth:`recover`.

    ``zds``: the ZDS channel (None: this agent runs no ZDS server, every ADD fails
    retryably); ``netns``: pod netns operations (default: the kernel's); ``backend``
    and ``host_rules``: the rules backend and the host probe set (default: chosen at
    start from the config)."""

    name = "enrollment"

    def __init__(self, ctx: AgentContext, backend: RulesBackend | None = None,
                 host_rules: ProbeSet | None = None, *, zds: ZdsChannel | None = None,
                 netns: NetnsOps | None = None, source: PodSource | None = None,
                 registrar: RegisteredPods | None = None):
        self.ctx = ctx
        self.source = source  # the config source: Pod objects, annotation writes
        self.registrar = registrar  # pods registered from CNI ADDs (cni.registration)
        cfg = ctx.config
        self.base_options = RuleOptions(probe_snat_ipv4=cfg.host_probe_snat_ip,
                                        probe_snat_ipv6=cfg.host_probe_snat_ipv6,
                                        ipv6=cfg.ambient_ipv6, dns_capture=cfg.ambient_dns_capture)
        self.zds = zds
        self.netns: NetnsOps = netns if netns is not None else KernelNetns()
        self.state = PodStateStore(cfg.state_dir)
        self.status = annotate.RedirectionStatus(self._annotator, self._stored_status)
        self.metrics = metrics_mod.of(ctx.registry)
        self.dataplane = Dataplane(run_blocking=ctx.run_blocking, netns=self.netns,
                                   backend=backend, host_rules=host_rules, zds=zds,
                                   status=self.status, state=self.state,
                                   base_options=self.base_options, records={},
                                   observe_stage=self.metrics.stage)
        self._locks: dict[str, asyncio.Lock] = {}
        self.retries = RetryQueue(self._retry, initial=BACKOFF_INITIAL, maximum=BACKOFF_MAX,
                                  name="enroll-retry")
        self._started = False
        self.events = PodEvents(ctx, source, self.metrics.repaired)  # Kubernetes Events and repair (cni.kubeevents)
        self.recovery = recovery_mod.Recovery(
            self, dataplane=self.dataplane, config=cfg, store=self.store,
            pods_known=self._pod_objects_known, events=self.events,
            netns_missing=self.metrics.netns_missing.inc)
        self.live: LivePods | None = None  # running pods following their labels
        self.backend_note = ""  # why the backend is not the configured one ("": it is)
        self._enrolling: dict[str, asyncio.Task] = {}  # uid -> task inside enroll()
        # sandboxes of running pods the CNI ADD found not ambient: key -> (netns, ips);
        # how a pod without IPs in its object (podman) is found when it becomes ambient
        self._sandboxes: collections.OrderedDict[str, tuple[str, list[str]]] = \
            collections.OrderedDict()
        self._aborted: set[asyncio.Task] = set()  # enroll tasks a CNI DEL cancelled
        # store-driven probe set updates (a known pod's IPs changed): uid -> its IPs now
        self._probe_ips: dict[str, list[str]] = {}
        self.probe_updates = RetryQueue(self._update_probe_ips, initial=BACKOFF_INITIAL,
                                        maximum=BACKOFF_MAX, name="probe-ips")

    @property
    def records(self) -> dict[str, PodRecord]:
        """The records by UID (the dataplane's map: a rolled-back pod leaves it)."""
        return self.dataplane.records

    @records.setter
    def records(self, value: dict[str, PodRecord]) -> None:
        self.dataplane.records = value

    @property
    def backend(self) -> RulesBackend | None:
        """The in-pod rules backend (None until started)."""
        return self.dataplane.backend

    @property
    def host_rules(self) -> ProbeSet | None:
        return self.dataplane.host_rules

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Pick the backend, set up host rules (retried 10 times, 2 s apart), then
        recover pods enrolled before a restart. Raises RulesError if host rules can't be
        installed."""
        if self.dataplane.backend is None:
            self.dataplane.backend = await self.ctx.run_blocking(self._choose_backend)
        if self.dataplane.host_rules is None:
            self.dataplane.host_rules = self._default_host_rules()
        host_rules = self.dataplane.host_rules
        for attempt in range(11):
            try:
                await self.ctx.run_blocking(host_rules.setup)
                break
            except RulesError as e:
                if attempt == 10:
                    raise
                log.warning("host probe rules: %s (retrying)", e)
                await asyncio.sleep(2.0)
        self._started = True
        self.events.start()
        await self.recover()
        store = self.store()
        if store is not None:
            cfg = self.ctx.config
            self.live = LivePods(self, store, host_netns=self.host_netns,
                                 run_blocking=self.ctx.run_blocking,
                                 observe=self.metrics.event, node_name=cfg.node_name,
                                 exclude_namespaces=cfg.exclude_namespaces or (),
                                 system_namespace=cfg.system_namespace, proc_dir=cfg.proc_dir,
                                 files_source=cfg.config_source != "kubernetes")
            self.live.start()

    def _choose_backend(self) -> RulesBackend:
        """Nftables when asked, unless iptables artifacts (our probe ipset) exist
        (stay on iptables until reboot); the iptables flavor is detected once and
        recorded in the state dir."""
        cfg = self.ctx.config
        if cfg.native_nftables:
            netns = cfg.host_rules_netns or None
            if not ipset_exists(PROBE_SET_V4, netns):
                return NftablesBackend()
            # said once, here and in debug_state: the setting reads true, pods get iptables
            self.backend_note = (f"native_nftables is true but the agent stays on iptables: "
                                 f"the iptables probe ipset {PROBE_SET_V4} exists in "
                                 f"{netns or 'the host netns'} (iptables host rules of this "
                                 "or another agent use it; docs/enrollment.md)")
            log.warning("%s", self.backend_note)
        return IptablesBackend(detect_flavor(cfg.state_dir, holding=self._host_flavors))

    def _host_flavors(self) -> set[str]:
        """The iptables flavors (``"nft"``, ``"legacy"``) whose tables in the node netns
        (``host_rules_netns``, else ours) hold an ``ISTIO_*`` chain. A node that can't be
        read is logged and counts as holding none (the ``iptables`` alternative decides,
        as before this look existed)."""
        netns = self.ctx.config.host_rules_netns or None
        try:
            with netns_mod.entered(netns) if netns else contextlib.nullcontext():
                stacks = rules_detect.held_stacks(self.ctx.config.ambient_ipv6)
        except (RulesError, OSError) as e:
            log.warning("cannot tell which iptables flavor holds our host rules: %s", e)
            return set()
        return {s.split("-", 1)[1] for s in stacks if s.startswith("iptables-")}

    def _default_host_rules(self) -> HostProbeRules:
        cfg = self.ctx.config
        backend = self.dataplane.backend
        kind = "nftables" if isinstance(backend, NftablesBackend) else "iptables"
        flavor = backend.flavor if isinstance(backend, IptablesBackend) else "nft"
        return HostProbeRules(backend=kind, flavor=flavor,
                              snat_ipv4=cfg.host_probe_snat_ip, snat_ipv6=cfg.host_probe_snat_ipv6,
                              ipv6=cfg.ambient_ipv6, netns=cfg.host_rules_netns or None)

    async def stop(self, grace: float) -> None:
        """Cancel background retries. In-pod rules always stay. Host rules and probe sets
        stay too (a restart or upgrade must not open a window where enrolled pods bypass
        the mesh; the next start re-creates them and reconciles pods), unless
        ``ambient_disable_safe_upgrade`` says this node is being decommissioned, as
        upstream's ``AMBIENT_DISABLE_SAFE_UPGRADE`` does."""
        if self.live is not None:  # waits for live (un)enrollments in flight
            await self.live.stop(grace)
        self._probe_ips.clear()
        tasks = self.retries.kill() + self.probe_updates.kill()
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=grace)
        await self.status.close(grace)
        await self.events.stop(grace)
        host_rules = self.dataplane.host_rules
        if host_rules is None:
            return
        if self.ctx.config.ambient_disable_safe_upgrade:
            try:
                await self.ctx.run_blocking(host_rules.teardown)
                log.info("host probe rules and sets removed (safe upgrade disabled)")
            except RulesError as e:
                log.warning("removing host probe rules: %s", e)
        await self.ctx.run_blocking(host_rules.close)

    def ready(self) -> tuple[bool, str]:
        return (True, "") if self._started else (False, "not started")

    def add_blocker(self) -> str:
        """Why an ambient pod's CNI ADD would block now ("" when it would not): no ztunnel
        has said hello on the ZDS socket, so the ADD would wait up to ``ztunnel_wait`` and
        then fail. The status server's ``/healthz/ready`` reports it; the health port's
        ``/readyz`` (the DaemonSet's probe, upstream's install readiness) does not."""
        zds = self.zds
        if self._started and zds is not None and not zds.connected():
            return (f"no ztunnel connected on {zds.path}: an "
                    f"ambient pod's CNI ADD would wait up to {self.ctx.config.ztunnel_wait:g}s "
                    f"for one, then fail")
        return ""

    def debug_state(self) -> dict[str, object]:
        backend = self.dataplane.backend
        return {
            "backend": backend.name if backend is not None else None,
            "iptables_flavor": backend.flavor if isinstance(backend, IptablesBackend) else None,
            "backend_note": self.backend_note,
            "pods": {uid: r.debug() for uid, r in self.records.items()},
            "live": dict(self.live.stats) if self.live is not None else None,
            "annotation_retries": self.status.pending_retries(),
        }

    def pods(self) -> dict[str, PodRecord]:
        """Current records by UID (read-only view for tools and tests)."""
        return dict(self.records)

    @property
    def host_netns(self) -> tuple[int, int]:
        """``(st_ino, st_dev)`` of the node netns (skipped by ``/proc`` scans)."""
        return self.netns.host_netns

    def note_sandbox(self, event: CniPodEvent) -> None:
        """Remember the netns and IPs of a pod whose CNI ADD was answered "not ambient"
        (the event server calls this), so that it can be enrolled live, without a
        ``/proc`` scan and without IPs in its object, if it becomes ambient. Forgotten at
        its CNI DEL; at most :data:`SANDBOXES_MAX` are kept (oldest dropped)."""
        if not event.netns or not event.ips:
            return
        self._sandboxes[event.key] = (event.netns, list(event.ips))
        self._sandboxes.move_to_end(event.key)
        while len(self._sandboxes) > SANDBOXES_MAX:
            self._sandboxes.popitem(last=False)

    def sandbox(self, key: str) -> tuple[str, list[str]] | None:
        """``(netns path, ips)`` noted by :meth:`note_sandbox` for pod ``key``, if any."""
        return self._sandboxes.get(key)

    def enrolling(self, uid: str) -> bool:
        """True while an :meth:`enroll` of pod ``uid`` runs (a CNI ADD or a live one)."""
        task = self._enrolling.get(uid)
        return task is not None and not task.done()

    # --- helpers ------------------------------------------------------------------------

    def lock(self, uid: str) -> asyncio.Lock:
        """The pod's lock: its ADD, DEL, retries and probe set updates take turns."""
        return self._locks.setdefault(uid, asyncio.Lock())

    def store(self) -> PodStore | None:
        """The config source's object store, or None."""
        return self.source.store if self.source is not None else None

    def _pod_object(self, uid: str, namespace: str, name: str) -> dict | None:
        store = self.store()
        if store is None:
            return None
        try:
            pod = store.pod_by_uid(uid) or (store.get("Pod", namespace, name) if name else None)
        except Exception as e:  # noqa: BLE001 - a broken store must not break enrollment
            log.warning("config source lookup for pod %s failed: %s", uid, e)
            return None
        if pod is None:
            # registered from CNI into a shared API server (WorkloadEntry): the registrar
            # holds the pod's identity (cni.registration)
            # under the name its workload is served with (ztunnel matches ZDS's name)
            reg_pod = self.registrar.served_pod(uid) if self.registrar is not None else None
            if reg_pod is not None:
                return reg_pod
        return pod

    def _netns_path(self, path: str) -> str:
        """``path`` (CNI_NETNS, a host path) as this agent sees it (setting
        ``host_mounts_path``, :func:`agent.core.netns.host_path`); a relative path is kept as
        given and refused by :meth:`enroll`."""
        try:
            return netns_mod.host_path(path, self.ctx.config.host_mounts_path)
        except ValueError:
            return path

    def _record_from_event(self, event: CniPodEvent) -> PodRecord:
        rec = PodRecord(uid=event.key, name=event.pod_name, namespace=event.pod_namespace,
                        netns=self._netns_path(event.netns), ips=list(event.ips))
        pod = self._pod_object(rec.uid, rec.namespace, rec.name)
        if pod:
            meta = pod.get("metadata") or {}
            if not event.pod_namespace:
                # no Kubernetes (podman): the event names a container, the Pod object
                # found by container ID (its metadata.uid) names the pod
                rec.name = meta.get("name") or rec.name
                rec.namespace = meta.get("namespace") or ""
            rec.annotations = {str(k): str(v) for k, v in (meta.get("annotations") or {}).items()}
            rec.service_account = ((pod.get("spec") or {}).get("serviceAccountName")
                                   or "default")
        return rec

    # --- enroll ---------------------------------------------------------------------------

    async def enroll(self, event: CniPodEvent, *, live: bool = False) -> None:
        """Enroll one ambient pod; returns only when rules, ZDS ack, host probe set and
        status all succeeded. Raises :class:`EnrollmentError` naming the pod, the step
        and the cause. Idempotent (a repeated ADD re-runs each step harmlessly).
        ``live``: the pod runs already (found by the watch, not its CNI ADD): the
        :data:`~cni.enrollment.dataplane.LIVE` policy, whose status waits for the rules."""
        rec = self._record_from_event(event)
        if not rec.netns:
            raise EnrollmentError(f"{rec.label()}: field 'netns' is empty")
        if not rec.netns.startswith("/"):
            raise EnrollmentError(f"{rec.label()}: field 'netns' {rec.netns!r} is not an "
                                  "absolute path")
        if not rec.ips:
            raise EnrollmentError(f"{rec.label()}: no pod IP in the CNI result (field 'ips' "
                                  "is empty); nothing to redirect")
        task = asyncio.current_task()
        assert task is not None
        self.retries.forget(rec.uid)  # a retry may hold the lock for up to ztunnel_wait
        self._enrolling[rec.uid] = task
        rec.answer_by = _answer_deadline(event)
        try:
            await self._enroll_locked(rec, LIVE if live else ADD)
        except asyncio.CancelledError:
            # our own cancel (abort_enroll) is turned into the ADD's answer; any other
            # cancellation (shutdown, a caller's timeout) stays a cancellation
            if task not in self._aborted or task.uncancel() > 0:
                raise
            problems, rec.rollback_problems = rec.rollback_problems, []
            raise EnrollmentError(f"{rec.label()}: pod deleted during enrollment (CNI DEL); "
                                  + rollback_outcome(problems)) from None
        except EnrollmentError as e:
            self.events.record(rec.namespace, rec.name, rec.uid, REASON_FAILED, str(e))
            raise
        finally:
            rec.answer_by = None  # background retries wait the full ztunnel_wait
            self._aborted.discard(task)
            if self._enrolling.get(rec.uid) is task:
                del self._enrolling[rec.uid]

    def abort_enroll(self, uid: str) -> asyncio.Task | None:
        """Cancel the enrollment of pod ``uid`` now in flight, if any (the CNI DEL of a pod
        whose ADD still runs, e.g. waiting up to ``ztunnel_wait`` for a ztunnel). The
        cancelled :meth:`enroll` rolls back what it did and raises
        :class:`EnrollmentError` ("pod deleted during enrollment"). Returns the task to
        await for the rollback, or None when no enrollment of ``uid`` runs."""
        task = self._enrolling.get(uid)
        if task is None or task.done() or task is asyncio.current_task():
            return None
        if task not in self._aborted:
            self._aborted.add(task)
            task.cancel(msg="pod deleted during enrollment")
        return task

    async def _enroll_locked(self, rec: PodRecord, policy: FailurePolicy) -> None:
        async with self.lock(rec.uid):
            self.retries.forget(rec.uid)
            old = self.records.get(rec.uid)
            if old is not None and old.netns == rec.netns and old.status == PodState.ENABLED:
                rec.steps = dict(old.steps)
            # a pod this agent knows (repeated ADD, ADD after a failure) may hold rules:
            # its netns is looked at before applying (cni.rules_detect.apply)
            known = old is not None
            self.records[rec.uid] = rec
            started = self.dataplane.clock()
            try:
                try:
                    fd = self.netns.open(rec.netns)
                finally:
                    self.metrics.stage("netns", self.dataplane.clock() - started)
            except HostNetnsRefused as e:
                rec.fail(Step.NETNS, str(e))
                raise EnrollmentError(f"{rec.label()}: field 'netns': {e}; no rules "
                                      "applied") from None
            except OSError as e:
                rec.fail(Step.NETNS, str(e))
                mounts = self.ctx.config.host_mounts_path
                hint = (f" (host_mounts_path={mounts}: is the runtime's netns path "
                        "mounted there in the agent's container?)" if mounts else "")
                raise EnrollmentError(f"{rec.label()}: netns path {rec.netns!r}: "
                                      f"{os.strerror(e.errno or 0)}{hint}") from None
            try:
                await self.dataplane.run(rec, fd, policy, known)
            except EnrollmentError as e:
                if e.retryable:
                    self.retries.add(rec.uid)
                raise
            finally:
                self.netns.close(fd)

    # --- retries ------------------------------------------------------------------------------

    async def _retry(self, uid: str) -> bool:
        """One retry of pod ``uid`` (the retry queue's ``process``): True when it is done
        (enabled, gone, or dropped), False to try again after the backoff."""
        async with self.lock(uid):
            rec = self.records.get(uid)
            if rec is None or rec.status == PodState.ENABLED:
                return True
            rec.attempts += 1
            if await self._retry_once(rec):
                if uid in self.records:
                    log.info("%s: enrolled after %d retries", rec.label(), rec.attempts)
                return True
            if rec.attempts == RETRY_REPORT_AFTER and uid in self.records:
                why = (f"{rec.attempts} retries failed, the last at {rec.error or rec.status}; "
                       f"still retrying every {BACKOFF_MAX:g}s")
                log.warning("%s: %s", rec.label(), why)
                self.events.record(rec.namespace, rec.name, rec.uid, REASON_EXHAUSTED, why)
                self.events.repair(rec.namespace, rec.name, rec.uid, why)
            return False

    async def _retry_once(self, rec: PodRecord) -> bool:
        if rec.status == PodState.NETNS_MISSING:
            found = await self.recovery.find_netns({rec.uid: rec})
            if rec.uid not in found:
                if self.recovery.verdict(rec, False)[0] == "drop":  # Pod object gone too
                    await self.recovery.leave(rec, "drop", "netns and Pod object gone")
                    self.records.pop(rec.uid, None)
                    if self.zds is not None:
                        await self.zds.delete(rec.uid)
                    return True
                return False
            rec.netns = found[rec.uid]
        try:
            fd = self.netns.open(rec.netns)
        except OSError as e:
            rec.fail(Step.NETNS, str(e), status=PodState.NETNS_MISSING)
            return False
        try:
            await self.dataplane.run(rec, fd, RETRY)
            return True
        except EnrollmentError:
            return False
        finally:
            self.netns.close(fd)

    # --- unenroll ---------------------------------------------------------------------------

    async def unenroll(self, event: CniPodEvent, is_delete: bool = False) -> None:
        """The CNI DEL (``is_delete=True``, the event server's call) or any caller holding
        a CNI event: :meth:`remove` of pod ``event.key``, with the pod's record built from
        the event when enrollment holds none (a DEL after an agent restart lost it) and
        the event's netns path. Raises as :meth:`remove`."""
        await self.remove(event.key, is_delete=is_delete, known=self._record_from_event(event),
                          netns=self._netns_path(event.netns))

    async def remove(self, uid: str, *, is_delete: bool, known: PodRecord | None = None,
                     netns: str = "") -> None:
        """Remove pod ``uid`` from the mesh, upstream's ``RemovePodFromMesh(pod, isDelete)``:
        probe set entries it owns, then (only when ``not is_delete`` and its
        netns still exists) the in-pod rules and routing, then the ZDS delete, the status
        annotation and the persisted record. ``known`` is the pod's record when
        enrollment holds none for ``uid`` (restart recovery's candidate; a CNI DEL's
        event); its IPs also fill a held record that has none. ``netns`` (a path as this
        agent sees it) overrides the record's for the rules removal.

        ``is_delete=True`` is the CNI DEL or a pod that terminated or whose Pod object
        was deleted: the sandbox is being destroyed and its netns
        goes away with the rules in it, so, as upstream, they are not deleted (that is
        the expensive part: every deleting nf_tables transaction waits for an RCU grace
        period), and an enrollment of the pod still in flight is cancelled first
        (:meth:`abort_enroll`). ``is_delete=False`` is un-enrollment of a live pod, which
        must leave the netns as it was. Best effort: a missing netns is fine; raises
        :class:`EnrollmentError` only when a step that could have run failed (after
        trying every step)."""
        if is_delete:  # the pod is going away: don't wait behind its ADD, cancel it
            aborted = self.abort_enroll(uid)
            if aborted is not None:
                log.info("pod %s deleted during enrollment: enrollment cancelled", uid)
                await asyncio.wait([aborted])
        self.retries.forget(uid)  # a retry may hold the lock for up to ztunnel_wait
        if is_delete:
            self._sandboxes.pop(uid, None)
        async with self.lock(uid):
            self.retries.forget(uid)
            rec = self.records.pop(uid, None) or known or PodRecord(uid=uid)
            if not rec.ips and known is not None:
                rec.ips = list(known.ips)
            netns_path = "" if is_delete else (netns or rec.netns)
            errors = await self.dataplane.remove(rec, netns_path, is_delete=is_delete)
            self.state.remove(uid)
            self._locks.pop(uid, None)
        if errors:
            raise EnrollmentError(f"{rec.label()}: removal incomplete: " + "; ".join(errors))

    # --- probe set entries following the Pod object ------------------------------------

    def pod_ips_seen(self, uid: str, ips: list[str]) -> None:
        """Upstream's probe set self-heal (``informers.go``: an enrolled pod whose IPs
        changed gets ``SyncHostProbeIPSet``), called by :mod:`cni.enrollment.watch` with a
        known pod's current ``status.podIPs`` (normalized): when they differ from the
        record's, its probe entries are upserted, and a record without IPs (recovered at
        start before kubelet published them) adopts them. Only looks and queues the
        update (:attr:`probe_updates`, keyed by pod; a failed update is retried with
        backoff, the newest IPs win)."""
        rec = self.records.get(uid)
        if rec is None or not ips or set(ips) == set(rec.ips):
            return
        self._probe_ips[uid] = list(ips)
        self.probe_updates.add(uid, now=True)

    async def _update_probe_ips(self, uid: str) -> bool:
        """The probe update queue's ``process``: True when done (or nothing to do),
        False to retry after the backoff."""
        ips = self._probe_ips.get(uid)
        if ips is None:
            return True
        done = await self._add_probe_ips(uid, ips)
        if not done:
            return False
        if self._probe_ips.get(uid) is ips:
            del self._probe_ips[uid]
            return True
        return False  # newer IPs came meanwhile: they go in at the next attempt

    async def _add_probe_ips(self, uid: str, ips: list[str]) -> bool:
        async with self.lock(uid):  # never after an unenroll removed the pod's entries
            rec = self.records.get(uid)
            host_rules = self.dataplane.host_rules
            if rec is None or host_rules is None:
                return True
            if not rec.ips:
                rec.ips = list(ips)
                log.info("%s: pod IPs now known (%s)", rec.label(), ", ".join(ips))
                if rec.status == PodState.ENABLED:
                    try:
                        self.state.save(rec)
                    except OSError as e:  # kept in memory; the next save writes them
                        log.warning("%s: cannot record its IPs in the state dir %s: %s",
                                    rec.label(), self.state.dir, e.strerror or e)
            try:
                await self.dataplane.blocking(host_rules.add_pod, uid, ips)
            except (RulesError, OSError, ValueError) as e:
                log.warning("%s: probe set entries for %s: %s (retrying)", rec.label(),
                            ", ".join(ips), e)
                return False
            return True

    # --- restart recovery -------------------------------------------------------------------

    def _pod_objects_known(self) -> bool:
        """Whether the config source holds its full set of Pod objects (its first load
        is done); False without a source."""
        return self.source is not None and bool(self.source.ready()[0])

    async def adopt(self, rec: PodRecord,
                    reconcile: Callable[[PodRecord], Awaitable[bool]]) -> str:
        """Restart recovery's :class:`cni.enrollment.recovery.RecoveredPods`: under the
        pod's lock ``rec`` becomes pod ``rec.uid``'s record and ``reconcile(rec)`` runs;
        False from it queues the pod for retry. Returns ``rec.status`` afterwards."""
        async with self.lock(rec.uid):
            self.records[rec.uid] = rec
            if not await reconcile(rec):
                self.retries.add(rec.uid)
            return rec.status

    async def recover(self) -> dict[str, str]:
        """Re-adopt pods enrolled before a restart (:meth:`cni.enrollment.recovery.Recovery.run`).
        Returns ``{uid: outcome}``."""
        return await self.recovery.run()

    # --- what the status server reads ---------------------------------------------------

    def _annotator(self) -> annotate.PodAnnotator | None:
        # a source without annotation writes (tests' in-memory stores) leaves pods unannotated
        source = self.source
        return source if isinstance(source, annotate.PodAnnotator) else None

    def _stored_status(self, ref: annotate.PodRef) -> str | None:
        """The annotation the config source's Pod ``ref`` carries now (same uid), if any."""
        store = self.store()
        pod = store.get("Pod", ref.namespace, ref.name) if store is not None else None
        meta = (pod or {}).get("metadata") or {}
        if not pod or (meta.get("uid") and meta.get("uid") != ref.uid):
            return None
        return (meta.get("annotations") or {}).get(STATUS_ANNOTATION)


def _answer_deadline(event: CniPodEvent) -> float | None:
    """Loop time by which the CNI ADD of ``event`` must be answered: the plugin's
    ``timeout`` less :data:`ANSWER_MARGIN`, from now; None when the plugin gave none."""
    if not event.timeout:
        return None
    return asyncio.get_running_loop().time() + max(0.0, event.timeout - ANSWER_MARGIN)
