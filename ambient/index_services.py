"""The ambient index's Service addresses: Kubernetes Services, ServiceEntries and local
``LocalService`` objects -> one ``Address{service}`` per published ``namespace/hostname``.

Each source object is translated (:mod:`ambient.translate_service`) into hostname
*candidates*; per hostname and namespace one candidate wins (Service > LocalService >
oldest ServiceEntry) and one of the winners is canonical, as istiod's service index
decides. Publishing a service whose selector or ports changed marks its member pods,
WorkloadEntries, ServiceEntries and EndpointSlices dirty, since their workloads list it.
"""

from __future__ import annotations

import dataclasses
import logging

from ambient import localconfig
from ambient import translate_service as ts
from ambient import waypoints as wpmod
from ambient import workload_pb2 as wl
from ambient.index_base import BAD_OBJECT, IndexBase, SourceKey, subset
from ambient.index_gateways import Gateways
from ambient.index_outputs import AddrMeta
from ambient.index_slices import Slices
from ambient.objects import ip_text, labels, meta, spec
from ambient.store import StoreEvent

_RANK = {"Service": 0, "LocalService": 1, "ServiceEntry": 2}
log = logging.getLogger(__name__)
#: services whose missing waypoint was warned about, kept at most (oldest forgotten)
MAX_UNBOUND_WARNED = 10_000


def selector_of(obj: dict) -> dict[str, str] | None:
    """A Service's ``spec.selector`` or a ServiceEntry's ``spec.workloadSelector.labels``;
    None when absent or empty."""
    s = spec(obj)
    raw = s.get("selector") if obj.get("kind") == "Service" else \
        (s.get("workloadSelector") or {}).get("labels")
    return raw if isinstance(raw, dict) and raw else None


