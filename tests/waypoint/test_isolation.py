"""A waypoint stream that NACKs everything, and one that never reads, do not delay
ztunnel's pushes; the waypoint configuration and the NACK counter behave. Real gRPC
server and clients over loopback, the real store and index (no Envoy needed here)."""

from __future__ import annotations

import asyncio
import time

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from prometheus_client import CollectorRegistry

from ambient.index import AmbientIndex
from ambient.objects import Mesh
from ambient.store import ObjectStore
from ambient.waypoint.resources import CLUSTER_TYPE, LISTENER_TYPE
from ambient.waypoint.service import WaypointConfigs
from ambient.xds.client import DeltaXdsClient
from ambient.xds.server import XdsServer
from tests.waypoint.test_envoy_waypoint import objects

WAYPOINT_NODE = "waypoint~127.0.0.9~wp-0.demo~demo.svc.cluster.local"


def _pod(name: str, ip: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "demo", "uid": f"uid-{name}",
                         "labels": {"app": "web"},
                         "annotations": {"ambient.istio.io/redirection": "enabled"}},
            "spec": {"nodeName": "n1", "serviceAccountName": "server",
                     "containers": [{"name": "c"}]},
            "status": {"podIP": ip, "podIPs": [{"ip": ip}], "phase": "Running",
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def _request(type_url: str, nonce: str = "", error: str = "") -> discovery_pb2.DeltaDiscoveryRequest:
    req = discovery_pb2.DeltaDiscoveryRequest(
        type_url=type_url, response_nonce=nonce,
        node=base_pb2.Node(id=WAYPOINT_NODE))
    req.node.metadata.update({"LABELS": {"gateway.networking.k8s.io/gateway-name": "wp"}})
    if error:
        req.error_detail.code = 3
        req.error_detail.message = error
    return req


async def test_nacking_and_stalled_waypoints_do_not_delay_ztunnel():
    store = ObjectStore(CollectorRegistry())
    store.apply([(o, "test") for o in objects("127.0.9", "10.96.9.9")])
    index = AmbientIndex(store, Mesh(), CollectorRegistry())
    index.start()
    registry = CollectorRegistry()
    server = XdsServer(index, port=0, debounce=0.01, debounce_max=0.05, registry=registry,
                       stall_timeout=30.0, waypoints=WaypointConfigs(store, index))
    await server.start()
    target = f"127.0.0.1:{server.port}"
    channels = [grpc.aio.insecure_channel(target) for _ in range(2)]
    try:
        # the NACKer: rejects every response it gets
        nacker_out: asyncio.Queue = asyncio.Queue()
        await nacker_out.put(_request(CLUSTER_TYPE))
        nacked = []

        async def requests(q):
            while True:
                yield await q.get()

        nacker = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channels[0]) \
            .DeltaAggregatedResources(requests(nacker_out))

        async def nack_all():
            async for resp in nacker:
                nacked.append(resp.nonce)
                await nacker_out.put(_request(resp.type_url, resp.nonce, "rejected by test"))

        nack_task = asyncio.create_task(nack_all())
        # the staller: asks for listeners and never reads a response
        stall_out: asyncio.Queue = asyncio.Queue()
        await stall_out.put(_request(LISTENER_TYPE))
        staller = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channels[1]) \
            .DeltaAggregatedResources(requests(stall_out))

        async with DeltaXdsClient(target, node_id="ztunnel~10.0.0.1~zt.istio-system~"
                                  "istio-system.svc.cluster.local",
                                  metadata={"NODE_NAME": "n1"}) as zt:
            await zt.wait_synced()
            await asyncio.sleep(0.2)
            assert nacked, "the NACKing waypoint got its clusters"
            for i in range(5):  # each pod change also rebuilds the waypoints' config
                t0 = time.monotonic()
                store.apply([(_pod(f"p{i}", f"127.0.9.{10 + i}"), "test")])
                await zt.wait_for(f"Kubernetes//Pod/demo/p{i}", timeout=2.0)
                assert time.monotonic() - t0 < 1.0
        assert sum(s.value for m in registry.collect() if m.name == "ambient_agent_xds_nacks"
                   for s in m.samples if s.name.endswith("_total")) >= 1
        clients = server.debug_state()["clients"]
        wp = [c for c in clients if c["proxy_type"] == "waypoint"]
        assert len(wp) == 2 and all(c["gateway"] == "demo/wp" for c in wp)
        nack_task.cancel()
        nacker.cancel()
        staller.cancel()
    finally:
        for ch in channels:
            await ch.close()
        await server.stop(0.2)
        index.stop()
