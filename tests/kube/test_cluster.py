"""The test cluster itself (scripts/kube-test-apiserver.sh + tests/kube/cluster.py) against
the real kube-apiserver: RBAC is enforced for the DaemonSet's service account, TokenRequest
and TokenReview work, deploy/crds/crds.yaml serves every version with unknown fields
kept, and the kubelet-playing helpers produce what the kubelet would."""

from __future__ import annotations

import os

import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from ambient.source_kube import RESOURCES
from tests.kube import cluster as kc


async def test_agent_service_account_is_bound_by_rbac_yaml_and_nothing_more(agent_kubeconfig):
    agent = await kc.client_from_kubeconfig(agent_kubeconfig)
    try:
        who = await kc.request(agent, "POST",
                               "/apis/authentication.k8s.io/v1/selfsubjectreviews",
                               body={"apiVersion": "authentication.k8s.io/v1",
                                     "kind": "SelfSubjectReview"})
        assert who["status"]["userInfo"]["username"] == \
            "system:serviceaccount:istio-system:ambient-agent"
        for _kind, (_, group, version, plural) in RESOURCES.items():
            base = f"/api/{version}" if not group else f"/apis/{group}/{version}"
            await kc.request(agent, "GET", f"{base}/{plural}", query=[("limit", 1)])
        for path in ("/api/v1/secrets", "/api/v1/configmaps",
                     "/api/v1/namespaces/istio-system/serviceaccounts"):
            with pytest.raises(ApiException) as err:
                await kc.request(agent, "GET", path)
            assert err.value.status == 403, path
        with pytest.raises(ApiException) as err:  # patch only through pods/status
            await kc.request(agent, "PATCH", "/api/v1/namespaces/default/pods/x",
                             body={"metadata": {"labels": {"a": "b"}}},
                             content_type="application/merge-patch+json")
        assert err.value.status == 403
    finally:
        await agent.close()


async def test_token_request_and_token_review(kube_cluster, kube_admin, kube_namespace,
                                               tmp_path):
    await kc.create_service_account(kube_admin, kube_namespace, "app")
    token = await kc.service_account_token(kube_admin, kube_namespace, "app",
                                           audiences=["istio-ca"])
    status = await kc.token_review(kube_admin, token, audiences=["istio-ca"])
    assert status["authenticated"] is True
    assert status["user"]["username"] == f"system:serviceaccount:{kube_namespace}:app"
    assert status["audiences"] == ["istio-ca"]
    wrong = await kc.token_review(kube_admin, token, audiences=["other"])
    assert not wrong.get("authenticated")
    forged = await kc.token_review(kube_admin, token[:-4] + "AAAA")
    assert not forged.get("authenticated") and forged.get("error")
    path = await kc.service_account_kubeconfig(kube_cluster, kube_admin, kube_namespace, "other",
                                               str(tmp_path / "other.kubeconfig"))
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    other = await kc.client_from_kubeconfig(path)
    try:
        who = await kc.request(other, "POST",
                               "/apis/authentication.k8s.io/v1/selfsubjectreviews",
                               body={"apiVersion": "authentication.k8s.io/v1",
                                     "kind": "SelfSubjectReview"})
        assert who["status"]["userInfo"]["username"] == \
            f"system:serviceaccount:{kube_namespace}:other"
    finally:
        await other.close()


