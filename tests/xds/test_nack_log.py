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
