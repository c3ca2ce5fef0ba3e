"""The xDS stream's state machine without I/O: :class:`ambient.xds.stream.XdsStream` is fed
request messages directly and returns the responses the server would send. No gRPC
server, no sockets, no root. The index is the real :class:`ambient.index.AmbientIndex`
over an :class:`ambient.store.ObjectStore` (through ``tests.ambient.builders.Harness``),
and changes reach the stream the way the server forwards them: generators invalidated
first, then :meth:`XdsStream.handle_push`.

The rules checked are the ones ``docs/xds.md`` states (first request always answered,
ACK silent, stale nonce ignored, NACK recorded and not resent, ``initial_resource_versions``
honoured, on-demand keys answered as found or removed and pushed once they resolve),
which mirror istiod's delta ADS server (``pilot/pkg/xds/delta.go``) and what ztunnel's
client (``src/xds/client.rs``) expects.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
from envoy.service.discovery.v3 import discovery_pb2

from ambient import workload_pb2 as wl
from ambient.api import IndexChange
from ambient.xds.generators import ADDRESS_TYPE, AUTHORIZATION_TYPE, default_generators
from ambient.xds.node import RequestError
from ambient.xds.stream import PreparedResponse, XdsStream
from tests.ambient.builders import Harness, pod, service

NODE_ID = "ztunnel~10.9.0.1~ztunnel-abcde.istio-system~istio-system.svc.cluster.local"
UID_A = "cluster0//Pod/ns/a"
UID_B = "cluster0//Pod/ns/b"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Rig:
    """A real index, the server's generators over it, and streams fed by hand."""

    def __init__(self, *objects: dict):
        self.h = Harness(*objects)
        self.generators = default_generators(self.h.index)
        self.h.index.subscribe(self._invalidate)

    def _invalidate(self, change: IndexChange) -> None:
        for gen in self.generators.values():  # what XdsServer.on_index_change does first
            gen.invalidate(change)

    def stream(self, delta: bool = True) -> XdsStream:
        return XdsStream(self.generators, self.h.index, peer="ipv4:127.0.0.1:1", delta=delta)

    def apply(self, s: XdsStream, *objects: dict) -> list:
        return s.handle_push(self.h.apply(*objects))

    def delete(self, s: XdsStream, kind: str, ns: str, name: str) -> list:
        return s.handle_push(self.h.delete(kind, ns, name))


def request(type_url: str = ADDRESS_TYPE, nonce: str = "", subscribe=(), unsubscribe=(),
            initial: dict | None = None, error: str = "") -> discovery_pb2.DeltaDiscoveryRequest:
    req = discovery_pb2.DeltaDiscoveryRequest(
        type_url=type_url, response_nonce=nonce, resource_names_subscribe=list(subscribe),
        resource_names_unsubscribe=list(unsubscribe),
        initial_resource_versions=initial or {})
    req.node.id = NODE_ID
    req.node.metadata.update({"NODE_NAME": "node"})
    if error:
        req.error_detail.code = 3
        req.error_detail.message = error
    return req


def as_delta(resp) -> discovery_pb2.DeltaDiscoveryResponse:
    return resp.parse() if isinstance(resp, PreparedResponse) else resp


def names(resp) -> list[str]:
    return sorted(r.name for r in as_delta(resp).resources)


def test_wildcard_first_request_gets_everything_then_ack_is_silent_and_stale_nonce_ignored():
    rig = Rig(pod("a", ip="10.1.0.1"), pod("b", ip="10.1.0.2"))
    s = rig.stream()
    [first] = s.handle_request(request())
    assert isinstance(first, PreparedResponse)  # the shared pre-serialized snapshot
    assert names(first) == [UID_A, UID_B]
    assert set(s.types[ADDRESS_TYPE].held) == {UID_A, UID_B}
    assert s.handle_request(request(nonce=first.nonce)) == []
    assert s.types[ADDRESS_TYPE].acks == 1
    assert s.handle_request(request(nonce="not-the-last-one")) == []
    assert s.types[ADDRESS_TYPE].stale == 1
    # the first request of a second type is answered too, even with nothing to send
    [authz] = s.handle_request(request(AUTHORIZATION_TYPE))
    assert as_delta(authz).type_url == AUTHORIZATION_TYPE and names(authz) == []


