"""A real kube-apiserver for tests (scripts/kube-test-apiserver.sh) and the helpers that
play the parts of a cluster no process plays here.

:class:`KubeCluster` is what the session fixture ``kube_cluster`` (tests/kube/conftest.py)
yields: the server's URL, the admin kubeconfig, and control of the processes
(:meth:`KubeCluster.apiserver_stop` / :meth:`KubeCluster.apiserver_start` restart the API
server on the same port; :meth:`KubeCluster.compact` compacts etcd's history).

No kube-controller-manager, scheduler or kubelet runs, so tests play them (and the
aggregated ClusterRoles ``view``/``edit``/``admin`` stay empty: their aggregation is a
controller-manager job; bind explicit rules instead):
- the namespace and service-account controllers: :func:`create_namespace` also creates
  the namespace's ``default`` ServiceAccount (the ServiceAccount admission plugin refuses
  pods without it); :func:`delete_namespace` deletes what the tests put in it and
  finalizes the namespace;
- the scheduler: :func:`create_pod` creates the pod already bound (``spec.nodeName``);
- the kubelet: :func:`create_node` registers a Node, :func:`set_pod_status` writes
  ``status`` (phase, podIPs, conditions, container statuses) through ``pods/status``,
  :func:`delete_pod` does the graceful delete and then the kubelet's final delete.

Credentials: :func:`service_account_token` asks the TokenRequest API for a token of a
ServiceAccount; :func:`kubeconfig_for_token` writes a kubeconfig with it, which is what
an agent under test is given (its own identity, its own RBAC, nothing of the admin's).

All HTTP goes through kubernetes_asyncio's ApiClient (``agent.core.kubecall``, as the
agent's own raw calls); JSON bodies are plain dicts. Errors raise
``agent.core.kubecall.KubeError``, a ``kubernetes_asyncio.client.exceptions.ApiException``.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import os
import subprocess
import time
import uuid
from typing import Any

import aiohttp
import yaml
from kubernetes_asyncio import client as kclient
from kubernetes_asyncio import config as kconfig
from kubernetes_asyncio.client.exceptions import ApiException

from agent.core import kubecall

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "kube-test-apiserver.sh")
DEPLOY = os.path.join(ROOT, "deploy", "kubernetes")
CRDS = os.path.join(ROOT, "deploy", "crds", "crds.yaml")
REGISTRATION_RBAC = os.path.join(ROOT, "deploy", "registration", "rbac-registration.yaml")
AGENT_NAMESPACE, AGENT_SERVICE_ACCOUNT = "istio-system", "ambient-agent"
FIELD_MANAGER = "ambient-tests"


def read_env(directory: str) -> dict[str, str]:
    """The ``KEY=value`` lines the script wrote to ``DIR/env``."""
    out = {}
    with open(os.path.join(directory, "env"), encoding="utf-8") as f:
        for line in f:
            key, sep, value = line.rstrip("\n").partition("=")
            if sep:
                out[key] = value
    return out


@dataclasses.dataclass
class KubeCluster:
    """A running kube-apiserver + etcd started by scripts/kube-test-apiserver.sh."""

    directory: str

    def __post_init__(self) -> None:
        self.env = read_env(self.directory)
        self.url: str = self.env["KUBE_APISERVER_URL"]
        self.etcd_url: str = self.env["ETCD_URL"]
        self.kubeconfig: str = os.path.join(self.directory, "admin.kubeconfig")
        self.ca_file: str = os.path.join(self.directory, "ca.crt")

    # --- processes ---

    def _script(self, command: str, timeout: float = 180, extra_args: str = "") -> None:
        env = dict(os.environ, KUBE_TEST_APISERVER_ARGS=extra_args)
        proc = subprocess.run(["bash", SCRIPT, command, self.directory], capture_output=True,
                              text=True, timeout=timeout, env=env)
        if proc.returncode:
            raise RuntimeError(f"kube-test-apiserver.sh {command} failed "
                               f"(exit {proc.returncode}): {proc.stderr[-3000:]}")

    def apiserver_stop(self) -> None:
        """Stop kube-apiserver (SIGTERM, then SIGKILL after 15 s); etcd keeps running."""
        self._script("apiserver-stop")

    def apiserver_start(self, extra_args: str = "") -> None:
        """Start kube-apiserver again on the same port; returns when /readyz is ok.
        ``extra_args``: more kube-apiserver flags for this run (``--watch-cache=false``)."""
        self._script("apiserver-start", extra_args=extra_args)

    def stop(self) -> None:
        self._script("stop")

    # --- etcd (its v3 HTTP/JSON gateway) ---

    async def etcd_revision(self) -> int:
        """etcd's current revision (= the newest resourceVersion the API server can hand out)."""
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{self.etcd_url}/v3/kv/range",
                              json={"key": base64.b64encode(b"/").decode(),
                                    "count_only": True}) as r:
                r.raise_for_status()
                return int((await r.json())["header"]["revision"])

    async def compact(self, revision: int | None = None) -> int:
        """Compact etcd's history up to ``revision`` (default: now); returns that revision.

        After this, watches from an older resourceVersion that reach etcd get
        ``410 Gone``; kube-apiserver itself does the same every 5 minutes.
        """
        revision = revision or await self.etcd_revision()
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{self.etcd_url}/v3/kv/compaction",
                              json={"revision": str(revision), "physical": True}) as r:
                r.raise_for_status()
        return revision

    # --- clients ---

    async def admin_client(self) -> kclient.ApiClient:
        """An ApiClient authenticated as cluster-admin (system:masters). Close it."""
        return await client_from_kubeconfig(self.kubeconfig)


