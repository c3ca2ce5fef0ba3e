"""One trust root per cluster, against the real kube-apiserver: the embedded CA of every
node's agent signs with the cluster's CA Secret (``cacerts``, else ``istio-ca-secret``),
bootstrapped race-free; a bad Secret is refused (never a root of the agent's own); a deleted
Secret keeps the loaded key; a new root rotates with an overlap; the root is published as
the ``istio-ca-root-cert`` ConfigMap by one elected agent.

Each test runs with its own system namespace holding the ``ambient-agent-ca`` Role of
deploy/kubernetes/rbac.yaml (copied into it unchanged but for the namespace), so the agents
use exactly the shipped permissions and tests never share a Secret."""

from __future__ import annotations

import asyncio
import base64
import copy
import datetime as dt
import logging
import subprocess

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509 import verification
from kubernetes_asyncio.client.exceptions import ApiException

from agent.sds import keys
from agent.sds.ca_embedded import create_root
from agent.sds.ca_istio import CAClientError
from agent.sds.server import SdsServer
from tests.helpers import eventually
from tests.kube import cluster as kc
from tests.kube.proxy import SlowApiProxy
from tests.sds.helpers import executor_runner, make_config


def _ca_role_documents(namespace: str) -> list[dict]:
    docs = [d for d in kc.manifest("rbac.yaml") if d["metadata"].get("name") == "ambient-agent-ca"]
    assert {d["kind"] for d in docs} == {"Role", "RoleBinding"}, docs
    out = []
    for d in docs:
        d = copy.deepcopy(d)
        d["metadata"]["namespace"] = namespace
        out.append(d)
    return out


@pytest.fixture
async def system_ns(kube_admin):
    """A fresh system namespace with the shipped ``ambient-agent-ca`` Role bound to the
    agent's ServiceAccount."""
    name = kc.unique("sys")
    await kc.create_namespace(kube_admin, name)
    for d in _ca_role_documents(name):
        await kc.apply(kube_admin, d)
    try:
        yield name
    finally:
        await kc.delete_namespace(kube_admin, name)


@pytest.fixture
async def agents(kube_cluster, kube_admin, tmp_path):
    """``make(system_ns, node, server="", **settings)`` -> an SdsServer (not started) in
    Kubernetes mode with its own token of the agent's ServiceAccount (``server``: another
    API URL, a proxy in front of the cluster's); all stopped at the end."""
    run = executor_runner()
    made: list[tuple[SdsServer, object]] = []

    async def make(system_ns: str, node: str, server: str = "", **overrides) -> SdsServer:
        kubeconfig = await kc.agent_kubeconfig(kube_cluster, kube_admin,
                                               str(tmp_path / f"{node}.kubeconfig"),
                                               server=server)
        api = await kc.client_from_kubeconfig(kubeconfig)
        state = tmp_path / node
        state.mkdir()
        overrides.setdefault("ca_root_publish", False)
        cfg = make_config(state, config_source="kubernetes", kubeconfig=kubeconfig,
                          system_namespace=system_ns, node_name=node, mesh_root_file=str(
                              state / "mesh-root" / "root-cert.pem"), **overrides)
        server = SdsServer(cfg, run, kube_api=lambda: api)
        made.append((server, api))
        return server

    try:
        yield make
    finally:
        for server, api in made:
            await server.stop(0.2)
            await api.close()
        run.pool.shutdown(wait=False)


async def get_secret(api, ns: str, name: str) -> dict | None:
    try:
        return await kc.request(api, "GET", f"/api/v1/namespaces/{ns}/secrets/{name}")
    except ApiException as e:
        if e.status == 404:
            return None
        raise