def test_one_pod_change_pushes_that_workload_only_and_a_delete_is_removed():
    rig = Rig(pod("a", ip="10.1.0.1"), pod("b", ip="10.1.0.2"))
    s = rig.stream()
    [first] = s.handle_request(request())
    s.handle_request(request(nonce=first.nonce))
    [push] = rig.apply(s, pod("a", ip="10.1.0.1", labels={"app": "new"}))
    assert names(push) == [UID_A] and not push.removed_resources
    held_version = s.types[ADDRESS_TYPE].held[UID_A]
    assert held_version == push.resources[0].version
    # the same object again changes nothing: no response at all
    assert rig.apply(s, pod("a", ip="10.1.0.1", labels={"app": "new"})) == []
    [gone] = rig.delete(s, "Pod", "ns", "b")
    assert names(gone) == [] and list(gone.removed_resources) == [UID_B]
    assert UID_B not in s.types[ADDRESS_TYPE].held


def test_nack_is_recorded_not_resent_and_the_rejected_resource_is_forgotten():
    rig = Rig(pod("a", ip="10.1.0.1"))
    s = rig.stream()
    [first] = s.handle_request(request())
    assert s.handle_request(request(nonce=first.nonce, error=f"{UID_A}: bad address")) == []
    ts = s.types[ADDRESS_TYPE]
    assert ts.nack_count == 1 and ts.nacks[-1]["detail"] == f"{UID_A}: bad address"
    assert UID_A not in ts.held  # ztunnel keeps no rejected resource: resend on next change
    [push] = rig.apply(s, pod("a", ip="10.1.0.1", labels={"app": "v2"}))
    assert names(push) == [UID_A]


def test_initial_resource_versions_skip_what_the_client_holds_and_remove_what_is_gone():
    rig = Rig(pod("a", ip="10.1.0.1"), pod("b", ip="10.1.0.2"))
    probe = rig.stream()
    [snap] = probe.handle_request(request())
    versions = {r.name: r.version for r in as_delta(snap).resources}
    s = rig.stream()  # a client reconnecting after a restart
    [first] = s.handle_request(request(initial={UID_A: versions[UID_A], UID_B: "stale",
                                                "cluster0//Pod/ns/gone": "v1"}))
    assert names(first) == [UID_B]
    assert list(first.removed_resources) == ["cluster0//Pod/ns/gone"]


def test_on_demand_key_found_not_found_and_pushed_once_it_resolves():
    rig = Rig(pod("a", ip="10.1.0.1", node="other"))
    s = rig.stream()
    # explicit subscription (no wildcard): ztunnel's on-demand mode
    [first] = s.handle_request(request(subscribe=["testnetwork/10.1.0.1"]))
    resp = as_delta(first)
    by_name = {r.name: r for r in resp.resources}
    # the workload with the key among its aliases, and a copy named by the key itself
    assert UID_A in by_name and "testnetwork/10.1.0.1" in by_name[UID_A].aliases
    assert "testnetwork/10.1.0.1" in by_name
    s.handle_request(request(nonce=resp.nonce))
    [missing] = s.handle_request(request(nonce=resp.nonce, subscribe=["testnetwork/10.1.0.9"]))
    assert names(missing) == [] and list(missing.removed_resources) == ["testnetwork/10.1.0.9"]
    s.handle_request(request(nonce=missing.nonce))
    # a pod that takes that IP later is pushed to the stream that asked for it
    [push] = rig.apply(s, pod("c", ip="10.1.0.9", node="other"))
    assert "cluster0//Pod/ns/c" in names(push)
    # an unrelated pod on another node is not
    assert rig.apply(s, pod("d", ip="10.1.0.7", node="other")) == []


