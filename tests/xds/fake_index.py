"""A small in-memory index implementing ``ambient.api.AmbientIndex`` for the xDS tests.

It holds real ``workload_pb2.Address`` / ``authorization_pb2.Authorization`` messages and
reports changes exactly like the real index must (``docs/xds.md``: only when
the produced proto changed; lookups and waypoint membership as the real index). It is a
stand-in for the ambient index (built in parallel), not a mock: the server talks to it
through the same protocol and gets the same shapes.
"""

from __future__ import annotations

import ipaddress

from ambient import authorization_pb2, workload_pb2
from ambient.api import IndexChange

CLUSTER = "Kubernetes"


def pod(name: str, ns: str = "default", ip: str = "10.0.0.1", node: str = "node1",
        sa: str = "default", services: dict | None = None, waypoint: str | None = None,
        network: str = "") -> workload_pb2.Address:
    """A pod Workload Address named by its uid ``Kubernetes//Pod/<ns>/<name>``."""
    wl = workload_pb2.Workload(
        uid=f"{CLUSTER}//Pod/{ns}/{name}", name=name, namespace=ns, node=node,
        service_account=sa, trust_domain="cluster.local", network=network,
        addresses=[ipaddress.ip_address(ip).packed], cluster_id=CLUSTER,
        tunnel_protocol=workload_pb2.HBONE)
    for key, ports in (services or {}).items():
        wl.services[key].ports.add(service_port=ports[0], target_port=ports[1])
    if waypoint:
        wl.waypoint.hostname.namespace = ns
        wl.waypoint.hostname.hostname = waypoint
        wl.waypoint.hbone_mtls_port = 15008
    return workload_pb2.Address(workload=wl)


def service(name: str, ns: str = "default", vip: str = "10.96.0.1", port: int = 80,
            target: int = 8080, waypoint: str | None = None) -> workload_pb2.Address:
    svc = workload_pb2.Service(name=name, namespace=ns,
                               hostname=f"{name}.{ns}.svc.cluster.local", canonical=True)
    svc.addresses.add(network="", address=ipaddress.ip_address(vip).packed)
    svc.ports.add(service_port=port, target_port=target)
    if waypoint:
        svc.waypoint.hostname.namespace = ns
        svc.waypoint.hostname.hostname = waypoint
        svc.waypoint.hbone_mtls_port = 15008
    return workload_pb2.Address(service=svc)


def policy(name: str, ns: str = "default", port: int = 9999) -> authorization_pb2.Authorization:
    pol = authorization_pb2.Authorization(name=name, namespace=ns,
                                          scope=authorization_pb2.NAMESPACE,
                                          action=authorization_pb2.DENY)
    pol.groups.add().rules.add().matches.add(destination_ports=[port])
    return pol


def address_name(address: workload_pb2.Address) -> str:
    if address.WhichOneof("type") == "workload":
        return address.workload.uid
    return f"{address.service.namespace}/{address.service.hostname}"


class FakeIndex:
    """``put``/``delete`` addresses and policies; each call notifies subscribers once
    (``batch()`` groups several calls into one change)."""

    def __init__(self):
        self._addresses: dict[str, workload_pb2.Address] = {}
        self._policies: dict[str, authorization_pb2.Authorization] = {}
        self._updaters: list = []
        self._batch: list[IndexChange] | None = None

    # -- protocol --
    def addresses(self):
        return dict(self._addresses)

    def address(self, name):
        return self._addresses.get(name)

    def address_names(self, kind=None):
        return [n for n, a in self._addresses.items()
                if kind is None or a.WhichOneof("type") == kind]

    def address_bytes(self, name):
        addr = self._addresses.get(name)
        return addr.SerializeToString(deterministic=True) if addr is not None else None

    def authorizations(self):
        return dict(self._policies)

    def authorization(self, name):
        return self._policies.get(name)

    def authorization_names(self):
        return list(self._policies)

    def authorization_bytes(self, name):
        pol = self._policies.get(name)
        return pol.SerializeToString(deterministic=True) if pol is not None else None

    def lookup(self, key):
        if key in self._addresses:
            addr = self._addresses[key]
            if addr.WhichOneof("type") == "service":
                return [key] + self._members(key)
            return [key]
        network, _, ip = key.partition("/")
        try:
            packed = ipaddress.ip_address(ip).packed
        except ValueError:
            return []
        out = [n for n, a in self._addresses.items() if a.WhichOneof("type") == "workload"
               and a.workload.network == network and packed in a.workload.addresses]
        if out:
            return out
        for n, a in self._addresses.items():
            if a.WhichOneof("type") == "service" and any(
                    na.network == network and na.address == packed for na in a.service.addresses):
                return [n] + self._members(n)
        return []

    def _members(self, svc_name):
        return [n for n, a in self._addresses.items() if a.WhichOneof("type") == "workload"
                and svc_name in a.workload.services]

    def waypoint_resources(self, namespace, name):
        host = f"{name}.{namespace}.svc.cluster.local"
        out = set()
        for n, a in self._addresses.items():
            kind = a.WhichOneof("type")
            gw = a.workload.waypoint if kind == "workload" else a.service.waypoint
            if gw.hostname.namespace == namespace and gw.hostname.hostname == host:
                out.add(n)
        return out

    def node_workloads(self, node):
        return {n for n, a in self._addresses.items()
                if a.WhichOneof("type") == "workload" and a.workload.node == node}

    def subscribe(self, updater):
        self._updaters.append(updater)
        return lambda: self._updaters.remove(updater)

    # -- mutation --
    def _emit(self, change: IndexChange) -> None:
        if change.empty():
            return
        if self._batch is not None:
            self._batch.append(change)
            return
        for u in list(self._updaters):
            u(change)

    def put(self, *addresses: workload_pb2.Address) -> None:
        changed = set()
        for a in addresses:
            name = address_name(a)
            if self._addresses.get(name) != a:
                self._addresses[name] = a
                changed.add(name)
        self._emit(IndexChange(addresses_changed=frozenset(changed)))

    def delete(self, *names: str) -> None:
        gone = {n for n in names if self._addresses.pop(n, None) is not None}
        self._emit(IndexChange(addresses_removed=frozenset(gone)))

    def put_policy(self, *pols) -> None:
        changed = set()
        for p in pols:
            name = f"{p.namespace}/{p.name}"
            if self._policies.get(name) != p:
                self._policies[name] = p
                changed.add(name)
        self._emit(IndexChange(authorizations_changed=frozenset(changed)))

    def delete_policy(self, *names: str) -> None:
        gone = {n for n in names if self._policies.pop(n, None) is not None}
        self._emit(IndexChange(authorizations_removed=frozenset(gone)))

    def rebuild(self, addresses, policies) -> None:
        """Replace everything (a full rebuild): reports removed names and changed names."""
        new_a = {address_name(a): a for a in addresses}
        new_p = {f"{p.namespace}/{p.name}": p for p in policies}
        change = IndexChange(
            addresses_changed=frozenset(n for n, a in new_a.items() if self._addresses.get(n) != a),
            addresses_removed=frozenset(set(self._addresses) - set(new_a)),
            authorizations_changed=frozenset(n for n, p in new_p.items()
                                             if self._policies.get(n) != p),
            authorizations_removed=frozenset(set(self._policies) - set(new_p)))
        self._addresses, self._policies = new_a, new_p
        self._emit(change)
