"""SDS per-name resolution and trust-bundle reloads (issue 17, items 11-13), against the real
SDS server over its Unix socket; the remote CA is a second agent's embedded CA served as
``IstioCertificateService`` (the protocol istiod speaks)."""

from __future__ import annotations

import asyncio
import logging
import os

import grpc
import pytest
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc

from agent.tlsport import authn
from agent.demo.envoy import free_port
from agent.core.lifecycle import AgentContext
from agent.sds import keys
from agent.sds.ca_embedded import EmbeddedCA
from agent.sds.server import SdsServer, build
from tests.sds.helpers import Stream, executor_runner, make_config, request, secrets_of

MISSING = "file-cert:{d}/tls.crt~{d}/tls.key"


def _root_of(resp) -> bytes:
    return secrets_of(resp)["ROOTCA"].validation_context.trusted_ca.inline_bytes


@pytest.fixture
async def fixed_sds(state_dir):
    run = executor_runner()
    servers: list[SdsServer] = []

    async def start(**overrides):
        overrides.setdefault("service_account", "cart")
        overrides.setdefault("pod_namespace", "shop")
        server = SdsServer(make_config(state_dir, ecc_signature_algorithm="ECDSA",
                                       **overrides), run)
        await server.start()
        servers.append(server)
        return server

    try:
        yield start
    finally:
        for s in servers:
            await s.stop(0.2)
        run.pool.shutdown(wait=False)


def _other_root(tmp_path, name: str) -> bytes:
    """A real CA root unrelated to the agent's (another embedded CA's)."""
    return EmbeddedCA.load_or_create(str(tmp_path / name), "cluster.local", "", "").root_pem


# ---------------------------------------------------------------- item 11: per-name


async def test_unresolvable_file_name_does_not_stop_default_on_the_same_stream(
        fixed_sds, tmp_path):
    server = await fixed_sds()
    d = tmp_path / "later"
    d.mkdir()
    missing = MISSING.format(d=d)
    async with grpc.aio.insecure_channel("unix:" + server.config.sds_socket) as ch:
        st = Stream(ch)
        await st.send(request(["default", missing]))
        first = await st.recv()
        assert list(secrets_of(first)) == ["default"]
        await st.send(request(["default", missing], nonce=first.nonce, node=""))
        (conn,) = server.service.connections.values()
        assert "tls.crt" in str(conn.failed[missing])
        assert server.service.generate_failures == {"file-cert": 1}
        assert server.file_secret_failures == 1
        # the files appear: the name is pushed on the same stream (watch or retry)
        pair = await server.certificate_for(["spiffe://cluster.local/ns/x/sa/y"])
        (d / "tls.key").write_bytes(pair.key)
        (d / "tls.crt").write_bytes(pair.chain)
        pushed = await st.recv(10)
        assert list(secrets_of(pushed)) == [missing]
        assert secrets_of(pushed)[missing].tls_certificate.certificate_chain.inline_bytes == \
            pair.chain
        assert not conn.failed


async def test_delta_and_fetch_serve_what_resolves(fixed_sds, tmp_path):
    server = await fixed_sds()
    missing = MISSING.format(d=tmp_path / "nowhere")
    async with grpc.aio.insecure_channel("unix:" + server.config.sds_socket) as ch:
        stub = sds_pb2_grpc.SecretDiscoveryServiceStub(ch)
        call = stub.DeltaSecrets()
        req = discovery_pb2.DeltaDiscoveryRequest(resource_names_subscribe=[missing, "default",
                                                                            "ROOTCA"])
        req.node.id = "n1"
        await call.write(req)
        resp = await asyncio.wait_for(call.read(), 10)
        assert sorted(r.name for r in resp.resources) == ["ROOTCA", "default"]
        call.cancel()
        got = await stub.FetchSecrets(discovery_pb2.DiscoveryRequest(
            resource_names=["default", missing]))
        assert list(secrets_of(got)) == ["default"]
        with pytest.raises(grpc.aio.AioRpcError) as e:  # nothing resolves: an error
            await stub.FetchSecrets(discovery_pb2.DiscoveryRequest(resource_names=[missing]))
        assert e.value.code() == grpc.StatusCode.UNKNOWN
        assert f"failed to generate secret for {missing}" in e.value.details()


