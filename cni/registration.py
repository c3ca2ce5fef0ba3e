"""Workload registration from CNI (component ``registration``): a host without Kubernetes
learns its pods from the CNI calls the runtime makes, not from hand-written Pod YAML.

Why: with podman (or any runtime that is not a kubelet) nothing writes a Pod object, so
an enrolled container would have rules and a ZDS entry but no workload in xDS, and its
IP changes on every restart. The agent sees everything a workload needs at the CNI ADD:

- its addresses: the ``prevResult`` IPs (:attr:`cni.events.CniPodEvent.ips`);
- its name: ``K8S_POD_NAME`` (podman 4.3 passes the container's name, or the pod's name
  for a podman pod's infra container; ``CNI_ARGS=IgnoreUnknown=1;K8S_POD_NAME=<name>``,
  no namespace, no UID; ``runtimeConfig`` carries only ``aliases``);
- its key: ``CNI_CONTAINERID`` (the Pod object's ``metadata.uid``, as
  :func:`cni.enablement.find_pod` already matches podman pods);
- its labels: from the runtime (:mod:`cni.runtime_labels`: podman's ``create`` event
  carries the container's labels, a podman pod's infra container carries the pod's),
  since the CNI call carries none. Two label keys name the identity:
  :data:`cni.registration_record.NAMESPACE_LABEL` (else setting ``registration_namespace``) and
  :data:`cni.registration_record.SERVICE_ACCOUNT_LABEL` (else ``default``).

A :class:`cni.registration_record.Registration` is built for every ADD before the enablement decision (so a
container label ``istio.io/dataplane-mode=ambient`` or ``none`` decides, as a pod label
does in Kubernetes; without one the network's ``ambient_default`` is written as that
label), applied when the ADD succeeds (ready: ``status.conditions`` Ready True), and
removed on the DEL. A container restart is a DEL then an ADD with a new IP: the
workload follows. Registrations are persisted in ``<state_dir>/registrations.json``
(0600, atomic) and re-applied when the agent starts, except those whose netns is gone
(the container stopped while the agent was down; its DEL was let through).

Backends (setting ``workload_registration``):

- ``local``: Pod objects in this agent's object store (origin
  :data:`LOCAL_ORIGIN`), next to whatever the files source holds; the index serves them
  like any Pod. An operator's Pod with the same namespace/name wins (the store rejects
  ours as a conflict, logged).
- ``workloadentry``: ``WorkloadEntry`` objects in a Kubernetes API server used as a
  shared store by several hosts (:mod:`cni.registration_kube`); the agent's kubernetes
  source watches them back, so every host's workloads reach every ztunnel.

Layering: the event server calls :meth:`WorkloadRegistrar.prepare`,
:meth:`WorkloadRegistrar.commit` and :meth:`WorkloadRegistrar.remove`; the registrar
only writes objects (store or API server) and never enrolls anything itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Any, Protocol

from agent.core.annotations import REGISTERED_BY
from agent.core.lifecycle import AgentContext, Component
from cni.events import CniPodEvent
from cni.sourceapi import PodSource
from agent.core.netns import host_path

from cni.registration_record import DATAPLANE_MODE_LABEL, Registration, RegistrationError, \
    RegistrationFile, identity

log = logging.getLogger(__name__)

LOCAL_ORIGIN = "registration"
LABEL_WAIT = 2.0  # seconds an ADD waits for the runtime's create event of its container


class LabelsPending(RegistrationError):
    """The runtime has not told this container's labels yet: the ADD is answered "try
    again later" (HTTP 503, CNI code 11), never decided without them."""

    retryable = True


