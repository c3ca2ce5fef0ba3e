"""ztunnel's xDS client (reproduced from ztunnel's source, :mod:`tests.ztunnel_exact.xds`)
against the agent's TLS port: served with a token and no client certificate, refused
without one (UNAUTHENTICATED naming why), TLS as ztunnel negotiates it, the server
certificate names ztunnel accepts, and on-demand lookups that wake ztunnel's waiter."""

from __future__ import annotations

import grpc
import pytest

from tests.ztunnel_exact.conftest import NODE, ZTUNNEL_TOKEN
from tests.ztunnel_exact.tls import ControlPlaneTunnel, VerifyError, verify_server
from tests.ztunnel_exact.xds import ADDRESS_TYPE, AUTHORIZATION_TYPE, ZtunnelEnv, ZtunnelXdsClient


def env_for(agent, host: str = "localhost", **kw) -> ZtunnelEnv:
    kw.setdefault("token", ZTUNNEL_TOKEN)
    return ZtunnelEnv(xds_address=f"https://{host}:{agent.xds.tls_port}",
                      xds_root_ca=agent.root_pem, node_name=NODE,
                      pod_name="ztunnel-x", pod_namespace="istio-system", **kw)


async def test_tls_xds_with_token_and_no_client_certificate_is_served(make_agent):
    agent = await make_agent()
    client = await ZtunnelXdsClient(env_for(agent)).start()
    try:
        await client.wait_ready()
        [conn] = client.tunnel.connections
        assert (conn.version, conn.alpn) == ("TLSv1.3", "h2")
        assert conn.cipher in ("TLS_AES_256_GCM_SHA384", "TLS_AES_128_GCM_SHA256")
        # ztunnel's initial requests, in its order, carrying its node
        first = client.requests_sent[:2]
        assert [r.type_url for r in first] == [ADDRESS_TYPE, AUTHORIZATION_TYPE]
        assert first[0].node.id == "ztunnel~1.1.1.1~ztunnel-x.istio-system~istio-system.svc.cluster.local"
        assert "Kubernetes//Pod/bank/ledger-0" in client.resources[ADDRESS_TYPE]
        # every response ACKed, nothing NACKed
        acks = [r for r in client.requests_sent if r.response_nonce]
        assert len(acks) == len(client.responses) and not client.nacks
        [state] = agent.xds.debug_state()["clients"]
        assert state["identity"] == "spiffe://cluster.local/ns/istio-system/sa/ztunnel"
        peer = next(iter(agent.xds.front_door.peers.values()))
        assert peer.cert_der is None and peer.version == "TLSv1.3"
    finally:
        await client.close()


@pytest.mark.parametrize("token, reason", [
    (None, "no client certificate and no 'authorization: Bearer' token"),
    ("not-a-listed-token", "bearer token is not in tokens_file")])
async def test_token_less_or_unknown_token_is_unauthenticated_naming_why(make_agent, token,
                                                                         reason):
    agent = await make_agent()
    client = await ZtunnelXdsClient(env_for(agent, token=token)).start()
    try:
        code, details = await client.wait_terminated()
        assert code == "UNAUTHENTICATED"
        assert reason in details and (token or "tok") not in details.replace("token", "")
        assert not client.ready.is_set() and not agent.xds.connections
    finally:
        await client.close()


async def test_wrong_cluster_header_is_not_a_credential(make_agent):
    """clusterid is only consulted by the TokenReview authenticator; with a tokens file a
    ztunnel with another CLUSTER_ID still gets in, with the same identity."""
    agent = await make_agent()
    client = await ZtunnelXdsClient(env_for(agent, cluster_id="other")).start()
    try:
        await client.wait_ready()
    finally:
        await client.close()


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "[::1]"])
async def test_server_certificate_names_ztunnel_accepts_on_a_plain_host(make_agent, host):
    agent = await make_agent()
    client = await ZtunnelXdsClient(env_for(agent, host=host)).start()
    try:
        await client.wait_ready()
    finally:
        await client.close()