def test_on_demand_warm_up_sends_the_workloads_on_the_clients_node():
    rig = Rig(pod("a", ip="10.1.0.1", node="node"), pod("b", ip="10.1.0.2", node="other"))
    s = rig.stream()
    [first] = s.handle_request(request(subscribe=["testnetwork/10.1.0.2"]))
    assert UID_A in names(first)  # NODE_NAME=node: its workloads without asking
    assert UID_B in names(first)


def test_service_member_change_is_pushed_to_a_stream_subscribed_to_the_service():
    svc = service("web", selector={"app": "web"}, cluster_ip="10.96.0.5")
    rig = Rig(svc, pod("a", ip="10.1.0.1", labels={"app": "web"}, node="other"))
    s = rig.stream()
    [first] = s.handle_request(request(subscribe=["ns/web.ns.svc.domain.suffix"]))
    assert "ns/web.ns.svc.domain.suffix" in names(first)
    s.handle_request(request(nonce=first.nonce))
    [push] = rig.apply(s, pod("b", ip="10.1.0.2", labels={"app": "web"}, node="other"))
    assert UID_B in names(push)


def test_unsubscribe_forgets_without_removal_and_resubscribe_answers_again():
    rig = Rig(pod("a", ip="10.1.0.1", node="other"))
    s = rig.stream()
    [first] = s.handle_request(request(subscribe=[UID_A]))
    assert names(first) == [UID_A]
    assert s.handle_request(request(nonce=first.nonce, unsubscribe=[UID_A])) == []
    assert UID_A not in s.types[ADDRESS_TYPE].held
    [again] = s.handle_request(request(nonce=first.nonce, subscribe=[UID_A]))
    assert names(again) == [UID_A]


def test_bad_requests_raise_request_error_naming_the_field():
    rig = Rig()
    s = rig.stream()
    no_node = discovery_pb2.DeltaDiscoveryRequest(type_url=ADDRESS_TYPE)
    with pytest.raises(RequestError, match="node.id"):
        s.handle_request(no_node)
    with pytest.raises(RequestError, match="type_url='type.googleapis.com/nope'"):
        s.handle_request(request("type.googleapis.com/nope"))


def test_state_of_the_world_stream_answers_ack_silently_and_pushes_full_state():
    rig = Rig(pod("a", ip="10.1.0.1"))
    s = rig.stream(delta=False)
    req = discovery_pb2.DiscoveryRequest(type_url=ADDRESS_TYPE)
    req.node.id = NODE_ID
    [first] = s.handle_request(req)
    assert isinstance(first, discovery_pb2.DiscoveryResponse) and first.version_info == "1"
    got = [wl.Address.FromString(r.value) for r in first.resources]
    assert [a.workload.uid for a in got] == [UID_A]
    ack = discovery_pb2.DiscoveryRequest(type_url=ADDRESS_TYPE, response_nonce=first.nonce,
                                         version_info=first.version_info)
    ack.node.id = NODE_ID
    assert s.handle_request(ack) == []
    [push] = rig.apply(s, pod("b", ip="10.1.0.2"))
    assert len(push.resources) == 2 and push.version_info == "2"


def test_the_stream_and_its_generators_import_no_grpc():
    """The state machine stays sans-I/O: importing it (and the index it reads) loads no
    gRPC module, so these tests need neither a server nor the grpc package's runtime."""
    code = ("import sys, ambient.xds.stream, ambient.xds.generators, ambient.xds.node, "
            "ambient.index; bad = sorted(m for m in sys.modules if m == 'grpc' "
            "or m.startswith('grpc.')); print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


async def test_first_push_is_set_by_a_complete_initial_address_response(server, connect):
    """``XdsServer.first_push`` (the daemon starts what the first push does not need
    after it, issue 28): unset while no client has been answered, set once a client was
    sent its initial Address response and holds every workload of it."""
    assert not server.first_push.is_set()
    client = await connect()
    await asyncio.wait_for(server.first_push.wait(), 30)
    await client.wait_for("Kubernetes//Pod/default/a", timeout=30)
    await client.wait_for("Kubernetes//Pod/default/b", timeout=30)
