"""Malformed AuthorizationPolicies read from a real kube-apiserver fail closed.

The CRDs of ``deploy/crds/`` keep ``spec`` schema-less (``x-kubernetes-preserve-unknown-
fields``), so the API server stores ``rules: {...}`` or ``ports: ["eighty"]`` as written;
the index fed by the kubernetes source must send such a policy closed, exactly as for the
files source, with one warning naming the policy, the field and the value.
"""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from ambient.index import AmbientIndex
from ambient.objects import Mesh
from ambient.source_kube import KubernetesSource
from ambient.store import ObjectStore
from tests.helpers import eventually
from tests.kube import cluster as kc

pytestmark = pytest.mark.timeout(120)


def _ap(name: str, ns: str, spec: dict) -> dict:
    return {"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
            "metadata": {"name": name, "namespace": ns}, "spec": spec}


async def test_malformed_policies_from_the_api_are_sent_closed(kube_admin, kube_namespace,
                                                               agent_kubeconfig, caplog):
    caplog.set_level(logging.WARNING, logger="ambient.index_policies")
    ns = kube_namespace
    await kc.apply(kube_admin, _ap("allow-map", ns, {
        "selector": {"matchLabels": {"app": "d"}},
        "rules": {"from": [{"source": {"principals": ["cluster.local/ns/x/sa/y"]}}]}}))
    await kc.apply(kube_admin, _ap("deny-eighty", ns, {
        "action": "DENY", "rules": [{"to": [{"operation": {"ports": ["eighty"]}}]}]}))
    registry = CollectorRegistry()
    store = ObjectStore(registry)
    src = KubernetesSource(store, agent_kubeconfig, sync_timeout=20)
    await src.start()
    index = AmbientIndex(store, Mesh(cluster_id="Kubernetes"), registry)
    try:
        index.start()
        await eventually(lambda: {f"{ns}/allow-map", f"{ns}/deny-eighty"} <= set(
            index.authorizations()), timeout=15, what="both policies sent")
        allow, deny = (index.authorizations()[f"{ns}/{n}"] for n in ("allow-map", "deny-eighty"))
        assert not allow.groups  # an ALLOW of nothing: its workloads are default-deny
        assert len(deny.groups) == 1 and not deny.groups[0].rules  # denies everything
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(f"{ns}/allow-map" in w and "'spec.rules'" in w for w in warned), warned
        assert any(f"{ns}/deny-eighty" in w and "ports[0]" in w and "'eighty'" in w
                   for w in warned), warned
    finally:
        index.stop()
        await src.stop()
