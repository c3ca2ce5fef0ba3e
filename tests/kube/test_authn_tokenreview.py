"""The TLS port's Kubernetes authentication against the real kube-apiserver: the
TokenReview authenticator (agent/tlsport/authn.py) as the DaemonSet's service account, with
real service-account tokens; then the agent as the daemon builds it in Kubernetes mode,
with ztunnel's xDS and CA clients (written from ztunnel's source, tests/ztunnel_exact)
presenting a real projected-style token bound to ztunnel's pod."""

from __future__ import annotations

import pytest

from agent.tlsport.authn import AuthenticationError, Authenticator, TokenReviewAuthenticator
from tests.kube import cluster as kc
from tests.ztunnel_exact.ca import ZtunnelCaClient
from tests.ztunnel_exact.conftest import agent_dir, make_agent  # noqa: F401 - fixtures
from tests.ztunnel_exact.xds import ADDRESS_TYPE, ZtunnelEnv, ZtunnelXdsClient


async def test_token_review_accepts_a_service_account_token_and_names_each_refusal(
        kube_cluster, kube_admin, agent_kubeconfig, kube_namespace):
    ns = kube_namespace
    await kc.create_service_account(kube_admin, ns, "ztunnel")
    await kc.create_node(kube_admin, "node-tr")
    pod = await kc.create_pod(kube_admin, "ztunnel-0", ns, "node-tr", service_account="ztunnel")
    good = await kc.service_account_token(kube_admin, ns, "ztunnel", audiences=["istio-ca"],
                                          bound_pod=("ztunnel-0", pod["metadata"]["uid"]))
    wrong_audience = await kc.service_account_token(kube_admin, ns, "ztunnel",
                                                    audiences=["not-istio"])
    agent_api = await kc.client_from_kubeconfig(agent_kubeconfig)
    try:
        reviewer = TokenReviewAuthenticator(agent_api, ["istio-ca"], "cluster.local",
                                            "Kubernetes")
        chain = Authenticator("cluster.local", token_review=reviewer)
        caller = await chain.authenticate_token(good, "Kubernetes")
        assert caller.spiffe_id == f"spiffe://cluster.local/ns/{ns}/sa/ztunnel"
        assert (caller.source, caller.pod_name, caller.pod_uid) == (
            "TokenReview", "ztunnel-0", pod["metadata"]["uid"])
        assert (await chain.authenticate_token(good)).spiffe_id == caller.spiffe_id
        assert reviewer.reviews == 1  # the second answer came from the cache
        for token, reason in ((wrong_audience, "wrong audience"),
                              (good[:-6] + "AAAAAA", "invalid or expired")):
            with pytest.raises(AuthenticationError) as e:
                await chain.authenticate_token(token)
            assert reason in str(e.value) and token not in str(e.value)
        with pytest.raises(AuthenticationError, match="client claims to be in cluster 'east'"):
            await chain.authenticate_token(good, "east")
    finally:
        await agent_api.close()
    # an identity without the ClusterRole of rbac.yaml may not review tokens
    await kc.create_service_account(kube_admin, ns, "nobody")
    nobody_token = await kc.service_account_token(kube_admin, ns, "nobody")
    nobody = await kc.client_from_kubeconfig(kc.kubeconfig_for_token(
        kube_cluster, nobody_token, agent_kubeconfig + ".nobody", user="nobody"))
    try:
        with pytest.raises(AuthenticationError, match="TokenReview answered HTTP 403"):
            await TokenReviewAuthenticator(nobody, ["istio-ca"], "cluster.local",
                                           "Kubernetes").authenticate(good)
    finally:
        await nobody.close()


async def test_ztunnel_with_a_real_token_is_served_xds_and_certificates(
        kube_admin, agent_kubeconfig, kube_namespace, make_agent):  # noqa: F811
    ns, node = kube_namespace, kc.unique("node")
    await kc.create_node(kube_admin, node)
    for sa in ("ztunnel", "ledger"):
        await kc.create_service_account(kube_admin, ns, sa)
    zt = await kc.create_pod(kube_admin, "ztunnel-0", ns, node, service_account="ztunnel")
    await kc.create_pod(kube_admin, "ledger-0", ns, node, service_account="ledger")
    await kc.set_pod_status(kube_admin, ns, "ledger-0", ips=["10.9.0.7"])
    token = await kc.service_account_token(kube_admin, ns, "ztunnel", audiences=["istio-ca"],
                                           bound_pod=("ztunnel-0", zt["metadata"]["uid"]))
    agent = await make_agent(config_source="kubernetes", kubeconfig=agent_kubeconfig,
                             node_name=node, ca_trusted_node_accounts=f"{ns}/ztunnel",
                             tokens_file="")
    xds = await ZtunnelXdsClient(ZtunnelEnv(
        xds_address=f"https://localhost:{agent.xds.tls_port}", xds_root_ca=agent.root_pem,
        token=token, node_name=node, pod_name="ztunnel-0", pod_namespace=ns)).start()
    ca = await ZtunnelCaClient(f"https://localhost:{agent.xds.tls_port}", agent.root_pem,
                               token=token).start()
    try:
        await xds.wait_ready()
        assert any(name.endswith(f"/Pod/{ns}/ledger-0") for name in xds.resources[ADDRESS_TYPE])
        [state] = agent.xds.debug_state()["clients"]
        assert state["identity"] == f"spiffe://cluster.local/ns/{ns}/sa/ztunnel"
        ledger = f"spiffe://cluster.local/ns/{ns}/sa/ledger"
        assert (await ca.fetch_certificate(ledger)).identity == ledger
    finally:
        await ca.close()
        await xds.close()
    bad = await ZtunnelXdsClient(ZtunnelEnv(
        xds_address=f"https://localhost:{agent.xds.tls_port}", xds_root_ca=agent.root_pem,
        token=token + "x", node_name=node, pod_name="ztunnel-0", pod_namespace=ns)).start()
    try:
        code, details = await bad.wait_terminated()
        assert code == "UNAUTHENTICATED" and "rejected by the Kubernetes API" in details
    finally:
        await bad.close()
