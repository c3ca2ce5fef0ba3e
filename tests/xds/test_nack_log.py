"""One log line per NACK over a real gRPC connection: the type URL, the rejected
resource names (at most MAX_NACK_NAMES, then how many more), the detail cut short, the
same client/type/detail at most once per window; the NACK counter by type URL."""

from __future__ import annotations

import logging
import time

from agent.status.report import xds as xds_report

from ambient.xds import server as xds_server
from ambient.xds.generators import ADDRESS_TYPE
from ambient.xds.stream import MAX_NACK_NAMES, nacked_names
from tests.helpers import eventually
from tests.xds.fake_index import pod


def _nack_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and " NACKed " in r.getMessage()]


def _nacks(server) -> int:
    return server.debug_state()["clients"][0]["types"][ADDRESS_TYPE]["nacks"]


def _counted(server) -> float:
    for metric in server.registry.collect():
        if metric.name == "ambient_agent_xds_nacks":
            return sum(s.value for s in metric.samples
                       if s.name.endswith("_total") and s.labels.get("type_url") == ADDRESS_TYPE)
    return 0.0


async def test_nack_logged_once_with_names_bounded_detail_and_counted(connect, index, server,
                                                                       caplog):
    caplog.set_level(logging.WARNING, logger=xds_server.__name__)
    # every served type has its series at 0 before the first NACK (a rate has a start)
    for type_url in xds_server.SERVED_TYPES:
        assert server.registry.get_sample_value("ambient_agent_xds_nacks_total",
                                                {"type_url": type_url}) == 0, type_url
    bad = [f"bad{i}" for i in range(MAX_NACK_NAMES + 3)]
    reason = "x" * 5000
    client = await connect(validator=lambda t, name, msg: reason if "/bad" in name else None)
    await client.wait_synced()
    index.put(*(pod(n, ip=f"10.0.1.{i + 1}") for i, n in enumerate(bad)))
    await eventually(lambda: _nacks(server) == 1, timeout=30)
    (line,) = _nack_lines(caplog)
    assert ADDRESS_TYPE in line
    named = [f"Kubernetes//Pod/default/{n}" for n in sorted(bad)][:MAX_NACK_NAMES]
    assert f"[{', '.join(named)} and 3 more]" in line, line
    assert len(line) < 1500, len(line)  # 5,000-character reasons x 8 are cut short
    assert _counted(server) == 1
    # ambient-agent status: the NACK line names the rejected resources too
    text = "\n".join(xds_report(server.debug_state(), time.time()))
    assert "NACK of nonce" in text and f"[{', '.join(named)} and 3 more]" in text, text

    # the same rejection again (the rejected pods change, so they are sent again and
    # NACKed again): counted every time, logged once in the window
    for round_ in (2, 3):
        index.put(*(pod(n, ip=f"10.0.{round_}.{i + 1}") for i, n in enumerate(bad)))
        await eventually(lambda r=round_: _nacks(server) == r, timeout=30)
    assert _counted(server) == 3
    assert len(_nack_lines(caplog)) == 1, _nack_lines(caplog)


def test_nacked_names_are_those_the_detail_names_else_all():
    sent = ["a", "ab", "inbound-vip|80|http|web.ns.svc.cluster.local"]
    assert nacked_names(sent, "ab: bad; x") == ["ab"]
    assert nacked_names(sent, "Error adding/updating cluster(s) "
                              "inbound-vip|80|http|web.ns.svc.cluster.local: Proto constraint") \
        == ["inbound-vip|80|http|web.ns.svc.cluster.local"]
    assert nacked_names(list(reversed(sent)), "something else entirely") == sent


# Envoy's wording of a resource its proto validation refuses (source/common/protobuf/
# utility.cc: "Proto constraint validation failed (" + the validator's chain + "): " +
# the resource's text), in that form for an HTTPRoute retry backoff of 0s (the cause a
# trial user found only in Envoy's own log)
ENVOY_PGV = (
    "Proto constraint validation failed (RouteConfigurationValidationError.VirtualHosts[0]: "
    "embedded message failed validation | caused by VirtualHostValidationError.Routes[0]: "
    "embedded message failed validation | caused by field: \"route\", reason: embedded "
    "message failed validation | caused by RouteActionValidationError.RetryPolicy: embedded "
    "message failed validation | caused by RetryPolicyValidationError.RetryBackOff: embedded "
    "message failed validation | caused by RetryBackOffValidationError.BaseInterval: value "
    "must be greater than 0s): goo.gle/debugstr name: \"inbound-vip|80|http|server\" "
    + "virtual_hosts { routes { match { prefix: \"/\" } } } " * 40)


def test_the_nack_detail_leads_with_envoys_innermost_reason():
    """The NACK's log line and ``/debug`` detail were the first characters of Envoy's
    message: a chain of "embedded message failed validation" and the resource's text,
    the reason itself cut off (newuser finding). The innermost cause comes first now;
    a detail of another wording (ztunnel's, Envoy's other errors) is kept as it was."""
    from ambient.xds.stream import nack_detail, nack_reason
    assert nack_reason(ENVOY_PGV) == ("RetryBackOffValidationError.BaseInterval: value must "
                                      "be greater than 0s")
    detail = nack_detail(ENVOY_PGV, 400)
    assert detail.startswith("RetryBackOffValidationError.BaseInterval: value must be greater "
                             "than 0s (in: Proto constraint validation failed (")
    assert detail.endswith("more characters)") and len(detail) < 450
    flat = ("Proto constraint validation failed (ClusterValidationError.ConnectTimeout: "
            "value must be greater than 0s): name: \"c\"")
    assert nack_reason(flat) == "ClusterValidationError.ConnectTimeout: value must be greater than 0s"
    for other in ("Kubernetes//Pod/a/b: unknown field", "Invalid duration: Expected positive"):
        assert nack_reason(other) == "" and nack_detail(other, 400) == other
