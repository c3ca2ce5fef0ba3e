"""The chart's renderings (a real ``helm template``) and the plain manifests applied to the
real kube-apiserver with ``kubectl apply --server-side --dry-run=server`` as cluster
admin: every object passes the API server's validation, defaulting and admission
(the system namespace exists, as the session fixture creates it; the priority class is
the API server's own), nothing is persisted, and ``kubectl apply -f deploy/kubernetes/``
touches no CustomResourceDefinition. On a cluster with neither Istio's nor this
project's CRDs, the plain manifests apply too (they hold none), and deploy/crds/ is
what brings the kinds the agent reads."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from scripts import gen_deploy
from tests.deploy.chart import ROOT, helm_or_skip
from tests.kube import cluster as kc

pytestmark = pytest.mark.timeout(300)

RENDERINGS = {
    "defaults": (),
    "remote-ca": ("ca.mode=remote", "ca.address=istiod.istio-system.svc:15012"),
    "ztunnel+registration": ("ztunnel.enabled=true", "registration.enabled=true"),
    "annotation-apparmor": ("useAppArmorAnnotation=true",),
}


def kubectl(cluster: kc.KubeCluster, *args: str, stdin: str | None = None
            ) -> subprocess.CompletedProcess:
    exe = shutil.which("kubectl")
    if exe is None:
        pytest.skip("kubectl is not installed")
    return subprocess.run([exe, "--kubeconfig", cluster.kubeconfig, *args], input=stdin,
                          capture_output=True, text=True, timeout=120)


def dry_run(cluster: kc.KubeCluster, *files: str, stdin: str | None = None) -> list[str]:
    """``kubectl apply --server-side --dry-run=server``; its ``kind/name`` lines."""
    argv = ["apply", "--server-side", "--dry-run=server", "--field-manager", "ambient-tests",
            "-o", "name"]
    for f in files:
        argv += ["-f", f]
    r = kubectl(cluster, *argv, stdin=stdin)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


@pytest.mark.parametrize("name", list(RENDERINGS))
def test_rendering_applies_server_side_dry_run(kube_cluster, name):
    helm = helm_or_skip()
    text = gen_deploy.template(helm, RENDERINGS[name])
    objects = dry_run(kube_cluster, "-", stdin=text)
    assert "daemonset.apps/ambient-agent" in objects, objects
    assert not any(o.startswith("customresourcedefinition") for o in objects), objects
    # a dry run persists nothing
    r = kubectl(kube_cluster, "get", "-n", "istio-system", "daemonset/ambient-agent")
    assert r.returncode != 0 and "NotFound" in r.stderr, (r.stdout, r.stderr)


def test_plain_directory_applies_and_creates_no_crd(kube_cluster):
    objects = dry_run(kube_cluster, str(ROOT / "deploy" / "kubernetes"))
    assert sorted(objects) == [
        "clusterrole.rbac.authorization.k8s.io/ambient-agent",
        "clusterrolebinding.rbac.authorization.k8s.io/ambient-agent",
        "configmap/ambient-agent", "daemonset.apps/ambient-agent",
        "role.rbac.authorization.k8s.io/ambient-agent-ca",
        "role.rbac.authorization.k8s.io/ambient-agent-status",
        "rolebinding.rbac.authorization.k8s.io/ambient-agent-ca",
        "rolebinding.rbac.authorization.k8s.io/ambient-agent-status",
        "serviceaccount/ambient-agent"], objects
    for extra in ("ztunnel", "registration"):
        objects = dry_run(kube_cluster, str(ROOT / "deploy" / extra))
        assert objects and not any(o.startswith("customresourcedefinition") for o in objects)
    # deploy/crds/ is the only place the CRDs come from (the session applied it already:
    # re-applying it is a no-op the server accepts)
    crds = dry_run(kube_cluster, str(ROOT / "deploy" / "crds"))
    assert len(crds) == 9 and all(o.startswith("customresourcedefinition") for o in crds)
