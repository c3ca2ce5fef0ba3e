"""``ambient-agent status`` mesh view (``/debug/mesh``) from a real ambient index over a
real object store, served by the real status server: workloads with their enrollment
state and whether the newest ZDS connection (the reference ZDS client as ztunnel) holds
them, services with endpoints, policies, waypoints; filters by section, namespace and
node; JSON output filtered the same way."""

from __future__ import annotations

import json
import os

from ambient.index import IndexComponent
from cni.enrollment import PodRecord
from tests.ambient import builders as b
from tests.status.conftest import running_status
from tests.status.test_status_cli import block, cli, row
from tests.zds.helpers import netns_fd, running_client, running_server
from zds import PodInfo


def harness():
    h = b.Harness()
    hbone = {"ambient.istio.io/redirection": "enabled"}  # what enrollment writes
    h.apply(
        b.ns("shop", labels={"istio.io/dataplane-mode": "ambient"}),
        b.pod("cart", "shop", ip="10.1.0.5", labels={"app": "cart"}, node="node-a",
              annotations=hbone),
        b.pod("db", "shop", ip="10.1.0.6", labels={"app": "db"}, node="node-b", annotations=hbone),
        b.pod("web", "front", ip="10.2.0.7", labels={"app": "web"}, node="node-a"),
        b.service("cart", "shop", selector={"app": "cart"}, cluster_ip="10.96.0.10"),
        b.policy("allow-front", "shop", action="ALLOW",
                 rules=[{"from": [{"source": {"namespaces": ["front"]}}]}]),
    )
    return h


async def test_status_workloads_services_policies(tmp_path):
    h = harness()
    h.index.start()
    index = IndexComponent(h.index)
    nsfd = netns_fd()
    async with running_server(ztunnel_wait=3) as zds, running_client(zds.path) as client:
        await client.wait_snapshot(timeout=3)
        await zds.add(PodInfo("uid-shop-cart", "cart", "shop", "cart", nsfd))
        await client.wait_for_pod("uid-shop-cart", timeout=5)
        async with running_status(tmp_path, components=[index, zds],
                                  enrollment=True) as (ctx, server):
            enrollment = ctx.components["enrollment"]  # not started: records as enroll() leaves them
            enrollment.records = {"uid-shop-cart": PodRecord(
                "uid-shop-cart", "cart", "shop", netns="/x", ips=["10.1.0.5"], status="enabled")}
            code, out, err = await _cli(server, "--workloads")
            assert code == 0, err
            lines = block(out, "Workloads (3)")
            assert lines[1].split() == ["NAMESPACE", "NAME", "KIND", "IPS", "NODE", "PROTOCOL",
                                        "STATUS", "WAYPOINT", "ENROLLED", "ZTUNNEL"]
            assert row(lines, "cart") == ["shop", "cart", "Pod", "10.1.0.5", "node-a", "HBONE",
                                          "Healthy", "-", "enabled", "yes"]
            assert row(lines, "10.1.0.6") == ["shop", "db", "Pod", "10.1.0.6", "node-b",
                                              "HBONE", "Healthy", "-", "-", "no"]
            assert row(lines, "web") == ["front", "web", "Pod", "10.2.0.7", "node-a", "TCP",
                                         "Healthy", "-", "-", "no"]
            assert "Services" not in out

            code, out, _ = await _cli(server, "--workloads", "--node", "node-a", "-n", "shop")
            assert block(out, "Workloads (1)")[2].startswith("shop")

            code, out, _ = await _cli(server, "--services", "--policies")
            svc = block(out, "Services (1)")
            assert row(svc, "cart") == ["shop", "cart", "10.96.0.10", "80->8080", "1", "-"]
            pol = block(out, "Policies (1)")
            assert row(pol, "allow-front") == ["shop", "allow-front", "NAMESPACE", "ALLOW",
                                               "1", "no"]

            code, out, _ = await _cli(server, "--workloads", "--wide", "-n", "shop")
            assert "spiffe://cluster.local/ns/shop/sa/sa" in out

            code, out, _ = await _cli(server, "--workloads", "-n", "front", "-o", "json")
            doc = json.loads(out)
            assert [w["name"] for w in doc["workloads"]] == ["web"]

            code, out, _ = await _cli(server)  # the full report ends with the mesh tables
            assert "Workloads (3)" in out and "Policies (1)" in out and "Waypoints (0)" in out
    os.close(nsfd)
    h.index.stop()


async def _cli(server, *args):
    import asyncio
    return await asyncio.to_thread(cli, server, *args)


def test_enum_names_come_from_the_message_descriptor():
    """The mesh view names enum values from each message's own descriptor (the status
    package never imports the index's generated modules); a number the descriptor does
    not know (a newer index) is shown as the number, never an error."""
    from agent.status.mesh import _enum_name
    from ambient import authorization_pb2 as az
    from ambient import workload_pb2 as wl

    w = wl.Workload(tunnel_protocol=wl.HBONE, status=wl.UNHEALTHY)
    assert (_enum_name(w, "tunnel_protocol"), _enum_name(w, "status")) == ("HBONE", "UNHEALTHY")
    assert _enum_name(wl.Workload(), "status") == "HEALTHY"  # proto3 default, 0
    p = az.Authorization(scope=az.WORKLOAD_SELECTOR, action=az.DENY)
    assert (_enum_name(p, "scope"), _enum_name(p, "action")) == ("WORKLOAD_SELECTOR", "DENY")
    assert _enum_name(wl.Workload(tunnel_protocol=99), "tunnel_protocol") == "99"
