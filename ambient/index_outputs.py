"""The ambient index's outputs, held serialized, their secondary indexes, and the diff a
flush announces (:class:`ambient.api.IndexChange`).

Outputs are kept as deterministic bytes: a parsed upb Address costs ~2.5 KiB against
~150 bytes serialized, and xDS sends the bytes as they are; readers of the typed message
parse on demand. The first write of a name in a flush remembers its old bytes, so the
announced change lists only names whose bytes really changed.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import sys
from typing import Iterable

from ambient import authorization_pb2 as az
from ambient import workload_pb2 as wl
from ambient.api import IndexChange
from ambient.objects import ip_text

_KIND = {"workload": "workload", "service": "service"}  # one str object per kind


@dataclasses.dataclass(slots=True)
class AddrMeta:
    """Secondary-index entries of one Address, so removal is exact, and its kind
    (``"workload"``/``"service"``: the Address's oneof)."""

    ip_keys: tuple[str, ...] = ()
    services: tuple[str, ...] = ()
    waypoints: tuple[str, ...] = ()
    node: str = ""
    kind: str = ""


class Outputs:
    """Address and Authorization bytes by resource name, with the indexes
    :meth:`lookup`, ``wp_members`` (waypoint key -> names bound to it) and
    ``node_workloads`` (node -> workload names) read."""

    def __init__(self) -> None:
        self.addr_bytes: dict[str, bytes] = {}
        self.addr_meta: dict[str, AddrMeta] = {}
        self.authz_bytes: dict[str, bytes] = {}
        # one entry per address, almost always one name: tuples (48 bytes) not sets (216)
        self.by_ip: dict[str, tuple[str, ...]] = {}
        self.members: dict[str, set[str]] = {}
        self.wp_members: dict[str, set[str]] = {}
        self.node_workloads: dict[str, set[str]] = {}
        # workload names each source object produced (a ServiceEntry's endpoints, an
        # EndpointSlice's targetRef-less endpoints, a LocalWorkload)
        self._produced: dict[tuple[str, str, str], set[str]] = {}
        self._orig_addr: dict[str, bytes | None] = {}
        self._orig_authz: dict[str, bytes | None] = {}

    # ------------------------------------------------------------------ writes

    def set_address(self, name: str, addr: wl.Address | None,
                    meta_: AddrMeta | None = None) -> None:
        """Hold ``addr`` (None: remove) under ``name`` with its index entries."""
        if name not in self._orig_addr:
            self._orig_addr[name] = self.addr_bytes.get(name)
        old_meta = self.addr_meta.pop(name, None)
        if old_meta is not None:
            self._index(name, old_meta, remove=True)
        if addr is None:
            self.addr_bytes.pop(name, None)
            return
        self.addr_bytes[name] = addr.SerializeToString(deterministic=True)
        meta_ = meta_ or AddrMeta()
        meta_.kind = _KIND.get(addr.WhichOneof("type") or "", "")
        self.addr_meta[name] = meta_
        self._index(name, meta_, remove=False)

    def set_workload(self, w: wl.Workload | None, name: str,
                     waypoint_keys: tuple[str, ...] = ()) -> None:
        """Hold the Address of workload ``w`` (None: remove) under ``name``."""
        if w is None:
            self.set_address(name, None)
            return
        ip_keys = tuple(f"{w.network}/{ip_text(a)}" for a in w.addresses)
        # service keys and node names repeat across every pod: one string object each
        self.set_address(name, wl.Address(workload=w), AddrMeta(
            ip_keys=ip_keys, services=tuple(sys.intern(k) for k in sorted(w.services)),
            waypoints=waypoint_keys, node=sys.intern(w.node)))

    def replace_produced(self, source: tuple[str, str, str],
                         produced: list[tuple[wl.Workload, tuple[str, ...]]]) -> None:
        """Hold exactly ``produced`` (workloads + their waypoint keys) for ``source``
        (kind, namespace, name), removing what it produced before and no longer does."""
        names = {w.uid for w, _ in produced}
        for old in self._produced.get(source, set()) - names:
            self.set_workload(None, old)
        for w, keys in produced:
            self.set_workload(w, w.uid, keys)
        if names:
            self._produced[source] = names
        else:
            self._produced.pop(source, None)

    def set_authz(self, key: str, policy: az.Authorization | None) -> None:
        """Hold ``policy`` (None: remove) under ``key`` (``namespace/name``)."""
        if key not in self._orig_authz:
            self._orig_authz[key] = self.authz_bytes.get(key)
        if policy is None:
            self.authz_bytes.pop(key, None)
        else:
            self.authz_bytes[key] = policy.SerializeToString(deterministic=True)

    def take_change(self) -> IndexChange:
        """What changed since the last call: names whose bytes differ from before."""
        changed: set[str] = set()
        removed: set[str] = set()
        for name, old in self._orig_addr.items():
            new = self.addr_bytes.get(name)
            if new == old:
                continue
            (removed if new is None else changed).add(name)
        az_changed: set[str] = set()
        az_removed: set[str] = set()
        for name, old in self._orig_authz.items():
            new = self.authz_bytes.get(name)
            if new == old:
                continue
            (az_removed if new is None else az_changed).add(name)
        self._orig_addr.clear()
        self._orig_authz.clear()
        return IndexChange(frozenset(changed), frozenset(removed), frozenset(az_changed),
                           frozenset(az_removed))

    def _index(self, name: str, m: AddrMeta, remove: bool) -> None:
        by_ip = self.by_ip
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
            [(self.members, s) for s in m.services]
            + [(self.wp_members, w) for w in m.waypoints]
            + ([(self.node_workloads, m.node)] if m.node else []))
        for table, key in pairs:
            if remove:
                bucket = table.get(key)
                if bucket is not None:
                    bucket.discard(name)
                    if not bucket:
                        del table[key]
            else:
                table.setdefault(key, set()).add(name)

    # ------------------------------------------------------------------ reads

    def lookup(self, key: str) -> list[str]:
        """Uid -> it; ``network/IP`` -> workloads and services (+ their members) with
        that address; ``namespace/hostname`` -> the service + its member workloads."""
        m = self.addr_meta.get(key)
        if m is not None and m.kind == "workload":
            return [key]
        out: list[str] = []
        names = self.by_ip.get(_normal_ip_key(key))
        if names:
            seen: set[str] = set()

            def add(name: str) -> None:
                if name not in seen and name in self.addr_bytes:
                    seen.add(name)
                    out.append(name)

            for name in sorted(names):
                add(name)
                for member in sorted(self.members.get(name, ())):
                    add(member)
            return out
        if key in self.addr_bytes:
            # a service's name (the waypoint build asks this once per bound service)
            members = self.members.get(key)
            if not members:
                return [key]
            addr = self.addr_bytes
            return [key, *sorted(n for n in members if n != key and n in addr)]
        return out


def _normal_ip_key(key: str) -> str:
    network, sep, ip = key.rpartition("/")
    # a hostname (``namespace/name.ns.svc...``) is no IP: IPv4 text starts with a digit and
    # IPv6 text holds a ':'; skipping the parse spares a raised ValueError per service
    # lookup (the waypoint build looks up every bound service's members this way)
    if not sep or not ip or (not ip[0].isdigit() and ":" not in ip):
        return key
    try:
        return f"{network}/{ipaddress.ip_address(ip)}"
    except ValueError:
        return key
