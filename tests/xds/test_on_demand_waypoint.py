"""On-demand lookups (``docs/xds.md``) and waypoint scoping."""

from __future__ import annotations

import asyncio

from ambient.xds.generators import ADDRESS_TYPE, AUTHORIZATION_TYPE
from tests.xds.fake_index import pod, service

POD_A = "Kubernetes//Pod/default/a"
POD_B = "Kubernetes//Pod/default/b"
SVC = "default/web.default.svc.cluster.local"


async def test_on_demand_initial_holds_only_node_local_workloads(connect, index):
    # subscribe ["*"] + unsubscribe ["*"] = subscribed to nothing; node-local warm-up
    client = await connect(on_demand=True, metadata={"NODE_NAME": "node1"})
    await client.wait_synced()
    assert set(client.resources(ADDRESS_TYPE)) == {POD_A}
    assert set(client.resources(AUTHORIZATION_TYPE)) == {"default/deny-9999"}  # never on-demand
    # a pod created on another node is not pushed; one on our node is
    n = len(client.responses)
    index.put(pod("remote", ip="10.0.0.50", node="node9"))
    index.put(pod("local", ip="10.0.0.51", node="node1"))
    await client.wait_for("Kubernetes//Pod/default/local")
    assert "Kubernetes//Pod/default/remote" not in client.resources()
    assert all("Kubernetes//Pod/default/remote" not in [r.name for r in x.resources]
               for x in client.responses[n:])


async def test_on_demand_by_ip_wakes_the_waiter(connect):
    client = await connect(on_demand=True, metadata={"NODE_NAME": "nodeX"})
    await client.wait_synced()
    # ztunnel's waiter only matches resources[].name / removed_resources: the answer
    # carries the pod (key among its aliases) and a copy named by the key, no removal
    names = await client.request("/10.0.0.2")
    assert set(names) == {POD_B, "/10.0.0.2"}
    assert POD_B in client.resources()
    resp = client.responses[-1]
    assert list(next(r for r in resp.resources if r.name == POD_B).aliases) == ["/10.0.0.2"]
    assert not resp.removed_resources


async def test_on_demand_by_vip_returns_service_and_members(connect, index):
    client = await connect(on_demand=True, metadata={"NODE_NAME": "nodeX"})
    await client.wait_synced()
    names = await client.request("/10.96.0.10")
    assert set(names) == {SVC, POD_A, "/10.96.0.10"}
    # later changes to a pod behind the subscribed service are pushed by uid
    index.put(pod("a", ip="10.0.0.77", services={SVC: (80, 8080)}))
    await client.wait(lambda: client.resources()[POD_A].workload.addresses[0] == bytes([10, 0, 0, 77]))
    # a new member of the subscribed service is pushed too
    index.put(pod("a2", ip="10.0.0.78", node="nodeZ", services={SVC: (80, 8080)}))
    await client.wait_for("Kubernetes//Pod/default/a2")


async def test_on_demand_by_hostname_and_uid(connect):
    client = await connect(on_demand=True, metadata={"NODE_NAME": "nodeX"})
    await client.wait_synced()
    assert set(await client.request(SVC)) == {SVC, POD_A}
    assert "/" + SVC not in client.responses[-1].removed_resources
    assert await client.request(POD_B) == [POD_B]
    assert POD_B not in client.responses[-1].removed_resources  # a name is not echoed


async def test_on_demand_not_found_is_a_removal_of_the_key(connect):
    client = await connect(on_demand=True, metadata={"NODE_NAME": "nodeX"})
    await client.wait_synced()
    assert await client.request("/10.9.9.9") == []
    assert list(client.responses[-1].removed_resources) == ["/10.9.9.9"]


async def test_waypoint_sees_only_its_services_and_workloads(connect, index):
    host = "wp.default.svc.cluster.local"
    index.put(service("bound", vip="10.96.0.20", waypoint=host),
              pod("c", ip="10.0.0.30", waypoint=host), pod("d", ip="10.0.0.31"))
    node_id = "waypoint~10.0.0.99~wp-5d8f7c9b4-x2x7q.default~default.svc.cluster.local"
    wp = await connect(node_id=node_id)
    await wp.wait_synced()
    assert set(wp.resources()) == {"default/bound.default.svc.cluster.local",
                                   "Kubernetes//Pod/default/c"}
    # binding a pod to the waypoint pushes it; unbinding removes it from the waypoint's view
    index.put(pod("d", ip="10.0.0.31", waypoint=host))
    await wp.wait_for("Kubernetes//Pod/default/d")
    index.put(pod("c", ip="10.0.0.30"))
    await wp.wait_for("Kubernetes//Pod/default/c", present=False)
    n = len(wp.responses)
    index.put(pod("b", ip="10.0.0.2", node="node3"))  # unrelated to the waypoint
    await asyncio.sleep(0.05)
    assert len(wp.responses) == n


