"""The ambient index: store objects -> Workload / Service / Authorization resources, kept
incrementally (``docs/ambient.md``). Implements :class:`ambient.api.AmbientIndex`.

This module wires the parts, one per output, and owns the event and flush order:

- :mod:`ambient.index_gateways`: waypoints, network gateways, the mesh network;
- :mod:`ambient.index_services`: Service addresses (Services, ServiceEntries, LocalServices);
- :mod:`ambient.index_slices`: EndpointSlice endpoints and Pod targetRefs;
- :mod:`ambient.index_policies`: Authorizations (policies, PeerAuthentications, LocalPolicies);
- :mod:`ambient.index_workloads`: Workload addresses (pods, WorkloadEntries, ServiceEntry
  endpoints, LocalWorkloads);
- :mod:`ambient.index_outputs`: the outputs, held serialized, and the diff;
  :mod:`ambient.index_base`: what the parts share.

How it stays incremental: every store event goes to its kind's handler
(:attr:`AmbientIndex.handlers`), which marks what it can affect *dirty* — a pod marks
its workload; a Service marks its hostname and the pods its old/new selector matches; a
namespace marks what lives in it; a policy marks the workloads its selector matches. A
flush recomputes only the dirty items, in dependency order (services, then
authorizations, then EndpointSlices, then workloads), compares each produced proto's
deterministic bytes with what it held, and announces only real changes to subscribers as
one :class:`ambient.api.IndexChange`. A Gateway (waypoint) or the system namespace's
network label changing is rare and reaches across namespaces, so it recomputes everything
(still announcing only what changed).

Adding a kind: the kind in :data:`ambient.store.KINDS`, a mark handler (and, if it has
its own dirty set, an update) in the part that owns its output, and one row in
:attr:`AmbientIndex.handlers`.

Bad objects never raise out of the index: the item is dropped (or its old output
removed), a warning names kind/namespace/name and the field, and
``ambient_agent_index_rejected_total{kind}`` counts it.
"""

from __future__ import annotations

import logging
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from agent.core import gcpause
from agent.core.lifecycle import AgentContext, Component
from ambient import authorization_pb2 as az
from ambient import translate_service as ts
from ambient import workload_pb2 as wl
from ambient.api import IndexChange, Updater
from ambient.index_base import Dirty, IndexBase, LocalKey
from ambient.index_gateways import Gateways
from ambient.index_outputs import Outputs
from ambient.index_policies import Policies
from ambient.index_services import Services
from ambient.index_slices import Slices
from ambient.index_workloads import Workloads
from ambient.objects import Mesh
from ambient.store import ObjectStore, StoreEvent

log = logging.getLogger(__name__)

