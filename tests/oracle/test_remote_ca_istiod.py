"""The mode with no CA key on the node, against the real istiod (issue 24 item 1).

One private kube-apiserver + etcd (scripts/kube-test-apiserver.sh) and the real istiod
(pilot-discovery, scripts/istiod-test.sh: its own self-signed root in the
``istio-ca-secret`` Secret, its CA on its secure gRPC port, 15012 in a cluster) with
``CA_TRUSTED_NODE_ACCOUNTS`` naming ztunnel's and the agent's accounts. The agent runs the
parts ztunnel talks to (:class:`tests.ztunnel_exact.conftest.AgentStack`: config source on
the API server, index, authn by TokenReview, SDS, xDS + CA on its TLS port) with
``ca_addr`` = istiod, istiod's root as ``ca_root_cert`` and a pod-bound token of its
DaemonSet's ServiceAccount (audience ``istio-ca``), as a kubelet projects it.

Shown:

- the agent holds no CA key (no ``*key*.pem`` anywhere in its state dir) and is ready only
  once istiod signed for it;
- ztunnel's CA client (:class:`tests.ztunnel_exact.ca.ZtunnelCaClient`, written from
  ztunnel's ``src/identity/caclient.rs``, its TLS from ``src/tls/control.rs``) with
  ``CA_ADDRESS`` = the agent verifies the agent's TLS port by hostname (``localhost``)
  against the agent's published ``mesh_root_file`` and gets, through the agent, a
  certificate for a pod of the node that chains to istiod's root; the call reached
  istiod with ztunnel's own pod-bound token (istiod ran its own node check);
- a pod on another node is refused (UNAUTHENTICATED) by the agent before istiod is asked;
- SDS workload certificates (minted by the agent with its own token and
  ``ImpersonatedIdentity``) chain to istiod's root, and so does ROOTCA;
- with ``AMBIENT_TEST_ZTUNNEL`` naming a ztunnel binary (skipped otherwise): the real
  ztunnel, ``XDS_ADDRESS``/``CA_ADDRESS`` = the agent, ``XDS_ROOT_CA``/``CA_ROOT_CA`` = the
  agent's ``mesh_root_file``, its pod-bound token as ``AUTH_TOKEN``, prefetches the
  certificate of the node's HBONE pod through the agent: Available in its
  ``/config_dump``, leaf signed by istiod's root;
- bad input: an agent whose ``ca_root_cert`` is not istiod's root stays not ready, says
  why (naming ``ca_root_cert``), serves ztunnel no certificate and still has no key.
"""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import subprocess
import tempfile
import time

import grpc
import pytest
import urllib.request
from cryptography import x509

from agent.core import config as agent_config
from agent.demo.envoy import free_port
from tests.kube import cluster as kc
from tests.oracle import harness as h
from tests.ztunnel_exact.ca import ZtunnelCaClient
from tests.ztunnel_exact.conftest import AgentStack

NODE_A, NODE_B = "rca-node-a", "rca-node-b"
ISTIOD_ENV = "CA_TRUSTED_NODE_ACCOUNTS=istio-system/ztunnel,istio-system/ambient-agent"


def key_files(state_dir: str) -> list[str]:
    """Every file under ``state_dir`` whose name says it holds a key."""
    return [os.path.join(d, n) for d, _, files in os.walk(state_dir) for n in files
            if "key" in n]


