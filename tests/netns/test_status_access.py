"""Loopback-only metrics and the admin endpoints (admin socket only) refuse a real
non-loopback peer: a netns pod on a real bridge
connects to the status server listening on the bridge gateway address (acceptance case 29)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from tests.status.conftest import running_status


@pytest.fixture
def pod(bridge):
    """A pod on the bridge, created outside the event loop (pyroute2's sync API runs its
    own loop); removed with the bridge."""
    return bridge.add_pod()


def http_from_pod(pod, host: str, port: int, method: str, path: str) -> tuple[int, bytes]:
    """One HTTP/1.0 request sent from inside ``pod``; returns (status, body). Blocking."""
    sock: socket.socket = pod.connect(host, port)
    try:
        sock.sendall(f"{method} {path} HTTP/1.0\r\nHost: {host}:{port}\r\n"
                     f"Content-Length: 0\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    finally:
        sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def test_quit_drain_debug_refused_from_pod(tmp_path, bridge, pod):
    async with running_status(tmp_path, status_address=bridge.gateway,
                              metrics_localhost_only=True) as (ctx, server):
        async def call(method: str, path: str) -> tuple[int, bytes]:
            return await asyncio.to_thread(http_from_pod, pod, bridge.gateway, server.port,
                                           method, path)

        assert (await call("GET", "/healthz/ready"))[0] == 200  # probes are open to all
        status, body = await call("GET", "/stats/prometheus")
        assert status == 403 and b"Only requests from localhost are allowed" in body
        for method, path in [("POST", "/quitquitquit"), ("GET", "/quitquitquit"),
                             ("POST", "/drain"), ("GET", "/debug"), ("GET", "/debug/config"),
                             ("GET", "/debug/all")]:
            status, body = await call(method, path)
            assert status == 403, (method, path, status, body)
            assert b"served only on the agent's admin socket" in body
        await asyncio.sleep(0.05)
        assert not ctx.shutdown.is_set() and not ctx.draining
