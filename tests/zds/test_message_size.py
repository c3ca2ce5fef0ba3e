"""A pod whose ZDS request would not fit ztunnel's 1,024-byte receive buffer (issue 28:
a podman-style ADD with a 200-character container ID as uid and a 900-character name).

ztunnel (``src/inpod/protocol.rs``, ``read_message``) reads each packet into
``vec![0u8; 1024]``; a longer one comes back ``MSG_TRUNC``, is NACKed "failure to read
message : received truncated message" and the connection is dropped
(``workloadmanager.rs``: ``ReceiveMessageError``), then re-established with a snapshot
that carries the same pod again: every pod on the node is hit, forever. The fake
ztunnel (``agent.demo.fake_ztunnel``) and the ztunnel-exact client
(``tests/ztunnel_exact/zds.py``) read with the same 1,024-byte buffer; here the agent
refuses that one pod, and the connection never notices.
"""

from __future__ import annotations

import os

import pytest

from zds import PodInfo, wire
from zds.api import MessageTooLarge
from tests.zds.helpers import netns_fd, running_server
from tests.zds.test_server import running_client
from tests.ztunnel_exact.zds import ZtunnelZds

BIG_UID = "c" * 200  # a podman container ID standing in for the pod uid
BIG_NAME = "p" * 900


@pytest.fixture
def nsfd():
    fd = netns_fd()
    yield fd
    os.close(fd)


def good(uid: str, fd: int | None) -> PodInfo:
    return PodInfo(uid, f"{uid}-name", "ns", "sa", fd)


def test_the_limit_is_ztunnels_and_exact():
    # the largest name that fits: 1024 bytes exactly is taken, one more is refused
    n = max(n for n in range(900, 1024)
            if len(wire.encode_add("u", "n" * n, "ns", "sa")) <= wire.MAX_MESSAGE)
    fits = "n" * n
    fd = netns_fd()
    try:
        from zds.pods import PodRecord
        PodRecord(PodInfo("u", fits, "ns", "sa", fd)).close()
        with pytest.raises(MessageTooLarge, match="over ztunnel's 1024-byte receive buffer"):
            PodRecord(PodInfo("u", fits + "n", "ns", "sa", fd))
    finally:
        os.close(fd)


async def test_oversized_pod_fails_alone_with_the_fake_ztunnel(nsfd):
    async with running_server(ztunnel_wait=3) as server:
        await server.add(good("a", nsfd), wait_ack=False)
        async with running_client(server.path) as client:
            await client.wait_snapshot(timeout=5)
            before = client.sessions
            with pytest.raises(MessageTooLarge) as e:
                await server.add(PodInfo(BIG_UID, BIG_NAME, "", "default", nsfd))
            text = str(e.value)
            assert "name 900" in text and "uid 200 characters" in text and len(text) < 400
            assert BIG_UID not in server.pods()  # neither recorded nor sent
            await server.add(good("b", nsfd))  # the others never notice
            assert set(client.pods) == {"a", "b"}
            assert client.sessions == before and not client.fatal
            [conn] = server.connections
            assert conn.snapshot_sent


async def test_oversized_pod_fails_alone_with_the_ztunnel_exact_client(nsfd):
    async with running_server(ztunnel_wait=3) as server:
        await server.add(good("a", nsfd), wait_ack=False)
        peer = ZtunnelZds(server.path).start()
        try:
            assert await _wait(lambda: peer.ready())
            with pytest.raises(MessageTooLarge):
                await server.add(PodInfo(BIG_UID, BIG_NAME, "", "default", nsfd))
            await server.add(good("b", nsfd))
            assert await _wait(lambda: set(peer.proxies) == {"a", "b"})
            assert peer.connections == 1 and peer.nacks == [] and peer.fatal is None
            assert "failure to read message" not in " ".join(peer.nacks)
        finally:
            peer.stop()


async def _wait(predicate, timeout: float = 10.0) -> bool:
    import asyncio
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        if loop.time() > end:
            return False
        await asyncio.sleep(0.01)
    return True