async def test_refused_file_name_is_not_retried(state_dir, tmp_path):
    """Attested mode refuses file names for good: reported once, no retry timer."""
    from agent.core.spiffe import Identity
    run = executor_runner()
    ident = Identity("cluster.local", "shop", "cart")
    server = SdsServer(make_config(state_dir, ecc_signature_algorithm="ECDSA"), run,
                       identify=lambda ctx: ident)
    await server.start()
    try:
        async with grpc.aio.insecure_channel("unix:" + server.config.sds_socket) as ch:
            st = Stream(ch)
            name = f"file-root:{tmp_path}/ca.pem"
            await st.send(request(["default", name]))
            assert list(secrets_of(await st.recv())) == ["default"]
            (conn,) = server.service.connections.values()
            assert conn.failed[name].retry is False and conn.retry_timer is None
    finally:
        await server.stop(0.2)
        run.pool.shutdown(wait=False)


# ---------------------------------------------------------------- item 12: trust anchors


async def test_trust_anchors_file_change_pushes_rootca(fixed_sds, tmp_path):
    extra_a, extra_b = _other_root(tmp_path, "a"), _other_root(tmp_path, "b")
    anchors = tmp_path / "anchors" / "extra.pem"
    anchors.parent.mkdir()
    anchors.write_bytes(extra_a)
    server = await fixed_sds(trust_anchors_file=str(anchors))
    mesh_root = server.root_pem()
    async with grpc.aio.insecure_channel("unix:" + server.config.sds_socket) as ch:
        st = Stream(ch)
        await st.send(request(["ROOTCA"]))
        first = await st.recv()
        assert keys.pem_blocks(_root_of(first)) == keys.pem_blocks(
            keys.merge_trust(mesh_root, extra_a))
        await st.send(request(["ROOTCA"], nonce=first.nonce, node=""))
        await server.watcher.wait_ready()
        anchors.write_bytes(extra_a + extra_b)
        pushed = await st.recv(10)
        assert _root_of(pushed) == keys.merge_trust(mesh_root, extra_a, extra_b)
        await st.send(request(["ROOTCA"], nonce=pushed.nonce, node=""))
        # the same certificates reordered: nothing is pushed
        anchors.write_bytes(extra_b + b"\n" + extra_a)
        assert await st.silent(1.0)
        # garbage: the previous anchors stay, counted, nothing pushed
        failures = server.file_secret_failures
        anchors.write_bytes(b"not a certificate\n")
        assert await st.silent(1.0)
        assert server.file_secret_failures == failures + 1
        assert keys.merge_trust(server.cache.extra_trust) == keys.merge_trust(extra_a, extra_b)


# ---------------------------------------------------------------- item 12: CA root file


async def _ca_agent(state: str, port: int) -> tuple[AgentContext, SdsServer]:
    os.makedirs(state, mode=0o700, exist_ok=True)
    tokens = os.path.join(state, "tokens.yaml")
    with open(tokens, "w") as f:
        f.write("t0k3n: shop/cart\n")
    os.chmod(tokens, 0o600)
    ctx = AgentContext(make_config(__import__("pathlib").Path(state), service_account="ca",
                                   pod_namespace="istio-system", ca_port=port,
                                   ca_listen_address="127.0.0.1", tokens_file=tokens,
                                   ecc_signature_algorithm="ECDSA"))
    authenticator = ctx.add(authn.build(ctx)).authenticator
    agent = ctx.add(build(ctx, None, authenticator))
    await agent.start()
    return ctx, agent


