"""The contracts between the ambient index and its consumers (xDS server, SDS attestation,
enrollment, debug). The index implements :class:`AmbientIndex`; consumers depend on this
module only, so the index never imports the server ("an updater interface
the index calls to announce changes").

Resource names are the ones ztunnel expects (``docs/xds.md``): a workload's
Address is named by its uid (``cluster//Pod/ns/name`` form), a service's by
``namespace/hostname``; an Authorization by ``namespace/name`` (static policies by
their own names).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Protocol

from ambient import authorization_pb2, workload_pb2


@dataclasses.dataclass(frozen=True)
class IndexChange:
    """What one index update changed, by resource name.

    ``addresses_changed`` holds names whose Address is new or different;
    ``addresses_removed`` names that no longer exist. Same for authorizations.
    """

    addresses_changed: frozenset[str] = frozenset()
    addresses_removed: frozenset[str] = frozenset()
    authorizations_changed: frozenset[str] = frozenset()
    authorizations_removed: frozenset[str] = frozenset()

    def empty(self) -> bool:
        return not (self.addresses_changed or self.addresses_removed
                    or self.authorizations_changed or self.authorizations_removed)


Updater = Callable[[IndexChange], None]


class AmbientIndex(Protocol):
    """Read side of the ambient index. All methods are cheap and non-blocking."""

    def addresses(self) -> dict[str, workload_pb2.Address]:
        """Every Address by resource name (workloads and services)."""

    def address(self, name: str) -> workload_pb2.Address | None:
        """One Address by resource name, or None."""

    def address_names(self, kind: str | None = None) -> list[str]:
        """Every Address resource name; only workloads (``"workload"``) or services
        (``"service"``) with ``kind``."""

    def address_bytes(self, name: str) -> bytes | None:
        """One Address serialized (deterministic), or None: what xDS sends."""

    def authorizations(self) -> dict[str, authorization_pb2.Authorization]:
        """Every Authorization by resource name."""

    def authorization(self, name: str) -> authorization_pb2.Authorization | None:
        """One Authorization by resource name, or None."""

    def authorization_names(self) -> list[str]:
        """Every Authorization resource name."""

    def authorization_bytes(self, name: str) -> bytes | None:
        """One Authorization serialized (deterministic), or None."""

    def lookup(self, key: str) -> list[str]:
        """Resource names answering an on-demand key: ``network/IP`` (several workloads
        may share an IP; a service VIP gives the service), ``namespace/hostname`` or a
        workload uid. Empty list when nothing matches."""

    def waypoint_resources(self, namespace: str, name: str) -> set[str]:
        """Address resource names of the services and workloads bound to the waypoint
        Gateway ``namespace/name``."""

    def node_workloads(self, node: str) -> set[str]:
        """Address resource names of the workloads whose ``node`` is ``node`` (the
        on-demand node-local warm-up)."""

    def subscribe(self, updater: Updater) -> Callable[[], None]:
        """Call ``updater`` after every index change (on the event loop). Returns an
        unsubscribe function."""


class ObjectStore(Protocol):
    """Read side of a config source: Kubernetes-shaped objects as plain dicts."""

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        """One object (``namespace`` is "" for cluster-scoped kinds such as Namespace)."""

    def list(self, kind: str, namespace: str | None = None) -> Iterable[dict]:
        """Objects of a kind, optionally in one namespace."""

    def pod_by_uid(self, uid: str) -> dict | None:
        """The Pod with ``metadata.uid == uid``, or None."""