class Services:
    """``published``: service key (``namespace/hostname``) -> the winning
    :class:`ambient.translate_service.ServiceInfo` (shared with :class:`Slices`, which
    reads it)."""

    def __init__(self, base: IndexBase, gateways: Gateways, slices: Slices,
                 published: dict[str, ts.ServiceInfo]):
        self.base = base
        self.gateways = gateways
        self.slices = slices
        self.published = published
        self.candidates: dict[str, dict[SourceKey, ts.ServiceInfo]] = {}
        self._source_hosts: dict[SourceKey, list[str]] = {}
        self._host_keys: dict[str, set[str]] = {}
        self._hosts_by_ns: dict[str, set[str]] = {}
        self._sel_by_label: dict[str, dict[tuple[str, str], set[str]]] = {}
        #: service key -> the waypoint key it names that does not exist (warned once)
        self._unbound_warned: dict[str, str] = {}

    # ------------------------------------------------------------------ marks

    def mark(self, ev: StoreEvent) -> None:
        """Service / ServiceEntry event: re-translate it, mark what its old and new
        selectors match, and (Service) the EndpointSlices that name it."""
        d = self.base.dirty
        kind, ns, name = ev.kind, ev.namespace, ev.name
        self.update_source((kind, ns, name), ev.new)
        if kind == "ServiceEntry":
            d.ses.add((ns, name))
        for o in (ev.old, ev.new):
            if o is not None:
                self.base.mark_selected(ns, selector_of(o))
        if kind == "Service":
            d.slices.update((ns, meta(s)["name"]) for s in self.base.store.list("EndpointSlice", ns)
                            if labels(s).get("kubernetes.io/service-name") == name)

    def mark_namespace(self, ns: str) -> None:
        """A namespace changed: its hostnames are dirty, and its Services and
        ServiceEntries are re-translated (namespace annotations feed the load balancer)."""
        self.base.dirty.hosts.update(self._hosts_by_ns.get(ns, ()))
        for kind in ("Service", "ServiceEntry"):
            for obj in self.base.store.list(kind, ns):
                self.update_source((kind, ns, meta(obj)["name"]), obj)

    def mark_all(self) -> None:
        """Re-translate every source and mark every hostname (a full flush)."""
        for kind in ("Service", "ServiceEntry", "LocalService"):
            for obj in self.base.store.list(kind):
                m = meta(obj)
                self.update_source((kind, m["namespace"], m["name"]), obj)
        self.base.dirty.hosts.update(self.candidates, self._host_keys)

    # ------------------------------------------------------------------ candidates

    def update_source(self, source: SourceKey, obj: dict | None) -> None:
        """Re-translate one Service/ServiceEntry/LocalService into hostname candidates;
        mark hosts dirty."""
        for host in self._source_hosts.pop(source, []):
            self.candidates.get(host, {}).pop(source, None)
            self.base.dirty.hosts.add(host)
        if obj is None:
            return
        kind, ns, name = source
        mesh = self.base.mesh
        ns_obj = self.base.store.get("Namespace", "", ns)
        try:
            if kind == "Service":
                info = ts.k8s_service(obj, mesh, ns_obj)
                infos = [info] if info else []
            elif kind == "ServiceEntry":
                infos = ts.service_entry_services(obj, mesh, ns_obj)
            else:
                svc = localconfig.service(spec(obj), f"{ns}/{name}")
                infos = [ts.ServiceInfo(f"{svc.namespace}/{svc.hostname}", svc.namespace,
                                        name, svc.hostname, "LocalService", "", svc, None, [],
                                        {}, {})]
        except BAD_OBJECT as e:
            self.base.reject(kind, ns, name, e)
            return
        hosts = []
        for info in infos:
            self.candidates.setdefault(info.hostname, {})[source] = info
            self._hosts_by_ns.setdefault(ns, set()).add(info.hostname)
            self.base.dirty.hosts.add(info.hostname)
            hosts.append(info.hostname)
        self._source_hosts[source] = hosts

    # ------------------------------------------------------------------ publishing

    def publish_host(self, host: str) -> None:
        """Per namespace one winner (Service > oldest ServiceEntry); one canonical."""
        cands = self.candidates.get(host) or {}
        winners: dict[str, ts.ServiceInfo] = {}
        for info in sorted(cands.values(), key=lambda i: (_RANK[i.source], i.created, i.name)):
            winners.setdefault(info.namespace, info)
        canonical_key = None
        ordered = sorted(winners.values(), key=lambda i: (_RANK[i.source], i.created, i.name))
        for info in ordered:
            if info.source == "Service" or (info.source == "ServiceEntry"
                                            and info.visibility_public):
                canonical_key = info.key
                break
        new_keys = {info.key for info in winners.values()}
        for key in self._host_keys.get(host, set()) - new_keys:
            self._unpublish(key)
        for info in winners.values():
            self._publish(info, info.key == canonical_key)
        if new_keys:
            self._host_keys[host] = new_keys
        else:
            self._host_keys.pop(host, None)
            if not cands:
                self.candidates.pop(host, None)

    @staticmethod
    def _membership_shape(info: ts.ServiceInfo | None) -> object:
        if info is None:
            return None
        return (info.source_key, tuple(sorted((info.selector or {}).items())),
                [dataclasses.astuple(p) for p in info.ports])

    def _publish(self, info: ts.ServiceInfo, canonical: bool) -> None:
        old = self.published.get(info.key)
        if self._membership_shape(old) != self._membership_shape(info):
            self._mark_members(old)
            self._mark_members(info)
        self._set_selector_index(info.key, old, info)
        self.published[info.key] = info
        proto = wl.Service()
        proto.CopyFrom(info.proto)
        waypoint_keys: tuple[str, ...] = ()
        if info.source != "LocalService":  # local-config services are sent as written
            proto.canonical = canonical
            waypoint_keys = self._bind_service(info, proto)
        ip_keys = tuple(f"{a.network}/{ip_text(a.address)}" for a in proto.addresses
                        if not a.HasField("length"))
        self.base.outputs.set_address(info.key, wl.Address(service=proto),
                                      AddrMeta(ip_keys=ip_keys, waypoints=waypoint_keys))

    def _unpublish(self, key: str) -> None:
        old = self.published.pop(key, None)
        if old is not None:
            self._mark_members(old)
            self._set_selector_index(key, old, None)
        self.base.outputs.set_address(key, None)

    def _mark_members(self, info: ts.ServiceInfo | None) -> None:
        if info is None or self.base.dirty.everything:
            return
        d = self.base.dirty
        self.base.mark_selected(info.namespace, info.selector)
        if info.source == "ServiceEntry":
            d.ses.add((info.namespace, info.name))
        elif info.source == "Service":
            for s in self.base.store.list("EndpointSlice", info.namespace):
                if labels(s).get("kubernetes.io/service-name") == info.name:
                    key = (info.namespace, meta(s)["name"])
                    d.slices.add(key)
                    # their targetRef pods take the Service's ports, which may have changed
                    d.pods.update(self.slices.targets.get(key, ()))

    def _set_selector_index(self, key: str, old: ts.ServiceInfo | None,
                            new: ts.ServiceInfo | None) -> None:
        if old is not None and old.selector:
            bucket = self._sel_by_label.get(old.namespace, {})
            for pair in old.selector.items():
                bucket.get(pair, set()).discard(key)
        if new is not None and new.selector:
            bucket = self._sel_by_label.setdefault(new.namespace, {})
            for pair in new.selector.items():
                bucket.setdefault(pair, set()).add(key)

    def _bind_service(self, info: ts.ServiceInfo, proto: wl.Service) -> tuple[str, ...]:
        """Waypoint binding for a service: waypoint, weighted waypoints, ingress_use_waypoint."""
        if info.labels.get(wpmod.MANAGED) in wpmod.MANAGED_NO_WAYPOINT:
            return ()
        waypoints = self.gateways.waypoints
        ns_obj = self.base.store.get("Namespace", "", info.namespace)
        ref = wpmod.use_waypoint_ref(info.labels, info.namespace, ns_obj)
        wp = wpmod.resolve(ref, "service", info.namespace, ns_obj, waypoints)
        self._warn_missing_waypoint(info, ref, waypoints)
        if wp is None:
            return ()
        proto.waypoint.CopyFrom(wp.gateway_address())
        keys = [wp.key]
        weighted = wpmod.canary(info.labels, info.annotations, info.namespace, ns_obj, wp,
                                waypoints)
        if weighted:  # canary() returns [] unless the canary label names a waypoint
            proto.weighted_waypoints.extend(weighted)
            keys.append(f"{info.labels.get(wpmod.USE_WAYPOINT_CANARY_NS) or info.namespace}/"
                        f"{info.labels[wpmod.USE_WAYPOINT_CANARY]}")
        ingress = info.labels.get("istio.io/ingress-use-waypoint")
        if ingress is None and ns_obj:
            ingress = labels(ns_obj).get("istio.io/ingress-use-waypoint")
        proto.ingress_use_waypoint = ingress is not None and ingress.lower() == "true"
        return tuple(keys)

    def _warn_missing_waypoint(self, info: ts.ServiceInfo, ref: tuple[str, str] | None,
                               waypoints: dict[str, wpmod.Waypoint]) -> None:
        """One WARNING when ``istio.io/use-waypoint`` (the service's or its namespace's)
        names a Gateway that is not a waypoint: none of that name, or one without
        ``status.addresses`` (not ready). The service is then bound to no waypoint (its
        traffic goes straight to its endpoints), as istiod leaves it, whose
        ``istio.io/WaypointBound`` condition says ``WaypointIsNotReady``. Warned again
        only after the binding worked or the label changed."""
        key = f"{info.namespace}/{info.name}"
        wanted = f"{ref[0]}/{ref[1]}" if ref is not None else ""
        if not wanted or wanted in waypoints:
            self._unbound_warned.pop(key, None)
            return
        if self._unbound_warned.get(key) == wanted:
            return
        if len(self._unbound_warned) >= MAX_UNBOUND_WARNED:
            self._unbound_warned.pop(next(iter(self._unbound_warned)))
        self._unbound_warned[key] = wanted
        gw = self.base.store.get("Gateway", ref[0], ref[1]) if ref is not None else None
        why = "does not exist" if gw is None else "is not ready (no status.addresses)"
        log.warning("%s %s: label %s names waypoint %s, which %s: not bound to a waypoint",
                    info.source, key, wpmod.USE_WAYPOINT, wanted, why)

    # ------------------------------------------------------------------ reads

    def services_for(self, ns: str, lbls: dict[str, str]) -> list[ts.ServiceInfo]:
        """Published services in ``ns`` whose selector matches ``lbls``."""
        bucket = self._sel_by_label.get(ns)
        if not bucket:
            return []
        keys: set[str] = set()
        for pair in lbls.items():
            keys |= bucket.get(pair, set())
        out = []
        for key in sorted(keys):
            info = self.published.get(key)
            if info is not None and info.selector and subset(info.selector, lbls):
                out.append(info)
        return out
