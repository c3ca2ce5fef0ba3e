"""Waypoint Gateway and route status written to the real kube-apiserver by one agent, as
istiod's gateway status writer writes it (ambient/waypoint/status_writer.py).

Each agent here is what the daemon builds in Kubernetes mode for this job: a
KubernetesSource filling an ObjectStore, and the StatusWriter, with its own token of the
DaemonSet's ServiceAccount, so the shipped RBAC (deploy/kubernetes/rbac.yaml: the
ClusterRole, and the ``ambient-agent-status`` Role copied into a fresh system namespace)
is what they run with. The expected conditions are istiod's texts (pilot/pkg/config/kube/
gateway/conditions.go, conversion.go, gatewaycommon/conversion.go)."""

from __future__ import annotations

import asyncio
import copy
import datetime as dt

import pytest
from prometheus_client import CollectorRegistry

from ambient.source_kube import KubernetesSource
from ambient.store import ObjectStore
from ambient.waypoint.status import CONTROLLER, WAYPOINT_BOUND
from ambient.waypoint.status_writer import LEASE_NAME, StatusWriter
from tests.kube import cluster as kc

GW = "/apis/gateway.networking.k8s.io/v1"
KINDS = ["Gateway", "HTTPRoute", "Service", "EndpointSlice"]


