"""A ztunnel stand-in for the enrollment tests (ztunnel itself can't run here).

Faithful to the ZDS client side of ``docs/zds.md``, built on the real
wire module (``zds.wire``): connect to the agent's SEQPACKET socket, send ZdsHello,
then answer every WorkloadRequest with an Ack. For each AddWorkload with a netns fd
it does what ztunnel does with it: enter the netns and open the in-pod listeners
(15001 outbound, 15006 inbound, 15008 HBONE, 15053 DNS TCP+UDP), so rule tests can
check where redirected traffic lands. ``nack`` makes it refuse adds (ztunnel error).
"""

from __future__ import annotations

import os
import socket
import threading
import time

from agent.core.netns import run_in_netns
from zds import wire

PORTS = (15001, 15006, 15008)


class FakeZtunnel:
    """Connect with :meth:`start`; ``adds`` maps uid -> netns inode (None for Keep),
    ``snapshots`` counts SnapshotSent, ``listeners[uid][port]`` are the in-pod sockets."""

    def __init__(self, path: str, open_listeners: bool = False, nack: str = ""):
        self.path, self.open_listeners, self.nack = path, open_listeners, nack
        self.adds: dict[str, int | None] = {}
        self.deleted: list[str] = []
        self.snapshot_uids: set[str] | None = None
        self.listeners: dict[str, dict[object, socket.socket]] = {}
        self.sock: socket.socket | None = None
        self._pending: set[str] = set()
        self._thread: threading.Thread | None = None
        self._stop = False

    def start(self, timeout: float = 5.0) -> "FakeZtunnel":
        deadline = time.monotonic() + timeout
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                s.connect(self.path)
                break
            except OSError:
                s.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.sock = s
        wire.send_packet(s, wire.encode_hello())
        self._thread = threading.Thread(target=self._run, daemon=True, name="fake-ztunnel")
        self._thread.start()
        return self

    def _run(self) -> None:
        assert self.sock is not None
        self._pending: set[str] = set()
        while not self._stop:
            try:
                self.sock.settimeout(0.2)
                packet = wire.recv_packet(self.sock)
            except (BlockingIOError, socket.timeout, TimeoutError):
                continue
            except OSError:
                return
            if packet is None:
                return
            try:
                self._handle(packet)
            except OSError:  # the agent closed the connection before our ack: as ztunnel, stop
                return
            finally:
                packet.close_fds()

    def _handle(self, packet: wire.Packet) -> None:
        req = wire.decode_request(packet.data)
        kind = req.WhichOneof("payload")
        error = ""
        if kind == "add":
            if self.nack:
                error = self.nack
            else:
                fd = packet.fds[0] if packet.fds else None
                self.adds[req.add.uid] = os.fstat(fd).st_ino if fd is not None else None
                self._pending.add(req.add.uid)
                if fd is not None and self.open_listeners and req.add.uid not in self.listeners:
                    self._listen(req.add.uid, fd)
        elif kind == "keep":
            self.adds.setdefault(req.keep.uid, None)
            self._pending.add(req.keep.uid)
        elif kind == "del":
            self.deleted.append(getattr(req, "del").uid)
            for s in self.listeners.pop(getattr(req, "del").uid, {}).values():
                s.close()
        elif kind == "snapshot_sent":
            self.snapshot_uids = set(self._pending)
        wire.send_packet(self.sock, wire.encode_ack(error))

    def _listen(self, uid: str, fd: int) -> None:
        def bind_all():
            socks: dict[object, socket.socket] = {}
            for port in PORTS + (15053,):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("0.0.0.0", port))
                s.listen(16)
                socks[port] = s
            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            u.bind(("0.0.0.0", 15053))
            socks["udp15053"] = u
            return socks
        self.listeners[uid] = run_in_netns(fd, bind_all)

    def wait(self, predicate, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.02)
        return predicate()

    def close(self) -> None:
        self._stop = True
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self.sock is not None:
            self.sock.close()
        for socks in self.listeners.values():
            for s in socks.values():
                s.close()
        self.listeners.clear()