async def until(predicate, timeout: float, what: str) -> None:
    """Await the async ``predicate`` every 0.2 s until it is truthy (AssertionError after
    ``timeout`` s)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await predicate():
        if loop.time() > deadline:
            raise AssertionError(f"{what} not reached within {timeout:g}s")
        await asyncio.sleep(0.2)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def cacerts_data(root: x509.Certificate, root_key, name: str
                 ) -> tuple[dict[str, str], x509.Certificate]:
    """``cacerts`` data (base64) of a plug-in CA: a new ECDSA intermediate with subject
    O=``name`` under ``root``, with the key identifiers real CA tooling writes (AKI = the
    root's SKI), so verifiers tell apart two roots with the same subject (every root
    :func:`agent.sds.ca_embedded.create_root` makes is O=<trust domain>, as istiod's are).
    Returns (data, intermediate)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    key = keys.generate_key("ECDSA")
    start = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1)
    ski = root.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    inter = (x509.CertificateBuilder()
             .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, name)]))
             .issuer_name(root.subject).public_key(key.public_key())
             .serial_number(x509.random_serial_number())
             .not_valid_before(start).not_valid_after(start + dt.timedelta(days=365))
             .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
             .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                          key_encipherment=False, data_encipherment=False,
                                          key_agreement=False, key_cert_sign=True,
                                          crl_sign=True, encipher_only=False,
                                          decipher_only=False), critical=True)
             .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                            critical=False)
             .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski),
                            critical=False)
             .sign(root_key, hashes.SHA256()))

    def pem(c: x509.Certificate) -> bytes:
        return c.public_bytes(serialization.Encoding.PEM)

    return ({"ca-cert.pem": b64(pem(inter)), "ca-key.pem": b64(keys.key_pem(key)),
             "root-cert.pem": b64(pem(root)), "cert-chain.pem": b64(pem(inter) + pem(root))},
            inter)


def verify_leaf(chain_pem: bytes, bundle: bytes) -> str:
    """Verify a leaf (first certificate of ``chain_pem``) against ``bundle`` with
    cryptography's path builder (as a client certificate, for its SPIFFE SAN), and with
    ``openssl verify``; returns the leaf's URI SAN."""
    certs = x509.load_pem_x509_certificates(chain_pem)
    roots = x509.load_pem_x509_certificates(bundle)
    verifier = (verification.PolicyBuilder().store(verification.Store(roots))
                .build_client_verifier())
    verified = verifier.verify(certs[0], certs[1:])
    assert verified.subjects, "no SAN verified"
    return keys.uri_sans(certs[0])[0]


def openssl_verify(tmp_path, chain_pem: bytes, bundle: bytes, name: str) -> subprocess.CompletedProcess:
    leaf = tmp_path / f"{name}-leaf.pem"
    ca = tmp_path / f"{name}-bundle.pem"
    leaf.write_bytes(x509.load_pem_x509_certificates(chain_pem)[0].public_bytes(
        serialization.Encoding.PEM))
    ca.write_bytes(bundle)
    return subprocess.run(["openssl", "verify", "-CAfile", str(ca), str(leaf)],
                          capture_output=True, text=True)


async def test_two_agents_started_at_once_end_with_one_root(agents, system_ns, kube_admin,
                                                            tmp_path):
    a = await agents(system_ns, kc.unique("node-a"))
    b = await agents(system_ns, kc.unique("node-b"))
    await asyncio.gather(a.start(), b.start())  # both find no Secret, both create
    assert a.ready() == (True, "") and b.ready() == (True, "")
    assert a.root_pem() and a.root_pem() == b.root_pem()
    assert [a.kube_ca.bootstrapped, b.kube_ca.bootstrapped].count(True) == 1
    secret = await get_secret(kube_admin, system_ns, "istio-ca-secret")
    assert secret["type"] == "istio.io/ca-root"
    data = {k: base64.b64decode(v or "") for k, v in secret["data"].items()}
    assert data["ca-cert.pem"] == data["root-cert.pem"]
    assert keys.merge_trust(data["root-cert.pem"]) == a.root_pem()
    assert await get_secret(kube_admin, system_ns, "cacerts") is None
    # each node's leaf verifies against the other node's bundle (its published file too)
    ida = f"spiffe://cluster.local/ns/{system_ns}/sa/a"
    idb = f"spiffe://cluster.local/ns/{system_ns}/sa/b"
    ca_, cb = await a.certificate_for([ida]), await b.certificate_for([idb])
    with open(b.config.mesh_root_file, "rb") as f:
        b_file = f.read()
    assert verify_leaf(ca_.chain, b_file) == ida
    assert verify_leaf(cb.chain, a.root_pem()) == idb
    for name, chain, bundle in (("a", ca_.chain, b.root_pem()), ("b", cb.chain, a.root_pem())):
        proc = openssl_verify(tmp_path, chain, bundle, name)
        assert proc.returncode == 0 and ": OK" in proc.stdout, proc.stdout + proc.stderr
    # a third agent, later, reads the same Secret and creates nothing
    c = await agents(system_ns, kc.unique("node-c"))
    await c.start()
    assert c.root_pem() == a.root_pem() and not c.kube_ca.bootstrapped


