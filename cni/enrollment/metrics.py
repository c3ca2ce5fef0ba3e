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
"""

from __future__ import annotations

import weakref

from prometheus_client import CollectorRegistry, Counter


class EnrollmentMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.reconcile_events = Counter(
            "nodeagent_reconcile_events", "The total number of node agent reconcile events.",
            ["type"], registry=registry)
        self.repaired = Counter(
            "istio_cni_repair_pods_repaired", "Total number of pods repaired by repair "
            "controller", ["type", "result"], registry=registry)
        # ours (no upstream counterpart): recovery/_netns_missing
        self.netns_missing = Counter(
            "ambient_agent_recovery_netns_missing", "Pods recorded as enrolled whose network "
            "namespace was not found at agent start", registry=registry)

    def event(self, old: object, new: object) -> None:
        """Count one store change: no old object → add, no new one → delete."""
        kind = "add" if old is None else "delete" if new is None else "update"
        self.reconcile_events.labels(kind).inc()


_OF: "weakref.WeakKeyDictionary[CollectorRegistry, EnrollmentMetrics]" = \
    weakref.WeakKeyDictionary()


def of(registry: CollectorRegistry) -> EnrollmentMetrics:
    """The metrics registered in ``registry`` (registered on first use)."""
    metrics = _OF.get(registry)
    if metrics is None:
        metrics = _OF[registry] = EnrollmentMetrics(registry)
    return metrics