async def client_from_kubeconfig(path: str) -> kclient.ApiClient:
    """An ApiClient configured from a kubeconfig file (as the agent loads its own)."""
    cfg = kclient.Configuration()
    await kconfig.load_kube_config(config_file=path, client_configuration=cfg)
    return kclient.ApiClient(cfg)


# --- raw REST through the ApiClient ---

async def request(api: kclient.ApiClient, method: str, path: str, body: Any = None,
                  query: list[tuple[str, Any]] | None = None,
                  content_type: str = "application/json") -> dict:
    """One API call; returns the decoded JSON body ({} when empty). Raises
    :class:`agent.core.kubecall.KubeError` (an ApiException: status, reason = the Status
    message) for non-2xx answers."""
    out = await kubecall.call(api, method, path, query=query or [], body=body,
                              content_type=content_type, timeout=None)
    return out if out is not None else {}


_DISCOVERY: dict[tuple[int, str], dict[str, tuple[str, bool]]] = {}


async def resource_of(api: kclient.ApiClient, api_version: str, kind: str,
                      refresh: bool = False) -> tuple[str, bool]:
    """(plural, namespaced) of ``kind`` in ``api_version``, from API discovery."""
    key = (id(api), api_version)
    if refresh or kind not in _DISCOVERY.get(key, {}):
        base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        found = await request(api, "GET", base)
        _DISCOVERY[key] = {r["kind"]: (r["name"], bool(r["namespaced"]))
                           for r in found.get("resources", []) if "/" not in r["name"]}
    if kind not in _DISCOVERY[key]:
        raise LookupError(f"{kind} is not served in {api_version}")
    return _DISCOVERY[key][kind]


async def object_path(api: kclient.ApiClient, api_version: str, kind: str, name: str = "",
                      namespace: str = "") -> str:
    plural, namespaced = await resource_of(api, api_version, kind)
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if namespaced:
        base += f"/namespaces/{namespace or 'default'}"
    return f"{base}/{plural}" + (f"/{name}" if name else "")


async def apply(api: kclient.ApiClient, obj: dict) -> dict:
    """Server-side apply one object (field manager ``ambient-tests``, forced); returns it."""
    meta = obj["metadata"]
    try:
        path = await object_path(api, obj["apiVersion"], obj["kind"], meta["name"],
                                 meta.get("namespace", ""))
    except LookupError:  # a CRD applied a moment ago: discovery caught up?
        await resource_of(api, obj["apiVersion"], obj["kind"], refresh=True)
        path = await object_path(api, obj["apiVersion"], obj["kind"], meta["name"],
                                 meta.get("namespace", ""))
    return await request(api, "PATCH", path, body=obj, content_type="application/apply-patch+yaml",
                         query=[("fieldManager", FIELD_MANAGER), ("force", "true")])


