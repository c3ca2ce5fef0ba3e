"""The enrollment pipeline for one pod: open netns -> in-pod rules -> ZDS add -> host probe
set -> status, written once, with the failure policy as a parameter; and its inverse
(rollback of a failed or cancelled ADD, removal of an enrolled pod). For a CNI ADD the
record and the status run beside the rules and the ZDS add (:meth:`Dataplane.run`).

Upstream: ``cni/pkg/nodeagent/net.go`` (``AddPodToMesh``: rules, then ztunnel, then
the probe set; ``RemovePodFromMesh(pod, isDelete)``) and ``meshdataplane_linux.go``.
Three callers, three policies (:data:`ADD`, with its variant :data:`LIVE` for a running
pod the watch enrolls; :data:`RETRY`, :data:`RECOVER`):

================  ===============================  ==============================
policy            rules step fails                 a later step fails
================  ===============================  ==============================
``ADD``           rules rolled back; the ADD fails  retryable error (rules kept:
                  for good (no retry)              fail closed); if the netns
                                                   vanished meanwhile, everything
                                                   is rolled back instead
``RETRY``         recorded; this attempt fails      retryable error
                  (retried with backoff)
``RECOVER``       recorded ("restart the pod"); the retryable error; ZDS was told
                  later steps still run             already (no announce, no ack)
================  ===============================  ==============================

Only ``ADD`` (and ``LIVE``) rolls back when cancelled (a CNI DEL during the ADD, or shutdown).
Every blocking call runs on the agent's executor; a cancelled caller waits for the
worker thread to finish first (a thread can't be stopped, and a rollback racing a
half-applied ruleset in another thread would leave rules behind).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from typing import Any, Callable, Protocol, TypeVar

from cni import annotate
from cni.enrollment.api import NetnsGone, NetnsOps, ProbeSet, ZdsChannel, ZdsPod, \
    ZdsRejected, ZtunnelUnavailable
from cni.enrollment.kernel import LoopbackDown
from cni.enrollment.records import PodRecord, PodState, PodStateStore, Step
from cni.events import EnrollmentError
from cni.rules_common import RuleOptions, RulesError, pod_options
from cni.rules_detect import Backend as RulesBackend

log = logging.getLogger(__name__)
T = TypeVar("T")


class OnRulesFailure(enum.Enum):
    """What a failed rules step does to the rest of the pipeline."""

    ROLLBACK = "rollback"  # undo the rules; the enrollment fails for good
    FAIL = "fail"          # keep what is there; this attempt fails (retried)
    CONTINUE = "continue"  # record it; run the remaining steps anyway


@dataclasses.dataclass(frozen=True)
class FailurePolicy:
    """How one run of the pipeline reacts to failures (see the module's table).

    ``announce``: send the pod to ZDS (False: restart recovery recorded it already);
    ``wait_ack``: wait for ztunnel's ACK; ``guard_netns``: roll everything back when the
    netns vanished during the run; ``rollback_on_cancel``: undo every step when
    cancelled; ``rules_hint``: appended to a recorded rules failure;
    ``status_beside_zds``: persist the record and write the status while ztunnel's ACK
    is awaited; ``status_beside_rules`` (with ``status_beside_zds``): start them before
    the in-pod rules instead, so they run beside the rules and the ACK (see
    :meth:`Dataplane.run`); ``timed``: observe each stage's duration
    (``observe_stage``)."""

    name: str
    on_rules_failure: OnRulesFailure
    announce: bool = True
    wait_ack: bool = True
    guard_netns: bool = False
    rollback_on_cancel: bool = False
    rules_hint: str = ""
    status_beside_zds: bool = False
    status_beside_rules: bool = False
    timed: bool = False


# a CNI ADD: the runtime starts none of the pod's containers before it is answered
ADD = FailurePolicy("add", OnRulesFailure.ROLLBACK, guard_netns=True, rollback_on_cancel=True,
                    status_beside_zds=True, status_beside_rules=True, timed=True)
# a running pod enrolled live (the watch): its traffic flows while it is enrolled, so the
# status waits for its rules (see Dataplane.run)
LIVE = dataclasses.replace(ADD, name="live", status_beside_rules=False)
RETRY = FailurePolicy("retry", OnRulesFailure.FAIL)
RECOVER = FailurePolicy("recover", OnRulesFailure.CONTINUE, announce=False, wait_ack=False,
                        rules_hint="; restart the pod")


class RunBlocking(Protocol):
    async def __call__(self, fn: Callable[..., T], *args: Any) -> T: ...


class Dataplane:
    """The pipeline's steps over the injected parts. ``records`` is the reconciler's map
    (a rolled-back pod leaves it); ``status`` writes the redirection annotation;
    ``observe_stage(stage, seconds)``, when given, is told how long each stage of an
    :data:`ADD` (or :data:`LIVE`) run took (``rules``, ``zds``, ``hostset``, ``state``, ``status``; the
    ``ambient_agent_cni_add_stage_seconds`` histogram of :mod:`cni.enrollment.metrics`)."""

    def __init__(self, *, run_blocking: RunBlocking, netns: NetnsOps,
                 backend: RulesBackend | None,
                 host_rules: ProbeSet | None, zds: ZdsChannel | None,
                 status: annotate.RedirectionStatus, state: PodStateStore,
                 base_options: RuleOptions, records: dict[str, PodRecord],
                 observe_stage: Callable[[str, float], None] | None = None):
        self.run_blocking = run_blocking
        self.netns = netns
        self.backend = backend
        self.host_rules = host_rules
        self.zds = zds
        self.status = status
        self.state = state
        self.base_options = base_options
        self.records = records
        self.observe_stage = observe_stage
        # what stage durations are measured with (seconds); tests set a manual clock
        self.clock: Callable[[], float] = time.monotonic

    @property
    def rules(self) -> RulesBackend:
        """The rules backend (chosen when enrollment starts). Raises RuntimeError before."""
        if self.backend is None:
            raise RuntimeError("the in-pod rules backend is chosen when enrollment starts")
        return self.backend

    def _timed(self, policy: FailurePolicy, stage: str, started: float) -> None:
        """Observe ``stage`` of an ADD run, begun at monotonic ``started``."""
        if policy.timed and self.observe_stage is not None:
            self.observe_stage(stage, self.clock() - started)

    async def blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """``run_blocking`` that, when cancelled, first waits for the worker thread."""
        fut = asyncio.ensure_future(self.run_blocking(fn, *args))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            await asyncio.wait([fut])
            if not fut.cancelled():
                fut.exception()  # retrieved: the caller rolls back whatever it did
            raise

    def options(self, rec: PodRecord) -> RuleOptions:
        return pod_options(self.base_options, rec.annotations)

    # --- the pipeline ------------------------------------------------------------------

    async def run(self, rec: PodRecord, fd: int, policy: FailurePolicy,
                  known: bool = True) -> None:
        """Rules, then :meth:`remaining_steps`, in the netns ``fd`` (the caller closes
        it), under ``policy``. ``known``: the agent had a record of the pod (its netns
        is looked at for rules before applying). Raises :class:`EnrollmentError`
        (``retryable`` set when a retry can fix it).

        With ``policy.status_beside_rules`` (a CNI ADD) the record and the ``enabled``
        status (:meth:`_persist_and_annotate`) start before the rules, so the ADD waits
        for ``max(rules + ZDS, record + PATCH)`` rather than their sum. Upstream
        annotates only after the rules, ztunnel's ACK and the probe set; the reason this
        is safe for a CNI ADD (and only for one) is the one of :meth:`remaining_steps`:
        no container of the pod runs before the ADD is answered, so nothing can act on
        the annotation meanwhile, and the ADD is answered only after every step is
        done, the status write included (a failed write still fails it, as upstream).
        The write is awaited before anything is reported or rolled back, so a pod never
        has two writes in flight; a rules failure then removes the annotation and the
        record again (:meth:`_undo_early`), a cancellation's :meth:`rollback_all` does
        too. A running pod enrolled live (:data:`LIVE`) keeps the status after its rules:
        its traffic flows meanwhile, and peers that read ``enabled`` before its rules
        are in would send it HBONE nothing listens for."""
        inode = self.netns.inode(fd)
        opts = self.options(rec)
        try:
            await self._run(rec, fd, opts, inode, policy, known)
        except asyncio.CancelledError:
            if policy.rollback_on_cancel:  # undo whatever ran, then stay cancelled
                rec.rollback_problems = await self.rollback_all(rec, fd, opts)
            raise

    async def _run(self, rec: PodRecord, fd: int, opts: RuleOptions, inode: int,
                   policy: FailurePolicy, known: bool) -> None:
        early: asyncio.Future | None = None
        if policy.status_beside_rules and policy.status_beside_zds and policy.announce:
            early = asyncio.ensure_future(self._persist_and_annotate(rec, policy))
        started = self.clock()
        try:
            try:
                outcome = await self.blocking(self.netns.apply_rules, fd, self.rules, opts,
                                              rec.netns, known)
            except (LoopbackDown, RulesError, OSError) as e:
                self._timed(policy, "rules", started)
                await self._rules_failed(rec, fd, opts, policy, e, early)
            else:
                self._timed(policy, "rules", started)
                rec.steps[Step.RULES] = True
                (log.info if policy.timed else log.debug)(
                    "%s: in-pod rules %s (%s)", rec.label(), outcome, self.rules.name)
        except BaseException:
            # cancelled (the rollback follows) or failed: the write beside the rules
            # finishes first, so what it did is in rec.steps and no second write overlaps it
            await settled(early)
            raise
        try:
            await self.remaining_steps(rec, fd, policy, early)
        except EnrollmentError as e:
            if policy.guard_netns and not self.netns.holds(rec.netns, inode):
                problems = await self.rollback_all(rec, fd, opts)
                raise EnrollmentError(f"{rec.label()}: netns {rec.netns} disappeared during "
                                      f"enrollment; {rollback_outcome(problems)} ({e})"
                                      ) from None
            raise
        if policy.guard_netns and not self.netns.holds(rec.netns, inode):
            problems = await self.rollback_all(rec, fd, opts)
            raise EnrollmentError(f"{rec.label()}: netns {rec.netns} disappeared during "
                                  f"enrollment; {rollback_outcome(problems)}")

    async def _rules_failed(self, rec: PodRecord, fd: int, opts: RuleOptions,
                            policy: FailurePolicy, e: Exception,
                            early: asyncio.Future | None = None) -> None:
        """Apply ``policy`` to a failed rules step: raise, or return to carry on.
        ``early``: the record and status write started beside the rules (undone when the
        enrollment fails for good)."""
        if policy.on_rules_failure is OnRulesFailure.CONTINUE:
            rec.fail(Step.RULES, f"reconcile at start: {e}{policy.rules_hint}")
            return
        if policy.on_rules_failure is OnRulesFailure.FAIL:
            rec.fail(Step.RULES, str(e))
            raise EnrollmentError(f"{rec.label()}: in-pod rules failed: {e}", True) from None
        if isinstance(e, LoopbackDown):  # checked before any rule: nothing to roll back
            undone = await self._undo_early(rec, early)
            rec.fail(Step.RULES, str(e))
            raise EnrollmentError(f"{rec.label()}: {e}; nothing was applied"
                                  + "".join(f"; {p}" for p in undone)) from None
        problems = await self.rollback_rules(fd, opts)
        problems += await self._undo_early(rec, early)
        rec.fail(Step.RULES, str(e))  # last: the rules failure is what the record says
        raise EnrollmentError(f"{rec.label()}: in-pod rules failed "
                              f"({rollback_outcome(problems)}): {e}") from None

    async def _undo_early(self, rec: PodRecord, early: asyncio.Future | None) -> list[str]:
        """The rules failed for good: once the record and status write started beside
        them is done, the record goes and an ``enabled`` written is removed
        (:meth:`_settle_status`: retried in the background if the removal fails).
        Returns what is not undone yet (empty: all done)."""
        if early is None:
            return []
        await settled(early)
        if rec.steps.get(Step.STATE):
            rec.steps[Step.STATE] = False
            self.state.remove(rec.uid)
        if rec.steps.get(Step.STATUS) and not await self._settle_status(rec, None):
            return ["status annotation: not removed yet (retried in the background)"]
        return []

    async def remaining_steps(self, rec: PodRecord, fd: int | None,
                              policy: FailurePolicy, early: asyncio.Future | None = None
                              ) -> None:
        """ZDS add (when ``policy.announce``) and, side by side with it, the host probe
        set entry and (``policy.status_beside_zds``) the record and the status (``early``:
        that write, when :meth:`run` already started it beside the rules); the record is
        enabled once all succeeded. Raises retryable :class:`EnrollmentError`.

        The probe set entry (host netns, an upsert) does not wait for ztunnel's ACK:
        neither depends on the other, and the entry only makes kubelet's probes of this
        IP leave the node with the SNAT source the in-pod rules let through (upstream adds
        it after ztunnel's ACK, ``addPodToHostAddrSet``; it is as harmless before, and a
        pod left pending by ZDS still passes its probes).

        The status: upstream writes it last, after the ACK and the probe set
        (``AnnotateEnrolledPod``). For a CNI ADD (:data:`ADD`) it is written while the
        ACK is awaited instead (started before the rules even, :meth:`run`), with the
        record persisted first (a pod whose record can't be written is never annotated),
        because nothing can act on it before the ADD is answered: the runtime starts
        none of the pod's containers before that, so no traffic to or from the pod
        exists whose path the annotation (HBONE to it, in the control plane and our own
        index) could change, and a failed ADD leaves no running pod behind. A running
        pod enrolled live (:data:`LIVE`) has it written here, after its rules: it is
        redirected by then, and until ztunnel holds it its traffic fails with or
        without the annotation. Everything finishes before anything is reported or
        rolled back, and a failure corrects what was written (:meth:`_settle_status`):
        a ZDS failure writes ``pending`` after the ``enabled`` write is done (never the
        two in flight at once), as upstream's partial enrollment; a probe set failure
        ``pending`` too; a pod that can't be described to ZDS, or a rollback, removes
        it. Other policies (retries, restart recovery, where the pod may run) keep
        upstream's order: record, then status, after the ACK and the probe set."""
        hostset = asyncio.ensure_future(self._hostset(rec, policy))
        if early is None and policy.status_beside_zds and policy.announce:
            early = asyncio.ensure_future(self._persist_and_annotate(rec, policy))
        try:
            await self._zds_add(rec, fd, policy, early)
        except BaseException:
            await settled(hostset, early)  # the ZDS failure is what is reported
            if early is not None and not early.cancelled() and early.exception() is None \
                    and rec.steps.get(Step.STATUS) and not rec.steps.get(Step.ZDS):
                # a pod ZDS can't describe fails for good: its annotation goes
                await self._settle_status(rec, None)
            raise
        rec.steps[Step.ZDS] = True
        failure = await hostset
        if failure is not None:
            if early is not None:
                await settled(early)  # the probe set failure is what is reported
                if rec.steps.get(Step.STATUS):
                    await self._settle_status(rec, annotate.PENDING)
            rec.fail(Step.HOSTSET, str(failure), status=PodState.PENDING)
            raise EnrollmentError(f"{rec.label()}: host probe set: {failure}; will retry",
                                  True) from None
        if early is None:
            await self._persist_and_annotate(rec, policy)
        else:
            await early  # its EnrollmentError (record or status not written) is ours
        rec.enabled()

    async def _persist_and_annotate(self, rec: PodRecord, policy: FailurePolicy) -> None:
        """Persist the record, then write the status ``enabled``; ``steps[STATE]`` and
        ``steps[STATUS]`` set as each is done. Raises retryable :class:`EnrollmentError`
        (the record's state says which failed); nothing is annotated when the record
        could not be written."""
        # persisted before the status says "enabled": a pod whose record can't be written
        # (the state dir's filesystem full, read-only) is never reported enrolled, to the
        # runtime or in its annotation, while a restart could not recover it
        started = self.clock()
        try:
            try:
                self.state.save(rec)
            finally:
                self._timed(policy, "state", started)
        except OSError as e:
            why = (f"cannot record the pod in the state dir {self.state.dir}: "
                   f"{e.strerror or e} (errno {e.errno})")
            rec.fail(Step.STATE, why, status=PodState.PENDING)
            raise EnrollmentError(f"{rec.label()}: {why}; will retry", True) from None
        rec.steps[Step.STATE] = True
        started = self.clock()
        written = await self.set_status(rec, "enabled")
        self._timed(policy, "status", started)
        if not written:
            rec.fail(Step.STATUS, "status annotation patch failed", status=PodState.PENDING)
            raise EnrollmentError(f"{rec.label()}: could not write status annotation; "
                                  "will retry", True)
        rec.steps[Step.STATUS] = True

    async def _settle_status(self, rec: PodRecord, value: str | None) -> bool:
        """Correct an ``enabled`` written beside the rules or the ZDS hand-off after a
        later failure: one attempt now, then retried in the background until written
        (the pod must not stay annotated captured while it is not). True when the
        attempt now wrote it."""
        rec.steps[Step.STATUS] = False
        if await self.set_status(rec, value):
            return True
        self.status.ensure(pod_ref(rec), value)
        return False

    async def _zds_add(self, rec: PodRecord, fd: int | None, policy: FailurePolicy,
                       early: asyncio.Future | None = None) -> None:
        """Hand the pod to ztunnel (when ``policy.announce``) and wait for its ACK (when
        ``policy.wait_ack``). Raises :class:`EnrollmentError` (retryable unless the pod
        cannot be described to ZDS). ``early``: the record and status write running
        beside it (:meth:`remaining_steps`), awaited before ``pending`` is written."""
        zds = self.zds
        if not policy.announce:
            return
        if zds is None:
            rec.fail(Step.ZDS, "no ZDS server component", status=PodState.PENDING)
            raise EnrollmentError(f"{rec.label()}: this agent runs no ZDS server", True)
        pod = ZdsPod(uid=rec.uid, name=rec.name, namespace=rec.namespace,
                     service_account=rec.service_account, netns_fd=fd)
        started = self.clock()
        try:
            try:
                await zds.add(pod, wait_ack=policy.wait_ack,
                              ztunnel_wait=time_left(rec.answer_by))
            finally:
                self._timed(policy, "zds", started)
        except ZtunnelUnavailable as e:
            rec.fail(Step.ZDS, str(e), status=PodState.PENDING)
            await self._pending(rec, early)
            raise EnrollmentError(f"{rec.label()}: {no_ztunnel_text(e)}", True) from None
        except ZdsRejected as e:
            rec.fail(Step.ZDS, f"{e.kind}: {e}", status=PodState.PENDING)
            await self._pending(rec, early)
            raise EnrollmentError(f"{rec.label()}: ztunnel did not accept the pod "
                                  f"({e.kind}: {e}); will retry", True) from None
        except ValueError as e:  # a pod ZDS can't describe (e.g. too large for ztunnel)
            rec.fail(Step.ZDS, str(e))
            raise EnrollmentError(f"{rec.label()}: cannot be handed to ztunnel: {e}"
                                  ) from None

    async def _pending(self, rec: PodRecord, early: asyncio.Future | None) -> None:
        """Write ``pending`` (rules in, no ztunnel took the pod), after the ``enabled``
        write beside the hand-off, if any, is done."""
        if early is None:
            await self.set_status(rec, "pending")
            return
        await settled(early)  # its failure, if any, is not what is reported
        await self._settle_status(rec, annotate.PENDING)

    async def _hostset(self, rec: PodRecord, policy: FailurePolicy) -> Exception | None:
        """Upsert the pod's probe set entries; ``steps[HOSTSET]`` set when done. Returns
        the failure (RulesError, OSError, ValueError) instead of raising it."""
        started = self.clock()
        try:
            if self.host_rules is None:
                raise RulesError("host probe rules not set up")
            await self.blocking(self.host_rules.add_pod, rec.uid, rec.ips)
        except (RulesError, OSError, ValueError) as e:
            return e
        finally:
            self._timed(policy, "hostset", started)
        rec.steps[Step.HOSTSET] = True
        return None

    async def set_status(self, rec: PodRecord, value: str | None) -> bool:
        """Write ``ambient.istio.io/redirection`` (None removes it) through the config
        source (:mod:`cni.annotate`), one attempt; True when done or nothing to write.
        A failure is logged with the pod's name; the caller's retry covers it."""
        return await self.status.write(pod_ref(rec), value)

    # --- undo --------------------------------------------------------------------------

    async def rollback_rules(self, fd: int, opts: RuleOptions) -> list[str]:
        """Delete the in-pod rules; returns what could not be undone (empty: all done)."""
        try:
            await self.blocking(self.netns.delete_rules, fd, self.rules, opts.ipv6, None)
        except (RulesError, OSError) as e:
            log.warning("rollback of in-pod rules failed: %s", e)
            return [f"in-pod rules: {e}"]
        return []

    async def rollback_all(self, rec: PodRecord, fd: int, opts: RuleOptions) -> list[str]:
        """Undo every step of a failed or cancelled enrollment; returns what could not be
        undone. ZDS delete always: the server records the pod even when unacked."""
        problems: list[str] = []
        if self.zds is not None:
            try:
                await self.zds.delete(rec.uid)
            except Exception as e:  # noqa: BLE001
                log.warning("%s: ZDS delete during rollback: %s", rec.label(), e)
                problems.append(f"ZDS delete: {e}")
        if rec.steps.get(Step.HOSTSET) and self.host_rules is not None:
            try:
                await self.blocking(self.host_rules.remove_pod, rec.uid, rec.ips)
            except (RulesError, OSError, ValueError) as e:
                log.warning("%s: probe set rollback: %s", rec.label(), e)
                problems.append(f"host probe set: {e}")
        problems += await self.rollback_rules(fd, opts)  # harmless when none applied
        if rec.steps.get(Step.STATUS):  # written beside the hand-off: the pod isn't captured
            rec.steps[Step.STATUS] = False
            if not await self.set_status(rec, None):
                problems.append("status annotation: not removed")
        if self.records.get(rec.uid) is rec:
            self.records.pop(rec.uid, None)
        self.state.remove(rec.uid)
        return problems

    async def remove(self, rec: PodRecord, netns_path: str, is_delete: bool = True
                     ) -> list[str]:
        """Take an enrolled pod out: in-pod rules (when ``netns_path``), with the probe set
        entries removed while the rules' deleting transaction waits for the kernel (they
        live in another netns and neither depends on the other; started earlier, their
        netlink work would compete with the rules' look at the pod netns); ZDS delete
        only after the rules are gone, so ztunnel never drains a proxy that traffic is
        still sent to; then the status annotation. Returns the steps that failed."""
        errors: list[str] = []
        loop = asyncio.get_running_loop()
        hostset: asyncio.Future | None = None
        host_rules = self.host_rules

        def start_hostset() -> None:
            nonlocal hostset
            if hostset is None and host_rules is not None:  # by owner: IPs may be unknown
                hostset = asyncio.ensure_future(
                    self.run_blocking(host_rules.remove_pod, rec.uid, rec.ips))

        if netns_path and self.netns.exists(netns_path):
            opts = self.options(rec)

            def during() -> None:  # the kernel is busy with the deleting transaction
                try:
                    loop.call_soon_threadsafe(start_hostset)
                except RuntimeError:  # loop closing: the entries go below or not at all
                    pass
            try:
                await self.run_blocking(self.netns.delete_rules, netns_path, self.rules,
                                        opts.ipv6, during)
            except NetnsGone:
                pass  # vanished between the check and the entry: nothing left to clean
            except (RulesError, OSError) as e:
                errors.append(f"in-pod rules: {e}")
        start_hostset()  # not started during the deletion (no rules, or it failed first)
        if self.zds is not None:
            try:
                await self.zds.delete(rec.uid)
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
                self.status.ensure(pod_ref(rec), None)
        else:
            # CNI DEL: the pod is going away; one attempt, as upstream ignores the error
            await self.set_status(rec, None)
        return errors


async def settled(*tasks: asyncio.Future | None) -> None:
    """Wait until every task given (None: skipped) is done, whatever happened to it; their
    exceptions are retrieved (the caller reports a failure of its own)."""
    running = [t for t in tasks if t is not None]
    if running:
        await asyncio.wait(running)
    for t in running:
        if not t.cancelled():
            t.exception()


def time_left(deadline: float | None) -> float | None:
    """Seconds from now to loop time ``deadline`` (at least 0); None without one."""
    if deadline is None:
        return None
    return max(0.0, deadline - asyncio.get_running_loop().time())


def no_ztunnel_text(e: ZtunnelUnavailable) -> str:
    """The CNI error for an ADD no ztunnel took: upstream answers "no ztunnel
    connection" at once; we say which socket, how long we waited, and that the runtime
    should retry (the pod's rules stay and the agent keeps retrying in the background)."""
    return (f"no ztunnel connected to {e.socket} for {e.waited:.1f} s; retry (in-pod "
            "rules are in place; the agent hands the pod to ztunnel when one connects)")


def pod_ref(rec: PodRecord) -> annotate.PodRef:
    return annotate.PodRef(uid=rec.uid, namespace=rec.namespace, name=rec.name)


def rollback_outcome(problems: list[str]) -> str:
    return "rolled back" if not problems else "rollback incomplete: " + "; ".join(problems)
