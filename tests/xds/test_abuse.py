"""Abusive xDS and SDS clients against the real in-process servers (grpc.aio over
loopback TCP / a Unix socket): oversized NACK details, streams cancelled by the client
mid-write, and a seeded-random fuzz of malformed requests. Every client here is a real
grpc.aio client speaking the ADS / SDS protocols the servers implement."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from agent.sds.server import SdsServer
from ambient.xds.generators import ADDRESS_TYPE
from tests.sds.helpers import Stream, executor_runner, make_config, request

NODE = "sidecar~10.0.0.5~app.default~default.svc.cluster.local"
MB = 1 << 20


@pytest.fixture
async def sds(state_dir):
    run = executor_runner()
    cfg = make_config(state_dir, ecc_signature_algorithm="ECDSA", service_account="cart",
                      pod_namespace="shop")
    server = SdsServer(cfg, run)
    await server.start()
    channel = grpc.aio.insecure_channel("unix:" + server.config.sds_socket)
    try:
        yield server, channel
    finally:
        await channel.close()
        await server.stop(0.2)
        run.pool.shutdown(wait=False)


def _longest(caplog, level=logging.WARNING) -> int:
    return max((len(r.getMessage()) for r in caplog.records if r.levelno >= level), default=0)


def _tracebacks(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING and r.exc_info]


async def test_sds_nack_with_a_megabyte_detail_logs_one_short_line(sds, caplog):
    server, channel = sds
    caplog.set_level(logging.WARNING)
    st = Stream(channel)
    await st.send(request(["default"]))
    r = await st.recv()
    await st.send(request(["default"], nonce=r.nonce, node="", error="x" * MB))
    assert await st.silent(0.3)
    delta = Stream(channel, "DeltaSecrets")
    first = discovery_pb2.DeltaDiscoveryRequest(resource_names_subscribe=["default"])
    first.node.id = "n" * MB
    await delta.send(first)
    d = await delta.recv()
    nack = discovery_pb2.DeltaDiscoveryRequest(response_nonce=d.nonce)
    nack.error_detail.message = "y" * MB
    await delta.send(nack)
    assert await delta.silent(0.3)
    nacks = [r for r in caplog.records if "NACK" in r.getMessage()]
    assert len(nacks) == 2, [r.getMessage()[:200] for r in caplog.records]
    assert all(len(r.getMessage()) < 2048 for r in nacks), [len(r.getMessage()) for r in nacks]
    assert "more characters" in nacks[0].getMessage()
    assert all(len(s["last_nack"] or "") < 1024 for s in server.debug_state()["streams"])
    st.cancel()
    delta.cancel()


async def test_xds_nack_with_a_megabyte_detail_logs_one_short_line(server, caplog):
    caplog.set_level(logging.WARNING)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(ch)
        call = stub.StreamAggregatedResources()
        node = base_pb2.Node(id=NODE)
        await call.write(discovery_pb2.DiscoveryRequest(type_url=ADDRESS_TYPE, node=node))
        first = await asyncio.wait_for(call.read(), 5)
        nack = discovery_pb2.DiscoveryRequest(type_url=ADDRESS_TYPE, response_nonce=first.nonce,
                                              version_info=first.version_info)
        nack.error_detail.message = "z" * MB
        await call.write(nack)
        delta = stub.DeltaAggregatedResources()
        await delta.write(discovery_pb2.DeltaDiscoveryRequest(type_url=ADDRESS_TYPE, node=node,
                                                              resource_names_subscribe=["*"]))
        d = await asyncio.wait_for(delta.read(), 5)
        dn = discovery_pb2.DeltaDiscoveryRequest(type_url=ADDRESS_TYPE, response_nonce=d.nonce)
        dn.error_detail.message = "w" * MB
        await delta.write(dn)
        for _ in range(100):
            if sum("NACKed" in r.getMessage() for r in caplog.records) >= 2:
                break
            await asyncio.sleep(0.02)
        call.cancel()
        delta.cancel()
    nacks = [r for r in caplog.records if "NACKed" in r.getMessage()]
    assert len(nacks) == 2
    assert all(len(r.getMessage()) < 1024 for r in nacks), [len(r.getMessage()) for r in nacks]


async def _cancel_storm(open_call, first_request, n: int = 60) -> None:
    """Open ``n`` streams; each sends ``first_request`` then is cancelled by the client
    at once (or after one yield), while the server is writing its answer."""
    for i in range(n):
        call = open_call()
        await call.write(first_request)
        if i % 2:
            await asyncio.sleep(0)
        call.cancel()
    await asyncio.sleep(0.5)


async def test_client_cancelled_streams_end_without_tracebacks(server, sds, caplog):
    """A client cancelling mid-stream (ztunnel restarting, Envoy draining) ends that
    stream quietly: the server's pending write fails and that is the end of the stream."""
    caplog.set_level(logging.DEBUG)
    sds_server, sds_channel = sds
    node = base_pb2.Node(id=NODE)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(ch)
        await _cancel_storm(stub.StreamAggregatedResources,
                            discovery_pb2.DiscoveryRequest(type_url=ADDRESS_TYPE, node=node))
        await _cancel_storm(stub.DeltaAggregatedResources, discovery_pb2.DeltaDiscoveryRequest(
            type_url=ADDRESS_TYPE, node=node, resource_names_subscribe=["*"]))
    sds_stub = __import__("envoy.service.secret.v3.sds_pb2_grpc",
                          fromlist=["x"]).SecretDiscoveryServiceStub(sds_channel)
    await _cancel_storm(sds_stub.StreamSecrets, request(["default", "ROOTCA"]), 30)
    first = discovery_pb2.DeltaDiscoveryRequest(resource_names_subscribe=["default"])
    first.node.id = NODE
    await _cancel_storm(sds_stub.DeltaSecrets, first, 30)
    for _ in range(100):
        if not server.connections and not sds_server.service.connections:
            break
        await asyncio.sleep(0.05)
    bad = _tracebacks(caplog)
    assert not bad, [(r.name, r.getMessage()[:300]) for r in bad]
    assert not server.connections
    assert not sds_server.service.connections
