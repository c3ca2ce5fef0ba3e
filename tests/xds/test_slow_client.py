"""A client that keeps sending requests but never reads its responses (it grew the agent by
746 MB): the stream's inbox stays bounded, the client is held back by HTTP/2 flow control,
and after ``stall_timeout`` the stream is closed with RESOURCE_EXHAUSTED and counted in
``ambient_agent_xds_slow_clients_disconnected_total``; other clients are served meanwhile.

The slow client is a raw grpc.aio ADS stream (not our reference client, which always
reads); the well-behaved one is the reference delta client.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from prometheus_client import CollectorRegistry

from ambient.xds.client import DeltaXdsClient
from ambient.xds.generators import ADDRESS_TYPE
from ambient.xds.server import XdsServer
from ambient.xds.connection import MAX_QUEUED_BYTES, MAX_QUEUED_REQUESTS
from tests.xds.fake_index import FakeIndex, pod


def big_index(n: int = 4000) -> FakeIndex:
    idx = FakeIndex()
    idx.put(*(pod(f"p{i}", ip=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}",
                  services={f"default/svc{i % 50}.default.svc.cluster.local": (80, 8080)})
              for i in range(n)))
    return idx


def request(i: int) -> discovery_pb2.DeltaDiscoveryRequest:
    req = discovery_pb2.DeltaDiscoveryRequest(type_url=ADDRESS_TYPE)
    if i == 0:
        req.node.CopyFrom(base_pb2.Node(id="ztunnel~10.0.0.9~zt.istio-system~istio-system.svc."
                                        "cluster.local"))
    else:  # subscribes 250 unknown names (answered: removed, ~12 KB), then drops them
        names = [f"default/nothing-{j}.default.svc.cluster.local" for j in range(250)]
        (req.resource_names_subscribe if i % 2 else req.resource_names_unsubscribe).extend(names)
    return req


async def test_client_that_never_reads_is_bounded_then_disconnected():
    registry = CollectorRegistry()
    server = XdsServer(big_index(), address="127.0.0.1", port=0, debounce=0.005,
                       debounce_max=0.05, registry=registry, stall_timeout=1.5)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    good = DeltaXdsClient(f"127.0.0.1:{server.port}", metadata={"NODE_NAME": "node1"})
    try:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).DeltaAggregatedResources()
        sent, blocked = 0, None
        for i in range(20_000):  # never reads; writes stop completing once we push back
            write = asyncio.ensure_future(call.write(request(i)))
            done, _ = await asyncio.wait({write}, timeout=0.5)
            if not done:  # left pending: cancelling a client write cancels the call
                blocked = write
                break
            write.result()
            sent += 1
        assert blocked is not None, "the server kept taking requests from a client that never reads"
        conn = next(iter(server.connections.values()))
        assert conn.inbox.high_water <= MAX_QUEUED_REQUESTS
        assert conn.inbox.bytes <= MAX_QUEUED_BYTES

        # a well-behaved client is served while the slow one is held back
        await good.connect()
        await good.wait_synced(timeout=20)
        assert len(good.resources(ADDRESS_TYPE)) == 4000

        def slow_count() -> float:
            return registry.get_sample_value(
                "ambient_agent_xds_slow_clients_disconnected_total") or 0.0

        for _ in range(100):
            if slow_count() == 1 and len(server.connections) == 1:
                break
            await asyncio.sleep(0.05)
        assert slow_count() == 1 and len(server.connections) == 1  # only the good one left
        # reading now, the slow client finds what it was told
        status = None
        for _ in range(10_000):
            try:
                if await asyncio.wait_for(call.read(), 5) is grpc.aio.EOF:
                    break
            except grpc.aio.AioRpcError as e:
                status = e
                break
        assert status is not None and status.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "did not read its responses for 1.5s" in status.details()
        with contextlib.suppress(BaseException):
            await blocked  # failed with the call
    finally:
        await good.close()
        await channel.close()
        await server.stop(0.5)
