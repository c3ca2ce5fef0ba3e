"""A delta NACK of a waypoint resource, on a real :class:`WaypointStream` fed real
``DeltaDiscoveryRequest`` s (no Envoy: tests/waypoint/test_envoy_nack.py is the Envoy
side): the stream holds again what the client had, never resends the rejected version,
sends a fixed one, and a NACK of a response that is no longer the newest still counts."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import struct_pb2
from prometheus_client import CollectorRegistry

from ambient.index import AmbientIndex
from ambient.objects import Mesh
from ambient.store import ObjectStore
from ambient.waypoint import resources as wr
from ambient.xds.node import parse_node
from ambient.xds.stream import XdsStream
from ambient.xds.waypoint_stream import WaypointStream
from tests.waypoint.nack_inject import InjectingConfigs, cluster

NODE_ID = "waypoint~10.0.0.1~wp-abc-def.demo~demo.svc.cluster.local"
X = "test-injected"


def _node() -> base_pb2.Node:
    md = struct_pb2.Struct()
    md.update({"WAYPOINT_NAME": "wp"})
    return base_pb2.Node(id=NODE_ID, metadata=md)


def _stream():
    store = ObjectStore(CollectorRegistry())
    store.apply([({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "demo"}}, "t"),
                 ({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
                   "metadata": {"name": "wp", "namespace": "demo"},
                   "spec": {"gatewayClassName": "istio-waypoint", "listeners": [
                       {"name": "mesh", "port": 15008, "protocol": "HBONE"}]}}, "t")])
    index = AmbientIndex(store, Mesh(), CollectorRegistry())
    index.start()
    configs = InjectingConfigs(store, index)
    stream = WaypointStream(configs, XdsStream({}, index), parse_node(_node()),
                            secret_identity=None)
    return stream, configs, index


def _req(nonce: str = "", error: str = "") -> discovery_pb2.DeltaDiscoveryRequest:
    req = discovery_pb2.DeltaDiscoveryRequest(type_url=wr.CLUSTER_TYPE, node=_node(),
                                              response_nonce=nonce)
    if error:
        req.error_detail.code = 3
        req.error_detail.message = error
    return req


def _set(stream, configs, version: str, timeout: int):
    configs.extra = {wr.CLUSTER_TYPE: {X: (version, cluster(X, timeout))}}
    configs.invalidate()
    return stream.handle_push(None)  # type: ignore[arg-type]


def _names(responses) -> list[str]:
    return [r.name for resp in responses for r in resp.resources]


def test_nacked_resource_is_not_resent_and_its_fix_is():
    stream, configs, index = _stream()
    try:
        configs.extra = {wr.CLUSTER_TYPE: {X: ("good-0", cluster(X, 1))}}
        (first,) = stream.handle_request(_req())
        assert X in [r.name for r in first.resources]
        assert stream.handle_request(_req(first.nonce)) == []  # ACK
        ts = stream.types[wr.CLUSTER_TYPE]

        (bad,) = _set(stream, configs, "bad-1", -1)
        assert _names([bad]) == [X]
        stream.handle_request(_req(bad.nonce, f"Error adding/updating cluster(s) {X}: "
                                              f"Proto constraint validation failed"))
        assert ts.nack_count == 1 and ts.nacks[-1]["names"] == [X]
        assert ts.held[X] == "good-0" and ts.rejected == {X: "bad-1"}  # what Envoy has
        # any later push: the rejected version is not sent again (no NACK loop)
        assert _names(_set(stream, configs, "bad-1", -1)) == []
        # the fix is sent, and forgets the rejection
        (fixed,) = _set(stream, configs, "good-2", 2)
        assert _names([fixed]) == [X] and ts.rejected == {}
        stream.handle_request(_req(fixed.nonce))
        assert ts.held[X] == "good-2" and ts.acks == 2

        # a revert to what the client holds after a NACK is nothing to send
        (bad,) = _set(stream, configs, "bad-3", -1)
        stream.handle_request(_req(bad.nonce, f"{X}: rejected"))
        assert _names(_set(stream, configs, "good-2", 2)) == []
        assert ts.held[X] == "good-2"
    finally:
        index.stop()


def test_nack_of_an_older_response_still_counts_and_marks_the_rejection():
    stream, configs, index = _stream()
    try:
        (first,) = stream.handle_request(_req())
        stream.handle_request(_req(first.nonce))
        ts = stream.types[wr.CLUSTER_TYPE]
        (bad,) = _set(stream, configs, "bad-1", -1)          # response N: the bad cluster
        configs.extra[wr.CLUSTER_TYPE]["other"] = ("o-1", cluster("other", 1))
        configs.invalidate()
        (newer,) = stream.handle_push(None)  # type: ignore[arg-type]  # N+1: another one
        assert _names([newer]) == ["other"]
        # Envoy NACKs N (each delta response on its own), then ACKs N+1
        assert stream.handle_request(_req(bad.nonce, f"{X}: bad")) == []
        assert ts.nack_count == 1 and ts.stale == 1 and ts.rejected == {X: "bad-1"}
        assert X not in ts.held  # Envoy never had it
        stream.handle_request(_req(newer.nonce))
        assert ts.held["other"] == "o-1"
        (fixed,) = _set(stream, configs, "good-2", 2)
        assert X in _names([fixed])
    finally:
        index.stop()
