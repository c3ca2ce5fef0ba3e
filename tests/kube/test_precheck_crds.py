"""``ambient-agent precheck``'s ``Istio CRDs`` line against the real kube-apiserver, as the
DaemonSet's ServiceAccount (only deploy/kubernetes/rbac.yaml's permissions: get of the six
CRDs by name): the session's deploy/crds/ CRDs are reported as this project's; one
relabelled as Istio's base chart labels its CRDs is reported as Istio's (the labels are
put back afterwards)."""

from __future__ import annotations

import asyncio
import os

from agent import precheck
from agent.core.config import load
from tests.kube import cluster as kc

CRD = "peerauthentications.security.istio.io"
BASE = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def _config(kubeconfig: str, tmp_path):
    return load({"config_file": os.devnull, "state_dir": str(tmp_path / "state"),
                 "config_source": "kubernetes", "kubeconfig": kubeconfig}, env={})


async def test_precheck_names_whose_crds_are_present(kube_admin, agent_kubeconfig, tmp_path):
    cfg = _config(agent_kubeconfig, tmp_path)
    c = await asyncio.to_thread(precheck.check_istio_crds, cfg)
    assert c.state == precheck.OK, c
    assert c.detail.startswith("ambient-agent's: AuthorizationPolicy, GRPCRoute, Gateway, "
                               "GatewayClass, HTTPRoute, PeerAuthentication, ServiceEntry, "
                               "TCPRoute, WorkloadEntry"), c
    # as Istio's base chart labels the CRDs it templates
    istio = {"app.kubernetes.io/name": None, "app.kubernetes.io/part-of": "istio",
             "helm.sh/chart": "base-1.28.0"}
    await kc.request(kube_admin, "PATCH", f"{BASE}/{CRD}", body={"metadata": {"labels": istio}},
                     content_type="application/merge-patch+json")
    try:
        c = await asyncio.to_thread(precheck.check_istio_crds, cfg)
        istio, ours = c.detail.split("; ")  # Istio's first (sorted by owner)
        assert istio == "Istio's: PeerAuthentication", c
        assert ours.startswith("ambient-agent's: ") and "PeerAuthentication" not in ours, c
    finally:
        await kc.request(kube_admin, "PATCH", f"{BASE}/{CRD}", body={"metadata": {"labels": {
            "app.kubernetes.io/name": "ambient-agent", "app.kubernetes.io/part-of": None,
            "helm.sh/chart": None}}}, content_type="application/merge-patch+json")
