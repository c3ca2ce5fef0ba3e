"""Test-only: a :class:`WaypointConfigs` whose built configurations also carry the
resources a test puts in ``extra`` (``{type_url: {name: (version, message)}}``), so a test
can hand a real Envoy a resource it rejects and later a fixed one. Everything else is the
real build. :func:`touch` makes a store change of a watched kind (a new, unbound Service),
which drops the cached configurations and pushes to every waypoint stream."""

from __future__ import annotations

from google.protobuf import duration_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2

from ambient.store import ObjectStore
from ambient.waypoint.service import Config, WaypointConfigs


class InjectingConfigs(WaypointConfigs):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.extra: dict[str, dict[str, tuple[str, object]]] = {}

    def _store(self, key, model, built, problems) -> Config:
        merged = {t: dict(items) for t, items in built.items()}
        for type_url, items in self.extra.items():
            merged.setdefault(type_url, {}).update(items)
        return super()._store(key, model, merged, problems)


def cluster(name: str, connect_timeout_s: int) -> cluster_pb2.Cluster:
    """A STATIC cluster with no endpoints; a ``connect_timeout`` <= 0 is one Envoy refuses
    (``ClusterValidationError.ConnectTimeout: value must be greater than 0s``)."""
    return cluster_pb2.Cluster(
        name=name, type=cluster_pb2.Cluster.STATIC,
        connect_timeout=duration_pb2.Duration(seconds=connect_timeout_s),
        load_assignment=endpoint_pb2.ClusterLoadAssignment(cluster_name=name))


def touch(store: ObjectStore, namespace: str, n: int, labels: dict | None = None) -> None:
    store.apply([({"apiVersion": "v1", "kind": "Service",
                   "metadata": {"name": f"touch-{n}", "namespace": namespace,
                                "labels": labels or {}},
                   "spec": {"clusterIP": f"10.250.{n // 250}.{n % 250 + 1}",
                            "ports": [{"name": "http", "port": 80}]}}, "test")])