async def test_changed_ca_root_file_reaches_rootca_at_once(tmp_path):
    """The remote CA's root is rotated (a new CA on the same address) and its root file
    is replaced: the client agent reconnects with the new root and pushes ROOTCA
    without waiting for the next certificate rotation."""
    port = free_port()
    ctx1, ca1 = await _ca_agent(str(tmp_path / "ca1"), port)
    root_file = tmp_path / "ca-root" / "root-cert.pem"
    root_file.parent.mkdir()
    root_file.write_bytes(ca1.root_pem())
    token = tmp_path / "token"
    token.write_text("t0k3n")
    client_state = tmp_path / "client"
    client_state.mkdir(mode=0o700)
    cctx = AgentContext(make_config(client_state, service_account="cart", pod_namespace="shop",
                                    ca_addr=f"localhost:{port}", ca_root_cert=str(root_file),
                                    ca_token_file=str(token), ecc_signature_algorithm="ECDSA"))
    client = cctx.add(build(cctx, None, None))
    await client.start()
    ctx2 = ca2 = None
    try:
        async with grpc.aio.insecure_channel("unix:" + client.config.sds_socket) as ch:
            st = Stream(ch)
            await st.send(request(["default", "ROOTCA"]))
            first = await st.recv()
            assert _root_of(first) == keys.merge_trust(ca1.root_pem())
            await st.send(request(["default", "ROOTCA"], nonce=first.nonce, node=""))
            await client.watcher.wait_ready()
            csrs = client.cache.csr_count
            # same certificates re-written: no reconnect, no renewal
            root_file.write_bytes(b"\n" + ca1.root_pem())
            assert await st.silent(1.0)
            assert client.cache.csr_count == csrs
            # the CA is replaced by one with another root, and the root file follows
            await ca1.stop(0.2)
            ctx2, ca2 = await _ca_agent(str(tmp_path / "ca2"), port)
            assert ca2.root_pem() != ca1.root_pem()
            tmp = root_file.parent / ".root.new"
            tmp.write_bytes(ca2.root_pem())
            os.replace(tmp, root_file)
            got: dict = {}
            while "ROOTCA" not in got or "default" not in got:
                resp = await st.recv(10)
                got.update(secrets_of(resp))
                await st.send(request(["default", "ROOTCA"], nonce=resp.nonce, node=""))
            assert got["ROOTCA"].validation_context.trusted_ca.inline_bytes == \
                keys.merge_trust(ca2.root_pem())
            chain = got["default"].tls_certificate.certificate_chain.inline_bytes
            assert keys.pem_blocks(chain)[-1].strip() != keys.pem_blocks(ca1.root_pem())[0].strip()
    finally:
        await client.stop(0.2)
        for agent in (ca1, ca2):
            if agent is not None:
                await agent.stop(0.2)
        for c in (ctx1, ctx2, cctx):
            if c is not None:
                c.executor.shutdown(wait=False)


async def test_unusable_ca_root_file_keeps_the_connection(tmp_path):
    port = free_port()
    ctx1, ca1 = await _ca_agent(str(tmp_path / "ca1"), port)
    root_file = tmp_path / "root-cert.pem"
    root_file.write_bytes(ca1.root_pem())
    client_state = tmp_path / "client"
    client_state.mkdir(mode=0o700)
    token = tmp_path / "token"
    token.write_text("t0k3n")
    cctx = AgentContext(make_config(client_state, service_account="cart", pod_namespace="shop",
                                    ca_addr=f"localhost:{port}", ca_root_cert=str(root_file),
                                    ca_token_file=str(token), ecc_signature_algorithm="ECDSA"))
    client = cctx.add(build(cctx, None, None))
    await client.start()
    try:
        await client.watcher.wait_ready()
        root_file.write_bytes(b"garbage")
        for _ in range(50):
            if client.file_secret_failures:
                break
            await asyncio.sleep(0.1)
        assert client.file_secret_failures == 1
        assert client._ca_root_bundle == keys.merge_trust(ca1.root_pem())
    finally:
        await client.stop(0.2)
        await ca1.stop(0.2)
        ctx1.executor.shutdown(wait=False)
        cctx.executor.shutdown(wait=False)


# ---------------------------------------------------------------- item 13: start-up


async def test_start_with_trust_anchors_logs_no_error(fixed_sds, tmp_path, caplog):
    anchors = tmp_path / "extra.pem"
    anchors.write_bytes(_other_root(tmp_path, "x"))
    caplog.set_level(logging.WARNING)
    server = await fixed_sds(trust_anchors_file=str(anchors))
    await asyncio.sleep(0.2)  # the warm-up mints default + ROOTCA
    assert server.ready() == (True, "")
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [r.getMessage() for r in bad]
