"""Component ``config-source``: the object store plus the backend chosen by ``config_source``
(``files``: :mod:`ambient.source_files`, ``kubernetes``: :mod:`ambient.source_kube`).

Consumers use ``ctx.get("config-source").store`` (an :class:`ambient.api.ObjectStore`) and
``await ctx.get("config-source").patch_pod_annotations(namespace, name, annotations)``.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from agent.lifecycle import AgentContext, Component
from ambient.source_files import DirectorySource
from ambient.source_kube import KubernetesSource
from ambient.store import ObjectStore

log = logging.getLogger("ambient.source")


class PodNotFound(LookupError):
    """patch_pod_annotations for a pod the source doesn't hold."""


class ConfigSource(Component):
    """Holds ``store`` and keeps it filled from ``backend``; ready once the first load is done."""

    name = "config-source"

    def __init__(self, store: ObjectStore, backend: DirectorySource | KubernetesSource):
        self.store = store
        self.backend = backend

    async def start(self) -> None:
        await self.backend.start()

    async def stop(self, grace: float) -> None:
        await self.backend.stop()

    def ready(self) -> tuple[bool, str]:
        if isinstance(self.backend, KubernetesSource):
            if not self.backend.is_synced():
                return False, "kubernetes source not synced"
            return True, ""
        return (True, "") if self.backend.loaded else (False, "config directory not loaded")

    async def patch_pod_annotations(self, namespace: str, name: str,
                                    annotations: dict[str, str | None]) -> dict:
        """Set (value) or remove (None) annotations on a pod; returns the updated Pod.

        Kubernetes: a merge patch of ``pods/status`` (the store follows via the watch and is
        also updated at once, so the index sees the change without waiting for it).
        Files: the in-memory object only (the file is the operator's; it is not rewritten).
        Raises :class:`PodNotFound` when the files source has no such pod.
        """
        if isinstance(self.backend, KubernetesSource):
            pod = await self.backend.patch_pod_annotations(namespace, name, annotations)
            if isinstance(pod, dict) and pod.get("metadata"):
                pod.setdefault("kind", "Pod")
                pod.setdefault("apiVersion", "v1")
                self.store.apply([(pod, "patch")], origin="kubernetes:Pod")
            return pod
        current = self.store.get("Pod", namespace, name)
        if current is None:
            raise PodNotFound(f"pod {namespace}/{name} not found in the config source")
        pod = copy.deepcopy(current)
        merged = dict(pod["metadata"].get("annotations") or {})
        for key, value in annotations.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = str(value)
        pod["metadata"]["annotations"] = merged
        # the owning file keeps owning the object, so a reload of that file still replaces it
        origin = self.store.origin_of(("Pod", namespace, name)) or "patch"
        self.store.apply([(pod, "patch")], origin=origin)
        return pod

    def debug_state(self) -> Any:
        state: dict[str, Any] = {"objects": self.store.counts()}
        if isinstance(self.backend, KubernetesSource):
            state.update(resource_versions=self.backend.resource_versions,
                         errors=self.backend.errors, relists=self.backend.relists)
        else:
            state.update(directory=self.backend.directory, files=len(self.backend.files))
        return state


def build(ctx: AgentContext) -> ConfigSource:
    """``config_source`` = files (``config_dir``) or kubernetes (``kubeconfig``/in-cluster)."""
    cfg = ctx.config
    store = ObjectStore(ctx.registry, source=cfg.config_source)
    if cfg.config_source == "kubernetes":
        backend: DirectorySource | KubernetesSource = KubernetesSource(store, cfg.kubeconfig)
    else:
        backend = DirectorySource(store, cfg.config_dir, ctx.run_blocking,
                                  registry=ctx.registry)
    return ConfigSource(store, backend)
