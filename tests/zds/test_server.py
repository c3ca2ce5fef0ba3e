"""ZDS server against the reference client and hand-driven misbehaving peers, over real
SOCK_SEQPACKET sockets with real netns fds (``docs/zds.md``).

The peer is ztunnel's protocol as the fake ztunnel (agent.demo.fake_ztunnel) implements it from
ztunnel's ``src/inpod/`` source; no real ztunnel runs on this machine (see
``docs/maintainers/testing.md``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat

import pytest

from agent.core import config as agent_config
from agent.core.lifecycle import AgentContext
from zds import NoZtunnel, PodInfo, ZdsError, ZdsNack, ZdsTimeout, wire
from zds.server import ZdsServer, build
from tests.zds.helpers import (RawPeer, eventually, metric, netns_fd, netns_fd_count,
                               running_client, running_server, short_dir)


def pod(uid: str, fd: int | None) -> PodInfo:
    return PodInfo(uid, f"name-{uid}", "ns", "sa", fd)


@pytest.fixture
def nsfd():
    fd = netns_fd()
    yield fd
    os.close(fd)


async def test_socket_permissions_stale_file_and_unlink():
    d = short_dir()
    path = os.path.join(d, "sub", "ztunnel.sock")
    os.makedirs(os.path.dirname(path))
    open(path, "w").close()  # a stale file from a previous agent
    server = ZdsServer(path)
    await server.start()
    try:
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert server.ready() == (True, "")
    finally:
        await server.stop()
    assert not os.path.exists(path)
    assert server.ready()[0] is False


async def test_live_server_on_the_path_is_not_replaced():
    """A second agent must not unlink a serving agent's socket (it would cut the first
    agent off from ztunnel); a stale socket nobody accepts on is replaced."""
    async with running_server() as first:
        second = ZdsServer(first.path)
        with pytest.raises(agent_config.ConfigError, match="ztunnel_uds_address"):
            await second.start()
        assert stat.S_ISSOCK(os.stat(first.path).st_mode)
        async with running_client(first.path) as client:
            await client.wait_snapshot(timeout=3)  # the first server still answers
    d = short_dir()
    stale = os.path.join(d, "z.sock")
    import socket

    dead = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    dead.bind(stale)
    dead.close()  # the file stays, nobody listens: ECONNREFUSED
    server = ZdsServer(stale)
    await server.start()
    await server.stop()


async def test_full_session_with_reference_client(nsfd):
    async with running_server(ztunnel_wait=3) as server:
        await server.add(pod("a", nsfd), wait_ack=False)
        await server.add(pod("k", None), wait_ack=False)  # no netns: KeepWorkload
        async with running_client(server.path) as client:
            await client.wait_snapshot(timeout=3)
            assert set(client.pods) == {"a"}
            assert client.snapshot_set == {"a", "k"}
            assert client.ready
            kinds = [(k, u) for _, k, u in client.received]
            assert kinds[-1] == ("snapshot_sent", "")
            assert sorted(kinds[:-1]) == [("add", "a"), ("keep", "k")]
            assert client.pods["a"].identity[0] == os.fstat(nsfd).st_ino
            assert client.pods["a"].namespace == "ns"

            await server.add(pod("b", nsfd))  # live add: returns after the ack
            assert "b" in client.pods
            await server.delete("a")
            assert "a" not in client.pods and "a" not in server.pods()

            state = server.debug_state()
            (conn,) = state["connections"]
            assert conn["latest"] and conn["snapshot_sent"] and conn["version"] == 1
            assert conn["holds"] == {"b": "add", "k": "keep"}
        await eventually(lambda: not server.connections)


async def test_metrics(nsfd):
    async with running_server() as server:
        registry = server.metrics.registry
        await server.add(pod("a", nsfd), wait_ack=False)
        async with running_client(server.path) as client:
            await client.wait_snapshot(timeout=3)
            assert metric(registry, "ztunnel_connected") == 1
            await server.add(pod("b", nsfd))
            await server.delete("b")
            def sent(t):
                return metric(registry, "ambient_agent_zds_messages_total", {"type": t, "direction": "sent"})
            assert (sent("add"), sent("del"), sent("snapshot_sent")) == (2, 1, 1)
            assert metric(registry, "ambient_agent_zds_messages_total",
                          {"type": "hello", "direction": "received"}) == 1
            assert metric(registry, "ambient_agent_zds_acks_total", {"result": "ok"}) == 4
            assert metric(registry, "ambient_agent_zds_ack_latency_seconds_count") == 4
        await eventually(lambda: metric(registry, "ztunnel_connected") == 0)


async def test_no_ztunnel_within_wait(nsfd):
    async with running_server(ztunnel_wait=0.2) as server:
        with pytest.raises(NoZtunnel, match="no ztunnel connected"):
            await server.add(pod("a", nsfd))
        assert server.pods() == ["a"]  # still recorded: the next snapshot carries it
        assert issubclass(NoZtunnel, ZdsError)


async def test_add_waits_for_a_ztunnel_that_connects_later(nsfd):
    async with running_server(ztunnel_wait=5) as server:
        adding = asyncio.create_task(server.add(pod("a", nsfd)))
        await asyncio.sleep(0.1)
        assert not adding.done()
        async with running_client(server.path) as client:
            await asyncio.wait_for(adding, 3)
            assert "a" in client.pods


async def test_bad_pod_info_names_the_field():
    async with running_server() as server:
        with pytest.raises(ValueError, match="PodInfo.uid"):
            await server.add(PodInfo("", "n", "ns", "sa", None))
        with pytest.raises(ValueError, match="PodInfo.netns_fd"):
            await server.add(PodInfo("u", "n", "ns", "sa", -1))
        with pytest.raises(ValueError, match="not an open fd"):
            await server.add(PodInfo("u", "n", "ns", "sa", 999_999))
        with pytest.raises(ValueError, match="uid"):
            await server.delete("")


async def test_nack_from_ztunnel(nsfd):
    async with running_server() as server:
        peer = RawPeer(server.path)
        try:
            await peer.hello()
            assert await peer.read_snapshot() == [("snapshot_sent", "")]
            adding = asyncio.create_task(server.add(pod("a", nsfd)))
            assert await peer.recv_and_ack("failure to start proxy : port in use") == ("add", "a")
            with pytest.raises(ZdsNack, match="failure to start proxy") as info:
                await adding
            assert info.value.text == "failure to start proxy : port in use"
            assert server.connections  # a NACK keeps the connection
        finally:
            peer.close()


async def test_ack_timeout_drops_connection_and_next_snapshot_has_the_pod(nsfd):
    async with running_server(ack_timeout=0.3) as server:
        peer = RawPeer(server.path)
        try:
            await peer.hello()
            await peer.read_snapshot()
            adding = asyncio.create_task(server.add(pod("a", nsfd)))
            kind, uid, fds = await peer.recv()  # never acked
            for fd in fds:
                os.close(fd)
            with pytest.raises(ZdsTimeout, match="no ack within"):
                await adding
            assert await peer.closed_by_server()
        finally:
            peer.close()
        async with running_client(server.path) as client:
            await client.wait_for_pod("a", timeout=3)


async def test_hello_timeout_and_garbage_hello_keep_others_alive(nsfd):
    async with running_server(hello_timeout=0.3) as server:
        async with running_client(server.path) as good:
            await good.wait_snapshot(timeout=3)
            silent = RawPeer(server.path)
            garbage = RawPeer(server.path)
            oversized = RawPeer(server.path)
            try:
                await garbage.send(b"\xff\xff\xff\xff")
                await oversized.send(b"\x08" * 5000)
                assert await garbage.closed_by_server()
                assert await oversized.closed_by_server()
                assert await silent.closed_by_server()
            finally:
                for p in (silent, garbage, oversized):
                    p.close()
            await server.add(pod("a", nsfd))  # the good connection still works
            assert "a" in good.pods
            assert len(server.connections) == 1


async def test_unexpected_message_when_idle_drops_connection():
    async with running_server(keepalive_interval=30) as server:
        peer = RawPeer(server.path)
        try:
            await peer.hello()
            await peer.read_snapshot()
            await peer.send(wire.encode_ack())  # unsolicited
            assert await peer.closed_by_server()
            assert server.metrics.messages.labels("unexpected", "received")._value.get() == 1
        finally:
            peer.close()


async def test_fd_on_ack_and_garbage_ack_drop_connection(nsfd):
    async with running_server() as server:
        for bad in ("fd", "garbage"):
            peer = RawPeer(server.path)
            try:
                await peer.hello()
                kind, uid, _ = await peer.recv()
                assert kind == "snapshot_sent"
                if bad == "fd":
                    await peer.send(wire.encode_ack(), [nsfd])
                else:
                    await peer.send(b"\x0a\xff")
                assert await peer.closed_by_server()
            finally:
                peer.close()
        await eventually(lambda: not server.connections)


async def test_keepalive_probe_runs_while_idle():
    async with running_server(keepalive_interval=0.05) as server:
        async with running_client(server.path) as client:
            await client.wait_snapshot(timeout=3)
            await eventually(lambda: server.connections[0].last_keepalive is not None)
            assert len(server.connections) == 1


async def test_add_withdrawn_when_pod_deleted_before_send(nsfd):
    async with running_server() as server:
        peer = RawPeer(server.path)
        try:
            await peer.hello()
            await peer.read_snapshot()
            first = asyncio.create_task(server.add(pod("a", nsfd)))
            kind, uid, fds = await peer.recv()  # "a" in flight, not acked yet
            os.close(fds[0])
            second = asyncio.create_task(server.add(pod("b", nsfd)))
            await asyncio.sleep(0.05)
            deleting = asyncio.create_task(server.delete("b"))  # queued Add b is withdrawn
            await asyncio.sleep(0.05)
            await peer.send(wire.encode_ack())
            await first
            assert await peer.recv_and_ack() == ("del", "b")
            with pytest.raises(ZdsError, match="deleted or replaced before AddWorkload"):
                await second
            await deleting
        finally:
            peer.close()


async def test_no_fd_leak(nsfd):
    before = netns_fd_count()
    async with running_server() as server:
        for i in range(50):
            await server.add(pod(f"p{i}", nsfd), wait_ack=False)
        async with running_client(server.path) as client:
            await client.wait_snapshot(timeout=5)
            assert len(client.pods) == 50
            for i in range(25):
                await server.delete(f"p{i}")
            await server.add(pod("p30", nsfd))  # re-add: old dup closed
            assert netns_fd_count() > before  # the dups and received fds were counted
    assert netns_fd_count() == before


async def test_two_ztunnels_adds_to_newest_deletes_to_all(nsfd):
    async with running_server() as server:
        await server.add(pod("s", nsfd), wait_ack=False)
        registry = server.metrics.registry
        async with running_client(server.path) as old:
            await old.wait_snapshot(timeout=3)
            async with running_client(server.path) as new:
                await new.wait_snapshot(timeout=3)
                assert "s" in old.pods and "s" in new.pods  # each gets the full snapshot
                assert metric(registry, "ztunnel_connected") == 2
                await server.add(pod("n1", nsfd))
                assert "n1" in new.pods and "n1" not in old.pods
                await server.delete("s")
                assert "s" not in new.pods and "s" not in old.pods
                assert [c["latest"] for c in server.debug_state()["connections"]] == [False, True]
            await eventually(lambda: len(server.connections) == 1)
            assert metric(registry, "ztunnel_connected") == 1
            await server.add(pod("n2", nsfd))  # newest gone: the previous takes over
            assert "n2" in old.pods
        await eventually(lambda: metric(registry, "ztunnel_connected") == 0)


async def test_reconnecting_ztunnel_gets_fresh_snapshot_and_agent_restart(nsfd):
    d = short_dir()
    path = os.path.join(d, "ztunnel.sock")
    first = ZdsServer(path, accept_rate=1000)
    await first.start()
    await first.add(pod("a", nsfd), wait_ack=False)
    await first.add(pod("gone", nsfd), wait_ack=False)
    async with running_client(path) as client:
        await client.wait_snapshot(timeout=3)
        assert set(client.pods) == {"a", "gone"}
        await first.stop()  # agent restart: ztunnel keeps its proxies and reconnects
        assert set(client.pods) == {"a", "gone"}
        second = ZdsServer(path, accept_rate=1000)
        await second.start()
        try:
            await second.add(pod("a", nsfd), wait_ack=False)  # restart path: pods still known
            await second.add(pod("k", None), wait_ack=False)
            await client.wait_snapshot(timeout=5, count=2)
            # a new session got the second snapshot; under load a reconnect can also land
            # in the stopping server's backlog first and be reset (one more session, no
            # snapshot), as a real ztunnel's would
            assert client.sessions >= 2
            assert set(client.pods) == {"a"}  # reconcile drained the pod not in the snapshot
            assert client.snapshot_set == {"a", "k"}
        finally:
            await second.stop()


async def test_wait_ack_false_with_ztunnel_connected_still_sends(nsfd):
    async with running_server() as server:
        async with running_client(server.path) as client:
            await client.wait_snapshot(timeout=3)
            await server.add(pod("bg", nsfd), wait_ack=False)
            await client.wait_for_pod("bg", timeout=3)


async def test_component_build_from_config():
    d = short_dir()
    config = agent_config.load({}, env={}).replace(
        ztunnel_uds_address=os.path.join(d, "zt", "ztunnel.sock"), ztunnel_wait=0.5)
    ctx = AgentContext(config)
    server = build(ctx)
    assert server.name == "zds" and server.ztunnel_wait == 0.5
    await server.start()
    try:
        async with running_client(config.ztunnel_uds_address) as client:
            # the daemon's server holds accepts until enrollment recovered its pods
            assert not server.accepting and not server.ready()[0]
            await asyncio.sleep(0.2)
            assert server.connections == [] and client.snapshots == 0
            server.open_accept()
            await client.wait_snapshot(timeout=3)
            assert server.ready() == (True, "")
            assert ctx.registry.get_sample_value("ztunnel_connected") == 1
    finally:
        await server.stop()
        ctx.executor.shutdown()


@pytest.mark.timeout(20)
async def test_burst_beyond_the_queue_waits_for_room(nsfd):
    """A burst of concurrent adds (and deletes) beyond upstream's 100-slot queue all land,
    in order. (A bounded queue that filled up used to make add() retry the same
    connection without ever yielding: the event loop hung.)"""
    burst = 300  # more than upstream's 100-slot queue
    async with running_server() as server:
        async with running_client(server.path) as client:
            await client.wait_snapshot(timeout=3)
            await asyncio.gather(*(server.add(pod(f"b{i}", nsfd)) for i in range(burst)))
            assert len(client.pods) == burst
            await asyncio.gather(*(server.add(pod(f"w{i}", nsfd), wait_ack=False)
                                   for i in range(burst)))
            await client.wait_for_pod(f"w{burst - 1}", timeout=5)
            assert len(client.pods) == 2 * burst
            await asyncio.gather(*(server.delete(f"b{i}") for i in range(burst)))
            assert len(client.pods) == burst


def _close_lines(caplog, level=None):
    return [r for r in caplog.records if r.name == "zds.connection" and "closed:" in r.getMessage()
            and (level is None or r.levelno == level)]


async def test_pre_hello_closes_are_info_and_garbage_warnings_rate_limited(caplog):
    """Peers that connect and close before ZdsHello (probes, another agent's liveness
    check, port scans) log at INFO; identical pre-hello warnings (garbage hello) are
    logged once per window, the next one says how many were held back; a protocol error
    after the hello stays a WARNING every time."""
    caplog.set_level(logging.DEBUG, logger="zds.connection")
    async with running_server() as server:
        for _ in range(20):
            RawPeer(server.path).close()
        await eventually(lambda: len(_close_lines(caplog)) == 20)
        assert _close_lines(caplog, logging.WARNING) == []
        assert all("before ZdsHello" in r.getMessage() for r in _close_lines(caplog))

        caplog.clear()
        server._pre_hello_limiter.window = 0.5
        for _ in range(5):
            peer = RawPeer(server.path)
            await peer.send(b"\xff\xff\xff\xff")
            assert await peer.closed_by_server()
            peer.close()
        await eventually(lambda: len(_close_lines(caplog)) == 5)
        warnings = _close_lines(caplog, logging.WARNING)
        assert len(warnings) == 1 and "ZdsHello" in warnings[0].getMessage()
        assert len(_close_lines(caplog, logging.DEBUG)) == 4
        await asyncio.sleep(0.6)
        peer = RawPeer(server.path)
        await peer.send(b"\xff\xff\xff\xff")
        assert await peer.closed_by_server()
        peer.close()
        await eventually(lambda: len(_close_lines(caplog, logging.WARNING)) == 2)
        assert "(4 more like this in the last 0.5s)" in \
            _close_lines(caplog, logging.WARNING)[1].getMessage()

        caplog.clear()
        for _ in range(2):  # after hello: a real protocol error, a warning each time
            peer = RawPeer(server.path)
            await peer.hello()
            await peer.read_snapshot()
            await peer.send(wire.encode_ack())  # unsolicited
            assert await peer.closed_by_server()
            peer.close()
        await eventually(lambda: len(_close_lines(caplog)) == 2)
        assert len(_close_lines(caplog, logging.WARNING)) == 2
        assert all(r.getMessage().startswith("ztunnel connection")
                   for r in _close_lines(caplog))


async def test_ztunnel_leaving_cleanly_is_info(caplog):
    """A ztunnel that closes its connection after the snapshot (it stopped or restarts)
    is an INFO line, as upstream's "ztunnel disconnected" (ztunnelserver.go): the demo's
    and every clean ztunnel restart's log has no WARNING for it."""
    caplog.set_level(logging.DEBUG, logger="zds")
    async with running_server() as server:
        peer = RawPeer(server.path)
        await peer.hello()
        await peer.read_snapshot()
        peer.close()
        await eventually(lambda: len(_close_lines(caplog)) == 1)
        line = _close_lines(caplog)[0]
        assert line.getMessage().endswith("closed: ztunnel closed the connection")
        assert line.levelno == logging.INFO
