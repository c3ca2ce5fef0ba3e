"""``ZdsServer.add(..., ztunnel_wait=)``: a caller with a deadline (a CNI ADD whose plugin
gives up after its ``agent_timeout``) waits less than the ``ztunnel_wait`` setting, never
more, and the error says which socket nobody connected to and for how long."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from tests.zds.helpers import netns_fd, running_client, running_server
from zds import NoZtunnel, PodInfo


@pytest.fixture
def nsfd():
    fd = netns_fd()
    yield fd
    os.close(fd)


async def test_add_waits_at_most_what_the_caller_asks(nsfd):
    async with running_server(ztunnel_wait=30) as server:
        started = time.monotonic()
        with pytest.raises(NoZtunnel) as err:
            await server.add(PodInfo("a", "n", "ns", "sa", nsfd), ztunnel_wait=0.3)
        took = time.monotonic() - started
        assert 0.25 < took < 2.0, took
        assert err.value.socket == server.path and err.value.waited == pytest.approx(0.3)
        assert str(err.value) == f"no ztunnel connected to {server.path} for 0.3 s"
        assert server.pods() == ["a"]  # recorded: the next snapshot carries it


async def test_add_wait_is_capped_by_the_setting(nsfd):
    async with running_server(ztunnel_wait=0.2) as server:
        started = time.monotonic()
        with pytest.raises(NoZtunnel, match="for 0.2 s") as err:
            await server.add(PodInfo("a", "n", "ns", "sa", nsfd), ztunnel_wait=60)
        assert time.monotonic() - started < 2.0
        assert err.value.waited == pytest.approx(0.2)


async def test_add_with_a_short_wait_still_goes_to_a_connected_ztunnel(nsfd):
    async with running_server(ztunnel_wait=30) as server:
        async with running_client(server.path) as client:
            await client.wait_snapshot(timeout=3)
            await asyncio.wait_for(
                server.add(PodInfo("b", "n", "ns", "sa", nsfd), ztunnel_wait=0.0), 3)
