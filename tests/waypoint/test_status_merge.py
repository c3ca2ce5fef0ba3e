"""How the status writer merges what it computed into an object's current status
(ambient/waypoint/status_writer.py): other controllers' route parents kept, ours replaced,
``lastTransitionTime`` kept while a condition's status stays. Pure functions, no server;
the writes themselves are tested against the real API server in
tests/kube/test_waypoint_status.py."""

from __future__ import annotations

from ambient.waypoint.status import CONTROLLER
from ambient.waypoint.status_writer import merged_gateway_status, merged_route_status


def cond(kind: str, status: str, reason: str, t: str | None = None) -> dict:
    c = {"type": kind, "status": status, "reason": reason, "message": "m",
         "observedGeneration": 1}
    return {**c, "lastTransitionTime": t} if t else c


def test_route_merge_keeps_theirs_replaces_ours_and_keeps_unchanged_times():
    theirs = {"parentRef": {"name": "gw"}, "controllerName": "example.com/x",
              "conditions": [cond("Accepted", "True", "Accepted", "2020-01-01T00:00:00Z")]}
    old_ours = {"parentRef": {"group": "", "kind": "Service", "name": "web"},
                "controllerName": CONTROLLER,
                "conditions": [cond("Accepted", "True", "Accepted", "2021-01-01T00:00:00Z"),
                               cond("ResolvedRefs", "True", "ResolvedRefs",
                                    "2021-01-01T00:00:00Z")]}
    stale = {"parentRef": {"group": "", "kind": "Service", "name": "gone"},
             "controllerName": CONTROLLER, "conditions": []}
    current = {"parents": [theirs, old_ours, stale]}
    desired = {"parents": [{"parentRef": old_ours["parentRef"], "controllerName": CONTROLLER,
                            "conditions": [cond("Accepted", "True", "Accepted"),
                                           cond("ResolvedRefs", "False", "BackendNotFound")]}]}
    out = merged_route_status(current, desired, "2030-01-01T00:00:00Z")
    assert out["parents"][0] == theirs
    assert len(out["parents"]) == 2  # the entry for the parent no longer named is gone
    got = {c["type"]: c for c in out["parents"][1]["conditions"]}
    assert got["Accepted"]["lastTransitionTime"] == "2021-01-01T00:00:00Z"
    assert got["ResolvedRefs"]["lastTransitionTime"] == "2030-01-01T00:00:00Z"
    # merging again with the result as current changes nothing (no write is due)
    assert merged_route_status(out, desired, "2031-01-01T00:00:00Z") == out


def test_gateway_merge_drops_addresses_it_no_longer_reports():
    current = {"addresses": [{"type": "IPAddress", "value": "10.0.0.1"}],
               "conditions": [cond("Programmed", "True", "Programmed", "2021-01-01T00:00:00Z")],
               "listeners": []}
    desired = {"addresses": [], "listeners": [],
               "conditions": [cond("Programmed", "False", "AddressNotAssigned")]}
    out = merged_gateway_status(current, desired, "2030-01-01T00:00:00Z")
    assert "addresses" not in out
    assert out["conditions"][0]["lastTransitionTime"] == "2030-01-01T00:00:00Z"
    assert merged_gateway_status(out, desired, "2031-01-01T00:00:00Z") == out
