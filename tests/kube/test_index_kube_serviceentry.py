"""ServiceEntry cases of the ambient index fed by the kubernetes source from a real
kube-apiserver (the source authenticated as the DaemonSet's ServiceAccount).

- the addresses istiod's IP allocator writes into a ServiceEntry's *status* (a JSON
  merge patch on the ``status`` subresource, as its ``ipallocate`` controller patches it)
  reach the Service's VIPs: the source carries the status with the object, and a
  status-only change is a watch event like any other;
- the per-host workloads of a DNS ServiceEntry carry the namespace's STRICT
  PeerAuthentication, and a selector policy created later reaches a ServiceEntry's
  workloads through the ServiceEntry's labels.
"""

from __future__ import annotations

import ipaddress

import pytest
from prometheus_client import CollectorRegistry

from ambient.index import AmbientIndex
from ambient.objects import Mesh
from ambient.source_kube import KubernetesSource
from ambient.store import ObjectStore
from tests.helpers import eventually
from tests.kube import cluster as kc

pytestmark = pytest.mark.timeout(120)


async def test_allocated_addresses_and_policies_of_service_entries(kube_admin, kube_namespace,
                                                                   agent_kubeconfig):
    ns = kube_namespace
    se = {"apiVersion": "networking.istio.io/v1", "kind": "ServiceEntry",
          "metadata": {"name": "ext", "namespace": ns, "labels": {"app": "ext"}},
          "spec": {"hosts": ["ext.example.com"], "resolution": "DNS",
                   "ports": [{"number": 443, "name": "tls", "protocol": "TLS"}]}}
    pa = {"apiVersion": "security.istio.io/v1", "kind": "PeerAuthentication",
          "metadata": {"name": "default", "namespace": ns}, "spec": {"mtls": {"mode": "STRICT"}}}
    ap = {"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
          "metadata": {"name": "ext-only", "namespace": ns},
          "spec": {"selector": {"matchLabels": {"app": "ext"}}, "action": "DENY",
                   "rules": [{"from": [{"source": {"namespaces": ["blocked"]}}]}]}}
    await kc.apply(kube_admin, se)
    await kc.apply(kube_admin, pa)
    registry = CollectorRegistry()
    store = ObjectStore(registry)
    src = KubernetesSource(store, agent_kubeconfig, sync_timeout=20)
    await src.start()
    index = AmbientIndex(store, Mesh(cluster_id="Kubernetes"), registry)
    try:
        index.start()
        key, uid = f"{ns}/ext.example.com", f"Kubernetes/networking.istio.io/ServiceEntry/{ns}/ext/ext.example.com"
        assert index.address(key) is not None
        assert list(index.address(key).service.addresses) == []
        assert list(index.address(uid).workload.authorization_policies) == [
            "istio-system/istio_converted_static_strict"]
        # istiod's allocator writes the status
        path = await kc.object_path(kube_admin, "networking.istio.io/v1", "ServiceEntry", "ext",
                                    ns)
        await kc.request(kube_admin, "PATCH", path + "/status",
                         {"status": {"addresses": [{"host": "ext.example.com",
                                                    "value": "240.240.0.7"}]}},
                         content_type="application/merge-patch+json")

        def vips() -> list[str]:
            a = index.address(key)
            return [str(ipaddress.ip_address(x.address)) for x in a.service.addresses] if a else []
        await eventually(lambda: vips() == ["240.240.0.7"], timeout=15)
        assert index.lookup("/240.240.0.7")[0] == key
        # a policy created after the ServiceEntry reaches its workload
        await kc.apply(kube_admin, ap)
        await eventually(lambda: list(index.address(uid).workload.authorization_policies) == [
            f"{ns}/ext-only", "istio-system/istio_converted_static_strict"], timeout=15)
    finally:
        index.stop()
        await src.stop()
