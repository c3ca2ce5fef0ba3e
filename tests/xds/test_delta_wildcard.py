"""Wildcard delta ADS over a real gRPC connection (``docs/xds.md``)."""

from __future__ import annotations

import asyncio

import pytest

from envoy.service.discovery.v3 import discovery_pb2

from ambient.xds.generators import ADDRESS_TYPE, AUTHORIZATION_TYPE, WORKLOAD_TYPE
from tests.xds.fake_index import pod, policy
from tests.helpers import eventually

POD_A = "Kubernetes//Pod/default/a"
POD_B = "Kubernetes//Pod/default/b"
SVC = "default/web.default.svc.cluster.local"


async def test_initial_wildcard_gets_everything_named_as_ztunnel_expects(connect):
    client = await connect()
    await client.wait_synced()
    assert set(client.resources(ADDRESS_TYPE)) == {POD_A, POD_B, SVC}
    assert client.resources(ADDRESS_TYPE)[POD_A].workload.uid == POD_A
    assert set(client.resources(AUTHORIZATION_TYPE)) == {"default/deny-9999"}
    assert all(v for v in client.versions[ADDRESS_TYPE].values())


async def test_first_request_answered_even_when_empty(connect, index):
    index.rebuild([], [])
    client = await connect()
    await client.wait_synced()
    assert [len(r.resources) for r in client.responses] == [0, 0]


async def test_one_changed_pod_sends_exactly_that_resource(connect, index):
    client = await connect()
    await client.wait_synced()
    n = len(client.responses)
    index.put(pod("a", ip="10.0.0.9"))
    resp = await client.next_response(ADDRESS_TYPE, after=n)
    assert [r.name for r in resp.resources] == [POD_A]
    assert list(resp.removed_resources) == []
    await asyncio.sleep(0.05)
    assert len(client.responses) == n + 1  # no WADS push for a pod change


async def test_ack_without_change_gets_no_response(connect):
    client = await connect()
    await client.wait_synced()
    await asyncio.sleep(0.05)  # the ACKs have gone out
    assert len(client.responses) == 2


async def test_removals_for_pod_service_and_policy(connect, index):
    client = await connect()
    await client.wait_synced()
    index.delete(POD_B)
    await client.wait_for(POD_B, present=False)
    assert POD_B in client.responses[-1].removed_resources
    index.delete(SVC)
    await client.wait_for(SVC, present=False)
    index.delete_policy("default/deny-9999")
    await client.wait_for("default/deny-9999", AUTHORIZATION_TYPE, present=False)
    assert list(client.responses[-1].removed_resources) == ["default/deny-9999"]


async def test_removals_after_full_rebuild(connect, index):
    client = await connect()
    await client.wait_synced()
    index.rebuild([pod("a", ip="10.0.0.1", services={SVC: (80, 8080)}), pod("c", ip="10.0.0.3")],
                  [policy("other")])
    await client.wait(lambda: set(client.resources()) == {POD_A, "Kubernetes//Pod/default/c"})
    await client.wait(lambda: set(client.resources(AUTHORIZATION_TYPE)) == {"default/other"})


async def test_burst_is_debounced_into_one_push(connect, index):
    client = await connect()
    await client.wait_synced()
    n = len(client.responses)
    for i in range(20):
        index.put(pod("b", ip=f"10.0.1.{i}", node="node2"))
    await client.wait(lambda: client.resources()[POD_B].workload.addresses[0] == bytes([10, 0, 1, 19]))
    await asyncio.sleep(0.05)
    assert len(client.responses) - n <= 2


async def test_reconnect_with_initial_resource_versions(connect, index):
    client = await connect()
    await client.wait_synced()
    await client.close()
    index.delete(POD_B)
    index.put(pod("c", ip="10.0.0.3"))
    n = len(client.responses)
    await client.reconnect()
    resp = await client.next_response(ADDRESS_TYPE, after=n)
    # unchanged pod a and the service are skipped; b is removed; c is new
    assert [r.name for r in resp.resources] == ["Kubernetes//Pod/default/c"]
    assert list(resp.removed_resources) == [POD_B]
    # a stale claimed version forces a resend
    await client.close()
    client.versions[ADDRESS_TYPE][POD_A] = "stale"
    n = len(client.responses)
    await client.reconnect()
    resp = await client.next_response(ADDRESS_TYPE, after=n)
    assert [r.name for r in resp.resources] == [POD_A]


async def test_nack_is_recorded_and_not_resent(connect, index, server):
    reject = {"Kubernetes//Pod/default/bad"}
    client = await connect(validator=lambda t, name, msg: "bad address" if name in reject else None)
    await client.wait_synced()
    n = len(client.responses)
    index.put(pod("bad", ip="10.0.0.66"), pod("good", ip="10.0.0.67"))
    await client.wait_for("Kubernetes//Pod/default/good")
    assert "Kubernetes//Pod/default/bad" not in client.resources()
    await eventually(lambda: server.debug_state()["clients"][0]["types"][ADDRESS_TYPE]["nacks"])
    await asyncio.sleep(0.05)
    assert len(client.responses) == n + 1  # not resent
    state = server.debug_state()["clients"][0]["types"][ADDRESS_TYPE]
    assert state["nacks"] == 1
    assert "Kubernetes//Pod/default/bad: bad address" in state["last_nacks"][0]["detail"]
    # a later change of the rejected resource is sent again (it is not held)
    reject.clear()
    index.put(pod("bad", ip="10.0.0.68"))
    await client.wait_for("Kubernetes//Pod/default/bad")