def manifest(path: str) -> list[dict]:
    """The documents of a YAML file (deploy/kubernetes/... relative names allowed)."""
    full = path if os.path.isabs(path) else os.path.join(DEPLOY, path)
    with open(full, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d]


async def apply_manifest(api: kclient.ApiClient, path: str) -> list[dict]:
    return [await apply(api, d) for d in manifest(path)]


async def wait_crds_established(api: kclient.ApiClient, names: list[str],
                                timeout: float = 30.0) -> None:
    """Wait until every CRD in ``names`` has condition Established=True, its kind is in
    discovery, and a LIST of it answers (a new CRD's storage answers 429 "storage is
    (re)initializing" for a moment after it is established)."""
    deadline = time.monotonic() + timeout
    pending = list(names)
    while pending:
        name = pending[0]
        crd = await request(api, "GET",
                            f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
        conds = {c["type"]: c["status"] for c in (crd.get("status") or {}).get("conditions", [])}
        if conds.get("Established") == "True":
            spec = crd["spec"]
            version = next(v["name"] for v in spec["versions"] if v.get("storage"))
            try:
                await resource_of(api, f"{spec['group']}/{version}", spec["names"]["kind"],
                                  refresh=True)
                await request(api, "GET", f"/apis/{spec['group']}/{version}/"
                              f"{spec['names']['plural']}", query=[("limit", 1)])
                pending.pop(0)
                continue
            except (LookupError, ApiException):
                pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"CRD {name} not established after {timeout:g}s: {conds}")
        await asyncio.sleep(0.1)


_CRD_BASE = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def _reinitializing(e: ApiException) -> bool:
    """A 429 "storage is (re)initializing": the API server's CRD storage right after a
    restart or a CRD change; the call is retried, not failed."""
    return e.status == 429


async def _crd_request(api: kclient.ApiClient, method: str, path: str,
                       deadline: float, **kw: Any) -> dict:
    """:func:`request`, retrying 429 "storage is (re)initializing" until ``deadline``
    (time.monotonic()); other errors are raised."""
    while True:
        try:
            return await request(api, method, path, **kw)
        except ApiException as e:
            if not _reinitializing(e) or time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.2)


async def _wait_crd_gone(api: kclient.ApiClient, name: str, deadline: float,
                         timeout: float) -> None:
    """Wait until CRD ``name`` is gone (404); TimeoutError names it with its conditions
    (a CRD stays Terminating while its objects are removed)."""
    while True:
        try:
            crd = await _crd_request(api, "GET", f"{_CRD_BASE}/{name}", deadline)
        except ApiException as e:
            if e.status == 404:
                return
            raise
        if time.monotonic() > deadline:
            conds = [(c.get("type"), c.get("status"), c.get("message"))
                     for c in (crd.get("status") or {}).get("conditions", [])]
            raise TimeoutError(f"CRD {name} still present after {timeout:g}s: {conds}")
        await asyncio.sleep(0.2)


async def apply_crds(api: kclient.ApiClient, timeout: float = 180.0) -> None:
    """Apply deploy/crds/crds.yaml and wait until the kinds are served. A CRD still
    Terminating from :func:`delete_crds` is waited out first (applying over it would be
    refused or deleted with it)."""
    deadline = time.monotonic() + timeout
    docs = manifest(CRDS)
    for d in docs:
        name = d["metadata"]["name"]
        try:
            crd = await _crd_request(api, "GET", f"{_CRD_BASE}/{name}", deadline)
        except ApiException as e:
            if e.status != 404:
                raise
            continue
        if (crd.get("metadata") or {}).get("deletionTimestamp"):
            await _wait_crd_gone(api, name, deadline, timeout)
    for d in docs:
        while True:
            try:
                await apply(api, d)
                break
            except ApiException as e:
                if not _reinitializing(e) or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.2)
    await wait_crds_established(api, [d["metadata"]["name"] for d in docs],
                                timeout=max(30.0, deadline - time.monotonic()))


