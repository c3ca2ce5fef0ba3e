"""The kubernetes config source (ambient/source_kube.py) against a real kube-apiserver.

The source always authenticates as the DaemonSet's own ServiceAccount
(istio-system/ambient-agent), whose only permissions are deploy/kubernetes/rbac.yaml as
shipped: a permission the source needs and the file lacks shows up as a 403 and fails the
test that needs it (every test also asserts no 403 was logged). Faults are real: a network
cut (tests/kube/proxy.py, a byte pipe in front of the real server), an etcd compaction, an
API server restart, APF (priority and fairness) answering 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl

import aiohttp
import pytest

from agent.core import kubecall
from ambient import source_kube
from ambient.source_kube import RESOURCES, KubernetesSource
from ambient.store import ObjectStore
from tests.helpers import eventually
from tests.kube import cluster as kc
from tests.kube.proxy import SlowApiProxy, TcpProxy

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch):
    monkeypatch.setattr(source_kube, "BACKOFF_START", 0.1)
    monkeypatch.setattr(source_kube, "BACKOFF_MAX", 1.0)
    monkeypatch.setattr(source_kube, "MISSING_RETRY", 0.5)


@pytest.fixture
def no_403(caplog):
    """Fails the test if the source logged any 403 (a permission rbac.yaml lacks)."""
    caplog.set_level(logging.INFO, logger="ambient.source_kube")
    yield caplog
    forbidden = [r.getMessage() for r in caplog.records
                 if r.name == "ambient.source_kube" and " 403 " in f" {r.getMessage()} "]
    assert not forbidden, forbidden


@contextlib.asynccontextmanager
async def running(kubeconfig: str, store: ObjectStore | None = None, **kwargs):
    src = KubernetesSource(store if store is not None else ObjectStore(), kubeconfig,
                           sync_timeout=kwargs.pop("sync_timeout", 20), **kwargs)
    await src.start()
    try:
        yield src
    finally:
        await src.stop()


def key_of(obj: dict) -> tuple[str, str, str]:
    meta = obj["metadata"]
    ns = "" if obj["kind"] in ("Namespace", "Node", "GatewayClass") else meta["namespace"]
    return obj["kind"], ns, meta["name"]


async def server_objects(api, objs: list[dict]) -> dict:
    """The server's current version of each object: key -> resourceVersion."""
    out = {}
    for o in objs:
        path = await kc.object_path(api, o["apiVersion"], o["kind"], o["metadata"]["name"],
                                    o["metadata"].get("namespace", ""))
        got = await kc.request(api, "GET", path)
        out[key_of(o)] = got["metadata"]["resourceVersion"]
    return out


