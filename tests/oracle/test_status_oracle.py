"""The waypoint status istiod writes against the status the agent writes, for the same
objects, on one real kube-apiserver with Istio's and the Gateway API's own CRDs (so the API
server validates both writers' status against the real schemas).

They run in turn, never at once: istiod first (started with its Gateway API status writer
on, ``PILOT_ENABLE_GATEWAY_API_STATUS=true``; the shared oracle runs it off), its status is
read, istiod is stopped and its per-revision Lease ``istio-gateway-status-leader-default``
released or expired, the statuses are cleared, then the agent's writer
(ambient/waypoint/status_writer.py, in process, with the DaemonSet's token) writes, and the
two are compared condition by condition (type, status, reason, message,
observedGeneration), with the Gateway's addresses and listeners. ``lastTransitionTime`` is
the writer's clock and is not compared. istiod's status is taken once it stayed unchanged
for 5 s: its first write can precede its view of the Services (seen here: the waypoint
Gateway first "hostname ... not found", then programmed). Differences are listed in :data:`KNOWN` with the
reason, or fail the test."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time

import pytest
from prometheus_client import CollectorRegistry

from ambient.source_kube import KubernetesSource
from ambient.store import ObjectStore
from ambient.waypoint.status import CONTROLLER
from ambient.waypoint.status_writer import ISTIOD_LOCK, StatusWriter
from tests.kube import cluster as kc
from tests.oracle import conftest as oc
from tests.oracle import harness as h

GW = "/apis/gateway.networking.k8s.io/v1"
NS, FAR = "sto", "sto-far"
ROUTES = ("good", "missing", "unknown-filter", "orphan", "cross", "unlabelled")
#: (object, path) -> why the agent differs from istiod on purpose
KNOWN: dict[tuple[str, str], str] = {}


class StatusPeers:
    """A private kube-apiserver and istiod with its gateway status writer on."""

    def __init__(self, workdir: str):
        self.kube_dir = os.path.join(workdir, "kube")
        self.istiod_dir = os.path.join(workdir, "istiod")
        self.cluster: kc.KubeCluster | None = None
        self.istiod_running = False

    def start(self) -> None:
        env = h.script_env(KUBE_TEST_OWNER_PID=str(os.getpid()))
        proc = subprocess.run(["bash", kc.SCRIPT, "start", self.kube_dir], capture_output=True,
                              text=True, env=env, timeout=300)
        if proc.returncode:
            raise RuntimeError(f"kube-test-apiserver.sh start failed: {proc.stderr[-2000:]}")
        self.cluster = kc.KubeCluster(self.kube_dir)
        env = h.script_env(ISTIOD_TEST_OWNER_PID=str(os.getpid()),
                           ISTIOD_TEST_KUBECONFIG=self.cluster.kubeconfig,
                           ISTIOD_TEST_ENV="PILOT_ENABLE_GATEWAY_API_STATUS=true")
        proc = subprocess.run(["bash", h.ISTIOD_SCRIPT, "start", self.istiod_dir],
                              capture_output=True, text=True, env=env, timeout=900)
        if proc.returncode:
            raise RuntimeError(f"istiod-test.sh start failed: {proc.stderr[-3000:]}")
        self.istiod_running = True

    def stop_istiod(self) -> None:
        if self.istiod_running:
            subprocess.run(["bash", h.ISTIOD_SCRIPT, "stop", self.istiod_dir],
                           capture_output=True, timeout=60)
            self.istiod_running = False

    def stop(self) -> None:
        self.stop_istiod()
        subprocess.run(["bash", kc.SCRIPT, "stop", self.kube_dir], capture_output=True,
                       timeout=60)


@pytest.fixture(scope="module")
def peers(tmp_path_factory):
    with oc.running(lambda: StatusPeers(str(tmp_path_factory.mktemp("status-oracle")))) as p:
        yield p


def service(ns: str, name: str, port: int, labels: dict | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": ns, "labels": labels or {}},
            "spec": {"selector": {"app": name}, "ports": [{"name": "p", "port": port}]}}


def route(name: str, parent: str, backends: list[dict], filters: list | None = None) -> dict:
    rule: dict = {"backendRefs": backends}
    if filters:
        rule["filters"] = filters
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": parent}],
                     "rules": [rule]}}


async def load(api) -> None:
    await kc.create_namespace(api, kc.AGENT_NAMESPACE)
    await kc.apply_manifest(api, "rbac.yaml")
    await kc.apply(api, {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass",
                         "metadata": {"name": "istio-waypoint"},
                         "spec": {"controllerName": "istio.io/mesh-controller"}})
    for ns in (NS, FAR):
        await kc.create_namespace(api, ns)
    await kc.apply(api, service(NS, "wp", 15008))
    await kc.apply(api, {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "wp-1", "namespace": NS,
                     "labels": {"kubernetes.io/service-name": "wp"}},
        "addressType": "IPv4", "ports": [{"name": "p", "port": 15008, "protocol": "TCP"}],
        "endpoints": [{"addresses": ["10.0.9.9"], "conditions": {"ready": True}}]})
    for name, port in (("wp", 15008), ("bad", 1234)):
        await kc.apply(api, {
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"gatewayClassName": "istio-waypoint",
                     "listeners": [{"name": "mesh", "port": port,
                                    "protocol": "HBONE" if port == 15008 else "HTTP"}]}})
    await kc.apply(api, service(NS, "web", 80, {"istio.io/use-waypoint": "wp"}))
    await kc.apply(api, service(NS, "plain", 80))
    await kc.apply(api, service(FAR, "far", 80))
    for r in (route("good", "web", [{"name": "web", "port": 80}]),
              route("missing", "web", [{"name": "nope", "port": 80}]),
              route("unknown-filter", "web", [{"name": "web", "port": 80}],
                    [{"type": "ExtensionRef",
                      "extensionRef": {"group": "x.io", "kind": "Y", "name": "z"}}]),
              route("orphan", "gone", [{"name": "web", "port": 80}]),
              route("cross", "web", [{"name": "far", "namespace": FAR, "port": 80}]),
              route("unlabelled", "plain", [{"name": "web", "port": 80}])):
        await kc.apply(api, r)


def view(obj: dict, kind: str) -> dict:
    """What is compared: conditions without lastTransitionTime, and for a Gateway its
    addresses and listeners; for a route the istiod-controller parents only."""
    st = obj.get("status") or {}

    def conds(cs) -> list[dict]:
        return [{k: c.get(k) for k in ("type", "status", "reason", "message",
                                       "observedGeneration")} for c in cs or []]

    if kind == "Gateway":
        return {"conditions": conds(st.get("conditions")), "addresses": st.get("addresses"),
                "listeners": [{**x, "conditions": conds(x.get("conditions"))}
                              for x in st.get("listeners") or []]}
    return {"parents": [{"parentRef": p.get("parentRef"), "conditions": conds(p.get("conditions"))}
                        for p in st.get("parents") or []
                        if p.get("controllerName") == CONTROLLER]}


async def snapshot(api) -> dict[str, dict]:
    out = {}
    for name in ("wp", "bad"):
        out[f"Gateway/{name}"] = view(await kc.request(
            api, "GET", f"{GW}/namespaces/{NS}/gateways/{name}"), "Gateway")
    for name in ROUTES:
        out[f"HTTPRoute/{name}"] = view(await kc.request(
            api, "GET", f"{GW}/namespaces/{NS}/httproutes/{name}"), "HTTPRoute")
    return out


def written(v: dict) -> bool:
    """A controller wrote it: the Gateway CRD's schema defaults a cleared status to
    conditions ``Unknown``/``Pending`` ("Waiting for controller"), which do not count."""
    conditions = v.get("conditions") or [c for p in v.get("parents") or []
                                          for c in p["conditions"]]
    return bool(conditions) and all(c["status"] != "Unknown" for c in conditions)


def complete(snap: dict[str, dict]) -> bool:
    return all(written(v) for v in snap.values())


async def until_complete(api, timeout: float, what: str) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while True:
        snap = await snapshot(api)
        if complete(snap):
            return snap
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: status incomplete after {timeout:g}s: {snap}")
        await asyncio.sleep(0.5)


async def settled(api, snap: dict[str, dict], quiet: float = 5.0,
                  timeout: float = 60.0) -> dict[str, dict]:
    """The snapshot once it stayed the same for ``quiet`` seconds (a writer may write a
    first status before its view of the cluster is complete)."""
    deadline = time.monotonic() + timeout
    since = time.monotonic()
    while time.monotonic() - since < quiet:
        assert time.monotonic() < deadline, "status never settled"
        await asyncio.sleep(0.5)
        now = await snapshot(api)
        if now != snap:
            if os.environ.get("STATUS_ORACLE_DUMP"):
                print("changed:", [k for k in now if now[k] != snap[k]])
            snap, since = now, time.monotonic()
    return snap


async def clear(api) -> None:
    for kind, names in (("gateways", ("wp", "bad")), ("httproutes", ROUTES)):
        for name in names:
            await kc.request(api, "PATCH", f"{GW}/namespaces/{NS}/{kind}/{name}/status",
                             body={"status": None}, content_type="application/merge-patch+json")


async def istiod_lease_free(api) -> bool:
    """istiod's gateway status locks (the ones the agent stands aside for) are not held."""
    return not await ISTIOD_LOCK.held(api, "istio-system")


