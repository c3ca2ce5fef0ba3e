"""Every listener is bounded: the status and health ports close idle and half-sent
connections, hold at most their cap (more are answered 503 and closed, counted), and
answer malformed HTTP with one DEBUG line; the caps fit the open-files limit; the xDS
server's gRPC core enforces its own cap. Real sockets, real servers."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from prometheus_client import CollectorRegistry

from agent.core import fdbudget
from ambient.xds.server import XdsServer
from tests.status.conftest import make_config, running_status
from tests.xds.fake_index import FakeIndex

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


async def until_closed(reader: asyncio.StreamReader, timeout: float) -> bytes:
    return await asyncio.wait_for(reader.read(), timeout)


async def test_idle_and_half_sent_connections_are_closed(tmp_path):
    async with running_status(tmp_path, status_idle_timeout=0.5) as (_, server):
        loop = asyncio.get_running_loop()
        silent = await asyncio.open_connection("127.0.0.1", server.port)
        half = await asyncio.open_connection("127.0.0.1", server.health_port)
        half[1].write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # never finished
        started = loop.time()
        assert await until_closed(silent[0], 5) == b""
        assert await until_closed(half[0], 5) == b""
        assert loop.time() - started < 3
        for _, w in (silent, half):
            w.close()


async def test_connection_cap_closes_the_oldest_idle_one_and_counts_it(tmp_path):
    """At the cap a new connection takes the least recently active idle one's place
    (refusal when all are busy: tests/status/test_health_starvation.py)."""
    async with running_status(tmp_path, status_max_connections=5,
                              status_idle_timeout=60) as (ctx, server):
        held = []
        for _ in range(5):
            held.append(await asyncio.open_connection("127.0.0.1", server.port))
            await asyncio.sleep(0.01)  # distinct accept times: held[0] is the oldest
        deadline = asyncio.get_running_loop().time() + 5
        while server.sites["status"].open_connections < 5:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        extra_r, extra_w = await asyncio.open_connection("127.0.0.1", server.port)
        extra_w.write(b"GET /healthz/ready HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(extra_r.readline(), 5)).startswith(b"HTTP/1.1 200")
        # the oldest was closed by the agent; the others are still served
        assert await until_closed(held[0][0], 5) == b""
        r, w = held[1]
        w.write(b"GET /healthz/ready HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(r.readline(), 5)).startswith(b"HTTP/1.1 200")
        sample = ctx.registry.get_sample_value
        assert sample("ambient_agent_listener_connections_evicted_total", {"listener": "status"}) == 1
        assert sample("ambient_agent_listener_connections_refused_total", {"listener": "status"}) == 0
        assert sample("ambient_agent_listener_connections", {"listener": "status"}) == 5
        assert server.debug_state()["connections"]["status"] == {"open": 5, "cap": 5,
                                                                 "refused": 0, "evicted": 1}
        extra_w.close()
        for _, w in held:
            w.close()


async def test_malformed_http_on_the_status_port_is_one_debug_line(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    async with running_status(tmp_path) as (_, server):
        for garbage in (b"GET / HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",
                        b"GET /healthz/ready HTTP/1.1\r\nContent-Length: -4\r\n\r\n"):
            r, w = await asyncio.open_connection("127.0.0.1", server.port)
            w.write(garbage)
            assert (await until_closed(r, 5)).split(b" ")[1] == b"400"
            w.close()
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    lines = [r for r in caplog.records if "malformed or broken HTTP" in r.getMessage()]
    assert len(lines) == 2 and all(r.levelno == logging.DEBUG and not r.exc_info
                                   for r in lines)


async def test_malformed_request_answer_does_not_echo_the_request(tmp_path):
    """aiohttp answered a malformed request line with the line itself (a newuser saw a
    14 KB 400 body): the answer is one short line naming the reason."""
    junk = b"\x01garbage" + b"Z" * 6000
    async with running_status(tmp_path) as (_, server):
        for garbage in (b"GET /" + junk + b" HTTP/1.1\r\nHost: x\r\n\r\n",
                        b"GET / HTTP/1.1\r\nHost: x\r\nno colon " + junk + b"\r\n\r\n"):
            r, w = await asyncio.open_connection("127.0.0.1", server.port)
            w.write(garbage)
            answer = await until_closed(r, 5)
            w.close()
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.split(b" ")[1] == b"400", answer[:200]
            assert b"ZZZZ" not in body and len(body) < 300, body[:400]
            assert body.startswith(b"400 Bad Request: ") and body.count(b"\n") == 1, body


def test_caps_fit_the_open_files_limit(tmp_path):
    cfg = make_config(tmp_path, status_max_connections=5000, health_max_connections=64,
                      xds_max_connections=5000)
    caps = fdbudget.listener_caps(cfg, nofile=1024)
    assert sum(caps.values()) <= 1024 - fdbudget.headroom(1024) == 768
    assert caps["health_max_connections"] >= 1 and caps["status_max_connections"] > 300
    note = fdbudget.describe(cfg, 1024)
    assert "open-files limit 1024 keeps 256 fds" in note and \
        "status_max_connections lowered from 5000" in note
    default = make_config(tmp_path)
    assert fdbudget.listener_caps(default, nofile=65536) == {
        "status_max_connections": 256, "health_max_connections": 64,
        "xds_max_connections": 256}
    assert fdbudget.describe(default, 65536) == ""
    unlimited = fdbudget.listener_caps(make_config(tmp_path, status_max_connections=0),
                                       nofile=65536)  # 0: as many as the budget allows
    assert sum(unlimited.values()) <= 65536 - 16384 and \
        unlimited["status_max_connections"] > 48000


async def test_xds_server_caps_its_connections():
    server = XdsServer(FakeIndex(), address="127.0.0.1", port=0, registry=CollectorRegistry(),
                       max_connections=3)
    await server.start()
    conns = []
    try:
        for _ in range(6):
            conns.append(await asyncio.open_connection("127.0.0.1", server.port))
            await asyncio.sleep(0.05)
        heads = []
        for r, w in conns:
            w.write(PREFACE)
            try:
                heads.append(await asyncio.wait_for(r.read(9), 5))
            except (ConnectionError, asyncio.TimeoutError):
                heads.append(b"")
        served = [h for h in heads if len(h) == 9 and h[3] == 0x04]  # SETTINGS frames
        assert len(served) == 3 and heads[3:] == [b"", b"", b""]
        # a real client still gets through once a slot is free
        for _, w in conns:
            w.close()
        await asyncio.sleep(0.2)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            await asyncio.wait_for(ch.channel_ready(), 5)
    finally:
        await server.stop(0.2)


@pytest.mark.parametrize("value", ["-1", "many"])
def test_bad_cap_is_one_clear_config_error(tmp_path, value):
    from agent.core.config import ConfigError
    with pytest.raises(ConfigError, match="status_max_connections"):
        make_config(tmp_path, env={"AMBIENT_AGENT_STATUS_MAX_CONNECTIONS": value})
