"""The ambient index's Workload addresses: pods, WorkloadEntries, ServiceEntry endpoints
(and DNS hosts without endpoints) and local ``LocalWorkload`` objects, each translated by
:mod:`ambient.translate_workload` and then joined with what the other parts hold: the
services whose selector or EndpointSlice references them, the waypoint or application
tunnel, the network gateway, and the ordered policy keys."""

from __future__ import annotations

import logging

from ambient import localconfig
from ambient import translate_service as ts
from ambient import translate_workload as tw
from ambient import waypoints as wpmod
from ambient import workload_pb2 as wl
from ambient.index_base import BAD_OBJECT, IndexBase, Produced
from ambient.index_gateways import Gateways
from ambient.index_policies import Policies
from ambient.index_services import Services
from ambient.index_slices import Slices
from ambient.objects import field, labels, meta, spec
from ambient.store import StoreEvent

log = logging.getLogger(__name__)

DNS_RESOLUTIONS = ("DNS", "DNS_ROUND_ROBIN", "DYNAMIC_DNS")


class Workloads:
    def __init__(self, base: IndexBase, gateways: Gateways, services: Services, slices: Slices,
                 policies: Policies):
        self.base = base
        self.gateways = gateways
        self.services = services
        self.slices = slices
        self.policies = policies
        # WorkloadEntries without spec.address already logged (one line per entry)
        self._addressless: set[tuple[str, str]] = set()

    # ------------------------------------------------------------------ marks

    def mark_pod(self, ev: StoreEvent) -> None:
        self.base.dirty.pods.add((ev.namespace, ev.name))

    def mark_workload_entry(self, ev: StoreEvent) -> None:
        self.base.dirty.wes.add((ev.namespace, ev.name))

    def mark_node(self, ev: StoreEvent) -> None:
        """A Node's labels (region/zone) feed the locality of the pods on it."""
        self.base.dirty.pods.update((meta(p)["namespace"], meta(p)["name"])
                                    for p in self.base.store.list("Pod")
                                    if spec(p).get("nodeName") == ev.name)

    def mark_all(self) -> None:
        d, base = self.base.dirty, self.base
        d.pods.update(base.keys_of("Pod"))
        d.wes.update(base.keys_of("WorkloadEntry"))
        d.ses.update(base.keys_of("ServiceEntry"))
        d.local.update(("LocalWorkload", ns, name) for ns, name in base.keys_of("LocalWorkload"))

    # ------------------------------------------------------------------ joins

    def _finish(self, w: wl.Workload, ns: str, lbls: dict[str, str],
                policy_labels: dict[str, str] | None = None,
                waypoint: bool = True) -> tuple[str, ...]:
        """Waypoint/app tunnel (by ``lbls``; none without ``waypoint``), network gateway,
        policies (selected by ``policy_labels``, default ``lbls``). Returns waypoint keys.

        A ServiceEntry's workloads, as istiod's ``serviceEntryWorkloadBuilder``: the
        policies are picked by the ServiceEntry's labels, an inline endpoint's waypoint by
        the endpoint's labels, and a DNS host without endpoints has no waypoint."""
        ns_obj = self.base.store.get("Namespace", "", ns)
        keys: tuple[str, ...] = ()
        if waypoint:
            keys = self._waypoint(w, ns, lbls, ns_obj)
        gw = self.gateways.netgws.get(w.network)
        if gw is not None:
            w.network_gateway.ParseFromString(gw)
        # bound to a waypoint: its own use-waypoint, or a service's (published before us)
        meta_ = self.base.outputs.addr_meta
        bound = bool(keys) or any(meta_[k].waypoints for k in w.services if k in meta_)
        w.authorization_policies.extend(self.policies.policy_keys(
            ns, lbls if policy_labels is None else policy_labels, bound))
        return keys

    def _waypoint(self, w: wl.Workload, ns: str, lbls: dict[str, str],
                  ns_obj: dict | None) -> tuple[str, ...]:
        """A waypoint instance's application tunnel, or the waypoint ``lbls`` bind to."""
        waypoints = self.gateways.waypoints
        keys: tuple[str, ...] = ()
        instance = wpmod.instance_of(lbls, ns, waypoints)
        if instance is not None:
            if instance.inbound_protocol:
                w.application_tunnel.protocol = (wl.ApplicationTunnel.PROXY
                                                 if instance.inbound_protocol == "PROXY"
                                                 else wl.ApplicationTunnel.NONE)
                w.application_tunnel.port = instance.inbound_port
        else:
            wp = wpmod.resolve(wpmod.use_waypoint_ref(lbls, ns, ns_obj), "workload", ns, ns_obj,
                               waypoints)
            if wp is not None:
                w.waypoint.CopyFrom(wp.gateway_address())
                keys = (wp.key,)
        return keys

    # ------------------------------------------------------------------ updates

    def update_pod(self, ns: str, name: str) -> None:
        base = self.base
        outputs = base.outputs
        uid = tw.pod_uid(base.mesh, ns, name)
        pod = base.store.get("Pod", ns, name)
        if pod is None:
            outputs.set_workload(None, uid)
            return
        try:
            if not tw.pod_included(pod):
                outputs.set_workload(None, uid)
                return
            ns_obj = base.store.get("Namespace", "", ns)
            node = base.store.get("Node", "", str(spec(pod).get("nodeName") or ""))
            w = tw.pod_workload(pod, base.mesh, ns_obj, node)
            lbls = labels(pod)
            named = tw.container_ports(pod)
            for info in self.services.services_for(ns, lbls):
                w.services[info.key].CopyFrom(ts.workload_ports(info, named))
            pod_uid = str(meta(pod).get("uid") or "")
            for key, ref_uids in self.slices.refs.get((ns, name), {}).items():
                svc = self.services.published.get(key)
                if (svc is not None and svc.source == "Service" and key not in w.services
                        and pod_uid in ref_uids):
                    w.services[key].CopyFrom(ts.workload_ports(svc, named))
            keys = self._finish(w, ns, lbls)
        except BAD_OBJECT as e:
            base.reject("Pod", ns, name, e)
            outputs.set_workload(None, uid)
            return
        outputs.set_workload(w, uid, keys)

    def update_workload_entry(self, ns: str, name: str) -> None:
        base = self.base
        uid = f"{base.mesh.cluster_id}/networking.istio.io/WorkloadEntry/{ns}/{name}"
        we = base.store.get("WorkloadEntry", ns, name)
        if we is None:
            self._addressless.discard((ns, name))
            base.outputs.set_workload(None, uid)
            return
        try:
            w, lbls, named = tw.workload_entry(we, base.mesh)
            if not w.addresses and not w.hostname and (ns, name) not in self._addressless:
                self._addressless.add((ns, name))
                log.info("WorkloadEntry %s/%s has no spec.address: sent without an address "
                         "(reachable only through the gateway of network %r or its "
                         "waypoint), as istiod does", ns, name, w.network)
            for info in self.services.services_for(ns, lbls):
                w.services[info.key].CopyFrom(ts.workload_ports(info, named,
                                                                override_by_name=True))
            keys = self._finish(w, ns, lbls)
        except BAD_OBJECT as e:
            base.reject("WorkloadEntry", ns, name, e)
            base.outputs.set_workload(None, uid)
            return
        base.outputs.set_workload(w, uid, keys)

    def update_service_entry(self, ns: str, name: str) -> None:
        """A ServiceEntry's endpoints (or, resolved by DNS without endpoints or workload
        selector, one workload per host) for each hostname it won."""
        base = self.base
        source = ("ServiceEntry", ns, name)
        se = base.store.get("ServiceEntry", ns, name)
        produced: Produced = []
        won = ([i for i in self.services.published.values() if i.source_key == source]
               if se else [])
        if se is not None and won:
            try:
                endpoints = field(se, "spec.endpoints", list, [])
                for i, ep in enumerate(endpoints):
                    w, lbls, named = tw.se_endpoint(se, ep, i, base.mesh)
                    for info in won:
                        w.services[info.key].CopyFrom(ts.workload_ports(info, named,
                                                                        override_by_name=True))
                    produced.append((w, self._finish(w, ns, lbls, policy_labels=labels(se))))
                s = spec(se)
                if (not endpoints and not s.get("workloadSelector")
                        and s.get("resolution") in DNS_RESOLUTIONS):
                    for info in won:
                        w = tw.dns_host_workload(se, info.hostname, base.mesh)
                        w.services[info.key].CopyFrom(ts.workload_ports(info, {}))
                        produced.append((w, self._finish(w, ns, labels(se), waypoint=False)))
            except BAD_OBJECT as e:
                base.reject("ServiceEntry", ns, name, e)
                produced = []
        base.outputs.replace_produced(source, produced)

    def update_local(self, ns: str, name: str) -> None:
        """A LocalWorkload, sent as written (:func:`ambient.localconfig.workload`)."""
        obj = self.base.store.get("LocalWorkload", ns, name)
        try:
            produced: Produced = []
            if obj is not None:
                produced = [(localconfig.workload(spec(obj), f"{ns}/{name}"), ())]
            self.base.outputs.replace_produced(("LocalWorkload", ns, name), produced)
        except BAD_OBJECT as e:
            self.base.reject("LocalWorkload", ns, name, e)
