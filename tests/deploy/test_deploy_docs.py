"""docs/deploy.md says what the plain manifests do: where ztunnel's DaemonSet
(deploy/ztunnel/ztunnel.yaml, the chart rendered with its defaults) gets the mesh root
it verifies the agent with (a newuser finding: the doc said the mesh-root hostPath, the
manifest mounts the istio-ca-root-cert ConfigMap)."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_deploy_doc_names_the_root_ztunnel_mounts():
    docs = list(yaml.safe_load_all((ROOT / "deploy/ztunnel/ztunnel.yaml").read_text()))
    ds = next(d for d in docs if d and d.get("kind") == "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    root_dir = str(Path(env["XDS_ROOT_CA"]).parent)
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == root_dir)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    doc = " ".join((ROOT / "docs/deploy.md").read_text().split())
    sentence = doc[doc.index("ztunnel's DaemonSet (`deploy/ztunnel/ztunnel.yaml`)"):]
    sentence = sentence[:sentence.index("(docs/ztunnel.md)")]
    if "configMap" in volume:
        assert f"`{volume['configMap']['name']}` ConfigMap" in sentence, sentence
        assert "only without `ca.rootPublish`" in sentence, sentence
    else:
        assert volume["hostPath"]["path"] in sentence, sentence
