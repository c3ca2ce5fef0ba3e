"""Restart's reason for a kept pod whose netns was not found names what was seen (a
newuser finding: after a re-ADD with another IP, restart said "recorded path gone" for
a path that exists)."""

from __future__ import annotations

from cni.enrollment.records import PodRecord
from cni.enrollment.recovery import Recovery


def test_reason_tells_a_gone_path_from_an_ip_mismatch(tmp_path):
    netns = tmp_path / "netns-file"  # stands in for the bind mount the runtime keeps
    netns.write_text("")
    rec = PodRecord("u1", "web", "shop", netns=str(netns), ips=["10.9.0.7"], status="enabled")
    why = Recovery.not_found_why(rec)
    assert f"recorded path {netns} exists but holds none of the recorded IPs (10.9.0.7)" in why
    assert "path gone" not in why
    netns.unlink()
    assert Recovery.not_found_why(rec).startswith("recorded path gone, ")