async def test_plugin_cacerts_wins_over_istio_ca_secret(agents, system_ns, kube_admin):
    from tests.sds.test_ca_kube import intermediate, pem
    root, root_key = create_root("cluster.local")
    inter, inter_key = intermediate(root, root_key)
    other_root, other_key = create_root("cluster.local")
    await kc.request(kube_admin, "POST", f"/api/v1/namespaces/{system_ns}/secrets", body={
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "istio-ca-secret"},
        "type": "istio.io/ca-root",
        "data": {"ca-cert.pem": b64(pem(other_root)), "ca-key.pem": b64(keys.key_pem(other_key))}})
    await kc.request(kube_admin, "POST", f"/api/v1/namespaces/{system_ns}/secrets", body={
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "cacerts"},
        "data": {"ca-cert.pem": b64(pem(inter)), "ca-key.pem": b64(keys.key_pem(inter_key)),
                 "root-cert.pem": b64(pem(root)),
                 "cert-chain.pem": b64(pem(inter) + pem(root))}})
    a = await agents(system_ns, kc.unique("node-a"))
    await a.start()
    assert a.ready() == (True, "")
    assert x509.load_pem_x509_certificates(a.root_pem()) == [root]
    bundle = await a.certificate_for([f"spiffe://cluster.local/ns/{system_ns}/sa/x"])
    chain = x509.load_pem_x509_certificates(bundle.chain)
    assert chain[1] == inter  # leaf, the plug-in chain, the root (istiod's response order)
    assert verify_leaf(bundle.chain, a.root_pem())


async def test_bad_secret_refuses_to_sign_names_it_and_never_falls_back(agents, system_ns,
                                                                       kube_admin, caplog):
    root, _ = create_root("cluster.local")
    _, wrong_key = create_root("cluster.local")
    pem_root = root.public_bytes(serialization.Encoding.PEM)
    await kc.request(kube_admin, "POST", f"/api/v1/namespaces/{system_ns}/secrets", body={
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "cacerts"},
        "data": {"ca-cert.pem": b64(pem_root), "ca-key.pem": b64(keys.key_pem(wrong_key)),
                 "root-cert.pem": b64(pem_root), "cert-chain.pem": b64(pem_root)}})
    caplog.set_level(logging.ERROR, logger="agent.sds.ca_kube")
    a = await agents(system_ns, kc.unique("node-a"))
    await a.start()  # the agent runs, and says why it is not ready
    ok, why = a.ready()
    assert not ok and f"Secret {system_ns}/cacerts key ca-key.pem" in why, why
    lines = [r.getMessage() for r in caplog.records if "cacerts" in r.getMessage()]
    assert len(lines) == 1 and "key ca-key.pem" in lines[0] and "does not match" in lines[0]
    with pytest.raises(CAClientError) as e:
        await a.certificate_for([f"spiffe://cluster.local/ns/{system_ns}/sa/x"])
    assert "CA is not ready" in str(e.value) and "ca-key.pem" in str(e.value)
    assert a.root_pem() == b""  # nothing of its own
    assert await get_secret(kube_admin, system_ns, "istio-ca-secret") is None
    await a.kube_ca.sync()
    await a.kube_ca.sync()
    lines = [r.getMessage() for r in caplog.records if "cacerts" in r.getMessage()]
    assert len(lines) == 1, lines  # one line, not one per retry


