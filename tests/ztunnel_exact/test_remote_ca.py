"""The mode with no CA key on the node (``ca_addr``): a second agent plays the remote Istio
CA (its embedded CA on its TLS port, as istiod serves the CA on 15012). The node's agent
holds no key, its SDS certificates are signed remotely, its trust bundle is the remote
root; ztunnel's CA client (reproduced from ztunnel's source) gets certificates both from the
remote CA directly (``CA_ADDRESS`` at istiod, as upstream deployments do) and through the
node agent's TLS port (``CA_ADDRESS`` at the node agent, which forwards the call with
ztunnel's token): its server certificate is verified by hostname against the node's
published ``mesh_root_file``, and the certificates chain to the remote root.
tests/kube/test_remote_ca_istiod.py runs the same against the real istiod."""

from __future__ import annotations

import os

from cryptography import x509

from tests.ztunnel_exact.ca import ZtunnelCaClient
from tests.ztunnel_exact.conftest import LEDGER_ID, ZTUNNEL_TOKEN

NODE_AGENT_TOKEN = "tok-node-agent-77c2"


async def test_no_key_on_the_node_certificates_from_the_remote_ca(make_agent, agent_dir):
    tokens = agent_dir / "remote-tokens.yaml"
    tokens.write_text(f"{ZTUNNEL_TOKEN}: istio-system/ztunnel\n"
                      f"{NODE_AGENT_TOKEN}: istio-system/ambient-agent\n")
    tokens.chmod(0o600)
    remote = await make_agent(tokens_file=str(tokens), ca_trusted_node_accounts=(
        "istio-system/ztunnel,istio-system/ambient-agent"))
    remote_root = remote.root_pem
    token_file = agent_dir / "node-agent.token"
    token_file.write_text(NODE_AGENT_TOKEN)
    os.chmod(token_file, 0o600)
    node = await make_agent(ca_addr=f"localhost:{remote.xds.tls_port}",
                            ca_root_cert=remote.ctx.config.mesh_root_file,
                            ca_token_file=str(token_file))
    # no CA key anywhere under the node agent's state; its TLS port's CA service forwards
    from agent.sds.ca_server import ForwardingCertificateService
    assert node.sds.embedded is None
    assert isinstance(node.sds.ca_servicer(), ForwardingCertificateService)
    assert not any(name.endswith("key.pem") for _, _, files in os.walk(node.ctx.config.state_dir)
                   for name in files)
    bundle = await node.sds.certificate_for(["spiffe://cluster.local/ns/istio-system/sa/"
                                             "ambient-agent"])
    leaf = x509.load_pem_x509_certificates(bundle.chain)[0]
    leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(remote_root))
    # SDS ROOTCA for a workload (minted remotely first), then the node's trust bundle
    rootca = await node.sds.cache.root_bundle("spiffe://cluster.local/ns/bank/sa/ledger")
    assert rootca.strip() == remote_root.strip()
    item = await node.sds.cache.workload("spiffe://cluster.local/ns/bank/sa/ledger")
    got = x509.load_pem_x509_certificates(item.chain)[0]
    from agent.sds import keys
    assert keys.uri_sans(got) == [LEDGER_ID]  # the pod's identity, asked by impersonation
    assert node.sds.root_pem().strip() == remote_root.strip()
    # ztunnel asks the remote CA itself (CA_ADDRESS = the remote CA)
    client = await ZtunnelCaClient(f"https://localhost:{remote.xds.tls_port}", remote_root,
                                   token=ZTUNNEL_TOKEN).start()
    try:
        cert = await client.fetch_certificate(LEDGER_ID)
    finally:
        await client.close()
    assert cert.identity == LEDGER_ID
    cert.leaf.verify_directly_issued_by(x509.load_pem_x509_certificates(node.sds.root_pem())[0])
    # ztunnel asks the node agent (CA_ADDRESS = the node agent), which forwards
    node_trust = open(node.ctx.config.mesh_root_file, "rb").read()
    assert remote_root.strip() in node_trust  # the mesh root + the serving issuer
    client = await ZtunnelCaClient(f"https://localhost:{node.xds.tls_port}", node_trust,
                                   token=ZTUNNEL_TOKEN).start()
    try:
        cert = await client.fetch_certificate(LEDGER_ID)
    finally:
        await client.close()
    assert cert.identity == LEDGER_ID
    cert.leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(remote_root))
    assert node.sds.ca_servicer().forwarded == 1
    assert not any(name.endswith("key.pem") for _, _, files in os.walk(node.ctx.config.state_dir)
                   for name in files)


async def test_remote_ca_unreachable_not_ready_no_fallback(make_agent, agent_dir):
    """``ca_addr`` naming a port where nothing listens: the agent stays not ready, says
    which CA and why, mints nothing from a key of its own (it has none), and ztunnel asking
    it gets the error, not a certificate."""
    import asyncio

    import grpc
    import pytest

    from agent.demo.envoy import free_port
    from agent.tlsport.servercert import node_local_material

    _, some_root = node_local_material(["some-ca"])
    root = agent_dir / "some-root.pem"
    root.write_bytes(some_root)
    address = f"localhost:{free_port()}"
    node = await make_agent(ca_addr=address, ca_root_cert=str(root))
    sds = node.sds
    for _ in range(300):
        if sds._remote_checks >= 1 and sds._remote_error:
            break
        await asyncio.sleep(0.1)
    ok, why = sds.ready()
    assert not ok and f"ca_addr={address}" in why, why
    assert sds.embedded is None and sds.root_pem() == b""
    assert not os.path.exists(node.ctx.config.mesh_root_file)  # no root to publish
    client = await ZtunnelCaClient(f"https://localhost:{node.xds.tls_port}",
                                   sds._serving_issuer, token=ZTUNNEL_TOKEN).start()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.fetch_certificate(LEDGER_ID)
        # a caller deadline shorter than the agent's retries to the remote CA (~3 s of
        # backoff): the answer is still the CA's error, within it (a fresh CI run under
        # load saw DEADLINE_EXCEEDED instead)
        with pytest.raises(grpc.aio.AioRpcError) as short:
            await client.fetch_certificate(LEDGER_ID, timeout=1.5)
    finally:
        await client.close()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"ca_addr={address}" in e.value.details()
    assert short.value.code() == grpc.StatusCode.UNAVAILABLE, short.value.details()
    assert f"ca_addr={address}" in short.value.details()
    assert not any("key" in name for _, _, files in os.walk(node.ctx.config.state_dir)
                   for name in files)
