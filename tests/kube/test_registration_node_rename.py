"""Issue 27: a host whose ``node_name`` changes between two runs (same state dir) moves
its kept registrations to the new name: its WorkloadEntries are re-written as
``<pod>-<new node>`` controlled by the new name, and the ones under the old name are
deleted at once (not re-written under the old name, not left for the grace-period
cleanup). Real kube-apiserver, as tests/kube/test_registration_workloadentry.py."""

from __future__ import annotations

import os

from agent.core.config import load
from tests.helpers import eventually
from tests.kube import cluster as kc
from tests.kube.test_registration_workloadentry import Host

WE = "/apis/networking.istio.io/v1/namespaces/{ns}/workloadentries"


class RenamedHost(Host):
    def __init__(self, tmp_path, node, kubeconfig, namespace):
        super().__init__(tmp_path, node, kubeconfig, namespace)
        self.config = load({"state_dir": str(tmp_path / "host"), "config_file": os.devnull},
                           env={}).replace(
            config_source="kubernetes", kubeconfig=kubeconfig, node_name=node,
            workload_registration="workloadentry", registration_runtime="none",
            registration_namespace=namespace, registration_grace=600.0)


async def test_node_name_change_moves_entries(kube_cluster, kube_admin, kube_namespace,
                                              tmp_path, caplog):
    await kc.apply_manifest(kube_admin, kc.REGISTRATION_RBAC)
    kubeconfig = await kc.agent_kubeconfig(kube_cluster, kube_admin,
                                           str(tmp_path / "agent.kubeconfig"))
    old, new = kc.unique("host-old"), kc.unique("host-new")

    async def names():
        items = (await kc.request(kube_admin, "GET", WE.format(ns=kube_namespace)))["items"]
        return {i["metadata"]["name"]: i["metadata"]["annotations"][
            "istio.io/workloadController"] for i in items}

    host = await RenamedHost(tmp_path, old, kubeconfig, kube_namespace).start()
    try:
        await host.add("e" * 64, "web", "10.240.3.2", {"app": "web"})
        await eventually(lambda: host.registrar.backend.stats["written"] >= 1, timeout=15,
                         what="the entry under the old name")
        assert await names() == {f"web-{old}": old}
    finally:
        await host.stop()
    host = await RenamedHost(tmp_path, new, kubeconfig, kube_namespace).start()
    try:
        assert host.registrar.stats["restored"] == 1
        await eventually(lambda: host.registrar.backend.stats["deleted"] >= 1
                         and host.registrar.backend.stats["written"] >= 1, timeout=15,
                         what="the entry moved")
        assert await names() == {f"web-{new}": new}
        assert host.registrar.registrations["e" * 64].node == new
        assert any("node_name is now" in r.getMessage() for r in caplog.records)
    finally:
        await host.stop()
    # the state file now names the new node: a third start moves nothing
    host = await RenamedHost(tmp_path, new, kubeconfig, kube_namespace).start()
    try:
        assert host.registrar.registrations["e" * 64].node == new
    finally:
        await host.stop()


async def test_missing_namespace_is_one_line_naming_it(kube_cluster, kube_admin, tmp_path,
                                                       caplog):
    """The shared API server has no Namespace for the container's namespace label: the
    write is retried, its warning is one line naming the namespace (not the HTTP dump),
    and the entry is written once the namespace exists (docs/podman.md, "Several hosts")."""
    await kc.apply_manifest(kube_admin, kc.REGISTRATION_RBAC)
    kubeconfig = await kc.agent_kubeconfig(kube_cluster, kube_admin,
                                           str(tmp_path / "agent.kubeconfig"))
    namespace = kc.unique("ops-later")
    host = await RenamedHost(tmp_path, kc.unique("host"), kubeconfig, namespace).start()
    try:
        await host.add("f" * 64, "web", "10.240.4.2", {"app": "web"})
        await eventually(lambda: host.registrar.backend.stats["errors"] >= 1, timeout=15,
                         what="the refused write")
        error = host.registrar.backend.last_error
        assert "\n" not in error and f"namespace {namespace} does not exist" in error, error
        warnings = [r.getMessage() for r in caplog.records
                    if r.levelname == "WARNING" and "WorkloadEntry" in r.getMessage()]
        assert warnings and all("\n" not in w and "HTTP response headers" not in w
                                for w in warnings), warnings
        await kc.create_namespace(kube_admin, namespace)
        try:
            await eventually(lambda: host.registrar.backend.stats["written"] >= 1,
                             timeout=20, what="the entry once the namespace exists")
        finally:
            await host.stop()
            host = None
            await kc.delete_namespace(kube_admin, namespace)
    finally:
        if host is not None:
            await host.stop()
