"""ZDS benchmarks: a 1,000-pod snapshot with netns fds, and live-add latency.

Floor (measured in the same run): a bare Python loop that ``send_fds`` a netns fd over
a SEQPACKET socketpair and reads a one-byte ack from a peer thread that receives the fd,
closes it and answers. That is the least any ZDS round trip can cost in Python.
Measured: our ZdsServer against our reference ZdsClient (ztunnel side) running in its
own thread and event loop, as ztunnel runs in its own process.
Targets (issue 3): snapshot <= 1.5x the floor; live-add p99 <= 2 ms (ratio reported).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import threading
import time

from benchmarks.common import Result, percentile, ratio_result
from zds import PodInfo, wire
from zds.client import ZdsClient
from zds.server import ZdsServer

PODS = 1000
LIVE_ADDS = 1000


def _floor_round_trips(n: int, fd: int) -> list[float]:
    """Per-round-trip seconds of the bare send_fds + one-byte-ack loop."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    payload = wire.encode_add("0123456789abcdef0123456789abcdef", "name", "namespace", "sa")

    def peer():
        for _ in range(n):
            _, fds, _, _ = socket.recv_fds(b, 1024, 1)
            for f in fds:
                os.close(f)
            b.send(b"\x00")

    t = threading.Thread(target=peer)
    t.start()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        socket.send_fds(a, [payload], [fd])
        a.recv(1)
        samples.append(time.perf_counter() - t0)
    t.join()
    a.close()
    b.close()
    return samples


class _ClientThread:
    """A ZdsClient on its own thread and event loop."""

    def __init__(self, path: str):
        self.loop = asyncio.new_event_loop()
        self.client: ZdsClient | None = None
        self.path = path
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.task = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result()

    async def _start(self):
        self.client = ZdsClient(self.path)
        return asyncio.get_running_loop().create_task(self.client.run())

    def wait_snapshot(self, timeout: float) -> None:
        asyncio.run_coroutine_threadsafe(self.client.wait_snapshot(timeout), self.loop).result()

    def close(self) -> None:
        async def stop():
            self.client.stop()
            await self.task
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


async def _measure(fd: int) -> tuple[float, list[float]]:
    d = tempfile.mkdtemp(prefix="zds-bench-")
    server = ZdsServer(os.path.join(d, "ztunnel.sock"), accept_rate=1000)
    await server.start()
    try:
        for i in range(PODS):
            await server.add(PodInfo(f"pod-{i:06d}-0123456789abcdef", f"name-{i}", "namespace",
                                     "sa", fd), wait_ack=False)
        t0 = time.perf_counter()
        client = await asyncio.to_thread(_ClientThread, server.path)
        try:
            await asyncio.to_thread(client.wait_snapshot, 60)
            snapshot = time.perf_counter() - t0
            latencies = []
            for i in range(LIVE_ADDS):
                pod = PodInfo(f"live-{i:06d}-0123456789abcdef", f"live-{i}", "namespace", "sa", fd)
                t1 = time.perf_counter()
                await server.add(pod)
                latencies.append(time.perf_counter() - t1)
        finally:
            await asyncio.to_thread(client.close)
    finally:
        await server.stop()
        shutil.rmtree(d, ignore_errors=True)
    return snapshot, latencies


def run() -> list[Result]:
    fd = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _floor_round_trips(200, fd)  # warm-up
        floor = _floor_round_trips(PODS, fd)
        snapshot, latencies = asyncio.run(_measure(fd))
    finally:
        os.close(fd)
    floor_total = sum(floor)
    ms = 1000.0
    p50, p99 = percentile(latencies, 50) * ms, percentile(latencies, 99) * ms
    f50, f99 = percentile(floor, 50) * ms, percentile(floor, 99) * ms
    return [
        ratio_result(f"zds snapshot of {PODS} pods with netns fds", snapshot * ms,
                     floor_total * ms, "ms", 1.5,
                     note="connect + hello + Adds + SnapshotSent, reference client"),
        Result("zds live add latency p50", p50, "ms", f50, "report", None,
               note="await add() incl. ack; floor = bare send_fds + 1-byte ack p50"),
        Result("zds live add latency p99", p99, "ms", f99, "p99 <= 2 ms", p99 <= 2.0,
               note="floor = bare send_fds + 1-byte ack p99"),
    ]


if __name__ == "__main__":
    for r in run():
        print(r.as_dict())