async def delete_crds(api: kclient.ApiClient, timeout: float = 180.0) -> None:
    """Delete the CRDs of deploy/crds/crds.yaml and wait until they are gone. Their objects
    (left by other tests) are deleted first, cluster-wide, so the CRDs' own cleanup has
    nothing to do: under load that cleanup kept a CRD Terminating for over a minute."""
    deadline = time.monotonic() + timeout
    docs = manifest(CRDS)
    for d in docs:
        spec = d["spec"]
        version = next(v["name"] for v in spec["versions"] if v.get("storage"))
        path = f"/apis/{spec['group']}/{version}/{spec['names']['plural']}"
        try:
            found = await _crd_request(api, "GET", path, deadline)
        except ApiException as e:
            if e.status == 404:
                continue
            raise
        for obj in found.get("items", []):
            meta = obj["metadata"]
            ns = meta.get("namespace")
            obj_path = (f"/apis/{spec['group']}/{version}/namespaces/{ns}/"
                        f"{spec['names']['plural']}/{meta['name']}" if ns
                        else f"{path}/{meta['name']}")
            try:
                await _crd_request(api, "DELETE", obj_path, deadline)
            except ApiException as e:
                if e.status != 404:
                    raise
    for d in docs:
        try:
            await _crd_request(api, "DELETE", f"{_CRD_BASE}/{d['metadata']['name']}", deadline)
        except ApiException as e:
            if e.status != 404:
                raise
    for d in docs:
        await _wait_crd_gone(api, d["metadata"]["name"], deadline, timeout)


# --- identities ---

async def service_account_token(api: kclient.ApiClient, namespace: str, name: str,
                                audiences: list[str] | None = None,
                                expiration_seconds: int = 3600,
                                bound_pod: tuple[str, str] | None = None) -> str:
    """A token for ServiceAccount namespace/name from the TokenRequest API
    (``serviceaccounts/token``). ``bound_pod`` = (name, uid) binds it to a pod, as the
    kubelet's projected tokens are. Never log the result."""
    spec: dict[str, Any] = {"expirationSeconds": expiration_seconds}
    if audiences:
        spec["audiences"] = audiences
    if bound_pod:
        spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1", "name": bound_pod[0],
                                  "uid": bound_pod[1]}
    out = await request(api, "POST",
                        f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
                        body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                              "spec": spec})
    return out["status"]["token"]


async def create_service_account(api: kclient.ApiClient, namespace: str, name: str) -> dict:
    return await apply(api, {"apiVersion": "v1", "kind": "ServiceAccount",
                             "metadata": {"name": name, "namespace": namespace}})


def kubeconfig_for_token(cluster: KubeCluster, token: str, path: str,
                         user: str = "agent", server: str = "") -> str:
    """Write a kubeconfig (mode 0600) that authenticates with ``token``; returns ``path``.
    ``server`` overrides the API server URL (a :class:`tests.kube.proxy.TcpProxy`)."""
    with open(cluster.ca_file, "rb") as f:
        ca = base64.b64encode(f.read()).decode()
    cfg = {"apiVersion": "v1", "kind": "Config",
           "clusters": [{"name": "kube-test", "cluster": {
               "server": server or cluster.url, "certificate-authority-data": ca}}],
           "users": [{"name": user, "user": {"token": token}}],
           "contexts": [{"name": user, "context": {"cluster": "kube-test", "user": user}}],
           "current-context": user}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        yaml.safe_dump(cfg, f)
    return path


async def service_account_kubeconfig(cluster: KubeCluster, api: kclient.ApiClient,
                                     namespace: str, name: str, path: str,
                                     audiences: list[str] | None = None) -> str:
    """Create (apply) ServiceAccount namespace/name, get a TokenRequest token for it and
    write a kubeconfig with that token to ``path``; returns ``path``."""
    await create_service_account(api, namespace, name)
    token = await service_account_token(api, namespace, name, audiences=audiences)
    return kubeconfig_for_token(cluster, token, path, user=f"{namespace}-{name}")


