"""Refused CA calls (xDS: tests/xds/test_security.py) are logged once per source per
minute (the count of the rest on the next line); the gRPC status names the reason every
time. docs/operating.md."""

from __future__ import annotations

import logging

import grpc
import pytest

from agent.core.lifecycle import AgentContext
from agent.core.ratelimit import RefusalLog, source_of
from agent.demo.envoy import free_port
from agent.sds import ca_pb2, ca_pb2_grpc
from agent.sds.server import build
from agent.tlsport import authn
from tests.sds.helpers import make_config

TOKEN = "tok-7d1e-secret-value"


def test_source_of_strips_the_port():
    assert source_of("ipv4:10.0.0.1:5678") == "10.0.0.1"
    assert source_of("ipv6:[fd00::1]:5678") == "fd00::1"
    assert source_of("unix:/run/x.sock") == "unix:/run/x.sock"


def test_refusal_log_counts_what_it_held_back(caplog):
    caplog.set_level(logging.WARNING)
    now = [100.0]
    rl = RefusalLog(logging.getLogger("tests.refusal"), "xds", window=60, clock=lambda: now[0])
    for port in range(5):
        rl.refused(f"ipv4:10.0.0.1:{4000 + port}", "bad token")
    rl.refused("ipv4:10.0.0.2:1", "bad token")
    now[0] += 61
    rl.refused("ipv4:10.0.0.1:9999", "bad token")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["xds: refused ipv4:10.0.0.1:4000: bad token",
                     "xds: refused ipv4:10.0.0.2:1: bad token",
                     "xds: refused ipv4:10.0.0.1:9999: bad token (4 more refused from "
                     "10.0.0.1 in the last 60s, not logged)"]


async def test_ca_refusals_are_rate_limited_per_source(state_dir, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="agent.sds.ca_server")
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(f"{TOKEN}: shop/cart\n")
    tokens.chmod(0o600)
    ctx = AgentContext(make_config(state_dir, service_account="cart", pod_namespace="shop",
                                   ca_port=free_port(), ca_listen_address="127.0.0.1",
                                   tokens_file=str(tokens), ecc_signature_algorithm="ECDSA"))
    authenticator = ctx.add(authn.build(ctx)).authenticator
    ca_agent = ctx.add(build(ctx, None, authenticator))
    await ca_agent.start()
    try:
        creds = grpc.ssl_channel_credentials(ca_agent.root_pem())
        for attempt, metadata in enumerate([[("authorization", "Bearer wrong")], []] * 3):
            async with grpc.aio.secure_channel(
                    f"127.0.0.1:{ca_agent.ca_port}", creds,
                    options=[("grpc.ssl_target_name_override",
                              "istiod.istio-system.svc")]) as ch:
                with pytest.raises(grpc.RpcError) as e:
                    await ca_pb2_grpc.IstioCertificateServiceStub(ch).CreateCertificate(
                        ca_pb2.IstioCertificateRequest(csr="x"), metadata=metadata,
                        timeout=30)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, attempt
            assert "request authenticate failure" in e.value.details()
            assert ("not in tokens_file" if metadata else "no client certificate") in \
                e.value.details()
    finally:
        await ca_agent.stop(0.5)
        ctx.executor.shutdown(wait=False)
    refused = [r.getMessage() for r in caplog.records if "CA: refused" in r.getMessage()]
    assert len(refused) == 1 and refused[0].startswith("CA: refused ipv4:127.0.0.1:"), refused
    assert TOKEN not in caplog.text and "wrong" not in refused[0].split(": ", 2)[1]
