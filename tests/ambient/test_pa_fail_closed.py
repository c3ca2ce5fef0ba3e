"""A PeerAuthentication that can't be read is STRICT for what it covers, never PERMISSIVE
or DISABLE, and logs one bounded warning naming the field and value (docs/ambient.md)."""

from __future__ import annotations

import logging

import pytest

from ambient import translate_authz as tz
from tests.ambient.builders import Harness, policy, pod

STATIC = "istio-system/istio_converted_static_strict"
POD = "cluster0//Pod/ns1/p1"


def _harness(*objs: dict) -> Harness:
    return Harness(policy("mesh", "istio-system", kind="PeerAuthentication",
                          mtls={"mode": "PERMISSIVE"}),
                   pod("p1", "ns1", labels={"app": "a"}), *objs)


def _keys(h: Harness) -> list[str]:
    return list(h.workload(POD).authorization_policies)


def test_readable_permissive_sends_nothing():
    h = _harness(policy("ns", "ns1", kind="PeerAuthentication", mtls={"mode": "PERMISSIVE"}))
    assert _keys(h) == []


@pytest.mark.parametrize("mtls", [{"mode": "permissive"}, {"mode": 7}, "PERMISSIVE",
                                  {"mode": ["DISABLE"]}])
def test_unreadable_namespace_mode_is_strict(mtls):
    h = _harness(policy("ns", "ns1", kind="PeerAuthentication", mtls=mtls))
    assert _keys(h) == [STATIC]


def test_unreadable_workload_mode_is_strict():
    h = _harness(policy("ns", "ns1", kind="PeerAuthentication", mtls={"mode": "PERMISSIVE"}),
                 policy("wl", "ns1", kind="PeerAuthentication", mtls={"mode": "Off"},
                        selector={"matchLabels": {"app": "a"}}))
    assert _keys(h) == [STATIC]


def test_unreadable_port_mode_is_strict_on_that_port():
    h = _harness(policy("wl", "ns1", kind="PeerAuthentication", mtls={"mode": "PERMISSIVE"},
                        selector={"matchLabels": {"app": "a"}},
                        portLevelMtls={"9090": {"mode": "bogus"}, "8080": {"mode": "DISABLE"}}))
    assert _keys(h) == ["ns1/converted_peer_authentication_wl"]
    a = h.index.authorization("ns1/converted_peer_authentication_wl")
    assert [list(g.rules[0].matches[0].destination_ports) for g in a.groups] == [[9090]]


@pytest.mark.parametrize("port_level", [["9090"], "9090", {"http": {"mode": "PERMISSIVE"}},
                                        {"0": {"mode": "STRICT"}}, {"70000": {}}])
def test_unreadable_port_map_is_strict_everywhere(port_level):
    h = _harness(policy("wl", "ns1", kind="PeerAuthentication", mtls={"mode": "PERMISSIVE"},
                        selector={"matchLabels": {"app": "a"}},
                        portLevelMtls=port_level))
    assert _keys(h) == [STATIC]


@pytest.mark.parametrize("selector", [{"matchLabels": ["app"]}, {"matchLabels": {"app": 1}},
                                      "app=a", ["app"]])
def test_unreadable_selector_is_strict_for_the_namespace(selector):
    h = _harness(policy("ns", "ns1", kind="PeerAuthentication", mtls={"mode": "PERMISSIVE"}),
                 policy("wl", "ns1", kind="PeerAuthentication", mtls={"mode": "DISABLE"},
                        selector=selector, created="2024-03-01T00:00:00Z"),
                 pod("p2", "ns1", ip="1.2.3.9", labels={"app": "b"}))
    assert _keys(h) == [STATIC]
    assert list(h.workload("cluster0//Pod/ns1/p2").authorization_policies) == [STATIC]


def test_unreadable_root_selector_is_strict_mesh_wide():
    h = _harness(policy("wl", "istio-system", kind="PeerAuthentication",
                        mtls={"mode": "DISABLE"}, selector={"matchLabels": {"app": 1}}))
    assert _keys(h) == [STATIC]


def test_one_bounded_escaped_warning_per_object(caplog):
    caplog.set_level(logging.WARNING, logger="ambient.index_policies")
    bad = "x\n" + "y" * 5000
    h = _harness(policy("wl", "ns1", kind="PeerAuthentication", mtls={"mode": bad},
                        selector={"matchLabels": {"app": "a"}}))
    lines = [r.getMessage() for r in caplog.records if "PeerAuthentication ns1/wl" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "spec.mtls.mode" in lines[0] and "read as STRICT" in lines[0]
    assert "\n" not in lines[0] and len(lines[0]) < 1000
    caplog.clear()
    h.apply(policy("other", "ns2", kind="PeerAuthentication", mtls={"mode": "STRICT"}))
    assert not [r for r in caplog.records if "ns1/wl" in r.getMessage()]
    assert _keys(h) == [STATIC]


def test_reader_never_raises():
    for sp in (None, "x", [], {"mtls": None, "portLevelMtls": {"1": None}},
               {"portLevelMtls": {True: {"mode": "STRICT"}}}):
        read = tz.read_peer_authentication({"metadata": {"name": "n", "namespace": "n"},
                                            "spec": sp})
        assert read.mode in tz.MODES
