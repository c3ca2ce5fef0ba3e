"""Shared helpers for the ZDS tests: short socket paths, a server fixture, raw peers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import tempfile

from prometheus_client import CollectorRegistry

from zds import wire
from agent.demo.fake_ztunnel import FakeZtunnel
from zds.server import ZdsServer
from tests.helpers import eventually, netns_fd_count  # noqa: F401 - re-exported


_CREATED: list[str] = []


def short_dir() -> str:
    """A private dir with a short path (AF_UNIX paths are limited to 108 bytes). Removed
    after the test that made it, pass or fail (``tests/zds/conftest.py``)."""
    path = tempfile.mkdtemp(prefix="zds-")
    _CREATED.append(path)
    return path


def remove_short_dirs() -> None:
    """Remove every dir :func:`short_dir` made so far."""
    while _CREATED:
        shutil.rmtree(_CREATED.pop(), ignore_errors=True)


def netns_fd() -> int:
    """An fd of this process's own netns (a real netns fd, as a pod's would be)."""
    return os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)


def metric(registry: CollectorRegistry, name: str, labels: dict | None = None) -> float:
    return registry.get_sample_value(name, labels or {}) or 0.0


@contextlib.asynccontextmanager
async def running_server(**kwargs):
    """A started ZdsServer on a fresh short path; stopped and its dir removed after."""
    d = short_dir()
    registry = CollectorRegistry()
    kwargs.setdefault("accept_rate", 1000.0)
    server = ZdsServer(os.path.join(d, "ztunnel.sock"), registry, **kwargs)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
        shutil.rmtree(d, ignore_errors=True)


@contextlib.asynccontextmanager
async def running_client(path: str, **kwargs):
    """A FakeZtunnel running in a task; stopped (proxies drained) after."""
    client = FakeZtunnel(path, **kwargs)
    task = asyncio.create_task(client.run())
    try:
        yield client
    finally:
        client.stop()
        await asyncio.wait_for(task, 5)


class RawPeer:
    """A hand-driven ZDS client socket for misbehaving-ztunnel tests (blocking I/O in
    threads). Everything it receives is returned as (kind, uid, fds)."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(5)
        self.sock.connect(path)

    async def send(self, data: bytes, fds: list[int] | None = None) -> None:
        if fds:
            await asyncio.to_thread(socket.send_fds, self.sock, [data], fds)
        else:
            await asyncio.to_thread(self.sock.send, data)

    async def hello(self) -> None:
        await self.send(wire.encode_hello())

    async def recv(self) -> tuple[str, str, list[int]] | None:
        def read():
            p = wire.recv_packet(self.sock)
            if p is None:
                return None
            req = wire.decode_request(p.data)
            kind = req.WhichOneof("payload")
            uid = getattr(req, kind).uid if kind != "snapshot_sent" else ""
            return kind, uid, p.fds
        return await asyncio.to_thread(read)

    async def recv_and_ack(self, error: str = "") -> tuple[str, str]:
        got = await self.recv()
        assert got is not None, "server closed the connection"
        kind, uid, fds = got
        for fd in fds:
            os.close(fd)
        await self.send(wire.encode_ack(error))
        return kind, uid

    async def read_snapshot(self) -> list[tuple[str, str]]:
        out = []
        while True:
            kind, uid = await self.recv_and_ack()
            out.append((kind, uid))
            if kind == "snapshot_sent":
                return out

    async def closed_by_server(self, timeout: float = 3.0) -> bool:
        def read():
            self.sock.settimeout(timeout)
            try:
                while True:
                    data = self.sock.recv(2048)
                    if not data:
                        return True
            except (ConnectionResetError, BrokenPipeError):
                return True
            except socket.timeout:
                return False
        return await asyncio.to_thread(read)

    def close(self) -> None:
        self.sock.close()
