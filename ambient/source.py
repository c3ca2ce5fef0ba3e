"""Component ``config-source``: the object store plus the backend chosen by ``config_source``
(``files``: :mod:`ambient.source_files`, ``kubernetes``: :mod:`ambient.source_kube`).

``agent.daemon`` hands the component to its consumers: the index, SDS and the cni
builders read ``store`` (an :class:`ambient.api.ObjectStore`); enrollment writes pod
annotations with ``await source.patch_pod_annotations(namespace, name, annotations)``
(its ``cni.annotate.PodAnnotator``); WorkloadEntry registration uses ``kube_api()``.
The cni side sees it through its own protocol, ``cni.sourceapi.PodSource``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Mapping

from agent.core.lifecycle import AgentContext, Component
from ambient.source_kube import KubernetesSource, strip_unused
from ambient.store import ObjectStore

if TYPE_CHECKING:
    # imported by build() only for the files source: watchfiles, the YAML loaders and
    # localconfig's protobuf are not on the Kubernetes source's path to its first LIST
    from ambient.source_files import DirectorySource

log = logging.getLogger(__name__)


__all__ = ["ConfigSource", "build"]


class ConfigSource(Component):
    """Holds ``store`` and keeps it filled from ``backend``; ready once the first load is done."""

    name = "config-source"

    def __init__(self, store: ObjectStore, backend: DirectorySource | KubernetesSource):
        self.store = store
        self.backend = backend

    async def begin(self) -> None:
        """Start reading without waiting for the first load: the Kubernetes source's
        LISTs go out (reads only: nothing on the node or in the cluster changes); a
        no-op for the files source, whose first load is :meth:`start`'s. Errors
        (credentials) raise as :meth:`start`'s would."""
        if isinstance(self.backend, KubernetesSource):
            await self.backend.begin()

    async def start(self) -> None:
        await self.backend.start()

    async def stop(self, grace: float) -> None:
        await self.backend.stop()

    def ready(self) -> tuple[bool, str]:
        if isinstance(self.backend, KubernetesSource):
            if not self.backend.is_synced():
                return False, f"kubernetes source not synced: {self.backend.unsynced()}"
            return True, ""
        return (True, "") if self.backend.loaded else (False, "config directory not loaded")

    async def patch_pod_annotations(self, namespace: str, name: str,
                                    annotations: Mapping[str, str | None]) -> dict:
        """Set (value) or remove (None) annotations on a pod; returns the updated Pod.

        Kubernetes: a merge patch of ``pods/status`` (the store follows via the watch and is
        also updated at once, so the index sees the change without waiting for it); API
        errors raise ``ApiException`` (``status`` 403, 404, 409, ...).
        Files: an overlay on the stored Pod that survives reloads of its file (the file
        is the operator's; it is not rewritten); raises
        :class:`ambient.source_files.PodNotFound` (a ``LookupError``) when the
        files source has no such pod.
        """
        if isinstance(self.backend, KubernetesSource):
            pod = await self.backend.patch_pod_annotations(namespace, name, dict(annotations))
            if isinstance(pod, dict) and pod.get("metadata") and not _older(
                    pod, self.store.get("Pod", namespace, name)):
                strip_unused(pod, "Pod")  # as the watch stores it
                pod.setdefault("kind", "Pod")
                pod.setdefault("apiVersion", "v1")
                self.store.apply([(pod, "patch")], origin="kubernetes:Pod")
            return pod
        return await self.backend.patch_pod_annotations(namespace, name, dict(annotations))

    def when_connected(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (on the loop) once the Kubernetes source has its API client
        and its LISTs are under way (at once when :meth:`begin` was called already),
        before :meth:`start` returns; never for the files source. For reads that need
        the client but not the listed objects (the CA Secret), so they overlap the
        LISTs."""
        if isinstance(self.backend, KubernetesSource):
            self.backend.when_connected(callback)

    def kube_api(self) -> Any | None:
        """The Kubernetes source's API client once started; None for the files source."""
        return self.backend.api if isinstance(self.backend, KubernetesSource) else None

    def debug_state(self) -> Any:
        state: dict[str, Any] = {"objects": self.store.counts()}
        if isinstance(self.backend, KubernetesSource):
            state.update(kinds=self.backend.debug_state())
        else:
            state.update(directory=self.backend.directory, files=len(self.backend.files),
                         annotation_overlay=self.backend.overlay())
        return state


def _older(patched: dict, stored: dict | None) -> bool:
    """True when the watch already delivered a newer version of the Pod than the PATCH
    response (a change right after ours): applying the response would take the store
    back. resourceVersions are opaque to clients, but etcd's are integers that only
    grow; anything else is applied (the watch corrects it with its next event)."""
    if stored is None:
        return False
    new = str((patched.get("metadata") or {}).get("resourceVersion") or "")
    old = str((stored.get("metadata") or {}).get("resourceVersion") or "")
    return new.isdigit() and old.isdigit() and int(old) > int(new)


def build(ctx: AgentContext) -> ConfigSource:
    """``config_source`` = files (``config_dir``) or kubernetes (``kubeconfig``/in-cluster)."""
    cfg = ctx.config
    store = ObjectStore(ctx.registry, source=cfg.config_source)
    if cfg.config_source == "kubernetes":
        backend: DirectorySource | KubernetesSource = KubernetesSource(store, cfg.kubeconfig)
    else:
        from ambient.source_files import DirectorySource
        backend = DirectorySource(store, cfg.config_dir, ctx.run_blocking,
                                  registry=ctx.registry)
    return ConfigSource(store, backend)