def one_of_every_kind(ns: str, node: str, suffix: str) -> list[dict]:
    """One object of each RESOURCES kind except Pod (made by run_pod) and Namespace."""
    lbl = {"app": f"app-{suffix}"}
    return [
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": f"svc-{suffix}", "namespace": ns},
         "spec": {"selector": lbl, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": f"svc-{suffix}-x", "namespace": ns,
                      "labels": {"kubernetes.io/service-name": f"svc-{suffix}"}},
         "addressType": "IPv4",
         "endpoints": [{"addresses": ["10.250.0.9"], "conditions": {"ready": True}}],
         "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]},
        {"apiVersion": "networking.istio.io/v1", "kind": "ServiceEntry",
         "metadata": {"name": f"se-{suffix}", "namespace": ns},
         "spec": {"hosts": [f"{suffix}.example.com"], "resolution": "STATIC",
                  "ports": [{"number": 80, "name": "http", "protocol": "HTTP"}],
                  "endpoints": [{"address": "10.250.1.1"}]}},
        {"apiVersion": "networking.istio.io/v1", "kind": "WorkloadEntry",
         "metadata": {"name": f"we-{suffix}", "namespace": ns, "labels": lbl},
         "spec": {"address": "10.250.2.1", "serviceAccount": "default"}},
        {"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
         "metadata": {"name": f"ap-{suffix}", "namespace": ns},
         "spec": {"selector": {"matchLabels": lbl}, "action": "DENY",
                  "rules": [{"from": [{"source": {"namespaces": ["other"]}}]}]}},
        {"apiVersion": "security.istio.io/v1", "kind": "PeerAuthentication",
         "metadata": {"name": f"pa-{suffix}", "namespace": ns},
         "spec": {"mtls": {"mode": "STRICT"}}},
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass",
         "metadata": {"name": f"gc-{suffix}"},
         "spec": {"controllerName": "istio.io/unmanaged-gateway"}},
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
         "metadata": {"name": f"gw-{suffix}", "namespace": ns},
         "spec": {"gatewayClassName": f"gc-{suffix}",
                  "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE"}]}},
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
         "metadata": {"name": f"rt-{suffix}", "namespace": ns},
         "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": f"svc-{suffix}"}],
                  "rules": [{"backendRefs": [{"name": f"svc-{suffix}", "port": 80}]}]}},
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "GRPCRoute",
         "metadata": {"name": f"grt-{suffix}", "namespace": ns},
         "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": f"svc-{suffix}"}],
                  "rules": [{"matches": [{"method": {"service": "pkg.Svc"}}],
                             "backendRefs": [{"name": f"svc-{suffix}", "port": 80}]}]}},
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "TCPRoute",
         "metadata": {"name": f"trt-{suffix}", "namespace": ns},
         "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": f"svc-{suffix}"}],
                  "rules": [{"backendRefs": [{"name": f"svc-{suffix}", "port": 80}]}]}},
    ]


async def delete_object(api, obj: dict) -> None:
    path = await kc.object_path(api, obj["apiVersion"], obj["kind"], obj["metadata"]["name"],
                                obj["metadata"].get("namespace", ""))
    await kc.request(api, "DELETE", path)


def rv_of(store: ObjectStore, key: tuple[str, str, str]) -> str | None:
    obj = store.get(*key)
    return obj["metadata"]["resourceVersion"] if obj else None


