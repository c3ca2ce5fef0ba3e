"""ZDS benchmarks: a 1,000-pod snapshot with netns fds, and live-add latency.

The snapshot figures are timed from "ztunnel, connect now" to the agent holding the ack
of ``SnapshotSent``, with the agent side on the main thread and the ztunnel side on a
second thread of the same process:

- floor: a bare Python loop. The bare peer (:func:`_bare_peer`: connect, send the
  ZdsHello bytes, then ``recv_fds`` + 2-byte success ack per message, keeping every fd
  as ztunnel holds them) against a bare server: accept, read the hello, ``send_fds`` the
  same AddWorkload bytes with a netns fd 1,000 times and SnapshotSent, reading the ack
  after each (1,001 round trips).
- judged: our ZdsServer (1,000 recorded pods) against **the same bare peer**. Only the
  server differs from the floor, so the ratio is the agent's own cost; target <= 1.5.
- report: our ZdsServer against the fake ztunnel (``agent.demo.fake_ztunnel``: its own event
  loop, its session on a thread, parsing and handling every request as ztunnel's
  in-pod manager does) next to the same floor. The difference to the judged row is
  the Python stand-in's per-message work, which ztunnel does in Rust.

Each is the best of ``ROUNDS`` runs, interleaved, since other work shares the machine.
The process is pinned to one CPU for the whole benchmark (floor and figures alike): a
lockstep exchange between two threads of one process otherwise measures where the
scheduler puts them, which it decides differently from run to run (same CPU: ~10 us per
round trip, a context switch each way; two CPUs with idle states between messages:
~40 us, an inter-processor wake-up each way). On one CPU both sides pay the same context
switches and the ratio is the per-message work.
Live adds: p99 <= 2 ms (floor: the bare send_fds + ack round trip).
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
from agent.demo.fake_ztunnel import FakeZtunnel
from zds.server import ZdsServer

PODS = 1000
LIVE_ADDS = 1000
ROUNDS = 5


def _bare_peer(path: str, go: threading.Event, messages: int,
               hold: threading.Event | None = None) -> None:
    """The bare ztunnel side: connect, hello, then receive and ack ``messages`` requests;
    with ``hold``, keep the connection open until it is set (so the agent sees the last
    ack on a live connection). Closes the received fds at the end."""
    go.wait()
    held: list[int] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(path)
        s.send(wire.encode_hello())
        for _ in range(messages):
            _, fds, _, _ = socket.recv_fds(s, wire.MAX_MESSAGE, 1)
            held.extend(fds)
            s.send(wire.ACK_OK)
        if hold is not None:
            hold.wait(60)
    for f in held:
        os.close(f)


def _floor_snapshot(fd: int, directory: str) -> float:
    """Seconds for the bare connect + hello + PODS adds + SnapshotSent loop."""
    path = os.path.join(directory, f"floor-{time.monotonic_ns()}.sock")
    add = wire.encode_add("pod-000000-0123456789abcdef", "name-0", "namespace", "sa")
    snapshot_sent = wire.encode_snapshot_sent()
    go = threading.Event()
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
        listener.bind(path)
        listener.listen(1)
        peer = threading.Thread(target=_bare_peer, args=(path, go, PODS + 1))
        peer.start()
        t0 = time.perf_counter()
        go.set()
        conn, _ = listener.accept()
        with conn:
            conn.recv(wire.MAX_MESSAGE)
            for _ in range(PODS):
                socket.send_fds(conn, [add], [fd])
                conn.recv(wire.MAX_MESSAGE)
            conn.send(snapshot_sent)
            conn.recv(wire.MAX_MESSAGE)
            elapsed = time.perf_counter() - t0
        peer.join()
    os.unlink(path)
    return elapsed


def _floor_round_trips(n: int, fd: int) -> list[float]:
    """Per-round-trip seconds of a bare send_fds + 2-byte-ack loop (live-add floor)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    payload = wire.encode_add("0123456789abcdef0123456789abcdef", "name", "namespace", "sa")
    held: list[int] = []

    def peer():
        for _ in range(n):
            _, fds, _, _ = socket.recv_fds(b, wire.MAX_MESSAGE, 1)
            held.extend(fds)
            b.send(wire.ACK_OK)

    t = threading.Thread(target=peer)
    t.start()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        socket.send_fds(a, [payload], [fd])
        a.recv(wire.MAX_MESSAGE)
        samples.append(time.perf_counter() - t0)
    t.join()
    a.close()
    b.close()
    for f in held:
        os.close(f)
    return samples


