"""The Kubernetes config source: list+watch per kind with kubernetes_asyncio.

Per kind one task runs the standard reflector loop (Kubernetes API conventions, "Efficient
detection of changes"): LIST (remembering ``metadata.resourceVersion``), then WATCH from
that version with ``allowWatchBookmarks=true`` and a server timeout; ADDED/MODIFIED become
upserts, DELETED deletes, BOOKMARK only advances the version. When a watch ends normally it
is resumed from the last version; ``410 Gone`` (version too old) triggers a fresh LIST,
whose result *replaces* what the store held for that kind (so deletes missed while
disconnected are not lost). Other errors back off exponentially (0.5 s doubling to 30 s).
A kind whose API is not installed (404, e.g. no Istio CRDs) is treated as empty and
retried at the maximum backoff.

Credentials: ``kubeconfig`` when set, else in-cluster (service account token).
``patch_pod_annotations`` patches ``pods/status`` with a JSON merge patch, as istio-cni
does (its RBAC grants ``patch`` on ``pods/status`` only).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from kubernetes_asyncio import client as kclient
from kubernetes_asyncio import config as kconfig
from kubernetes_asyncio import watch as kwatch
from kubernetes_asyncio.client.exceptions import ApiException

from ambient.store import CLUSTER_KINDS, ObjectStore

log = logging.getLogger("ambient.source.kube")

# kind -> (apiVersion, group, version, plural); group "" = core (/api/v1)
RESOURCES: dict[str, tuple[str, str, str, str]] = {
    "Namespace": ("v1", "", "v1", "namespaces"),
    "Node": ("v1", "", "v1", "nodes"),
    "Pod": ("v1", "", "v1", "pods"),
    "Service": ("v1", "", "v1", "services"),
    "EndpointSlice": ("discovery.k8s.io/v1", "discovery.k8s.io", "v1", "endpointslices"),
    "ServiceEntry": ("networking.istio.io/v1", "networking.istio.io", "v1", "serviceentries"),
    "WorkloadEntry": ("networking.istio.io/v1", "networking.istio.io", "v1", "workloadentries"),
    "AuthorizationPolicy": ("security.istio.io/v1", "security.istio.io", "v1",
                            "authorizationpolicies"),
    "PeerAuthentication": ("security.istio.io/v1", "security.istio.io", "v1",
                           "peerauthentications"),
    "Gateway": ("gateway.networking.k8s.io/v1", "gateway.networking.k8s.io", "v1", "gateways"),
    "GatewayClass": ("gateway.networking.k8s.io/v1", "gateway.networking.k8s.io", "v1",
                     "gatewayclasses"),
}
BACKOFF_START, BACKOFF_MAX = 0.5, 30.0


async def _check(resp: Any) -> None:
    """Raise ApiException for a non-2xx raw response (``_preload_content=False`` skips it)."""
    if 200 <= resp.status <= 299:
        return
    body = await resp.read()
    resp.release()
    reason = resp.reason or ""
    try:
        reason = json.loads(body).get("message") or reason
    except (ValueError, AttributeError):
        pass
    raise ApiException(status=resp.status, reason=reason)


class KubernetesSource:
    """Fills an :class:`ObjectStore` from the Kubernetes API.

    ``api_client`` may be given (tests point it at a fake API server); otherwise one is
    built from ``kubeconfig`` or in-cluster credentials at :meth:`start`.
    ``watch_timeout`` is the server-side watch timeout in seconds.
    """

    def __init__(self, store: ObjectStore, kubeconfig: str = "",
                 api_client: kclient.ApiClient | None = None, kinds: list[str] | None = None,
                 watch_timeout: int = 300, sync_timeout: float = 30.0):
        self.store = store
        self.kubeconfig = kubeconfig
        self.api = api_client
        self._own_client = api_client is None
        self.kinds = kinds or list(RESOURCES)
        self.watch_timeout = watch_timeout
        self.sync_timeout = sync_timeout
        self.synced: dict[str, asyncio.Event] = {k: asyncio.Event() for k in self.kinds}
        self.resource_versions: dict[str, str] = {}
        self.relists: dict[str, int] = {k: 0 for k in self.kinds}
        self.errors: dict[str, str] = {}
        self._tasks: list[asyncio.Task] = []

    # --- lifecycle ---

    async def start(self) -> None:
        """Start every reflector and wait (up to ``sync_timeout``) for their first LIST."""
        if self.api is None:
            if self.kubeconfig:
                cfg = kclient.Configuration()
                await kconfig.load_kube_config(config_file=self.kubeconfig,
                                               client_configuration=cfg)
            else:
                cfg = kclient.Configuration()
                kconfig.load_incluster_config(client_configuration=cfg)
            self.api = kclient.ApiClient(cfg)
        self._tasks = [asyncio.create_task(self._reflect(kind), name=f"kube-{kind}")
                       for kind in self.kinds]
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in self.synced.values())),
                                   timeout=self.sync_timeout)
        except asyncio.TimeoutError:
            missing = [k for k, e in self.synced.items() if not e.is_set()]
            log.warning("kubernetes source not synced after %.0fs: %s", self.sync_timeout,
                        ", ".join(missing))

    def is_synced(self) -> bool:
        return all(e.is_set() for e in self.synced.values())

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []
        if self.api is not None and self._own_client:
            await self.api.close()

    # --- API calls ---

    def _path(self, kind: str) -> str:
        _, group, version, plural = RESOURCES[kind]
        return f"/api/{version}/{plural}" if not group else f"/apis/{group}/{version}/{plural}"

    async def _get(self, path: str, query: list[tuple[str, Any]]) -> Any:
        """GET ``path`` through the ApiClient (auth, TLS, host from its configuration);
        returns the raw aiohttp response (not preloaded)."""
        resp = await self.api.call_api(path, "GET", query_params=query,
                                       header_params={"Accept": "application/json"},
                                       auth_settings=["BearerToken"], _preload_content=False)
        await _check(resp)
        return resp

    async def list_objects(self, kind: str) -> tuple[list[dict], str]:
        """One LIST: (objects with kind/apiVersion filled in, resourceVersion)."""
        resp = await self._get(self._path(kind), [])
        body = json.loads(await resp.read())
        resp.release()
        api_version = RESOURCES[kind][0]
        items = []
        for item in body.get("items") or []:
            if isinstance(item, dict):
                item.setdefault("kind", kind)
                item.setdefault("apiVersion", api_version)
                items.append(item)
        return items, str((body.get("metadata") or {}).get("resourceVersion") or "")

    async def _watch_call(self, kind: str, **kwargs: Any) -> Any:
        query = [("watch", "true"), ("allowWatchBookmarks", "true")]
        if kwargs.get("resource_version"):
            query.append(("resourceVersion", kwargs["resource_version"]))
        if kwargs.get("timeout_seconds"):
            query.append(("timeoutSeconds", kwargs["timeout_seconds"]))
        return await self._get(self._path(kind), query)

    # --- reflector ---

    async def _reflect(self, kind: str) -> None:
        origin = f"kubernetes:{kind}"
        backoff = BACKOFF_START
        rv = ""
        while True:
            try:
                if not rv:
                    items, rv = await self.list_objects(kind)
                    self.relists[kind] += 1
                    self.store.replace_origin(origin, [(o, f"list {kind}") for o in items])
                    self.synced[kind].set()
                self.resource_versions[kind] = rv
                rv = await self._watch_once(kind, origin, rv)
                self.errors.pop(kind, None)
                backoff = BACKOFF_START
            except asyncio.CancelledError:
                raise
            except ApiException as e:
                if e.status == 410:
                    log.info("watch %s: resourceVersion %s is gone; relisting", kind, rv)
                    rv = ""
                    continue
                if e.status == 404:
                    self.store.replace_origin(origin, [])
                    self.synced[kind].set()
                    backoff = BACKOFF_MAX
                self.errors[kind] = f"{e.status} {e.reason}"
                log.warning("%s %s failed: %s %s; retrying in %.1fs", "watch" if rv else "list",
                            kind, e.status, e.reason, backoff)
                rv = "" if e.status == 404 else rv
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX)
            except Exception as e:  # connection refused, reset, malformed stream...
                self.errors[kind] = str(e) or type(e).__name__
                log.warning("%s %s failed: %s; retrying in %.1fs", "watch" if rv else "list",
                            kind, self.errors[kind], backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX)

    async def _watch_once(self, kind: str, origin: str, rv: str) -> str:
        """Follow one watch until the server ends it; returns the last resourceVersion."""
        w = kwatch.Watch(return_type="object")
        api_version = RESOURCES[kind][0]

        async def call(**kwargs: Any) -> Any:
            return await self._watch_call(kind, **kwargs)
        call.__doc__ = ":param watch:\n:rtype: object"
        try:
            async for event in w.stream(call, resource_version=rv,
                                        timeout_seconds=self.watch_timeout):
                etype, obj = event.get("type"), event.get("raw_object")
                if etype == "BOOKMARK":
                    rv = w.resource_version or rv
                    continue
                if not isinstance(obj, dict):
                    self.store.reject("invalid", f"watch {kind}", f"event object {obj!r}")
                    continue
                obj.setdefault("kind", kind)
                obj.setdefault("apiVersion", api_version)
                if etype in ("ADDED", "MODIFIED"):
                    self.store.apply([(obj, f"watch {kind}")], origin=origin)
                elif etype == "DELETED":
                    meta = obj.get("metadata") or {}
                    ns = "" if kind in CLUSTER_KINDS else str(meta.get("namespace") or "")
                    self.store.apply(deletes=[(kind, ns, str(meta.get("name")))])
                rv = w.resource_version or rv
                self.resource_versions[kind] = rv
        finally:
            await w.close()
        return rv

    # --- writes ---

    async def patch_pod_annotations(self, namespace: str, name: str,
                                    annotations: dict[str, str | None]) -> dict:
        """Merge-patch ``metadata.annotations`` of a pod through ``pods/status``.

        A value of None removes the annotation. Returns the patched Pod. Raises
        ``kubernetes_asyncio.client.exceptions.ApiException`` on API errors and
        RuntimeError before :meth:`start`.
        """
        if self.api is None:
            raise RuntimeError(f"cannot patch pod {namespace}/{name}: the kubernetes source "
                               "is not started")
        body = {"metadata": {"annotations": annotations}}
        path = f"/api/v1/namespaces/{namespace}/pods/{name}/status"
        resp = await self.api.call_api(
            path, "PATCH", body=body, auth_settings=["BearerToken"], _preload_content=False,
            header_params={"Content-Type": "application/merge-patch+json",
                           "Accept": "application/json"})
        await _check(resp)
        pod = json.loads(await resp.read())
        resp.release()
        return pod