async def test_secret_deleted_while_running_keeps_the_key_and_warns_once(agents, system_ns,
                                                                        kube_admin, caplog):
    a = await agents(system_ns, kc.unique("node-a"))
    await a.start()
    root = a.root_pem()
    caplog.set_level(logging.WARNING, logger="agent.sds.ca_kube")
    await kc.request(kube_admin, "DELETE",
                     f"/api/v1/namespaces/{system_ns}/secrets/istio-ca-secret")
    await eventually(lambda: any("was deleted" in r.getMessage() for r in caplog.records),
                     timeout=20, what="the deletion noticed (watch)")
    await a.kube_ca.sync()
    await a.kube_ca.sync()
    warned = [r for r in caplog.records if "was deleted" in r.getMessage()]
    assert len(warned) == 1 and f"{system_ns}/istio-ca-secret" in warned[0].getMessage()
    assert a.root_pem() == root and a.ready() == (True, "")
    cert = await a.certificate_for([f"spiffe://cluster.local/ns/{system_ns}/sa/x"])
    assert verify_leaf(cert.chain, root)
    assert await get_secret(kube_admin, system_ns, "istio-ca-secret") is None  # not re-created


async def test_root_rotation_overlap_then_switch(agents, system_ns, kube_admin, tmp_path):
    """A new root in the Secret: the bundle carries old + new at once, signing stays on the
    old key for ``ca_root_overlap``, then switches. Certificates signed before and after
    the switch verify against the bundle served during the overlap (no connection made
    with either fails), and against the published ConfigMap."""
    a = await agents(system_ns, kc.unique("node-a"), ca_root_overlap=4.0, ca_root_publish=True)
    b = await agents(system_ns, kc.unique("node-b"), ca_root_overlap=4.0, ca_root_publish=True)
    await asyncio.gather(a.start(), b.start())
    old_root = a.root_pem()
    ident = f"spiffe://cluster.local/ns/{system_ns}/sa/x"
    before = await a.certificate_for([ident])
    new_root, new_key = create_root("cluster.local")
    new_pem = new_root.public_bytes(serialization.Encoding.PEM)
    await kc.request(kube_admin, "PATCH",
                     f"/api/v1/namespaces/{system_ns}/secrets/istio-ca-secret",
                     body={"data": {"ca-cert.pem": b64(new_pem),
                                    "ca-key.pem": b64(keys.key_pem(new_key)),
                                    "root-cert.pem": b64(new_pem)}},
                     content_type="application/merge-patch+json")
    both = keys.merge_trust(old_root, new_pem)
    await eventually(lambda: a.root_pem() == both and b.root_pem() == both, timeout=20,
                     what="old + new roots in both agents' bundles")
    overlap_bundle = a.root_pem()

    def published_file() -> bytes:
        with open(a.config.mesh_root_file, "rb") as f:
            return f.read().strip()

    # written by a task the change starts: wait for it, do not race it
    await eventually(lambda: published_file() == overlap_bundle.strip(), timeout=10,
                     what="old + new roots in mesh_root_file")
    during = await a.certificate_for([ident])
    issuer = x509.load_pem_x509_certificates(during.chain)[0].issuer
    assert issuer == x509.load_pem_x509_certificate(old_root).subject  # still the old key
    assert during.root == overlap_bundle  # the CA response's last element: the bundle
    await eventually(lambda: a.kube_ca.pending is None and b.kube_ca.pending is None,
                     timeout=20, what="signing switched after the overlap")
    after = await b.certificate_for([ident])
    leaf_after = x509.load_pem_x509_certificates(after.chain)[0]
    leaf_after.verify_directly_issued_by(new_root)
    for name, cert in (("before", before), ("during", during), ("after", after)):
        assert verify_leaf(cert.chain, overlap_bundle) == ident
        proc = openssl_verify(tmp_path, cert.chain, overlap_bundle, name)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    # old leaves are still valid: the old root stays in the bundle after the switch
    assert x509.load_pem_x509_certificate(old_root) in x509.load_pem_x509_certificates(
        a.root_pem())


