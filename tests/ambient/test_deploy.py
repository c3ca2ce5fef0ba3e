"""deploy/ manifests: schema-valid (kubernetes-validate, offline schemas), RBAC matching
exactly what the kubernetes source uses, ConfigMap keys being real settings; no CRD in
deploy/kubernetes/ (``kubectl apply -f deploy/kubernetes/`` must never create or replace
one: they live in deploy/crds/, applied only on purpose), the registration role apart in
deploy/registration/, and ztunnel's DaemonSet (deploy/ztunnel/) pointed at the node-local
agent. (That these files are the Helm chart's rendering: tests/deploy/test_chart.py.)"""

from __future__ import annotations

import glob
import os

import kubernetes_validate
import pytest
import yaml

from agent.core import config as agent_config
from ambient.source_kube import RESOURCES
from ambient.waypoint.status_writer import ISTIOD_LOCK, LEASE_NAME, WRITTEN

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(ROOT, "deploy", "kubernetes")
DIRS = ("kubernetes", "crds", "registration", "ztunnel")


def documents(directory: str = "kubernetes") -> list[tuple[str, dict]]:
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "deploy", directory, "*.yaml"))):
        with open(path, encoding="utf-8") as f:
            out += [(os.path.basename(path), d) for d in yaml.safe_load_all(f) if d]
    return out


@pytest.mark.parametrize("name,doc", [(f"{d}/{n}", doc) for d in DIRS for n, doc in documents(d)],
                         ids=lambda v: v if isinstance(v, str) else f"{v.get('kind')}")
def test_manifest_is_schema_valid(name, doc):
    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_all_expected_objects_present():
    kinds = sorted(d["kind"] for _, d in documents())
    # the agent's identity and roles (ambient-agent; the Role ambient-agent-ca: the
    # cluster-wide CA's Secrets and publisher Lease), its settings and the DaemonSet; no CRD
    # (and the Role ambient-agent-status: the waypoint status writer's Lease)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet", "Role",
                     "Role", "RoleBinding", "RoleBinding", "ServiceAccount"]
    assert sorted(d["kind"] for _, d in documents("crds")) == ["CustomResourceDefinition"] * 9
    assert sorted(d["kind"] for _, d in documents("registration")) == ["ClusterRole",
                                                                       "ClusterRoleBinding"]
    assert sorted(d["kind"] for _, d in documents("ztunnel")) == ["DaemonSet", "ServiceAccount"]


def test_crds_cover_exactly_the_custom_kinds_the_source_reads():
    crds = {(d["spec"]["group"], d["spec"]["names"]["plural"], d["spec"]["names"]["kind"],
             v["name"]) for _, d in documents("crds") if d["kind"] == "CustomResourceDefinition"
            for v in d["spec"]["versions"] if v["storage"]}
    wanted = {(group, plural, kind, version)
              for kind, (_, group, version, plural) in RESOURCES.items()
              if group not in ("", "discovery.k8s.io")}
    assert crds == wanted
    for _, d in documents("crds"):
        # what precheck tells from Istio's own (agent/precheck.py crd_owner)
        assert d["metadata"]["labels"]["app.kubernetes.io/name"] == "ambient-agent"
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
    # cni/kubeevents.py: an Event on the pod per enrollment failure (its count patched)
    wanted |= {("", "events", "create"), ("", "events", "patch")}
    # agent/tlsport/authn.py: ztunnel's token on the TLS port is checked with a TokenReview
    wanted.add(("authentication.k8s.io", "tokenreviews", "create"))
    # agent/precheck.py check_istio_crds: get, by name, the CRD of each custom kind
    wanted.add(("apiextensions.k8s.io", "customresourcedefinitions", "get"))
    # the istio-ca-root-cert publisher (ca.mode cluster; test_ca_roles_... has the names)
    wanted |= {("", "configmaps", v) for v in ("get", "list", "watch", "patch", "create")}
    # ambient/waypoint/status_writer.py: a merge patch of each written kind's status, and a
    # read of the object after a 409
    # (Services: the istio.io/WaypointBound condition, core group)
    for _, api_version, plural in WRITTEN.values():
        group = "" if api_version == "/api/v1" else "gateway.networking.k8s.io"
        wanted |= {(group, plural, "get"), (group, f"{plural}/status", "patch")}
    assert granted == wanted
    [crd_rule] = [r for r in role["rules"] if r["apiGroups"] == ["apiextensions.k8s.io"]]
    assert set(crd_rule["resourceNames"]) == {
        f"{plural}.{group}" for _, group, _, plural in RESOURCES.values()
        if group not in ("", "discovery.k8s.io")}


