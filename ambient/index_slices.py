"""The ambient index's EndpointSlice endpoints, as istiod's ``endpointSlicesBuilder`` and
``matchingServicesWithoutSelectors`` (pilot/pkg/serviceregistry/ambient/workloads.go).

A Pod targetRef names a pod by (namespace, name, uid); that pod, whatever its network
mode, lists the Service unless its labels already select it, with the *Service's* ports
resolved against the pod (the slice's port names play no part): this part keeps those
references (``refs``) for :mod:`ambient.index_workloads` and marks exactly the pods whose
references changed. Endpoints without a Pod targetRef become HOST_NETWORK workloads
carrying the slice's ports joined to the Service's by port name.
"""

from __future__ import annotations

import logging
from typing import Mapping

from ambient import translate_service as ts
from ambient import translate_workload as tw
from ambient import workload_pb2 as wl
from ambient.index_base import BAD_OBJECT, IndexBase, PodKey, Produced
from ambient.objects import TranslateError, field, labels
from ambient.store import StoreEvent

log = logging.getLogger(__name__)


class Slices:
    """``refs``: pod -> {service key: targetRef uids}; ``targets``: slice -> the pods it
    names (so a slice change touches exactly those pods). ``published`` is the services
    part's map of published services (read only here)."""

    def __init__(self, base: IndexBase, published: Mapping[str, ts.ServiceInfo]):
        self.base = base
        self.published = published
        self.refs: dict[PodKey, dict[str, set[str]]] = {}
        self.targets: dict[PodKey, set[PodKey]] = {}
        self._sources: dict[PodKey, dict[str, set[tuple[str, str]]]] = {}

    def mark(self, ev: StoreEvent) -> None:
        """EndpointSlice event."""
        self.base.dirty.slices.add((ev.namespace, ev.name))

    def mark_all(self) -> None:
        self.base.dirty.slices.update(self.base.keys_of("EndpointSlice"))

    def update(self, ns: str, name: str) -> None:
        """Recompute one EndpointSlice's references and produced workloads."""
        base = self.base
        source = ("EndpointSlice", ns, name)
        slice_key = f"slice:{ns}/{name}"
        # only pods whose references change are recomputed: a Kubernetes-managed slice of a
        # selector Service changes on every readiness flip and names up to 100 pods
        before: dict[PodKey, set[tuple[str, str]]] = {}
        for pod in self.targets.pop((ns, name), set()):
            before[pod] = self._src(pod).pop(slice_key, set())
            self._rebuild_refs(pod)
        obj = base.store.get("EndpointSlice", ns, name)
        produced: Produced = []
        svc_name = labels(obj).get("kubernetes.io/service-name") if obj else None
        info = self.published.get(
            f"{ns}/{svc_name}.{ns}.svc.{base.mesh.domain_suffix}") if svc_name else None
        if obj is not None and info is not None and info.source == "Service" \
                and obj.get("addressType") != "FQDN":
            try:
                ports = self._ports(info, obj)
                targets: set[PodKey] = set()
                seen: set[str] = set()
                self.targets[(ns, name)] = targets
                for i, ep in enumerate(field(obj, "endpoints", list, [])):
                    if not isinstance(ep, dict):
                        raise TranslateError(f"field 'endpoints[{i}]' must be a mapping")
                    ref = ep.get("targetRef") or {}
                    if isinstance(ref, dict) and ref.get("kind") == "Pod":
                        # istiod keys its targetRef index by the reference exactly as written
                        # (no namespace defaulting); the uid is compared with the pod's
                        pod = (str(ref.get("namespace") or ""), str(ref.get("name") or ""))
                        targets.add(pod)
                        self._src(pod).setdefault(slice_key, set()).add(
                            (info.key, str(ref.get("uid") or "")))
                        self._rebuild_refs(pod)
                        continue
                    try:
                        w = tw.slice_endpoint(obj, ep, i, base.mesh)
                    except TranslateError as e:  # istiod skips the endpoint, not the slice
                        base.rejected.labels("EndpointSlice").inc()
                        log.warning("EndpointSlice %s/%s: skipping endpoint: %s", ns, name, e)
                        continue
                    if w.uid in seen:
                        log.warning("EndpointSlice %s/%s: field 'endpoints[%d].addresses[0]' "
                                    "repeats %s; skipping that endpoint", ns, name, i,
                                    w.uid.rsplit("/", 1)[1])
                        continue
                    seen.add(w.uid)
                    w.services[info.key].CopyFrom(ports)
                    produced.append((w, ()))
            except BAD_OBJECT as e:
                base.reject("EndpointSlice", ns, name, e)
                produced = []
                for pod in self.targets.get((ns, name), ()):  # drop what was added
                    self._src(pod).pop(slice_key, None)
                    self._rebuild_refs(pod)
                self.targets.pop((ns, name), None)
            if not self.targets.get((ns, name), True):
                del self.targets[(ns, name)]
        for pod in set(before) | self.targets.get((ns, name), set()):
            if before.get(pod, set()) != self._sources.get(pod, {}).get(slice_key, set()):
                base.dirty.pods.add(pod)
        base.outputs.replace_produced(source, produced)

    def _src(self, pod: PodKey) -> dict[str, set[tuple[str, str]]]:
        return self._sources.setdefault(pod, {})

    def _rebuild_refs(self, pod: PodKey) -> None:
        src = self._src(pod)
        if not src:
            self.refs.pop(pod, None)
            self._sources.pop(pod, None)
            return
        refs: dict[str, set[str]] = {}
        for pairs in src.values():
            for key, uid in pairs:
                refs.setdefault(key, set()).add(uid)
        self.refs[pod] = refs

    @staticmethod
    def _ports(info: ts.ServiceInfo, obj: dict) -> wl.PortList:
        by_name = {}
        for p in field(obj, "ports", list, []) or []:
            if isinstance(p, dict) and (p.get("protocol") or "TCP") == "TCP" \
                    and isinstance(p.get("port"), int):
                by_name[p.get("name") or ""] = p["port"]
        out = wl.PortList()
        for p in info.ports:
            if p.name in by_name:
                out.ports.append(wl.Port(service_port=p.port, target_port=by_name[p.name]))
        return out
