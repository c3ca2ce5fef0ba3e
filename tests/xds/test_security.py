"""mTLS listener (identity from the peer certificate's SPIFFE URI SAN) and bearer tokens."""

from __future__ import annotations

import logging

import grpc
import pytest
from prometheus_client import CollectorRegistry

from agent.core.logsetup import redact
from ambient.xds.client import ClientTls, DeltaXdsClient
from agent.tlsport.servercert import TlsMaterial
from ambient.xds.server import XdsServer
from tests.xds.certs import Pki

ZTUNNEL_ID = "spiffe://cluster.local/ns/istio-system/sa/ztunnel"


@pytest.fixture
async def tls_server(index):
    pki = Pki()
    cert, key = pki.leaf("spiffe://cluster.local/ns/istio-system/sa/ambient-agent",
                         dns=["istiod.istio-system.svc"])
    calls = []

    async def provider():
        calls.append(1)
        return TlsMaterial(cert, key, pki.root_pem)

    srv = XdsServer(index, port=0, tls_address="127.0.0.1", tls_port=0, tls_provider=provider,
                    debounce=0.005, registry=CollectorRegistry())
    await srv.start()
    try:
        yield srv, pki
    finally:
        await srv.stop(0.5)


async def _client(srv, pki, spiffe_id, node_id=None):
    cert, key = pki.leaf(spiffe_id)
    kwargs = {"node_id": node_id} if node_id else {}
    return await DeltaXdsClient(
        f"127.0.0.1:{srv.tls_port}", tls=ClientTls(pki.root_pem, cert, key,
                                                   server_name="istiod.istio-system.svc"),
        **kwargs).connect()


async def test_mtls_caller_identity_comes_from_spiffe_san(tls_server):
    srv, pki = tls_server
    client = await _client(srv, pki, ZTUNNEL_ID)
    try:
        await client.wait_synced()
        assert len(client.resources()) == 3
        clients = srv.debug_state()["clients"]
        assert [c["identity"] for c in clients] == [ZTUNNEL_ID]
        assert clients[0]["proxy_type"] == "ztunnel"
    finally:
        await client.close()


async def test_mtls_rejects_client_from_another_root(tls_server):
    srv, _ = tls_server
    client = await _client(srv, Pki("rogue root"), ZTUNNEL_ID)
    try:
        with pytest.raises(grpc.RpcError):
            await client.wait_synced(timeout=5)
    finally:
        await client.close()


async def test_mtls_identity_namespace_must_match_node(tls_server):
    srv, pki = tls_server
    client = await _client(srv, pki, "spiffe://cluster.local/ns/other/sa/x")  # node ns istio-system
    try:
        with pytest.raises(grpc.RpcError) as e:
            await client.wait_synced()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "does not match the caller identity" in e.value.details()
    finally:
        await client.close()


async def test_mtls_requires_spiffe_san(tls_server):
    srv, pki = tls_server
    client = await _client(srv, pki, None)
    try:
        with pytest.raises(grpc.RpcError) as e:
            await client.wait_synced()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await client.close()


async def test_bearer_token(index, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    srv = XdsServer(index, port=0, token_file=str(token), registry=CollectorRegistry())
    await srv.start()
    clients = []
    try:
        good = DeltaXdsClient(f"127.0.0.1:{srv.port}", token="s3cret")
        clients.append(await good.connect())
        await good.wait_synced()
        for bad_token in (None, "wrong"):
            bad = DeltaXdsClient(f"127.0.0.1:{srv.port}", token=bad_token)
            clients.append(await bad.connect())
            with pytest.raises(grpc.RpcError) as e:
                await bad.wait_synced()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "s3cret" not in e.value.details()
            # the log redaction leaves the refusal readable (it was "authorization:
            # [REDACTED] or wrong bearer [REDACTED]")
            assert redact(e.value.details()) == e.value.details(), e.value.details()
            assert "xds_token_file" in e.value.details()
    finally:
        for c in clients:
            await c.close()
        await srv.stop(0.5)


async def test_cli_against_the_tls_port_says_what_is_missing(tls_server, tmp_path, caplog):
    """``xds dump`` at the TLS port without ``--ca`` (UNAVAILABLE "Socket closed") or with
    it but no credentials (the client may see INTERNAL) names the likely cause; the
    agent's refusal names the client's TCP address, not the front door's socket."""
    import logging

    from tests.xds.test_cli_dump_as_written import _dump

    srv, pki = tls_server
    caplog.set_level(logging.WARNING, logger="ambient.xds.server")
    addr = f"127.0.0.1:{srv.tls_port}"
    rc, out, err = await _dump("--addr", addr, "--timeout", "10")
    assert rc == 1 and out == "" and "pass --ca <mesh root PEM>" in err, err
    assert len(err.strip().splitlines()) == 1, err
    ca = tmp_path / "root.pem"
    ca.write_bytes(pki.root_pem)
    rc, out, err = await _dump("--addr", addr, "--ca", str(ca), "--server-name",
                               "istiod.istio-system.svc", "--timeout", "10")
    assert rc == 1 and out == "" and "--token-file" in err and "--cert/--key" in err, err
    refused = [r.getMessage() for r in caplog.records if "xds: refused" in r.getMessage()]
    assert refused and all(m.startswith("xds: refused ipv4:127.0.0.1:") for m in refused), \
        refused


async def test_xds_refusals_are_rate_limited_per_source(index, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="ambient.xds.server")
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    srv = XdsServer(index, port=0, token_file=str(token), registry=CollectorRegistry())
    await srv.start()
    try:
        for bad_token in (None, "wrong", "wrong", None):
            bad = DeltaXdsClient(f"127.0.0.1:{srv.port}", token=bad_token)
            await bad.connect()
            try:
                with pytest.raises(grpc.RpcError) as e:
                    await bad.wait_synced()
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert e.value.details()
            finally:
                await bad.close()
    finally:
        await srv.stop(0.5)
    refused = [r.getMessage() for r in caplog.records if "xds: refused" in r.getMessage()]
    assert len(refused) == 1 and refused[0].startswith("xds: refused ipv4:127.0.0.1:"), refused
