"""The enablement snapshot: how ``istio-cni`` decides "ambient" while no agent answers.

The plugin stays in the conflist when the agent stops (:mod:`cni.installwatch`), so a
pod created during a restart or upgrade still runs it. Upstream's plugin asks the API
server itself (a kubeconfig the installer writes); ours asks the agent, and when the
agent can't be reached it reads this file instead (:func:`cni.plugin.fallback_decision`):
ambient pods get "try again later" (CNI code 11, the runtime retries the sandbox), every
other pod is let through. Component ``cni-snapshot`` keeps it current.

File: ``<dir of cni_event_socket>/enablement.json`` (the plugin's ``cni_agent_run_dir``),
mode 0600, written atomically (temporary file + rename) when the answer for any pod or
namespace changes (store events, debounced 100 ms), and left in place at stop (that is
its purpose; removed only with ``ambient_disable_safe_upgrade``, when the plugin goes
too). Shape (version 1)::

    {"version": 1, "node": "node-1", "source": "kubernetes", "generated": 1733044800.0,
     "excluded_namespaces": ["kube-system"],
     "namespaces": {"demo": true, "legacy": false},
     "pods": {"<pod uid or container id>": true, ...}}

- ``pods``: the decision for every non-terminal Pod object of this node the source
  holds (with the files source also Pods without ``spec.nodeName``), keyed by
  ``metadata.uid``: the pod UID a kubelet passes as ``K8S_POD_UID``, or the container ID
  a podman-style runtime's event is named by. A sandbox re-created for a known pod gets
  exactly the agent's answer.
- ``namespaces``: per Namespace object, the decision for a pod of that namespace that
  carries no ``istio.io/dataplane-mode`` label of its own (a pod the snapshot does not
  know yet: created while the agent was down). Excluded namespaces are ``false``.
- ``excluded_namespaces``: ``exclude_namespaces`` of the agent.
- ``registration`` (only when ``workload_registration`` is not ``none``): the mode. A
  container of such a runtime that the snapshot does not know is held by the plugin
  (code 11) while the agent is down: its labels, which decide whether it is ambient,
  only the agent reads, so letting it through could start an ambient container unmeshed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any, Callable, Sequence

from agent.core.files import write_atomic
from agent.core.lifecycle import AgentContext, Component
from cni import enablement
from cni.enablement import TERMINAL_PHASES, on_this_node
from cni.plugin_request import SNAPSHOT_NAME, SNAPSHOT_VERSION
from cni.sourceapi import PodSource, PodStore, StoreChange

log = logging.getLogger(__name__)

DEBOUNCE = 0.1  # seconds: a burst of store events is written once
RETRY_FIRST = 1.0  # seconds before the first retry of a failed write; doubled per failure
RETRY_MAX = 30.0  # seconds: the longest wait between retries


def snapshot_path(cni_event_socket: str) -> str:
    """Where the plugin looks: next to the event socket (its ``cni_agent_run_dir``)."""
    return os.path.join(os.path.dirname(cni_event_socket), SNAPSHOT_NAME)


def build_snapshot(store: Any, *, node_name: str, source: str,
                   exclude_namespaces: list[str]) -> dict:
    """The snapshot content for ``store`` now (see the module docstring); ``store`` None
    (no config source) gives empty maps, which is what the agent itself knows then. Pods
    or namespaces whose decision can't be made (malformed selector) are left out: the
    plugin then falls back to the namespace, then to the plugin config's
    ``ambient_default``, as the agent does for a pod it has no object for."""
    excluded = sorted(set(exclude_namespaces or ()))
    files_source = source != "kubernetes"
    namespaces: dict[str, bool] = {}
    pods: dict[str, bool] = {}
    for ns in store.list("Namespace") if store is not None else ():
        name = (ns.get("metadata") or {}).get("name")
        if not isinstance(name, str):
            continue
        probe = {"metadata": {"namespace": name, "name": "", "labels": {}}}
        try:
            namespaces[name] = enablement.object_is_ambient(probe, store, excluded)
        except ValueError as e:
            log.warning("namespace %s: enablement undecidable: %s", name, e)
    for pod in store.list("Pod") if store is not None else ():
        meta = pod.get("metadata") or {}
        uid = meta.get("uid")
        if not isinstance(uid, str) or not uid or not on_this_node(pod, node_name, files_source):
            continue
        if (pod.get("status") or {}).get("phase") in TERMINAL_PHASES:
            continue
        try:
            pods[uid] = enablement.object_is_ambient(pod, store, excluded)
        except ValueError as e:
            log.warning("pod %s/%s: enablement undecidable: %s", meta.get("namespace"),
                        meta.get("name"), e)
    return {"version": SNAPSHOT_VERSION, "node": node_name, "source": source,
            "excluded_namespaces": excluded, "namespaces": dict(sorted(namespaces.items())),
            "pods": dict(sorted(pods.items()))}


def write_snapshot(path: str, content: dict) -> None:
    """Write ``content`` (plus ``generated``, Unix seconds) to ``path`` atomically, 0600.
    Raises OSError."""
    data = dict(content, generated=round(time.time(), 3))
    write_atomic(path, json.dumps(data, sort_keys=True, separators=(",", ":")), 0o600)


class SnapshotWriter(Component):
    """Component ``cni-snapshot``: keeps :func:`snapshot_path` current from the config
    source's store. Started before ``cni-installer``, so the plugin never meets a node
    agent's conflist without a snapshot next to the socket it asks."""

    name = "cni-snapshot"

    def __init__(self, ctx: AgentContext, path: str, source: PodSource):
        self.ctx = ctx
        self.path = path
        self.source = source
        self._written: dict | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._task: asyncio.Task | None = None
        self._dirty = False
        self.writes = 0
        self.error = ""
        self._failing = False  # the last write (or build) failed: the file is stale
        self._retry_delay = RETRY_FIRST
        self._wake = asyncio.Event()  # set by a relevant change: ends a retry wait early

    def _store(self) -> PodStore:
        return self.source.store

    def _content(self) -> dict:
        cfg = self.ctx.config
        content = build_snapshot(self._store(), node_name=cfg.node_name,
                                 source=cfg.config_source,
                                 exclude_namespaces=list(cfg.exclude_namespaces))
        if cfg.workload_registration != "none":
            # the plugin holds containers it does not know (issue 27: their labels, which
            # decide ambient, are the agent's to read; see fallback_decision)
            content["registration"] = cfg.workload_registration
        return content

    def _source_ready(self) -> bool:
        """Whether the config source holds its first full load (a Kubernetes source that
        has not synced yet holds a part of the cluster, or nothing)."""
        try:
            return bool(self.source.ready()[0])
        except Exception:  # noqa: BLE001 - undecidable: treat as not loaded
            return False

    async def start(self) -> None:
        """Write the first snapshot and follow the store.

        A failed write (OSError, e.g. ENOSPC; or a store the snapshot can't be built
        from) leaves the previous file in place (the plugin keeps using it) and is
        retried after ``RETRY_FIRST`` seconds, doubling to ``RETRY_MAX``, or at the next
        relevant change, whichever comes first, until a write succeeds. Meanwhile
        :meth:`ready` is ``False`` with the file and the error as reason. Logged once as
        ERROR when writes start failing and once as INFO when the file is current again.

        While the config source has not finished its first load, nothing is written:
        a snapshot of a partial store would tell the plugin that ambient pods of the
        previous run are unknown (and so let them through unmeshed while no agent runs).
        The previous run's file stays until the source is ready (checked every
        ``DEBOUNCE`` seconds)."""
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        self._unsubscribe = self._store().subscribe(self._on_events)
        if self._source_ready():
            if not await self._write():
                self._dirty = True
                self._task = asyncio.get_running_loop().create_task(
                    self._debounced(retry_first=True), name="cni-snapshot-write")
        else:
            self.error = "waiting for the config source's first load"
            self._dirty = True
            self._task = asyncio.get_running_loop().create_task(
                self._debounced(), name="cni-snapshot-write")

    async def stop(self, grace: float) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=grace)
            self._task = None
        if self.ctx.config.ambient_disable_safe_upgrade:
            try:
                os.unlink(self.path)
                log.info("removed %s (safe upgrade disabled)", self.path)
            except FileNotFoundError:
                pass

    def ready(self) -> tuple[bool, str]:
        """``(False, reason)`` until the first write, and while the file is stale (the
        last write failed; the reason names the file and the error)."""
        if self._written is not None and not self._failing:
            return True, ""
        return False, self.error or "not written"

    def debug_state(self) -> Any:
        w = self._written or {}
        return {"path": self.path, "writes": self.writes, "error": self.error,
                "stale": self._failing, "retry_delay": self._retry_delay,
                "pods": len(w.get("pods") or {}), "namespaces": len(w.get("namespaces") or {})}

    def _relevant(self, ev) -> bool:
        """Whether a store event can change the snapshot: a Pod of this node (before or
        after), a Namespace's labels (or its arrival or removal). Other nodes' pods, and
        status churn of namespaces, are skipped: at cluster scale pod events are
        constant and a rebuild walks every pod."""
        if ev.kind == "Namespace":
            return _labels(ev.old) != _labels(ev.new) or ev.old is None or ev.new is None
        if ev.kind != "Pod":
            return False
        cfg = self.ctx.config
        files = cfg.config_source != "kubernetes"
        return any(obj is not None and on_this_node(obj, cfg.node_name, files)
                   for obj in (ev.old, ev.new))

    def _on_events(self, events: Sequence[StoreChange]) -> None:
        if any(self._relevant(ev) for ev in events):
            self._dirty = True
            self._wake.set()
            if self._task is None or self._task.done():
                self._task = asyncio.get_running_loop().create_task(
                    self._debounced(), name="cni-snapshot-write")

    async def _debounced(self, retry_first: bool = False) -> None:
        """Write while dirty (debounced); after a failed write wait for the backoff or
        the next relevant change (``_wake``), then try again. ``retry_first``: the
        caller's write just failed, wait before the first attempt."""
        while self._dirty:
            if retry_first:
                retry_first = False
                await self._retry_wait()
            await asyncio.sleep(DEBOUNCE)
            if not self._source_ready():
                continue  # stays dirty: written once the source is loaded
            self._dirty = False
            if not await self._write():
                self._dirty = True
                await self._retry_wait()

    async def _retry_wait(self) -> None:
        """Sleep ``_retry_delay`` seconds or until a relevant change, then double the
        delay (at most ``RETRY_MAX``)."""
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), self._retry_delay)
        except asyncio.TimeoutError:
            pass
        self._retry_delay = min(self._retry_delay * 2, RETRY_MAX)

    def _failed(self, error: str) -> None:
        """Record a failed build or write: ERROR once when failing starts, then DEBUG."""
        self.error = error
        if not self._failing:
            self._failing = True
            log.error("%s; the plugin keeps the previous snapshot; retrying", error)
        else:
            log.debug("%s (retry in %gs)", error, self._retry_delay)

    async def _write(self) -> bool:
        """Write the snapshot if it differs from the file's; whether the file is now
        current (False: see :meth:`_failed`)."""
        try:
            content = self._content()
        except Exception as e:  # noqa: BLE001 - a broken store must not stop the agent
            self._failed(f"cannot build the snapshot for {self.path}: {e}")
            return False
        if content != self._written:
            try:
                await self.ctx.run_blocking(write_snapshot, self.path, content)
            except OSError as e:
                self._failed(f"cannot write {self.path}: {e}")
                return False
            self._written = content
            self.writes += 1
            log.debug("enablement snapshot written: %d pods, %d namespaces",
                      len(content["pods"]), len(content["namespaces"]))
        # equal to what was last written: a failed write left that file in place
        self.error = ""
        self._retry_delay = RETRY_FIRST
        if self._failing:
            self._failing = False
            log.info("enablement snapshot %s is current again", self.path)
        return True


def build(ctx: AgentContext, source: PodSource) -> SnapshotWriter:
    """The ``cni-snapshot`` component of the config ``source``'s pods; ``agent.daemon``
    starts it before ``cni-installer`` (the plugin reads the file while no agent runs)."""
    return SnapshotWriter(ctx, snapshot_path(ctx.config.cni_event_socket), source)


def _labels(obj: dict | None) -> dict:
    return ((obj or {}).get("metadata") or {}).get("labels") or {}