class IstiodCA:
    """The private API server + istiod of this module (see the module docstring)."""

    def __init__(self, workdir: str):
        self.kube_dir = os.path.join(workdir, "kube")
        self.istiod_dir = os.path.join(workdir, "istiod")
        self.cluster: kc.KubeCluster | None = None
        self.env: dict[str, str] = {}

    def start(self) -> None:
        env = h.script_env(KUBE_TEST_OWNER_PID=str(os.getpid()))
        proc = subprocess.run(["bash", kc.SCRIPT, "start", self.kube_dir], capture_output=True,
                              text=True, env=env, timeout=300)
        if proc.returncode:
            raise RuntimeError(f"kube-test-apiserver.sh start failed: {proc.stderr[-2000:]}")
        self.cluster = kc.KubeCluster(self.kube_dir)
        env = h.script_env(ISTIOD_TEST_OWNER_PID=str(os.getpid()),
                           ISTIOD_TEST_KUBECONFIG=self.cluster.kubeconfig,
                           ISTIOD_TEST_ENV=ISTIOD_ENV)
        proc = subprocess.run(["bash", h.ISTIOD_SCRIPT, "start", self.istiod_dir],
                              capture_output=True, text=True, env=env, timeout=900)
        if proc.returncode:
            raise RuntimeError(f"istiod-test.sh start failed: {proc.stderr[-3000:]}")
        self.env = kc.read_env(self.istiod_dir)

    @property
    def ca_address(self) -> str:
        """istiod's CA (secure gRPC), as ``localhost:<port>``: its certificate names
        ``localhost`` (ISTIOD_CUSTOM_HOST) and ``istiod.istio-system.svc``."""
        return "localhost:" + self.env["ISTIOD_SECURE_XDS_ADDR"].rsplit(":", 1)[1]

    def log(self) -> str:
        return h.Oracle.tail(os.path.join(self.istiod_dir, "istiod.log"), 30)

    def stop(self) -> None:
        subprocess.run(["bash", h.ISTIOD_SCRIPT, "stop", self.istiod_dir], capture_output=True,
                       timeout=60)
        subprocess.run(["bash", kc.SCRIPT, "stop", self.kube_dir], capture_output=True,
                       timeout=60)


@pytest.fixture(scope="module")
def istiod_ca(tmp_path_factory):
    """The module's :class:`IstiodCA` (started; stopped after the module, also on failure).
    Skips without root or Go; fails instead with ``AMBIENT_REQUIRE_ISTIOD=1``."""
    from tests.oracle.conftest import running
    with running(lambda: IstiodCA(str(tmp_path_factory.mktemp("istiod-ca")))) as ca:
        yield ca


async def until(what: str, check, timeout: float = 60.0, detail=lambda: ""):
    """Await ``check()`` (async, truthy) until it holds; AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        got = await check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout:.0f}s {detail()}")
        await asyncio.sleep(0.3)


class Cluster:
    """The objects of one test: nodes, pods, pod-bound tokens, istiod's root on disk."""

    def __init__(self, ca: IstiodCA, api, work: str):
        self.ca, self.api, self.work = ca, api, work

    async def prepare(self, ns: str) -> None:
        api = self.api
        await kc.create_namespace(api, kc.AGENT_NAMESPACE)
        await kc.apply_manifest(api, "rbac.yaml")
        await kc.create_namespace(api, ns, labels={"istio.io/dataplane-mode": "ambient"})
        for node, ip in ((NODE_A, "127.0.0.31"), (NODE_B, "127.0.0.32")):
            await kc.create_node(api, node, ip=ip)
        await kc.create_service_account(api, kc.AGENT_NAMESPACE, "ztunnel")
        for sa in ("ledger", "teller"):
            await kc.create_service_account(api, ns, sa)
        self.pods = {}
        for name, pns, node, sa, ip in (
                ("agent-a", kc.AGENT_NAMESPACE, NODE_A, kc.AGENT_SERVICE_ACCOUNT, "127.0.0.31"),
                ("ztunnel-a", kc.AGENT_NAMESPACE, NODE_A, "ztunnel", "10.253.0.2"),
                ("ledger-0", ns, NODE_A, "ledger", "10.253.0.5"),
                ("teller-0", ns, NODE_B, "teller", "10.253.1.5")):
            name = kc.unique(name)
            captured = {"ambient.istio.io/redirection": "enabled"} if pns == ns else {}
            pod = await kc.run_pod(api, name, pns, node, [ip], service_account=sa,
                                   annotations=captured)
            self.pods[sa] = (pns, name, pod["metadata"]["uid"])
        secret = await kc.request(api, "GET",
                                  "/api/v1/namespaces/istio-system/secrets/istio-ca-secret")
        self.istiod_root = base64.b64decode(secret["data"]["ca-cert.pem"])
        self.root_file = os.path.join(self.work, "istiod-root.pem")
        with open(self.root_file, "wb") as f:
            f.write(self.istiod_root)

    async def pod_token(self, sa: str) -> str:
        """A token of the pod running as ``sa``, bound to it, audience istio-ca (what the
        kubelet projects for ztunnel and for the agent's DaemonSet pod)."""
        pns, name, uid = self.pods[sa]
        return await kc.service_account_token(self.api, pns, sa, audiences=["istio-ca"],
                                              bound_pod=(name, uid))

    async def agent(self, root_file: str, tag: str) -> AgentStack:
        assert self.ca.cluster is not None
        state = tempfile.mkdtemp(prefix=f"rca{tag}-")  # short: Unix socket paths
        os.chmod(state, 0o700)
        self.dirs.append(state)
        token_file = os.path.join(self.work, f"agent-{tag}.token")
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(await self.pod_token(kc.AGENT_SERVICE_ACCOUNT))
        kubeconfig = await kc.agent_kubeconfig(self.ca.cluster, self.api,
                                               os.path.join(self.work, f"agent-{tag}.kubeconfig"))
        cfg = agent_config.load({
            "state_dir": state, "config_source": "kubernetes", "kubeconfig": kubeconfig,
            "node_name": NODE_A, "ca_addr": self.ca.ca_address, "ca_root_cert": root_file,
            "ca_token_file": token_file, "xds_port": str(free_port()),
            "xds_tls_port": str(free_port()), "xds_tls_address": "127.0.0.1",
            "workload_certs_dir": os.path.join(state, "no-certs")}, env={})
        stack = AgentStack(cfg)
        self.stacks.append(stack)
        return await stack.start()

    dirs: list[str]
    stacks: list[AgentStack]


