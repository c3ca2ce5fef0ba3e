"""Kubernetes Events on pods, and istio-cni's repair of pods left without their rules.

**Events** (``core/v1`` Events, as istio-cni writes them through client-go's event
recorder, ``pkg/kube/kclient/events.go``): a ``Warning`` Event on the pod for every
enrollment failure (reason :data:`REASON_FAILED`, the error as message) and when a pod's
background retries reach their backoff cap (:data:`REASON_EXHAUSTED`; the retries go on
at the cap, as upstream's queue retries without limit). Like client-go's correlator, an
Event repeated for the same pod, reason and message is not created again: its ``count``
and ``lastTimestamp`` are patched. Writes never block enrollment: they are queued
(:data:`QUEUE_MAX`, the oldest dropped and counted) and sent by one task; an API error is
one WARNING line (rate limited by the log's repeat filter), never retried.

**Repair** (upstream ``cni/pkg/repair``: settings ``REPAIR_ENABLED``, ``REPAIR_LABEL_PODS``,
``REPAIR_DELETE_PODS``, ``REPAIR_BROKEN_POD_LABEL_KEY``/``_VALUE``; off here by default):
a running ambient pod whose enrollment reached retry exhaustion runs without its rules,
so with ``repair_enabled`` it is either deleted (``repair_delete_pods``, with the pod's
UID and resourceVersion as preconditions, so its controller recreates it and the new
sandbox's CNI ADD enrolls it) or labelled ``repair_broken_pod_label_key=
repair_broken_pod_label_value`` through ``pods/status`` (``repair_label_pods``; an
already labelled pod is skipped). Delete wins when both are set (upstream's order).
Each repair writes upstream's Event (reasons ``DeleteBrokenPod`` / ``LabelBrokenPod``,
component ``cni-repair``) and counts ``istio_cni_repair_pods_repaired_total{type,result}``.
A pod is repaired at most once per UID.

Both need the Kubernetes config source (its API client); with any other source they do
nothing (there is no Pod object to write to).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

from prometheus_client import Counter

from agent.core.lifecycle import AgentContext
from cni.sourceapi import PodSource

log = logging.getLogger(__name__)

REASON_FAILED = "AmbientEnrollmentFailed"
REASON_EXHAUSTED = "AmbientEnrollmentRetriesExhausted"
REASON_NETNS_MISSING = "AmbientPodNetnsMissing"  # a recorded pod's netns gone at restart
REASON_DELETE = "DeleteBrokenPod"  # upstream's repair reasons
REASON_LABEL = "LabelBrokenPod"
COMPONENT = "ambient-agent"
REPAIR_COMPONENT = "cni-repair"  # upstream's repair controller's event source
QUEUE_MAX = 256
MESSAGE_MAX = 1024  # the API server refuses messages over 1 KiB... keep well inside
SEEN_MAX = 1024  # (uid, reason, message) remembered for counting repeats
TIMEOUT = 10.0
MERGE_PATCH = "application/merge-patch+json"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class PodEvents:
    """The Event writer and repair; ``record``/``repair`` only queue (call on the loop)."""

    def __init__(self, ctx: AgentContext, source: PodSource | None, repaired: Counter):
        """``repaired``: ``istio_cni_repair_pods_repaired_total{type,result}``, the
        enrollment metrics' counter, handed in (this module sits below
        :mod:`cni.enrollment`, whose recovery uses it)."""
        self.ctx = ctx
        self.source = source
        self.node = ctx.config.node_name
        self.repaired = repaired
        self._queue: collections.deque = collections.deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._seen: collections.OrderedDict[tuple, tuple[str, int]] = collections.OrderedDict()
        self._repaired: set[str] = set()
        self.stats = {"events": 0, "patched": 0, "dropped": 0, "errors": 0, "repaired": 0}

    def _api(self) -> Any | None:
        return self.source.kube_api() if self.source is not None else None

    # --- lifecycle (driven by the enrollment component) ---

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._writer(),
                                                                name="pod-events")

    async def stop(self, grace: float) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        if self._queue:
            self._wake.set()
            try:  # give queued events a moment; they are best effort
                await asyncio.wait_for(self._drained(), timeout=min(grace, 2.0))
            except asyncio.TimeoutError:
                pass
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def _drained(self) -> None:
        while self._queue:
            await asyncio.sleep(0.02)

    # --- what enrollment calls ---

    def record(self, namespace: str, name: str, uid: str, reason: str, message: str,
               component: str = COMPONENT) -> None:
        """Queue a Warning Event on pod ``namespace/name`` (``uid``)."""
        if not name or not namespace or self._api() is None:
            return
        self._put(("event", namespace, name, uid, reason, message[:MESSAGE_MAX], component))

    def repair(self, namespace: str, name: str, uid: str, why: str) -> None:
        """Queue the repair of a pod left without its rules (no-op unless
        ``repair_enabled``; at most once per UID)."""
        cfg = self.ctx.config
        if not cfg.repair_enabled or uid in self._repaired or self._api() is None:
            return
        if not (cfg.repair_delete_pods or cfg.repair_label_pods):
            return
        self._repaired.add(uid)
        self._put(("repair", namespace, name, uid, why))

    def _put(self, item: tuple) -> None:
        if len(self._queue) >= QUEUE_MAX:
            self._queue.popleft()
            self.stats["dropped"] += 1
        self._queue.append(item)
        self._wake.set()

    # --- the writer ---

    async def _writer(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                item = self._queue.popleft()
                try:
                    if item[0] == "event":
                        await self._event(*item[1:])
                    else:
                        await self._repair(*item[1:])
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - best effort, never fatal
                    self.stats["errors"] += 1
                    log.warning("pod %s/%s: %s failed: %s", item[1], item[2],
                                "writing an Event" if item[0] == "event" else "repair",
                                _short(e))

    async def _call(self, method: str, path: str, body: Any = None,
                    content_type: str = "application/json") -> Any:
        # imported here: importing enrollment loads no kubernetes_asyncio (agent/core/kubelazy.py)
        from agent.core import kubecall

        api = self._api()
        if api is None:
            raise RuntimeError("no Kubernetes API client")
        return await kubecall.call(api, method, path, body=body, content_type=content_type,
                                   timeout=TIMEOUT)

    async def _event(self, namespace: str, name: str, uid: str, reason: str, message: str,
                     component: str) -> None:
        key = (uid, reason, message, component)
        seen = self._seen.get(key)
        now = _now()
        if seen is not None:
            event_name, count = seen
            try:
                await self._call("PATCH", f"/api/v1/namespaces/{namespace}/events/{event_name}",
                                 {"count": count + 1, "lastTimestamp": now},
                                 MERGE_PATCH)
                self._seen[key] = (event_name, count + 1)
                self._seen.move_to_end(key)
                self.stats["patched"] += 1
                return
            except Exception:  # noqa: BLE001 - gone (TTL): write a new one
                del self._seen[key]
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{name}.", "namespace": namespace},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": namespace,
                               "name": name, "uid": uid},
            "reason": reason, "message": message, "type": "Warning",
            "source": {"component": component, "host": self.node},
            "reportingComponent": component, "reportingInstance": self.node,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        created = await self._call("POST", f"/api/v1/namespaces/{namespace}/events", body)
        self.stats["events"] += 1
        self._seen[key] = ((created or {}).get("metadata", {}).get("name", ""), 1)
        while len(self._seen) > SEEN_MAX:
            self._seen.popitem(last=False)

    async def _repair(self, namespace: str, name: str, uid: str, why: str) -> None:
        cfg = self.ctx.config
        kind = "delete" if cfg.repair_delete_pods else "label"
        pod = self._pod(uid, namespace, name)
        if pod is None:
            log.info("pod %s/%s: gone before its repair", namespace, name)
            return
        try:
            if kind == "delete":
                await self._call("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}", {
                    "apiVersion": "v1", "kind": "DeleteOptions",
                    "preconditions": {"uid": uid, "resourceVersion":
                                      pod.get("metadata", {}).get("resourceVersion")}})
                text = "pod detected as broken, deleted"
            else:
                key, value = cfg.repair_broken_pod_label_key, cfg.repair_broken_pod_label_value
                if key in (pod.get("metadata", {}).get("labels") or {}):
                    self.repaired.labels(kind, "skip").inc()
                    log.info("pod %s/%s already has label %s, skipping", namespace, name, key)
                    return
                # pods/status may change metadata too, and is the lower privilege (upstream)
                await self._call("PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}/status",
                                 {"metadata": {"labels": {key: value}}},
                                 MERGE_PATCH)
                text = "pod detected as broken, labeled"
        except Exception as e:
            self.repaired.labels(kind, "fail").inc()
            self.record(namespace, name, uid, REASON_DELETE if kind == "delete" else REASON_LABEL,
                        f"pod detected as broken, but failed to {kind}: {_short(e)}",
                        REPAIR_COMPONENT)
            raise
        self.repaired.labels(kind, "success").inc()
        self.stats["repaired"] += 1
        log.warning("pod %s/%s (uid %s) runs without its rules (%s): %s", namespace, name,
                    uid, why, text.replace("pod detected as broken, ", ""))
        self.record(namespace, name, uid, REASON_DELETE if kind == "delete" else REASON_LABEL,
                    text, REPAIR_COMPONENT)

    def _pod(self, uid: str, namespace: str, name: str) -> dict | None:
        store = self.source.store if self.source is not None else None
        pod = store.pod_by_uid(uid) if store is not None else None
        if pod is None and store is not None:
            pod = store.get("Pod", namespace, name)
        return pod

    def debug_state(self) -> dict:
        return {"queued": len(self._queue), **self.stats}


def _short(e: BaseException) -> str:
    """One line for the log and the repair Event: ``HTTP <status>: `` and the API server's
    answer as sent (its body, up to 300 characters), else the error's text."""
    body = getattr(e, "body", None)  # a KubeError's: the answer's bytes
    text = (body.decode("utf-8", "replace")[:300] if isinstance(body, bytes) and body
            else None) or \
        getattr(e, "reason", None) or str(e) or type(e).__name__
    status = getattr(e, "status", None)
    return (f"HTTP {status}: " if status else "") + " ".join(str(text).split())[:300]
