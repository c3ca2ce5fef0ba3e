"""An ADS client that asks for a waypoint's Envoy resources the way a waypoint Envoy does,
and a plain-dict view of what it got.

:class:`EnvoyAdsClient` is the delta ADS stream of Envoy (``DeltaAggregatedResources``)
as a waypoint's bootstrap configures it (``ambient/waypoint/bootstrap.py``: ADS, delta,
node on the first message only): wildcard CDS and LDS first; after each CDS response it
subscribes EDS to the names of the EDS clusters it holds, after each LDS response RDS to
the ``route_config_name`` of every ``rds`` HTTP connection manager of its listeners (what
Envoy's cluster and listener managers do when those resources warm). Every response is
ACKed; the client validates nothing (it is a reader, not Envoy: a NACK would change what
istiod keeps sending).

:func:`to_py` turns a resource into plain data with every ``Any`` unpacked when its type
is known to xds-protos (packages are imported on demand) and left as ``{"@type": url}``
otherwise (Istio's own filters such as ``istio.stats``), so two servers' resources can be
compared by the fields that decide behaviour.
"""

from __future__ import annotations

import base64
import importlib
import os
import pkgutil
import time
from typing import Any

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import json_format, message_factory, symbol_database

from ambient.xds.client import DeltaXdsClient

CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
LDS = "type.googleapis.com/envoy.config.listener.v3.Listener"
EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
RDS = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
ENVOY_TYPES = {CDS: cluster_pb2.Cluster, LDS: listener_pb2.Listener,
               EDS: endpoint_pb2.ClusterLoadAssignment, RDS: route_pb2.RouteConfiguration}
HCM = ("type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
       "HttpConnectionManager")

_WELL_KNOWN = ("google.protobuf.", "xds.type.v3.TypedStruct", "udpa.type.v1.TypedStruct")
_imported: set[str] = set()


def _message_class(full_name: str):
    """The generated class of ``full_name``, importing its xds-protos package on demand;
    None when no installed package defines it."""
    pool = symbol_database.Default().pool
    for attempt in range(2):
        try:
            return message_factory.GetMessageClass(pool.FindMessageTypeByName(full_name))
        except KeyError:
            if attempt:
                return None
        package = full_name.rsplit(".", 1)[0]
        if package in _imported:
            return None
        _imported.add(package)
        try:
            mod = importlib.import_module(package)
        except ImportError:
            return None
        for info in pkgutil.iter_modules(getattr(mod, "__path__", []) or
                                         [os.path.dirname(mod.__file__ or "")]):
            if info.name.endswith("_pb2"):
                try:
                    importlib.import_module(f"{package}.{info.name}")
                except ImportError:
                    pass
    return None


def to_py(msg) -> Any:
    """A protobuf message as plain data: set fields only (proto3 defaults are absent, as
    in JSON), enums by name, bytes in base64, ``Any`` unpacked where its type is known."""
    name = msg.DESCRIPTOR.full_name
    if name == "google.protobuf.Any":
        type_name = msg.type_url.rsplit("/", 1)[-1]
        cls = _message_class(type_name)
        if cls is None:
            return {"@type": type_name}
        inner = cls()
        inner.ParseFromString(msg.value)
        return {"@type": type_name, **_as_dict(to_py(inner))}
    if name.startswith(_WELL_KNOWN):
        return json_format.MessageToDict(msg, preserving_proto_field_name=True)
    out: dict[str, Any] = {}
    for fd, value in msg.ListFields():
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            vfd = fd.message_type.fields_by_name["value"]
            out[fd.name] = {k: (to_py(v) if vfd.message_type is not None else v)
                            for k, v in value.items()}
        elif fd.is_repeated:
            out[fd.name] = [_scalar(fd, v) for v in value]
        else:
            out[fd.name] = _scalar(fd, value)
    return out


def _as_dict(v: Any) -> dict:
    return v if isinstance(v, dict) else {"value": v}