async def test_initial_list_and_watch_of_every_kind(kube_admin, kube_namespace, agent_kubeconfig,
                                                    no_403):
    node = kc.unique("node")
    await kc.create_node(kube_admin, node)
    before = one_of_every_kind(kube_namespace, node, "a")
    after = one_of_every_kind(kube_namespace, node, "b")
    try:
        for o in before:
            await kc.apply(kube_admin, o)
        await kc.run_pod(kube_admin, "pod-a", kube_namespace, node, ["10.250.0.9"],
                         labels={"app": "app-a"})
        pod_key = ("Pod", kube_namespace, "pod-a")
        async with running(agent_kubeconfig) as src:
            store = src.store
            assert src.is_synced() and not src.errors and not src.missing, src.debug_state()
            # initial LIST: every object, at the server's version
            want = await server_objects(kube_admin, before)
            want[("Node", "", node)] = (await kc.request(
                kube_admin, "GET", f"/api/v1/nodes/{node}"))["metadata"]["resourceVersion"]
            want[("Namespace", "", kube_namespace)] = (await kc.request(
                kube_admin, "GET", f"/api/v1/namespaces/{kube_namespace}")
            )["metadata"]["resourceVersion"]
            want[pod_key] = (await kc.request(
                kube_admin, "GET", f"/api/v1/namespaces/{kube_namespace}/pods/pod-a")
            )["metadata"]["resourceVersion"]
            assert {k: rv_of(store, k) for k in want} == want
            assert {k[0] for k in want} == set(RESOURCES)
            pod = store.get(*pod_key)
            assert pod["kind"] == "Pod" and pod["apiVersion"] == "v1"
            assert pod["status"]["podIPs"] == [{"ip": "10.250.0.9"}]
            # managedFields are dropped, as istiod's informers drop them (the server has them)
            served = await kc.request(kube_admin, "GET",
                                      f"/api/v1/namespaces/{kube_namespace}/pods/pod-a")
            assert served["metadata"]["managedFields"]
            assert not [o["metadata"]["name"] for kind in RESOURCES for o in store.list(kind)
                        if "managedFields" in o["metadata"]]

            # WATCH: adds
            for o in after:
                await kc.apply(kube_admin, o)
            await kc.run_pod(kube_admin, "pod-b", kube_namespace, node, ["10.250.0.10"])
            want_after = await server_objects(kube_admin, after)
            await eventually(lambda: all(rv_of(store, k) == v for k, v in want_after.items()),
                             timeout=30, what="watched adds")
            await eventually(lambda: (store.get("Pod", kube_namespace, "pod-b") or {})
                             .get("status", {}).get("podIP") == "10.250.0.10", timeout=30)
            assert "managedFields" not in store.get("Pod", kube_namespace, "pod-b")["metadata"]
            # changes
            for o in before:
                changed = {**o, "metadata": {**o["metadata"], "labels": {
                    **o["metadata"].get("labels", {}), "changed": "yes"}}}
                await kc.apply(kube_admin, changed)
            await kc.set_pod_status(kube_admin, kube_namespace, "pod-a", ips=["10.250.0.9"],
                                    ready=False)
            await eventually(lambda: all(
                (store.get(*key_of(o))["metadata"].get("labels") or {}).get("changed") == "yes"
                for o in before), timeout=30, what="watched changes")
            await eventually(lambda: {c["type"]: c["status"] for c in store.get(*pod_key)[
                "status"]["conditions"]}["Ready"] == "False", timeout=30)
            # deletes (the pod as the kubelet finishes it: graceful, then final)
            for o in before + after:
                await delete_object(kube_admin, o)
            await kc.delete_pod(kube_admin, kube_namespace, "pod-a")
            await kc.delete_node(kube_admin, node)
            gone = [key_of(o) for o in before + after] + [pod_key, ("Node", "", node)]
            await eventually(lambda: all(store.get(*k) is None for k in gone), timeout=30,
                             what="watched deletes")
            assert store.get("Pod", kube_namespace, "pod-b") is not None
            stats = src.debug_state()
            assert all(stats[k]["lists"] == 1 and stats[k]["watch_events"] >= 1
                       for k in RESOURCES if k != "Namespace"), stats
            assert not src.errors
    finally:
        await kc.delete_node(kube_admin, node)
        for o in before + after:
            with contextlib.suppress(kc.ApiException):
                await delete_object(kube_admin, o)


async def test_on_connected_runs_with_the_client_while_the_lists_are_under_way(
        agent_kubeconfig, no_403):
    """Issue 28: ``on_connected`` callbacks (the agent's CA Secret read) are called once,
    with the API client made and no kind listed yet, so what they read overlaps the
    LISTs; a callback that raises is logged and the source syncs all the same."""
    src = KubernetesSource(ObjectStore(), agent_kubeconfig, kinds=["Namespace", "Pod"],
                           sync_timeout=20)
    seen: list[tuple[bool, bool]] = []

    def broken() -> None:
        raise RuntimeError("a consumer's bug")

    src.on_connected += [lambda: seen.append((src.api is not None, src.is_synced())), broken]
    await src.start()
    try:
        assert seen == [(True, False)]
        assert src.is_synced()
    finally:
        await src.stop()


