"""The reference client's ztunnel behaviors (``docs/zds.md``), driven by a
hand-written fake agent on a real SEQPACKET socket: fatal protocol errors, read errors
answered with "failure to read message" then reconnect, idempotent Add, Del before
the snapshot, and netns replacement for a known uid."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from zds import wire
from agent.demo.fake_ztunnel import ProtocolError
from tests.zds.helpers import netns_fd, running_client, short_dir


class FakeAgent:
    """Accepts client connections; each accepted socket is driven by the test."""

    def __init__(self):
        self.path = os.path.join(short_dir(), "ztunnel.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(self.path)
        self.listener.listen(4)
        self.listener.settimeout(5)

    async def accept(self) -> socket.socket:
        conn, _ = await asyncio.to_thread(self.listener.accept)
        conn.settimeout(5)
        hello = await asyncio.to_thread(conn.recv, 1024)
        assert wire.decode_hello(hello).version == 1
        return conn

    @staticmethod
    async def request(conn: socket.socket, data: bytes, fds: list[int] | None = None) -> str:
        """Send one request, return the ack's error text."""
        if fds:
            await asyncio.to_thread(socket.send_fds, conn, [data], fds)
        else:
            await asyncio.to_thread(conn.send, data)
        return wire.decode_ack(await asyncio.to_thread(conn.recv, 1024)).error

    def close(self):
        self.listener.close()


@pytest.fixture
def agent():
    a = FakeAgent()
    yield a
    a.close()


@pytest.fixture
def nsfd():
    fd = netns_fd()
    yield fd
    os.close(fd)


ADD = wire.encode_add("u1", "n", "ns", "sa")


async def test_keep_after_snapshot_is_fatal(agent):
    async with running_client(agent.path) as client:
        conn = await agent.accept()
        assert await agent.request(conn, wire.encode_snapshot_sent()) == ""
        error = await agent.request(conn, wire.encode_keep("x"))
        assert "KeepWorkload x after SnapshotSent" in error
        await asyncio.sleep(0.05)
        assert isinstance(client.fatal, ProtocolError)
        with pytest.raises(ProtocolError):
            await client.wait_for_pod("never", timeout=1)
        conn.close()


async def test_second_snapshot_sent_and_add_without_info_are_fatal(agent, nsfd):
    async with running_client(agent.path) as client:
        conn = await agent.accept()
        await agent.request(conn, wire.encode_snapshot_sent())
        assert "second SnapshotSent" in await agent.request(conn, wire.encode_snapshot_sent())
        conn.close()
    async with running_client(agent.path) as client:
        conn = await agent.accept()
        from zds import zds_pb2
        bare = zds_pb2.WorkloadRequest(add=zds_pb2.AddWorkload(uid="u")).SerializeToString()
        assert "without workload_info" in await agent.request(conn, bare, [nsfd])
        await asyncio.sleep(0.05)
        assert client.fatal is not None and not client.pods
        conn.close()


async def test_read_errors_nack_then_reconnect(agent, nsfd):
    async with running_client(agent.path) as client:
        conn = await agent.accept()
        assert await agent.request(conn, ADD) == "failure to read message : No control message"
        conn.close()
        conn = await agent.accept()  # the client reconnected
        error = await agent.request(conn, wire.encode_keep("k"), [nsfd])
        assert error == "failure to read message : Unexpected control message"
        conn.close()
        conn = await agent.accept()
        assert (await agent.request(conn, b"\xff\xff")).startswith("failure to read message : ")
        conn.close()
        conn = await agent.accept()
        assert client.fatal is None and client.sessions == 4
        conn.close()


async def test_add_idempotent_replace_and_del_before_snapshot(agent, nsfd):
    async with running_client(agent.path) as client:
        conn = await agent.accept()
        assert await agent.request(conn, ADD, [nsfd]) == ""
        first = client.pods["u1"]
        assert await agent.request(conn, ADD, [nsfd]) == ""  # same netns: same proxy
        assert client.pods["u1"] is first
        other = os.open("/proc/1/ns/net" if os.path.exists("/proc/1/ns/net") else "/proc/self/ns/net",
                        os.O_RDONLY)
        try:
            replaced_identity = os.fstat(other)
            await agent.request(conn, ADD, [other])
        finally:
            os.close(other)
        if (replaced_identity.st_ino, replaced_identity.st_dev) != first.identity:
            assert client.pods["u1"] is not first  # new netns for a known uid replaces it
        assert await agent.request(conn, wire.encode_add("u2", "n", "ns", "sa"), [nsfd]) == ""
        assert await agent.request(conn, wire.encode_del("u2")) == ""  # before SnapshotSent
        assert "u2" in client.pods  # drained at reconcile, not now
        assert await agent.request(conn, wire.encode_snapshot_sent()) == ""
        assert set(client.pods) == {"u1"} and client.ready
        assert await agent.request(conn, wire.encode_del("u1")) == ""  # after: drained now
        assert not client.pods
        assert await agent.request(conn, wire.encode_del("unknown")) == ""
        conn.close()


async def test_stop_ends_the_session_thread_and_drains(agent, nsfd):
    """The session runs on its own blocking thread; stop() must end it (the socket is
    shut down under the blocking read) and close every held netns fd."""
    import threading

    async with running_client(agent.path) as client:
        conn = await agent.accept()
        try:
            assert await agent.request(conn, ADD, [nsfd]) == ""
            await client.wait_for_pod("u1", timeout=5)
            fd = client.pods["u1"].netns_fd
            assert any(t.name.startswith("zds-client-") for t in threading.enumerate())
        finally:
            client.stop()
    assert not [t for t in threading.enumerate() if t.name.startswith("zds-client-")]
    with pytest.raises(OSError):
        os.fstat(fd)
    conn.close()
