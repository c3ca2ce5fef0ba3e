"""Registration into a shared Kubernetes API server: ``WorkloadEntry`` per registered pod
(``workload_registration: workloadentry``), for several hosts without kubelets.

Each host's agent runs with ``config_source: kubernetes`` against one API server used as
a store only; it writes a ``WorkloadEntry`` for every pod its CNI ADDs register and
watches every host's entries back through its kubernetes source, so each ztunnel is
served every host's workloads. What Istio's VM auto-registration does
(``pilot/pkg/autoregistration``), carried over:

- annotations ``istio.io/workloadController`` (here: the node name of the registering
  agent, as istiod's instance ID there) and ``istio.io/connectedAt`` (RFC 3339, when the
  entry was written by a live agent); the entry's labels are the pod's, in
  ``metadata.labels`` and ``spec.labels``; ``spec.address`` the pod's first IP,
  ``spec.serviceAccount`` its service account, ``spec.network`` the agent's ``network``.
  ``istio.io/autoRegistrationGroup`` is *not* set: that marks entries an istiod sharing
  the API server would garbage-collect for want of a connected proxy.
- cleanup after a grace period (``registration_grace``, Istio's
  ``PILOT_WORKLOAD_ENTRY_GRACE_PERIOD`` default 10 s): a host that is gone stops renewing
  its ``coordination.k8s.io/v1`` Lease ``ambient-agent-<node>`` in ``system_namespace``
  (``leaseDurationSeconds`` = the grace period, renewed every third of it); every agent
  looks, once per grace period, at the entries other nodes control and deletes those whose
  node's Lease has not been renewed for longer than its duration plus the grace period
  (or has no Lease at all). A container that goes away (CNI DEL) is deleted at once.
- health: an entry exists only while its pod's sandbox runs and its ADD succeeded, so it
  is served Healthy; ``ambient.istio.io/redirection: enabled`` marks an enrolled pod
  (HBONE), as the enrollment's annotation does on a Pod.

At start the agent re-asserts its kept registrations and deletes the entries it controls
that it no longer holds (containers gone while it was down). Writes never block a CNI
ADD: they are queued per pod (latest wins) and retried with a backoff while the API
server is away; :meth:`WorkloadEntryBackend.debug_state` shows what is pending.

Names: ``<pod name>-<node>`` (lower-cased DNS subdomain, at most 253 characters), stable
across container restarts, so a restart is an update of ``spec.address``, not a new entry.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import re
from typing import Any

from kubernetes_asyncio import client as kclient
from kubernetes_asyncio.client.exceptions import ApiException

from agent.core.annotations import REGISTERED_BY
from agent.core.backoff import Backoff
from agent.core.config import Config
from cni.registration_record import Registration
from cni.sourceapi import PodSource, PodStore

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "networking.istio.io", "v1", "workloadentries"
CONTROLLER = "istio.io/workloadController"
CONNECTED_AT = "istio.io/connectedAt"
REDIRECTION = "ambient.istio.io/redirection"
LEASE_PREFIX = "ambient-agent-"
RETRY_MAX = 10.0


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _rfc3339(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def entry_name(reg: Registration) -> str:
    """``<pod name>-<node>`` as a DNS subdomain (≤ 253 characters)."""
    name = re.sub(r"[^a-z0-9.-]", "-", f"{reg.name}-{reg.node}".lower()).strip("-.")
    return name[-253:].lstrip("-.")


def workload_entry(reg: Registration, network: str, connected_at: str) -> dict[str, Any]:
    """The WorkloadEntry object for ``reg`` (see the module docstring)."""
    annotations = {CONTROLLER: reg.node, CONNECTED_AT: connected_at, REGISTERED_BY: reg.node}
    if reg.ambient:
        annotations[REDIRECTION] = "enabled"
    spec: dict[str, Any] = {"address": reg.ips[0] if reg.ips else "",
                            "labels": dict(reg.labels),
                            "serviceAccount": reg.service_account}
    if network:
        spec["network"] = network
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "WorkloadEntry",
            "metadata": {"name": entry_name(reg), "namespace": reg.namespace,
                         "labels": dict(reg.labels), "annotations": annotations},
            "spec": spec}


def api_error_line(e: Exception, namespace: str) -> str:
    """One line for a failed API call: an ``ApiException``'s status and the API server's
    ``message`` (never its multi-line headers-and-body ``str()``); a missing namespace says
    which one and that it must be created (the shared API server has no controller making
    Namespaces)."""
    if not isinstance(e, ApiException):
        return " ".join(str(e).split()) or type(e).__name__
    message = ""
    try:
        message = str(json.loads(e.body or "{}").get("message") or "")
    except (ValueError, AttributeError):
        pass
    line = f"HTTP {e.status} {message or e.reason or ''}".strip()
    if e.status == 404 and "namespaces" in message:
        line += (f" (namespace {namespace} does not exist in the API server: create it, "
                 f"kubectl create namespace {namespace})")
    return " ".join(line.split())


class WorkloadEntryBackend:
    """:class:`cni.registration.Backend` writing WorkloadEntries (module docstring).

    Uses ``source``'s Kubernetes ApiClient (so the same credentials and API server as the
    watch) and its store to find the entries other nodes control; node name, grace,
    lease namespace and network come from ``config``.
    """

    def __init__(self, config: Config, source: PodSource):
        self.source = source
        self.node = config.node_name
        self.grace = config.registration_grace
        self.lease_namespace = config.system_namespace
        self.network = config.network
        self._pending: dict[str, tuple[str, Registration]] = {}  # uid -> (op, reg)
        self._written: dict[str, Registration] = {}  # uid -> what the API server holds
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.stats = {"written": 0, "deleted": 0, "errors": 0, "cleaned": 0, "renewals": 0}
        self.last_error = ""

    # --- plumbing ---

    @property
    def api(self) -> kclient.ApiClient:
        api = self.source.kube_api()
        if api is None:
            raise RuntimeError("the kubernetes config source has no API client (not started?)")
        return api

    def _objects(self) -> kclient.CustomObjectsApi:
        return kclient.CustomObjectsApi(self.api)

    def _store(self) -> PodStore:
        return self.source.store

    # --- Backend ---

    async def start(self, kept: list[Registration]) -> None:
        for reg in kept:
            self._queue("put", reg)
        await self._drop_unheld(kept)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._writer(), name="workloadentry-writer"),
                       loop.create_task(self._heartbeat(), name="workloadentry-lease"),
                       loop.create_task(self._cleanup_loop(), name="workloadentry-cleanup")]

    async def stop(self) -> None:
        # entries stay: a restarted agent re-asserts them; a host that stays down is
        # cleaned up by the others after the grace period
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        self._tasks = []

    def moved(self, old: Registration) -> None:
        """The API server holds ``old`` under its node's entry name: the put of its
        rebound copy then queues that entry's deletion (:meth:`_queue`)."""
        self._written[old.uid] = old

    async def put(self, reg: Registration) -> None:
        self._queue("put", reg)

    async def delete(self, reg: Registration) -> None:
        self._queue("delete", reg)

    def served_name(self, reg: Registration) -> str:
        """The name the workload of ``reg`` is served under: its WorkloadEntry's."""
        return entry_name(reg)

    def debug_state(self) -> Any:
        return {"backend": "workloadentry", "node": self.node, "grace_seconds": self.grace,
                "pending": {uid[:12]: op for uid, (op, _r) in self._pending.items()},
                "last_error": self.last_error, **self.stats}

    # --- writes ---

    def _queue(self, op: str, reg: Registration) -> None:
        """Queue the latest operation for ``reg.uid``; a put under another name or
        namespace (relabelled) also queues the deletion of the entry written before."""
        previous = self._pending.get(reg.uid)
        old = previous[1] if previous is not None and previous[0] == "put" else \
            self._written.get(reg.uid)
        if op == "put" and old is not None and (old.namespace, entry_name(old)) != (
                reg.namespace, entry_name(reg)):
            self._pending[reg.uid + "/old"] = ("delete", old)
        self._pending[reg.uid] = (op, reg)
        self._wake.set()

    async def _writer(self) -> None:
        backoff = Backoff(0.2, RETRY_MAX)
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                key, (op, reg) = next(iter(self._pending.items()))
                try:
                    if op == "put":
                        await self._put(reg)
                    else:
                        await self._delete(reg)
                except Exception as e:  # noqa: BLE001 - retried; the API server may be away
                    self.stats["errors"] += 1
                    self.last_error = (f"{op} {reg.namespace}/{entry_name(reg)}: "
                                       f"{api_error_line(e, reg.namespace)}")
                    delay = backoff.next()
                    log.warning("WorkloadEntry %s; retrying in %.1fs", self.last_error, delay)
                    await asyncio.sleep(delay)
                    continue
                backoff.reset()
                if self._pending.get(key) == (op, reg):
                    del self._pending[key]

    async def _put(self, reg: Registration) -> None:
        body = workload_entry(reg, self.network, _rfc3339(_now()))
        api, name = self._objects(), body["metadata"]["name"]
        try:
            await api.create_namespaced_custom_object(GROUP, VERSION, reg.namespace, PLURAL, body)
        except ApiException as e:
            if e.status != 409:
                raise
            current = await api.get_namespaced_custom_object(GROUP, VERSION, reg.namespace,
                                                             PLURAL, name)
            owner = ((current.get("metadata") or {}).get("annotations") or {}).get(CONTROLLER)
            if owner and owner != self.node:
                raise RuntimeError(f"{reg.namespace}/{name} is controlled by node {owner}") from None
            body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            await api.replace_namespaced_custom_object(GROUP, VERSION, reg.namespace, PLURAL,
                                                       name, body)
        self._written[reg.uid] = reg
        self.stats["written"] += 1
        log.info("WorkloadEntry %s/%s written (%s)", reg.namespace, name, ",".join(reg.ips))

    async def _delete(self, reg: Registration) -> None:
        name = entry_name(reg)
        try:
            await self._objects().delete_namespaced_custom_object(GROUP, VERSION, reg.namespace,
                                                                  PLURAL, name)
        except ApiException as e:
            if e.status != 404:
                raise
        if self._written.get(reg.uid) is reg:
            del self._written[reg.uid]
        self.stats["deleted"] += 1
        log.info("WorkloadEntry %s/%s deleted", reg.namespace, name)

    async def _drop_unheld(self, kept: list[Registration]) -> None:
        """Delete the entries this node controls that it no longer holds."""
        wanted = {(r.namespace, entry_name(r)) for r in kept}
        try:
            items = (await self._objects().list_cluster_custom_object(GROUP, VERSION, PLURAL)
                     ).get("items") or []
        except Exception as e:  # noqa: BLE001 - the periodic cleanup tries again
            log.warning("listing WorkloadEntries at start failed: %s", e)
            return
        for item in items:
            meta = item.get("metadata") or {}
            namespace, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
            if ((meta.get("annotations") or {}).get(CONTROLLER) == self.node
                    and (namespace, name) not in wanted):
                await self._delete_entry(namespace, name, "no longer on this node")

    async def _delete_entry(self, namespace: str, name: str, why: str) -> None:
        try:
            await self._objects().delete_namespaced_custom_object(GROUP, VERSION, namespace,
                                                                  PLURAL, name)
            self.stats["cleaned"] += 1
            log.info("WorkloadEntry %s/%s removed: %s", namespace, name, why)
        except ApiException as e:
            if e.status != 404:
                log.warning("removing WorkloadEntry %s/%s: %s", namespace, name, e.reason)

    # --- heartbeat and cleanup ---

    async def _heartbeat(self) -> None:
        leases = kclient.CoordinationV1Api(self.api)
        name = LEASE_PREFIX + self.node
        while True:
            try:
                now = _now()
                # a plain dict body (the client sends it as is; its stubs only name V1Lease)
                body: Any = {
                    "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": name, "namespace": self.lease_namespace},
                    "spec": {"holderIdentity": self.node,
                             "leaseDurationSeconds": max(1, int(round(self.grace))),
                             "renewTime": _rfc3339(now)}}
                try:
                    current = await leases.read_namespaced_lease(name, self.lease_namespace)
                    body["metadata"]["resourceVersion"] = current.metadata.resource_version
                    await leases.replace_namespaced_lease(name, self.lease_namespace, body)
                except ApiException as e:
                    if e.status != 404:
                        raise
                    body["spec"]["acquireTime"] = _rfc3339(now)
                    await leases.create_namespaced_lease(self.lease_namespace, body)
                self.stats["renewals"] += 1
            except Exception as e:  # noqa: BLE001
                self.last_error = f"lease {self.lease_namespace}/{name}: {e}"
                log.warning("renewing %s failed: %s", name, e)
            await asyncio.sleep(max(self.grace / 3, 0.2))

    async def _cleanup_loop(self) -> None:
        while True:
            await asyncio.sleep(self.grace)
            try:
                await self.cleanup()
            except Exception as e:  # noqa: BLE001
                log.warning("WorkloadEntry cleanup failed: %s", e)

    async def cleanup(self) -> int:
        """Delete entries of nodes whose Lease lapsed more than the grace period ago (or
        that have none). Returns how many were deleted."""
        store = self._store()
        by_node: dict[str, list[tuple[str, str]]] = {}
        for we in store.list("WorkloadEntry"):
            meta = we.get("metadata") or {}
            ann = meta.get("annotations") or {}
            owner = ann.get(CONTROLLER)
            if owner and owner != self.node and REGISTERED_BY in ann:
                by_node.setdefault(owner, []).append((meta["namespace"], meta["name"]))
        leases = kclient.CoordinationV1Api(self.api)
        deleted = 0
        for node, entries in by_node.items():
            why = await self._lapsed(leases, node)
            if not why:
                continue
            for namespace, name in entries:
                await self._delete_entry(namespace, name, f"node {node} {why}")
                deleted += 1
        return deleted

    async def _lapsed(self, leases: kclient.CoordinationV1Api, node: str) -> str:
        try:
            lease = await leases.read_namespaced_lease(LEASE_PREFIX + node, self.lease_namespace)
        except ApiException as e:
            if e.status == 404:
                return "has no lease"
            raise
        renew = lease.spec.renew_time or lease.spec.acquire_time
        if renew is None:
            return "never renewed its lease"
        if renew.tzinfo is None:
            renew = renew.replace(tzinfo=dt.timezone.utc)
        duration = lease.spec.lease_duration_seconds or self.grace
        silent = (_now() - renew).total_seconds()
        if silent > duration + self.grace:
            return f"renewed its lease {silent:.0f}s ago (grace {self.grace:g}s)"
        return ""
