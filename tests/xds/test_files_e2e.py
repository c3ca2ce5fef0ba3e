"""End to end from the YAML directory source: real files, real inotify, the real ambient
index, the xDS server and the reference client over real gRPC. Editing one file delivers
exactly that change; deleting files delivers removals."""

from __future__ import annotations

import asyncio
import textwrap

import pytest
from prometheus_client import CollectorRegistry

from ambient.xds.client import DeltaXdsClient
from ambient.xds.generators import ADDRESS_TYPE, AUTHORIZATION_TYPE
from ambient.xds.server import XdsServer

index_mod = pytest.importorskip("ambient.index")
files_mod = pytest.importorskip("ambient.source_files")
from ambient.objects import Mesh  # noqa: E402
from ambient.store import ObjectStore  # noqa: E402

NS = textwrap.dedent("""\
    apiVersion: v1
    kind: Namespace
    metadata: {name: demo, labels: {istio.io/dataplane-mode: ambient}}
    """)
POD = textwrap.dedent("""\
    apiVersion: v1
    kind: Pod
    metadata: {name: %s, namespace: demo, uid: uid-%s, labels: {app: web}}
    spec: {nodeName: n1, serviceAccountName: sa, containers: [{name: c, ports: [{containerPort: 8080, name: http}]}]}
    status: {podIP: %s, podIPs: [{ip: %s}], phase: Running, conditions: [{type: Ready, status: "True"}]}
    """)
SVC = textwrap.dedent("""\
    apiVersion: v1
    kind: Service
    metadata: {name: web, namespace: demo}
    spec: {clusterIP: 10.96.0.10, selector: {app: web}, ports: [{name: http, port: 80, targetPort: http}]}
    """)
POLICY = textwrap.dedent("""\
    apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata: {name: deny-9999, namespace: demo}
    spec: {action: DENY, rules: [{to: [{operation: {ports: ["9999"]}}]}]}
    """)

POD_A = "Kubernetes//Pod/demo/a"
POD_B = "Kubernetes//Pod/demo/b"
SVC_NAME = "demo/web.demo.svc.cluster.local"


async def run_blocking(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


@pytest.fixture
async def stack(tmp_path):
    (tmp_path / "ns.yaml").write_text(NS)
    (tmp_path / "a.yaml").write_text(POD % ("a", "a", "10.1.0.1", "10.1.0.1"))
    (tmp_path / "b.yaml").write_text(POD % ("b", "b", "10.1.0.2", "10.1.0.2"))
    (tmp_path / "svc.yaml").write_text(SVC)
    (tmp_path / "policy.yaml").write_text(POLICY)
    registry = CollectorRegistry()
    store = ObjectStore(registry, source="files")
    source = files_mod.DirectorySource(store, str(tmp_path), run_blocking, debounce_ms=10)
    await source.start()
    index = index_mod.AmbientIndex(store, Mesh(cluster_id="Kubernetes", root_namespace="istio-system",
                                               trust_domain="cluster.local", network=""),
                                   registry)
    index.start()
    server = XdsServer(index, port=0, debounce=0.01, registry=registry)
    await server.start()
    client = DeltaXdsClient(f"127.0.0.1:{server.port}", metadata={"NODE_NAME": "n1"})
    try:
        yield tmp_path, client
    finally:
        await client.close()
        await server.stop(0.5)
        index.stop()
        await source.stop()


async def test_wildcard_session_follows_file_edits(stack):
    directory, client = stack
    await client.connect()
    await client.wait_synced()
    assert {POD_A, POD_B, SVC_NAME} <= set(client.resources())
    assert "demo/deny-9999" in client.resources(AUTHORIZATION_TYPE)
    n = len(client.responses)

    # edit one pod's file: exactly that workload arrives
    (directory / "a.yaml").write_text(POD % ("a", "a", "10.1.0.9", "10.1.0.9"))
    await client.wait(lambda: client.resources()[POD_A].workload.addresses == [bytes([10, 1, 0, 9])])
    updates = [r for r in client.responses[n:] if r.type_url == ADDRESS_TYPE]
    assert [[x.name for x in r.resources] for r in updates] == [[POD_A]]
    assert all(not r.removed_resources for r in updates)

    # deleting files: removals for the pod, the service and the policy
    (directory / "b.yaml").unlink()
    await client.wait_for(POD_B, present=False)
    (directory / "svc.yaml").unlink()
    await client.wait_for(SVC_NAME, present=False)
    (directory / "policy.yaml").unlink()
    await client.wait_for("demo/deny-9999", AUTHORIZATION_TYPE, present=False)


async def test_reconnect_after_changes_gets_only_the_difference(stack):
    directory, client = stack
    await client.connect()
    await client.wait_synced()
    await client.close()
    (directory / "b.yaml").unlink()
    (directory / "c.yaml").write_text(POD % ("c", "c", "10.1.0.3", "10.1.0.3"))
    await asyncio.sleep(0.3)  # let the source and index catch up while disconnected
    n = len(client.responses)
    await client.reconnect()
    resp = await client.next_response(ADDRESS_TYPE, after=n)
    names = {r.name for r in resp.resources}
    assert "Kubernetes//Pod/demo/c" in names and POD_A not in names
    assert POD_B in resp.removed_resources