async def test_bookmarks_advance_the_resource_version(kube_admin, agent_kubeconfig, no_403):
    """The API server's watch cache sends BOOKMARKs (~2 s before a watch's timeout here)
    carrying the newest resourceVersion even when nothing of that kind changed; the source
    follows them, so a reconnect starts from a recent version."""
    async with running(agent_kubeconfig, kinds=["GatewayClass"], watch_timeout=4) as src:
        rv0 = int(src.resource_versions["GatewayClass"])
        other = kc.unique("bm")
        await kc.create_namespace(kube_admin, other)  # another kind: the global version moves
        try:
            ns_rv = int((await kc.request(kube_admin, "GET", f"/api/v1/namespaces/{other}"))
                        ["metadata"]["resourceVersion"])
            assert ns_rv > rv0
            await eventually(lambda: src.stats["GatewayClass"].bookmarks >= 1, timeout=30,
                             what="a bookmark")
            await eventually(lambda: int(src.resource_versions["GatewayClass"]) >= ns_rv,
                             timeout=30, what="the bookmark's resourceVersion")
            # the watch ends at its timeout and resumes from the bookmark's version
            await eventually(lambda: src.stats["GatewayClass"].watches >= 2, timeout=30)
            assert src.stats["GatewayClass"].watch_events == 0
            assert src.relists["GatewayClass"] == 1  # resumed, never relisted
        finally:
            await kc.delete_namespace(kube_admin, other)


async def test_410_after_compaction_relists_nothing_lost_nothing_duplicated(
        kube_cluster, kube_admin, kube_namespace, tmp_path, no_403, caplog):
    """With the watch cache off, a watch is served by etcd itself; once etcd compacted
    the history past the source's version, etcd (through the API server) answers the resumed
    watch with 410 Gone. The relist must show exactly the changes made while the source was
    cut off: one add, one change, one delete, no event for the unchanged pod."""
    node = kc.unique("node")
    kube_cluster.apiserver_stop()
    kube_cluster.apiserver_start(extra_args="--watch-cache=false")
    proxy = await TcpProxy(int(kube_cluster.env["KUBE_APISERVER_PORT"])).start()
    try:
        api = await kube_cluster.admin_client()
        try:
            for name in ("keep", "change", "delete"):
                await kc.run_pod(api, name, kube_namespace, node, ["10.250.3.1"])
            kubeconfig = await kc.agent_kubeconfig(kube_cluster, api,
                                                   str(tmp_path / "agent.kubeconfig"),
                                                   server=proxy.url)
            async with running(kubeconfig, kinds=["Pod"]) as src:
                store = src.store
                mine = lambda: sorted(p["metadata"]["name"] for p in store.list(  # noqa: E731
                    "Pod", kube_namespace))
                assert mine() == ["change", "delete", "keep"]
                events = []
                store.subscribe(lambda evs: events.extend(
                    e for e in evs if e.namespace == kube_namespace))
                old_rv = src.resource_versions["Pod"]
                proxy.cut()
                await kc.run_pod(api, "add", kube_namespace, node, ["10.250.3.2"])
                await kc.set_pod_status(api, kube_namespace, "change", ips=["10.250.3.9"])
                await kc.delete_pod(api, kube_namespace, "delete")
                compacted = await kube_cluster.compact()
                assert compacted > int(old_rv)
                # the server now refuses the source's version: proof the fault is real
                with pytest.raises(kc.ApiException) as err:
                    await watch_once(api, f"/api/v1/namespaces/{kube_namespace}/pods", old_rv)
                assert err.value.status == 410
                relists = src.relists["Pod"]
                proxy.restore()
                await eventually(lambda: src.relists["Pod"] > relists, timeout=20,
                                 what="a relist after 410")
                await eventually(lambda: mine() == ["add", "change", "keep"], timeout=30)
                assert store.get("Pod", kube_namespace, "change")["status"]["podIP"] == \
                    "10.250.3.9"
                # nothing lost, nothing duplicated: one event per real change, none for "keep"
                changes = sorted((e.name, e.old is None, e.new is None) for e in events)
                assert changes == [("add", True, False), ("change", False, False),
                                   ("delete", False, True)], events
                assert any("is gone" in r.getMessage() for r in caplog.records)
        finally:
            await api.close()
    finally:
        await proxy.stop()
        kube_cluster.apiserver_stop()
        kube_cluster.apiserver_start()


