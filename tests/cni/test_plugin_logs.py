"""The plugin's log lines reach the agent's log (upstream's plugin tees its log to the node
agent): the real plugin, exec'd through the installer's launcher, against the real CNI
event server. A failed ADD's reason is logged by the agent under ``cni.plugin``; the
forwarding is bounded, never waited on, and survives a missing agent; ``POST /log``
refuses what is not an array of log lines without a traceback."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp

from cni import eventserver, plugin
from tests.cni.conftest import cni_env, net_conf, run_plugin


async def _until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_failed_add_reason_is_in_the_agent_log(cni_agent, launcher, caplog):
    caplog.set_level(logging.INFO, logger="cni.plugin")
    cni_agent.enroller.fail_with = "no ztunnel connected within 30s"
    rc, out, err = await run_plugin(launcher, cni_env(), net_conf(cni_agent.run_dir,
                                                                ambient_default=True))
    assert rc == 1 and "no ztunnel connected within 30s" in err  # stderr keeps it too
    await _until(lambda: any(r.name == "cni.plugin" for r in caplog.records))
    [rec] = [r for r in caplog.records if r.name == "cni.plugin"]
    line = rec.getMessage()
    assert rec.levelno == logging.ERROR
    assert "ADD failed (code 999)" in line and "no ztunnel connected within 30s" in line
    assert "container_id=c0ffee" in line and "pod=demo/web-0" in line
    assert "[plugin time " in line


async def test_debug_lines_follow_plugin_log_level(cni_agent, launcher, caplog):
    caplog.set_level(logging.DEBUG, logger="cni.plugin")
    # info (the default): a successful ADD has nothing to say, nothing is sent
    rc, _, _ = await run_plugin(launcher, cni_env(), net_conf(cni_agent.run_dir))
    assert rc == 0
    rc, _, _ = await run_plugin(launcher, cni_env(), net_conf(
        cni_agent.run_dir, plugin_log_level="debug"))
    assert rc == 0
    await _until(lambda: any(r.name == "cni.plugin" for r in caplog.records))
    msgs = [r.getMessage() for r in caplog.records if r.name == "cni.plugin"]
    assert len(msgs) == 1 and "agent answered" in msgs[0]


def test_no_agent_costs_no_more_than_the_send_timeout(tmp_path):
    """Forwarding to a socket nobody reads: the plugin returns within its bound."""
    import socket

    path = str(tmp_path / "pluginevent.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(0)  # accepts into the backlog, never reads
    try:
        p = plugin.Plugin({"CNI_COMMAND": "ADD"}, b"", open("/dev/null", "w"))
        p.socket = path
        for _ in range(plugin.LOG_LINES_MAX + 5):
            p._keep("info", "x" * 5000)
        assert len(p.forward) == plugin.LOG_LINES_MAX and p.dropped == 5
        assert all(len(json.loads(line)["msg"]) == plugin.LOG_LINE_MAX for line in p.forward)
        started = time.monotonic()
        p.send_logs()
        assert time.monotonic() - started < plugin.LOG_SEND_TIMEOUT + 0.5
    finally:
        listener.close()
    p._keep("info", "again")
    p.send_logs()  # nobody listens any more: ignored


async def test_log_endpoint_refuses_bad_bodies(cni_agent, caplog):
    caplog.set_level(logging.DEBUG, logger="cni")
    sock = cni_agent.server.socket_path
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(sock)) as s:
        for body, status in ((b"not json", 400), (b'{"a": 1}', 400),
                             (b"x" * (eventserver.LOG_BODY_MAX + 1), 413)):
            async with s.post("http://localhost/log", data=body) as r:
                assert r.status == status, body[:20]
        lines = [json.dumps({"level": "info", "time": "", "msg": f"m{i}"})
                 for i in range(eventserver.LOG_LINES_MAX + 3)]
        async with s.post("http://localhost/log",
                          data=json.dumps(["{bad", 7, *lines]).encode()) as r:
            assert r.status == 200
    msgs = [r.getMessage() for r in caplog.records if r.name == "cni.plugin"]
    assert len([m for m in msgs if m.startswith("m")]) == eventserver.LOG_LINES_MAX - 2
    assert any("more plugin log lines" in m for m in msgs)
    assert cni_agent.server.ready() == (True, "")
