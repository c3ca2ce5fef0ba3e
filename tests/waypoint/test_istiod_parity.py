"""Unit checks of the differences tests/oracle/test_waypoint_oracle.py found against istiod
(that suite needs root and Go; these run everywhere): a member pod outside the mesh gets
a plaintext endpoint, inbound-vip clusters balance by least request with panic mode off,
connect_originate accepts the trust domain's SANs, default routes retry as istiod's."""

from __future__ import annotations

from ambient.waypoint import resources as wr
from ambient.waypoint.httproute import DEFAULT_RETRY
from ambient.waypoint.model import Endpoint, ServicePort, WaypointModel


def test_endpoint_outside_mesh_is_plaintext_and_captured_is_hbone():
    cla = wr._endpoints("c", [Endpoint("10.1.0.1", 8080, "u1", hbone=False),
                              Endpoint("10.1.0.2", 8080, "u2")])
    plain, hbone = cla["endpoints"][0]["lb_endpoints"]
    assert plain["endpoint"]["address"] == {"socket_address": {"address": "10.1.0.1",
                                                               "port_value": 8080}}
    assert "metadata" not in plain
    assert hbone["endpoint"]["address"]["envoy_internal_address"] == {
        "server_listener_name": "connect_originate", "endpoint_id": "10.1.0.2:8080"}
    assert hbone["metadata"]["filter_metadata"][wr.ORIGINAL_DST_KEY] == {"local": "10.1.0.2:8080"}


def test_vip_cluster_least_request_panic_off():
    c = wr._vip_cluster("inbound-vip|80|http|a.b.svc.cluster.local",
                        ServicePort(80, "HTTP", "http"), "http")
    assert c["lb_policy"] == "LEAST_REQUEST"
    assert c["common_lb_config"] == {"healthy_panic_threshold": {}}


def test_connect_originate_accepts_trust_domain():
    c = wr.connect_originate_cluster(WaypointModel("ns1", "wp", "td.example"))
    sans = c["transport_socket"]["typed_config"]["common_tls_context"][
        "combined_validation_context"]["default_validation_context"][
        "match_typed_subject_alt_names"]
    assert [s["matcher"]["prefix"] for s in sans] == ["spiffe://td.example/",
                                                     "spiffe://td.example/ns/ns1/sa/"]


def test_default_route_retries_and_parses():
    rc = wr._route_config("inbound-vip|80|http|a.b.svc.cluster.local",
                          "inbound-vip|80|http|a.b.svc.cluster.local", 80)
    route = rc["virtual_hosts"][0]["routes"][0]["route"]
    assert route["retry_policy"] is DEFAULT_RETRY and route["retry_policy"]["num_retries"] == 2
    wr.to_message(wr.ROUTE_TYPE, rc)  # Envoy's schema accepts it


def test_endpoint_messages_match_the_dict_form():
    """The Assembler builds endpoints directly as messages: the same as the dict form."""
    eps = [Endpoint("10.1.0.1", 8080, "u1", hbone=False), Endpoint("10.1.0.2", 8080, "u2"),
           Endpoint("fd00::3", 9090, "u3", hbone=False)]
    assert wr._endpoints_message("c", eps) == wr.to_message(wr.ENDPOINT_TYPE,
                                                            wr._endpoints("c", eps))