def differences(a: dict, b: dict, path: str = "") -> list[tuple[str, object, object]]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += differences(a.get(k), b.get(k), f"{path}.{k}" if path else k)
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        out = []
        for i, (x, y) in enumerate(zip(a, b)):
            out += differences(x, y, f"{path}[{i}]")
        return out
    return [] if a == b else [(path, a, b)]


async def test_agent_writes_the_status_istiod_writes(peers):
    assert peers.cluster is not None
    api = await peers.cluster.admin_client()
    agent_api = None
    source = writer = None
    try:
        await load(api)
        theirs = await until_complete(api, 120, "istiod")
        theirs = await settled(api, theirs)
        if os.environ.get("STATUS_ORACLE_DUMP"):
            print(json.dumps(theirs, indent=1, sort_keys=True))
        # istiod wrote what this comparison is about (not an empty status on both sides)
        assert [c["type"] for c in theirs["Gateway/wp"]["conditions"]] == [
            "Accepted", "Programmed", "ResolvedRefs"]
        assert len(theirs["HTTPRoute/good"]["parents"]) == 1
        peers.stop_istiod()
        deadline = time.monotonic() + 60
        while not await istiod_lease_free(api):
            assert time.monotonic() < deadline, "istiod's gateway status Lease never released"
            await asyncio.sleep(0.5)
        await clear(api)
        cleared = await snapshot(api)
        assert not any(written(v) or v.get("listeners") for v in cleared.values()), cleared
        kubeconfig = await kc.agent_kubeconfig(peers.cluster, api,
                                               os.path.join(peers.kube_dir, "agent.kubeconfig"))
        agent_api = await kc.client_from_kubeconfig(kubeconfig)
        store = ObjectStore(CollectorRegistry(), source="kubernetes")
        source = KubernetesSource(store, api_client=agent_api,
                                  kinds=["Namespace", "Gateway", "HTTPRoute", "Service",
                                         "EndpointSlice"])
        await source.start()
        writer = StatusWriter(store, lambda: agent_api, kc.AGENT_NAMESPACE, "oracle-agent",
                              lease_seconds=3)
        await writer.start()
        ours = await until_complete(api, 60, "agent")
        assert writer.writes["patched"] >= len(ours), writer.writes
        if os.environ.get("STATUS_ORACLE_DUMP"):
            print(json.dumps(ours["Gateway/wp"], indent=1, sort_keys=True))
        found = []
        for key in sorted(theirs):
            for path, a, b in differences(theirs[key], ours[key]):
                if (key, path) not in KNOWN:
                    found.append(f"{key} {path}: istiod {a!r} agent {b!r}")
        assert not found, "\n".join(found)
    finally:
        if writer is not None:
            await writer.stop()
        if source is not None:
            await source.stop()
        if agent_api is not None:
            await agent_api.close()
        await api.close()