@pytest.fixture
async def cluster(istiod_ca, tmp_path):
    assert istiod_ca.cluster is not None
    api = await istiod_ca.cluster.admin_client()
    c = Cluster(istiod_ca, api, str(tmp_path))
    c.dirs, c.stacks = [], []
    ns = kc.unique("bank")
    try:
        await c.prepare(ns)
        c.ns = ns
        yield c
    finally:
        for s in c.stacks:
            await s.stop()
        for d in c.dirs:
            shutil.rmtree(d, ignore_errors=True)
        for node in (NODE_A, NODE_B):
            await kc.delete_node(api, node)
        await kc.delete_namespace(api, ns)
        await api.close()


async def test_ztunnel_and_sds_certificates_from_istiod_through_the_agent(cluster):
    agent = await cluster.agent(cluster.root_file, "ok")
    sds = agent.sds
    await until("the agent ready (istiod signed its certificate)",
                lambda: asyncio.sleep(0, sds.ready()[0]), timeout=60,
                detail=lambda: f"{sds.ready()[1]}\n{cluster.ca.log()}")
    assert sds.embedded is None
    assert key_files(agent.ctx.config.state_dir) == []
    istiod_root = x509.load_pem_x509_certificate(cluster.istiod_root)
    # the trust ztunnel reads: istiod's root + the issuer of the agent's serving cert
    trust = open(agent.ctx.config.mesh_root_file, "rb").read()
    assert cluster.istiod_root.strip() in trust
    ledger = f"spiffe://cluster.local/ns/{cluster.ns}/sa/ledger"
    teller = f"spiffe://cluster.local/ns/{cluster.ns}/sa/teller"
    client = await ZtunnelCaClient(f"https://localhost:{agent.xds.tls_port}", trust,
                                   token=await cluster.pod_token("ztunnel")).start()
    try:
        async def fetched():  # until the agent's and istiod's pod informers have the pods
            try:
                return await client.fetch_certificate(ledger)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAUTHENTICATED:
                    raise
                return None
        cert = await until("ztunnel's certificate for a pod of the node, via the agent",
                           fetched, detail=cluster.ca.log)
        assert cert.identity == ledger
        cert.leaf.verify_directly_issued_by(istiod_root)
        assert cert.chain[-1] == istiod_root
        forwarded = sds.ca_servicer().forwarded
        assert forwarded >= 1
        # a pod of another node: refused by the agent, never forwarded
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.fetch_certificate(teller)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "impersonation" in e.value.details()
        assert sds.ca_servicer().forwarded == forwarded
    finally:
        await client.close()
    # SDS: the agent's own CA client (its token, ImpersonatedIdentity) for the pod
    item = await sds.cache.workload(ledger)
    leaf = x509.load_pem_x509_certificates(item.chain)[0]
    leaf.verify_directly_issued_by(istiod_root)
    from agent.sds import keys
    assert keys.uri_sans(leaf) == [ledger]
    rootca = await sds.cache.root_bundle(ledger)
    assert x509.load_pem_x509_certificates(rootca) == [istiod_root]
    assert key_files(agent.ctx.config.state_dir) == []


