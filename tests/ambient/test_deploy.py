"""deploy/kubernetes/ manifests: schema-valid (kubernetes-validate, offline schemas), RBAC
matching exactly what the kubernetes source uses, ConfigMap keys being real settings."""

from __future__ import annotations

import glob
import os

import kubernetes_validate
import pytest
import yaml

from agent.core import config as agent_config
from ambient.source_kube import RESOURCES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(ROOT, "deploy", "kubernetes")


def documents() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(glob.glob(os.path.join(DEPLOY, "*.yaml"))):
        with open(path, encoding="utf-8") as f:
            out += [(os.path.basename(path), d) for d in yaml.safe_load_all(f) if d]
    return out


@pytest.mark.parametrize("name,doc", documents(), ids=lambda v: v if isinstance(v, str) else
                         f"{v.get('kind')}")
def test_manifest_is_schema_valid(name, doc):
    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_all_expected_objects_present():
    kinds = sorted(d["kind"] for _, d in documents())
    # rbac-registration.yaml adds a ClusterRole + binding (hosts without Kubernetes)
    assert kinds == ["ClusterRole"] * 2 + ["ClusterRoleBinding"] * 2 + ["ConfigMap"] + \
        ["CustomResourceDefinition"] * 7 + ["DaemonSet", "ServiceAccount"]


def test_crds_cover_exactly_the_custom_kinds_the_source_reads():
    crds = {(d["spec"]["group"], d["spec"]["names"]["plural"], d["spec"]["names"]["kind"],
             v["name"]) for _, d in documents() if d["kind"] == "CustomResourceDefinition"
            for v in d["spec"]["versions"] if v["storage"]}
    wanted = {(group, plural, kind, version)
              for kind, (_, group, version, plural) in RESOURCES.items()
              if group not in ("", "discovery.k8s.io")}
    assert crds == wanted
    for _, d in documents():
        if d["kind"] == "CustomResourceDefinition":
            for v in d["spec"]["versions"]:
                props = v["schema"]["openAPIV3Schema"]["properties"]
                assert props["spec"]["x-kubernetes-preserve-unknown-fields"] is True
                assert props["status"]["x-kubernetes-preserve-unknown-fields"] is True


def test_cluster_role_grants_exactly_what_the_agent_uses():
    role = next(d for _, d in documents() if d["kind"] == "ClusterRole"
                and d["metadata"]["name"] == "ambient-agent")
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"]
               for r in rule["resources"] for v in rule["verbs"]}
    wanted = {(group, plural, verb) for _, group, _, plural in RESOURCES.values()
              for verb in ("list", "watch")}
    wanted.add(("", "pods/status", "patch"))
    # agent/tlsport/authn.py: ztunnel's token on the TLS port is checked with a TokenReview
    wanted.add(("authentication.k8s.io", "tokenreviews", "create"))
    # cni/kubeevents.py: Events on pods (created, repeats patched); repair's delete mode
    # needs pods delete, granted only by the operator who turns it on
    wanted |= {("", "events", "create"), ("", "events", "patch")}
    assert granted == wanted


def test_registration_role_grants_exactly_what_the_registration_uses():
    """cni/registration_kube.py: WorkloadEntry create/get/replace/delete, Lease
    read/create/replace; bound to the agent's ServiceAccount."""
    role = next(d for _, d in documents() if d["kind"] == "ClusterRole"
                and d["metadata"]["name"] == "ambient-agent-registration")
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"]
               for r in rule["resources"] for v in rule["verbs"]}
    assert granted == {("networking.istio.io", "workloadentries", v)
                       for v in ("get", "create", "update", "delete")} | {
        ("coordination.k8s.io", "leases", v) for v in ("get", "create", "update")}
    binding = next(d for _, d in documents() if d["kind"] == "ClusterRoleBinding"
                   and d["roleRef"]["name"] == "ambient-agent-registration")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "ambient-agent",
                                    "namespace": "istio-system"}]


def test_configmap_holds_valid_settings(tmp_path):
    cm = next(d for _, d in documents() if d["kind"] == "ConfigMap")
    path = tmp_path / "config.yaml"
    path.write_text(cm["data"]["config.yaml"])
    cfg = agent_config.load({"config_file": str(path)}, env={})
    assert cfg.config_source == "kubernetes"


def test_daemonset_mounts_the_host_paths_the_agent_needs():
    ds = next(d for _, d in documents() if d["kind"] == "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True
    assert pod["hostPID"] is True  # SDS attestation: SO_PEERCRED pids are host pids
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    by_host = {vols[n]["hostPath"]["path"]: m for n, m in mounts.items()
               if "hostPath" in vols[n]}
    # as upstream: host paths under /host (host_mounts_path), sockets at their host path
    assert by_host["/proc"]["mountPath"] == "/host/proc"
    assert by_host["/var/run/netns"]["mountPath"] == "/host/var/run/netns"
    assert by_host["/var/run/netns"]["mountPropagation"] == "HostToContainer"
    assert by_host["/var/run/ztunnel"]["mountPath"] == "/var/run/ztunnel"
    strategy = ds["spec"]["updateStrategy"]
    assert strategy["rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 0}
    c = pod["containers"][0]
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": 8000}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": 8000}
    assert c["resources"]["requests"]
    paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert paths == {"/opt/cni/bin", "/etc/cni/net.d", "/proc", "/var/run/netns",
                     "/var/run/ztunnel", "/var/run/ambient-agent",
                     "/var/run/ambient-agent/mesh-root"}
    caps = pod["containers"][0]["securityContext"]["capabilities"]["add"]
    assert {"NET_ADMIN", "SYS_ADMIN"} <= set(caps)
