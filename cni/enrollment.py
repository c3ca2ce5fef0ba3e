"""The enrollment reconciler (component ``enrollment``; ``docs/enrollment.md``).

Keyed by pod UID (``CniPodEvent.key``). Desired state = pods that should be ambient
(CNI ADDs the event server accepted, plus pods the config source says are enrolled);
actual state = in-pod rules present, ZDS acked, probe set entry, status. Steps, in
order, each idempotent:

1. **rules**: enter the pod netns in a worker thread, install routing + ruleset
   (:mod:`cni.rules_iptables` or :mod:`cni.rules_nftables`). Failure is permanent for
   this ADD: rules are rolled back and :class:`EnrollmentError` carries the tool's stderr.
2. **ZDS add**: hand the netns fd to ztunnel and wait for its ACK. Failure is
   retryable: the pod stays ``pending`` (rules kept: fail closed) and a background task
   retries with exponential backoff; the CNI ADD gets the error.
3. **host probe set**: the pod's IPs, owner = UID (:mod:`cni.hostrules`). Retryable.
4. **status**: ``ambient.istio.io/redirection: enabled`` written through the config
   source (:mod:`cni.annotate`: a PATCH in Kubernetes mode, an overlay on the stored Pod
   with the files source), also visible in :meth:`Enrollment.debug_state`.

A pod is reported enrolled only when all four succeeded. Each enrolled pod is persisted
as ``<state_dir>/pods/<uid>.json`` (uid, name, namespace, service account, netns path,
IPs, annotations) so a restarted agent recovers it even without Kubernetes: by its
netns path if that still holds the pod IP, else by scanning ``/proc``
(:mod:`cni.podnetns`). At restart each record is re-decided against its current Pod
object as a fresh ADD would be (dropped when its netns and Pod object are both gone,
un-enrolled when it no longer qualifies), every kept pod is recorded in ZDS and only then
are ztunnel connections accepted (:meth:`Enrollment.recover`); rules are reconciled
after (replaced atomically, never duplicated), probe set re-synced. A kept pod whose
netns can't be found is reported (``netns-missing``) and retried, and it is still
announced to ZDS without a netns (``Keep``) so ztunnel doesn't drop it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import fcntl
import json
import logging
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

from agent.core.backoff import Backoff
from agent.core.files import write_atomic
from agent.core.lifecycle import AgentContext, Component
from cni import annotate
from cni import enablement
from agent.core import netns as netns_mod
from cni import podnetns
from cni import rules_detect
from cni.events import CniPodEvent, EnrollmentError
from cni.podips import pod_status_ips, usable_ips
from cni.hostrules import HostProbeRules
from cni.livepods import LivePods
from cni.rules_common import RuleOptions, RulesError, pod_options
from cni.rules_iptables import IptablesBackend, detect_flavor
from cni.rules_nftables import NftablesBackend

log = logging.getLogger(__name__)

STATUS_ANNOTATION = annotate.REDIRECTION_ANNOTATION
BACKOFF_INITIAL, BACKOFF_MAX = 0.2, 30.0
SANDBOXES_MAX = 4096  # not-ambient pods remembered for live enrollment (a node's worth)
# A CNI ADD is answered this long before the plugin would give up (its event's
# ``timeout``): time for the answer to travel and for the work before the ZDS wait.
ANSWER_MARGIN = 0.5
IFF_UP, SIOCGIFFLAGS = 0x1, 0x8913  # <linux/if.h>, <linux/sockios.h>


class LoopbackDown(Exception):
    """The pod netns's ``lo`` is down (or missing): checked before any rule is applied,
    since the in-pod routes (``local 0.0.0.0/0 dev lo``) need it up. The runtime brings
    ``lo`` up before it runs chained plugins, so this means a broken sandbox."""


@dataclasses.dataclass
class PodRecord:
    """One pod the agent enrolls. Persisted (JSON) minus the runtime-only fields."""

    uid: str
    name: str = ""
    namespace: str = ""
    service_account: str = "default"
    netns: str = ""
    ips: list[str] = dataclasses.field(default_factory=list)
    annotations: dict[str, str] = dataclasses.field(default_factory=dict)
    # runtime-only
    status: str = "pending"  # pending | enabled | failed | netns-missing
    error: str = ""
    steps: dict[str, bool] = dataclasses.field(default_factory=dict)
    attempts: int = 0
    updated: float = 0.0
    answer_by: float | None = None  # loop time the CNI ADD in flight must be answered by

    PERSISTED = ("uid", "name", "namespace", "service_account", "netns", "ips", "annotations")

    def __post_init__(self) -> None:
        # canonical, unmapped (cni.podips): a record read from an older state file or
        # built from a Pod object compares equal to the CNI event's addresses
        self.ips = usable_ips(self.ips if isinstance(self.ips, list) else [], "ips[{i}]",
                              f"pod record {self.uid}")

    def label(self) -> str:
        who = f"{self.namespace}/{self.name}" if self.name else "pod"
        return f"{who} (uid {self.uid})"

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.PERSISTED}


class PodStateStore:
    """``<state_dir>/pods/<uid>.json`` files (dir 0700, files 0600, atomic writes)."""

    def __init__(self, state_dir: str):
        self.dir = Path(state_dir, "pods")

    def save(self, rec: PodRecord) -> None:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self.dir / f"{_safe(rec.uid)}.json"
        write_atomic(path, json.dumps(rec.to_json()), 0o600, fsync=False)

    def remove(self, uid: str) -> None:
        try:
            (self.dir / f"{_safe(uid)}.json").unlink()
        except FileNotFoundError:
            pass

    def load(self) -> list[PodRecord]:
        """Every readable record; a malformed file is logged and skipped, never fatal."""
        records = []
        for path in sorted(self.dir.glob("*.json")) if self.dir.exists() else []:
            try:
                data = json.loads(path.read_text())
                if not isinstance(data, dict) or not isinstance(data.get("uid"), str):
                    raise ValueError("field 'uid' missing or not a string")
                records.append(PodRecord(**{k: data[k] for k in PodRecord.PERSISTED
                                            if k in data}))
            except (OSError, ValueError, TypeError) as e:
                log.error("skipping pod state file %s: %s", path, e)
        return records


def _safe(uid: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in uid)


class Enrollment(Component):
    """The reconciler. Public API for the CNI event server: :meth:`enroll`,
    :meth:`unenroll`; for tools and tests: :meth:`pods`, :meth:`recover`."""

    name = "enrollment"

    def __init__(self, ctx: AgentContext, backend=None, host_rules: HostProbeRules | None = None):
        self.ctx = ctx
        cfg = ctx.config
        self.base_options = RuleOptions(probe_snat_ipv4=cfg.host_probe_snat_ip,
                                        probe_snat_ipv6=cfg.host_probe_snat_ipv6,
                                        ipv6=cfg.ambient_ipv6, dns_capture=cfg.ambient_dns_capture)
        self.backend = backend
        self.host_rules = host_rules
        self.state = PodStateStore(cfg.state_dir)
        self.records: dict[str, PodRecord] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._retry_tasks: dict[str, asyncio.Task] = {}
        self._host_netns = podnetns.host_netns_id()
        self._started = False
        self.live: LivePods | None = None  # running pods following their labels
        self._enrolling: dict[str, asyncio.Task] = {}  # uid -> task inside enroll()
        # sandboxes of running pods the CNI ADD found not ambient: key -> (netns, ips);
        # how a pod without IPs in its object (podman) is found when it becomes ambient
        self._sandboxes: collections.OrderedDict[str, tuple[str, list[str]]] = \
            collections.OrderedDict()
        self._aborted: set[asyncio.Task] = set()  # enroll tasks a CNI DEL cancelled
        self._rollback_problems: dict[str, list[str]] = {}
        self.status = annotate.RedirectionStatus(self._annotator, self._stored_status)
        self._side_tasks: set[asyncio.Task] = set()  # store-driven probe set updates

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Pick the backend, set up host rules (retried 10 times, 2 s apart), then
        recover pods enrolled before a restart. Raises RulesError if host rules can't be
        installed."""
        if self.backend is None:
            self.backend = await self.ctx.run_blocking(self._choose_backend)
        if self.host_rules is None:
            self.host_rules = self._default_host_rules()
        for attempt in range(11):
            try:
                await self.ctx.run_blocking(self.host_rules.setup)
                break
            except RulesError as e:
                if attempt == 10:
                    raise
                log.warning("host probe rules: %s (retrying)", e)
                await asyncio.sleep(2.0)
        self._started = True
        await self.recover()
        store = self._store()
        if store is not None:
            cfg = self.ctx.config
            self.live = LivePods(self, store, node_name=cfg.node_name,
                                 exclude_namespaces=cfg.exclude_namespaces or (),
                                 system_namespace=cfg.system_namespace, proc_dir=cfg.proc_dir,
                                 files_source=cfg.config_source != "kubernetes")
            self.live.start()

    def _choose_backend(self):
        """Nftables when asked, unless iptables artifacts (our probe ipset) exist
        (stay on iptables until reboot); the iptables flavor is detected once and
        recorded in the state dir."""
        cfg = self.ctx.config
        if cfg.native_nftables and not _ipset_exists("istio-inpod-probes-v4",
                                                     cfg.host_rules_netns or None):
            return NftablesBackend()
        return IptablesBackend(detect_flavor(cfg.state_dir))

    def _default_host_rules(self) -> HostProbeRules:
        cfg = self.ctx.config
        kind = "nftables" if isinstance(self.backend, NftablesBackend) else "iptables"
        return HostProbeRules(backend=kind, flavor=getattr(self.backend, "flavor", "nft"),
                              snat_ipv4=cfg.host_probe_snat_ip, snat_ipv6=cfg.host_probe_snat_ipv6,
                              ipv6=cfg.ambient_ipv6,
                              netns=getattr(cfg, "host_rules_netns", "") or None)

    async def stop(self, grace: float) -> None:
        """Cancel background retries. In-pod rules always stay. Host rules and probe sets
        stay too (a restart or upgrade must not open a window where enrolled pods bypass
        the mesh; the next start re-creates them and reconciles pods), unless
        ``ambient_disable_safe_upgrade`` says this node is being decommissioned, as
        upstream's ``AMBIENT_DISABLE_SAFE_UPGRADE`` does."""
        if self.live is not None:  # waits for live (un)enrollments in flight
            await self.live.stop(grace)
        tasks = list(self._retry_tasks.values()) + list(self._side_tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=grace)
        self._retry_tasks.clear()
        await self.status.close(grace)
        if self.host_rules is None:
            return
        if self.ctx.config.ambient_disable_safe_upgrade:
            try:
                await self.ctx.run_blocking(self.host_rules.teardown)
                log.info("host probe rules and sets removed (safe upgrade disabled)")
            except RulesError as e:
                log.warning("removing host probe rules: %s", e)
        await self.ctx.run_blocking(self.host_rules.close)

    def ready(self) -> tuple[bool, str]:
        return (True, "") if self._started else (False, "not started")

    def add_blocker(self) -> str:
        """Why an ambient pod's CNI ADD would block now ("" when it would not): no ztunnel
        has said hello on the ZDS socket, so the ADD would wait up to ``ztunnel_wait`` and
        then fail. The status server's ``/healthz/ready`` reports it; the health port's
        ``/readyz`` (the DaemonSet's probe, upstream's install readiness) does not."""
        zds = self._zds()
        latest = getattr(zds, "latest", None)
        if self._started and callable(latest) and latest() is None:
            return (f"no ztunnel connected on {getattr(zds, 'path', 'the ZDS socket')}: an "
                    f"ambient pod's CNI ADD would wait up to {self.ctx.config.ztunnel_wait:g}s "
                    f"for one, then fail")
        return ""

    def debug_state(self) -> Any:
        return {
            "backend": getattr(self.backend, "name", None),
            "iptables_flavor": getattr(self.backend, "flavor", None),
            "pods": {uid: {"pod": r.label(), "status": r.status, "error": r.error,
                           "steps": r.steps, "netns": r.netns, "ips": r.ips,
                           "attempts": r.attempts} for uid, r in self.records.items()},
            "live": dict(self.live.stats) if self.live is not None else None,
            "annotation_retries": self.status.pending_retries(),
        }

    def pods(self) -> dict[str, PodRecord]:
        """Current records by UID (read-only view for tools and tests)."""
        return dict(self.records)

    @property
    def host_netns(self) -> tuple[int, int]:
        """``(st_ino, st_dev)`` of the node netns, taken at construction (skipped by
        ``/proc`` scans)."""
        return self._host_netns

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

    def _lock(self, uid: str) -> asyncio.Lock:
        return self._locks.setdefault(uid, asyncio.Lock())

    def _store(self):
        source = self.ctx.get("config-source")
        return getattr(source, "store", None) if source is not None else None

    def _pod_object(self, uid: str, namespace: str, name: str) -> dict | None:
        store = self._store()
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
            served_pod = getattr(self.ctx.get("registration"), "served_pod", None)
            reg_pod = served_pod(uid) if callable(served_pod) else None
            if reg_pod is not None:
                return reg_pod
        return pod

    def _netns_path(self, path: str) -> str:
        """``path`` (CNI_NETNS, a host path) as this agent sees it (setting
        ``host_mounts_path``, :func:`agent.core.netns.host_path`); a relative path is kept as
        given and refused by :meth:`enroll`."""
        try:
            return netns_mod.host_path(path, getattr(self.ctx.config, "host_mounts_path", ""))
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

    def _zds(self):
        return self.ctx.get("zds")

    # --- enroll ---------------------------------------------------------------------------

    async def enroll(self, event: CniPodEvent) -> None:
        """Enroll one ambient pod; returns only when rules, ZDS ack, host probe set and
        status all succeeded. Raises :class:`EnrollmentError` naming the pod, the step
        and the cause. Idempotent (a repeated ADD re-runs each step harmlessly)."""
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
        self._cancel_retry(rec.uid)  # a retry may hold the lock for up to ztunnel_wait
        self._enrolling[rec.uid] = task
        rec.answer_by = _answer_deadline(event)
        try:
            await self._enroll_locked(rec)
        except asyncio.CancelledError:
            # our own cancel (abort_enroll) is turned into the ADD's answer; any other
            # cancellation (shutdown, a caller's timeout) stays a cancellation
            if task not in self._aborted or task.uncancel() > 0:
                raise
            problems = self._rollback_problems.pop(rec.uid, [])
            raise EnrollmentError(f"{rec.label()}: pod deleted during enrollment (CNI DEL); "
                                  + _rollback_outcome(problems)) from None
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

    async def _enroll_locked(self, rec: PodRecord) -> None:
        async with self._lock(rec.uid):
            self._cancel_retry(rec.uid)
            old = self.records.get(rec.uid)
            if old is not None and old.netns == rec.netns and old.status == "enabled":
                rec.steps = dict(old.steps)
            # a pod this agent knows (repeated ADD, ADD after a failure) may hold rules:
            # its netns is looked at before applying (cni.rules_detect.apply)
            known = old is not None
            self.records[rec.uid] = rec
            try:
                fd = netns_mod.open_netns(rec.netns)
            except OSError as e:
                self._fail(rec, "netns", str(e))
                mounts = getattr(self.ctx.config, "host_mounts_path", "")
                hint = (f" (host_mounts_path={mounts}: is the runtime's netns path "
                        "mounted there in the agent's container?)" if mounts else "")
                raise EnrollmentError(f"{rec.label()}: netns path {rec.netns!r}: "
                                      f"{os.strerror(e.errno or 0)}{hint}") from None
            try:
                await self._enroll_steps(rec, fd, known)
            finally:
                os.close(fd)

    async def _enroll_steps(self, rec: PodRecord, fd: int, known: bool = True) -> None:
        inode = os.fstat(fd).st_ino
        opts = pod_options(self.base_options, rec.annotations)
        try:
            await self._steps_or_rollback(rec, fd, opts, inode, known)
        except asyncio.CancelledError:
            # a CNI DEL (abort_enroll) or shutdown: undo whatever ran, then stay cancelled
            self._rollback_problems[rec.uid] = await self._rollback_all(rec, fd, opts)
            raise

    async def _steps_or_rollback(self, rec: PodRecord, fd: int, opts: RuleOptions,
                                 inode: int, known: bool = True) -> None:
        try:
            outcome = await self._blocking(self._apply_rules, fd, opts, rec.netns, known)
        except LoopbackDown as e:  # checked before any rule: nothing to roll back
            self._fail(rec, "rules", str(e))
            raise EnrollmentError(f"{rec.label()}: {e}; nothing was applied") from None
        except (RulesError, OSError) as e:
            problems = await self._rollback_rules(fd, opts)
            self._fail(rec, "rules", str(e))
            raise EnrollmentError(f"{rec.label()}: in-pod rules failed "
                                  f"({_rollback_outcome(problems)}): {e}") from None
        rec.steps["rules"] = True
        log.info("%s: in-pod rules %s (%s)", rec.label(), outcome, self.backend.name)
        try:
            await self._remaining_steps(rec, fd, wait_ack=True)
        except EnrollmentError as e:
            if not self._same_netns(rec.netns, inode):
                problems = await self._rollback_all(rec, fd, opts)
                raise EnrollmentError(f"{rec.label()}: netns {rec.netns} disappeared during "
                                      f"enrollment; {_rollback_outcome(problems)} ({e})"
                                      ) from None
            self._schedule_retry(rec)
            raise
        if not self._same_netns(rec.netns, inode):
            problems = await self._rollback_all(rec, fd, opts)
            raise EnrollmentError(f"{rec.label()}: netns {rec.netns} disappeared during "
                                  f"enrollment; {_rollback_outcome(problems)}")

    async def _blocking(self, fn, *args):
        """``ctx.run_blocking`` that, when cancelled, first waits for the worker thread to
        finish: a thread can't be stopped, and a rollback racing a half-applied ruleset
        in another thread would leave rules behind."""
        fut = asyncio.ensure_future(self.ctx.run_blocking(fn, *args))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            await asyncio.wait([fut])
            if not fut.cancelled():
                fut.exception()  # retrieved: the caller rolls back whatever it did
            raise

    def _apply_rules(self, fd: int, opts: RuleOptions, netns_path: str = "",
                     known: bool = True) -> str:
        """In the pod netns (worker thread): check ``lo`` is up, then apply the ruleset in
        the stack the netns already holds our rules in, if any (:func:`rules_detect.apply`:
        a pod never gets a second copy in another stack, e.g. after the recorded iptables
        flavor was lost), else with the agent's backend. ``known``: the agent has a
        record of the pod (always looked at; else only when our routing is there).
        Raises :class:`LoopbackDown`, RulesError, OSError."""
        with netns_mod.entered(fd):
            label = netns_path or f"fd {fd}"
            _require_loopback_up(label)
            outcome, backend, strays = rules_detect.apply(self.backend, opts, known)
            if backend is not self.backend:
                log.warning("pod netns %s holds our rules in %s, not in the agent's %s: "
                            "reconciled them there", label, rules_detect.stack_of(backend),
                            rules_detect.stack_of(self.backend))
            for stray in strays:
                log.warning("pod netns %s also held our rules in %s: removed", label,
                            rules_detect.stack_of(stray))
            return outcome

    def _delete_rules(self, ipv6: bool, during=None) -> None:
        """In the pod netns (worker thread): our rules out of every stack holding them,
        then the routing. ``during``: see :func:`rules_detect.delete_everywhere`."""
        rules_detect.delete_everywhere(self.backend, ipv6, during)

    async def _rollback_rules(self, fd: int, opts: RuleOptions) -> list[str]:
        """Delete the in-pod rules; returns what could not be undone (empty: all done)."""
        def undo():
            with netns_mod.entered(fd):
                self._delete_rules(opts.ipv6)
        try:
            await self._blocking(undo)
        except (RulesError, OSError) as e:
            log.warning("rollback of in-pod rules failed: %s", e)
            return [f"in-pod rules: {e}"]
        return []

    async def _rollback_all(self, rec: PodRecord, fd: int, opts: RuleOptions) -> list[str]:
        """Undo every step of a failed or cancelled enrollment; returns what could not be
        undone. ZDS delete always: the server records the pod even when unacked."""
        problems: list[str] = []
        zds = self._zds()
        if zds is not None:
            try:
                await zds.delete(rec.uid)
            except Exception as e:  # noqa: BLE001
                log.warning("%s: ZDS delete during rollback: %s", rec.label(), e)
                problems.append(f"ZDS delete: {e}")
        if rec.steps.get("hostset"):
            try:
                await self._blocking(self.host_rules.remove_pod, rec.uid, rec.ips)
            except (RulesError, OSError, ValueError) as e:
                log.warning("%s: probe set rollback: %s", rec.label(), e)
                problems.append(f"host probe set: {e}")
        problems += await self._rollback_rules(fd, opts)  # harmless when none applied
        if self.records.get(rec.uid) is rec:
            self.records.pop(rec.uid, None)
        self.state.remove(rec.uid)
        return problems

    @staticmethod
    def _same_netns(path: str, inode: int) -> bool:
        try:
            return os.stat(path).st_ino == inode
        except OSError:
            return False

    async def _remaining_steps(self, rec: PodRecord, fd: int | None, wait_ack: bool,
                               announce: bool = True) -> None:
        """ZDS add (skipped with ``announce=False``: restart recovery recorded the pod in
        ZDS already), host probe set, status. Raises retryable EnrollmentError."""
        import zds as zds_mod  # lazy: keep cni importable without the zds package's server

        zds = self._zds()
        if announce and zds is None:
            self._fail(rec, "zds", "no ZDS server component", status="pending")
            raise EnrollmentError(f"{rec.label()}: this agent runs no ZDS server", True)
        if announce:
            info = zds_mod.PodInfo(uid=rec.uid, name=rec.name, namespace=rec.namespace,
                                   service_account=rec.service_account, netns_fd=fd)
            try:
                await zds.add(info, wait_ack=wait_ack, ztunnel_wait=_time_left(rec.answer_by))
            except zds_mod.NoZtunnel as e:
                self._fail(rec, "zds", str(e), status="pending")
                await self._set_status(rec, "pending")
                raise EnrollmentError(f"{rec.label()}: {_no_ztunnel_text(e)}", True) from None
            except zds_mod.ZdsError as e:
                self._fail(rec, "zds", f"{type(e).__name__}: {e}", status="pending")
                await self._set_status(rec, "pending")
                raise EnrollmentError(f"{rec.label()}: ztunnel did not accept the pod "
                                      f"({type(e).__name__}: {e}); will retry", True) from None
        rec.steps["zds"] = True
        try:
            await self._blocking(self.host_rules.add_pod, rec.uid, rec.ips)
        except (RulesError, OSError, ValueError) as e:
            self._fail(rec, "hostset", str(e), status="pending")
            raise EnrollmentError(f"{rec.label()}: host probe set: {e}; will retry", True) from None
        rec.steps["hostset"] = True
        if not await self._set_status(rec, "enabled"):
            self._fail(rec, "status", "status annotation patch failed", status="pending")
            raise EnrollmentError(f"{rec.label()}: could not write status annotation; "
                                  "will retry", True)
        rec.steps["status"] = True
        rec.status, rec.error, rec.updated = "enabled", "", time.time()
        self.state.save(rec)

    async def _set_status(self, rec: PodRecord, value: str | None) -> bool:
        """Write ``ambient.istio.io/redirection`` (None removes it) through the config
        source (:mod:`cni.annotate`), one attempt; True when done or nothing to write.
        A failure is logged with the pod's name; the caller's retry covers it."""
        return await self.status.write(_pod_ref(rec), value)

    def _annotator(self) -> annotate.PodAnnotator | None:
        source = self.ctx.get("config-source")
        return source if isinstance(source, annotate.PodAnnotator) else None

    def _stored_status(self, ref: annotate.PodRef) -> str | None:
        """The annotation the config source's Pod ``ref`` carries now (same uid), if any."""
        store = self._store()
        pod = store.get("Pod", ref.namespace, ref.name) if store is not None else None
        meta = (pod or {}).get("metadata") or {}
        if not pod or (meta.get("uid") and meta.get("uid") != ref.uid):
            return None
        return (meta.get("annotations") or {}).get(STATUS_ANNOTATION)

    def _fail(self, rec: PodRecord, step: str, why: str, status: str = "failed") -> None:
        rec.status, rec.error, rec.updated = status, f"{step}: {why}", time.time()
        rec.steps[step] = False
        log.warning("%s: %s failed: %s", rec.label(), step, why)

    # --- retries ------------------------------------------------------------------------------

    def _cancel_retry(self, uid: str) -> None:
        task = self._retry_tasks.pop(uid, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    def _schedule_retry(self, rec: PodRecord) -> None:
        if rec.uid not in self._retry_tasks:
            self._retry_tasks[rec.uid] = asyncio.create_task(self._retry_loop(rec.uid),
                                                             name=f"enroll-retry-{rec.uid}")

    async def _retry_loop(self, uid: str) -> None:
        """Exponential backoff (0.2 s doubling to 30 s) until the pod is enabled or gone."""
        backoff = Backoff(BACKOFF_INITIAL, BACKOFF_MAX)
        try:
            while True:
                await backoff.wait()
                async with self._lock(uid):
                    rec = self.records.get(uid)
                    if rec is None or rec.status == "enabled":
                        return
                    rec.attempts += 1
                    if await self._retry_once(rec):
                        if uid in self.records:
                            log.info("%s: enrolled after %d retries", rec.label(),
                                     rec.attempts)
                        return
        finally:
            if self._retry_tasks.get(uid) is asyncio.current_task():
                self._retry_tasks.pop(uid, None)

    async def _retry_once(self, rec: PodRecord) -> bool:
        if rec.status == "netns-missing":
            found = await self._find_netns({rec.uid: rec})
            if rec.uid not in found:
                if self._recovery_verdict(rec, False)[0] == "drop":  # Pod object gone too
                    await self._recover_leaving(rec, "drop", "netns and Pod object gone")
                    self.records.pop(rec.uid, None)
                    zds = self._zds()
                    if zds is not None:
                        await zds.delete(rec.uid)
                    return True
                return False
            rec.netns = found[rec.uid]
        try:
            fd = netns_mod.open_netns(rec.netns)
        except OSError as e:
            self._fail(rec, "netns", str(e), status="netns-missing")
            return False
        try:
            try:
                opts = pod_options(self.base_options, rec.annotations)
                await self._blocking(self._apply_rules, fd, opts, rec.netns)
                rec.steps["rules"] = True
            except (LoopbackDown, RulesError, OSError) as e:
                self._fail(rec, "rules", str(e))
                return False
            await self._remaining_steps(rec, fd, wait_ack=True)
            return True
        except EnrollmentError:
            return False
        finally:
            os.close(fd)

    # --- unenroll ---------------------------------------------------------------------------

    async def unenroll(self, event: CniPodEvent, is_delete: bool = False) -> None:
        """Remove a pod from the mesh, upstream's ``RemovePodFromMesh(pod, isDelete)``:
        probe set entries it owns, then (only when ``not is_delete`` and its
        netns still exists) the in-pod rules and routing, then the ZDS delete, the status
        annotation and the persisted record.

        ``is_delete=True`` is the CNI DEL: the sandbox is being destroyed and its netns
        goes away with the rules in it, so, as upstream, they are not deleted (that is
        the expensive part: every deleting nf_tables transaction waits for an RCU grace
        period). ``is_delete=False`` is un-enrollment of a live pod, which must leave the
        netns as it was. Best effort: a missing netns is fine; raises
        :class:`EnrollmentError` only when a step that could have run failed (after
        trying every step)."""
        uid = event.key
        if is_delete:  # the pod is going away: don't wait behind its ADD, cancel it
            aborted = self.abort_enroll(uid)
            if aborted is not None:
                log.info("pod %s deleted during enrollment: enrollment cancelled", uid)
                await asyncio.wait([aborted])
        self._cancel_retry(uid)  # a retry may hold the lock for up to ztunnel_wait
        if is_delete:
            self._sandboxes.pop(uid, None)
        async with self._lock(uid):
            self._cancel_retry(uid)
            rec = self.records.pop(uid, None) or self._record_from_event(event)
            if not rec.ips:
                rec.ips = list(event.ips)
            netns_path = "" if is_delete else (self._netns_path(event.netns) or rec.netns)
            errors = await self._remove(rec, netns_path, is_delete=is_delete)
            self.state.remove(uid)
            self._locks.pop(uid, None)
        if errors:
            raise EnrollmentError(f"{rec.label()}: removal incomplete: " + "; ".join(errors))

    async def _remove(self, rec: PodRecord, netns_path: str, is_delete: bool = True
                      ) -> list[str]:
        """In-pod rules (when ``netns_path``), with the probe set entries removed while the
        rules' deleting transaction waits for the kernel (they live in another netns and
        neither depends on the other; started earlier, their netlink work would compete
        with the rules' look at the pod netns); ZDS delete only after the rules are gone,
        so ztunnel never drains a proxy that traffic is still sent to."""
        errors: list[str] = []
        loop = asyncio.get_running_loop()
        hostset: asyncio.Future | None = None

        def start_hostset() -> None:
            nonlocal hostset
            if hostset is None and self.host_rules is not None:  # by owner: IPs may be unknown
                hostset = asyncio.ensure_future(
                    self.ctx.run_blocking(self.host_rules.remove_pod, rec.uid, rec.ips))

        if netns_path and os.path.exists(netns_path):
            opts = pod_options(self.base_options, rec.annotations)

            def during() -> None:  # the kernel is busy with the deleting transaction
                try:
                    loop.call_soon_threadsafe(start_hostset)
                except RuntimeError:  # loop closing: the entries go below or not at all
                    pass

            def undo():
                with netns_mod.entered(netns_path):
                    self._delete_rules(opts.ipv6, during)
            try:
                await self.ctx.run_blocking(undo)
            except netns_mod.NetnsError:
                pass  # vanished between the check and the entry: nothing left to clean
            except (RulesError, OSError) as e:
                errors.append(f"in-pod rules: {e}")
        start_hostset()  # not started during the deletion (no rules, or it failed first)
        zds = self._zds()
        if zds is not None:
            try:
                await zds.delete(rec.uid)
            except Exception as e:  # noqa: BLE001
                errors.append(f"ZDS delete: {e}")
        if hostset is not None:
            try:
                await hostset
            except (RulesError, OSError, ValueError) as e:
                errors.insert(0, f"host probe set: {e}")
        if not is_delete:
            # a live pod leaving the mesh: the annotation must go, so a failed write is
            # retried in the background with backoff; but, as upstream, not while the
            # removal itself failed (the pod may still be redirected: the control plane
            # must keep seeing it as captured)
            if not errors:
                self.status.ensure(_pod_ref(rec), None)
        else:
            # CNI DEL: the pod is going away; one attempt, as upstream ignores the error
            await self._set_status(rec, None)
        return errors

    # --- probe set entries following the Pod object ------------------------------------

    def pod_ips_seen(self, uid: str, ips: list[str]) -> None:
        """Upstream's probe set self-heal (``informers.go``: an enrolled pod whose IPs
        changed gets ``SyncHostProbeIPSet``), called by :mod:`cni.livepods` with a known
        pod's current ``status.podIPs`` (normalized): when they differ from the record's,
        its probe entries are upserted, and a record without IPs (recovered at start
        before kubelet published them) adopts them. Only looks and schedules."""
        rec = self.records.get(uid)
        if rec is None or not ips or set(ips) == set(rec.ips):
            return
        task = asyncio.get_running_loop().create_task(self._add_probe_ips(uid, ips),
                                                      name=f"probe-ips-{uid}")
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    async def _add_probe_ips(self, uid: str, ips: list[str]) -> None:
        async with self._lock(uid):  # never after an unenroll removed the pod's entries
            rec = self.records.get(uid)
            if rec is None or self.host_rules is None:
                return
            if not rec.ips:
                rec.ips = list(ips)
                log.info("%s: pod IPs now known (%s)", rec.label(), ", ".join(ips))
                if rec.status == "enabled":
                    self.state.save(rec)
            try:
                await self._blocking(self.host_rules.add_pod, uid, ips)
            except (RulesError, OSError, ValueError) as e:
                log.warning("%s: probe set entries for %s: %s", rec.label(), ", ".join(ips), e)

    # --- restart recovery -------------------------------------------------------------------
    #
    # Upstream's Server.Start: ConstructInitialSnapshot (every live enrolled pod, with its
    # netns when found) *before* the ztunnel server runs, so the first snapshot a ztunnel
    # gets names every pod; ztunnel shuts every proxy not named before SnapshotSent. Then
    # the informer's first events re-decide each pod. Here both happen in recover():
    # phase 1 decides and records, opens ZDS accepts; phase 2 does the slow per-pod work.

    async def recover(self) -> dict[str, str]:
        """Re-adopt pods enrolled before a restart. Returns ``{uid: outcome}``:
        ``enabled``, ``netns-missing``, ``failed``/``pending`` (a step failed; retried),
        ``dropped`` (netns and Pod object both gone: forgotten, never announced, so
        ztunnel drains its proxy) or ``unenrolled`` (no longer qualifies).

        1. Candidates: persisted records and (Kubernetes mode) pods of this node annotated
           ``enabled``; each netns is looked up (recorded path if it still holds the pod
           IP, else a ``/proc`` scan).
        2. Each is re-decided against its current Pod object as a fresh ADD would be
           (:meth:`_recovery_verdict`).
        3. Every kept pod is recorded in ZDS (``AddWorkload`` with its netns, ``Keep``
           without), then ZDS accepts are opened (:meth:`zds.ZdsServer.open_accept`).
        4. Then, per kept pod: rules reconciled, probe set, status; pods that no longer
           qualify are un-enrolled; the probe set is reconciled against the kept pods.
        """
        try:
            candidates = self._recovery_candidates()
            fds = await self._open_recovered_netns(candidates) if candidates else {}
            try:
                verdicts = {uid: self._recovery_verdict(rec, uid in fds)
                            for uid, rec in candidates.items()}
                kept = [candidates[u] for u, (v, _) in verdicts.items() if v == "keep"]
                await self._announce_recovered(kept, fds)
            except BaseException:
                for fd in fds.values():
                    os.close(fd)
                raise
        finally:
            zds = self._zds()
            if zds is not None and hasattr(zds, "open_accept"):
                zds.open_accept()
        if not candidates:
            await self._reconcile_probe_set({})  # entries of pods gone while we were not
            return {}
        outcomes: dict[str, str] = {}
        try:
            kept_results = await asyncio.gather(*(self._recover_kept(rec, fds.pop(rec.uid, None))
                                                  for rec in kept))
        finally:
            for fd in fds.values():
                os.close(fd)
        outcomes.update({rec.uid: s for rec, s in zip(kept, kept_results)})
        for uid, (verdict, why) in verdicts.items():
            if verdict != "keep":
                outcomes[uid] = await self._recover_leaving(candidates[uid], verdict, why)
        await self._reconcile_probe_set({r.uid: r for r in kept})
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
        try:
            pruned = await self.ctx.run_blocking(
                self.host_rules.sync, {r.uid: r.ips for r in wanted.values()})
            if pruned:
                log.info("removed stale probe set entries: %s", ", ".join(pruned))
        except (RulesError, OSError, ValueError) as e:
            log.error("probe set reconcile at start: %s", e)

    def _recovery_candidates(self) -> dict[str, PodRecord]:
        wanted: dict[str, PodRecord] = {r.uid: r for r in self.state.load()}
        for rec in self._enrolled_from_store():
            wanted.setdefault(rec.uid, rec)
        return wanted

    def _enrolled_from_store(self) -> list[PodRecord]:
        store = self._store()
        if store is None or self.ctx.config.config_source != "kubernetes":
            return []
        out = []
        try:
            pods = list(store.list("Pod"))
        except Exception as e:  # noqa: BLE001
            log.warning("config source pod list failed: %s", e)
            return out
        for pod in pods:
            meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
            annotations = meta.get("annotations") or {}
            if annotations.get(STATUS_ANNOTATION) != "enabled" or not meta.get("uid"):
                continue
            if spec.get("nodeName") not in (None, "", self.ctx.config.node_name):
                continue
            out.append(PodRecord(uid=meta["uid"], name=meta.get("name", ""),
                                 namespace=meta.get("namespace", ""),
                                 service_account=spec.get("serviceAccountName") or "default",
                                 ips=pod_status_ips(pod), annotations=dict(annotations)))
        return out

    def _pod_objects_known(self) -> bool:
        """Whether the config source has its full set of Pod objects (first load / LIST
        done), so a missing Pod object means the pod is gone. No source: unknown."""
        source = self.ctx.get("config-source")
        if source is None or getattr(source, "store", None) is None:
            return False
        try:
            return bool(source.ready()[0])
        except Exception:  # noqa: BLE001
            return False

    def _recovery_verdict(self, rec: PodRecord, netns_alive: bool) -> tuple[str, str]:
        """Decide a recovered pod as a fresh CNI ADD would (``cni.enablement.decide``).
        Returns ``(verdict, reason)``: ``keep``; ``drop`` (no netns and no Pod object:
        the pod is gone); ``unenroll`` (the Pod object says it no longer qualifies:
        another node, terminal, host network, not ambient, excluded namespace; its
        in-pod rules are removed when its netns is alive); ``unenroll-deleted`` (the
        same, but its sandbox is gone or terminal: nothing to remove inside it).

        Only a Pod object with the record's UID is this pod's: a same-named pod with
        another UID is a new pod. Without a synced config source nothing is dropped."""
        known = self._pod_objects_known()
        pod = None
        store = self._store()
        if store is not None:
            try:
                pod = store.pod_by_uid(rec.uid)
            except Exception as e:  # noqa: BLE001 - a broken store must not stop recovery
                log.warning("%s: config source lookup failed: %s", rec.label(), e)
                known = False
        if pod is None:
            if netns_alive:
                return "keep", "netns alive, no Pod object (enrolled by the plugin config)"
            if known:
                return "drop", "netns gone and no Pod object"
            return "keep", "netns not found; Pod objects not known yet (kept, retried)"
        meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
        gone = "unenroll" if netns_alive else "unenroll-deleted"
        node = spec.get("nodeName")
        if node and node != self.ctx.config.node_name:
            return gone, f"its Pod object is on node {node}, not {self.ctx.config.node_name}"
        phase = (pod.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed"):
            return "unenroll-deleted", f"pod is terminal (phase {phase})"
        event = CniPodEvent(command="ADD", container_id=rec.uid, netns=rec.netns,
                            pod_name=meta.get("name") or rec.name,
                            pod_namespace=meta.get("namespace") or rec.namespace,
                            pod_uid=rec.uid, ips=list(rec.ips))
        try:
            decision = enablement.decide(event, store, self.ctx.config.exclude_namespaces or (),
                                         pod=pod)
        except ValueError as e:  # a malformed selector: keep what was decided before
            log.warning("%s: cannot re-decide at restart: %s", rec.label(), e)
            return "keep", f"cannot re-decide ({e})"
        if not decision.ambient:
            return gone, decision.reason
        return "keep", decision.reason

    async def _open_recovered_netns(self, wanted: dict[str, PodRecord]) -> dict[str, int]:
        """``{uid: open netns fd}`` for the pods whose netns was found (caller closes);
        ``rec.netns`` is updated to where it was found."""
        found = await self._find_netns(wanted)
        fds: dict[str, int] = {}
        for uid, path in found.items():
            try:
                fds[uid] = netns_mod.open_netns(path)
                wanted[uid].netns = path
            except OSError as e:
                log.warning("%s: netns %s: %s", wanted[uid].label(), path, e)
        return fds

    async def _announce_recovered(self, kept: list[PodRecord], fds: dict[str, int]) -> None:
        """Record every kept pod in ZDS before any ztunnel is accepted: ``AddWorkload``
        with its netns, ``Keep`` when its netns is not found (so ztunnel keeps a proxy
        it still runs)."""
        import zds as zds_mod

        zds = self._zds()
        if zds is None:
            return
        for rec in kept:
            info = zds_mod.PodInfo(uid=rec.uid, name=rec.name, namespace=rec.namespace,
                                   service_account=rec.service_account,
                                   netns_fd=fds.get(rec.uid))
            try:
                await zds.add(info, wait_ack=False)
            except (ValueError, zds_mod.ZdsError) as e:
                log.error("%s: cannot record in ZDS at restart: %s", rec.label(), e)

    async def _recover_kept(self, rec: PodRecord, fd: int | None) -> str:
        """Phase 2 for a kept pod (already announced to ZDS): reconcile its rules, probe
        set, status; ``fd`` (closed here) is its netns, None when not found."""
        async with self._lock(rec.uid):
            self.records[rec.uid] = rec
            if fd is None:
                self._fail(rec, "netns", "netns not found (recorded path gone and no process "
                           "of this pod in /proc)", status="netns-missing")
                self._schedule_retry(rec)
                return rec.status
            try:
                opts = pod_options(self.base_options, rec.annotations)
                try:
                    await self._blocking(self._apply_rules, fd, opts, rec.netns)
                    rec.steps["rules"] = True
                except (LoopbackDown, RulesError, OSError) as e:
                    self._fail(rec, "rules", f"reconcile at start: {e}; restart the pod")
                try:
                    await self._remaining_steps(rec, fd, wait_ack=False, announce=False)
                except EnrollmentError:
                    self._schedule_retry(rec)
            finally:
                os.close(fd)
            return rec.status

    async def _recover_leaving(self, rec: PodRecord, verdict: str, why: str) -> str:
        """Forget a dropped pod (probe set entries, record; never announced to ZDS) or
        un-enroll one that no longer qualifies (its rules too when its netns is alive)."""
        if verdict == "drop":
            log.info("%s: %s: dropped (ztunnel drains its proxy)", rec.label(), why)
            if rec.ips and self.host_rules is not None:
                try:
                    await self.ctx.run_blocking(self.host_rules.remove_pod, rec.uid, rec.ips)
                except (RulesError, OSError, ValueError) as e:
                    log.warning("%s: probe set entries: %s", rec.label(), e)
            self.state.remove(rec.uid)
            return "dropped"
        log.info("%s: %s: removing it from the mesh", rec.label(), why)
        event = CniPodEvent(command="DEL", container_id=rec.uid, netns=rec.netns,
                            pod_name=rec.name, pod_namespace=rec.namespace, pod_uid=rec.uid,
                            ips=list(rec.ips))
        try:
            await self.unenroll(event, is_delete=verdict == "unenroll-deleted")
        except EnrollmentError as e:
            log.warning("un-enrolling %s at restart: %s", rec.label(), e)
        return "unenrolled"

    async def _find_netns(self, wanted: dict[str, PodRecord]) -> dict[str, str]:
        """``{uid: netns path}``: the recorded path when it still holds the pod IP, else a
        ``/proc`` scan (the returned path is ``<proc>/<pid>/ns/net``)."""
        def find() -> dict[str, str]:
            paths: dict[str, str] = {}
            recorded = [(uid, rec) for uid, rec in wanted.items()
                        if rec.netns and os.path.exists(rec.netns)]
            # each check enters the netns (on this private pool's thread, which is back
            # in the agent's netns after) and lists its addresses: a few syscalls, run
            # side by side since restart recovery waits for them
            with concurrent.futures.ThreadPoolExecutor(
                    max_workers=min(4, len(recorded) or 1),
                    thread_name_prefix="netns-check") as pool:
                held = pool.map(lambda item: podnetns.netns_holds_ip(
                    item[1].netns, item[1].ips, own_thread=False), recorded)
                for (uid, rec), ok in zip(recorded, held):
                    if ok:
                        paths[uid] = rec.netns
            missing = {u: r.ips for u, r in wanted.items() if u not in paths}
            if missing:
                for uid, hit in podnetns.scan(self.ctx.config.proc_dir, missing,
                                              self._host_netns).items():
                    os.close(hit.fd)
                    paths[uid] = hit.path
            return paths
        return await self.ctx.run_blocking(find)


def _answer_deadline(event: CniPodEvent) -> float | None:
    """Loop time by which the CNI ADD of ``event`` must be answered: the plugin's
    ``timeout`` less :data:`ANSWER_MARGIN`, from now; None when the plugin gave none."""
    if not event.timeout:
        return None
    return asyncio.get_running_loop().time() + max(0.0, event.timeout - ANSWER_MARGIN)


def _time_left(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    return max(0.0, deadline - asyncio.get_running_loop().time())


def _no_ztunnel_text(e) -> str:
    """The CNI error for an ADD no ztunnel took: upstream answers "no ztunnel
    connection" at once; we say which socket, how long we waited, and that the runtime
    should retry (the pod's rules stay and the agent keeps retrying in the background)."""
    return (f"no ztunnel connected to {e.socket} for {e.waited:.1f} s; retry (in-pod "
            "rules are in place; the agent hands the pod to ztunnel when one connects)")


def _pod_ref(rec: PodRecord) -> annotate.PodRef:
    return annotate.PodRef(uid=rec.uid, namespace=rec.namespace, name=rec.name)


def _rollback_outcome(problems: list[str]) -> str:
    return "rolled back" if not problems else "rollback incomplete: " + "; ".join(problems)


def _require_loopback_up(netns_label: str) -> None:
    """Raise :class:`LoopbackDown` unless ``lo`` of the calling thread's netns is up.
    ``SIOCGIFFLAGS`` on a socket made here (a socket belongs to the netns it was created
    in): ~10 µs, where a netlink dump costs ~1 ms."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            ifreq = fcntl.ioctl(sock.fileno(), SIOCGIFFLAGS, struct.pack("16sH14x", b"lo", 0))
        flags, state = struct.unpack("16sH14x", ifreq)[1], "down"
    except OSError as e:
        flags, state = 0, f"unusable ({e.strerror})"
    if not flags & IFF_UP:
        raise LoopbackDown(f"loopback interface 'lo' in the pod netns {netns_label} is {state} "
                           "(the runtime brings it up before running chained plugins: the "
                           "sandbox is broken or something set lo down)")


def _ipset_exists(name: str, netns: str | None) -> bool:
    """Whether ipset ``name`` exists in the node netns (``netns`` path, None = ours)."""
    from pyroute2 import IPSet
    from pyroute2.netlink.exceptions import NetlinkError

    def probe() -> bool:
        try:
            with IPSet() as ipset:
                list(ipset.list(name))  # a generator: errors surface only when consumed
            return True
        except (NetlinkError, OSError):
            return False
    return netns_mod.run_in_netns(netns, probe) if netns else probe()


def build(ctx: AgentContext) -> Enrollment:
    """Builder for ``agent.daemon.COMPONENT_BUILDERS`` (after ``zds``, before ``cni-events``)."""
    return Enrollment(ctx)