class LabelSource(Protocol):
    """Where container labels come from (:class:`cni.runtime_labels.PodmanLabels`)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def labels(self, container_id: str, wait: float) -> dict[str, str] | None:
        """The container's labels, waiting up to ``wait`` seconds for them; None when the
        runtime has not reported the container."""


class Backend(Protocol):
    """Where registrations are written: the local store or a shared API server."""

    async def start(self, kept: list[Registration]) -> None: ...

    async def stop(self) -> None: ...

    async def put(self, reg: Registration) -> None: ...

    async def delete(self, reg: Registration) -> None: ...

    def moved(self, old: Registration) -> None:
        """Before :meth:`start`: ``old`` (a kept registration of another node name) is
        held by the store under that name and moves to this node."""

    def debug_state(self) -> Any: ...


class LocalBackend:
    """Pod objects in the agent's own store (origin :data:`LOCAL_ORIGIN`). Annotations
    others set on our Pod (the enrollment's redirection annotation) are kept when we
    re-apply it."""

    def __init__(self, store: Any):
        self.store = store

    async def start(self, kept: list[Registration]) -> None:
        self.store.replace_origin(LOCAL_ORIGIN, [(self._object(r), f"registration {r.label()}")
                                                 for r in kept])

    async def stop(self) -> None:
        # Pod objects go with the process; the file keeps them for the next start
        return None

    def moved(self, old: Registration) -> None:
        return None  # the store is this process's: nothing was written under the old name

    def _object(self, reg: Registration) -> dict:
        pod = reg.pod()
        current = self.store.pod_by_uid(reg.uid)
        if current is not None:
            kept = {k: v for k, v in ((current.get("metadata") or {}).get("annotations")
                                      or {}).items() if k != REGISTERED_BY}
            pod["metadata"]["annotations"] = {**kept, **pod["metadata"]["annotations"]}
        return pod

    async def put(self, reg: Registration) -> None:
        stale = [("Pod", p["metadata"]["namespace"], p["metadata"]["name"])
                 for p in [self.store.pod_by_uid(reg.uid)] if p is not None
                 and (p["metadata"]["namespace"], p["metadata"]["name"]) != (reg.namespace,
                                                                             reg.name)
                 and self.store.origin_of(("Pod", p["metadata"]["namespace"],
                                           p["metadata"]["name"])) == LOCAL_ORIGIN]
        events = self.store.apply([(self._object(reg), f"registration {reg.label()}")],
                                  deletes=stale, origin=LOCAL_ORIGIN)
        owner = self.store.origin_of(("Pod", reg.namespace, reg.name))
        if not events and owner not in (LOCAL_ORIGIN, None):
            # the store logged the conflict; the operator's object stays authoritative
            log.warning("pod %s is defined by %s; not registered from CNI", reg.label(), owner)

    async def delete(self, reg: Registration) -> None:
        key = ("Pod", reg.namespace, reg.name)
        if self.store.origin_of(key) == LOCAL_ORIGIN:
            self.store.apply(deletes=[key], origin=LOCAL_ORIGIN)

    def debug_state(self) -> Any:
        return {"backend": "local", "objects": self.store.objects_of_origin(LOCAL_ORIGIN)}


class WorkloadRegistrar(Component):
    """The ``registration`` component (see the module docstring).

    ``backend``: a :class:`Backend`; ``labels``: a :class:`LabelSource` or None (then only
    the network's ``ambient_default`` and ``registration_namespace`` name the workload).
    """

    name = "registration"

    def __init__(self, ctx: AgentContext, backend: Backend, labels: LabelSource | None):
        self.ctx = ctx
        self.backend = backend
        self.label_source = labels
        self.file = RegistrationFile(ctx.config.state_dir)
        self.registrations: dict[str, Registration] = {}
        self._started = False
        self._learning: set[str] = set()  # container IDs whose labels are being read
        self._tasks: set[asyncio.Task] = set()
        self.stats = {"registered": 0, "removed": 0, "failed": 0, "restored": 0,
                      "dropped_at_start": 0, "held": 0}

    # --- lifecycle ---

    async def start(self) -> None:
        kept = []
        for reg in self.file.load():
            if reg.netns and not os.path.exists(self._netns(reg.netns)):
                log.info("%s: its netns %s is gone (stopped while the agent was down); "
                         "not registered again", reg.label(), reg.netns)
                self.stats["dropped_at_start"] += 1
                continue
            kept.append(reg)
        kept, moved = self._rebind_node(kept)
        self.registrations = {r.uid: r for r in kept}
        self.stats["restored"] = len(kept)
        await self.backend.start(kept)
        if moved or len(kept) != len(self.file.load()):
            self._save()
        if self.label_source is not None:
            await self.label_source.start()
        self._started = True
        log.info("workload registration (%s) started with %d kept registrations",
                 self.ctx.config.workload_registration, len(kept))

    def _rebind_node(self, kept: list[Registration]) -> tuple[list[Registration], int]:
        """Kept registrations made under another ``node_name`` (the setting changed
        between runs) move to this node: they are this host's containers. The backend is
        told what it holds under the old name (:meth:`Backend.moved`), so the old entries
        are deleted instead of re-written. Returns the rebound list and how many moved."""
        node = self.ctx.config.node_name
        out, olds, count = [], set(), 0
        for reg in kept:
            if reg.node != node:
                olds.add(reg.node)
                count += 1
                self.backend.moved(reg)
                reg = dataclasses.replace(reg, node=node)
            out.append(reg)
        if olds:
            log.warning("node_name is now %s, was %s: %d kept registrations move to %s",
                        node, ", ".join(sorted(olds)), count, node)
        return out, count

    async def stop(self, grace: float) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=grace)
        if self.label_source is not None:
            await self.label_source.stop()
        await self.backend.stop()
        self._started = False

    def ready(self) -> tuple[bool, str]:
        return (True, "") if self._started else (False, "registration not started")

    def debug_state(self) -> Any:
        return {"mode": self.ctx.config.workload_registration, **self.stats,
                "backend": self.backend.debug_state(),
                "workloads": {r.uid[:12]: {"pod": f"{r.namespace}/{r.name}", "ips": r.ips,
                                           "ambient": r.ambient}
                              for r in self.registrations.values()}}

    # --- the event server's calls ---

    async def prepare(self, event: CniPodEvent) -> Registration:
        """The registration an ADD would make (not applied yet): identity from the
        runtime's labels (waiting up to :data:`LABEL_WAIT` for them), addresses from the
        event. Raises :class:`RegistrationError` naming a bad field."""
        labels: dict[str, str] | None = None
        if self.label_source is not None:
            try:
                labels = await self.label_source.labels(event.container_id, LABEL_WAIT)
            except Exception as e:  # noqa: BLE001 - the runtime being odd never fails an ADD
                log.warning("container %s: labels from the runtime unavailable: %s",
                            event.container_id[:12], e)
        broken = getattr(self.label_source, "broken", "")
        if labels is None and broken and event.key not in self.registrations:
            # Fail closed: without its labels an ambient container would start unmeshed
            # as default/default. The ADD fails with the reason; podman reports it.
            self.stats["failed"] += 1
            log.error("container %s: refused, its labels cannot be read from the runtime: "
                      "%s", event.container_id[:12], broken)
            raise RegistrationError(f"labels of container {event.container_id[:12]} cannot "
                                    f"be read from the runtime ({broken})")
        if labels is None:
            previous = self.registrations.get(event.key)
            if previous is None and self.label_source is not None:
                # Fail closed: guessing ("defaults") would let an ambient container start
                # unmeshed under the wrong namespace. The ADD is held (CNI code 11) and the
                # labels are read once podman released the container's lock, so the next
                # start finds them.
                self.stats["held"] += 1
                self._learn_later(event)
                log.warning("container %s: held (try again later): the runtime reported "
                            "no labels within %gs; they are read now for the next start",
                            event.container_id[:12], LABEL_WAIT)
                raise LabelsPending(
                    f"labels of container {event.container_id[:12]} not read from the "
                    f"runtime yet (they decide whether it is ambient); start it again")
            labels = dict(previous.labels) if previous is not None else {}
        name, namespace, sa, lbls = identity(event, labels,
                                             self.ctx.config.registration_namespace)
        if DATAPLANE_MODE_LABEL not in lbls and event.ambient_default:
            lbls[DATAPLANE_MODE_LABEL] = "ambient"  # the network says so, as a namespace label would
        return Registration(uid=event.key, name=name, namespace=namespace,
                            service_account=sa, labels=lbls, ips=list(event.ips),
                            netns=event.netns, node=self.ctx.config.node_name,
                            registered_at=self.ctx.clock())

    async def commit(self, reg: Registration, ambient: bool) -> None:
        """Apply ``reg`` (the ADD succeeded): write it through the backend and persist it.
        A backend failure is raised (local: the operator already defines that pod); the
        kubernetes backend retries on its own and does not raise for the API server being
        away."""
        reg.ambient = ambient
        try:
            await self.backend.put(reg)
        except Exception:
            self.stats["failed"] += 1
            raise
        self.registrations[reg.uid] = reg
        self.stats["registered"] += 1
        self._save()
        log.info("registered workload %s ips %s%s", reg.label(), ",".join(reg.ips),
                 " (ambient)" if ambient else "")

    def _learn_later(self, event: CniPodEvent) -> None:
        """Read the labels of a held container in the background (``inspect`` of the
        label source, which keeps them for the next ADD)."""
        inspect = getattr(self.label_source, "inspect", None)
        key = event.container_id
        if not callable(inspect) or key in self._learning:
            return
        self._learning.add(key)

        async def learn() -> None:
            try:
                # podman holds the container's lock until the failed start is unwound
                for delay in (0.2, 0.5, 1.0, 2.0, 4.0):
                    await asyncio.sleep(delay)
                    if await inspect(key) is not None:
                        log.info("container %s: labels read from the runtime; its next "
                                 "start is decided with them", key[:12])
                        return
                log.warning("container %s: labels still unreadable from the runtime",
                            key[:12])
            finally:
                self._learning.discard(key)
        task = asyncio.get_running_loop().create_task(learn(), name=f"labels-{key[:12]}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def remove(self, key: str) -> None:
        """The DEL of container ``key`` (or an ADD that failed): the workload goes away.
        Unknown keys are fine (a DEL is repeated, or the ADD never registered)."""
        reg = self.registrations.pop(key, None)
        if reg is None:
            return
        try:
            await self.backend.delete(reg)
        finally:
            self._save()
        self.stats["removed"] += 1
        log.info("unregistered workload %s", reg.label())

    def registration(self, key: str) -> Registration | None:
        return self.registrations.get(key)

    def served_pod(self, key: str) -> dict[str, Any] | None:
        """The Pod shape of registration ``key`` named as its workload is served in xDS
        (the backend's ``served_name``: a WorkloadEntry is ``<pod>-<node>``), or None.
        Enrollment sends that name to ztunnel over ZDS: ztunnel finds a pod's own
        workload by name, namespace and service account among its node's workloads
        (ztunnel ``state/workload.rs`` ``find_by_info``), so the names must agree."""
        reg = self.registrations.get(key)
        if reg is None:
            return None
        served = getattr(self.backend, "served_name", None)
        return reg.pod(served(reg) if callable(served) else "")

    # --- internals ---

    def _netns(self, path: str) -> str:
        try:
            return host_path(path, self.ctx.config.host_mounts_path)
        except ValueError:
            return path

    def _save(self) -> None:
        try:
            self.file.save(list(self.registrations.values()))
        except OSError as e:
            log.error("cannot persist registrations to %s: %s", self.file.path, e)


def build(ctx: AgentContext, source: PodSource) -> WorkloadRegistrar | None:
    """The ``registration`` component, which ``agent.daemon`` builds after the config
    ``source`` it registers pods in (local: its store; workloadentry: its API server).
    None when ``workload_registration`` is ``none``."""
    mode = ctx.config.workload_registration
    if mode == "none":
        return None
    labels: LabelSource | None = None
    if ctx.config.registration_runtime == "podman":
        from cni.runtime_labels import PodmanLabels
        labels = PodmanLabels(ctx.config.podman_containers_conf or None,
                              owner=ctx.config.state_dir)
    if mode == "local":
        backend: Backend = LocalBackend(source.store)
    else:
        from cni.registration_kube import WorkloadEntryBackend
        backend = WorkloadEntryBackend(ctx.config, source)
    return WorkloadRegistrar(ctx, backend, labels)

