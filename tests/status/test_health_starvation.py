"""kubelet's probes are never starved by idle connections.

The health port (liveness, ``GET /healthz`` on 8000): 64 idle connections held by one
pod, by many pods, or by another process on the prober's own address, and a fresh
liveness GET still gets 200 (the least recently active connection makes room). The
status port (readiness ``/healthz/ready`` and the rewritten app probes on 15020): its
global cap filled by idle connections from many addresses, each within the per-source
cap (a tester's 450 loopback connections answered every probe 503), and its per-source
cap filled from the prober's own address: a fresh probe gets the real answer, the
oldest idle connection is closed instead; a connection whose request is being served is
never the one closed, and when all of them are, the newcomer is refused. Real status
server, real sockets; the other peers are other loopback addresses."""

from __future__ import annotations

import asyncio
import socket

import pytest

from aiohttp import web

from tests.status.conftest import running_status, serve_app

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


async def _readiness(port: int, source: str = "127.0.0.1") -> bytes:
    """kubelet's readiness probe of the status port, from ``source``: a new connection,
    one GET of /healthz/ready, Connection: close. The status line."""
    loop = asyncio.get_running_loop()
    s = await _idle(source, port)
    try:
        await loop.sock_sendall(s, b"GET /healthz/ready HTTP/1.1\r\nHost: 127.0.0.1:15020\r\n"
                                   b"User-Agent: kube-probe/1.33\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := await asyncio.wait_for(loop.sock_recv(s, 4096), TIMEOUT):
            answer += chunk
    finally:
        s.close()
    return answer


def _counter(ctx, name: str, listener: str) -> float:
    return ctx.registry.get_sample_value(f"ambient_agent_listener_connections_{name}_total",
                                         {"listener": listener}) or 0.0


async def _closed_by_server(s: socket.socket) -> bool:
    """The agent closed ``s`` (EOF or reset), within :data:`TIMEOUT`."""
    loop = asyncio.get_running_loop()
    try:
        return await asyncio.wait_for(loop.sock_recv(s, 200), TIMEOUT) == b""
    except ConnectionError:
        return True


async def test_one_address_holds_at_most_its_quota_of_the_status_port(tmp_path):
    """Past the per-source cap the address's oldest idle connection makes room: the
    address never holds more than its quota, and a probe from it still gets in."""
    async with running_status(tmp_path, status_idle_timeout=300,
                              max_connections_per_source=4) as (ctx, server):
        held = [await _idle("127.0.0.2", server.port) for _ in range(4)]
        await _settle(server, "status", 4)
        try:
            answer = await _readiness(server.port, "127.0.0.2")
            assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
            assert await _closed_by_server(held[0]), "the oldest idle connection stays open"
            assert server.sites["status"].open_connections <= 4
            assert _counter(ctx, "evicted", "status") == 1
            assert _counter(ctx, "refused", "status") == 0
        finally:
            for s in held:
                s.close()


async def test_readiness_probe_gets_in_past_the_status_ports_global_cap(tmp_path):
    """The tester's case, scaled to a cap of 64: idle connections from 20 addresses,
    each within its per-source cap of 16, more than fill the port; 20 fresh readiness
    probes (from the prober's address and from a flooding one) all get the real answer."""
    async with running_status(tmp_path, status_idle_timeout=300, status_max_connections=64,
                              max_connections_per_source=16) as (ctx, server):
        sources = [f"127.0.3.{i}" for i in range(1, 21)]
        held = []
        try:
            for i in range(20 * 15):
                held.append(await _idle(sources[i % len(sources)], server.port))
            await _settle(server, "status", 64)
            for i in range(20):
                answer = await _readiness(server.port, "127.0.0.1" if i % 2 else sources[0])
                assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
            site = server.sites["status"]
            assert site.open_connections <= 64
            assert _counter(ctx, "refused", "status") == 0
            assert _counter(ctx, "evicted", "status") >= 20 * 15 - 64
        finally:
            for s in held:
                s.close()


async def test_a_connection_being_served_is_never_evicted(tmp_path):
    """At the cap, a connection whose request is in progress (a metrics scrape waiting
    for Envoy's admin, held by the test) is not closed for a newcomer: when every open
    connection is busy the newcomer gets the 503 refusal, and the busy one its answer
    once Envoy's part arrives. Fails if aiohttp drops the in-progress flag."""
    gate = asyncio.Event()
    entered = asyncio.Event()

    async def envoy_stats(request):
        entered.set()
        await gate.wait()
        return web.Response(text="envoy_server_live 1\n")

    app = web.Application()
    app.router.add_get("/stats/prometheus", envoy_stats)
    async with serve_app(app) as envoy_port:
        async with running_status(tmp_path, status_idle_timeout=300, status_max_connections=1,
                                  max_connections_per_source=0,
                                  envoy_admin_port=envoy_port) as (ctx, server):
            loop = asyncio.get_running_loop()
            busy = await _idle("127.0.0.2", server.port)
            try:
                await loop.sock_sendall(busy, b"GET /stats/prometheus HTTP/1.1\r\nHost: x\r\n"
                                              b"Connection: close\r\n\r\n")
                await asyncio.wait_for(entered.wait(), TIMEOUT)
                # the newcomer sends nothing: a refused connection's unread request would
                # turn the close into a reset that can overtake the 503
                extra = await _idle("127.0.0.3", server.port)
                try:
                    answer = await asyncio.wait_for(loop.sock_recv(extra, 200), TIMEOUT)
                finally:
                    extra.close()
                assert answer.startswith(b"HTTP/1.1 503 ") and b"too many connections" in answer
                assert _counter(ctx, "evicted", "status") == 0
                assert _counter(ctx, "refused", "status") == 1
                gate.set()
                got = b""
                while chunk := await asyncio.wait_for(loop.sock_recv(busy, 65536), TIMEOUT):
                    got += chunk
                assert got.startswith(b"HTTP/1.1 200 ") and b"envoy_server_live" in got, got[:300]
            finally:
                gate.set()
                busy.close()
