"""The first (full) build skips marking each Service's and policy's members, since every
workload is recomputed anyway: its outputs must equal those of the same objects added one
at a time to a running index, where that marking is what finds the members."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from ambient.index import AmbientIndex
from ambient.objects import Mesh
from ambient.store import ObjectStore
from tests.ambient.builders import ns, pod, policy, service

MESH = Mesh(cluster_id="cluster0", domain_suffix="domain.suffix")


def _objects() -> list[dict]:
    """Pods first, then the Services, EndpointSlice-less, and policies that select them."""
    pods, selectors = [], []
    for n in range(3):
        name = f"ns{n}"
        pods.append(ns(name, labels={"istio.io/dataplane-mode": "ambient"}))
        for p in range(12):
            pods.append(pod(f"pod{p}", name, ip=f"10.1.{n}.{p + 1}",
                            labels={"app": f"app{p % 4}"}))
        for s in range(4):
            selectors.append(service(f"svc{s}", name, selector={"app": f"app{s}"},
                                     cluster_ip=f"10.96.{n}.{s + 1}"))
        for a in range(2):
            selectors.append(policy(f"allow{a}", name, selector={"matchLabels": {
                "app": f"app{a}"}}, rules=[{"from": [{"source": {"principals": [
                    f"cluster.local/ns/{name}/sa/client"]}}]}]))
    return pods + selectors


def _outputs(index: AmbientIndex) -> tuple[dict, dict]:
    return dict(index._outputs.addr_bytes), dict(index._outputs.authz_bytes)


def test_full_build_equals_incremental_one():
    objs = _objects()
    full_store = ObjectStore(CollectorRegistry())
    full_store.replace_origin("test", [(o, "test") for o in objs])
    full = AmbientIndex(full_store, MESH, CollectorRegistry())
    full.start()

    inc_store = ObjectStore(CollectorRegistry())
    inc = AmbientIndex(inc_store, MESH, CollectorRegistry())
    inc.start()
    for obj in objs:  # each a store transaction the index follows at once
        inc_store.apply([(obj, "test")], origin="test")

    addresses, authorizations = _outputs(full)
    workloads = [full.address(n).workload for n in addresses if "/Pod/" in n]
    assert len(workloads) == 36
    assert sum(1 for w in workloads if w.services) == 36
    assert sum(1 for w in workloads if w.authorization_policies) == 18
    assert _outputs(inc) == (addresses, authorizations)
