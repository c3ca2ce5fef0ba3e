"""Bytes that are not the method's protobuf, sent to the CA's ``CreateCertificate`` and to
the SDS methods: the call ends ``INVALID_ARGUMENT`` naming the message type and size, with
one short WARNING and no traceback. grpcio's own deserializer wrapper logs an ERROR with a
``DecodeError`` traceback for every such message and ends the call ``UNKNOWN`` (unary) or
hands the handler ``None`` (streams); a client can fill the log that way without a token,
since decoding runs before the handler authenticates anyone."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from agent.sds.ca_server import CertificateService
from tests.sds.helpers import executor_runner, make_config
from agent.sds.server import SdsServer

GARBAGE = b"\x0f" * 300  # field 1 with the invalid wire type 7


def _tracebacks(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.exc_info]


def _assert_refused_once(caplog, code, details, type_name: str) -> None:
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert f"not a valid {type_name} ({len(GARBAGE)} bytes)" in details, details
    lines = [r for r in caplog.records if "is not a valid" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING, lines
    assert len(lines[0].getMessage()) < 1024
    assert not _tracebacks(caplog), _tracebacks(caplog)


async def test_create_certificate_garbage_is_invalid_argument_without_traceback(caplog):
    """As the xDS plaintext port serves it (no authenticator: every decodable request would
    be UNAUTHENTICATED; the garbage never gets that far)."""
    caplog.set_level(logging.INFO)
    server = grpc.aio.server()
    CertificateService(None, None, "cluster.local", None, []).add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = ch.unary_unary("/istio.v1.auth.IstioCertificateService/CreateCertificate",
                                  request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await asyncio.wait_for(call(GARBAGE), 10)
            _assert_refused_once(caplog, e.value.code(), e.value.details(),
                                 "IstioCertificateRequest")
            # the server still answers a well-formed request (refused: no authenticator)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await asyncio.wait_for(call(b""), 10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await server.stop(0)


@pytest.fixture
async def sds(state_dir):
    run = executor_runner()
    server = SdsServer(make_config(state_dir, ecc_signature_algorithm="ECDSA",
                                   service_account="cart", pod_namespace="shop"), run)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0.2)
        run.pool.shutdown(wait=False)


@pytest.mark.parametrize("method,kind,type_name", [
    ("StreamSecrets", "stream", "DiscoveryRequest"),
    ("DeltaSecrets", "stream", "DeltaDiscoveryRequest"),
    ("FetchSecrets", "unary", "DiscoveryRequest")])
async def test_sds_garbage_is_invalid_argument_without_traceback(sds, caplog, method, kind,
                                                                 type_name):
    caplog.set_level(logging.INFO)
    path = f"/envoy.service.secret.v3.SecretDiscoveryService/{method}"
    async with grpc.aio.insecure_channel("unix:" + sds.config.sds_socket) as ch:
        if kind == "unary":
            call = ch.unary_unary(path, request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await asyncio.wait_for(call(GARBAGE), 10)
            code, details = e.value.code(), e.value.details()
        else:
            stream = ch.stream_stream(path, request_serializer=None,
                                      response_deserializer=None)()
            await stream.write(GARBAGE)
            code = await asyncio.wait_for(stream.code(), 10)
            details = await stream.details()
    _assert_refused_once(caplog, code, details, type_name)
