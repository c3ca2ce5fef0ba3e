"""Two nodes, one root, cross-node mTLS (issue 24 item 5, the CI part).

Two agents, wired as ``ambient-agent run`` wires the parts ztunnel talks to (config source
on the real kube-apiserver, index, authn, SDS with the cluster CA Secret, xDS + CA on the
TLS port: :class:`tests.ztunnel_exact.conftest.AgentStack`), each with its own token of the
DaemonSet's ServiceAccount and its own node. On each node a ztunnel-exact CA client
(:mod:`tests.ztunnel_exact.ca`, reproduced from ztunnel's source) fetches the certificate of
a pod of that node by impersonation. Each certificate verifies against the *other* node's
trust bundle (its published ``mesh_root_file``), and the two complete an HBONE exchange:
node A's pod certificate dials node B's HBONE port as a source ztunnel does (TLS 1.3 only,
ALPN ``h2``, one HTTP/2 ``CONNECT`` to the destination ``IP:port``), node B's side is the
HBONE terminator written from ztunnel's ``src/proxy/inbound.rs``
(:class:`tests.waypoint.hbone.HboneTerminator`) holding node B's pod certificate; each side
verifies the other against its *own* node's bundle, the caller sees B's SPIFFE ID, the
terminator records A's, and an HTTP request and its answer cross the tunnel."""

from __future__ import annotations

import asyncio

from cryptography.hazmat.primitives import serialization

from agent.core import config as agent_config
from agent.demo.envoy import free_port
from tests.kube import cluster as kc
from tests.kube.test_ca_secret import _ca_role_documents, verify_leaf
from tests.waypoint.hbone import HboneTerminator, hbone_request
from tests.ztunnel_exact.ca import ZtunnelCaClient
from tests.ztunnel_exact.conftest import ZTUNNEL_TOKEN, AgentStack


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
        # HBONE: alpha (node A) dials beta's node (B) as a source ztunnel does
        answer = b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nfrom-beta"

        async def app(reader, writer):  # the destination pod's server on node B
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(app, "127.0.0.1", 0)
        app_port = server.sockets[0].getsockname()[1]
        terminator = await HboneTerminator(
            "127.0.0.1", chain=chain_pem(beta), key=beta.key_pem, root=b.root_pem,
            port=free_port()).start()
        try:
            authority = f"127.0.0.1:{app_port}"
            status, body, peer = await hbone_request(
                ("127.0.0.1", terminator.port), authority,
                b"GET / HTTP/1.1\r\nhost: beta\r\n\r\n",
                chain=chain_pem(alpha), key=alpha.key_pem, root=a.root_pem)
        finally:
            await terminator.stop()
            server.close()
            await server.wait_closed()
        assert status == 200, (status, terminator.refused)
        assert peer == idb  # the caller verified node B's pod identity
        assert terminator.tunnels == [(ida, authority)]  # node B saw node A's pod identity
        assert body == answer
    finally:
        for c in clients:
            await c.close()
        for s in stacks:
            await s.stop()
        for node in nodes:
            await kc.delete_node(kube_admin, node)
        await kc.delete_namespace(kube_admin, system_ns)
