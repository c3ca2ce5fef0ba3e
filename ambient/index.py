"""The ambient index: store objects -> Workload / Service / Authorization resources, kept
incrementally (``docs/ambient.md``). Implements
:class:`ambient.api.AmbientIndex`.

How it stays incremental: every store event marks what it can affect *dirty* — a pod
marks its workload; a Service marks its hostname and the pods its old/new selector
matches; a namespace marks what lives in it; a policy marks the workloads its selector
matches. A flush recomputes only the dirty items, in dependency order (services, then
authorizations, then EndpointSlices, then workloads), compares each produced proto's
deterministic bytes with what it held, and announces only real changes to subscribers as
one :class:`ambient.api.IndexChange`. A Gateway (waypoint) or the system namespace's
network label changing is rare and reaches across namespaces, so it recomputes everything
(still announcing only what changed).

Bad objects never raise out of the index: the item is dropped (or its old output
removed), a warning names kind/namespace/name and the field, and
``ambient_agent_index_rejected_total{kind}`` counts it.
"""

from __future__ import annotations

import dataclasses
import sys
import ipaddress
import logging
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge

from agent.core.lifecycle import AgentContext, Component
from ambient import authorization_pb2 as az
from ambient import localconfig
from ambient import translate_authz as tz
from ambient import translate_service as ts
from ambient import translate_workload as tw
from ambient import waypoints as wpmod
from ambient import workload_pb2 as wl
from ambient.api import IndexChange, Updater
from ambient.objects import Mesh, TranslateError, field, ip_text, labels, meta, spec
from ambient.store import ObjectStore, StoreEvent

log = logging.getLogger(__name__)

PodKey = tuple[str, str]  # (namespace, name)
DNS_RESOLUTIONS = ("DNS", "DNS_ROUND_ROBIN", "DYNAMIC_DNS")


def _subset(selector: dict[str, str], lbls: dict[str, str]) -> bool:
    return all(lbls.get(k) == v for k, v in selector.items())


@dataclasses.dataclass
class _Dirty:
    full: bool = False
    hosts: set[str] = dataclasses.field(default_factory=set)
    pods: set[PodKey] = dataclasses.field(default_factory=set)
    wes: set[PodKey] = dataclasses.field(default_factory=set)
    ses: set[PodKey] = dataclasses.field(default_factory=set)
    slices: set[PodKey] = dataclasses.field(default_factory=set)
    policies: set[PodKey] = dataclasses.field(default_factory=set)
    local: set[tuple[str, str, str]] = dataclasses.field(default_factory=set)
    pa: bool = False

    def any(self) -> bool:
        return bool(self.full or self.hosts or self.pods or self.wes or self.ses or self.slices
                    or self.policies or self.local or self.pa)


_KIND = {"workload": "workload", "service": "service"}  # one str object per kind


@dataclasses.dataclass(slots=True)
class _AddrMeta:
    """Secondary-index entries of one Address, so removal is exact, and its kind
    (``"workload"``/``"service"``: the Address's oneof)."""

    ip_keys: tuple[str, ...] = ()
    services: tuple[str, ...] = ()
    waypoints: tuple[str, ...] = ()
    node: str = ""
    kind: str = ""


