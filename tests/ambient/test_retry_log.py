"""ambient.source_kube.RetryLog: the reflectors' failures summarised, one WARNING per reason
per backoff step naming every kind, one INFO on recovery (the real API server stopped is
tests/kube/test_agent_apiserver_down.py; here the timing is driven by hand)."""

from __future__ import annotations

import asyncio
import logging

from ambient.source_kube import RetryLog

KINDS = [f"Kind{i}" for i in range(11)]
REASON = "ClientConnectorError: Cannot connect to host 127.0.0.1:6443"


async def test_one_line_per_step_for_every_kind(caplog):
    caplog.set_level(logging.INFO, "t.retry")
    rl = RetryLog(logging.getLogger("t.retry"), gather=0.15)
    delay = 0.3
    for _step in range(4):
        for kind in KINDS:  # every kind fails within a few ms, as in an outage
            rl.failed(kind, "list", REASON, delay)
            await asyncio.sleep(0.001)
        await asyncio.sleep(delay * 1.05)
        delay *= 2
    await asyncio.sleep(0.3)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 4, lines  # 44 failures, 4 lines
    for line in lines:
        assert "list of 11 kinds failed (Kind0, Kind1, Kind10, Kind2" in line, line
        assert REASON in line and "retrying in" in line, line
    for kind in KINDS:
        rl.recovered(kind)
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and "answers again" in infos[0], infos


async def test_other_reasons_get_their_own_lines_and_a_cured_failure_is_still_logged(caplog):
    caplog.set_level(logging.INFO, "t.retry2")
    rl = RetryLog(logging.getLogger("t.retry2"), gather=0.05)
    rl.failed("Pod", "watch", "403 Forbidden: pods", 0.05)
    rl.failed("Service", "watch", "MalformedStream: not JSON", 0.05)
    rl.recovered("Service")  # the next watch worked before the line was due: logged now
    rl.failed("Node", "list", REASON, 0.05)
    await asyncio.sleep(0.3)
    records = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert records[0] == (logging.WARNING, "kubernetes API: watch of 1 kind failed (Service): "
                                           "MalformedStream: not JSON; retrying in 0.1s"), records
    lines = sorted(m for level, m in records[1:] if level == logging.WARNING)
    assert len(lines) == 2, records
    assert "list of 1 kind failed (Node)" in lines[0], lines
    assert "watch of 1 kind failed (Pod): 403 Forbidden: pods" in lines[1], lines
    assert not [m for level, m in records if level == logging.INFO]  # Pod, Node still failing
