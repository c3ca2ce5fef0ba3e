"""Two nodes, one root, cross-node mTLS (issue 24 item 5, the CI part).

Two agents, wired as ``ambient-agent run`` wires the parts ztunnel talks to (config source
on the real kube-apiserver, index, authn, SDS with the cluster CA Secret, xDS + CA on the
TLS port: :class:`tests.ztunnel_exact.conftest.AgentStack`), each with its own token of the
DaemonSet's ServiceAccount and its own node. On each node a ztunnel-exact CA client
(:mod:`tests.ztunnel_exact.ca`, reproduced from ztunnel's source) fetches the certificate of
a pod of that node by impersonation. Each certificate verifies against the *other* node's
trust bundle (its published ``mesh_root_file``), and the two complete an HBONE-style mTLS
exchange: TLS 1.3 only, ALPN ``h2``, both sides requiring and verifying the peer's
certificate against their own node's bundle and checking the peer's SPIFFE SAN, then bytes
both ways. (HBONE's HTTP/2 CONNECT layer is not spoken: no HTTP/2 library is installed
here; the trust question — does node B accept node A's identities — is the TLS layer.)"""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from agent.core import config as agent_config
from agent.demo.envoy import free_port
from agent.sds import keys
from tests.kube import cluster as kc
from tests.kube.test_ca_secret import _ca_role_documents, verify_leaf
from tests.ztunnel_exact.ca import ZtunnelCaClient
from tests.ztunnel_exact.conftest import ZTUNNEL_TOKEN, AgentStack


async def _context(cert, bundle: bytes, tmp: Path, name: str, server: bool) -> ssl.SSLContext:
    chain = tmp / f"{name}-chain.pem"
    chain.write_bytes(b"".join(c.public_bytes(serialization.Encoding.PEM)
                               for c in [cert.leaf, *cert.chain]))
    key = tmp / f"{name}-key.pem"
    key.write_bytes(cert.key_pem)
    key.chmod(0o600)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(str(chain), str(key))
    ctx.load_verify_locations(cadata=bundle.decode())
    ctx.check_hostname = False  # SPIFFE: the URI SAN is checked below, not a host name
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.set_alpn_protocols(["h2"])
    return ctx


def _peer_spiffe(writer: asyncio.StreamWriter) -> str:
    der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    return keys.uri_sans(x509.load_der_x509_certificate(der))[0]


async def test_two_nodes_one_root_cross_node_mtls(kube_cluster, kube_admin, kube_namespace,
                                                  tmp_path):
    system_ns = kc.unique("sys")
    await kc.create_namespace(kube_admin, system_ns)
    for d in _ca_role_documents(system_ns):
        await kc.apply(kube_admin, d)
    nodes = [kc.unique("node-a"), kc.unique("node-b")]
    pods = {nodes[0]: ("alpha-0", "alpha", "10.252.0.5"), nodes[1]: ("beta-0", "beta", "10.252.1.5")}
    stacks: list[AgentStack] = []
    clients: list[ZtunnelCaClient] = []
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(f"{ZTUNNEL_TOKEN}: istio-system/ztunnel\n")
    try:
        for i, node in enumerate(nodes):
            await kc.create_node(kube_admin, node, ip=f"127.0.0.{20 + i}")
            name, sa, ip = pods[node]
            await kc.create_service_account(kube_admin, kube_namespace, sa)
            await kc.run_pod(kube_admin, name, kube_namespace, node, [ip], service_account=sa)
        for node in nodes:
            state = tmp_path / node
            state.mkdir(mode=0o700)
            kubeconfig = await kc.agent_kubeconfig(kube_cluster, kube_admin,
                                                   str(tmp_path / f"{node}.kubeconfig"))
            cfg = agent_config.load({
                "state_dir": str(state), "config_source": "kubernetes",
                "kubeconfig": kubeconfig, "system_namespace": system_ns, "node_name": node,
                "tokens_file": str(tokens), "xds_port": str(free_port()),
                "xds_tls_port": str(free_port()), "xds_tls_address": "127.0.0.1",
                "workload_certs_dir": str(state / "no-certs"), "ca_root_publish": "false"},
                env={})
            stacks.append(AgentStack(cfg))
        await asyncio.gather(*(s.start() for s in stacks))  # both bootstrap at once
        a, b = stacks
        assert a.root_pem == b.root_pem, "two nodes, two roots"
        certs = []
        for stack, node in zip(stacks, nodes):
            client = await ZtunnelCaClient(f"https://localhost:{stack.xds.tls_port}",
                                           stack.root_pem, token=ZTUNNEL_TOKEN).start()
            clients.append(client)
            _, sa, _ = pods[node]
            want = f"spiffe://cluster.local/ns/{kube_namespace}/sa/{sa}"
            for _ in range(100):  # until the node's agent has seen its pod
                try:
                    cert = await client.fetch_certificate(want)
                    break
                except Exception:  # noqa: BLE001 - UNAUTHENTICATED until the pod is indexed
                    await asyncio.sleep(0.2)
            else:
                cert = await client.fetch_certificate(want)
            assert cert.identity == want
            certs.append(cert)
        alpha, beta = certs
        ida, idb = alpha.identity, beta.identity

        def chain_pem(c) -> bytes:
            return b"".join(x.public_bytes(serialization.Encoding.PEM) for x in [c.leaf, *c.chain])

        assert verify_leaf(chain_pem(alpha), b.root_pem) == ida  # A's leaf, B's bundle
        assert verify_leaf(chain_pem(beta), a.root_pem) == idb
        # the mTLS exchange: alpha (node A) dials beta (node B)
        server_ctx = await _context(beta, b.root_pem, tmp_path, "beta", server=True)
        client_ctx = await _context(alpha, a.root_pem, tmp_path, "alpha", server=False)
        seen: dict[str, str] = {}

        async def serve(reader, writer):
            seen["server_peer"] = _peer_spiffe(writer)
            seen["server_version"] = writer.get_extra_info("ssl_object").version()
            data = await reader.readexactly(5)
            writer.write(b"pong:" + data)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server_ctx)
        port = server.sockets[0].getsockname()[1]
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx)
            assert writer.get_extra_info("ssl_object").selected_alpn_protocol() == "h2"
            assert _peer_spiffe(writer) == idb
            writer.write(b"ping!")
            await writer.drain()
            assert await asyncio.wait_for(reader.read(), 10) == b"pong:ping!"
            writer.close()
        finally:
            server.close()
            await server.wait_closed()
        assert seen == {"server_peer": ida, "server_version": "TLSv1.3"}
    finally:
        for c in clients:
            await c.close()
        for s in stacks:
            await s.stop()
        for node in nodes:
            await kc.delete_node(kube_admin, node)
        await kc.delete_namespace(kube_admin, system_ns)