async def test_root_configmap_published_by_one_agent_recreated_and_istiod_respected(
        agents, system_ns, kube_admin, kube_namespace):
    a = await agents(system_ns, kc.unique("node-a"), ca_root_publish=True)
    b = await agents(system_ns, kc.unique("node-b"), ca_root_publish=True)
    await asyncio.gather(a.start(), b.start())
    path = f"/api/v1/namespaces/{kube_namespace}/configmaps/istio-ca-root-cert"

    async def published() -> dict | None:
        try:
            return await kc.request(kube_admin, "GET", path)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    cm: dict | None = None

    async def has_root() -> bool:
        nonlocal cm
        cm = await published()
        return bool(cm) and cm["data"].get("root-cert.pem") == a.root_pem().decode()

    await until(has_root, timeout=30, what="istio-ca-root-cert in a namespace")
    assert cm["metadata"]["labels"] == {"istio.io/config": "true"}
    await eventually(lambda: [a.publisher.leading, b.publisher.leading].count(True) == 1,
                     timeout=20, what="exactly one leader")
    lease = await kc.request(kube_admin, "GET", f"/apis/coordination.k8s.io/v1/namespaces/"
                                                f"{system_ns}/leases/ambient-agent-ca-root-publisher")
    leader = a if a.publisher.leading else b
    assert lease["spec"]["holderIdentity"] == leader.config.node_name
    # deleted -> re-created; changed -> restored
    await kc.request(kube_admin, "DELETE", path)
    await until(has_root, timeout=30, what="the deleted ConfigMap re-created")
    await kc.request(kube_admin, "PATCH", path, body={"data": {"root-cert.pem": "x"}},
                     content_type="application/merge-patch+json")
    await until(has_root, timeout=30, what="the changed ConfigMap restored")
    # a new namespace gets it
    ns2 = kc.unique("t2")
    await kc.create_namespace(kube_admin, ns2)
    try:
        async def in_new() -> bool:
            try:
                got = await kc.request(kube_admin, "GET", f"/api/v1/namespaces/{ns2}/configmaps/"
                                                          "istio-ca-root-cert")
            except ApiException:
                return False
            return got["data"]["root-cert.pem"] == a.root_pem().decode()
        await until(in_new, timeout=30, what="a new namespace's ConfigMap")
    finally:
        await kc.delete_namespace(kube_admin, ns2)
    # istiod's namespace controller holds its election: the agents step aside
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    record = ('{"holderIdentity":"istiod-1","leaseDurationSeconds":30,'
              f'"acquireTime":"{now}","renewTime":"{now}","leaderTransitions":0}}')
    await kc.request(kube_admin, "POST", f"/api/v1/namespaces/{system_ns}/configmaps", body={
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "istio-namespace-controller-election",
                     "annotations": {"control-plane.alpha.kubernetes.io/leader": record}}})
    await eventually(lambda: not a.publisher.leading and not b.publisher.leading
                     and a.publisher.istiod_active and b.publisher.istiod_active, timeout=20,
                     what="both agents stepped aside for istiod")
    await kc.request(kube_admin, "DELETE", path)
    await asyncio.sleep(3)
    assert await published() is None  # nobody fights istiod