async def until(predicate, timeout: float, what: str) -> None:
    """Await the async ``predicate`` every 0.2 s until truthy; AssertionError after
    ``timeout`` s naming ``what``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await predicate():
        if loop.time() > deadline:
            raise AssertionError(f"{what} not reached within {timeout:g}s")
        await asyncio.sleep(0.2)


@pytest.fixture
async def system_ns(kube_admin):
    """A fresh system namespace with the shipped ``ambient-agent-status`` Role bound."""
    name = kc.unique("sys")
    await kc.create_namespace(kube_admin, name)
    docs = [d for d in kc.manifest("rbac.yaml")
            if d["metadata"].get("name") == "ambient-agent-status"]
    assert {d["kind"] for d in docs} == {"Role", "RoleBinding"}, docs
    for d in docs:
        d = copy.deepcopy(d)
        d["metadata"]["namespace"] = name
        await kc.apply(kube_admin, d)
    try:
        yield name
    finally:
        await kc.delete_namespace(kube_admin, name)


class Agent:
    def __init__(self, source: KubernetesSource, writer: StatusWriter, api):
        self.source, self.writer, self.api = source, writer, api
        self.stopped = False

    async def crash(self) -> None:
        """As a killed agent: the election and the writer stop at once, the Lease is left
        as it was (no release)."""
        task, self.writer.election._task = self.writer.election._task, None
        assert task is not None
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await self.writer._step_down()
        self.writer.election.leading = False
        await self.stop()

    async def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            await self.writer.stop()
            await self.source.stop()
            await self.api.close()


@pytest.fixture
async def agents(kube_cluster, kube_admin, tmp_path):
    """``make(system_ns, node)`` -> a started Agent (lease 3 s); all stopped at the end."""
    made: list[Agent] = []

    async def make(system_ns: str, node: str) -> Agent:
        kubeconfig = await kc.agent_kubeconfig(kube_cluster, kube_admin,
                                               str(tmp_path / f"{node}.kubeconfig"))
        api = await kc.client_from_kubeconfig(kubeconfig)
        store = ObjectStore(CollectorRegistry(), source="kubernetes")
        source = KubernetesSource(store, api_client=api, kinds=KINDS)
        writer = StatusWriter(store, lambda: api, system_ns, node, lease_seconds=3)
        agent = Agent(source, writer, api)
        made.append(agent)
        await source.start()
        await writer.start()
        return agent

    try:
        yield make
    finally:
        for a in made:
            await a.stop()


def service(ns: str, name: str, port: int, labels: dict | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": ns, "labels": labels or {}},
            "spec": {"selector": {"app": name}, "ports": [{"name": "p", "port": port}]}}


def route(ns: str, name: str, parent: str, backends: list[dict],
          filters: list | None = None) -> dict:
    rule: dict = {"backendRefs": backends}
    if filters:
        rule["filters"] = filters
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": parent}],
                     "rules": [rule]}}


async def waypoint_objects(admin, ns: str) -> None:
    """A waypoint (Gateway + its Service with port 15008 + an EndpointSlice) and a
    Service ``web`` using it."""
    await kc.apply(admin, service(ns, "wp", 15008))
    await kc.apply(admin, {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "wp-1", "namespace": ns,
                     "labels": {"kubernetes.io/service-name": "wp"}},
        "addressType": "IPv4", "ports": [{"name": "p", "port": 15008}],
        "endpoints": [{"addresses": ["10.0.9.9"]}]})
    await kc.apply(admin, {
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
        "metadata": {"name": "wp", "namespace": ns},
        "spec": {"gatewayClassName": "istio-waypoint",
                 "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE"}]}})
    await kc.apply(admin, service(ns, "web", 80, {"istio.io/use-waypoint": "wp"}))


async def get(admin, path: str) -> dict:
    return await kc.request(admin, "GET", path)


def by_type(conditions: list[dict]) -> dict[str, dict]:
    return {c["type"]: c for c in conditions}


def ours(obj: dict) -> list[dict]:
    return [p for p in (obj.get("status") or {}).get("parents") or []
            if p.get("controllerName") == CONTROLLER]


async def test_status_written_as_istiod_writes_it_and_not_rewritten_when_unchanged(
        agents, system_ns, kube_admin, kube_namespace):
    ns = kube_namespace
    other = kc.unique("far")
    await kc.create_namespace(kube_admin, other)
    try:
        await waypoint_objects(kube_admin, ns)
        await kc.apply(kube_admin, service(other, "far", 80))
        for r in (route(ns, "good", "web", [{"name": "web", "port": 80}]),
                  route(ns, "missing", "web", [{"name": "nope", "port": 80}]),
                  route(ns, "unsupported", "web", [{"name": "web", "port": 80}],
                        filters=[{"type": "ExtensionRef",
                                  "extensionRef": {"group": "x", "kind": "Y", "name": "z"}}]),
                  route(ns, "rewrite", "web", [{"name": "web", "port": 80}],
                        filters=[{"type": "URLRewrite", "urlRewrite": {"hostname": "h"}}]),
                  route(ns, "cross", "web", [{"name": "far", "namespace": other, "port": 80}]),
                  route(ns, "orphan", "gone", [{"name": "web", "port": 80}])):
            await kc.apply(kube_admin, r)
        # another controller's entry on "good" must survive our writes
        foreign = {"parentRef": {"name": "ingress", "namespace": ns},
                   "controllerName": "example.com/other",
                   "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted",
                                   "message": "theirs", "observedGeneration": 1,
                                   "lastTransitionTime": "2020-01-01T00:00:00Z"}]}
        await kc.request(kube_admin, "PATCH", f"{GW}/namespaces/{ns}/httproutes/good/status",
                         body={"status": {"parents": [foreign]}},
                         content_type="application/merge-patch+json")
        agent = await agents(system_ns, kc.unique("node"))

        async def all_written() -> bool:
            for name in ("good", "missing", "unsupported", "rewrite", "cross", "orphan"):
                if not ours(await get(kube_admin, f"{GW}/namespaces/{ns}/httproutes/{name}")):
                    return False
            gw = await get(kube_admin, f"{GW}/namespaces/{ns}/gateways/wp")
            return bool((gw.get("status") or {}).get("listeners"))

        await until(all_written, 40, "status on every route and the Gateway")
        routes = {n: await get(kube_admin, f"{GW}/namespaces/{ns}/httproutes/{n}")
                  for n in ("good", "missing", "unsupported", "rewrite", "cross", "orphan")}

        good = routes["good"]
        assert foreign in good["status"]["parents"]
        (entry,) = ours(good)
        assert entry["parentRef"] == {"group": "", "kind": "Service", "name": "web"}
        c = by_type(entry["conditions"])
        assert (c["Accepted"]["status"], c["Accepted"]["reason"], c["Accepted"]["message"]) == \
            ("True", "Accepted", "Route was valid")
        assert (c["ResolvedRefs"]["status"], c["ResolvedRefs"]["reason"],
                c["ResolvedRefs"]["message"]) == ("True", "ResolvedRefs",
                                                  "All references resolved")
        generation = good["metadata"]["generation"]
        assert all(x["observedGeneration"] == generation and x["lastTransitionTime"]
                   for x in entry["conditions"])

        c = by_type(ours(routes["missing"])[0]["conditions"])
        assert (c["ResolvedRefs"]["status"], c["ResolvedRefs"]["reason"],
                c["ResolvedRefs"]["message"]) == (
            "False", "BackendNotFound", f"backend(nope.{ns}.svc.cluster.local) not found")
        assert c["Accepted"]["status"] == "True"
        # a filter type istiod cannot convert: istiod's InvalidFilter under ResolvedRefs
        c = by_type(ours(routes["unsupported"])[0]["conditions"])
        assert (c["Accepted"]["status"], c["ResolvedRefs"]["status"], c["ResolvedRefs"]["reason"],
                c["ResolvedRefs"]["message"]) == ("True", "False", "InvalidFilter",
                                                  'unsupported filter type "ExtensionRef"')
        # one istiod converts but the waypoint does not carry: Accepted=False naming the field
        c = by_type(ours(routes["rewrite"])[0]["conditions"])
        assert (c["Accepted"]["status"], c["Accepted"]["reason"]) == ("False", "UnsupportedValue")
        assert "spec.rules[0].filters[0].type" in c["Accepted"]["message"]
        # a Service-parented route needs no ReferenceGrant for another namespace (istiod:
        # mesh routes are converted with enforceRefGrant = !mesh)
        c = by_type(ours(routes["cross"])[0]["conditions"])
        assert (c["ResolvedRefs"]["status"], c["ResolvedRefs"]["reason"]) == ("True",
                                                                             "ResolvedRefs")
        c = by_type(ours(routes["orphan"])[0]["conditions"])
        assert (c["Accepted"]["status"], c["Accepted"]["reason"], c["Accepted"]["message"]) == \
            ("False", "NoMatchingParent", 'parent service: "gone" not found')

        gw = await get(kube_admin, f"{GW}/namespaces/{ns}/gateways/wp")
        svc = await get(kube_admin, f"/api/v1/namespaces/{ns}/services/wp")
        c = by_type(gw["status"]["conditions"])
        assert (c["Accepted"]["reason"], c["Programmed"]["status"], c["Programmed"]["message"],
                c["ResolvedRefs"]["reason"]) == (
            "Accepted", "True", f"Resource programmed, assigned to service(s) "
                                f"wp.{ns}.svc.cluster.local:15008", "ResolvedRefs")
        assert gw["status"]["addresses"] == [
            {"type": "IPAddress", "value": ip} for ip in svc["spec"]["clusterIPs"]] + [
            {"type": "Hostname", "value": f"wp.{ns}.svc.cluster.local"}]
        assert gw["status"]["listeners"][0]["name"] == "mesh"

        # unchanged: a full pass sends nothing, every resourceVersion stays
        async def synced_store() -> bool:
            for n, obj in routes.items():
                held = agent.source.store.get("HTTPRoute", ns, n)
                if held is None or held["metadata"]["resourceVersion"] != \
                        obj["metadata"]["resourceVersion"]:
                    return False
            held = agent.source.store.get("Gateway", ns, "wp")
            if held is None or held["metadata"]["resourceVersion"] != \
                    gw["metadata"]["resourceVersion"]:
                return False
            # the Service using the waypoint carries istiod's WaypointBound, bound
            web = await get(kube_admin, f"/api/v1/namespaces/{ns}/services/web")
            bound = by_type((web.get("status") or {}).get("conditions") or []).get(
                WAYPOINT_BOUND) or {}
            held = agent.source.store.get("Service", ns, "web")
            return bound.get("status") == "True" and held is not None and \
                held["metadata"]["resourceVersion"] == web["metadata"]["resourceVersion"]

        await until(synced_store, 30, "the agent's store holding the written versions")
        web = await get(kube_admin, f"/api/v1/namespaces/{ns}/services/web")
        bound = by_type(web["status"]["conditions"])[WAYPOINT_BOUND]
        assert (bound["reason"], bound["message"]) == (
            "WaypointAccepted", f"Successfully attached to waypoint {ns}/wp")
        patched = agent.writer.writes["patched"]
        assert await agent.writer.sync() == 0
        assert agent.writer.writes["patched"] == patched
        for n, obj in routes.items():
            now = await get(kube_admin, f"{GW}/namespaces/{ns}/httproutes/{n}")
            assert now["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"], n
        now = await get(kube_admin, f"{GW}/namespaces/{ns}/gateways/wp")
        assert now["metadata"]["resourceVersion"] == gw["metadata"]["resourceVersion"]

        # a spec change: observedGeneration follows, an unchanged condition keeps its time
        before = by_type(entry["conditions"])["Accepted"]["lastTransitionTime"]
        changed = route(ns, "good", "web", [{"name": "web", "port": 80, "weight": 3}])
        await kc.apply(kube_admin, changed)

        async def regenerated() -> bool:
            obj = await get(kube_admin, f"{GW}/namespaces/{ns}/httproutes/good")
            mine = ours(obj)
            return bool(mine) and mine[0]["conditions"][0]["observedGeneration"] == \
                obj["metadata"]["generation"] > generation

        await until(regenerated, 30, "observedGeneration following the new generation")
        obj = await get(kube_admin, f"{GW}/namespaces/{ns}/httproutes/good")
        assert by_type(ours(obj)[0]["conditions"])["Accepted"]["lastTransitionTime"] == before
        assert foreign in obj["status"]["parents"]

        # the backend appears: ResolvedRefs turns True
        await kc.apply(kube_admin, service(ns, "nope", 80))

        async def resolved() -> bool:
            obj = await get(kube_admin, f"{GW}/namespaces/{ns}/httproutes/missing")
            return by_type(ours(obj)[0]["conditions"])["ResolvedRefs"]["status"] == "True"

        await until(resolved, 30, "ResolvedRefs True once the backend exists")

        # the waypoint loses its endpoints: not programmed, and its addresses are removed
        await kc.request(kube_admin, "DELETE", f"/apis/discovery.k8s.io/v1/namespaces/{ns}/"
                                               "endpointslices/wp-1")

        async def unassigned() -> bool:
            st = (await get(kube_admin, f"{GW}/namespaces/{ns}/gateways/wp"))["status"]
            return by_type(st["conditions"])["Programmed"]["reason"] == "AddressNotAssigned" \
                and "addresses" not in st

        await until(unassigned, 30, "Programmed=False and no addresses without endpoints")
    finally:
        await kc.delete_namespace(kube_admin, other)


async def test_two_agents_one_writer_failover_and_istiod_lock(
        agents, system_ns, kube_admin, kube_namespace):
    ns = kube_namespace
    await waypoint_objects(kube_admin, ns)
    a = await agents(system_ns, kc.unique("node-a"))
    b = await agents(system_ns, kc.unique("node-b"))

    async def one_leader() -> bool:
        return [a.writer.leading, b.writer.leading].count(True) == 1

    await until(one_leader, 20, "exactly one leader")
    leader, follower = (a, b) if a.writer.leading else (b, a)
    lease = await get(kube_admin, f"/apis/coordination.k8s.io/v1/namespaces/{system_ns}/"
                                  f"leases/{LEASE_NAME}")
    assert lease["spec"]["holderIdentity"] == leader.writer.election.identity

    async def gateway_programmed() -> bool:
        gw = await get(kube_admin, f"{GW}/namespaces/{ns}/gateways/wp")
        return by_type((gw.get("status") or {}).get("conditions") or []).get(
            "Programmed", {}).get("status") == "True"

    await until(gateway_programmed, 30, "the Gateway's status written")
    await kc.apply(kube_admin, route(ns, "r1", "web", [{"name": "web", "port": 80}]))

    async def written(name: str) -> bool:
        return bool(ours(await get(kube_admin, f"{GW}/namespaces/{ns}/httproutes/{name}")))

    await until(lambda: written("r1"), 30, "r1's status")
    assert leader.writer.writes["patched"] >= 2
    assert follower.writer.writes["patched"] == 0 and follower.writer.passes == 0
    assert not follower.writer.leading
    patched_before_crash = leader.writer.writes["patched"]

    # the leader dies (no release, no more renewals): the follower takes over once the
    # Lease is not renewed for its duration, and writes what changes next
    await leader.crash()

    async def took_over() -> bool:
        return follower.writer.leading

    await until(took_over, 20, "the follower leading after the leader stopped")
    await kc.apply(kube_admin, route(ns, "r2", "web", [{"name": "web", "port": 80}]))
    await until(lambda: written("r2"), 30, "r2's status written by the new leader")
    assert follower.writer.writes["patched"] >= 1
    assert leader.writer.writes["patched"] == patched_before_crash

    # a graceful stop gives the Lease up: a third agent takes over
    c = await agents(system_ns, kc.unique("node-c"))
    await until(lambda: written("r2"), 5, "r2 still written")  # (c is a follower now)
    assert not c.writer.leading
    await follower.stop()

    async def c_leads() -> bool:
        return c.writer.leading

    await until(c_leads, 20, "the third agent leading after a graceful stop")
    lease = await get(kube_admin, f"/apis/coordination.k8s.io/v1/namespaces/{system_ns}/"
                                  f"leases/{LEASE_NAME}")
    assert lease["spec"]["holderIdentity"] == c.writer.election.identity
    await kc.apply(kube_admin, route(ns, "r3", "web", [{"name": "web", "port": 80}]))
    await until(lambda: written("r3"), 30, "r3's status written by the third agent")

    # istiod's per-revision gateway status Lease is held: the agent stands aside
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    await kc.request(kube_admin, "POST",
                     f"/apis/coordination.k8s.io/v1/namespaces/{system_ns}/leases", body={
                         "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                         "metadata": {"name": "istio-gateway-status-leader-default"},
                         "spec": {"holderIdentity": "istiod-1", "leaseDurationSeconds": 300,
                                  "acquireTime": now, "renewTime": now}})

    async def stood_aside() -> bool:
        return not c.writer.leading and c.writer.election.istiod_active

    await until(stood_aside, 20, "the agent standing aside for istiod")
    patched = c.writer.writes["patched"]
    await kc.apply(kube_admin, route(ns, "r4", "web", [{"name": "web", "port": 80}]))
    # the writer's worker is stopped while istiod leads: no pass can run
    assert c.writer._worker is None
    obj = await get(kube_admin, f"{GW}/namespaces/{ns}/httproutes/r4")
    assert not ours(obj) and c.writer.writes["patched"] == patched


async def test_conflicting_change_is_reread_not_overwritten(
        agents, system_ns, kube_admin, kube_namespace):
    """A write computed from an old resourceVersion gets 409 and is decided again from the
    object as it is now (never a blind overwrite)."""
    ns = kube_namespace
    await waypoint_objects(kube_admin, ns)
    await kc.apply(kube_admin, route(ns, "r", "web", [{"name": "web", "port": 80}]))
    agent = await agents(system_ns, kc.unique("node"))

    async def written() -> bool:
        return bool(ours(await get(kube_admin, f"{GW}/namespaces/{ns}/httproutes/r")))

    await until(written, 30, "r's status")
    stale = copy.deepcopy(agent.source.store.get("HTTPRoute", ns, "r"))
    # someone else adds their entry after the agent's store copy was taken
    theirs = {"parentRef": {"name": "other"}, "controllerName": "example.com/x",
              "conditions": []}
    obj = await get(kube_admin, f"{GW}/namespaces/{ns}/httproutes/r")
    await kc.request(kube_admin, "PATCH", f"{GW}/namespaces/{ns}/httproutes/r/status",
                     body={"status": {"parents": obj["status"]["parents"] + [theirs]}},
                     content_type="application/merge-patch+json")
    # decide from the stale copy with ours removed, so a write is due
    stale["status"]["parents"] = []
    conflicts = agent.writer.writes["conflicts"]
    desired = {"parents": ours(obj)}
    desired["parents"] = [{k: v for k, v in p.items()} for p in desired["parents"]]
    for p in desired["parents"]:
        p["conditions"] = [{k: v for k, v in c.items() if k != "lastTransitionTime"}
                           for c in p["conditions"]]
    await agent.writer._write("httproutes", ns, "r", desired, stale)
    assert agent.writer.writes["conflicts"] == conflicts + 1
    now = await get(kube_admin, f"{GW}/namespaces/{ns}/httproutes/r")
    assert theirs in now["status"]["parents"] and len(ours(now)) == 1


async def test_service_naming_a_missing_waypoint_gets_istiods_condition(
        agents, system_ns, kube_admin, kube_namespace):
    """istiod's ``WaypointIsNotReady`` on a Service whose ``istio.io/use-waypoint`` names no
    Gateway; ``WaypointAccepted`` once that Gateway is a waypoint (has an address); the
    condition removed (others kept) when the label goes."""
    ns = kube_namespace
    await kc.apply(kube_admin, service(ns, "lost", 80, {"istio.io/use-waypoint": "ghost"}))
    await agents(system_ns, kc.unique("node"))
    path = f"/api/v1/namespaces/{ns}/services/lost"

    async def condition() -> dict:
        obj = await get(kube_admin, path)
        return by_type((obj.get("status") or {}).get("conditions") or []).get(
            WAYPOINT_BOUND) or {}

    async def not_ready() -> bool:
        return (await condition()).get("reason") == "WaypointIsNotReady"

    await until(not_ready, 30, "WaypointBound=False on the Service")
    c = await condition()
    assert (c["status"], c["message"]) == ("False", f'waypoint "{ns}/ghost" is not ready')
    assert c["lastTransitionTime"]

    # the waypoint appears (its Service with 15008 and endpoints: the writer gives the
    # Gateway its addresses, which makes it a waypoint)
    await kc.apply(kube_admin, service(ns, "ghost", 15008))
    await kc.apply(kube_admin, {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "ghost-1", "namespace": ns,
                     "labels": {"kubernetes.io/service-name": "ghost"}},
        "addressType": "IPv4", "ports": [{"name": "p", "port": 15008}],
        "endpoints": [{"addresses": ["10.0.9.8"]}]})
    await kc.apply(kube_admin, {
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
        "metadata": {"name": "ghost", "namespace": ns},
        "spec": {"gatewayClassName": "istio-waypoint",
                 "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE"}]}})

    async def accepted() -> bool:
        return (await condition()).get("status") == "True"

    await until(accepted, 40, "WaypointBound=True once the waypoint exists")
    assert (await condition())["message"] == f"Successfully attached to waypoint {ns}/ghost"

    # the label goes: our condition is removed
    await kc.apply(kube_admin, service(ns, "lost", 80))

    async def pruned() -> bool:
        obj = await get(kube_admin, path)
        return WAYPOINT_BOUND not in by_type((obj.get("status") or {}).get("conditions") or [])

    await until(pruned, 30, "the condition removed with the label")


async def test_no_service_condition_while_istiods_ambient_status_lease_is_held(
        agents, system_ns, kube_admin, kube_namespace):
    """istiod writes WaypointBound itself under its ``istio-status-leader`` Lease: while
    that is held the agent writes Gateway and route status but no Service condition."""
    ns = kube_namespace
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    lease = f"/apis/coordination.k8s.io/v1/namespaces/{system_ns}/leases"
    await kc.request(kube_admin, "POST", lease, body={
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "istio-status-leader-default"},
        "spec": {"holderIdentity": "istiod-1", "leaseDurationSeconds": 300,
                 "acquireTime": now, "renewTime": now}})
    await waypoint_objects(kube_admin, ns)
    agent = await agents(system_ns, kc.unique("node"))

    async def gateway_held() -> bool:  # written, and back in the agent's store
        gw = agent.source.store.get("Gateway", ns, "wp")
        return bool(gw and (gw.get("status") or {}).get("addresses"))

    await until(gateway_held, 30, "the Gateway's status written and seen")
    assert await agent.writer.sync() == 0  # a whole pass, done when it returns
    web = await get(kube_admin, f"/api/v1/namespaces/{ns}/services/web")
    assert WAYPOINT_BOUND not in by_type((web.get("status") or {}).get("conditions") or [])

    # istiod's Lease goes: the agent writes the condition
    await kc.request(kube_admin, "DELETE", f"{lease}/istio-status-leader-default")
    await kc.apply(kube_admin, service(ns, "web", 80, {"istio.io/use-waypoint": "wp",
                                                       "touch": "1"}))

    async def written() -> bool:
        obj = await get(kube_admin, f"/api/v1/namespaces/{ns}/services/web")
        return WAYPOINT_BOUND in by_type((obj.get("status") or {}).get("conditions") or [])

    await until(written, 30, "WaypointBound written once istiod's Lease is gone")


async def test_unsupported_listener_and_missing_service_as_istiod(
        agents, system_ns, kube_admin, kube_namespace):
    """istiod's testdata/waypoint.yaml "invalid" case: a listener other than HBONE on 15008
    is not accepted (the Gateway still is); no Service named as the Gateway: not
    programmed, no address."""
    ns = kube_namespace
    await kc.apply(kube_admin, {
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
        "metadata": {"name": "invalid", "namespace": ns},
        "spec": {"gatewayClassName": "istio-waypoint",
                 "listeners": [{"name": "mesh", "port": 1234, "protocol": "HTTP"}]}})
    await agents(system_ns, kc.unique("node"))

    async def written() -> bool:
        gw = await get(kube_admin, f"{GW}/namespaces/{ns}/gateways/invalid")
        return bool((gw.get("status") or {}).get("conditions"))

    await until(written, 30, "the Gateway's status")
    st = (await get(kube_admin, f"{GW}/namespaces/{ns}/gateways/invalid"))["status"]
    c = by_type(st["conditions"])
    assert (c["Accepted"]["status"], c["Accepted"]["message"]) == ("True", "Resource accepted")
    assert (c["Programmed"]["status"], c["Programmed"]["reason"], c["Programmed"]["message"]) == (
        "False", "AddressNotUsable", "Failed to assign to any requested addresses: hostname "
        f'"invalid.{ns}.svc.cluster.local" not found')
    assert "addresses" not in st
    (listener,) = st["listeners"]
    lc = by_type(listener["conditions"])
    assert (lc["Accepted"]["status"], lc["Accepted"]["reason"], lc["Accepted"]["message"]) == (
        "False", "UnsupportedProtocol", 'Expected a single listener on port 15008 with '
                                        'protocol "HBONE"')
    assert listener["supportedKinds"] == [
        {"group": "gateway.networking.k8s.io", "kind": "HTTPRoute"},
        {"group": "gateway.networking.k8s.io", "kind": "GRPCRoute"}]


async def test_forbidden_writes_warn_once_retry_and_recover(
        kube_cluster, system_ns, kube_admin, kube_namespace, tmp_path, caplog):
    """An agent whose ServiceAccount may read everything but not write status: every write
    is Forbidden, counted, logged once per object at WARNING, retried with backoff, and
    the writer keeps leading; once the shipped ClusterRole is bound the status appears."""
    ns = kube_namespace
    await waypoint_objects(kube_admin, ns)
    sa = kc.unique("nostatus")
    await kc.create_service_account(kube_admin, ns, sa)
    reader = kc.unique("reader")
    await kc.apply(kube_admin, {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": reader},
        "rules": [{"apiGroups": ["", "discovery.k8s.io", "gateway.networking.k8s.io"],
                   "resources": ["services", "endpointslices", "gateways", "httproutes"],
                   "verbs": ["list", "watch", "get"]}]})
    subject = [{"kind": "ServiceAccount", "name": sa, "namespace": ns}]
    bindings = [(reader, kc.unique("bind-reader")), ("ambient-agent", kc.unique("bind-agent"))]
    await kc.apply(kube_admin, {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": bindings[0][1]}, "subjects": subject,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": reader}})
    await kc.apply(kube_admin, {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": "status-lease", "namespace": system_ns}, "subjects": subject,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                    "name": "ambient-agent-status"}})
    token = await kc.service_account_token(kube_admin, ns, sa)
    api = await kc.client_from_kubeconfig(kc.kubeconfig_for_token(
        kube_cluster, token, str(tmp_path / "nostatus.kubeconfig")))
    store = ObjectStore(CollectorRegistry(), source="kubernetes")
    source = KubernetesSource(store, api_client=api, kinds=KINDS)
    writer = StatusWriter(store, lambda: api, system_ns, kc.unique("node"), lease_seconds=3)
    agent = Agent(source, writer, api)
    caplog.set_level("DEBUG", logger="ambient.waypoint.status_writer")
    try:
        await source.start()
        await writer.start()

        async def failing_twice() -> bool:
            return writer.writes["errors"] >= 2 and writer.passes >= 2

        await until(failing_twice, 40, "two failed passes")
        assert writer.leading and writer.writes["patched"] == 0
        warnings = [r for r in caplog.records if r.levelname == "WARNING"
                    and "writing status of Gateway" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert "forbidden" in warnings[0].getMessage().lower()
        await kc.apply(kube_admin, {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": bindings[1][1]}, "subjects": subject,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "ambient-agent"}})

        async def written() -> bool:
            gw = await get(kube_admin, f"{GW}/namespaces/{ns}/gateways/wp")
            return bool((gw.get("status") or {}).get("conditions"))

        await until(written, 60, "the status written once allowed")
    finally:
        await agent.stop()
        await kc.request(kube_admin, "DELETE",
                         f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{reader}")
        for _, name in bindings:
            try:
                await kc.request(kube_admin, "DELETE", "/apis/rbac.authorization.k8s.io/v1/"
                                                       f"clusterrolebindings/{name}")
            except Exception:  # noqa: BLE001 - the second may not exist when the test failed
                pass