def _scalar(fd, value) -> Any:
    if fd.message_type is not None:
        return to_py(value)
    if fd.enum_type is not None:
        ev = fd.enum_type.values_by_number.get(value)
        return ev.name if ev is not None else value
    if fd.type == fd.TYPE_BYTES:
        return base64.b64encode(value).decode()
    return value


def rds_names(listener: dict) -> set[str]:
    """``route_config_name`` of every RDS-configured HTTP connection manager of a listener
    (in its filter chains and its default chain)."""
    chains = list(listener.get("filter_chains", []))
    if "default_filter_chain" in listener:
        chains.append(listener["default_filter_chain"])
    out = set()
    for chain in chains:
        for f in chain.get("filters", []):
            tc = f.get("typed_config", {})
            if tc.get("@type", "").endswith("HttpConnectionManager") and "rds" in tc:
                out.add(tc["rds"]["route_config_name"])
    return out


class EnvoyAdsClient(DeltaXdsClient):
    """See the module docstring. ``resources(type_url)`` holds parsed Envoy messages;
    :meth:`view` the plain-data form; :attr:`last_response` the monotonic time of the last
    response (to tell a quiet stream)."""

    def __init__(self, target: str, *, node_id: str, metadata: dict, **kw: Any):
        super().__init__(target, node_id=node_id, metadata=metadata, types=(CDS, LDS), **kw)
        self._subscribed: dict[str, set[str]] = {EDS: set(), RDS: set()}
        self.last_response = time.monotonic()

    async def _apply(self, resp: discovery_pb2.DeltaDiscoveryResponse) -> None:
        type_url = resp.type_url
        store = self._resources.setdefault(type_url, {})
        versions = self.versions.setdefault(type_url, {})
        cls = ENVOY_TYPES.get(type_url)
        for res in resp.resources:
            if cls is None:
                continue
            msg = cls()
            msg.ParseFromString(res.resource.value)
            store[res.name] = msg
            versions[res.name] = res.version
        for name in resp.removed_resources:
            store.pop(name, None)
            versions.pop(name, None)
        self.responses.append(resp)
        self.last_response = time.monotonic()
        if self._outbox is not None:
            self._outbox.put_nowait(discovery_pb2.DeltaDiscoveryRequest(
                type_url=type_url, response_nonce=resp.nonce))
            if type_url == CDS:
                self._follow(EDS, {n for n, c in store.items()
                                   if c.type == cluster_pb2.Cluster.EDS})
            elif type_url == LDS:
                self._follow(RDS, set().union(*(rds_names(to_py(x)) for x in store.values()))
                             if store else set())
        self.synced.add(type_url)
        async with self._changed:
            self._changed.notify_all()

    def _follow(self, type_url: str, wanted: set[str]) -> None:
        have = self._subscribed[type_url]
        add, drop = sorted(wanted - have), sorted(have - wanted)
        if not add and not drop:
            return
        assert self._outbox is not None
        self._outbox.put_nowait(discovery_pb2.DeltaDiscoveryRequest(
            type_url=type_url, resource_names_subscribe=add, resource_names_unsubscribe=drop))
        self._subscribed[type_url] = set(wanted)
        for name in drop:
            self._resources.get(type_url, {}).pop(name, None)

    def pending(self) -> set[str]:
        """Subscribed EDS/RDS names not answered yet."""
        out = set()
        for type_url, names in self._subscribed.items():
            out |= {f"{type_url.rsplit('.', 1)[-1]}:{n}" for n in names
                    if n not in self._resources.get(type_url, {})}
        return out

    def quiet_for(self) -> float:
        return time.monotonic() - self.last_response

    def view(self) -> dict[str, dict[str, Any]]:
        """``{"LDS"|"CDS"|"EDS"|"RDS": {name: plain data}}``."""
        short = {CDS: "CDS", LDS: "LDS", EDS: "EDS", RDS: "RDS"}
        return {s: {n: to_py(m) for n, m in self._resources.get(t, {}).items()}
                for t, s in short.items()}
