"""The ZDS server's snapshot over real SOCK_SEQPACKET sockets with real netns fds: the
snapshot thread's failures, deletes during it, a full socket buffer, stop during it; and
live adds of pods without a netns (``docs/zds.md``).

The peers are hand-driven sockets (``RawPeer``) and the fake ztunnel
(``agent.demo.fake_ztunnel``, written from ztunnel's ``src/inpod/``); the protocol logic
alone is unit-tested in ``test_session.py``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import threading

import pytest

from zds import PodInfo, ZdsError, wire
from zds.server import ZdsServer
from tests.zds.helpers import (RawPeer, eventually, netns_fd, netns_fd_count, running_client,
                               running_server, short_dir)


def pod(uid: str, fd: int | None) -> PodInfo:
    return PodInfo(uid, f"name-{uid}", "ns", "sa", fd)


@pytest.fixture
def nsfd():
    fd = netns_fd()
    yield fd
    os.close(fd)


async def test_client_disconnect_mid_snapshot(nsfd):
    async with running_server() as server:
        for i in range(5):
            await server.add(pod(f"p{i}", nsfd), wait_ack=False)
        peer = RawPeer(server.path)
        await peer.hello()
        kind, uid, fds = await peer.recv()
        assert kind == "add" and len(fds) == 1
        os.close(fds[0])
        peer.close()  # gone without acking
        await eventually(lambda: not server.connections)
        assert server.metrics.connected._value.get() == 0
        async with running_client(server.path) as client:
            await client.wait_snapshot(timeout=3)
            assert set(client.pods) == {f"p{i}" for i in range(5)}


async def test_snapshot_ack_timeout_drops_connection(nsfd):
    """A ztunnel that stops acking mid-snapshot is dropped after the ack timeout (the
    snapshot runs on its own thread with kernel socket timeouts); the loop stays free
    meanwhile and a reconnect gets the whole snapshot."""
    async with running_server(ack_timeout=0.3) as server:
        for i in range(3):
            await server.add(pod(f"p{i}", nsfd), wait_ack=False)
        peer = RawPeer(server.path)
        try:
            await peer.hello()
            assert (await peer.recv_and_ack())[0] == "add"
            kind, uid, fds = await peer.recv()  # the second Add is never acked
            for fd in fds:
                os.close(fd)
            t0 = asyncio.get_running_loop().time()
            while server.connections:  # the loop keeps running while the thread waits
                await asyncio.sleep(0.01)
            assert asyncio.get_running_loop().time() - t0 < 3
            assert await peer.closed_by_server()
        finally:
            peer.close()
        async with running_client(server.path) as client:
            await client.wait_snapshot(timeout=3)
            assert set(client.pods) == {"p0", "p1", "p2"}


async def test_stop_during_snapshot_ends_the_snapshot_thread(nsfd):
    """Stopping the server while a snapshot thread waits for an ack returns at once (the
    socket is shut down under the thread) and leaks no fd or thread."""
    before = netns_fd_count()
    threads = {t.name for t in threading.enumerate()}
    d = short_dir()
    server = ZdsServer(os.path.join(d, "ztunnel.sock"), accept_rate=1000.0)
    await server.start()
    peer = None
    try:
        for i in range(3):
            await server.add(pod(f"p{i}", nsfd), wait_ack=False)
        peer = RawPeer(server.path)
        await peer.hello()
        kind, uid, fds = await peer.recv()  # in flight, never acked
        for fd in fds:
            os.close(fd)
        t0 = asyncio.get_running_loop().time()
        await asyncio.wait_for(server.stop(), 3)
        assert asyncio.get_running_loop().time() - t0 < 1
    finally:
        await server.stop()
        if peer is not None:
            peer.close()
        shutil.rmtree(d, ignore_errors=True)
    await eventually(lambda: not any(t.name.startswith("zds-snapshot") and t.is_alive()
                                     and t.name not in threads for t in threading.enumerate()))
    assert netns_fd_count() == before


async def test_pod_deleted_during_snapshot_is_never_announced_after(nsfd):
    async with running_server() as server:
        for i in range(4):
            await server.add(pod(f"p{i}", nsfd), wait_ack=False)
        peer = RawPeer(server.path)
        try:
            await peer.hello()
            first = await peer.recv_and_ack()
            deleting = asyncio.create_task(server.delete("p3"))
            await asyncio.sleep(0.05)
            rest = await peer.read_snapshot()
            assert ("add", "p3") not in rest and first != ("add", "p3")
            assert await peer.recv_and_ack() == ("del", "p3")  # after SnapshotSent
            await asyncio.wait_for(deleting, 3)
        finally:
            peer.close()


async def test_snapshot_resumes_after_socket_buffer_fills(nsfd):
    """The snapshot thread sends until sendmsg would block; then it waits for room (not
    holding the fd lock) and resumes, in order, without losing or repeating a pod.

    The peer is a fake ztunnel (no real one runs here) that acks ahead of reading, so
    the server's sends pile up unread in its receive queue and fill the server's send
    buffer, as a slow ztunnel would."""
    pods = 600
    async with running_server() as server:
        for i in range(pods):
            await server.add(pod(f"p{i:04d}", nsfd), wait_ack=False)
        peer = RawPeer(server.path)
        try:
            await peer.hello()
            acks = asyncio.create_task(asyncio.to_thread(
                lambda: [peer.sock.send(wire.ACK_OK) for _ in range(pods + 1)]))
            got = []
            while True:
                received = await peer.recv()
                assert received is not None, "server closed the connection"
                kind, uid, fds = received
                for fd in fds:
                    os.close(fd)
                got.append((kind, uid))
                if kind == "snapshot_sent":
                    break
            await acks
            assert got == [("add", f"p{i:04d}") for i in range(pods)] + [("snapshot_sent", "")]
            await server.wait_connected(1, timeout=5)
            conn = server.connections[0]
            assert len(conn.held) == pods
        finally:
            peer.close()


async def test_live_add_without_netns_is_refused_and_never_sent_as_keep(nsfd):
    """ztunnel takes KeepWorkload only before SnapshotSent (a Keep after it is a fatal
    protocol error in its ``statemanager.rs``): a pod recorded without a netns is named
    in snapshots only, and a live add of it says why it was not sent."""
    async with running_server() as server:
        peer = RawPeer(server.path)
        try:
            await peer.hello()
            await peer.read_snapshot()
            with pytest.raises(ZdsError, match="has no netns"):
                await server.add(pod("k", None))
            await server.add(pod("k", None), wait_ack=False)  # recorded, nothing sent
            await server.add(pod("a", nsfd), wait_ack=False)
            assert await peer.recv_and_ack() == ("add", "a")  # the next thing sent
            assert server.pods() == ["k", "a"]
        finally:
            peer.close()
        async with running_client(server.path) as client:
            await client.wait_snapshot(timeout=3)
            assert client.snapshot_set == {"k", "a"}


async def test_the_snapshot_thread_alone_drives_the_session(nsfd, caplog):
    """Issue 28: the loop never touches a session its snapshot thread owns. A live add
    submitted while the thread waits for an ack waits in the connection (the session's
    own queue stays empty) and goes out after SnapshotSent; a stop while the thread waits
    is carried out by the thread ("server stopping"), and the add's caller is told."""
    caplog.set_level(logging.INFO, logger="zds")
    async with running_server(ztunnel_wait=3) as server:
        await server.add(pod("p0", nsfd), wait_ack=False)
        peer = RawPeer(server.path)
        try:
            await peer.hello()
            kind, uid, fds = await peer.recv()  # in flight: the thread waits for its ack
            for fd in fds:
                os.close(fd)
            assert (kind, uid) == ("add", "p0")
            [conn] = server.connections
            adding = asyncio.create_task(server.add(pod("live", nsfd)))
            await eventually(lambda: conn.debug_state()["queued"] == 1)
            assert conn.session.queued == 0  # held by the connection, not the session
            await peer.send(wire.ACK_OK)
            assert await peer.read_snapshot() == [("snapshot_sent", "")]
            assert await peer.recv_and_ack() == ("add", "live")  # handed over, then sent
            await asyncio.wait_for(adding, 3)
        finally:
            peer.close()

        await server.add(pod("p1", nsfd), wait_ack=False)
        peer = RawPeer(server.path)
        try:
            await peer.hello()
            await eventually(lambda: len(server.connections) == 1)
            got = await peer.recv()  # the thread waits for this ack
            assert got is not None
            for fd in got[2]:
                os.close(fd)
            [conn] = server.connections
            adding = asyncio.create_task(server.add(pod("late", nsfd), ztunnel_wait=0.5))
            await eventually(lambda: conn.debug_state()["queued"] == 1)
            conn.task.cancel()  # what stop does to each connection
            await asyncio.gather(conn.task, return_exceptions=True)
            with pytest.raises(ZdsError):
                await asyncio.wait_for(adding, 3)  # told, never left waiting
        finally:
            peer.close()
    assert not [r for r in caplog.records if "internal error" in r.getMessage()
                or r.exc_info]
    assert any("closed: server stopping" in r.getMessage() for r in caplog.records)