class _ClientThread:
    """A FakeZtunnel on its own thread and event loop, created before the timing starts."""

    def __init__(self, path: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.client = asyncio.run_coroutine_threadsafe(self._make(path), self.loop).result()
        self.task: asyncio.Task | None = None

    @staticmethod
    async def _make(path: str) -> FakeZtunnel:
        return FakeZtunnel(path)

    def start(self) -> None:
        """Ask the client's loop to connect (returns at once)."""
        def begin():
            self.task = self.loop.create_task(self.client.run())
        self.loop.call_soon_threadsafe(begin)

    def close(self) -> None:
        async def stop():
            self.client.stop()
            await self.task
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


async def _zds_snapshot(server: ZdsServer) -> tuple[float, _ClientThread]:
    """Seconds from the client's start to the server holding SnapshotSent's ack."""
    client = await asyncio.to_thread(_ClientThread, server.path)
    t0 = time.perf_counter()
    client.start()
    await server.wait_connected(1, timeout=60)
    return time.perf_counter() - t0, client


async def _server_bare_peer(server: ZdsServer) -> float:
    """Seconds from the bare peer's go to the server holding SnapshotSent's ack."""
    go, hold = threading.Event(), threading.Event()
    peer = threading.Thread(target=_bare_peer, args=(server.path, go, PODS + 1, hold))
    peer.start()
    try:
        t0 = time.perf_counter()
        go.set()
        await server.wait_connected(1, timeout=60)
        elapsed = time.perf_counter() - t0
    finally:
        hold.set()
        go.set()
        await asyncio.to_thread(peer.join)
    while server.connections:  # the server saw the EOF
        await asyncio.sleep(0.005)
    return elapsed


async def _measure(fd: int, directory: str
                   ) -> tuple[list[float], list[float], list[float], list[float]]:
    server = ZdsServer(os.path.join(directory, "ztunnel.sock"), accept_rate=1000)
    await server.start()
    floors, bare, snapshots, latencies = [], [], [], []
    try:
        for i in range(PODS):
            await server.add(PodInfo(f"pod-{i:06d}-0123456789abcdef", f"name-{i}", "namespace",
                                     "sa", fd), wait_ack=False)
        await asyncio.to_thread(_floor_snapshot, fd, directory)  # warm-up
        for rnd in range(ROUNDS):
            floors.append(await asyncio.to_thread(_floor_snapshot, fd, directory))
            bare.append(await _server_bare_peer(server))
            elapsed, client = await _zds_snapshot(server)
            snapshots.append(elapsed)
            if rnd < ROUNDS - 1:
                await asyncio.to_thread(client.close)
                while server.connections:  # the server saw the EOF
                    await asyncio.sleep(0.005)
        try:
            for i in range(LIVE_ADDS):
                pod = PodInfo(f"live-{i:06d}-0123456789abcdef", f"live-{i}", "namespace", "sa", fd)
                t1 = time.perf_counter()
                await server.add(pod)
                latencies.append(time.perf_counter() - t1)
        finally:
            await asyncio.to_thread(client.close)
    finally:
        await server.stop()
    return floors, bare, snapshots, latencies


def run() -> list[Result]:
    fd = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    directory = tempfile.mkdtemp(prefix="zds-bench-")
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})  # see the module docstring: one CPU
    try:
        _floor_round_trips(200, fd)  # warm-up
        floor = _floor_round_trips(LIVE_ADDS, fd)
        floors, bare, snapshots, latencies = asyncio.run(_measure(fd, directory))
    finally:
        os.sched_setaffinity(0, allowed)
        os.close(fd)
        shutil.rmtree(directory, ignore_errors=True)
    ms = 1000.0
    p50, p99 = percentile(latencies, 50) * ms, percentile(latencies, 99) * ms
    f50, f99 = percentile(floor, 50) * ms, percentile(floor, 99) * ms
    return [
        ratio_result(f"zds snapshot of {PODS} pods with netns fds", min(bare) * ms,
                     min(floors) * ms, "ms", 1.5,
                     note=f"our server: connect + hello + {PODS} Adds + SnapshotSent to the "
                          f"bare peer; best of {ROUNDS}; floor = bare server, same peer"),
        Result(f"zds snapshot of {PODS} pods to the reference client", min(snapshots) * ms,
               "ms", min(floors) * ms, "report", None,
               note="our server + the fake ztunnel (Python stand-in); floor = bare loop"),
        Result("zds live add latency p50", p50, "ms", f50, "report", None,
               note="await add() incl. ack; floor = bare send_fds + ack p50"),
        Result("zds live add latency p99", p99, "ms", f99, "p99 <= 2 ms", p99 <= 2.0,
               note="floor = bare send_fds + ack p99"),
    ]


if __name__ == "__main__":
    for r in run():
        print(r.as_dict())