async def test_rotation_warns_when_the_overlap_ends_before_renewals(agents, system_ns,
                                                                    kube_admin, caplog):
    """ztunnel learns a new root only with its next certificate, at half the span of the
    one it holds: an overlap shorter than that lets signing switch while a holder trusts
    the old root alone (docs/trust.md). Agent a's CA service signed a 10-minute
    certificate (renewed ~4 minutes after issue) before the rotation and its overlap is
    4 s: it warns, once, naming the setting. Agent b signed the same lifetime for SDS
    only, whose clients get a changed root bundle pushed at once: no warning."""
    a = await agents(system_ns, kc.unique("node-a"), ca_root_overlap=4.0)
    b = await agents(system_ns, kc.unique("node-b"), ca_root_overlap=4.0)
    await asyncio.gather(a.start(), b.start())
    ident = f"spiffe://cluster.local/ns/{system_ns}/sa/x"
    _, csr = keys.new_key_and_csr("ECDSA", [ident])
    a.embedded.sign_for_peer(csr, [ident], 600)  # what the CA service does for ztunnel
    await b.certificate_for([ident], ttl=600)
    caplog.set_level(logging.WARNING, logger="agent.sds.ca_kube")
    new_root, new_key = create_root("cluster.local")
    new_pem = new_root.public_bytes(serialization.Encoding.PEM)
    await kc.request(kube_admin, "PATCH",
                     f"/api/v1/namespaces/{system_ns}/secrets/istio-ca-secret",
                     body={"data": {"ca-cert.pem": b64(new_pem),
                                    "ca-key.pem": b64(keys.key_pem(new_key)),
                                    "root-cert.pem": b64(new_pem)}},
                     content_type="application/merge-patch+json")
    await eventually(lambda: a.kube_ca.pending is not None and b.kube_ca.pending is not None,
                     timeout=20, what="both agents in the rotation's overlap")
    warned = [r.getMessage() for r in caplog.records if "ca_root_overlap" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "ca_root_overlap 4s is too short" in warned[0] and "SECRET_TTL/2" in warned[0]


async def test_first_read_asks_for_both_secrets_at_once_and_start_does_not_read_again(
        agents, system_ns, kube_cluster):
    """Issue 28 (cold start): the agent begins the CA Secret read with ``prefetch_ca()``
    while its config source lists; that first read GETs ``cacerts`` and
    ``istio-ca-secret`` at once (one round trip, not two, on a slow API server: a proxy
    holding each GET 0.5 s); ``start()`` awaits it instead of reading again; a later
    resync asks one after the other (the second only when cacerts is not used)."""
    proxy = await SlowApiProxy(kube_cluster.url, kube_cluster.ca_file, list_delay=0.5).start()
    a = None
    try:
        a = await agents(system_ns, kc.unique("node-a"), server=proxy.url)
        paths = [f"/api/v1/namespaces/{system_ns}/secrets/{n}"
                 for n in ("cacerts", "istio-ca-secret")]
        a.prefetch_ca()
        both = frozenset(paths)
        await eventually(lambda: any(both <= t for t in proxy.together), timeout=30,
                         what="both Secret GETs in flight together")
        await a.start()
        assert a.ready() == (True, "") and a.kube_ca is not None and a.kube_ca.bootstrapped
        assert [proxy.gets.get(p) for p in paths] == [1, 1], proxy.gets
        proxy.together.clear()
        await a.kube_ca.sync()  # a resync: neither Secret is cacerts, so both, in turn
        assert [proxy.gets.get(p) for p in paths] == [2, 2], proxy.gets
        assert not any(both <= t for t in proxy.together), proxy.together
    finally:
        if a is not None:
            await a.stop(0.2)  # its Secret watches end before the proxy stops
        await proxy.stop()


async def test_prefetch_is_a_no_op_without_an_api_client_and_start_still_refuses_cleanly(
        tmp_path):
    """``prefetch_ca()`` before the config source has its client does nothing; ``start()``
    then reads as it always did: no client is a CA that refuses, naming why (not a
    crash)."""
    run = executor_runner()
    state = tmp_path / "node"
    state.mkdir()
    cfg = make_config(state, config_source="kubernetes", kubeconfig="/nonexistent",
                      system_namespace="istio-system", node_name="n", ca_root_publish=False,
                      mesh_root_file=str(state / "mesh-root" / "root-cert.pem"))
    server = SdsServer(cfg, run, kube_api=lambda: None)
    try:
        server.prefetch_ca()
        assert server._ca_read is None and server.kube_ca is None
        await server.start()
        ok, why = server.ready()
        assert not ok and "no Kubernetes API client" in why, why
    finally:
        await server.stop(0.2)
        run.pool.shutdown(wait=False)