def test_registration_role_grants_exactly_what_the_registration_uses():
    """cni/registration_kube.py: WorkloadEntry create/get/replace/delete, Lease
    read/create/replace; bound to the agent's ServiceAccount."""
    assert not any(d["metadata"]["name"] == "ambient-agent-registration"
                   for _, d in documents()), "opt-in: not in deploy/kubernetes/"
    role = next(d for _, d in documents("registration") if d["kind"] == "ClusterRole"
                and d["metadata"]["name"] == "ambient-agent-registration")
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"]
               for r in rule["resources"] for v in rule["verbs"]}
    assert granted == {("networking.istio.io", "workloadentries", v)
                       for v in ("get", "create", "update", "delete")} | {
        ("coordination.k8s.io", "leases", v) for v in ("get", "create", "update")}
    binding = next(d for _, d in documents("registration") if d["kind"] == "ClusterRoleBinding"
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
    # as upstream's istio-cni: AppArmor profiles would block in-pod redirection
    assert c["securityContext"]["appArmorProfile"] == {"type": "Unconfined"}


def test_ca_roles_read_only_the_named_secrets():
    """The cluster-wide CA (Role in the system namespace): get/list/watch on the Secrets
    cacerts and istio-ca-secret only, create (bootstrap; create cannot be limited by
    name), the publisher's Lease by name (+ create) and istiod's election ConfigMap; in
    the ClusterRole, the root ConfigMap istio-ca-root-cert by name (+ create)."""
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in documents()}
    role = docs[("Role", "ambient-agent-ca")]
    assert role["metadata"]["namespace"] == "istio-system"
    granted = {(g, r, v, tuple(rule.get("resourceNames", ()))) for rule in role["rules"]
               for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    secrets = ("cacerts", "istio-ca-secret")
    lease = ("ambient-agent-ca-root-publisher",)
    assert granted == {("", "secrets", v, secrets) for v in ("get", "list", "watch")} | {
        ("", "secrets", "create", ()),
        ("coordination.k8s.io", "leases", "get", lease),
        ("coordination.k8s.io", "leases", "update", lease),
        ("coordination.k8s.io", "leases", "create", ()),
        ("", "configmaps", "get", ("istio-namespace-controller-election",))}
    assert docs[("RoleBinding", "ambient-agent-ca")]["subjects"] == [
        {"kind": "ServiceAccount", "name": "ambient-agent", "namespace": "istio-system"}]
    cluster = docs[("ClusterRole", "ambient-agent")]
    granted = {(v, tuple(rule.get("resourceNames", ()))) for rule in cluster["rules"]
               if rule["resources"] == ["configmaps"] for v in rule["verbs"]}
    assert granted == {(v, ("istio-ca-root-cert",)) for v in ("get", "list", "watch", "patch")
                       } | {("create", ())}


def test_status_role_grants_exactly_what_the_status_writer_uses():
    """ambient/waypoint/status_writer.py through agent/core/kubelease.py: its Lease by name
    (+ create), list of Leases (istiod's per-revision lock) and istiod's ConfigMap lock."""
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in documents()}
    role = docs[("Role", "ambient-agent-status")]
    assert role["metadata"]["namespace"] == "istio-system"
    granted = {(g, r, v, tuple(rule.get("resourceNames", ()))) for rule in role["rules"]
               for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    lease = (LEASE_NAME,)
    assert granted == {
        ("coordination.k8s.io", "leases", "get", lease),
        ("coordination.k8s.io", "leases", "update", lease),
        ("coordination.k8s.io", "leases", "create", ()),
        ("coordination.k8s.io", "leases", "list", ()),
        ("", "configmaps", "get", (ISTIOD_LOCK.configmap,))}
    assert docs[("RoleBinding", "ambient-agent-status")]["subjects"] == [
        {"kind": "ServiceAccount", "name": "ambient-agent", "namespace": "istio-system"}]


def test_ztunnel_daemonset_points_at_the_node_local_agent():
    """deploy/ztunnel/: xDS and CA at https://$(HOST_IP):<xds_tls_port> with HOST_IP from
    status.hostIP defined before them (Kubernetes expands $(VAR) only from earlier
    entries), the root from the istio-ca-root-cert ConfigMap and a projected token for
    audience istio-ca where Istio's chart mounts them, the ZDS socket dir shared."""
    ds = next(d for _, d in documents("ztunnel") if d["kind"] == "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    c = pod["containers"][0]
    env = [e["name"] for e in c["env"]]
    values = {e["name"]: e.get("value") for e in c["env"]}
    refs = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"]
            if "valueFrom" in e}
    assert refs["HOST_IP"] == "status.hostIP"
    assert values["XDS_ADDRESS"] == values["CA_ADDRESS"] == "https://$(HOST_IP):15012"
    assert env.index("HOST_IP") < env.index("XDS_ADDRESS")
    assert values["ALT_XDS_HOSTNAME"] == "istiod.istio-system.svc"
    vols = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: vols[m["name"]] for m in c["volumeMounts"]}
    assert mounts["/var/run/secrets/istio"]["configMap"]["name"] == "istio-ca-root-cert"
    assert values["XDS_ROOT_CA"] == values["CA_ROOT_CA"] == "/var/run/secrets/istio/root-cert.pem"
    [src] = mounts["/var/run/secrets/tokens"]["projected"]["sources"]
    assert src["serviceAccountToken"]["audience"] == "istio-ca"
    assert values["AUTH_TOKEN"] == "/var/run/secrets/tokens/" + src["serviceAccountToken"]["path"]
    assert mounts["/var/run/ztunnel"]["hostPath"]["path"] == "/var/run/ztunnel"
    # the account the agent trusts to ask for other identities (ca_trusted_node_accounts)
    assert (ds["metadata"]["namespace"], pod["serviceAccountName"]) == ("istio-system", "ztunnel")