async def test_waypoint_name_from_labels_metadata(connect, index):
    index.put(service("bound", vip="10.96.0.20", waypoint="gw.default.svc.cluster.local"))
    wp = await connect(node_id="waypoint~10.0.0.99~whatever.default~default.svc.cluster.local",
                       metadata={"LABELS": {"gateway.networking.k8s.io/gateway-name": "gw"}})
    await wp.wait_synced()
    assert set(wp.resources()) == {"default/bound.default.svc.cluster.local"}


# --- on-demand answers as istiod gives them, waking ztunnel without a warning ------------
#
# ztunnel (src/xds/client.rs) wakes an on-demand waiter only for a response naming the
# key in resources[].name or removed_resources; for each removed name its Address
# handler (src/xds.rs remove_internal) removes a workload by uid, else parses the name as
# namespace/hostname and logs a WARNING unless the hostname holds a "/" (a CIDR) or the
# service exists. ztunnel_warnings() applies those rules to what a response removes.

def ztunnel_warnings(resp, held_workloads: set[str], held_services: set[str]) -> list[str]:
    out = []
    for name in resp.removed_resources:
        if name in held_workloads:
            continue
        namespace, sep, hostname = name.partition("/")
        if not sep:
            out.append(f"{name}: not namespace/hostname")
        elif "/" not in hostname and name not in held_services:
            out.append(f"{name}: tried to remove service, but it was not found")
    return out


async def test_found_key_is_answered_with_aliases_no_removal_and_wakes_the_waiter(connect):
    """Issue 17 item 4, issue 13 item 7: found by IP -> the resource with the key among
    its aliases, the key not in removed_resources (so ztunnel logs nothing), plus a copy
    named by the key: the only warning-free way ztunnel's waiter (name match) wakes."""
    client = await connect(on_demand=True, metadata={"NODE_NAME": "nodeX"})
    await client.wait_synced()
    names = await client.request("/10.0.0.2")  # returns only once the waiter would wake
    resp = client.responses[-1]
    assert "/10.0.0.2" not in resp.removed_resources and not resp.removed_resources
    by_name = {r.name: r for r in resp.resources}
    assert set(names) == {POD_B, "/10.0.0.2"}
    assert "/10.0.0.2" in by_name[POD_B].aliases
    twin = by_name["/10.0.0.2"]
    assert twin.resource == by_name[POD_B].resource and twin.version == by_name[POD_B].version
    assert client.resources()[POD_B].workload.uid == POD_B
    assert ztunnel_warnings(resp, set(), set()) == []


async def test_missing_key_is_removed_then_pushed_to_every_stream_that_asked(connect, index):
    """Issue 17 item 4: missing -> a removal of the key; when an address with that IP
    appears it is pushed to each stream that asked (not to one that did not)."""
    asked1 = await connect(on_demand=True, metadata={"NODE_NAME": "nodeX"})
    asked2 = await connect(on_demand=True, metadata={"NODE_NAME": "nodeY"})
    other = await connect(on_demand=True, metadata={"NODE_NAME": "nodeZ"})
    for c in (asked1, asked2, other):
        await c.wait_synced()
    for c in (asked1, asked2):
        assert await c.request("/10.9.9.9") == []
        assert list(c.responses[-1].removed_resources) == ["/10.9.9.9"]
    n_other = len(other.responses)
    index.put(pod("late", ip="10.9.9.9", node="node7"))
    late = "Kubernetes//Pod/default/late"
    for c in (asked1, asked2):
        await c.wait_for(late)
        pushed = next(r for r in c.responses if any(x.name == late for x in r.resources))
        assert "/10.9.9.9" in next(x for x in pushed.resources if x.name == late).aliases
    await asyncio.sleep(0.1)
    assert all(late not in [x.name for x in r.resources] for r in other.responses[n_other:])
    # and it stays subscribed: a later change of that pod is pushed too
    index.put(pod("late", ip="10.9.9.9", node="node8"))
    await asked1.wait(lambda: asked1.resources()[late].workload.node == "node8")


async def test_asking_again_is_answered_again(connect, index):
    """Issue 17 item 4: the same key asked twice on one stream gets two answers, found
    (resent although held at that version) and missing alike."""
    client = await connect(on_demand=True, metadata={"NODE_NAME": "nodeX"})
    await client.wait_synced()
    for _ in range(2):
        assert await client.request("/10.9.9.8") == []
        assert list(client.responses[-1].removed_resources) == ["/10.9.9.8"]
    for _ in range(2):
        assert POD_B in await client.request("/10.0.0.2")
    for _ in range(2):
        assert await client.request(POD_B) == [POD_B]
        assert not client.responses[-1].removed_resources
