"""deploy/helm/ambient-agent rendered by a real ``helm template`` (v3.22.0 built from its Go
module by scripts/helm-build.sh): the plain manifests in deploy/kubernetes/, deploy/ztunnel/
and deploy/registration/ are exactly its rendering (drift), the schema refuses unknown
and mistyped values naming them, no rendering holds a CRD, and the values change what
they say (ports, CA mode, AppArmor form). Applying the renderings to a real API server:
tests/kube/test_chart_dry_run.py."""

from __future__ import annotations

import pytest
import yaml

from scripts import gen_deploy
from tests.deploy.chart import ROOT, helm_or_skip


@pytest.fixture(scope="module")
def helm() -> str:
    return helm_or_skip()


def docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def test_plain_manifests_are_the_chart_rendered(helm):
    rendered = gen_deploy.render(helm)
    stale = [rel for rel, text in rendered.items()
             if not (ROOT / rel).exists() or (ROOT / rel).read_text() != text]
    assert not stale, f"out of date with the chart (run python scripts/gen_deploy.py): {stale}"
    # and nothing else is in deploy/kubernetes/ that the chart does not make
    plain = {p.relative_to(ROOT).as_posix() for p in (ROOT / "deploy/kubernetes").glob("*")}
    assert plain == {r for r in rendered if r.startswith("deploy/kubernetes/")}


@pytest.mark.parametrize("sets, named", [
    (("imagee.tag=x",), "imagee"),                      # a typo at the top
    (("ports.helth=8001",), "helth"),                   # a typo inside an object
    (("ztunnel.enable=true",), "enable"),
    (("ports.health=high",), "health"),                 # a mistyped value
    (("ca.mode=embedded",), "mode"),                      # not one of the modes
    (("tolerations[0].operater=Exists",), "operater"),
])
def test_unknown_or_mistyped_values_fail_naming_them(helm, sets, named):
    with pytest.raises(gen_deploy.HelmError) as err:
        gen_deploy.template(helm, sets)
    message = str(err.value)
    assert "values don't meet the specifications of the schema" in message, message
    assert named in message, message


def test_remote_ca_needs_an_address(helm):
    with pytest.raises(gen_deploy.HelmError) as err:
        gen_deploy.template(helm, ("ca.mode=remote",))
    assert "address" in str(err.value)


@pytest.mark.parametrize("sets", [(), ("ztunnel.enabled=true", "registration.enabled=true"),
                                  ("ca.mode=remote", "ca.address=istiod.istio-system.svc:15012")])
def test_no_rendering_holds_a_crd(helm, sets):
    kinds = {d["kind"] for d in docs(gen_deploy.template(helm, sets))}
    assert "CustomResourceDefinition" not in kinds
    assert "DaemonSet" in kinds


def test_values_reach_the_objects(helm):
    out = docs(gen_deploy.template(helm, (
        "namespace=mesh-system", "ports.health=8101", "ports.xdsTls=15112",
        "image.repository=registry.example/agent", "image.tag=9.9", "useAppArmorAnnotation=true",
        "ztunnel.enabled=true", "ca.mode=remote", "ca.address=istiod.mesh-system.svc:15012")))
    by = {(d["kind"], d["metadata"]["name"]): d for d in out}
    ds = by[("DaemonSet", "ambient-agent")]
    pod = ds["spec"]["template"]
    c = pod["spec"]["containers"][0]
    assert ds["metadata"]["namespace"] == "mesh-system"
    assert c["image"] == "registry.example/agent:9.9"
    assert c["livenessProbe"]["httpGet"]["port"] == 8101
    assert "appArmorProfile" not in c["securityContext"]
    assert pod["metadata"]["annotations"][
        "container.apparmor.security.beta.kubernetes.io/agent"] == "unconfined"
    settings = yaml.safe_load(by[("ConfigMap", "ambient-agent")]["data"]["config.yaml"])
    assert (settings["health_port"], settings["xds_tls_port"]) == (8101, 15112)
    assert settings["system_namespace"] == "mesh-system"
    assert settings["ca_addr"] == "istiod.mesh-system.svc:15012"
    # remote CA: no CA Secret, Lease or ConfigMap permissions on nodes
    assert ("Role", "ambient-agent-ca") not in by
    assert not any("configmaps" in r["resources"]
                   for r in by[("ClusterRole", "ambient-agent")]["rules"])
    z = by[("DaemonSet", "ztunnel")]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in z["env"]}
    assert env["XDS_ADDRESS"] == "https://$(HOST_IP):15112"
    # the agent forwards ztunnel's CA calls; ztunnel trusts the agent's published file
    assert env["CA_ADDRESS"] == "https://$(HOST_IP):15112"
    assert env["ALT_XDS_HOSTNAME"] == env["ALT_CA_HOSTNAME"] == "istiod.mesh-system.svc"
    vols = {v["name"]: v for v in by[("DaemonSet", "ztunnel")]["spec"]["template"]["spec"]
            ["volumes"]}
    assert vols["istiod-ca-cert"]["hostPath"]["path"] == "/var/run/ambient-agent/mesh-root"


def test_node_mode_has_no_secret_access_and_ztunnel_mounts_the_host_root(helm):
    out = docs(gen_deploy.template(helm, ("ca.mode=node", "ztunnel.enabled=true")))
    by = {(d["kind"], d["metadata"]["name"]): d for d in out}
    assert ("Role", "ambient-agent-ca") not in by
    settings = yaml.safe_load(by[("ConfigMap", "ambient-agent")]["data"]["config.yaml"])
    assert settings["ca_kubernetes_secret"] is False
    vols = {v["name"]: v for v in by[("DaemonSet", "ztunnel")]["spec"]["template"]["spec"]
            ["volumes"]}
    assert vols["istiod-ca-cert"]["hostPath"]["path"] == "/var/run/ambient-agent/mesh-root"