async def watch_once(api, path: str, rv: str) -> None:
    """Open a watch at ``rv`` and read its first line; raises KubeError for ERROR."""
    async with kubecall.stream(api, path, timeout=None,  # an HTTP-level 410 raises here
                               query=[("watch", "true"), ("resourceVersion", rv),
                                      ("timeoutSeconds", 2)]) as resp:
        line = await resp.content.readline()
    KubernetesSource(ObjectStore(), kinds=["Pod"])._events("Pod", "probe", [line], rv)


async def test_changes_while_the_source_is_down_are_reconciled_at_start(
        kube_admin, kube_namespace, agent_kubeconfig, no_403):
    """An agent restart keeps the store's consumers (index, enrollment) but not the watch:
    the new source's first LIST replaces what the store held, with one event per object
    created, changed or deleted while it was down and none for the rest."""
    node = kc.unique("node")
    store = ObjectStore()
    for name in ("keep", "change", "delete"):
        await kc.run_pod(kube_admin, name, kube_namespace, node, ["10.250.4.1"])
    async with running(agent_kubeconfig, store, kinds=["Pod"]):
        pass
    assert {p["metadata"]["name"] for p in store.list("Pod", kube_namespace)} == \
        {"keep", "change", "delete"}
    await kc.run_pod(kube_admin, "add", kube_namespace, node, ["10.250.4.2"])
    await kc.set_pod_status(kube_admin, kube_namespace, "change", ips=["10.250.4.3"])
    await kc.delete_pod(kube_admin, kube_namespace, "delete")
    events = []
    store.subscribe(lambda evs: events.extend(e for e in evs if e.namespace == kube_namespace))
    async with running(agent_kubeconfig, store, kinds=["Pod"]) as src:
        assert src.is_synced()
        assert sorted((e.name, e.old is None, e.new is None) for e in events) == [
            ("add", True, False), ("change", False, False), ("delete", False, True)]
        assert store.get("Pod", kube_namespace, "change")["status"]["podIP"] == "10.250.4.3"


async def test_api_server_restart_mid_run(kube_cluster, kube_admin, kube_namespace,
                                          agent_kubeconfig, no_403):
    """The API server goes away (connections refused) and comes back on the same port with
    an empty watch cache: the source retries with backoff, resumes (410 from the new cache
    -> relist), and catches every change made before and after the restart."""
    node = kc.unique("node")
    await kc.run_pod(kube_admin, "before", kube_namespace, node, ["10.250.5.1"])
    async with running(agent_kubeconfig, kinds=["Pod", "Service"]) as src:
        store = src.store
        await kc.run_pod(kube_admin, "during", kube_namespace, node, ["10.250.5.2"])
        await eventually(lambda: store.get("Pod", kube_namespace, "during") is not None,
                         timeout=30)
        kube_cluster.apiserver_stop()
        await asyncio.sleep(1.0)
        assert src.errors.get("Pod"), "the source did not notice the API server was gone"
        kube_cluster.apiserver_start()
        api = await kube_cluster.admin_client()
        try:
            await kc.run_pod(api, "after", kube_namespace, node, ["10.250.5.3"])
            await kc.delete_pod(api, kube_namespace, "before")
            await kc.apply(api, {"apiVersion": "v1", "kind": "Service",
                                 "metadata": {"name": "s", "namespace": kube_namespace},
                                 "spec": {"ports": [{"port": 80}]}})
        finally:
            await api.close()
        await eventually(lambda: sorted(p["metadata"]["name"] for p in store.list(
            "Pod", kube_namespace)) == ["after", "during"], timeout=20, what="pods resynced")
        await eventually(lambda: store.get("Service", kube_namespace, "s") is not None,
                         timeout=20)
        await eventually(lambda: not src.errors, timeout=30)
        assert src.is_synced()


