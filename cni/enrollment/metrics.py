"""istio-cni's node-agent metrics that enrollment and repair keep (upstream's names and labels).

``nodeagent_reconcile_events_total{type}`` (upstream ``cni/pkg/nodeagent/informers.go``):
Pod and Namespace changes the node agent handled, ``type`` ``add``, ``update`` or
``delete``. ``istio_cni_repair_pods_repaired_total{type,result}`` (upstream
``cni/pkg/repair/monitoring.go``): pods the repair handled, ``type`` ``label`` or
``delete``, ``result`` ``success``, ``skip`` or ``fail``.
``ambient_agent_recovery_netns_missing_total`` (ours): recorded pods whose netns was
not found at start (:meth:`cni.enrollment.recovery.Recovery._netns_missing`). Registered
once per registry
(:func:`of`), so building a second reconciler on the same context reuses them.

Ours (no upstream equivalent): ``ambient_agent_cni_add_stage_seconds{stage}``, a
histogram of how long each stage of an ambient pod's CNI ADD took in the agent, in
seconds, one observation per stage that ran (a failed stage is observed too; the stages
after it are not, except those already running beside it). ``stage``, in pipeline
order (:data:`ADD_STAGES`): ``lookup`` (the Pod object in the config source's store,
waited for when the watch has not delivered it yet), ``netns`` (opening the pod netns),
``rules`` (the in-pod rules, on a worker thread), ``zds`` (handing the pod to ztunnel
and waiting for its ACK), ``hostset`` (the host probe set entry), ``state`` (the record
in the state dir), ``status`` (the ``ambient.istio.io/redirection`` annotation PATCH).
``hostset`` runs while ``zds`` waits, ``state`` and ``status`` while ``rules`` and
``zds`` run (:meth:`cni.enrollment.dataplane.Dataplane.run`; for a live enrollment
beside ``zds`` only), so the stages' times overlap and do not add up to the ADD; each is
the time of its own work. The whole ADD,
as the plugin waits for it, is ``ambient_agent_cni_add_seconds`` of the CNI event
server.
"""

from __future__ import annotations

import functools
import weakref

from prometheus_client import CollectorRegistry, Counter, Histogram

ADD_STAGES = ("lookup", "netns", "rules", "zds", "hostset", "state", "status")
# seconds: an exec of iptables-restore is ~2-5 ms, an API PATCH ~5-50 ms, a ZDS ack < 1 ms
STAGE_BUCKETS = (.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5)


class EnrollmentMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.reconcile_events = Counter(
            "nodeagent_reconcile_events", "The total number of node agent reconcile events.",
            ["type"], registry=registry)
        # each type's child looked up once (on first use, so a type never seen has no
        # series, as before): event() runs for every object change of the cluster, and
        # labels() takes a lock and builds a key each time
        self._event_child = functools.cache(self.reconcile_events.labels)
        self.repaired = Counter(
            "istio_cni_repair_pods_repaired", "Total number of pods repaired by repair "
            "controller", ["type", "result"], registry=registry)
        # ours (no upstream counterpart): recovery/_netns_missing
        self.netns_missing = Counter(
            "ambient_agent_recovery_netns_missing", "Pods recorded as enrolled whose network "
            "namespace was not found at agent start", registry=registry)
        self.add_stage = Histogram(
            "ambient_agent_cni_add_stage_seconds", "time of one stage of an ambient pod's CNI "
            "ADD in the agent, seconds", ["stage"], registry=registry, buckets=STAGE_BUCKETS)

    def event(self, old: object, new: object) -> None:
        """Count one store change: no old object → add, no new one → delete."""
        kind = "add" if old is None else "delete" if new is None else "update"
        self._event_child(kind).inc()

    def stage(self, name: str, seconds: float) -> None:
        """Observe one ADD stage (``name`` one of :data:`ADD_STAGES`) that took ``seconds``."""
        self.add_stage.labels(name).observe(seconds)


_OF: "weakref.WeakKeyDictionary[CollectorRegistry, EnrollmentMetrics]" = \
    weakref.WeakKeyDictionary()


def of(registry: CollectorRegistry) -> EnrollmentMetrics:
    """The metrics registered in ``registry`` (registered on first use)."""
    metrics = _OF.get(registry)
    if metrics is None:
        metrics = _OF[registry] = EnrollmentMetrics(registry)
    return metrics
