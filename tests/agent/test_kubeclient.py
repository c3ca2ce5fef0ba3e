"""agent/core/kubeclient.py: one client configuration for every Kubernetes caller."""

from __future__ import annotations

import pytest

from agent.core.config import ConfigError
from agent.core.kubeclient import client_configuration


async def test_no_kubeconfig_outside_a_pod_names_the_setting(monkeypatch):
    """Newuser: ``run --config-source kubernetes`` with no kubeconfig on a plain host
    ended in "cannot start config-source: Service host/port is not set." (the library's
    words); it is now a usage error naming ``kubeconfig`` and what to do."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    with pytest.raises(ConfigError) as e:
        await client_configuration("")
    assert e.value.setting == "kubeconfig"
    assert "no in-cluster service account" in str(e.value) and "run the agent in a pod" in \
        str(e.value)


async def test_kubeconfig_file_is_loaded(tmp_path):
    path = tmp_path / "kubeconfig"
    path.write_text("""apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:6443", insecure-skip-tls-verify: true}}]
users: [{name: u, user: {token: t0ken}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
""")
    cfg = await client_configuration(str(path))
    assert cfg.host == "https://127.0.0.1:6443"
