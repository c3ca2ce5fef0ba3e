"""docs/ztunnel.md states the certificate lifetimes the code gives (issue 26 item 3).

The page once said the TLS port's certificate lives 24 h (it lives ``secret_ttl`` plus
the backdated 2 minutes) and that the CA signs whatever lifetime ztunnel asks (a request
below the floor is raised to it). Each number the page gives is checked against the
constant the code uses, so the page and the code can't drift apart again.
"""

from __future__ import annotations

import re
from pathlib import Path

from agent.core.config import SETTINGS
from agent.sds.ca_embedded import BACKDATE, DEFAULT_TTL, MAX_TTL, MIN_TTL

PAGE = Path(__file__).resolve().parent.parent / "docs" / "ztunnel.md"


def section(title: str) -> str:
    text = PAGE.read_text()
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, f"docs/ztunnel.md has no section {title!r}"
    return " ".join(m.group(1).split())


def test_workload_certificate_lifetime_section_matches_the_ca():
    text = section("Workload certificate lifetime")
    floor = MIN_TTL // 60
    assert f"below {floor} minutes gets {floor} minutes" in text, text
    assert f"{MAX_TTL // 86400} days is refused" in text
    assert f"0 or none gets {DEFAULT_TTL // 3600} h" in text
    assert f"NotBefore {int(BACKDATE.total_seconds() // 60)} minutes in the past" in text
    assert "set ztunnel's `SECRET_TTL`" in text  # how to bound it


def test_tls_port_certificate_lifetime_is_secret_ttl_plus_backdate():
    text = " ".join(PAGE.read_text().split())
    default = next(s for s in SETTINGS if s.name == "secret_ttl").default
    assert f"lives `secret_ttl` (default {int(default // 3600)} h" in text
    assert f"plus the {int(BACKDATE.total_seconds() // 60)} minutes its NotBefore is backdated" in text
    assert "renewed at half of what is left" in text


def test_the_page_says_how_to_run_pods_without_the_demo_and_what_a_pod_needs():
    plain = section("Pods as plain network namespaces, without the demo")
    assert "cnitool" in plain and "ip netns add" in plain and "CNI_COMMAND=ADD" in plain
    pod = section("What a Pod object needs to be served to ztunnel")
    for field in ("status.podIPs", "spec.serviceAccountName", "spec.nodeName",
                  "ambient.istio.io/redirection"):
        assert field in pod, field