async def test_crds_serve_every_version_and_keep_unknown_fields(kube_admin, kube_namespace):
    spec = {"action": "DENY", "rules": [{"from": [{"source": {"principals": ["x"]}}]}],
            "someFutureField": {"nested": [1, 2]}}
    await kc.apply(kube_admin, {"apiVersion": "security.istio.io/v1", "kind":
                                "AuthorizationPolicy",
                                "metadata": {"name": "p", "namespace": kube_namespace},
                                "spec": spec})
    for version in ("v1", "v1beta1"):
        got = await kc.request(kube_admin, "GET", f"/apis/security.istio.io/{version}/"
                               f"namespaces/{kube_namespace}/authorizationpolicies/p")
        assert got["spec"] == spec
    for path in ("/apis/networking.istio.io/v1alpha3/serviceentries",
                 "/apis/networking.istio.io/v1beta1/workloadentries",
                 "/apis/security.istio.io/v1beta1/peerauthentications",
                 "/apis/gateway.networking.k8s.io/v1beta1/gateways",
                 "/apis/gateway.networking.k8s.io/v1/gatewayclasses"):
        await kc.request(kube_admin, "GET", path)
    with pytest.raises(ApiException) as err:  # structural schema: spec must be an object
        await kc.request(kube_admin, "POST", f"/apis/networking.istio.io/v1/namespaces/"
                         f"{kube_namespace}/serviceentries",
                         body={"apiVersion": "networking.istio.io/v1", "kind": "ServiceEntry",
                               "metadata": {"name": "bad"}, "spec": "not-an-object"})
    assert err.value.status == 422 and "spec" in err.value.reason


async def test_playing_the_kubelet(kube_admin, kube_namespace):
    node = kc.unique("node")
    await kc.create_node(kube_admin, node, ip="127.0.0.1")
    try:
        created = await kc.create_pod(kube_admin, "a", kube_namespace, node,
                                      labels={"app": "a"})
        assert created["status"]["phase"] == "Pending"
        assert created["spec"]["serviceAccountName"] == "default"
        pod = await kc.set_pod_status(kube_admin, kube_namespace, "a",
                                      ips=["10.1.0.5", "fd00::5"])
        assert pod["status"]["phase"] == "Running"
        assert [i["ip"] for i in pod["status"]["podIPs"]] == ["10.1.0.5", "fd00::5"]
        assert {c["type"]: c["status"] for c in pod["status"]["conditions"]}["Ready"] == "True"
        listed = await kc.request(kube_admin, "GET", "/api/v1/pods",
                                  query=[("fieldSelector", f"spec.nodeName={node}")])
        assert [p["metadata"]["name"] for p in listed["items"]] == ["a"]
        await kc.delete_pod(kube_admin, kube_namespace, "a")
        with pytest.raises(ApiException) as err:
            await kc.request(kube_admin, "GET", f"/api/v1/namespaces/{kube_namespace}/pods/a")
        assert err.value.status == 404
    finally:
        await kc.delete_node(kube_admin, node)


def test_script_second_server_own_ports_stop_cleans_and_refuses_foreign_dirs(kube_cluster,
                                                                              tmp_path):
    """Two servers coexist (a second test run, say): their own free ports, their own etcd;
    `stop` ends both processes and removes the directory; `stop` and `start` refuse a
    directory the script did not make / one that is not empty."""
    import subprocess

    second = tmp_path / "second"
    run = lambda *a: subprocess.run(["bash", kc.SCRIPT, *a], capture_output=True,  # noqa: E731
                                    text=True, timeout=180)
    started = run("start", str(second))
    assert started.returncode == 0, started.stderr
    try:
        env = kc.read_env(str(second))
        assert env["KUBE_APISERVER_PORT"] != kube_cluster.env["KUBE_APISERVER_PORT"]
        assert env["ETCD_PORT"] != kube_cluster.env["ETCD_PORT"]
        assert oct(second.stat().st_mode & 0o777) == "0o700"
        pids = [int((second / f).read_text()) for f in ("etcd.pid", "kube-apiserver.pid")]
    finally:
        stopped = run("stop", str(second))
    assert stopped.returncode == 0, stopped.stderr
    assert not second.exists()
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or \
            open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep").write_text("x")
    refused = run("stop", str(foreign))
    assert refused.returncode != 0 and "not touching it" in refused.stderr
    assert (foreign / "keep").exists()
    refused = run("start", str(foreign))
    assert refused.returncode != 0 and "not empty" in refused.stderr