EventHandler = Callable[[StoreEvent], None]


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
        self._subscribers: list[Updater] = []
        self._unsubscribe_store: Callable[[], None] | None = None
        registry = registry if registry is not None else CollectorRegistry()
        self.rejected = Counter("ambient_agent_index_rejected",
                                "objects the index skipped or degraded", ["kind"],
                                registry=registry)
        self.pushes = Counter("ambient_agent_index_changes",
                              "index changes announced to subscribers", registry=registry)
        self._sizes = Gauge("ambient_agent_index_resources", "resources held by the index",
                            ["type"], registry=registry)
        # the children looked up once: two labels() calls per announced change were ~3 %
        # of the agent's CPU per change burst (cProfile, issue 28)
        self._size_addresses = self._sizes.labels("address")
        self._size_authorizations = self._sizes.labels("authorization")
        self._outputs = Outputs()
        self._dirty = Dirty()
        base = self._base = IndexBase(store, mesh, mesh, self._dirty, self._outputs, self.rejected)
        published: dict[str, ts.ServiceInfo] = {}
        self._gateways = Gateways(base)
        self._slices = Slices(base, published)
        self._services = Services(base, self._gateways, self._slices, published)
        self._policies = Policies(base)
        self._workloads = Workloads(base, self._gateways, self._services, self._slices,
                                    self._policies)
        #: store kind -> what an event of it marks dirty (kinds not listed are ignored)
        self.handlers: dict[str, EventHandler] = {
            "Namespace": self._mark_namespace,
            "Node": self._workloads.mark_node,
            "Pod": self._workloads.mark_pod,
            "WorkloadEntry": self._workloads.mark_workload_entry,
            "Service": self._services.mark,
            "ServiceEntry": self._services.mark,
            "EndpointSlice": self._slices.mark,
            "AuthorizationPolicy": self._policies.mark_authorization_policy,
            "PeerAuthentication": self._policies.mark_peer_authentication,
            "Gateway": self._gateways.mark,
            "GatewayClass": self._gateways.mark,
            "LocalWorkload": self._mark_local,
            "LocalService": self._mark_local,
            "LocalPolicy": self._mark_local,
            # read by the waypoints' Envoy config (ambient/waypoint/), no index output
            "HTTPRoute": lambda ev: None,
            "GRPCRoute": lambda ev: None,
            "TCPRoute": lambda ev: None,
        }
        #: local-config kind -> its update (local objects are applied in sorted order)
        self._local_updates: dict[str, Callable[[str, str], None]] = {
            "LocalService": lambda ns, name: self._services.update_source(
                ("LocalService", ns, name), store.get("LocalService", ns, name)),
            "LocalWorkload": self._workloads.update_local,
            "LocalPolicy": self._policies.update_local,
        }

    @property
    def mesh(self) -> Mesh:
        """The mesh settings with the network the system namespace's label names."""
        return self._base.mesh

    # ------------------------------------------------------------------ public API

    def start(self) -> IndexChange:
        """Build everything from the store and follow its changes. Returns the initial change."""
        if self._unsubscribe_store is None:
            self._unsubscribe_store = self.store.subscribe(self.on_events)
        self._dirty.full = True
        with gcpause.paused():  # the first build allocates the whole index at once
            return self._flush()

    def stop(self) -> None:
        if self._unsubscribe_store:
            self._unsubscribe_store()
            self._unsubscribe_store = None

    def addresses(self) -> dict[str, wl.Address]:
        """Every Address, parsed (for inspection; xDS reads :meth:`address_bytes`)."""
        return {name: wl.Address.FromString(b) for name, b in self._outputs.addr_bytes.items()}

    def address(self, name: str) -> wl.Address | None:
        data = self._outputs.addr_bytes.get(name)
        return wl.Address.FromString(data) if data is not None else None

    def address_names(self, kind: str | None = None) -> list[str]:
        """Resource names of every Address (only ``"workload"``s or ``"service"``s with
        ``kind``)."""
        if kind is None:
            return list(self._outputs.addr_bytes)
        return [n for n, m in self._outputs.addr_meta.items() if m.kind == kind]

    def address_bytes(self, name: str) -> bytes | None:
        """The Address serialized (deterministic), or None."""
        return self._outputs.addr_bytes.get(name)

    def authorizations(self) -> dict[str, az.Authorization]:
        return {name: az.Authorization.FromString(b)
                for name, b in self._outputs.authz_bytes.items()}

    def authorization(self, name: str) -> az.Authorization | None:
        data = self._outputs.authz_bytes.get(name)
        return az.Authorization.FromString(data) if data is not None else None

    def authorization_names(self) -> list[str]:
        return list(self._outputs.authz_bytes)

    def authorization_bytes(self, name: str) -> bytes | None:
        return self._outputs.authz_bytes.get(name)

    def lookup(self, key: str) -> list[str]:
        """Uid -> it; ``network/IP`` -> workloads and services (+ their members) with
        that address; ``namespace/hostname`` -> the service + its member workloads."""
        return self._outputs.lookup(key)

    def waypoint_resources(self, namespace: str, name: str) -> set[str]:
        return set(self._outputs.wp_members.get(f"{namespace}/{name}", ()))

    def node_workloads(self, node: str) -> set[str]:
        """Workload resource names whose ``node`` is ``node`` (ZDS/on-demand warm-up)."""
        return set(self._outputs.node_workloads.get(node, ()))

    def subscribe(self, updater: Updater) -> Callable[[], None]:
        self._subscribers.append(updater)

        def unsubscribe() -> None:
            if updater in self._subscribers:
                self._subscribers.remove(updater)

        return unsubscribe

    def debug_state(self) -> dict:
        kinds: dict[str, int] = {}
        for m in self._outputs.addr_meta.values():
            kinds[m.kind] = kinds.get(m.kind, 0) + 1
        return {"workloads": kinds.get("workload", 0), "services": kinds.get("service", 0),
                "authorizations": len(self._outputs.authz_bytes),
                "waypoints": sorted(self._gateways.waypoints), "network": self.mesh.network}

    # ------------------------------------------------------------------ events

    def on_events(self, events: list[StoreEvent]) -> IndexChange:
        """Apply one store transaction; never raises (a failing item is logged and skipped)."""
        for ev in events:
            handler = self.handlers.get(ev.kind)
            if handler is None:
                continue
            try:
                handler(ev)
            except Exception:  # an unexpected shape must not stop the index
                log.exception("index: cannot apply %s %s/%s", ev.kind, ev.namespace, ev.name)
                self.rejected.labels(ev.kind).inc()
        return self._flush()

    def _mark_namespace(self, ev: StoreEvent) -> None:
        """A namespace's labels and annotations feed everything in it; the system
        namespace's network label feeds everything."""
        if ev.name == self.base_mesh.root_namespace and self._gateways.network_changed():
            self._dirty.full = True
        self._base.mark_namespace_workloads(ev.name)
        self._services.mark_namespace(ev.name)

    def _mark_local(self, ev: StoreEvent) -> None:
        key: LocalKey = (ev.kind, ev.namespace, ev.name)
        self._dirty.local.add(key)

    # ------------------------------------------------------------------ flush

    def _flush(self) -> IndexChange:
        d = self._dirty
        if not d.any():
            return IndexChange()
        if d.full:
            self._gateways.network_changed()
            self._gateways.refresh()
            self._services.mark_all()
            self._workloads.mark_all()
            self._slices.mark_all()
            self._policies.mark_all()
            d.full = False
            d.everything = True  # until d.reset() below
        services, policies, workloads = self._services, self._policies, self._workloads
        while d.hosts:
            services.publish_host(d.hosts.pop())
        if d.pa:
            d.pa = False
            policies.update_peer_authentications()
        while d.policies:
            policies.update_policy(*d.policies.pop())
        for kind, ns, name in sorted(d.local):
            self._local_updates[kind](ns, name)
        d.local.clear()
        while d.hosts:  # LocalService updates above
            services.publish_host(d.hosts.pop())
        while d.slices:
            self._slices.update(*d.slices.pop())
        while d.ses:
            workloads.update_service_entry(*d.ses.pop())
        while d.wes:
            workloads.update_workload_entry(*d.wes.pop())
        while d.pods:
            workloads.update_pod(*d.pods.pop())
        d.reset()
        return self._announce()

    def _announce(self) -> IndexChange:
        change = self._outputs.take_change()
        self._size_addresses.set(len(self._outputs.addr_bytes))
        self._size_authorizations.set(len(self._outputs.authz_bytes))
        if not change.empty():
            self.pushes.inc()
            for updater in list(self._subscribers):
                try:
                    updater(change)
                except Exception:
                    log.exception("index subscriber failed")
        return change


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


def build(ctx: AgentContext, store: ObjectStore) -> IndexComponent:
    """The ``ambient-index`` component over the config source's ``store``."""
    cfg = ctx.config
    mesh = Mesh(cluster_id=cfg.cluster_id, root_namespace=cfg.system_namespace,
                trust_domain=cfg.trust_domain, network=cfg.network)
    index = AmbientIndex(store, mesh, ctx.registry)
    return IndexComponent(index)
