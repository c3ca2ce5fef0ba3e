"""The ``sds`` component as the daemon builds it: lifecycle, debug state, the API other
components use, a second agent using the first one's CA port as its Istio CA, and no key
material or token in any log line."""

from __future__ import annotations

import json
import logging
import os

import grpc
import pytest
from cryptography import x509

from agent.tlsport import authn
from agent.demo.envoy import free_port
from agent.core.lifecycle import AgentContext
from agent.sds import keys
from agent.sds.server import build
from tests.sds.helpers import Stream, make_config, request, secrets_of


async def test_component_lifecycle_api_and_no_secrets_in_logs(state_dir, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("s3cr3t-token-value: shop/cart\n")
    tokens.chmod(0o600)
    ctx = AgentContext(make_config(state_dir, service_account="cart", pod_namespace="shop",
                                   ca_port=free_port(), ca_listen_address="127.0.0.1",
                                   tokens_file=str(tokens), ecc_signature_algorithm="ECDSA"))
    authenticator = ctx.add(authn.build(ctx)).authenticator
    ca_agent = ctx.add(build(ctx, None, authenticator))
    await ca_agent.start()
    client_state = tmp_path / "client-state"
    client_state.mkdir(mode=0o700)
    root = tmp_path / "root.pem"
    root.write_bytes(ca_agent.root_pem())
    token = tmp_path / "token"
    token.write_text("s3cr3t-token-value")
    cctx = AgentContext(make_config(client_state, service_account="cart", pod_namespace="shop",
                                    ca_addr=f"localhost:{ca_agent.ca_port}",
                                    ca_root_cert=str(root), ca_token_file=str(token)))
    client_agent = cctx.add(build(cctx, None, None))
    try:
        assert ca_agent.ready() == (True, "")
        sock = ca_agent.config.sds_socket
        assert os.stat(sock).st_mode & 0o777 == 0o600
        assert os.stat(os.path.dirname(sock)).st_mode & 0o777 == 0o750
        await client_agent.start()
        # the fixed-identity socket (gRPC's own bind) is renamed into place: no temp left
        csock = client_agent.config.sds_socket
        assert os.stat(csock).st_mode & 0o777 == 0o600
        assert [n for n in os.listdir(os.path.dirname(csock)) if n.startswith(".s")] == []
        async with grpc.aio.insecure_channel("unix:" + client_agent.config.sds_socket) as ch:
            st = Stream(ch)
            await st.send(request(["default", "ROOTCA"]))
            got = secrets_of(await st.recv())
            state = json.loads(json.dumps(client_agent.debug_state()))
            assert state["streams"][0]["resource_names"] == ["ROOTCA", "default"]
        leaf = x509.load_pem_x509_certificate(
            got["default"].tls_certificate.certificate_chain.inline_bytes)
        assert keys.uri_sans(leaf) == ["spiffe://cluster.local/ns/shop/sa/cart"]
        assert got["ROOTCA"].validation_context.trusted_ca.inline_bytes == \
            keys.merge_trust(ca_agent.root_pem())
        assert client_agent.root_pem() == keys.merge_trust(ca_agent.root_pem())
        server_cert = await ca_agent.certificate_for(["istiod.istio-system.svc", "127.0.0.1"])
        assert server_cert.root == ca_agent.root_pem()
        assert state["certificates"][0]["spiffe_id"] == "spiffe://cluster.local/ns/shop/sa/cart"
        assert ca_agent.debug_state()["ca_issued"] >= 1
        from prometheus_client import generate_latest
        exposition = generate_latest(cctx.registry).decode()
        assert 'istio_agent_num_outgoing_requests_total{request_type="csr"} 1.0' in exposition
        assert 'istio_agent_cert_expiry_seconds{resource_name="default",' \
            'spiffe_id="spiffe://cluster.local/ns/shop/sa/cart"}' in exposition
        # a missing token: the name stays unresolved with the CA's reason (debug state,
        # counter), the stream stays open and gets the certificate once the token is back
        token_text = token.read_text()
        token.unlink()
        client_agent.cache.items.clear()
        async with grpc.aio.insecure_channel("unix:" + client_agent.config.sds_socket) as ch:
            st = Stream(ch)
            await st.send(request(["default"]))
            assert await st.silent(0.6)
            unresolved = [s["unresolved"] for s in client_agent.debug_state()["streams"]
                          if s["unresolved"]]
            assert "request authenticate failure" in unresolved[0]["default"]
            assert client_agent.service.generate_failures["default"] >= 1
            token.write_text(token_text)
            got = secrets_of(await st.recv(10))
            assert list(got) == ["default"]
        assert client_agent.ready() == (True, "")
    finally:
        await client_agent.stop(0.5)
        await ca_agent.stop(0.5)
        ctx.executor.shutdown(wait=False)
        cctx.executor.shutdown(wait=False)
    assert not os.path.exists(ca_agent.config.sds_socket)
    logs = caplog.text
    assert "PRIVATE KEY" not in logs and "s3cr3t-token-value" not in logs


async def test_bad_settings_are_clear_errors(state_dir):
    ctx = AgentContext(make_config(state_dir, ecc_signature_algorithm="DSA"))
    with pytest.raises(ValueError, match="ecc_signature_algorithm='DSA'"):
        build(ctx, None, None)
    ctx = AgentContext(make_config(state_dir, sds_socket_mode="rw"))
    with pytest.raises(ValueError, match="sds_socket_mode"):
        build(ctx, None, None)
    ctx = AgentContext(make_config(state_dir, ca_cert_file=str(state_dir / "missing.pem"),
                                   ca_key_file=str(state_dir / "missing.key")))
    comp = build(ctx, None, None)
    with pytest.raises(RuntimeError, match="missing.pem"):
        await comp.start()
    ctx.executor.shutdown(wait=False)


async def test_extra_trust_anchors_are_merged_into_rootca(state_dir, tmp_path):
    """Extra anchors (upstream's ProxyConfig.caCertificatesPem; here the
    trust_anchors_file setting) are merged into ROOTCA: split, de-duplicated, sorted."""
    other_state = tmp_path / "other"
    other_state.mkdir(mode=0o700)
    other = AgentContext(make_config(other_state, service_account="a", pod_namespace="ns"))
    other_sds = other.add(build(other, None, None))
    await other_sds.start()
    anchors = tmp_path / "anchors.pem"
    anchors.write_bytes(other_sds.root_pem())
    await other_sds.stop(0)
    ctx = AgentContext(make_config(state_dir, service_account="a", pod_namespace="ns",
                                   trust_anchors_file=str(anchors)))
    sds = ctx.add(build(ctx, None, None))
    await sds.start()
    try:
        async with grpc.aio.insecure_channel("unix:" + sds.config.sds_socket) as ch:
            st = Stream(ch)
            await st.send(request(["ROOTCA"]))
            got = secrets_of(await st.recv())
        bundle = got["ROOTCA"].validation_context.trusted_ca.inline_bytes
        assert bundle == keys.merge_trust(sds.root_pem(), anchors.read_bytes())
        assert len(x509.load_pem_x509_certificates(bundle)) == 2
    finally:
        await sds.stop(0)


@pytest.mark.parametrize("content", [None, b"not a certificate\n"])
async def test_bad_trust_anchors_file_names_the_setting(state_dir, tmp_path, content):
    from agent.core.config import ConfigError

    path = tmp_path / "anchors.pem"
    if content is not None:
        path.write_bytes(content)
    ctx = AgentContext(make_config(state_dir, service_account="a", pod_namespace="ns",
                                   trust_anchors_file=str(path)))
    sds = ctx.add(build(ctx, None, None))
    with pytest.raises(ConfigError, match="trust_anchors_file"):
        await sds.start()


async def test_busy_ca_port_fails_start_naming_it_and_leaves_nothing_behind(state_dir,
                                                                             monkeypatch):
    """A ``ca_port`` another process holds stops start-up with an error naming the
    setting; the stop that follows a failed start releases the CA port's certificate
    renewal, gRPC server and private socket, and the authenticator keeps no front door."""
    import asyncio
    import socket

    from agent.core.config import ConfigError
    from agent.tlsport import frontdoor

    backends = []
    made = frontdoor.private_socket_path
    monkeypatch.setattr(frontdoor, "private_socket_path",
                        lambda *a: backends.append(made(*a)) or backends[-1])
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    ctx = AgentContext(make_config(state_dir, service_account="cart", pod_namespace="shop",
                                   ca_port=port, ca_listen_address="127.0.0.1"))
    auth = ctx.add(authn.build(ctx))
    server = ctx.add(build(ctx, None, auth.authenticator))
    try:
        with pytest.raises(ConfigError) as e:
            await server.start()
        assert e.value.setting == "ca_port" and e.value.value == port
        assert server._ca_port is None and server.ca_port == 0
        assert auth.authenticator._doors == []
        assert len(backends) == 1 and not os.path.exists(backends[0])
        assert [t for t in asyncio.all_tasks() if t.get_name() == "renew-ca_port"] == []
        assert not os.path.exists(server.config.sds_socket)
    finally:
        holder.close()
        await server.stop(0)
