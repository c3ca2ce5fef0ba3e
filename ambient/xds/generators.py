"""One generator per workload-xDS type URL (``docs/xds.md``).

A generator turns index entries into ``envoy.service.discovery.v3.Resource`` messages
for one type URL, caches them by resource name, and knows which resource names an
:class:`ambient.api.IndexChange` touches for its type. The xDS server holds a registry
``type URL -> generator`` (:func:`default_generators`): adding a type means adding a
generator here, not editing the push loop (Istio's ``xdsgen.go``).

Versions are content hashes ("any deterministic content hash"): the hex
BLAKE2b-64 of the deterministically serialized payload, so they are stable across
restarts and replicas and a client's ``initial_resource_versions`` can be compared.

The cache is shared by every stream: the first stream that needs a resource
serializes it, the others reuse the same bytes. :meth:`Generator.invalidate` must be
called for every index change *before* any stream reads the index again (the server
does this in its updater callback, ahead of the debounced fan-out).
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import ipaddress
from typing import Iterable

from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2
from google.protobuf.message import Message

from ambient import authorization_pb2, workload_pb2  # noqa: F401  (registers the types)
from ambient.api import AmbientIndex, IndexChange

ADDRESS_TYPE = "type.googleapis.com/istio.workload.Address"
WORKLOAD_TYPE = "type.googleapis.com/istio.workload.Workload"
AUTHORIZATION_TYPE = "type.googleapis.com/istio.security.Authorization"

SHORT_NAMES = {"address": ADDRESS_TYPE, "workload": WORKLOAD_TYPE,
               "authorization": AUTHORIZATION_TYPE}


def content_version(payload: bytes) -> str:
    """Hex BLAKE2b-64 of ``payload`` (16 characters)."""
    return hashlib.blake2b(payload, digest_size=8).hexdigest()


def _ip_text(raw: bytes) -> str | None:
    try:
        return str(ipaddress.ip_address(raw))
    except ValueError:
        return None


def address_aliases(address: workload_pb2.Address) -> list[str]:
    """The ``network/IP`` keys of an Address: one per workload IP,
    one per service VIP (CIDR VIPs as ``network/IP/len``)."""
    kind = address.WhichOneof("type")
    if kind == "workload":
        wl = address.workload
        return [f"{wl.network}/{ip}" for ip in map(_ip_text, wl.addresses) if ip]
    if kind == "service":
        out = []
        for na in address.service.addresses:
            ip = _ip_text(na.address)
            if ip:
                out.append(f"{na.network}/{ip}/{na.length}" if na.length else f"{na.network}/{ip}")
        return out
    return []


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """``payload``: serialized ``DeltaDiscoveryResponse.resources`` of every resource;
    ``versions``: name -> version of the same resources."""

    payload: bytes
    versions: dict[str, str]


class Generator(abc.ABC):
    """Resources of one type URL, built from the index and cached by resource name.

    Subclasses implement :meth:`_payload` (the typed message for a name, or None) and
    :meth:`names`; ``change_fields`` names the two IndexChange fields this type follows.
    """

    type_url: str = ""
    change_fields: tuple[str, str] = ("addresses_changed", "addresses_removed")
    on_demand: bool = False

    def __init__(self, index: AmbientIndex):
        self.index = index
        self._cache: dict[str, discovery_pb2.Resource | None] = {}
        self._snapshot: Snapshot | None = None

    # -- index views --
    @abc.abstractmethod
    def names(self) -> Iterable[str]:
        """Every resource name of this type currently in the index."""

    @abc.abstractmethod
    def _payload(self, name: str) -> Message | None:
        """The typed message named ``name``, or None when the index has none."""

    def _payload_bytes(self, name: str) -> bytes | None:
        """``name``'s message serialized (deterministic), or None. The index holds its
        outputs serialized, so the generators take those bytes as they are."""
        msg = self._payload(name)
        return msg.SerializeToString(deterministic=True) if msg is not None else None

    def lookup(self, key: str) -> list[str]:
        """Resource names answering a subscribed key (exact name by default)."""
        return [key] if self.resource(key) is not None else []

    def aliases(self, name: str) -> list[str]:
        return []

    def workload(self, name: str) -> workload_pb2.Workload | None:
        """The Workload behind resource ``name`` (on-demand push decisions), if any."""
        return None

    # -- cache --
    def resource(self, name: str) -> discovery_pb2.Resource | None:
        """The cached Resource for ``name`` (name, version, Any), or None if absent."""
        try:
            return self._cache[name]
        except KeyError:
            pass
        payload = self._payload_bytes(name)
        res = None
        if payload is not None:
            res = discovery_pb2.Resource(
                name=name, version=content_version(payload),
                resource=any_pb2.Any(type_url=self.type_url, value=payload))
        self._cache[name] = res
        return res

    def resource_with_aliases(self, name: str, extra: Iterable[str] = ()
                              ) -> discovery_pb2.Resource | None:
        """Like :meth:`resource` with ``aliases`` filled (on-demand answers);
        ``extra`` keys (the one the client asked with, when spelled otherwise) are added
        when not already there."""
        res = self.resource(name)
        if res is None:
            return None
        aliases = self.aliases(name)
        aliases += [k for k in extra if k not in aliases and k != name]
        if not aliases:
            return res
        copy = discovery_pb2.Resource()
        copy.CopyFrom(res)
        copy.aliases.extend(aliases)
        return copy

    def resource_named(self, name: str, key: str) -> discovery_pb2.Resource | None:
        """The resource ``name`` under the resource name ``key`` (same payload and
        version): the on-demand answer's copy that wakes a waiter keyed by ``key``."""
        res = self.resource(name)
        if res is None:
            return None
        return discovery_pb2.Resource(name=key, version=res.version, resource=res.resource,
                                      aliases=[name])

    def snapshot(self) -> "Snapshot":
        """Every resource of this type, pre-serialized as the ``resources`` field of a
        DeltaDiscoveryResponse, shared by all streams until the next change of this type.

        Protobuf concatenation is a merge (a documented wire-format property), so a
        response is these bytes followed by the serialized rest of the response; this is
        what keeps an initial push to N clients close to one serialization (benchmarks).
        """
        if self._snapshot is None:
            resp = discovery_pb2.DeltaDiscoveryResponse()
            versions = {}
            for name in self.names():
                res = self.resource(name)
                if res is not None:
                    resp.resources.append(res)
                    versions[name] = res.version
            self._snapshot = Snapshot(resp.SerializeToString(), versions)
        return self._snapshot

    def touched(self, change: IndexChange) -> tuple[frozenset[str], frozenset[str]]:
        """``(changed, removed)`` names of this type in ``change``."""
        return getattr(change, self.change_fields[0]), getattr(change, self.change_fields[1])

    def invalidate(self, change: IndexChange) -> None:
        """Forget cached resources the change touched (call before reading the index)."""
        changed, removed = self.touched(change)
        if changed or removed:
            self._snapshot = None
        for name in changed:
            self._cache.pop(name, None)
        for name in removed:
            self._cache.pop(name, None)

    def cached(self) -> int:
        return len(self._cache)


