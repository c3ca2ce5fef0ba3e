"""``ambient-agent precheck``'s ``Kubernetes API`` line against the real kube-apiserver:
OK as the DaemonSet's ServiceAccount (deploy/kubernetes/rbac.yaml as shipped); FAIL, in
one line, for a token the server refuses (401), for a ServiceAccount whose ClusterRole
lacks a verb on a kind the agent lists (403: each refused ``verb Kind`` named), and for a
server nobody answers on (naming its URL)."""

from __future__ import annotations

import asyncio
import contextlib
import os

from agent import precheck
from agent.core.config import load
from agent.demo.envoy import free_port
from ambient.source_kube import RESOURCES
from tests.kube import cluster as kc

RBAC = "/apis/rbac.authorization.k8s.io/v1"


def _config(kubeconfig: str, tmp_path):
    return load({"config_file": os.devnull, "state_dir": str(tmp_path / "state"),
                 "config_source": "kubernetes", "kubeconfig": kubeconfig}, env={})


async def _check(kubeconfig: str, tmp_path) -> precheck.Check:
    return await asyncio.to_thread(precheck.check_kube_api, _config(kubeconfig, tmp_path))


async def test_ok_as_the_daemonsets_service_account(agent_kubeconfig, kube_cluster, tmp_path):
    c = await _check(agent_kubeconfig, tmp_path)
    assert c.state == precheck.OK, c
    assert c.detail == (f"{kube_cluster.url}: list and watch allowed for all "
                        f"{len(RESOURCES)} kinds the agent reads")


async def test_a_refused_token_is_a_fail_naming_the_credentials(kube_cluster, tmp_path):
    kubeconfig = kc.kubeconfig_for_token(kube_cluster, "not-a-valid-token",
                                         str(tmp_path / "bad.kubeconfig"))
    c = await _check(kubeconfig, tmp_path)
    assert c.state == precheck.FAIL, c
    assert c.detail.startswith(f"{kube_cluster.url} answered 401 Unauthorized: it refuses "
                               f"the token or certificate of kubeconfig {kubeconfig}"), c
    assert "not-a-valid-token" not in c.line()
    assert "\n" not in c.line()


@contextlib.asynccontextmanager
async def service_account_with(api, namespace: str, rules: list[dict]):
    """ServiceAccount ``namespace/partial`` bound to a fresh ClusterRole of ``rules``;
    the role and binding are deleted at exit."""
    name = kc.unique("precheck")
    await kc.create_service_account(api, namespace, "partial")
    await kc.apply(api, {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                         "metadata": {"name": name}, "rules": rules})
    try:
        await kc.apply(api, {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": "partial",
                          "namespace": namespace}]})
        yield
    finally:
        for path in (f"clusterrolebindings/{name}", f"clusterroles/{name}"):
            with contextlib.suppress(kc.ApiException):
                await kc.request(api, "DELETE", f"{RBAC}/{path}")


async def test_rbac_missing_for_a_kind_is_a_fail_naming_kind_and_verb(
        kube_cluster, kube_admin, kube_namespace, tmp_path):
    """rbac.yaml's ClusterRole with the EndpointSlice rule removed and Service's watch
    taken away: precheck names ``list EndpointSlice`` and ``watch Service``."""
    role = next(d for d in kc.manifest("rbac.yaml") if d["kind"] == "ClusterRole")
    rules = [r for r in role["rules"] if "endpointslices" not in r["resources"]]
    assert len(rules) == len(role["rules"]) - 1
    core = next(r for r in rules if "services" in r["resources"] and "list" in r["verbs"])
    rules.remove(core)
    rules += [{**core, "resources": [x for x in core["resources"] if x != "services"]},
              {"apiGroups": [""], "resources": ["services"], "verbs": ["list"]}]
    async with service_account_with(kube_admin, kube_namespace, rules):
        token = await kc.service_account_token(kube_admin, kube_namespace, "partial")
        kubeconfig = kc.kubeconfig_for_token(kube_cluster, token, str(tmp_path / "p.kubeconfig"))
        c = await _check(kubeconfig, tmp_path)
    assert c.state == precheck.FAIL, c
    assert c.detail.startswith(f"{kube_cluster.url}: refused (403): watch Service, "
                               "list EndpointSlice (the agent's ClusterRole needs list and "
                               "watch on each"), c
    assert f"system:serviceaccount:{kube_namespace}:partial" in c.detail, c
    assert "\n" not in c.line()


async def test_an_unreachable_server_is_a_fail_naming_the_url(kube_cluster, tmp_path):
    url = f"https://127.0.0.1:{free_port()}"
    kubeconfig = kc.kubeconfig_for_token(kube_cluster, "t", str(tmp_path / "gone.kubeconfig"),
                                         server=url)
    c = await _check(kubeconfig, tmp_path)
    assert c.state == precheck.FAIL, c
    assert c.detail.startswith(f"cannot reach the API server at {url}: "), c


async def test_run_checks_fails_the_precheck_on_a_refused_token(kube_cluster, tmp_path):
    kubeconfig = kc.kubeconfig_for_token(kube_cluster, "x", str(tmp_path / "bad.kubeconfig"))
    results = await asyncio.to_thread(precheck.run_checks, _config(kubeconfig, tmp_path))
    api = next(r for r in results if r.name == "Kubernetes API")
    assert api.state == precheck.FAIL and "401" in api.detail
