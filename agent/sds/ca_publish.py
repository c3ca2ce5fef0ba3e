"""The mesh root as ConfigMap ``istio-ca-root-cert`` in every namespace, written by one agent.

What istiod's namespace controller does (upstream
``pilot/pkg/serviceregistry/kube/controller/namespacecontroller.go`` and
``security/pkg/k8s/configutil.go``), so charts that mount the root from that ConfigMap
(ztunnel's, sidecars') work unchanged:

- ConfigMap ``istio-ca-root-cert``, label ``istio.io/config: "true"``, data key
  ``root-cert.pem`` = the root bundle, in every namespace except ``kube-public``,
  ``kube-node-lease`` and ``local-path-storage`` (``kube-system`` is *not* skipped: ztunnel
  may run there) and except namespaces being deleted;
- created when missing (also when someone deletes it), its ``root-cert.pem`` updated when
  it differs (other keys left alone); a create that meets AlreadyExists, a terminating or
  vanished namespace, or Forbidden is skipped, as upstream does;
- re-done for every namespace when the root bundle changes, for one namespace when it or
  its ConfigMap changes, and for all every ``resync`` seconds.

One writer per cluster: the agents elect a leader with the ``coordination.k8s.io/v1``
Lease :data:`LEASE_NAME` in ``system_namespace`` (``leaseDurationSeconds`` 15, renewed every
5 s, taken over when not renewed for its duration; optimistic concurrency on the Lease's
resourceVersion makes two takeovers at once end with one holder; the election is
:class:`agent.core.kubelease.LeaseElection`, shared with the Gateway API status writer).
Only the holder writes.

istiod beside the agent: istiod's namespace controller holds its own election, a ConfigMap
lock ``istio-namespace-controller-election`` in the system namespace. While that lock is
held (its leader record renewed within its lease duration) no agent writes, so the two never
fight; when both sign from the same Secret (``cacerts`` or ``istio-ca-secret``) they publish
the same root anyway.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Awaitable, Callable

from kubernetes_asyncio import client as kclient
from kubernetes_asyncio.client.exceptions import ApiException

from agent.core import kubewatch
from agent.core.backoff import Backoff
from agent.core.kubelease import LEASE_SECONDS, IstiodLock, LeaseElection

log = logging.getLogger(__name__)

CONFIGMAP = "istio-ca-root-cert"
DATA_KEY = "root-cert.pem"
LABELS = {"istio.io/config": "true"}
IGNORED_NAMESPACES = frozenset({"kube-public", "kube-node-lease", "local-path-storage"})
LEASE_NAME = "ambient-agent-ca-root-publisher"
ISTIOD_ELECTION = "istio-namespace-controller-election"
REQUEST_TIMEOUT = 10.0


class RootPublisher:
    """Publishes ``root()`` (PEM bytes) as described in the module docstring.

    ``api`` returns the config source's ``ApiClient``; ``namespace`` is the system
    namespace (Lease, istiod's lock); ``identity`` this agent's holder identity (its node
    name). :meth:`root_changed` re-publishes everywhere.
    """

    def __init__(self, api: Callable[[], Any], namespace: str, identity: str,
                 root: Callable[[], bytes], clock: Callable[[], float] = time.time,
                 lease_seconds: int = LEASE_SECONDS, resync: float = 300.0):
        self._api = api
        self.namespace = namespace
        self.identity = identity or "ambient-agent"
        self._root = root
        self.clock = clock
        self.lease_seconds = lease_seconds
        self.resync = resync
        self.election = LeaseElection(
            api, namespace, LEASE_NAME, self.identity, on_lead=self._lead,
            on_lose=self._step_down, istiod=IstiodLock(configmap=ISTIOD_ELECTION),
            lease_seconds=lease_seconds, what=f"publishing ConfigMap {CONFIGMAP}")
        self.writes = {"created": 0, "updated": 0, "skipped": 0, "errors": 0}
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._all = asyncio.Event()
        self._lead_tasks: list[asyncio.Task] = []
        self._published_root = b""

    @property
    def leading(self) -> bool:
        return self.election.leading

    @property
    def istiod_active(self) -> bool:
        return self.election.istiod_active

    async def start(self) -> None:
        await self.election.start()

    async def stop(self) -> None:
        await self.election.stop()
        await self._step_down()

    def root_changed(self) -> None:
        self._all.set()

    # --- API plumbing ---

    def _client(self) -> Any:
        api = self._api()
        if api is None:
            raise RuntimeError("no Kubernetes API client (config source not started)")
        return api

    def _lead(self) -> None:
        loop = asyncio.get_running_loop()
        self._all.set()
        self._lead_tasks = [loop.create_task(self._worker(), name="ca-root-publish"),
                            loop.create_task(self._watch("namespaces"), name="ca-root-ns"),
                            loop.create_task(self._watch("configmaps"), name="ca-root-cm")]

    async def _step_down(self) -> None:
        for t in self._lead_tasks:
            t.cancel()
        await asyncio.gather(*self._lead_tasks, return_exceptions=True)
        self._lead_tasks = []

    # --- publishing (leader only) ---

    async def _worker(self) -> None:
        while True:
            get_one = asyncio.ensure_future(self._queue.get())
            get_all = asyncio.ensure_future(self._all.wait())
            try:
                done, _ = await asyncio.wait({get_one, get_all}, timeout=self.resync,
                                             return_when=asyncio.FIRST_COMPLETED)
            finally:
                for f in (get_one, get_all):
                    if not f.done():
                        f.cancel()
            try:
                if get_all in done or not done:
                    self._all.clear()
                    if get_one in done:
                        self._queue.put_nowait(get_one.result())
                    await self.publish_all()
                else:
                    await self.publish(get_one.result())
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - retried at the next event or resync
                self.writes["errors"] += 1
                log.warning("publishing %s: %s", CONFIGMAP, e)
                await asyncio.sleep(1.0)
                self._all.set()

    async def publish_all(self) -> None:
        """Every namespace, once: one LIST of the namespaces and one of the ConfigMaps
        (by name, all namespaces), then :meth:`publish` only where the ConfigMap is
        missing or holds another root. Upstream reads them from its informer's cache;
        a GET per namespace (and its model decoding) held the event loop 1-3 ms each (py-spy),
        for every namespace of the cluster, right while the agent's first xDS pushes
        and changes went out (issue 28: 50 namespaces at 5k pods)."""
        root = self._root()
        core = kclient.CoreV1Api(self._client())
        namespaces, _ = await _list(core.list_namespace(_request_timeout=REQUEST_TIMEOUT,
                                                     _preload_content=False))
        current = set()
        if root:
            text = root.decode()
            cms, _ = await _list(core.list_config_map_for_all_namespaces(
                field_selector=f"metadata.name={CONFIGMAP}", _request_timeout=REQUEST_TIMEOUT,
                _preload_content=False))
            for cm in cms:
                if (cm.get("data") or {}).get(DATA_KEY) == text:
                    current.add((cm.get("metadata") or {}).get("namespace"))
        for ns in namespaces:
            meta = ns.get("metadata") or {}
            if (ns.get("status") or {}).get("phase") == "Terminating" or \
                    meta.get("name") in current or not isinstance(meta.get("name"), str):
                continue
            await self.publish(meta["name"])
        self._published_root = root

    async def publish(self, namespace: str) -> None:
        """Create or update the ConfigMap in ``namespace`` (upstream ``InsertDataToConfigMap``)."""
        root = self._root()
        if namespace in IGNORED_NAMESPACES or not root:
            return
        text = root.decode()
        core = kclient.CoreV1Api(self._client())
        try:
            cm = await core.read_namespaced_config_map(CONFIGMAP, namespace,
                                                       _request_timeout=REQUEST_TIMEOUT)
        except ApiException as e:
            if e.status != 404:
                raise
            body: Any = {"apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": CONFIGMAP, "namespace": namespace,
                                 "labels": dict(LABELS)},
                    "data": {DATA_KEY: text}}
            try:
                await core.create_namespaced_config_map(namespace, body,
                                                        _request_timeout=REQUEST_TIMEOUT)
            except ApiException as e2:
                if e2.status in (409, 404, 403) or "terminat" in str(e2.body or "").lower():
                    self.writes["skipped"] += 1
                    if e2.status == 403:
                        log.info("not allowed to create ConfigMap %s/%s: skipped",
                                 namespace, CONFIGMAP)
                    return
                raise
            self.writes["created"] += 1
            log.info("created ConfigMap %s/%s", namespace, CONFIGMAP)
            return
        if (cm.data or {}).get(DATA_KEY) == text:
            return
        await core.patch_namespaced_config_map(CONFIGMAP, namespace,
                                               {"data": {DATA_KEY: text}},
                                               _request_timeout=REQUEST_TIMEOUT)
        self.writes["updated"] += 1
        log.info("updated ConfigMap %s/%s", namespace, CONFIGMAP)

    async def _watch(self, kind: str) -> None:
        """Queue the namespace of every namespace or ConfigMap event."""
        retry = Backoff(1.0, 30.0, jitter=(0.8, 1.2))
        while True:
            try:
                api = self._client()
                core = kclient.CoreV1Api(api)
                lister: Any
                kw: dict[str, Any]
                if kind == "namespaces":
                    lister, kw = core.list_namespace, {}
                else:
                    lister = core.list_config_map_for_all_namespaces
                    kw = {"field_selector": f"metadata.name={CONFIGMAP}"}
                # the LIST only for its resourceVersion: read raw, no model per object
                _, rv = await _list(lister(_request_timeout=REQUEST_TIMEOUT,
                                           _preload_content=False, **kw))
                async with kubewatch.Watch(api) as w:
                    async for event in w.stream(lister, resource_version=rv,
                                                timeout_seconds=300, **kw):
                        retry.reset()
                        obj = event["object"]
                        meta = obj.metadata
                        ns = meta.name if kind == "namespaces" else meta.namespace
                        if kind == "namespaces" and event["type"] == "DELETED":
                            continue
                        self._queue.put_nowait(ns)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - re-list after a backoff
                delay = retry.next()
                log.debug("root publisher watch %s: %s; again in %.1fs", kind, e, delay)
                await asyncio.sleep(delay)

    def debug_state(self) -> dict:
        return {**self.election.debug_state(), **self.writes}


async def _list(request: Awaitable[Any]) -> tuple[list[dict], str]:
    """The ``items`` (plain dicts) and ``metadata.resourceVersion`` of a LIST made with
    ``_preload_content=False`` (the raw aiohttp response): only names, phases, one data
    key and the version are read here, so the client's model classes are not built.
    Raises ApiException for a non-2xx answer."""
    resp = await request
    try:
        data = await resp.read()
    finally:
        resp.release()
    if not 200 <= resp.status <= 299:  # the client checks only what it decodes itself
        raise ApiException(status=resp.status, reason=f"{resp.reason}: {data[:200]!r}")
    body = json.loads(data)
    if not isinstance(body, dict):
        raise ApiException(status=0, reason="LIST answer is not a JSON object")
    items = body.get("items")
    rv = str((body.get("metadata") or {}).get("resourceVersion") or "")
    return [i for i in items or () if isinstance(i, dict)], rv
