"""What every part of the ambient index shares (``ambient/index.py`` wires the parts):
the store being followed, the mesh settings, the dirty marks of the next flush, the
serialized outputs, and how a bad object is rejected.

The parts, one per output (``docs/ambient.md``): :mod:`ambient.index_gateways`
(waypoints, network gateways, the mesh network), :mod:`ambient.index_services`
(Service addresses), :mod:`ambient.index_slices` (EndpointSlice endpoints),
:mod:`ambient.index_policies` (Authorizations) and :mod:`ambient.index_workloads`
(Workload addresses).
"""

from __future__ import annotations

import dataclasses
import logging

from prometheus_client import Counter

from ambient import workload_pb2 as wl
from ambient.index_outputs import Outputs
from ambient.objects import Mesh, TranslateError, labels, meta, spec
from ambient.store import ObjectStore

log = logging.getLogger(__name__)

PodKey = tuple[str, str]  # (namespace, name)
LocalKey = tuple[str, str, str]  # (kind, namespace, name) of a local-config object
SourceKey = tuple[str, str, str]  # (kind, namespace, name) of the object an output came from
Produced = list[tuple[wl.Workload, tuple[str, ...]]]  # workloads + their waypoint keys

# what a translator raises on a malformed object: the object is skipped, never the index
BAD_OBJECT = (TranslateError, KeyError, TypeError, ValueError, AttributeError)


def subset(selector: dict[str, str], lbls: dict[str, str]) -> bool:
    """Whether every ``selector`` label is in ``lbls`` with the same value."""
    return all(lbls.get(k) == v for k, v in selector.items())


def policy_selector(obj: dict) -> dict[str, str] | None:
    """``spec.selector.matchLabels`` of an AuthorizationPolicy / PeerAuthentication:
    None without a selector, ``{}`` for an empty one."""
    sel = spec(obj).get("selector")
    if not isinstance(sel, dict):
        return None
    ml = sel.get("matchLabels") or {}
    return ml if isinstance(ml, dict) else None


@dataclasses.dataclass
class Dirty:
    """What the next flush recomputes. :meth:`reset` replaces every set with a fresh one:
    an emptied set keeps its grown table and ``pop()`` then scans it, which would make
    every later single-pod change cost O(cluster)."""

    full: bool = False
    # a full flush is under way: every pod, WorkloadEntry, ServiceEntry and EndpointSlice
    # is marked already, so the marking of an object's selected members is skipped (at
    # 5k pods it was a scan of each namespace's pods per Service and policy)
    everything: bool = False
    hosts: set[str] = dataclasses.field(default_factory=set)
    pods: set[PodKey] = dataclasses.field(default_factory=set)
    wes: set[PodKey] = dataclasses.field(default_factory=set)
    ses: set[PodKey] = dataclasses.field(default_factory=set)
    slices: set[PodKey] = dataclasses.field(default_factory=set)
    policies: set[PodKey] = dataclasses.field(default_factory=set)
    local: set[LocalKey] = dataclasses.field(default_factory=set)
    pa: bool = False

    def any(self) -> bool:
        return bool(self.full or self.hosts or self.pods or self.wes or self.ses or self.slices
                    or self.policies or self.local or self.pa)

    def reset(self) -> None:
        # field by field, not through dataclasses.fields() and a fresh Dirty: this runs
        # after every flush, i.e. once per watch read (tests/ambient/test_index_dirty.py
        # checks that every field is reset)
        self.full = self.everything = self.pa = False
        self.hosts, self.pods, self.wes, self.ses = set(), set(), set(), set()
        self.slices, self.policies, self.local = set(), set(), set()


@dataclasses.dataclass
class IndexBase:
    """The state every part reads: ``mesh`` is ``base_mesh`` with the network the system
    namespace's label names (replaced by :mod:`ambient.index_gateways`)."""

    store: ObjectStore
    base_mesh: Mesh
    mesh: Mesh
    dirty: Dirty
    outputs: Outputs
    rejected: Counter

    def reject(self, kind: str, ns: str, name: object, error: Exception) -> None:
        """Count and log one skipped object (``ambient_agent_index_rejected_total{kind}``)."""
        self.rejected.labels(kind).inc()
        log.warning("skipping %s %s/%s: %s", kind, ns, name, error)

    def mark_selected(self, ns: str | None, selector: dict[str, str] | None,
                      allow_empty: bool = False, service_entries: bool = False) -> None:
        """Mark pods and WorkloadEntries ``selector`` matches (``ns`` None = all namespaces);
        with ``service_entries`` also the ServiceEntries whose own labels it matches (a
        policy reaches a ServiceEntry's workloads through the ServiceEntry's labels)."""
        if selector is None or (not selector and not allow_empty) or self.dirty.everything:
            return
        if service_entries:
            for obj in self.store.list("ServiceEntry", ns):
                if subset(selector, labels(obj)):
                    self.dirty.ses.add((meta(obj)["namespace"], meta(obj)["name"]))
        for kind, target in (("Pod", self.dirty.pods), ("WorkloadEntry", self.dirty.wes)):
            for obj in self.store.list(kind, ns):
                lbls = labels(obj)
                if kind == "WorkloadEntry":
                    lbls = {**lbls, **{str(k): str(v) for k, v in
                                       ((spec(obj).get("labels") or {}).items())}}
                if subset(selector, lbls):
                    target.add((meta(obj)["namespace"], meta(obj)["name"]))

    def mark_namespace_workloads(self, ns: str) -> None:
        """Mark every pod, WorkloadEntry and ServiceEntry in ``ns``."""
        d, store = self.dirty, self.store
        if d.everything:
            return
        d.pods.update((ns, meta(p)["name"]) for p in store.list("Pod", ns))
        d.wes.update((ns, meta(w)["name"]) for w in store.list("WorkloadEntry", ns))
        d.ses.update((ns, meta(s)["name"]) for s in store.list("ServiceEntry", ns))

    def keys_of(self, kind: str) -> list[PodKey]:
        """(namespace, name) of every stored object of ``kind``."""
        return [(meta(o)["namespace"], meta(o)["name"]) for o in self.store.list(kind)]