async def test_wrong_root_not_ready_no_certificate_no_key(cluster, tmp_path):
    from agent.tlsport.servercert import node_local_material
    _, other_root = node_local_material(["not-istiod"])
    wrong = tmp_path / "wrong-root.pem"
    wrong.write_bytes(other_root)
    agent = await cluster.agent(str(wrong), "bad")
    sds = agent.sds

    async def reported():
        ok, why = sds.ready()
        return not ok and "ca_root_cert" in why and sds._remote_checks >= 1

    await until("not ready, naming ca_root_cert", reported, timeout=60,
                detail=lambda: sds.ready()[1])
    ok, why = sds.ready()
    assert not ok and cluster.ca.ca_address in why, why
    assert sds.embedded is None and key_files(agent.ctx.config.state_dir) == []
    assert not os.path.exists(agent.ctx.config.mesh_root_file)  # no root learnt
    # ztunnel asking this agent (trusting its serving certificate's issuer) gets the error,
    # never a certificate of some other root
    client = await ZtunnelCaClient(f"https://localhost:{agent.xds.tls_port}",
                                   sds._serving_issuer,
                                   token=await cluster.pod_token("ztunnel")).start()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.fetch_certificate(f"spiffe://cluster.local/ns/{cluster.ns}/sa/ledger")
    finally:
        await client.close()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    assert "ca_root_cert" in e.value.details()
    assert key_files(agent.ctx.config.state_dir) == []


ZTUNNEL = os.environ.get("AMBIENT_TEST_ZTUNNEL", "")


def _readiness_port_free() -> bool:
    import socket
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", 15021))
            return True
        except OSError:
            return False


@pytest.mark.skipif(not (ZTUNNEL and os.access(ZTUNNEL, os.X_OK)),
                    reason="AMBIENT_TEST_ZTUNNEL does not name a ztunnel binary")
async def test_real_ztunnel_uses_the_agent_as_its_ca(cluster, tmp_path):
    """The real ztunnel's CA is the agent, whose CA is istiod: the certificate ztunnel
    prefetches for the node's HBONE pod is signed by istiod's root."""
    import base64 as b64
    import json

    from agent.demo.ztunnel import ZtunnelProcess, ZtunnelSettings
    if not _readiness_port_free():
        pytest.skip("port 15021 (ztunnel's fixed readiness port) is taken on this host")
    agent = await cluster.agent(cluster.root_file, "zt")
    sds = agent.sds
    await until("the agent ready", lambda: asyncio.sleep(0, sds.ready()[0]), timeout=60,
                detail=lambda: sds.ready()[1])
    token = tmp_path / "ztunnel.token"
    token.write_text(await cluster.pod_token("ztunnel"))
    os.chmod(token, 0o600)
    pns, pod_name, _ = cluster.pods["ztunnel"]
    admin = free_port()
    settings = ZtunnelSettings(
        binary=ZTUNNEL, xds_address=f"localhost:{agent.xds.tls_port}",
        root_cert=agent.ctx.config.mesh_root_file, token_file=str(token),
        zds_socket=str(tmp_path / "no-zds.sock"), node_name=NODE_A, admin_port=admin,
        stats_port=free_port(),
        extra_env={"POD_NAMESPACE": pns, "POD_NAME": pod_name, "INSTANCE_IP": "10.253.0.2"})
    zt = ZtunnelProcess(settings, tmp_path / "ztunnel.log")
    zt.start()
    ledger = f"spiffe://cluster.local/ns/{cluster.ns}/sa/ledger"

    def dump() -> dict:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{admin}/config_dump", timeout=5) as r:
                return json.loads(r.read())
        except OSError:
            return {}

    try:
        async def available():
            if zt.proc is not None and zt.proc.poll() is not None:
                raise AssertionError(f"ztunnel exited: {zt.log()[-3000:]}")
            certs = (await asyncio.to_thread(dump)).get("certificates") or []
            return next((c for c in certs if c.get("identity") == ledger
                         and c.get("state") == "Available"), None)

        entry = await until("ztunnel holds the pod's certificate (Available)", available,
                            timeout=90, detail=lambda: zt.log()[-3000:])
        leaf = x509.load_pem_x509_certificate(b64.b64decode(entry["certChain"][0]["pem"]))
        leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(cluster.istiod_root))
        assert sds.ca_servicer().forwarded >= 1
        assert key_files(agent.ctx.config.state_dir) == []
    finally:
        zt.stop()
