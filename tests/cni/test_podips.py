"""Pod addresses are normalized where they enter the agent (issue 17 item 5): the plugin
event, a Pod object's status, a persisted pod record. IPv4-mapped IPv6 becomes IPv4, as
upstream's ``netip.Addr.Unmap()``; bad values are named."""

from __future__ import annotations

import logging

import pytest

from cni.enrollment import PodRecord
from cni.events import CniPodEvent, EventError
from cni.podips import normalize_ip, normalize_ips, pod_status_ips


@pytest.mark.parametrize("given,expected", [
    ("::ffff:10.0.0.19", "10.0.0.19"),
    ("::FFFF:0a00:0013", "10.0.0.19"),  # the same address, hex form
    ("10.0.0.19", "10.0.0.19"),
    (" 10.0.0.19 ", "10.0.0.19"),
    ("FD00:0:0::1", "fd00::1"),
    ("::1", "::1"),
    ("64:ff9b::a00:13", "64:ff9b::a00:13"),  # NAT64, not mapped: stays IPv6
])
def test_normalize_ip(given, expected):
    assert normalize_ip(given) == expected


@pytest.mark.parametrize("bad", ["10.0.0.19/24", "pod-a", "", "10.0.0.256", 5, None])
def test_normalize_ip_names_field_and_value(bad):
    with pytest.raises(ValueError, match=r"field 'ips\[1\]'") as err:
        normalize_ips(["10.0.0.1", bad])
    assert repr(bad) in str(err.value)


def test_normalize_ips_drops_the_mapped_duplicate():
    assert normalize_ips(["::ffff:10.0.0.19", "10.0.0.19", "fd00::13"]) == ["10.0.0.19",
                                                                             "fd00::13"]


def test_event_from_json_unmaps_and_rejects():
    base = {"command": "ADD", "container_id": "c1", "netns": "/var/run/netns/x"}
    ev = CniPodEvent.from_json(dict(base, ips=["::ffff:10.0.0.19", "fd00::1"]))
    assert ev.ips == ["10.0.0.19", "fd00::1"]
    with pytest.raises(EventError, match=r"field 'ips\[0\]' is not an IP address: 'x'"):
        CniPodEvent.from_json(dict(base, ips=["x"]))


def test_pod_status_ips_as_upstream():
    def pod(status):
        return {"metadata": {"name": "p", "namespace": "n"}, "status": status}
    # podIPs wins when non-empty, else podIP; mapped forms unmapped
    assert pod_status_ips(pod({"podIP": "10.0.0.1", "podIPs": [
        {"ip": "::ffff:10.0.0.19"}, {"ip": "fd00::19"}]})) == ["10.0.0.19", "fd00::19"]
    assert pod_status_ips(pod({"podIP": "::ffff:10.0.0.1", "podIPs": []})) == ["10.0.0.1"]
    assert pod_status_ips(pod({})) == [] and pod_status_ips(None) == []
    assert pod_status_ips({"status": "odd"}) == []


def test_pod_status_ips_skips_and_names_a_bad_entry(caplog):
    caplog.set_level(logging.WARNING, "cni.podips")
    got = pod_status_ips({"metadata": {"name": "p", "namespace": "n"},
                          "status": {"podIPs": [{"ip": "nope"}, {"ip": "10.0.0.2"}]}})
    assert got == ["10.0.0.2"]
    assert "pod n/p: field 'status.podIPs[0].ip' is not an IP address: 'nope'" in caplog.text


def test_pod_record_keeps_good_addresses(caplog):
    caplog.set_level(logging.WARNING, "cni.podips")
    rec = PodRecord(uid="u1", ips=["::ffff:10.0.0.3", "junk", "10.0.0.3", "fd00::3"])
    assert rec.ips == ["10.0.0.3", "fd00::3"]
    assert "pod record u1: field 'ips[1]' is not an IP address: 'junk'" in caplog.text