async def test_stale_nonce_is_ignored(connect, server):
    client = await connect()
    await client.wait_synced()
    n = len(client.responses)
    # a NACK with an old nonce and a new subscription: ignored entirely
    client.send(discovery_pb2.DeltaDiscoveryRequest(
        type_url=ADDRESS_TYPE, response_nonce="not-the-last-nonce",
        error_detail={"message": "x: y"}))
    await asyncio.sleep(0.05)
    assert len(client.responses) == n
    types = server.debug_state()["clients"][0]["types"][ADDRESS_TYPE]
    assert types["stale_nonces"] == 1 and types["nacks"] == 0


async def test_legacy_workload_type_omits_services(connect, index):
    client = await connect(types=[WORKLOAD_TYPE])
    await client.wait_synced()
    assert set(client.resources(WORKLOAD_TYPE)) == {POD_A, POD_B}
    index.delete(POD_A)
    await client.wait_for(POD_A, WORKLOAD_TYPE, present=False)


async def test_bad_type_url_closes_stream_with_clear_status(connect, server):
    import grpc
    client = await connect(types=["type.googleapis.com/envoy.config.cluster.v3.Cluster"])
    await client.wait(lambda: client.error is not None)
    assert client.error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "type_url=" in client.error.details()
    # the server keeps serving others
    other = await connect()
    await other.wait_synced()


async def test_missing_node_is_rejected(server):
    import grpc
    from envoy.service.discovery.v3 import ads_pb2_grpc
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(ch)
        call = stub.DeltaAggregatedResources(iter([discovery_pb2.DeltaDiscoveryRequest(
            type_url=ADDRESS_TYPE)]))
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "node.id" in e.details()
        else:
            raise AssertionError("expected INVALID_ARGUMENT")


async def test_debounce_is_one_timer_per_burst_and_waits_for_quiet():
    """istiod's debounce: a burst of changes arms one timer (it was cancelled and made
    again per change: CPU per change burst, issue 28) and fans out once, no sooner than
    ``debounce`` after the burst's last change; a change after that fan-out starts a
    new debounce."""
    import time

    from prometheus_client import CollectorRegistry

    from ambient.api import IndexChange
    from ambient.xds.server import XdsServer
    from tests.xds.fake_index import FakeIndex

    srv = XdsServer(FakeIndex(), port=0, debounce=0.3, debounce_max=30.0,
                    registry=CollectorRegistry())
    loop = asyncio.get_running_loop()
    armed, flushed = [], []
    real_call_later, real_flush = loop.call_later, srv._flush

    def call_later(delay, callback, *args, **kwargs):
        armed.append(callback)
        return real_call_later(delay, callback, *args, **kwargs)

    def flush():
        flushed.append(time.monotonic())
        real_flush()

    srv._flush = flush  # type: ignore[method-assign]
    loop.call_later = call_later  # type: ignore[method-assign]
    try:
        for i in range(100):
            srv.on_index_change(IndexChange(addresses_changed=frozenset({f"a{i}"})))
        last = time.monotonic()
        assert len(armed) == 1
        deadline = time.monotonic() + 30
        while not flushed and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert len(flushed) == 1 and flushed[0] >= last + 0.3 - 0.002, (flushed, last)
        assert srv._pending is None and srv._timer is None
        srv.on_index_change(IndexChange(addresses_changed=frozenset({"again"})))
        while len(flushed) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert len(flushed) == 2
    finally:
        loop.call_later = real_call_later  # type: ignore[method-assign]
        if srv._timer is not None:
            srv._timer.cancel()


async def test_debounce_rearms_for_the_rest_of_the_quiet_time():
    """A change while the timer runs moves the fan-out to ``debounce`` after it (the timer
    re-arms for the rest of the quiet time when it fires)."""
    import time

    from prometheus_client import CollectorRegistry

    from ambient.api import IndexChange
    from ambient.xds.server import XdsServer
    from tests.xds.fake_index import FakeIndex

    srv = XdsServer(FakeIndex(), port=0, debounce=0.4, debounce_max=30.0,
                    registry=CollectorRegistry())
    flushed: list[float] = []
    real_flush = srv._flush

    def flush():
        flushed.append(time.monotonic())
        real_flush()

    srv._flush = flush  # type: ignore[method-assign]
    try:
        srv.on_index_change(IndexChange(addresses_changed=frozenset({"a"})))
        await asyncio.sleep(0.2)
        srv.on_index_change(IndexChange(addresses_changed=frozenset({"b"})))
        second = time.monotonic()
        deadline = second + 30
        while not flushed and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if flushed and flushed[0] < second:  # the box stalled > 0.4 s before "b": no test
            pytest.skip("loop stalled past the quiet time before the second change")
        assert len(flushed) == 1 and flushed[0] >= second + 0.4 - 0.002, (flushed, second)
    finally:
        if srv._timer is not None:
            srv._timer.cancel()
