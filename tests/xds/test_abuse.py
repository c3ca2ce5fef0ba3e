"""Abusive xDS and SDS clients against the real in-process servers (grpc.aio over
loopback TCP / a Unix socket): oversized NACK details, streams cancelled by the client
mid-write, and a seeded-random fuzz of malformed requests. Every client here is a real
grpc.aio client speaking the ADS / SDS protocols the servers implement."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc

from agent.sds.server import SdsServer
from agent.sds.service import SECRET_TYPE
from ambient.xds.generators import ADDRESS_TYPE
from tests.sds.helpers import Stream, executor_runner, make_config, request, secrets_of

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
    first.node.id = NODE
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
    sds_stub = sds_pb2_grpc.SecretDiscoveryServiceStub(sds_channel)
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
    assert sds_server.cache.watchers == {}


# ---------------------------------------------------------------- seeded fuzz
SEED = 28


def _text(rng: random.Random, n: int) -> str:
    """``n`` random characters, any plane (protobuf strings carry any valid UTF-8)."""
    return "".join(chr(rng.choice((rng.randrange(32, 127), rng.randrange(0x80, 0xD800),
                                   rng.randrange(0xE000, 0x10FFFF)))) for _ in range(n))


def _names(rng: random.Random) -> list[str]:
    kind = rng.randrange(6)
    if kind == 0:
        return [f"default/nothing-{i}.default.svc.cluster.local"
                for i in range(rng.choice((200, 3000)))]
    if kind == 1:
        return ["g" * rng.choice((2000, 70_000))]  # giant name
    if kind == 2:
        return [_text(rng, rng.randrange(1, 40)) for _ in range(rng.randrange(1, 20))]
    if kind == 3:
        return ["*"]
    if kind == 4:
        return ["default", "ROOTCA", "Kubernetes//Pod/default/a", "10.0.0.1"]
    return []


def _type_url(rng: random.Random, good: str) -> str:
    return rng.choice((good, good, good, "", "type.googleapis.com/" + _text(rng, 8),
                       SECRET_TYPE if good != SECRET_TYPE else ADDRESS_TYPE, "x" * 5000))


def _common(rng: random.Random, req, good_type: str, first: bool) -> None:
    req.type_url = _type_url(rng, good_type)
    if first or rng.random() < 0.1:
        req.node.id = rng.choice((NODE, NODE, "", _text(rng, 30), "n" * 100_000))
        if rng.random() < 0.3:
            req.node.metadata.update({"NODE_NAME": rng.choice(("node1", _text(rng, 10)))})
    req.response_nonce = rng.choice(("", "", _text(rng, 12), "0-" + "f" * 12, "n" * 3000))
    if rng.random() < 0.25:
        req.error_detail.code = rng.randrange(0, 17)
        req.error_detail.message = rng.choice((_text(rng, 50), "e" * rng.choice((10_000, 300_000))))


def _sotw(rng: random.Random, good_type: str, first: bool) -> discovery_pb2.DiscoveryRequest:
    req = discovery_pb2.DiscoveryRequest(resource_names=_names(rng),
                                         version_info=rng.choice(("", "1", _text(rng, 20))))
    _common(rng, req, good_type, first)
    return req


def _delta(rng: random.Random, good_type: str, first: bool
           ) -> discovery_pb2.DeltaDiscoveryRequest:
    req = discovery_pb2.DeltaDiscoveryRequest(resource_names_subscribe=_names(rng),
                                              resource_names_unsubscribe=_names(rng))
    if rng.random() < 0.2:
        req.initial_resource_versions.update({n: _text(rng, 5) for n in _names(rng)})
    _common(rng, req, good_type, first)
    return req


async def _fuzz_stream(rng: random.Random, call, make, good_type: str, count: int) -> int:
    """Write ``count`` fuzzed requests on ``call`` (never read), then cancel it. Returns
    the number written before the server ended the stream."""
    sent = 0
    try:
        for i in range(count):
            await asyncio.wait_for(call.write(make(rng, good_type, i == 0)), 5)
            sent += 1
            if rng.random() < 0.3:
                await asyncio.sleep(0)
    except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError,
            asyncio.TimeoutError):
        pass  # the server refused an earlier request and closed the stream: expected
    finally:
        call.cancel()
    return sent


async def _raw_bytes_stream(rng: random.Random, channel: grpc.aio.Channel, method: str) -> None:
    """Random bytes as whole request messages (what a broken or hostile peer sends)."""
    call = channel.stream_stream(method, request_serializer=None,
                                 response_deserializer=None)()
    try:
        for _ in range(3):
            await asyncio.wait_for(call.write(rng.randbytes(rng.randrange(1, 400))), 5)
    except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError,
            asyncio.TimeoutError):
        pass
    finally:
        call.cancel()


async def test_seeded_fuzz_leaves_servers_serving_quiet_and_empty(server, sds, connect,
                                                                  caplog):
    """~1,100 malformed ADS (delta and SotW) and SDS (StreamSecrets, DeltaSecrets)
    requests from ``random.Random(SEED)``: wrong type URLs, huge and giant names, bogus
    nonces, NACKs with long details, unsubscribes of unknown names, random bytes. After
    it: nothing logged with a traceback, no log line over a few KB, every stream's state
    dropped, and well-behaved clients are still served."""
    caplog.set_level(logging.INFO)
    rng = random.Random(SEED)
    sds_server, sds_channel = sds
    sds_stub = sds_pb2_grpc.SecretDiscoveryServiceStub(sds_channel)
    written = 0
    async with grpc.aio.insecure_channel(
            f"127.0.0.1:{server.port}",
            options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        ads = ads_pb2_grpc.AggregatedDiscoveryServiceStub(ch)
        for i in range(70):
            written += await _fuzz_stream(rng, ads.DeltaAggregatedResources(), _delta,
                                          ADDRESS_TYPE, 4)
            written += await _fuzz_stream(rng, ads.StreamAggregatedResources(), _sotw,
                                          ADDRESS_TYPE, 4)
            written += await _fuzz_stream(rng, sds_stub.StreamSecrets(), _sotw, SECRET_TYPE, 4)
            written += await _fuzz_stream(rng, sds_stub.DeltaSecrets(), _delta, SECRET_TYPE, 4)
            if i % 10 == 0:
                await _raw_bytes_stream(rng, ch, ADS_DELTA)
                await _raw_bytes_stream(rng, sds_channel, SDS_STREAM)
        for _ in range(200):
            if not server.connections and not sds_server.service.connections:
                break
            await asyncio.sleep(0.05)
    assert written > 300, written  # many requests reached the servers, not only the first
    bad = _tracebacks(caplog)
    assert not bad, [(r.name, r.getMessage()[:300]) for r in bad]
    long = [(r.name, r.getMessage()[:150]) for r in caplog.records if len(r.getMessage()) >= 4096]
    assert not long, long
    assert server.connections == {}
    assert sds_server.service.connections == {}
    assert sds_server.cache.watchers == {}  # every stream's identity watch released

    good = await connect()
    await good.wait_synced(timeout=10)
    assert good.resources(ADDRESS_TYPE)
    st = Stream(sds_channel)
    await st.send(request(["default"]))
    assert secrets_of(await st.recv())["default"].tls_certificate.certificate_chain
    st.cancel()


ADS_DELTA = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources"
SDS_STREAM = "/envoy.service.secret.v3.SecretDiscoveryService/StreamSecrets"


# ---------------------------------------------------------------- the caps, one by one
async def _refused(call, req) -> grpc.aio.AioRpcError:
    await call.write(req)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        while True:
            await asyncio.wait_for(call.read(), 10)
    call.cancel()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    return e.value


async def test_xds_caps_refuse_naming_the_field_and_the_cap(server, monkeypatch):
    from ambient.xds import stream
    node = base_pb2.Node(id=NODE)
    async with grpc.aio.insecure_channel(
            f"127.0.0.1:{server.port}",
            options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        ads = ads_pb2_grpc.AggregatedDiscoveryServiceStub(ch)
        many = [f"n{i}" for i in range(stream.MAX_NAMES_PER_REQUEST + 1)]
        e = await _refused(ads.DeltaAggregatedResources(), discovery_pb2.DeltaDiscoveryRequest(
            type_url=ADDRESS_TYPE, node=node, resource_names_subscribe=many))
        assert "resource_names_subscribe" in e.details()
        assert f"at most {stream.MAX_NAMES_PER_REQUEST} names per request" in e.details()
        e = await _refused(ads.StreamAggregatedResources(), discovery_pb2.DiscoveryRequest(
            type_url=ADDRESS_TYPE, node=node, resource_names=["g" * 5000]))
        assert "resource_names" in e.details() and "MAX_NAME_LENGTH" in e.details()
        assert len(e.details()) < 400
        e = await _refused(ads.StreamAggregatedResources(), discovery_pb2.DiscoveryRequest(
            type_url=ADDRESS_TYPE, node=base_pb2.Node(id="n" * 5000)))
        assert e.details().startswith("node.id=") and "MAX_NODE_ID_LENGTH" in e.details()

        # names subscribed one request at a time add up to the per-stream cap
        monkeypatch.setattr(stream, "MAX_NAMES_PER_STREAM", 400)
        call = ads.DeltaAggregatedResources()
        await call.write(discovery_pb2.DeltaDiscoveryRequest(
            type_url=ADDRESS_TYPE, node=node, resource_names_subscribe=["10.0.0.1"]))
        await asyncio.wait_for(call.read(), 5)
        for batch in range(2):
            await call.write(discovery_pb2.DeltaDiscoveryRequest(
                type_url=ADDRESS_TYPE, resource_names_subscribe=[
                    f"default/u{batch}-{i}.default.svc.cluster.local" for i in range(150)]))
            await asyncio.wait_for(call.read(), 5)
        e = await _refused(call, discovery_pb2.DeltaDiscoveryRequest(
            type_url=ADDRESS_TYPE, resource_names_subscribe=[
                f"default/last-{i}.svc.cluster.local" for i in range(150)]))
        assert "<451 names" in e.details()
        assert "at most 400 subscribed names per type on a stream" in e.details()
    for _ in range(100):
        if not server.connections:
            break
        await asyncio.sleep(0.02)
    assert server.connections == {}


async def test_sds_caps_refuse_naming_the_field_and_the_cap(sds):
    from agent.sds.service import MAX_NAME_LENGTH, MAX_NODE_ID_LENGTH
    server, channel = sds
    stub = sds_pb2_grpc.SecretDiscoveryServiceStub(channel)
    e = await _refused(stub.StreamSecrets(), request(["g" * (MAX_NAME_LENGTH + 1)]))
    assert "MAX_NAME_LENGTH" in e.details() and len(e.details()) < 400
    e = await _refused(stub.StreamSecrets(), request(["default"], node="n" * 5000))
    assert "node.id: 5000 characters" in e.details() and str(MAX_NODE_ID_LENGTH) in e.details()


@pytest.mark.parametrize("method,size", [("DeltaAggregatedResources", 3000),
                                         ("StreamAggregatedResources", 3000),
                                         ("DeltaAggregatedResources", 8 * MB)])
async def test_xds_garbage_request_ends_invalid_argument_logged_once(server, caplog, method,
                                                                     size):
    """A message that is not the stream's protobuf (0x0f: field 1 with the invalid wire
    type 7) ends the stream INVALID_ARGUMENT naming it, with one short warning; it used to
    end with status OK and nothing logged."""
    caplog.set_level(logging.WARNING)
    async with grpc.aio.insecure_channel(
            f"127.0.0.1:{server.port}",
            options=[("grpc.max_send_message_length", 16 * MB)]) as ch:
        call = ch.stream_stream(
            f"/envoy.service.discovery.v3.AggregatedDiscoveryService/{method}",
            request_serializer=None, response_deserializer=None)()
        with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
            await asyncio.wait_for(call.write(b"\x0f" * size), 30)
        code = await asyncio.wait_for(call.code(), 30)
        details = await call.details()
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert f"({size} bytes)" in details and "is not a valid" in details
    lines = [r for r in caplog.records if "is not a valid" in r.getMessage()]
    assert len(lines) == 1 and len(lines[0].getMessage()) < 1024
    assert not _tracebacks(caplog)
