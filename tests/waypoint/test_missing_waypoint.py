"""A Service whose ``istio.io/use-waypoint`` names a Gateway that is no waypoint: one
WARNING from the index (the YAML directory's only report), and the
``istio.io/WaypointBound`` condition istiod writes (pilot/pkg/model/service.go
``GetConditions``, pilot/pkg/serviceregistry/ambient/waypoints.go
``fetchWaypointForTarget``), which the status writer writes in Kubernetes mode. Real
store and index."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry

from ambient.index import AmbientIndex
from ambient.objects import Mesh
from ambient.store import ObjectStore
from ambient.waypoint.status import WAYPOINT_BOUND, statuses
from ambient.waypoint.status_writer import merged_service_status

NS = "mw"
GW = "gateway.networking.k8s.io/v1"


def _svc(name: str, labels: dict, ip: str) -> dict:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": NS, "labels": labels, "generation": 2},
            "spec": {"clusterIP": ip, "ports": [{"name": "http", "port": 80}]}}


def _gateway(name: str, ready: bool = True, allowed: str | None = None,
             traffic: str | None = None) -> dict:
    listener: dict = {"name": "mesh", "port": 15008, "protocol": "HBONE"}
    if allowed:
        listener["allowedRoutes"] = {"namespaces": {"from": allowed}}
    gw: dict = {"apiVersion": GW, "kind": "Gateway",
                "metadata": {"name": name, "namespace": NS,
                             "labels": {"istio.io/waypoint-for": traffic} if traffic else {}},
                "spec": {"gatewayClassName": "istio-waypoint", "listeners": [listener]}}
    if ready:
        gw["status"] = {"addresses": [{"type": "IPAddress", "value": "10.204.0.1"}]}
    return gw


def _store(*objs: dict) -> ObjectStore:
    store = ObjectStore(CollectorRegistry())
    store.apply([({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}, "t"),
                 *((o, "t") for o in objs)])
    return store


def _cond(store: ObjectStore, name: str) -> dict | None:
    found = statuses(store)["services"].get(f"{NS}/{name}")
    if found is None:
        return None
    (cond,) = found["conditions"]
    assert cond["type"] == WAYPOINT_BOUND
    return cond


def _short(cond: dict | None) -> tuple | None:
    return None if cond is None else (cond["status"], cond["reason"], cond["message"])


def test_waypoint_bound_condition_as_istiod_writes_it():
    store = _store(
        _svc("ghost-user", {"istio.io/use-waypoint": "ghost"}, "10.98.1.1"),
        _svc("early", {"istio.io/use-waypoint": "notyet"}, "10.98.1.2"),
        _svc("bound", {"istio.io/use-waypoint": "wp"}, "10.98.1.3"),
        _svc("ingress", {"istio.io/use-waypoint": "wp",
                         "istio.io/ingress-use-waypoint": "true"}, "10.98.1.4"),
        _svc("workload-only", {"istio.io/use-waypoint": "wl"}, "10.98.1.5"),
        _svc("opted-out", {"istio.io/use-waypoint": "none"}, "10.98.1.6"),
        _svc("plain", {}, "10.98.1.7"),
        _gateway("notyet", ready=False), _gateway("wp"), _gateway("wl", traffic="workload"))
    assert _short(_cond(store, "ghost-user")) == (
        "False", "WaypointIsNotReady", f'waypoint "{NS}/ghost" is not ready')
    assert _cond(store, "ghost-user")["observedGeneration"] == 2
    assert _short(_cond(store, "early")) == (
        "False", "WaypointIsNotReady", f'waypoint "{NS}/notyet" is not ready')
    assert _short(_cond(store, "bound")) == (
        "True", "WaypointAccepted", f"Successfully attached to waypoint {NS}/wp")
    assert _short(_cond(store, "ingress")) == (
        "True", "WaypointAccepted", f"Successfully attached to waypoint {NS}/wp. Ingress "
                                    f"traffic will traverse the waypoint")
    assert _short(_cond(store, "workload-only")) == (
        "False", "UnsupportedTrafficType", 'attempting to bind to traffic type "service" '
                                           f'which the waypoint "{NS}/wl" does not support')
    assert _cond(store, "opted-out") is None and _cond(store, "plain") is None


def test_attachment_denied_from_another_namespace():
    store = _store(_gateway("wp"))
    store.apply([({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "other"}}, "t"),
                 ({**_svc("far", {"istio.io/use-waypoint": "wp",
                                  "istio.io/use-waypoint-namespace": NS}, "10.98.2.1"),
                   "metadata": {"name": "far", "namespace": "other",
                                "labels": {"istio.io/use-waypoint": "wp",
                                           "istio.io/use-waypoint-namespace": NS}}}, "t")])
    cond = statuses(store)["services"]["other/far"]["conditions"][0]
    assert (cond["status"], cond["reason"]) == ("False", "AttachmentDenied")
    assert f'waypoint "{NS}/wp" (missing allowedRoutes?)' in cond["message"]


def test_merged_service_status_keeps_other_conditions_and_prunes_ours():
    current = {"loadBalancer": {}, "conditions": [
        {"type": "Other", "status": "True", "reason": "R", "message": "m"},
        {"type": WAYPOINT_BOUND, "status": "False", "reason": "WaypointIsNotReady",
         "message": "x", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
    want = {"conditions": [{"type": WAYPOINT_BOUND, "status": "False",
                            "reason": "WaypointIsNotReady", "message": "y",
                            "observedGeneration": 1}]}
    out = merged_service_status(current, want, "2026-02-02T00:00:00Z")
    assert out["loadBalancer"] == {} and [c["type"] for c in out["conditions"]] == [
        "Other", WAYPOINT_BOUND]
    assert out["conditions"][1]["lastTransitionTime"] == "2026-01-01T00:00:00Z"  # same status
    assert [c["type"] for c in merged_service_status(current, {"conditions": []}, "now")[
        "conditions"]] == ["Other"]
    assert "conditions" not in merged_service_status(
        {"conditions": current["conditions"][1:]}, {"conditions": []}, "now")


def test_index_warns_once_then_binds_when_the_gateway_appears(caplog):
    caplog.set_level(logging.WARNING, logger="ambient.index_services")
    store = _store(_svc("web", {"istio.io/use-waypoint": "ghost"}, "10.98.3.1"))
    index = AmbientIndex(store, Mesh(), CollectorRegistry())
    index.start()
    try:
        def warnings() -> list[str]:
            return [r.getMessage() for r in caplog.records
                    if r.levelno == logging.WARNING and "use-waypoint" in r.getMessage()]
        (line,) = warnings()
        assert f"Service {NS}/web: label istio.io/use-waypoint names waypoint {NS}/ghost, " \
               f"which does not exist: not bound to a waypoint" == line
        # the service changes (re-bound by the index): still one warning
        store.apply([(_svc("web", {"istio.io/use-waypoint": "ghost", "x": "1"}, "10.98.3.1"),
                      "t")])
        assert len(warnings()) == 1
        address = index.address(f"{NS}/web.{NS}.svc.cluster.local")
        assert not address.service.HasField("waypoint")
        # a Gateway of that name, not ready yet: said once more, why it differs
        store.apply([(_gateway("ghost", ready=False), "t")])
        store.apply([(_svc("web", {"istio.io/use-waypoint": "ghost", "x": "2"}, "10.98.3.1"),
                      "t")])
        assert len(warnings()) == 1  # same waypoint named: not repeated
        store.apply([(_gateway("ghost"), "t")])
        address = index.address(f"{NS}/web.{NS}.svc.cluster.local")
        assert address.service.HasField("waypoint")
        # unbound again later (the Gateway goes): warned again
        store.apply(deletes=[("Gateway", NS, "ghost")])
        assert len(warnings()) == 2
    finally:
        index.stop()
