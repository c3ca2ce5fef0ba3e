"""The ambient index's global inputs: waypoints and network gateways (from Gateway and
GatewayClass objects, :mod:`ambient.waypoints`) and the mesh network (the system
namespace's ``topology.istio.io/network`` label). They are rare and reach across
namespaces, so a change here makes the next flush recompute everything (still
announcing only what changed)."""

from __future__ import annotations

import dataclasses

from ambient import waypoints as wpmod
from ambient.index_base import IndexBase
from ambient.objects import labels, meta, spec
from ambient.store import StoreEvent


class Gateways:
    """``waypoints`` (``namespace/name`` -> :class:`ambient.waypoints.Waypoint`) and
    ``netgws`` (network -> serialized GatewayAddress)."""

    def __init__(self, base: IndexBase):
        self.base = base
        self.waypoints: dict[str, wpmod.Waypoint] = {}
        self.netgws: dict[str, bytes] = {}

    def mark(self, ev: StoreEvent) -> None:
        """Gateway / GatewayClass event: everything is dirty when a waypoint or network
        gateway changed."""
        if self.refresh():
            self.base.dirty.full = True

    def network_changed(self) -> bool:
        """Re-read the system namespace's network label; True (and gateways refreshed)
        when ``base.mesh`` changed."""
        base = self.base
        ns = base.store.get("Namespace", "", base.base_mesh.root_namespace)
        network = (labels(ns).get(wpmod.NETWORK_LABEL) if ns else None) or base.base_mesh.network
        if network == base.mesh.network:
            return False
        base.mesh = dataclasses.replace(base.base_mesh, network=network)
        self.refresh()
        return True

    def refresh(self) -> bool:
        """Recompute waypoints and network gateways; True when either changed."""
        waypoints: dict[str, wpmod.Waypoint] = {}
        netgws: dict[str, bytes] = {}
        store = self.base.store
        for gw in store.list("Gateway"):
            try:
                cls = store.get("GatewayClass", "", str(spec(gw).get("gatewayClassName")))
                wp = wpmod.waypoint_from_gateway(gw, cls, self.base.mesh.network)
                if wp is not None:
                    waypoints[wp.key] = wp
                ng = wpmod.network_gateway(gw)
                if ng is not None:
                    netgws.setdefault(ng[0], ng[1])
            except Exception as e:  # malformed Gateway: skip it, keep the rest
                self.base.reject("Gateway", meta(gw).get("namespace", ""), meta(gw).get("name"), e)
        changed = waypoints != self.waypoints or netgws != self.netgws
        self.waypoints, self.netgws = waypoints, netgws
        return changed