async def agent_kubeconfig(cluster: KubeCluster, api: kclient.ApiClient, path: str,
                           server: str = "") -> str:
    """A kubeconfig with a token of the DaemonSet's own ServiceAccount
    (istio-system/ambient-agent of deploy/kubernetes/rbac.yaml, applied by the fixture)."""
    token = await service_account_token(api, AGENT_NAMESPACE, AGENT_SERVICE_ACCOUNT)
    return kubeconfig_for_token(cluster, token, path, user="ambient-agent", server=server)


async def token_review(api: kclient.ApiClient, token: str,
                       audiences: list[str] | None = None) -> dict:
    """POST a TokenReview; returns its ``status`` (authenticated, user, audiences, error)."""
    spec: dict[str, Any] = {"token": token}
    if audiences:
        spec["audiences"] = audiences
    out = await request(api, "POST", "/apis/authentication.k8s.io/v1/tokenreviews",
                        body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                              "spec": spec})
    return out.get("status") or {}


# --- playing the controllers, the scheduler and the kubelet ---

def unique(prefix: str) -> str:
    """A DNS-1123 name unique to this call: ``<prefix>-<8 hex>``."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def create_namespace(api: kclient.ApiClient, name: str,
                           labels: dict[str, str] | None = None) -> dict:
    """Create (apply) a namespace and its ``default`` ServiceAccount."""
    ns = await apply(api, {"apiVersion": "v1", "kind": "Namespace",
                           "metadata": {"name": name, "labels": labels or {}}})
    await create_service_account(api, name, "default")
    return ns


# namespaced collections tests create objects in; deleted by delete_namespace
_NAMESPACED = [
    "/api/v1/namespaces/{ns}/services",
    "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
    "/apis/networking.istio.io/v1/namespaces/{ns}/serviceentries",
    "/apis/networking.istio.io/v1/namespaces/{ns}/workloadentries",
    "/apis/security.istio.io/v1/namespaces/{ns}/authorizationpolicies",
    "/apis/security.istio.io/v1/namespaces/{ns}/peerauthentications",
    "/apis/gateway.networking.k8s.io/v1/namespaces/{ns}/gateways",
    "/apis/gateway.networking.k8s.io/v1/namespaces/{ns}/httproutes",
    "/apis/gateway.networking.k8s.io/v1/namespaces/{ns}/grpcroutes",
    "/apis/gateway.networking.k8s.io/v1/namespaces/{ns}/tcproutes",
    "/api/v1/namespaces/{ns}/serviceaccounts",
]


async def delete_namespace(api: kclient.ApiClient, name: str) -> None:
    """Delete a namespace as the namespace controller would: its pods (force), the other
    kinds tests create, then the namespace, then finalize it. Missing things are fine."""
    try:
        await request(api, "DELETE", f"/api/v1/namespaces/{name}/pods",
                      query=[("gracePeriodSeconds", 0)])
    except ApiException as e:
        if e.status != 404:
            raise
    for template in _NAMESPACED:
        try:
            await request(api, "DELETE", template.format(ns=name))
        except ApiException as e:
            if e.status not in (404, 405):
                raise
    try:
        ns = await request(api, "DELETE", f"/api/v1/namespaces/{name}")
    except ApiException as e:
        if e.status == 404:
            return
        raise
    ns["spec"] = {"finalizers": []}
    try:
        await request(api, "PUT", f"/api/v1/namespaces/{name}/finalize", body=ns)
    except ApiException as e:
        if e.status not in (404, 409):
            raise


async def create_node(api: kclient.ApiClient, name: str, ip: str = "127.0.0.1",
                      labels: dict[str, str] | None = None) -> dict:
    """Register a Node (what the kubelet does at start), with an InternalIP address."""
    node = await apply(api, {"apiVersion": "v1", "kind": "Node",
                             "metadata": {"name": name, "labels": {
                                 "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                 **(labels or {})}}})
    return await request(api, "PATCH", f"/api/v1/nodes/{name}/status",
                         content_type="application/merge-patch+json",
                         body={"status": {"addresses": [{"type": "InternalIP", "address": ip},
                                                        {"type": "Hostname", "address": name}],
                                          "conditions": [{"type": "Ready", "status": "True",
                                                          "reason": "KubeletReady",
                                                          "message": "played by tests"}]}}) \
        or node


async def delete_node(api: kclient.ApiClient, name: str) -> None:
    try:
        await request(api, "DELETE", f"/api/v1/nodes/{name}")
    except ApiException as e:
        if e.status != 404:
            raise


def pod_manifest(name: str, namespace: str, node: str, labels: dict[str, str] | None = None,
                 annotations: dict[str, str] | None = None, service_account: str = "default",
                 ports: list[dict] | None = None, **spec_extra: Any) -> dict:
    """A Pod bound to ``node`` with one container (its image is never pulled)."""
    container: dict[str, Any] = {"name": "app", "image": "registry.invalid/app:1"}
    if ports:
        container["ports"] = ports
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": labels or {},
                         "annotations": annotations or {}},
            "spec": {"nodeName": node, "serviceAccountName": service_account,
                     "containers": [container], **spec_extra}}


async def create_pod(api: kclient.ApiClient, name: str, namespace: str, node: str,
                     **kwargs: Any) -> dict:
    """Create a pod already scheduled to ``node`` (``spec.nodeName``); Pending, no IP."""
    return await request(api, "POST", f"/api/v1/namespaces/{namespace}/pods",
                         body=pod_manifest(name, namespace, node, **kwargs))


async def set_pod_status(api: kclient.ApiClient, namespace: str, name: str,
                         ips: list[str] | None = None, ready: bool = True,
                         phase: str = "Running", host_ip: str = "127.0.0.1") -> dict:
    """Write the pod's status as the kubelet does once its sandbox runs: phase, hostIP(s),
    podIP(s), conditions (PodScheduled, Initialized, ContainersReady, Ready) and one
    container status. ``ips`` empty = no IP yet. Returns the Pod."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    flag = "True" if ready else "False"
    status: dict[str, Any] = {
        "phase": phase, "hostIP": host_ip, "hostIPs": [{"ip": host_ip}], "startTime": now,
        "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
            {"type": "Initialized", "status": "True", "lastTransitionTime": now},
            {"type": "ContainersReady", "status": flag, "lastTransitionTime": now},
            {"type": "Ready", "status": flag, "lastTransitionTime": now}],
        "containerStatuses": [{
            "name": "app", "image": "registry.invalid/app:1", "imageID": "",
            "containerID": f"containerd://{uuid.uuid4().hex}", "ready": ready,
            "started": phase == "Running", "restartCount": 0,
            "state": ({"running": {"startedAt": now}} if phase == "Running" else
                      {"waiting": {"reason": "ContainerCreating"}})}]}
    if ips:
        status["podIP"] = ips[0]
        status["podIPs"] = [{"ip": ip} for ip in ips]
    return await request(api, "PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}/status",
                         body={"status": status}, content_type="application/merge-patch+json")


async def run_pod(api: kclient.ApiClient, name: str, namespace: str, node: str,
                  ips: list[str], ready: bool = True, **kwargs: Any) -> dict:
    """:func:`create_pod` + :func:`set_pod_status` (Running with ``ips``)."""
    await create_pod(api, name, namespace, node, **kwargs)
    return await set_pod_status(api, namespace, name, ips=ips, ready=ready)


async def delete_pod(api: kclient.ApiClient, namespace: str, name: str) -> None:
    """Delete as a user and then as the kubelet: the graceful DELETE sets
    ``deletionTimestamp`` (a bound, running pod stays), the kubelet's DELETE with
    grace 0 removes it. Missing pod is fine."""
    path = f"/api/v1/namespaces/{namespace}/pods/{name}"
    try:
        await request(api, "DELETE", path)
        await request(api, "DELETE", path, query=[("gracePeriodSeconds", 0)])
    except ApiException as e:
        if e.status != 404:
            raise
