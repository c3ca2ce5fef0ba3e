"""Fixtures: a real grpc.aio xDS server on a kernel-chosen loopback port over the
in-memory FakeIndex, and reference clients connected to it (closed after the test)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from ambient.xds.client import DeltaXdsClient
from ambient.xds.server import XdsServer
from tests.xds.fake_index import FakeIndex, policy, pod, service


@pytest.fixture
def index():
    idx = FakeIndex()
    idx.put(pod("a", ip="10.0.0.1", services={"default/web.default.svc.cluster.local": (80, 8080)}),
            pod("b", ip="10.0.0.2", node="node2"),
            service("web", vip="10.96.0.10"))
    idx.put_policy(policy("deny-9999"))
    return idx


@pytest.fixture
async def server(index):
    srv = XdsServer(index, address="127.0.0.1", port=0, debounce=0.005, debounce_max=0.05,
                    registry=CollectorRegistry())
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop(0.5)


@pytest.fixture
async def connect(server):
    clients = []

    async def make(**kwargs) -> DeltaXdsClient:
        kwargs.setdefault("metadata", {"NODE_NAME": "node1"})
        client = DeltaXdsClient(f"127.0.0.1:{server.port}", **kwargs)
        clients.append(client)
        await client.connect()
        return client

    try:
        yield make
    finally:
        for c in clients:
            await c.close()
