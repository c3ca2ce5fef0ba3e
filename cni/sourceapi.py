"""What the CNI side reads of the agent's config source, owned by cni.

Consumer-owned protocols: ``ambient.source.ConfigSource`` (and its
``ambient.store.ObjectStore``) has everything below, but cni never imports ambient (an
import-linter contract); ``agent.daemon`` hands the source to the cni builders, and mypy
checks there that it fits.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence


class StoreChange(Protocol):
    """One change a store announces (``ambient.store.StoreEvent`` has it): the object's
    ``kind``, ``namespace`` and ``name``, and the object before (``old``) and after
    (``new``); None when it was created or deleted."""

    @property
    def kind(self) -> str: ...

    @property
    def namespace(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def old(self) -> dict | None: ...

    @property
    def new(self) -> dict | None: ...


class PodStore(Protocol):
    """Kubernetes-shaped objects as plain dicts (Pods, Namespaces, WorkloadEntries)."""

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        """One object (``namespace`` is "" for cluster-scoped kinds such as Namespace)."""

    def list(self, kind: str, namespace: str | None = None) -> Iterable[dict]:
        """Objects of ``kind``, optionally in one namespace."""

    def pod_by_uid(self, uid: str) -> dict | None:
        """The Pod with ``metadata.uid == uid``, or None."""

    def subscribe(self, listener: Callable[[Sequence[StoreChange]], object]
                  ) -> Callable[[], None]:
        """Call ``listener(events)`` after every change; returns an unsubscribe function."""


class PodSource(Protocol):
    """The config source component: its store, whether its first load is done, pod
    annotation writes and (config_source kubernetes) its API client."""

    @property
    def store(self) -> PodStore: ...

    def ready(self) -> tuple[bool, str]:
        """``(True, "")`` once the first full load is in the store."""

    async def patch_pod_annotations(self, namespace: str, name: str,
                                    annotations: Mapping[str, str | None]) -> dict:
        """Write a pod's annotations (None removes one); returns the updated Pod."""

    def kube_api(self) -> Any | None:
        """The Kubernetes source's ``kubernetes_asyncio`` ApiClient once started, else None."""