class AmbientIndex:
    """The index over one :class:`ambient.store.ObjectStore`.

    A pod is HBONE only once the node agent annotated it captured (``ambient.istio.io/
    redirection: enabled``), with every config source (the enrollment writes it through
    the source). Call :meth:`start` once the store holds its initial objects; from then
    on every store transaction is applied.
    """

    def __init__(self, store: ObjectStore, mesh: Mesh, registry: CollectorRegistry | None = None):
        self.store = store
        self.base_mesh = mesh
        self.mesh = mesh
        self._subscribers: list[Updater] = []
        self._unsubscribe_store: Callable[[], None] | None = None
        # outputs, held serialized (deterministic): a parsed upb Address costs ~2.5 KiB
        # against ~150 bytes serialized, and xDS sends the bytes; readers of the typed
        # message parse on demand (address(), addresses())
        self._addr_bytes: dict[str, bytes] = {}
        self._addr_meta: dict[str, _AddrMeta] = {}
        self._authz_bytes: dict[str, bytes] = {}
        # secondary indexes of outputs
        # one entry per address, almost always one name: tuples (48 bytes) not sets (216)
        self._by_ip: dict[str, tuple[str, ...]] = {}
        self._members: dict[str, set[str]] = {}
        self._wp_members: dict[str, set[str]] = {}
        self._node_workloads: dict[str, set[str]] = {}
        # derived inputs
        self._candidates: dict[str, dict[tuple[str, str, str], ts.ServiceInfo]] = {}
        self._source_hosts: dict[tuple[str, str, str], list[str]] = {}
        self._host_keys: dict[str, set[str]] = {}
        self._published: dict[str, ts.ServiceInfo] = {}
        self._hosts_by_ns: dict[str, set[str]] = {}
        self._sel_by_label: dict[str, dict[tuple[str, str], set[str]]] = {}
        # EndpointSlice Pod targetRefs: pod -> {service key: targetRef uids}, and per slice
        # which pods it names, so a slice change touches exactly those pods
        self._slice_refs: dict[PodKey, dict[str, set[str]]] = {}
        self._slice_targets: dict[PodKey, set[PodKey]] = {}
        self._slice_sources: dict[PodKey, dict[str, set[tuple[str, str]]]] = {}
        self._produced: dict[tuple[str, str, str], set[str]] = {}
        self._ap_selectors: dict[str, dict[str, dict[str, str]]] = {}
        self._pa_converted: dict[PodKey, str] = {}
        self._pa_modes: tuple[str, dict[str, str]] = ("UNSET", {})
        self._waypoints: dict[str, wpmod.Waypoint] = {}
        self._netgws: dict[str, bytes] = {}
        self._dirty = _Dirty()
        self._orig_addr: dict[str, bytes | None] = {}
        self._orig_authz: dict[str, bytes | None] = {}
        registry = registry if registry is not None else CollectorRegistry()
        self.rejected = Counter("ambient_agent_index_rejected",
                                "objects the index skipped or degraded", ["kind"],
                                registry=registry)
        self.pushes = Counter("ambient_agent_index_changes",
                              "index changes announced to subscribers", registry=registry)
        self._sizes = Gauge("ambient_agent_index_resources", "resources held by the index",
                            ["type"], registry=registry)

    # ------------------------------------------------------------------ public API

    def start(self) -> IndexChange:
        """Build everything from the store and follow its changes. Returns the initial change."""
        if self._unsubscribe_store is None:
            self._unsubscribe_store = self.store.subscribe(self.on_events)
        self._dirty.full = True
        return self._flush()

    def stop(self) -> None:
        if self._unsubscribe_store:
            self._unsubscribe_store()
            self._unsubscribe_store = None

    def addresses(self) -> dict[str, wl.Address]:
        """Every Address, parsed (for inspection; xDS reads :meth:`address_bytes`)."""
        return {name: wl.Address.FromString(b) for name, b in self._addr_bytes.items()}

    def address(self, name: str) -> wl.Address | None:
        data = self._addr_bytes.get(name)
        return wl.Address.FromString(data) if data is not None else None

    def address_names(self, kind: str | None = None) -> list[str]:
        """Resource names of every Address (only ``"workload"``s or ``"service"``s with
        ``kind``)."""
        if kind is None:
            return list(self._addr_bytes)
        return [n for n, m in self._addr_meta.items() if m.kind == kind]

    def address_bytes(self, name: str) -> bytes | None:
        """The Address serialized (deterministic), or None."""
        return self._addr_bytes.get(name)

    def authorizations(self) -> dict[str, az.Authorization]:
        return {name: az.Authorization.FromString(b) for name, b in self._authz_bytes.items()}

    def authorization(self, name: str) -> az.Authorization | None:
        data = self._authz_bytes.get(name)
        return az.Authorization.FromString(data) if data is not None else None

    def authorization_names(self) -> list[str]:
        return list(self._authz_bytes)

    def authorization_bytes(self, name: str) -> bytes | None:
        return self._authz_bytes.get(name)

    def lookup(self, key: str) -> list[str]:
        """Uid -> it; ``network/IP`` -> workloads and services (+ their members) with
        that address; ``namespace/hostname`` -> the service + its member workloads."""
        m = self._addr_meta.get(key)
        if m is not None and m.kind == "workload":
            return [key]
        out: list[str] = []
        seen: set[str] = set()

        def add(name: str) -> None:
            if name not in seen and name in self._addr_bytes:
                seen.add(name)
                out.append(name)

        names = self._by_ip.get(self._normal_ip_key(key))
        if names:
            for name in sorted(names):
                add(name)
                for member in sorted(self._members.get(name, ())):
                    add(member)
            return out
        if key in self._addr_bytes:
            add(key)
            for member in sorted(self._members.get(key, ())):
                add(member)
        return out

    def waypoint_resources(self, namespace: str, name: str) -> set[str]:
        return set(self._wp_members.get(f"{namespace}/{name}", ()))

    def node_workloads(self, node: str) -> set[str]:
        """Workload resource names whose ``node`` is ``node`` (ZDS/on-demand warm-up)."""
        return set(self._node_workloads.get(node, ()))

    def subscribe(self, updater: Updater) -> Callable[[], None]:
        self._subscribers.append(updater)
        return lambda: self._subscribers.remove(updater) if updater in self._subscribers else None

    def debug_state(self) -> dict:
        kinds: dict[str, int] = {}
        for m in self._addr_meta.values():
            kinds[m.kind] = kinds.get(m.kind, 0) + 1
        return {"workloads": kinds.get("workload", 0), "services": kinds.get("service", 0),
                "authorizations": len(self._authz_bytes), "waypoints": sorted(self._waypoints),
                "network": self.mesh.network}

    # ------------------------------------------------------------------ events

    def on_events(self, events: list[StoreEvent]) -> IndexChange:
        """Apply one store transaction; never raises (a failing item is logged and skipped)."""
        for ev in events:
            try:
                self._mark(ev)
            except Exception:  # an unexpected shape must not stop the index
                log.exception("index: cannot apply %s %s/%s", ev.kind, ev.namespace, ev.name)
                self.rejected.labels(ev.kind).inc()
        return self._flush()

    def _mark(self, ev: StoreEvent) -> None:
        d = self._dirty
        kind, ns, name = ev.kind, ev.namespace, ev.name
        objs = [o for o in (ev.old, ev.new) if o is not None]
        if kind == "Pod":
            d.pods.add((ns, name))
        elif kind == "Namespace":
            if name == self.base_mesh.root_namespace and self._network_changed():
                d.full = True
            self._mark_namespace(name)
        elif kind == "Node":
            d.pods.update((meta(p)["namespace"], meta(p)["name"]) for p in self.store.list("Pod")
                          if spec(p).get("nodeName") == name)
        elif kind in ("Service", "ServiceEntry"):
            self._update_service_source((kind, ns, name), ev.new)
            if kind == "ServiceEntry":
                d.ses.add((ns, name))
            for o in objs:
                self._mark_selected(ns, self._selector_of(o))
            if kind == "Service":
                d.slices.update((ns, meta(s)["name"]) for s in self.store.list("EndpointSlice", ns)
                                if labels(s).get("kubernetes.io/service-name") == name)
        elif kind == "WorkloadEntry":
            d.wes.add((ns, name))
        elif kind == "EndpointSlice":
            d.slices.add((ns, name))
        elif kind == "AuthorizationPolicy":
            d.policies.add((ns, name))
            for o in objs:
                sel = self._policy_selector(o)
                scope_ns = None if ns == self.base_mesh.root_namespace else ns
                self._mark_selected(scope_ns, sel, allow_empty=True)
        elif kind == "PeerAuthentication":
            d.pa = True
            for o in objs:
                sel = self._policy_selector(o)
                if sel is None:
                    if ns == self.base_mesh.root_namespace:
                        d.full = True
                    else:
                        self._mark_namespace(ns, workloads_only=True)
                elif ns != self.base_mesh.root_namespace:
                    self._mark_selected(ns, sel, allow_empty=True)
        elif kind in ("Gateway", "GatewayClass"):
            if self._refresh_gateways():
                d.full = True
        elif kind in ("LocalWorkload", "LocalService", "LocalPolicy"):
            d.local.add((kind, ns, name))

    def _mark_namespace(self, ns: str, workloads_only: bool = False) -> None:
        d = self._dirty
        d.pods.update((ns, meta(p)["name"]) for p in self.store.list("Pod", ns))
        d.wes.update((ns, meta(w)["name"]) for w in self.store.list("WorkloadEntry", ns))
        d.ses.update((ns, meta(s)["name"]) for s in self.store.list("ServiceEntry", ns))
        if not workloads_only:
            d.hosts.update(self._hosts_by_ns.get(ns, ()))
            for svc in self.store.list("Service", ns):  # namespace annotations feed the LB
                self._update_service_source(("Service", ns, meta(svc)["name"]), svc)
            for se in self.store.list("ServiceEntry", ns):
                self._update_service_source(("ServiceEntry", ns, meta(se)["name"]), se)

    def _mark_selected(self, ns: str | None, selector: dict[str, str] | None,
                       allow_empty: bool = False) -> None:
        """Mark pods and WorkloadEntries ``selector`` matches (``ns`` None = all namespaces)."""
        if selector is None or (not selector and not allow_empty):
            return
        for kind, target in (("Pod", self._dirty.pods), ("WorkloadEntry", self._dirty.wes)):
            for obj in self.store.list(kind, ns):
                lbls = labels(obj)
                if kind == "WorkloadEntry":
                    lbls = {**lbls, **{str(k): str(v) for k, v in
                                       ((spec(obj).get("labels") or {}).items())}}
                if _subset(selector, lbls):
                    target.add((meta(obj)["namespace"], meta(obj)["name"]))

    @staticmethod
    def _selector_of(obj: dict) -> dict[str, str] | None:
        s = spec(obj)
        raw = s.get("selector") if obj.get("kind") == "Service" else \
            (s.get("workloadSelector") or {}).get("labels")
        return raw if isinstance(raw, dict) and raw else None

    @staticmethod
    def _policy_selector(obj: dict) -> dict[str, str] | None:
        sel = spec(obj).get("selector")
        if not isinstance(sel, dict):
            return None
        ml = sel.get("matchLabels") or {}
        return ml if isinstance(ml, dict) else None

    # ------------------------------------------------------------------ global inputs

    def _network_changed(self) -> bool:
        ns = self.store.get("Namespace", "", self.base_mesh.root_namespace)
        network = (labels(ns).get(wpmod.NETWORK_LABEL) if ns else None) or self.base_mesh.network
        if network == self.mesh.network:
            return False
        self.mesh = dataclasses.replace(self.base_mesh, network=network)
        self._refresh_gateways()
        return True

    def _refresh_gateways(self) -> bool:
        """Recompute waypoints and network gateways; True when either changed."""
        waypoints: dict[str, wpmod.Waypoint] = {}
        netgws: dict[str, bytes] = {}
        for gw in self.store.list("Gateway"):
            try:
                cls = self.store.get("GatewayClass", "", str(spec(gw).get("gatewayClassName")))
                wp = wpmod.waypoint_from_gateway(gw, cls, self.mesh.network)
                if wp is not None:
                    waypoints[wp.key] = wp
                ng = wpmod.network_gateway(gw)
                if ng is not None:
                    netgws.setdefault(ng[0], ng[1])
            except Exception as e:  # malformed Gateway: skip it, keep the rest
                self._reject("Gateway", meta(gw).get("namespace", ""), meta(gw).get("name"), e)
        changed = waypoints != self._waypoints or netgws != self._netgws
        self._waypoints, self._netgws = waypoints, netgws
        return changed

    # ------------------------------------------------------------------ services

    def _update_service_source(self, source: tuple[str, str, str], obj: dict | None) -> None:
        """Re-translate one Service/ServiceEntry into hostname candidates; mark hosts dirty."""
        for host in self._source_hosts.pop(source, []):
            self._candidates.get(host, {}).pop(source, None)
            self._dirty.hosts.add(host)
        if obj is None:
            return
        kind, ns, name = source
        ns_obj = self.store.get("Namespace", "", ns)
        try:
            if kind == "Service":
                info = ts.k8s_service(obj, self.mesh, ns_obj)
                infos = [info] if info else []
            elif kind == "ServiceEntry":
                infos = ts.service_entry_services(obj, self.mesh, ns_obj)
            else:
                svc = localconfig.service(spec(obj), f"{ns}/{name}")
                infos = [ts.ServiceInfo(f"{svc.namespace}/{svc.hostname}", svc.namespace,
                                        name, svc.hostname, "LocalService", "", svc, None, [],
                                        {}, {})]
        except (TranslateError, KeyError, TypeError, ValueError, AttributeError) as e:
            self._reject(kind, ns, name, e)
            return
        hosts = []
        for info in infos:
            self._candidates.setdefault(info.hostname, {})[source] = info
            self._hosts_by_ns.setdefault(ns, set()).add(info.hostname)
            self._dirty.hosts.add(info.hostname)
            hosts.append(info.hostname)
        self._source_hosts[source] = hosts

    def _publish_host(self, host: str) -> None:
        """Per namespace one winner (Service > oldest ServiceEntry); one canonical."""
        cands = self._candidates.get(host) or {}
        rank = {"Service": 0, "LocalService": 1, "ServiceEntry": 2}
        winners: dict[str, ts.ServiceInfo] = {}
        for info in sorted(cands.values(), key=lambda i: (rank[i.source], i.created, i.name)):
            winners.setdefault(info.namespace, info)
        canonical_key = None
        ordered = sorted(winners.values(), key=lambda i: (rank[i.source], i.created, i.name))
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
                self._candidates.pop(host, None)

    def _membership_shape(self, info: ts.ServiceInfo | None) -> object:
        if info is None:
            return None
        return (info.source_key, tuple(sorted((info.selector or {}).items())),
                [dataclasses.astuple(p) for p in info.ports])

    def _publish(self, info: ts.ServiceInfo, canonical: bool) -> None:
        old = self._published.get(info.key)
        if self._membership_shape(old) != self._membership_shape(info):
            self._mark_members(old)
            self._mark_members(info)
        self._set_selector_index(info.key, old, info)
        self._published[info.key] = info
        proto = wl.Service()
        proto.CopyFrom(info.proto)
        waypoint_keys: tuple[str, ...] = ()
        if info.source != "LocalService":  # local-config services are sent as written
            proto.canonical = canonical
            waypoint_keys = self._bind_service(info, proto)
        ip_keys = tuple(f"{a.network}/{ip_text(a.address)}" for a in proto.addresses
                        if not a.HasField("length"))
        self._set_address(info.key, wl.Address(service=proto),
                          _AddrMeta(ip_keys=ip_keys, waypoints=waypoint_keys))

    def _unpublish(self, key: str) -> None:
        old = self._published.pop(key, None)
        if old is not None:
            self._mark_members(old)
            self._set_selector_index(key, old, None)
        self._set_address(key, None)

    def _mark_members(self, info: ts.ServiceInfo | None) -> None:
        if info is None:
            return
        self._mark_selected(info.namespace, info.selector)
        if info.source == "ServiceEntry":
            self._dirty.ses.add((info.namespace, info.name))
        elif info.source == "Service":
            for s in self.store.list("EndpointSlice", info.namespace):
                if labels(s).get("kubernetes.io/service-name") == info.name:
                    key = (info.namespace, meta(s)["name"])
                    self._dirty.slices.add(key)
                    # their targetRef pods take the Service's ports, which may have changed
                    self._dirty.pods.update(self._slice_targets.get(key, ()))

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
        ns_obj = self.store.get("Namespace", "", info.namespace)
        ref = wpmod.use_waypoint_ref(info.labels, info.namespace, ns_obj)
        wp = wpmod.resolve(ref, "service", info.namespace, ns_obj, self._waypoints)
        if wp is None:
            return ()
        proto.waypoint.CopyFrom(wp.gateway_address())
        keys = [wp.key]
        weighted = wpmod.canary(info.labels, info.annotations, info.namespace, ns_obj, wp,
                                self._waypoints)
        if weighted:  # canary() returns [] unless the canary label names a waypoint
            proto.weighted_waypoints.extend(weighted)
            keys.append(f"{info.labels.get(wpmod.USE_WAYPOINT_CANARY_NS) or info.namespace}/"
                        f"{info.labels[wpmod.USE_WAYPOINT_CANARY]}")
        ingress = info.labels.get("istio.io/ingress-use-waypoint")
        if ingress is None and ns_obj:
            ingress = labels(ns_obj).get("istio.io/ingress-use-waypoint")
        proto.ingress_use_waypoint = ingress is not None and ingress.lower() == "true"
        return tuple(keys)

    def _services_for(self, ns: str, lbls: dict[str, str]) -> list[ts.ServiceInfo]:
        """Published services in ``ns`` whose selector matches ``lbls``."""
        bucket = self._sel_by_label.get(ns)
        if not bucket:
            return []
        keys: set[str] = set()
        for pair in lbls.items():
            keys |= bucket.get(pair, set())
        out = []
        for key in sorted(keys):
            info = self._published.get(key)
            if info is not None and info.selector and _subset(info.selector, lbls):
                out.append(info)
        return out

    # ------------------------------------------------------------------ authorizations

    def _update_policy(self, ns: str, name: str) -> None:
        key = f"{ns}/{name}"
        self._ap_selectors.get(ns, {}).pop(key, None)
        obj = self.store.get("AuthorizationPolicy", ns, name)
        result = None
        if obj is not None:
            try:
                translated = tz.authorization_policy(obj, self.base_mesh.root_namespace)
                result = translated.policy
                if translated.problems:
                    # counted as rejected parts: the policy itself is still enforced,
                    # closed on the side that is safe for its action
                    self.rejected.labels("AuthorizationPolicy").inc()
                    for problem in translated.problems:
                        log.warning("AuthorizationPolicy %s: %s", key, problem)
                if translated.note:
                    log.info("AuthorizationPolicy %s: %s", key, translated.note)
            except (TranslateError, KeyError, TypeError, ValueError, AttributeError) as e:
                self._reject("AuthorizationPolicy", ns, name, e)
                result = None
        if result is not None and result.scope == az.WORKLOAD_SELECTOR:
            self._ap_selectors.setdefault(ns, {})[key] = dict(
                (spec(obj).get("selector") or {}).get("matchLabels") or {})
        self._set_authz(key, result)

    def _update_peer_authentications(self) -> None:
        """Modes, the static STRICT policy and converted per-port policies."""
        root = self.base_mesh.root_namespace
        pas = sorted(self.store.list("PeerAuthentication"),
                     key=lambda p: (meta(p).get("creationTimestamp") or "", meta(p)["name"]))
        mesh_mode, ns_modes = "UNSET", {}
        for pa in pas:
            ns = meta(pa)["namespace"]
            if self._policy_selector(pa) is not None:
                continue
            try:
                mode = tz.pa_top_mode(pa)
            except TranslateError as e:
                self._reject("PeerAuthentication", ns, meta(pa)["name"], e)
                continue
            if ns == root:
                mesh_mode = mesh_mode if mesh_mode != "UNSET" else mode
            else:
                ns_modes.setdefault(ns, mode)
        self._pa_modes = (mesh_mode, ns_modes)
        converted: dict[PodKey, str] = {}
        wanted: dict[str, az.Authorization] = {}
        for pa in pas:
            ns, name = meta(pa)["namespace"], meta(pa)["name"]
            if ns == root or self._policy_selector(pa) is None:
                continue
            inherited = ns_modes.get(ns, "UNSET")
            inherited = inherited if inherited != "UNSET" else mesh_mode
            try:
                policy = tz.converted_peer_authentication(pa, inherited)
            except TranslateError as e:
                self._reject("PeerAuthentication", ns, name, e)
                continue
            if policy is not None:
                key = f"{ns}/{policy.name}"
                wanted[key] = policy
                converted[(ns, name)] = key
        if pas:
            wanted[f"{root}/{tz.STATIC_STRICT}"] = tz.static_strict(root)
        for key in [k for k in self._authz_bytes if self._is_pa_key(k)]:
            if key not in wanted:
                self._set_authz(key, None)
        for key, policy in wanted.items():
            self._set_authz(key, policy)
        self._pa_converted = converted

    def _is_pa_key(self, key: str) -> bool:
        name = key.split("/", 1)[1]
        return name == tz.STATIC_STRICT or name.startswith(tz.CONVERTED_PREFIX)

    def _policy_keys(self, ns: str, lbls: dict[str, str]) -> list[str]:
        """Sorted selector AuthorizationPolicies, then PeerAuthentication keys."""
        keys = [k for scope in {ns, self.base_mesh.root_namespace}
                for k, sel in self._ap_selectors.get(scope, {}).items() if _subset(sel, lbls)]
        keys.sort()
        mesh_mode, ns_modes = self._pa_modes
        effective = ns_modes.get(ns, "UNSET")
        effective = effective if effective != "UNSET" else mesh_mode
        workload_pa = None
        for pa in sorted(self.store.list("PeerAuthentication", ns),
                         key=lambda p: (meta(p).get("creationTimestamp") or "", meta(p)["name"])):
            sel = self._policy_selector(pa)
            if sel is not None and ns != self.base_mesh.root_namespace and _subset(sel, lbls):
                workload_pa = pa
                break
        if workload_pa is not None:
            try:
                mode = tz.pa_top_mode(workload_pa)
            except TranslateError:
                mode = "UNSET"
            if mode != "UNSET":
                effective = mode
            converted = self._pa_converted.get((ns, meta(workload_pa)["name"]))
            if converted:
                return keys + [converted]
        if effective == "STRICT":
            keys.append(f"{self.base_mesh.root_namespace}/{tz.STATIC_STRICT}")
        return keys

    # ------------------------------------------------------------------ workloads

    def _finish_workload(self, w: wl.Workload, ns: str, lbls: dict[str, str],
                         policies: bool = True) -> tuple[str, ...]:
        """Waypoint/app tunnel, network gateway, policies. Returns waypoint keys."""
        ns_obj = self.store.get("Namespace", "", ns)
        keys: tuple[str, ...] = ()
        instance = wpmod.instance_of(lbls, ns, self._waypoints)
        if instance is not None:
            if instance.inbound_protocol:
                w.application_tunnel.protocol = (wl.ApplicationTunnel.PROXY
                                                 if instance.inbound_protocol == "PROXY"
                                                 else wl.ApplicationTunnel.NONE)
                w.application_tunnel.port = instance.inbound_port
        else:
            wp = wpmod.resolve(wpmod.use_waypoint_ref(lbls, ns, ns_obj), "workload", ns, ns_obj,
                               self._waypoints)
            if wp is not None:
                w.waypoint.CopyFrom(wp.gateway_address())
                keys = (wp.key,)
        gw = self._netgws.get(w.network)
        if gw is not None:
            w.network_gateway.ParseFromString(gw)
        if policies:
            w.authorization_policies.extend(self._policy_keys(ns, lbls))
        return keys

    def _set_workload(self, w: wl.Workload | None, name: str, waypoint_keys: tuple[str, ...] = ()
                      ) -> None:
        if w is None:
            self._set_address(name, None)
            return
        ip_keys = tuple(f"{w.network}/{ip_text(a)}" for a in w.addresses)
        # service keys and node names repeat across every pod: one string object each
        self._set_address(name, wl.Address(workload=w), _AddrMeta(
            ip_keys=ip_keys, services=tuple(sys.intern(k) for k in sorted(w.services)),
            waypoints=waypoint_keys, node=sys.intern(w.node)))

    def _update_pod(self, ns: str, name: str) -> None:
        uid = tw.pod_uid(self.mesh, ns, name)
        pod = self.store.get("Pod", ns, name)
        if pod is None:
            self._set_workload(None, uid)
            return
        try:
            if not tw.pod_included(pod):
                self._set_workload(None, uid)
                return
            ns_obj = self.store.get("Namespace", "", ns)
            node = self.store.get("Node", "", str(spec(pod).get("nodeName") or ""))
            w = tw.pod_workload(pod, self.mesh, ns_obj, node)
            lbls = labels(pod)
            named = tw.container_ports(pod)
            for info in self._services_for(ns, lbls):
                w.services[info.key].CopyFrom(ts.workload_ports(info, named))
            pod_uid = str(meta(pod).get("uid") or "")
            for key, ref_uids in self._slice_refs.get((ns, name), {}).items():
                info = self._published.get(key)
                if (info is not None and info.source == "Service" and key not in w.services
                        and pod_uid in ref_uids):
                    w.services[key].CopyFrom(ts.workload_ports(info, named))
            keys = self._finish_workload(w, ns, lbls)
        except (TranslateError, KeyError, TypeError, ValueError, AttributeError) as e:
            self._reject("Pod", ns, name, e)
            self._set_workload(None, uid)
            return
        self._set_workload(w, uid, keys)

    def _update_workload_entry(self, ns: str, name: str) -> None:
        uid = f"{self.mesh.cluster_id}/networking.istio.io/WorkloadEntry/{ns}/{name}"
        we = self.store.get("WorkloadEntry", ns, name)
        if we is None:
            self._set_workload(None, uid)
            return
        try:
            w, lbls, named = tw.workload_entry(we, self.mesh)
            for info in self._services_for(ns, lbls):
                w.services[info.key].CopyFrom(ts.workload_ports(info, named,
                                                                override_by_name=True))
            keys = self._finish_workload(w, ns, lbls)
        except (TranslateError, KeyError, TypeError, ValueError, AttributeError) as e:
            self._reject("WorkloadEntry", ns, name, e)
            self._set_workload(None, uid)
            return
        self._set_workload(w, uid, keys)

    def _replace_produced(self, source: tuple[str, str, str],
                          produced: list[tuple[wl.Workload, tuple[str, ...]]]) -> None:
        names = {w.uid for w, _ in produced}
        for old in self._produced.get(source, set()) - names:
            self._set_workload(None, old)
        for w, keys in produced:
            self._set_workload(w, w.uid, keys)
        if names:
            self._produced[source] = names
        else:
            self._produced.pop(source, None)

    def _update_service_entry(self, ns: str, name: str) -> None:
        source = ("ServiceEntry", ns, name)
        se = self.store.get("ServiceEntry", ns, name)
        produced: list[tuple[wl.Workload, tuple[str, ...]]] = []
        won = [i for i in self._published.values() if i.source_key == source] if se else []
        if se is not None and won:
            try:
                endpoints = field(se, "spec.endpoints", list, [])
                for i, ep in enumerate(endpoints):
                    w, lbls, named = tw.se_endpoint(se, ep, i, self.mesh)
                    for info in won:
                        w.services[info.key].CopyFrom(ts.workload_ports(info, named,
                                                                        override_by_name=True))
                    produced.append((w, self._finish_workload(w, ns, lbls)))
                s = spec(se)
                if (not endpoints and not s.get("workloadSelector")
                        and s.get("resolution") in DNS_RESOLUTIONS):
                    for info in won:
                        w = tw.dns_host_workload(se, info.hostname, self.mesh)
                        w.services[info.key].CopyFrom(ts.workload_ports(info, {}))
                        produced.append((w, ()))
            except (TranslateError, KeyError, TypeError, ValueError, AttributeError) as e:
                self._reject("ServiceEntry", ns, name, e)
                produced = []
        self._replace_produced(source, produced)

    def _update_slice(self, ns: str, name: str) -> None:
        """EndpointSlice endpoints, as istiod's ``endpointSlicesBuilder`` and
        ``matchingServicesWithoutSelectors`` (pilot/pkg/serviceregistry/ambient/workloads.go).

        A Pod targetRef names a pod by (namespace, name, uid); that pod, whatever its network
        mode, lists the Service unless its labels already select it, with the *Service's*
        ports resolved against the pod (the slice's port names play no part). Endpoints
        without a Pod targetRef become HOST_NETWORK workloads carrying the slice's ports
        joined to the Service's by port name."""
        source = ("EndpointSlice", ns, name)
        slice_key = f"slice:{ns}/{name}"
        # only pods whose references change are recomputed: a Kubernetes-managed slice of a
        # selector Service changes on every readiness flip and names up to 100 pods
        before: dict[PodKey, set[tuple[str, str]]] = {}
        for pod in self._slice_targets.pop((ns, name), set()):
            before[pod] = self._slice_src(pod).pop(slice_key, set())
            self._rebuild_slice_refs(pod)
        obj = self.store.get("EndpointSlice", ns, name)
        produced: list[tuple[wl.Workload, tuple[str, ...]]] = []
        svc_name = labels(obj).get("kubernetes.io/service-name") if obj else None
        info = self._published.get(
            f"{ns}/{svc_name}.{ns}.svc.{self.mesh.domain_suffix}") if svc_name else None
        if obj is not None and info is not None and info.source == "Service" \
                and obj.get("addressType") != "FQDN":
            try:
                ports = self._slice_ports(info, obj)
                targets: set[PodKey] = set()
                self._slice_targets[(ns, name)] = targets
                for i, ep in enumerate(field(obj, "endpoints", list, [])):
                    if not isinstance(ep, dict):
                        raise TranslateError(f"field 'endpoints[{i}]' must be a mapping")
                    ref = ep.get("targetRef") or {}
                    if isinstance(ref, dict) and ref.get("kind") == "Pod":
                        # istiod keys its targetRef index by the reference exactly as written
                        # (no namespace defaulting); the uid is compared in _update_pod
                        pod = (str(ref.get("namespace") or ""), str(ref.get("name") or ""))
                        targets.add(pod)
                        self._slice_src(pod).setdefault(slice_key, set()).add(
                            (info.key, str(ref.get("uid") or "")))
                        self._rebuild_slice_refs(pod)
                        continue
                    w = tw.slice_endpoint(obj, ep, i, self.mesh)
                    w.services[info.key].CopyFrom(ports)
                    produced.append((w, ()))
            except (TranslateError, KeyError, TypeError, ValueError, AttributeError) as e:
                self._reject("EndpointSlice", ns, name, e)
                produced = []
                for pod in self._slice_targets.get((ns, name), ()):  # drop what was added
                    self._slice_src(pod).pop(slice_key, None)
                    self._rebuild_slice_refs(pod)
                self._slice_targets.pop((ns, name), None)
            if not self._slice_targets.get((ns, name), True):
                del self._slice_targets[(ns, name)]
        for pod in set(before) | self._slice_targets.get((ns, name), set()):
            if before.get(pod, set()) != self._slice_sources.get(pod, {}).get(slice_key, set()):
                self._dirty.pods.add(pod)
        self._replace_produced(source, produced)

    def _slice_src(self, pod: PodKey) -> dict[str, set[tuple[str, str]]]:
        return self._slice_sources.setdefault(pod, {})

    def _rebuild_slice_refs(self, pod: PodKey) -> None:
        src = self._slice_src(pod)
        if not src:
            self._slice_refs.pop(pod, None)
            self._slice_sources.pop(pod, None)
            return
        refs: dict[str, set[str]] = {}
        for pairs in src.values():
            for key, uid in pairs:
                refs.setdefault(key, set()).add(uid)
        self._slice_refs[pod] = refs

    @staticmethod
    def _slice_ports(info: ts.ServiceInfo, obj: dict) -> wl.PortList:
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

    def _update_local(self, kind: str, ns: str, name: str) -> None:
        source = (kind, ns, name)
        obj = self.store.get(kind, ns, name)
        if kind == "LocalService":
            self._update_service_source(source, obj)
            return
        try:
            if kind == "LocalWorkload":
                produced = []
                if obj is not None:
                    w = localconfig.workload(spec(obj), f"{ns}/{name}")
                    produced = [(w, ())]
                self._replace_produced(source, produced)
            else:
                key = f"{ns}/{name}"
                self._set_authz(key, localconfig.policy(spec(obj), key) if obj else None)
        except (TranslateError, KeyError, TypeError, ValueError, AttributeError) as e:
            self._reject(kind, ns, name, e)

    # ------------------------------------------------------------------ flush and diff

    def _flush(self) -> IndexChange:
        d = self._dirty
        if not d.any():
            return IndexChange()
        if d.full:
            self._network_changed()
            self._refresh_gateways()
            for kind in ("Service", "ServiceEntry", "LocalService"):
                for obj in self.store.list(kind):
                    m = meta(obj)
                    self._update_service_source((kind, m["namespace"], m["name"]), obj)
            d.hosts.update(self._candidates, self._host_keys)
            d.pods.update((meta(o)["namespace"], meta(o)["name"]) for o in self.store.list("Pod"))
            d.wes.update((meta(o)["namespace"], meta(o)["name"])
                         for o in self.store.list("WorkloadEntry"))
            d.ses.update((meta(o)["namespace"], meta(o)["name"])
                         for o in self.store.list("ServiceEntry"))
            d.slices.update((meta(o)["namespace"], meta(o)["name"])
                            for o in self.store.list("EndpointSlice"))
            d.policies.update((meta(o)["namespace"], meta(o)["name"])
                              for o in self.store.list("AuthorizationPolicy"))
            d.policies.update(tuple(k.split("/", 1)) for k in self._authz_bytes
                              if not self._is_pa_key(k))
            for kind in ("LocalWorkload", "LocalPolicy"):
                d.local.update((kind, meta(o)["namespace"], meta(o)["name"])
                               for o in self.store.list(kind))
            d.pa = True
            d.full = False
        while d.hosts:
            self._publish_host(d.hosts.pop())
        if d.pa:
            d.pa = False
            self._update_peer_authentications()
        while d.policies:
            ns, name = d.policies.pop()
            if self.store.get("LocalPolicy", ns, name) is None:
                self._update_policy(ns, name)
        for kind, ns, name in sorted(d.local):
            self._update_local(kind, ns, name)
        d.local.clear()
        while d.hosts:  # LocalService updates above
            self._publish_host(d.hosts.pop())
        while d.slices:
            self._update_slice(*d.slices.pop())
        while d.ses:
            self._update_service_entry(*d.ses.pop())
        while d.wes:
            self._update_workload_entry(*d.wes.pop())
        while d.pods:
            self._update_pod(*d.pods.pop())
        # fresh sets: an emptied set keeps its grown table and pop() then scans it, which
        # would make every later single-pod change cost O(cluster)
        self._dirty = _Dirty()
        return self._announce()

    def _announce(self) -> IndexChange:
        changed, removed = set(), set()
        for name, old in self._orig_addr.items():
            new = self._addr_bytes.get(name)
            if new == old:
                continue
            (removed if new is None else changed).add(name)
        az_changed, az_removed = set(), set()
        for name, old in self._orig_authz.items():
            new = self._authz_bytes.get(name)
            if new == old:
                continue
            (az_removed if new is None else az_changed).add(name)
        self._orig_addr.clear()
        self._orig_authz.clear()
        change = IndexChange(frozenset(changed), frozenset(removed), frozenset(az_changed),
                             frozenset(az_removed))
        self._sizes.labels("address").set(len(self._addr_bytes))
        self._sizes.labels("authorization").set(len(self._authz_bytes))
        if not change.empty():
            self.pushes.inc()
            for updater in list(self._subscribers):
                try:
                    updater(change)
                except Exception:
                    log.exception("index subscriber failed")
        return change

    def _set_address(self, name: str, addr: wl.Address | None,
                     meta_: _AddrMeta | None = None) -> None:
        if name not in self._orig_addr:
            self._orig_addr[name] = self._addr_bytes.get(name)
        old_meta = self._addr_meta.pop(name, None)
        if old_meta is not None:
            self._index(name, old_meta, remove=True)
        if addr is None:
            self._addr_bytes.pop(name, None)
            return
        self._addr_bytes[name] = addr.SerializeToString(deterministic=True)
        meta_ = meta_ or _AddrMeta()
        meta_.kind = _KIND.get(addr.WhichOneof("type"), "")
        self._addr_meta[name] = meta_
        self._index(name, meta_, remove=False)

    def _index(self, name: str, m: _AddrMeta, remove: bool) -> None:
        by_ip = self._by_ip
        for key in m.ip_keys:
            names = by_ip.get(key, ())
            if remove:
                names = tuple(n for n in names if n != name)
            elif name not in names:
                names += (name,)
            if names:
                by_ip[key] = names
            else:
                by_ip.pop(key, None)
        pairs: Iterable[tuple[dict[str, set[str]], str]] = (
            [(self._members, s) for s in m.services]
            + [(self._wp_members, w) for w in m.waypoints]
            + ([(self._node_workloads, m.node)] if m.node else []))
        for table, key in pairs:
            if remove:
                bucket = table.get(key)
                if bucket is not None:
                    bucket.discard(name)
                    if not bucket:
                        del table[key]
            else:
                table.setdefault(key, set()).add(name)

    def _set_authz(self, key: str, policy: az.Authorization | None) -> None:
        if key not in self._orig_authz:
            self._orig_authz[key] = self._authz_bytes.get(key)
        if policy is None:
            self._authz_bytes.pop(key, None)
        else:
            self._authz_bytes[key] = policy.SerializeToString(deterministic=True)

    def _reject(self, kind: str, ns: str, name: object, error: Exception) -> None:
        self.rejected.labels(kind).inc()
        log.warning("skipping %s %s/%s: %s", kind, ns, name, error)

    @staticmethod
    def _normal_ip_key(key: str) -> str:
        network, sep, ip = key.rpartition("/")
        if not sep:
            return key
        try:
            return f"{network}/{ipaddress.ip_address(ip)}"
        except ValueError:
            return key