@contextlib.asynccontextmanager
async def flow_schema_rejecting(api, subjects: list[dict]):
    """An APF priority level with no seats of its own and Reject: while one request of
    ``subjects`` executes, every other one is answered 429 (Retry-After: 1)."""
    name = kc.unique("throttle")
    await kc.apply(api, {
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "PriorityLevelConfiguration",
        "metadata": {"name": name},
        "spec": {"type": "Limited", "limited": {
            "nominalConcurrencyShares": 0, "lendablePercent": 0, "borrowingLimitPercent": 0,
            "limitResponse": {"type": "Reject"}}}})
    await kc.apply(api, {
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "FlowSchema",
        "metadata": {"name": name},
        "spec": {"priorityLevelConfiguration": {"name": name}, "matchingPrecedence": 500,
                 "distinguisherMethod": {"type": "ByUser"},
                 "rules": [{"subjects": subjects, "resourceRules": [{
                     "verbs": ["*"], "apiGroups": ["*"], "resources": ["*"],
                     "clusterScope": True, "namespaces": ["*"]}]}]}})
    try:
        yield name
    finally:
        for kind in ("flowschemas", "prioritylevelconfigurations"):
            with contextlib.suppress(kc.ApiException):
                await kc.request(api, "DELETE",
                                 f"/apis/flowcontrol.apiserver.k8s.io/v1/{kind}/{name}")


