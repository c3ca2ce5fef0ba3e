"""ztunnel's CA client (reproduced from ztunnel's source, :mod:`tests.ztunnel_exact.ca`)
against the embedded CA served on the xDS TLS port (ztunnel's default ``CA_ADDRESS``):
node-proxy impersonation with a token, refusals that name why, and CA calls that keep
working after the agent has run 25 hours (an injected clock drives the agent's CA and
certificate renewal, and ztunnel's certificate verifier)."""

from __future__ import annotations

import os
import stat

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from tests.ztunnel_exact.ca import ZtunnelCaClient
from tests.ztunnel_exact.conftest import LEDGER_ID, ZTUNNEL_TOKEN, FakeClock
from tests.ztunnel_exact.tls import VerifyError, verify_server


def ca_client(agent, token=ZTUNNEL_TOKEN, now=None, port=None) -> ZtunnelCaClient:
    return ZtunnelCaClient(f"https://localhost:{port or agent.xds.tls_port}", agent.root_pem,
                           token=token, now=now)


async def test_ca_on_the_xds_port_impersonates_pods_of_this_node(make_agent):
    agent = await make_agent()
    client = await ca_client(agent).start()
    try:
        cert = await client.fetch_certificate(LEDGER_ID)
        assert cert.identity == LEDGER_ID
        root = x509.load_pem_x509_certificate(agent.root_pem)
        assert cert.chain and cert.chain[-1] == root
        assert (cert.leaf.not_valid_after_utc - cert.leaf.not_valid_before_utc).total_seconds() \
            == 24 * 3600 + 120  # SECRET_TTL 24 h, NotBefore backdated 2 min
        # a pod of another node: the node proxy may not act for it
        with pytest.raises(grpc.RpcError) as e:
            await client.fetch_certificate("spiffe://cluster.local/ns/bank/sa/far")
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "impersonation" in e.value.details()
        assert agent.sds.debug_state()["ca_issued"] == 1
    finally:
        await client.close()


async def test_ca_without_token_is_refused_naming_why(make_agent):
    agent = await make_agent()
    client = await ca_client(agent, token=None).start()
    try:
        with pytest.raises(grpc.RpcError) as e:
            await client.fetch_certificate(LEDGER_ID)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert e.value.details() == ("request authenticate failure: no client certificate and "
                                     "no 'authorization: Bearer' token")
    finally:
        await client.close()


async def test_mesh_root_is_published_world_readable(make_agent):
    agent = await make_agent()
    path = agent.ctx.config.mesh_root_file
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o755
    assert x509.load_pem_x509_certificate(agent.root_pem) == agent.sds.embedded.cert


async def test_separate_ca_port_still_works(make_agent):
    from agent.demo.envoy import free_port

    agent = await make_agent(ca_port=free_port(), ca_listen_address="127.0.0.1")
    client = await ca_client(agent, port=agent.sds.ca_port).start()
    try:
        assert (await client.fetch_certificate(LEDGER_ID)).identity == LEDGER_ID
        [conn] = client.tunnel.connections
        assert (conn.version, conn.alpn) == ("TLSv1.3", "h2")
    finally:
        await client.close()


async def test_ca_calls_succeed_after_the_agent_ran_25_hours(make_agent):
    """The agent and ztunnel share a fake wall clock. Each hour ztunnel opens a fresh
    connection (hyper drops idle pooled connections after 90 s; ztunnel renews every
    ~12 h), verifies the server certificate at that time, and asks for a certificate.
    Without renewal the first server certificate (24 h) is expired at hour 25: shown by
    verifying it at that time."""
    clock = FakeClock()
    agent = await make_agent(clock=clock)
    start = clock()
    first = agent.xds.certificate.material
    first_der = x509.load_pem_x509_certificate(first.cert_chain_pem).public_bytes(
        serialization.Encoding.DER)
    for hour in range(26):
        client = await ca_client(agent, now=clock).start()
        try:
            cert = await client.fetch_certificate(LEDGER_ID)
        finally:
            await client.close()
        assert [c.error for c in client.tunnel.connections] == [""], f"hour {hour}"
        assert cert.leaf.not_valid_before_utc.timestamp() <= clock() \
            < cert.leaf.not_valid_after_utc.timestamp()
        clock.advance(3600)
    clock.advance(-3600)
    assert clock() - start == 25 * 3600
    served = agent.xds.certificate
    assert served.renewals >= 2 and served.material.not_after > clock()
    with pytest.raises(VerifyError, match="(?i)expired|not valid|validity"):
        verify_server(first_der, agent.root_pem, "localhost", None, clock())


async def test_short_ttl_requests_get_the_floor_and_no_renewal_storm(make_agent):
    """Issue 26: a ztunnel asking 60 s certificates got ~23,000 in 30 s (its refresh, at half
    of [NotBefore, NotAfter], was due at once: NotBefore is backdated 2 minutes). The CA
    raises such requests to 10 minutes; a client renewing as ztunnel does (at the midpoint
    of the certificate it holds) asks once per ~4 simulated minutes, counted here."""
    clock = FakeClock()
    agent = await make_agent(clock=clock)
    client = ZtunnelCaClient(f"https://localhost:{agent.xds.tls_port}", agent.root_pem,
                             token=ZTUNNEL_TOKEN, secret_ttl=60, now=clock)
    await client.start()
    try:
        fetched = 0
        end = clock.now + 3600
        cert = None
        while clock.now < end:
            if cert is None or clock.now >= (cert.leaf.not_valid_before_utc.timestamp() + (
                    cert.leaf.not_valid_after_utc - cert.leaf.not_valid_before_utc
            ).total_seconds() / 2):
                cert = await client.fetch_certificate(LEDGER_ID)
                fetched += 1
                span = (cert.leaf.not_valid_after_utc - cert.leaf.not_valid_before_utc)
                assert span.total_seconds() == 600 + 120
            clock.advance(10)
        assert fetched <= 3600 / 240 + 1, fetched
    finally:
        await client.close()