class AddressGenerator(Generator):
    """``istio.workload.Address`` (WDS): workloads named by uid, services by
    ``namespace/hostname``; on-demand keys resolved with ``index.lookup``."""

    type_url = ADDRESS_TYPE
    on_demand = True

    def names(self) -> Iterable[str]:
        return self.index.address_names()

    def _payload(self, name: str) -> Message | None:
        return self.index.address(name)

    def _payload_bytes(self, name: str) -> bytes | None:
        return self.index.address_bytes(name)

    def lookup(self, key: str) -> list[str]:
        return list(self.index.lookup(key))

    def aliases(self, name: str) -> list[str]:
        address = self.index.address(name)
        return address_aliases(address) if address is not None else []

    def workload(self, name: str) -> workload_pb2.Workload | None:
        address = self.index.address(name)
        if address is not None and address.WhichOneof("type") == "workload":
            return address.workload
        return None


class WorkloadGenerator(AddressGenerator):
    """Legacy ``istio.workload.Workload``: bare Workload messages, services omitted
."""

    type_url = WORKLOAD_TYPE

    def names(self) -> Iterable[str]:
        return self.index.address_names("workload")

    def _payload(self, name: str) -> Message | None:
        return self.workload(name)

    def _payload_bytes(self, name: str) -> bytes | None:
        msg = self.workload(name)
        return msg.SerializeToString(deterministic=True) if msg is not None else None

    def lookup(self, key: str) -> list[str]:
        return [n for n in self.index.lookup(key) if self.workload(n) is not None]


class AuthorizationGenerator(Generator):
    """``istio.security.Authorization`` (WADS): policies by ``namespace/name``; wildcard
    only in ztunnel, exact names otherwise."""

    type_url = AUTHORIZATION_TYPE
    change_fields = ("authorizations_changed", "authorizations_removed")

    def names(self) -> Iterable[str]:
        return self.index.authorization_names()

    def _payload(self, name: str) -> Message | None:
        return self.index.authorization(name)

    def _payload_bytes(self, name: str) -> bytes | None:
        return self.index.authorization_bytes(name)


GENERATOR_CLASSES: tuple[type[Generator], ...] = (
    AddressGenerator, WorkloadGenerator, AuthorizationGenerator)


def default_generators(index: AmbientIndex) -> dict[str, Generator]:
    """The registry ``type URL -> generator`` for every type this server speaks."""
    return {cls.type_url: cls(index) for cls in GENERATOR_CLASSES}
