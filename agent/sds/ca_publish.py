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
resourceVersion makes two takeovers at once end with one holder). Only the holder writes.

istiod beside the agent: istiod's namespace controller holds its own election, a ConfigMap
lock ``istio-namespace-controller-election`` in the system namespace. While that lock is
held (its leader record renewed within its lease duration) no agent writes, so the two never
fight; when both sign from the same Secret (``cacerts`` or ``istio-ca-secret``) they publish
the same root anyway.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import time
from typing import Any, Callable

from kubernetes_asyncio import client as kclient
from kubernetes_asyncio import watch as kwatch
from kubernetes_asyncio.client.exceptions import ApiException

from agent.core.backoff import Backoff

log = logging.getLogger(__name__)

CONFIGMAP = "istio-ca-root-cert"
DATA_KEY = "root-cert.pem"
LABELS = {"istio.io/config": "true"}
IGNORED_NAMESPACES = frozenset({"kube-public", "kube-node-lease", "local-path-storage"})
LEASE_NAME = "ambient-agent-ca-root-publisher"
ISTIOD_ELECTION = "istio-namespace-controller-election"
LEADER_ANNOTATION = "control-plane.alpha.kubernetes.io/leader"
LEASE_SECONDS = 15
REQUEST_TIMEOUT = 10.0


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _micro(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_time(value: Any) -> dt.datetime | None:
    if isinstance(value, dt.datetime):
        return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)
    if not value:
        return None
    try:
        return dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None


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
        self.leading = False
        self.istiod_active = False
        self.writes = {"created": 0, "updated": 0, "skipped": 0, "errors": 0}
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._all = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._lead_tasks: list[asyncio.Task] = []
        self._published_root = b""

    async def start(self) -> None:
        self._tasks = [asyncio.get_running_loop().create_task(self._elect(),
                                                              name="ca-root-election")]

    async def stop(self) -> None:
        await self._step_down()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.leading:
            self.leading = False
        await self._release()

    def root_changed(self) -> None:
        self._all.set()

    # --- API plumbing ---

    def _client(self) -> Any:
        api = self._api()
        if api is None:
            raise RuntimeError("no Kubernetes API client (config source not started)")
        return api

    # --- election ---

    async def _istiod_holds_lock(self) -> bool:
        """True while istiod's namespace controller election (a ConfigMap lock) is held."""
        try:
            cm = await kclient.CoreV1Api(self._client()).read_namespaced_config_map(
                ISTIOD_ELECTION, self.namespace, _request_timeout=REQUEST_TIMEOUT)
        except ApiException as e:
            if e.status in (404, 403):
                return False
            raise
        record = (cm.metadata.annotations or {}).get(LEADER_ANNOTATION)
        if not record:
            return False
        try:
            rec = json.loads(record)
        except ValueError:
            return False
        renewed = _parse_time(rec.get("renewTime"))
        duration = float(rec.get("leaseDurationSeconds") or 0)
        return bool(rec.get("holderIdentity")) and renewed is not None and (
            renewed + dt.timedelta(seconds=duration) > _now())

    async def _acquire_or_renew(self) -> bool:
        """One election round; True when this agent holds the Lease afterwards."""
        coord = kclient.CoordinationV1Api(self._client())
        now = _now()
        try:
            lease = await coord.read_namespaced_lease(LEASE_NAME, self.namespace,
                                                      _request_timeout=REQUEST_TIMEOUT)
        except ApiException as e:
            if e.status != 404:
                raise
            body: Any = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                         "metadata": {"name": LEASE_NAME, "namespace": self.namespace},
                    "spec": {"holderIdentity": self.identity,
                             "leaseDurationSeconds": self.lease_seconds,
                             "acquireTime": _micro(now), "renewTime": _micro(now),
                             "leaseTransitions": 0}}
            try:
                await coord.create_namespaced_lease(self.namespace, body,
                                                    _request_timeout=REQUEST_TIMEOUT)
            except ApiException as e2:
                if e2.status == 409:
                    return False  # another agent created it first
                raise
            return True
        spec = lease.spec
        holder = spec.holder_identity or ""
        renewed = _parse_time(spec.renew_time)
        duration = spec.lease_duration_seconds or self.lease_seconds
        expired = renewed is None or renewed + dt.timedelta(seconds=duration) < now
        if holder != self.identity and holder and not expired:
            return False
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": LEASE_NAME, "namespace": self.namespace,
                             "resourceVersion": lease.metadata.resource_version},
                "spec": {"holderIdentity": self.identity,
                         "leaseDurationSeconds": self.lease_seconds,
                         "acquireTime": (_micro(_parse_time(spec.acquire_time) or now)
                                         if holder == self.identity else _micro(now)),
                         "renewTime": _micro(now),
                         "leaseTransitions": (spec.lease_transitions or 0)
                         + (0 if holder == self.identity else 1)}}
        try:
            await coord.replace_namespaced_lease(LEASE_NAME, self.namespace, body,
                                                 _request_timeout=REQUEST_TIMEOUT)
        except ApiException as e:
            if e.status == 409:
                return False  # someone else renewed or took it meanwhile
            raise
        return True

    async def _release(self) -> None:
        """Give the Lease up at stop (another agent takes over at once)."""
        try:
            coord = kclient.CoordinationV1Api(self._client())
            lease = await coord.read_namespaced_lease(LEASE_NAME, self.namespace,
                                                      _request_timeout=REQUEST_TIMEOUT)
            if lease.spec.holder_identity != self.identity:
                return
            body: Any = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                         "metadata": {"name": LEASE_NAME, "namespace": self.namespace,
                                      "resourceVersion": lease.metadata.resource_version},
                         "spec": {"holderIdentity": "", "leaseDurationSeconds": 1,
                             "leaseTransitions": lease.spec.lease_transitions or 0}}
            await coord.replace_namespaced_lease(LEASE_NAME, self.namespace, body,
                                                 _request_timeout=REQUEST_TIMEOUT)
        except Exception as e:  # noqa: BLE001 - best effort at stop
            log.debug("releasing Lease %s: %s", LEASE_NAME, e)

    async def _elect(self) -> None:
        period = max(self.lease_seconds / 3, 0.2)
        while True:
            try:
                istiod = await self._istiod_holds_lock()
                if istiod != self.istiod_active:
                    self.istiod_active = istiod
                    if istiod:
                        log.info("istiod's namespace controller holds %s/%s: not publishing "
                                 "%s (istiod does)", self.namespace, ISTIOD_ELECTION, CONFIGMAP)
                held = False if istiod else await self._acquire_or_renew()
            except Exception as e:  # noqa: BLE001 - API away: stop writing, keep trying
                log.debug("root publisher election: %s", e)
                held = False
            if held and not self.leading:
                self.leading = True
                log.info("leading %s/%s: publishing ConfigMap %s", self.namespace, LEASE_NAME,
                         CONFIGMAP)
                self._lead()
            elif not held and self.leading:
                log.info("lost %s/%s: no longer publishing %s", self.namespace, LEASE_NAME,
                         CONFIGMAP)
                await self._step_down()
            await asyncio.sleep(period)

    def _lead(self) -> None:
        loop = asyncio.get_running_loop()
        self._all.set()
        self._lead_tasks = [loop.create_task(self._worker(), name="ca-root-publish"),
                            loop.create_task(self._watch("namespaces"), name="ca-root-ns"),
                            loop.create_task(self._watch("configmaps"), name="ca-root-cm")]

    async def _step_down(self) -> None:
        self.leading = False
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
        """Every namespace, once."""
        core = kclient.CoreV1Api(self._client())
        namespaces = await core.list_namespace(_request_timeout=REQUEST_TIMEOUT)
        for ns in namespaces.items:
            if ns.status is not None and ns.status.phase == "Terminating":
                continue
            await self.publish(ns.metadata.name)
        self._published_root = self._root()

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
                core = kclient.CoreV1Api(self._client())
                lister: Any
                kw: dict[str, Any]
                if kind == "namespaces":
                    lister, kw = core.list_namespace, {}
                else:
                    lister = core.list_config_map_for_all_namespaces
                    kw = {"field_selector": f"metadata.name={CONFIGMAP}"}
                listed = await lister(_request_timeout=REQUEST_TIMEOUT, **kw)
                async with kwatch.Watch() as w:
                    async for event in w.stream(lister, resource_version=listed.metadata.resource_version,
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
        return {"leading": self.leading, "istiod_active": self.istiod_active,
                "lease": f"{self.namespace}/{LEASE_NAME}", **self.writes}
