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
terminator records A's, and an HTTP request and its answer cross the tunnel.

The root rotation, as ztunnel meets it: ztunnel verifies a peer against the roots that came
with its *own* current certificate (the CA response's last element) and replaces them only
with its next certificate. Certificates fetched by the ztunnel-exact clients before, during
and after a rotation of the plug-in CA Secret ``cacerts`` are paired in HBONE exchanges,
each side verifying against its own certificate's roots: every pair a ztunnel can meet
while it renews within the overlap works; the one pair the overlap exists to rule out (a
certificate held since before the rotation, old root only, meeting one signed by the new
key) fails, so the check is not vacuous. The agents' clock is a test clock, moved past
the overlap (no waiting); real ztunnels through a real rotation:
``tests/kube/test_two_hosts_rotation.py``."""

from __future__ import annotations

import asyncio
import contextlib

from cryptography.hazmat.primitives import serialization

from agent.core import config as agent_config
from agent.demo.envoy import free_port
from tests.kube import cluster as kc
from agent.sds import keys
from agent.sds.ca_embedded import create_root
from tests.helpers import eventually
from tests.kube import cluster as kc
from tests.kube.test_ca_secret import _ca_role_documents, b64, verify_leaf
from tests.waypoint.hbone import HboneTerminator, hbone_request
from tests.ztunnel_exact.ca import WorkloadCertificate, ZtunnelCaClient
from tests.ztunnel_exact.conftest import ZTUNNEL_TOKEN, AgentStack, FakeClock


class TwoNodes:
    """Two agents (``stacks``) on ``nodes``, a ztunnel-exact CA client on each
    (``clients``), one pod per node (``pods``: node -> (name, service account, IP))."""

    def __init__(self, namespace: str, system_ns: str):
        self.namespace, self.system_ns = namespace, system_ns
        self.nodes = [kc.unique("node-a"), kc.unique("node-b")]
        self.pods = {self.nodes[0]: ("alpha-0", "alpha", "10.252.0.5"),
                     self.nodes[1]: ("beta-0", "beta", "10.252.1.5")}
        self.stacks: list[AgentStack] = []
        self.clients: list[ZtunnelCaClient] = []

    def identity(self, i: int) -> str:
        return f"spiffe://cluster.local/ns/{self.namespace}/sa/{self.pods[self.nodes[i]][1]}"

    async def fetch(self, i: int) -> WorkloadCertificate:
        """Node ``i``'s pod certificate as its ztunnel fetches it (by impersonation),
        retried while the node's agent has not indexed the pod yet (UNAUTHENTICATED)."""
        want = self.identity(i)
        for _ in range(100):
            try:
                return await self.clients[i].fetch_certificate(want)
            except Exception:  # noqa: BLE001 - UNAUTHENTICATED until the pod is indexed
                await asyncio.sleep(0.2)
        return await self.clients[i].fetch_certificate(want)


@contextlib.asynccontextmanager
async def two_nodes(kube_cluster, kube_admin, namespace: str, tmp_path, clock=None,
                    settings: dict[str, str] | None = None, cacerts: dict[str, str] | None = None):
    """A system namespace with the shipped CA Role (and ``cacerts`` when given, else the
    agents bootstrap ``istio-ca-secret``), two nodes with a pod each, two agents started at
    once with ``settings`` and ``clock``, a ztunnel-exact CA client per node. Yields a
    :class:`TwoNodes`; everything is removed on exit."""
    system_ns = kc.unique("sys")
    await kc.create_namespace(kube_admin, system_ns)
    t = TwoNodes(namespace, system_ns)
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(f"{ZTUNNEL_TOKEN}: istio-system/ztunnel\n")
    tokens.chmod(0o600)
    try:
        for d in _ca_role_documents(system_ns):
            await kc.apply(kube_admin, d)
        if cacerts is not None:
            await kc.request(kube_admin, "POST", f"/api/v1/namespaces/{system_ns}/secrets",
                             body={"apiVersion": "v1", "kind": "Secret",
                                   "metadata": {"name": "cacerts"}, "data": cacerts})
        for i, node in enumerate(t.nodes):
            await kc.create_node(kube_admin, node, ip=f"127.0.0.{20 + i}")
            name, sa, ip = t.pods[node]
            await kc.create_service_account(kube_admin, namespace, sa)
            await kc.run_pod(kube_admin, name, namespace, node, [ip], service_account=sa)
        for node in t.nodes:
            state = tmp_path / node
            state.mkdir(mode=0o700)
            kubeconfig = await kc.agent_kubeconfig(kube_cluster, kube_admin,
                                                   str(tmp_path / f"{node}.kubeconfig"))
            cfg = agent_config.load({
                "state_dir": str(state), "config_source": "kubernetes",
                "kubeconfig": kubeconfig, "system_namespace": system_ns, "node_name": node,
                "tokens_file": str(tokens), "xds_port": str(free_port()),
                "xds_tls_port": str(free_port()), "xds_tls_address": "127.0.0.1",
                "workload_certs_dir": str(state / "no-certs"), "ca_root_publish": "false",
                **(settings or {})}, env={})
            t.stacks.append(AgentStack(cfg, clock=clock))
        await asyncio.gather(*(s.start() for s in t.stacks))  # both at once
        for stack in t.stacks:
            t.clients.append(await ZtunnelCaClient(f"https://localhost:{stack.xds.tls_port}",
                                                   stack.root_pem, token=ZTUNNEL_TOKEN).start())
        yield t
    finally:
        for c in t.clients:
            await c.close()
        for s in t.stacks:
            await s.stop()
        for node in t.nodes:
            await kc.delete_node(kube_admin, node)
        await kc.delete_namespace(kube_admin, system_ns)


def root_cacerts(root, key) -> dict[str, str]:
    """``cacerts`` data whose root signs itself (istiod accepts this plug-in form)."""
    p = b64(root.public_bytes(serialization.Encoding.PEM))
    return {"ca-cert.pem": p, "ca-key.pem": b64(keys.key_pem(key)), "root-cert.pem": p,
            "cert-chain.pem": ""}


def chain_pem(c: WorkloadCertificate) -> bytes:
    return b"".join(x.public_bytes(serialization.Encoding.PEM) for x in [c.leaf, *c.chain])


async def hbone(client: WorkloadCertificate, client_root: bytes, server: WorkloadCertificate,
                server_root: bytes) -> tuple[int, bytes, str, list]:
    """``client`` (node A's pod certificate) dials an HBONE terminator holding ``server``
    (node B's) as a source ztunnel does; each verifies the other against the given roots.
    Returns (CONNECT status, body, the server's SPIFFE ID as the client verified it, the
    terminator's tunnels [(client ID, authority)])."""
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nfrom-beta"

    async def app(reader, writer):  # the destination pod's server on node B
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        writer.close()

    srv = await asyncio.start_server(app, "127.0.0.1", 0)
    app_port = srv.sockets[0].getsockname()[1]
    terminator = await HboneTerminator("127.0.0.1", chain=chain_pem(server), key=server.key_pem,
                                       root=server_root, port=free_port()).start()
    try:
        authority = f"127.0.0.1:{app_port}"
        status, body, peer = await hbone_request(
            ("127.0.0.1", terminator.port), authority, b"GET / HTTP/1.1\r\nhost: beta\r\n\r\n",
            chain=chain_pem(client), key=client.key_pem, root=client_root)
        return status, body, peer, list(terminator.tunnels)
    finally:
        await terminator.stop()
        srv.close()
        await srv.wait_closed()


async def test_two_nodes_one_root_cross_node_mtls(kube_cluster, kube_admin, kube_namespace,
                                                  tmp_path):
    async with two_nodes(kube_cluster, kube_admin, kube_namespace, tmp_path) as t:
        a, b = t.stacks
        assert a.root_pem == b.root_pem, "two nodes, two roots"
        alpha, beta = await t.fetch(0), await t.fetch(1)
        ida, idb = t.identity(0), t.identity(1)
        assert alpha.identity == ida and beta.identity == idb
        assert verify_leaf(chain_pem(alpha), b.root_pem) == ida  # A's leaf, B's bundle
        assert verify_leaf(chain_pem(beta), a.root_pem) == idb
        # HBONE: alpha (node A) dials beta's node (B) as a source ztunnel does, each side
        # verifying against its own node's bundle
        status, body, peer, tunnels = await hbone(alpha, a.root_pem, beta, b.root_pem)
        assert status == 200, status
        assert peer == idb  # the caller verified node B's pod identity
        assert [who for who, _ in tunnels] == [ida]  # node B saw node A's pod identity
        assert body.endswith(b"from-beta")


async def test_root_rotation_as_ztunnel_trusts(kube_cluster, kube_admin, kube_namespace,
                                               tmp_path):
    # The roots sign directly (cacerts with ca-cert.pem = root-cert.pem, no chain): the
    # ztunnel-exact control-plane TLS verifies the agent's serving certificate from the
    # leaf alone (Python's ssl gives it no peer intermediates), so no intermediate here;
    # the real-ztunnel test uses one.
    overlap = 60.0
    clock = FakeClock()
    old_root, old_key = create_root("cluster.local")
    async with two_nodes(kube_cluster, kube_admin, kube_namespace, tmp_path, clock=clock,
                         settings={"ca_root_overlap": f"{overlap:g}s"},
                         cacerts=root_cacerts(old_root, old_key)) as t:
        a, b = t.stacks
        before = [await t.fetch(0), await t.fetch(1)]
        for c in before:
            assert c.roots == [old_root]
            c.leaf.verify_directly_issued_by(old_root)
        new_root, new_key = create_root("cluster.local")
        await kc.request(kube_admin, "PATCH",
                         f"/api/v1/namespaces/{t.system_ns}/secrets/cacerts",
                         body={"data": root_cacerts(new_root, new_key)},
                         content_type="application/merge-patch+json")
        both = keys.merge_trust(old_root.public_bytes(serialization.Encoding.PEM),
                                new_root.public_bytes(serialization.Encoding.PEM))
        await eventually(lambda: a.sds.root_pem() == both and b.sds.root_pem() == both,
                         timeout=30, what="old + new roots in both agents' bundles (watch)")
        during = [await t.fetch(0), await t.fetch(1)]
        for c in during:  # still the old key, and the response carries both roots
            assert set(c.roots) == {old_root, new_root}
            c.leaf.verify_directly_issued_by(old_root)
        clock.advance(overlap + 1)
        for s in t.stacks:
            await s.sds.kube_ca.sync()
            assert s.sds.kube_ca.pending is None, "signing did not switch after the overlap"
        after = [await t.fetch(0), await t.fetch(1)]
        for c in after:
            assert set(c.roots) == {old_root, new_root}
            c.leaf.verify_directly_issued_by(new_root)

        async def pair(x: WorkloadCertificate, y: WorkloadCertificate) -> str:
            """"ok", or why the exchange failed."""
            try:
                status, body, peer, tunnels = await hbone(x, x.roots_pem(), y, y.roots_pem())
            except (OSError, asyncio.TimeoutError, ConnectionError) as e:
                return f"{type(e).__name__}: {e}"
            if status != 200:
                return f"CONNECT status {status}"
            assert peer == t.identity(1) and [w for w, _ in tunnels] == [t.identity(0)]
            assert body.endswith(b"from-beta")
            return "ok"

        stages = {"before": before, "during": during, "after": after}
        results = {(p, q): await pair(stages[p][0], stages[q][1])
                   for p in stages for q in stages}
        # a peer that renewed within the overlap holds both roots: all of these work
        must_work = [("before", "before"), ("before", "during"), ("during", "before"),
                     ("during", "during"), ("during", "after"), ("after", "during"),
                     ("after", "after")]
        assert all(results[k] == "ok" for k in must_work), results
        # old root only vs the new key: what an overlap shorter than ztunnel's renewal
        # would let happen. The side holding only the old root refuses the other's
        # certificate: the client (certificate verify failed), or the server (its alert)
        assert "certificate verify failed" in results[("before", "after")], results
        assert results[("after", "before")] != "ok", results
        print(f"\nrotation pairs (client stage, server stage): {results}")