async def test_server_certificate_names_for_a_cluster_and_extra_names(make_agent):
    agent = await make_agent(tls_server_names="agent.example.internal,192.0.2.10")
    leaf = None
    tunnel = await ControlPlaneTunnel(f"https://127.0.0.1:{agent.xds.tls_port}",
                                      agent.root_pem).start()
    try:
        conn_material = agent.xds.certificate.material
        from cryptography import x509
        leaf = x509.load_pem_x509_certificate(conn_material.cert_chain_pem)
        der = leaf.public_bytes(__import__("cryptography.hazmat.primitives.serialization",
                                           fromlist=["Encoding"]).Encoding.DER)
        import time
        for name in ("istiod.istio-system.svc", "istiod.istio-system.svc.cluster.local",
                     "istiod-remote.istio-system.svc", "istio-pilot.istio-system.svc",
                     NODE, "agent.example.internal", "192.0.2.10", "localhost", "127.0.0.1",
                     "::1"):
            verify_server(der, agent.root_pem, name, None, time.time())
        with pytest.raises(VerifyError):
            verify_server(der, agent.root_pem, "evil.example", None, time.time())
        # ztunnel's ALT_XDS_HOSTNAME: the host (a node IP) is not in the certificate,
        # the alternative name is
        verify_server(der, agent.root_pem, "198.51.100.4", "istiod.istio-system.svc",
                      time.time())
    finally:
        await tunnel.close()


async def test_on_demand_lookup_wakes_ztunnels_waiter(make_agent):
    # an on-demand ztunnel runs without its DNS proxy: the agent's DNS capture is off
    agent = await make_agent(ambient_dns_capture="false")
    client = await ZtunnelXdsClient(env_for(agent, on_demand=True)).start()
    try:
        await client.wait_ready()  # Authorization only: Address starts subscribed to nothing
        assert client.requests_sent[0].resource_names_subscribe == ["*"]
        assert client.requests_sent[0].resource_names_unsubscribe == ["*"]
        await client.demand("/10.1.0.7")  # ztunnel demands "<network>/<IP>" keys
        assert "Kubernetes//Pod/bank/ledger-0" in client.resources[ADDRESS_TYPE]
        assert not client.nacks
    finally:
        await client.close()


async def test_on_demand_with_dns_capture_on_is_refused_naming_both_settings(make_agent):
    """ztunnel refuses XDS_ON_DEMAND with its DNS proxy on (config.rs validate_config:
    "DNS proxy does not currently support on-demand mode"), so an on-demand ztunnel has
    nothing on 15053. With the agent still redirecting pods' DNS there, every lookup
    would time out; the agent refuses the on-demand stream instead, naming the fix."""
    agent = await make_agent()
    assert agent.ctx.config.ambient_dns_capture is True
    client = await ZtunnelXdsClient(env_for(agent, on_demand=True)).start()
    try:
        with pytest.raises(ConnectionError) as e:
            await client.wait_ready()
        text = str(e.value)
        assert "FAILED_PRECONDITION" in text and "AMBIENT_DNS_CAPTURE=false" in text
        assert "XDS_ON_DEMAND" in text
    finally:
        await client.close()
    # a wildcard ztunnel (DNS proxy on) is served by the same agent
    client = await ZtunnelXdsClient(env_for(agent)).start()
    try:
        await client.wait_ready()
        assert "Kubernetes//Pod/bank/ledger-0" in client.resources[ADDRESS_TYPE]
    finally:
        await client.close()


async def test_plaintext_port_does_not_serve_the_ca(make_agent):
    from agent.sds import ca_pb2, ca_pb2_grpc
    from tests.ztunnel_exact.ca import csr_for

    agent = await make_agent()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.xds.port}") as ch:
        with pytest.raises(grpc.RpcError) as e:
            await ca_pb2_grpc.IstioCertificateServiceStub(ch).CreateCertificate(
                ca_pb2.IstioCertificateRequest(csr=csr_for("spiffe://x/ns/a/sa/b")[0].decode()),
                metadata=[("authorization", f"Bearer {ZTUNNEL_TOKEN}")])
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "TLS only" in e.value.details()