async def test_throttling_429_is_retried_with_backoff(kube_cluster, kube_admin, kube_namespace,
                                                      agent_kubeconfig, no_403, caplog):
    """Real 429s: APF rejects the agent's LISTs while a request of the same priority level
    holds its only seat (a create whose body arrives slowly). The source backs off (no
    faster than Retry-After), stays unsynced, then syncs once the seat is free."""
    await kc.create_service_account(kube_admin, kube_namespace, "holder")
    await kc.apply(kube_admin, {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": "holder", "namespace": kube_namespace},
        "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]}]})
    await kc.apply(kube_admin, {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": "holder", "namespace": kube_namespace},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "holder"},
        "subjects": [{"kind": "ServiceAccount", "name": "holder", "namespace": kube_namespace}]})
    holder_token = await kc.service_account_token(kube_admin, kube_namespace, "holder")
    subjects = [{"kind": "ServiceAccount", "serviceAccount": {
        "name": kc.AGENT_SERVICE_ACCOUNT, "namespace": kc.AGENT_NAMESPACE}},
        {"kind": "ServiceAccount", "serviceAccount": {"name": "holder",
                                                      "namespace": kube_namespace}}]
    release = asyncio.Event()

    async def slow_body():
        yield b'{"apiVersion":"v1","kind":"ConfigMap",'
        await release.wait()
        yield b'"metadata":{"name":"held"}}'

    async with flow_schema_rejecting(kube_admin, subjects), aiohttp.ClientSession() as http:
        ctx = ssl.create_default_context(cafile=kube_cluster.ca_file)
        url = f"{kube_cluster.url}/api/v1/namespaces/{kube_namespace}/configmaps"
        holder = None

        async def seat_held() -> bool:
            nonlocal holder
            if holder is None or holder.done():
                holder = asyncio.create_task(http.post(
                    url, data=slow_body(), ssl=ctx, headers={
                        "Authorization": f"Bearer {holder_token}",
                        "Content-Type": "application/json"}))
                await asyncio.sleep(0.3)
            agent = await kc.client_from_kubeconfig(agent_kubeconfig)
            try:
                await kc.request(agent, "GET", "/api/v1/pods", query=[("limit", 1)])
                return False
            except kc.ApiException as e:
                assert e.status == 429, e
                return True
            finally:
                await agent.close()

        for _ in range(50):  # the FlowSchema takes effect within a moment
            if await seat_held():
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("APF never rejected the agent's request")
        src = KubernetesSource(ObjectStore(), agent_kubeconfig, kinds=["Pod"], sync_timeout=3)
        try:
            await src.start()  # returns after sync_timeout, unsynced
            assert not src.is_synced()
            assert src.errors["Pod"].startswith("429")
            throttled = [r for r in caplog.records if "429" in r.getMessage()
                         and r.name == "ambient.source_kube"]
            # ~3 s at no faster than Retry-After (1 s): a handful of attempts, not a flood
            assert 2 <= len(throttled) <= 5, [r.getMessage() for r in throttled]
            release.set()
            await holder
            await eventually(src.is_synced, timeout=30, what="sync after the seat is free")
            assert "Pod" not in src.errors
        finally:
            release.set()
            await src.stop()


async def test_missing_crds_are_retried_until_installed(kube_cluster, kube_admin, kube_namespace,
                                                        agent_kubeconfig, no_403, caplog):
    """Started on a cluster without the Istio and Gateway API CRDs, the source is synced
    (those kinds are empty), logs each missing kind once, and lists them once they exist."""
    crd_kinds = {"ServiceEntry", "WorkloadEntry", "AuthorizationPolicy", "PeerAuthentication",
                 "Gateway", "GatewayClass", "HTTPRoute", "GRPCRoute", "TCPRoute"}
    try:
        # inside the try: a delete that times out still gets the CRDs applied again, so the
        # tests after this one find them (a CRD stuck Terminating once failed 8 of them)
        await kc.delete_crds(kube_admin)
        async with running(agent_kubeconfig) as src:
            assert src.is_synced()
            assert src.missing == crd_kinds
            await asyncio.sleep(1.5)  # several retries (MISSING_RETRY 0.5 s here)...
            warned = [r.getMessage() for r in caplog.records if "not served" in r.getMessage()]
            assert len(warned) == len(crd_kinds), warned  # ...logged once per kind
            await kc.apply_crds(kube_admin)
            await kc.apply(kube_admin, {
                "apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
                "metadata": {"name": "late", "namespace": kube_namespace},
                "spec": {"action": "DENY", "rules": [{}]}})
            await eventually(lambda: src.store.get("AuthorizationPolicy", kube_namespace, "late")
                             is not None, timeout=30, what="the policy after its CRD")
            await eventually(lambda: not src.missing, timeout=30)
            assert not src.errors
            assert any("is served now" in r.getMessage() for r in caplog.records)
    finally:
        await kc.apply_crds(kube_admin)


async def test_patch_pod_annotations_as_the_agent(kube_admin, kube_namespace, agent_kubeconfig,
                                                  no_403):
    """The redirection annotation goes through pods/status, the one write rbac.yaml grants."""
    node = kc.unique("node")
    await kc.run_pod(kube_admin, "p", kube_namespace, node, ["10.250.6.1"])
    async with running(agent_kubeconfig, kinds=["Pod"]) as src:
        pod = await src.patch_pod_annotations(kube_namespace, "p", {
            "ambient.istio.io/redirection": "enabled"})
        assert pod["metadata"]["annotations"]["ambient.istio.io/redirection"] == "enabled"
        await eventually(lambda: (src.store.get("Pod", kube_namespace, "p")["metadata"]
                                  .get("annotations") or {}).get(
            "ambient.istio.io/redirection") == "enabled", timeout=30)
        await src.patch_pod_annotations(kube_namespace, "p", {
            "ambient.istio.io/redirection": None})
        await eventually(lambda: "ambient.istio.io/redirection" not in (
            src.store.get("Pod", kube_namespace, "p")["metadata"].get("annotations") or {}),
            timeout=30)
        with pytest.raises(kc.ApiException) as err:
            await src.patch_pod_annotations(kube_namespace, "missing", {"a": "b"})
        assert err.value.status == 404


async def test_a_permission_missing_from_the_role_is_a_403_that_keeps_the_source_unsynced(
        kube_cluster, kube_admin, kube_namespace, tmp_path, caplog):
    """The negative control of every test above: the ClusterRole of rbac.yaml with its
    EndpointSlice rule removed, bound to a fresh ServiceAccount. The source logs the 403
    naming the kind, stays unsynced (so the agent is not ready), and syncs once the
    permission is granted."""
    caplog.set_level(logging.WARNING, logger="ambient.source_kube")
    role = next(d for d in kc.manifest("rbac.yaml") if d["kind"] == "ClusterRole")
    name = kc.unique("partial")
    rules = [r for r in role["rules"] if "endpointslices" not in r["resources"]]
    assert len(rules) == len(role["rules"]) - 1
    await kc.create_service_account(kube_admin, kube_namespace, "partial")
    await kc.apply(kube_admin, {"apiVersion": "rbac.authorization.k8s.io/v1",
                                "kind": "ClusterRole", "metadata": {"name": name},
                                "rules": rules})
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": name},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                           "name": name},
               "subjects": [{"kind": "ServiceAccount", "name": "partial",
                             "namespace": kube_namespace}]}
    await kc.apply(kube_admin, binding)
    try:
        token = await kc.service_account_token(kube_admin, kube_namespace, "partial")
        kubeconfig = kc.kubeconfig_for_token(kube_cluster, token, str(tmp_path / "p.kubeconfig"))
        async with running(kubeconfig, sync_timeout=3) as src:
            assert not src.is_synced()
            assert set(src.errors) == {"EndpointSlice"}, src.errors
            assert src.errors["EndpointSlice"].startswith("403")
            assert any("EndpointSlice" in r.getMessage() and " 403 " in r.getMessage()
                       for r in caplog.records)
            await kc.apply(kube_admin, {**binding, "roleRef": {
                **binding["roleRef"], "name": "ambient-agent"}, "metadata": {
                "name": name + "-full"}})
            await eventually(src.is_synced, timeout=30, what="sync once granted")
    finally:
        for path in (f"clusterrolebindings/{name}", f"clusterrolebindings/{name}-full",
                     f"clusterroles/{name}"):
            with contextlib.suppress(kc.ApiException):
                await kc.request(kube_admin, "DELETE",
                                 f"/apis/rbac.authorization.k8s.io/v1/{path}")


async def test_slow_and_throttled_lists_still_sync_every_object(
        kube_cluster, kube_admin, kube_namespace, tmp_path, no_403):
    """Bad input of issue 28: an API server (tests/kube/proxy.py's SlowApiProxy in front
    of the real one) that answers each kind's first two LISTs with 429 and every LIST
    after 2 s. The source retries, is synced with every pod once the slow LISTs end,
    within the bound the backoff and the delays allow, then follows changes as usual."""
    await kc.run_pod(kube_admin, "slow0", kube_namespace, "node-a", ips=["10.9.0.1"])
    proxy = await SlowApiProxy(kube_cluster.url, kube_cluster.ca_file, list_delay=2.0,
                               throttle=2, retry_after=1).start()
    try:
        kubeconfig = await kc.agent_kubeconfig(kube_cluster, kube_admin,
                                               str(tmp_path / "slow.kubeconfig"),
                                               server=proxy.url)
        store = ObjectStore()
        loop = asyncio.get_running_loop()
        began = loop.time()
        async with running(kubeconfig, store, kinds=["Namespace", "Pod"],
                           sync_timeout=60) as src:
            took = loop.time() - began
            assert src.is_synced()
            # two 429s (each waited no less than Retry-After, 1 s), then a 2 s LIST
            assert 4.0 <= took <= 45.0, took
            assert proxy.throttled == 4 and proxy.lists >= 2
            assert store.get("Pod", kube_namespace, "slow0") is not None
            await kc.run_pod(kube_admin, "slow1", kube_namespace, "node-a", ips=["10.9.0.2"])
            await eventually(lambda: store.get("Pod", kube_namespace, "slow1") is not None,
                             timeout=30, what="a pod made after the slow start")
    finally:
        await proxy.stop()
