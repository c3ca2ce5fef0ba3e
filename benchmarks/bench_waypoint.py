"""Waypoint Envoy configuration (issue 25, ``docs/waypoint.md``).

Figures, each next to a floor measured in the same run, on the real store and index with
N Services (one pod each, HTTP port 80) bound to one waypoint by ``istio.io/use-waypoint``:
- full configuration of the waypoint at N=1000, cold (the first stream of that waypoint:
  model, resources, parsing): floor = protobuf serializing the same resources once.
  Target ratio <= 2.
- the same after one pod changes (what every later push costs: the index names the
  changed pod, only its service's parts are rebuilt): floor as above. Target ratio <= 2.
- one HTTPRoute change rebuilt at N=1000 against the same at N=100 (size independence),
  the two sizes alternated change by change. Target ratio <= 1.3.
The Envoy side (time until Envoy holds the change) is not measured here.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry

from ambient.index import AmbientIndex
from ambient.objects import Mesh
from ambient.store import ObjectStore
from ambient.waypoint import resources
from ambient.waypoint.service import WaypointConfigs
from benchmarks.common import Result, median, ratio_result


def _objects(n: int) -> list[dict]:
    out: list[dict] = [
        {"apiVersion": "v1", "kind": "Namespace",
         "metadata": {"name": "bench", "labels": {"istio.io/dataplane-mode": "ambient"}}},
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
         "metadata": {"name": "wp", "namespace": "bench"},
         "spec": {"gatewayClassName": "istio-waypoint",
                  "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE"}]},
         "status": {"addresses": [{"type": "IPAddress", "value": "10.200.0.1"}]}}]
    for i in range(n):
        out.append({"apiVersion": "v1", "kind": "Service",
                    "metadata": {"name": f"s{i}", "namespace": "bench",
                                 "labels": {"istio.io/use-waypoint": "wp"}},
                    "spec": {"clusterIP": f"10.96.{i // 250}.{i % 250 + 1}",
                             "selector": {"app": f"a{i}"},
                             "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}})
        out.append(_pod(i, 1))
    return out


def _pod(i: int, generation: int) -> dict:
    ip = f"10.{100 + generation}.{i // 250}.{i % 250 + 1}"
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"p{i}", "namespace": "bench", "uid": f"u{i}",
                         "labels": {"app": f"a{i}"},
                         "annotations": {"ambient.istio.io/redirection": "enabled"}},
            "spec": {"nodeName": "n", "serviceAccountName": "sa", "containers": [{"name": "c"}]},
            "status": {"podIP": ip, "podIPs": [{"ip": ip}], "phase": "Running",
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def _route(value: str) -> dict:
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
            "metadata": {"name": "r", "namespace": "bench"},
            "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "s0"}],
                     "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": value}}],
                                "backendRefs": [{"name": "s0", "port": 80}]}]}}


class _Setup:
    def __init__(self, n: int):
        self.store = ObjectStore(CollectorRegistry())
        self.store.apply([(o, "bench") for o in _objects(n)])
        self.index = AmbientIndex(self.store, Mesh(), CollectorRegistry())
        self.index.start()
        self.configs = WaypointConfigs(self.store, self.index)
        self.configs.start()
        # what the xDS server does with every index change
        self.index.subscribe(self.configs.invalidate)
        self.opts = resources.Options()

    def build(self) -> resources.Message:
        return self.configs.config("bench", "wp", self.opts)

    def serialize_floor(self) -> float:
        cfg = self.build()
        t0 = time.perf_counter()
        for items in cfg.resources.values():
            for _v, msg in items.values():
                msg.SerializeToString()
        return time.perf_counter() - t0


def _timed_change(setup: _Setup, change) -> float:
    change()
    t0 = time.perf_counter()
    setup.build()
    return time.perf_counter() - t0


def run() -> list[Result]:
    big = _Setup(1000)
    t0 = time.perf_counter()
    big.build()
    cold = time.perf_counter() - t0
    floor = median([big.serialize_floor() for _ in range(5)])
    warm = median([_timed_change(big, lambda g=g: big.store.apply([(_pod(7, g), "bench")]))
                   for g in range(2, 9)])
    small = _Setup(100)
    small.build()
    # alternated round by round, so the machine's load drifts over both sizes alike
    route_small, route_big = [], []
    for v in range(15):
        route_small.append(_timed_change(small, lambda v=v: small.store.apply(
            [(_route(f"/v{v}"), "bench")])))
        route_big.append(_timed_change(big, lambda v=v: big.store.apply(
            [(_route(f"/v{v}"), "bench")])))
    return [
        ratio_result("waypoint config, 1000 services, cold build", cold, floor, "s", 2.0,
                     "floor: serializing the same resources once"),
        ratio_result("waypoint config, 1000 services, rebuild after one pod change", warm,
                     floor, "s", 2.0, "incremental: the changed service only"),
        ratio_result("waypoint config rebuild after one HTTPRoute change, 1000 vs 100 services",
                     median(route_big), median(route_small), "s", 1.3, "size independence"),
    ]