# ---------------------------------------------------------------------- component


class IndexComponent(Component):
    """Component ``ambient-index``: ``.index`` is the :class:`AmbientIndex` over the
    ``config-source`` store, built at start (after the source's initial load)."""

    name = "ambient-index"

    def __init__(self, index: AmbientIndex):
        self.index = index
        self.started = False

    async def start(self) -> None:
        change = self.index.start()
        self.started = True
        log.info("ambient index built: %d addresses, %d authorizations",
                 len(change.addresses_changed), len(change.authorizations_changed))

    async def stop(self, grace: float) -> None:
        self.index.stop()

    def ready(self) -> tuple[bool, str]:
        return (True, "") if self.started else (False, "index not built")

    def debug_state(self) -> dict:
        return self.index.debug_state()


def build(ctx: AgentContext) -> IndexComponent | None:
    """Builder for ``agent.daemon.COMPONENT_BUILDERS``; needs the ``config-source`` component."""
    source = ctx.get("config-source")
    if source is None:
        return None
    cfg = ctx.config
    mesh = Mesh(cluster_id=cfg.cluster_id, root_namespace=cfg.system_namespace,
                trust_domain=cfg.trust_domain, network=cfg.network)
    index = AmbientIndex(source.store, mesh, ctx.registry)
    return IndexComponent(index)
