"""The health port (kubelet's liveness probe, ``GET /healthz`` on 8000) is never starved:
64 idle connections held by one pod, by many pods, or by another process on the prober's
own address, and a fresh liveness GET still gets 200 (the least recently active
connection makes room). The status port keeps refusing past its per-source cap. Real
status server, real sockets; the other peers are other loopback addresses."""

from __future__ import annotations

import asyncio
import socket

import pytest

from tests.status.conftest import running_status

TIMEOUT = 20.0  # generous: a starved probe shows as a 503 or a closed connection


async def _idle(source: str, port: int):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((source, 0))
    s.setblocking(False)
    await asyncio.get_running_loop().sock_connect(s, ("127.0.0.1", port))
    return s


async def _liveness(port: int) -> bytes:
    """kubelet's HTTP prober: a new connection, one GET, Connection: close."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nUser-Agent: kube-probe/1.33"
            b"\r\nConnection: close\r\n\r\n")
    answer = await asyncio.wait_for(r.read(), TIMEOUT)
    w.close()
    return answer.split(b"\r\n", 1)[0]


async def _settle(server, listener: str, n: int) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TIMEOUT
    site = server.sites[listener]
    while site.open_connections + site.refused + getattr(site, "evicted", 0) < n:
        assert loop.time() < deadline
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("sources", [["127.0.0.2"], [f"127.0.2.{i}" for i in range(1, 65)],
                                     ["127.0.0.1"]],
                         ids=["one-pod", "64-pods", "prober's-own-address"])
async def test_liveness_probe_passes_with_64_idle_connections_held(tmp_path, sources):
    async with running_status(tmp_path, status_idle_timeout=300) as (_, server):
        port = server.health_port
        held = []
        try:
            for i in range(64):
                held.append(await _idle(sources[i % len(sources)], port))
            await _settle(server, "health", 64)
            for _ in range(8):  # kubelet's failureThreshold is far lower; 8 of 8 failed
                assert await _liveness(port) == b"HTTP/1.1 200 OK"
            state = server.debug_state()["connections"]["health"]
            assert state["open"] <= state["cap"]
        finally:
            for s in held:
                s.close()


async def test_one_address_holds_at_most_its_quota_of_the_status_port(tmp_path):
    async with running_status(tmp_path, status_idle_timeout=300,
                              max_connections_per_source=4) as (ctx, server):
        held = [await _idle("127.0.0.2", server.port) for _ in range(4)]
        await _settle(server, "status", 4)
        extra = await _idle("127.0.0.2", server.port)
        loop = asyncio.get_running_loop()
        answer = await asyncio.wait_for(loop.sock_recv(extra, 200), TIMEOUT)
        assert answer.startswith(b"HTTP/1.1 503 ") and b"too many connections" in answer
        # another address is served
        r, w = await asyncio.open_connection("127.0.0.1", server.port)
        w.write(b"GET /healthz/ready HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(r.readline(), TIMEOUT)).startswith(b"HTTP/1.1 ")
        w.close()
        assert ctx.registry.get_sample_value("ambient_agent_listener_connections_refused_total",
                                             {"listener": "status"}) == 1
        for s in [*held, extra]:
            s.close()
