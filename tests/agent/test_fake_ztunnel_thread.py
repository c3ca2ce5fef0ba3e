"""agent.demo.fake_ztunnel_thread: the fake ztunnel on a thread of its own, against the
real ZDS server (zds.server.ZdsServer) on this test's loop. No root needed: the netns fds
are this process's own (/proc/self/ns/net). What the fake records (adds, keeps, deletes,
the snapshot's uids), its NACK switch and its per-request hook, and that closing it
leaves no thread and no fd behind."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from agent.demo.fake_ztunnel_thread import FakeZtunnelThread
from tests.helpers import netns_fd_count
from tests.zds.helpers import netns_fd, running_server
from zds import PodInfo, ZdsNack


async def test_records_snapshot_adds_and_deletes_then_closes_cleanly():
    fd = netns_fd()
    fds_before = netns_fd_count()
    try:
        async with running_server() as server:
            await server.add(PodInfo("a", "pa", "ns", "sa", fd), wait_ack=False)
            await server.add(PodInfo("k", "pk", "ns", "sa", None), wait_ack=False)
            seen: list[tuple[str, str]] = []
            zt = await asyncio.to_thread(
                FakeZtunnelThread(server.path,
                                  on_request=lambda kind, body: seen.append(
                                      (kind, getattr(body, "uid", "")))).start)
            try:
                assert await asyncio.to_thread(zt.wait, lambda: zt.snapshot_uids is not None)
                assert zt.snapshot_uids == {"a", "k"}
                assert zt.adds == {"a": os.fstat(fd).st_ino, "k": None}
                await server.add(PodInfo("b", "pb", "ns", "sa", fd))  # acked once held
                assert "b" in zt.fake.pods and zt.adds["b"] == os.fstat(fd).st_ino
                await server.delete("b")
                assert await asyncio.to_thread(zt.wait, lambda: zt.deleted == ["b"])
                assert ("snapshot_sent", "") in seen and ("del", "b") in seen
            finally:
                await asyncio.to_thread(zt.close)
            assert not [t for t in threading.enumerate() if t.name == "fake-ztunnel"]
    finally:
        os.close(fd)
    assert netns_fd_count() == fds_before - 1  # the fake's held fds are all closed


async def test_nack_refuses_every_add_until_cleared():
    fd = netns_fd()
    try:
        async with running_server() as server:
            zt = await asyncio.to_thread(FakeZtunnelThread(server.path, nack="no room").start)
            try:
                await asyncio.to_thread(zt.wait, lambda: zt.fake.snapshot_received)
                with pytest.raises(ZdsNack, match="no room"):
                    await server.add(PodInfo("a", "pa", "ns", "sa", fd))
                assert "a" not in zt.adds and "a" not in zt.fake.pods
                zt.nack = ""
                await server.add(PodInfo("a", "pa", "ns", "sa", fd))
                assert "a" in zt.fake.pods
            finally:
                await asyncio.to_thread(zt.close)
    finally:
        os.close(fd)


def test_start_times_out_naming_the_socket(tmp_path):
    path = str(tmp_path / "nothing.sock")
    with pytest.raises(TimeoutError, match="nothing.sock"):
        FakeZtunnelThread(path).start(timeout=0.3)
    assert not [t for t in threading.enumerate() if t.name == "fake-ztunnel"]
