"""A ZDS peer that does what ztunnel's in-pod workload manager does, for CI without the binary.

Written from ztunnel's own source (``src/inpod/workloadmanager.rs``, ``statemanager.rs``,
``protocol.rs``, ``packet.rs``), not from this project's ``agent/demo/fake_ztunnel.py``, so the agent
is tested against the peer's behaviour rather than against our reading of the spec.
Only the protobuf messages are shared (``zds.zds_pb2``: the wire contract, the same
``zds.proto`` as ztunnel's). What it reproduces, each with where ztunnel does it:

- **connect** (``WorkloadProxyNetworkHandler::connect``): a non-blocking SEQPACKET
  connect, retried forever; ztunnel doubles a 10 ms delay before each retry (so 20 ms,
  40 ms, ... capped at 15 s). ``connect_retry`` fixes the delay instead (tests that must
  connect "at the earliest moment" pass a tight one).
- **per connection** (``WorkloadProxyManagerProcessor::new`` -> ``reset_snapshot``): the
  snapshot name set and the pending (failed-to-start) proxies are cleared, running
  proxies are kept; then ``ZdsHello{version: V1}`` is sent. A failed hello is an
  "announce error": retried after a backoff (5 ms doubling, 15 s cap).
- **reading** (``WorkloadStreamProcessor::read_message``): one ``recvmsg`` of at most
  1024 bytes with room for one fd (``MSG_CMSG_CLOEXEC``); 0 bytes is EOF (the
  connection ends normally and ztunnel reconnects). Fds are taken first (more than one:
  all closed, "Expected 1 FD, got N"), then ``MSG_TRUNC``/``MSG_CTRUNC`` ("received
  truncated message"), then the protobuf; no payload, Add without fd ("No control
  message") and anything else with an fd ("Unexpected control message") are read
  errors. A read error is answered with the NACK ``failure to read message : ...`` and
  ends the connection (reconnect).
- **handling** (``WorkloadProxyManagerState::process_msg``):
  Add without ``workload_info`` is a protocol error; before ``SnapshotSent`` the uid
  joins the snapshot set; the netns fd is ``fstat``-ed (identity = ``(st_ino, st_dev)``);
  a running proxy with the same netns is kept (idempotent), with another netns it is
  shut and replaced; a proxy that fails to start goes to pending, is NACKed
  ``failure to start proxy : ...`` (the connection stays) and retried every 5 s.
  Keep after ``SnapshotSent`` is a protocol error, else the uid joins the snapshot set.
  Del before ``SnapshotSent`` only leaves the snapshot set and pending; after, it shuts
  the proxy. A second ``SnapshotSent`` is a protocol error; the first one shuts
  **every running proxy not named before it** (``reconcile``).
- **acks**: an empty ``Ack`` when handling succeeded. A protocol error is NACKed
  ``failure to process message : ProtocolError(...)`` and is fatal: ztunnel's manager
  returns an error and stops (``run_internal``), recorded here as :attr:`fatal`.
- **readiness** (``ready``): snapshot received and nothing pending.

Runs on its own thread with blocking socket calls, as a separate process would.
Observations for tests: :attr:`snapshots` (one :class:`SnapshotRecord` per handled
``SnapshotSent``), :attr:`proxies` (running, uid -> :class:`Proxy`), :attr:`shut`
(uid, reason) in order, :attr:`nacks`, :attr:`connections`, :attr:`connect_attempts`.
"""

from __future__ import annotations

import array
import dataclasses
import errno
import os
import random
import socket
import threading
import time
from typing import Callable

from zds import zds_pb2

MAX_MESSAGE = 1024          # protocol.rs: vec![0u8; 1024]
RETRY_DURATION = 5.0        # workloadmanager.rs: pending proxies retried every 5 s
CONNECT_MAX_BACKOFF = 15.0  # CONNECTION_FAILURE_RETRY_DELAY_MAX_INTERVAL


class ProtocolError(Exception):
    """ztunnel's ``Error::ProtocolError``: fatal for the workload manager."""


class ProxyError(Exception):
    """ztunnel's ``Error::ProxyError``: the proxy did not start; retried, NACKed."""


class ReadError(Exception):
    """A message that could not be read (``read_message`` returned an error)."""


@dataclasses.dataclass
class Proxy:
    """A running in-pod proxy: the pod's identity from ``workload_info``, its netns
    identity ``(st_ino, st_dev)``, and the netns fd ztunnel keeps while it runs."""

    uid: str
    name: str
    namespace: str
    service_account: str
    netns_id: tuple[int, int]
    fd: int
    connection: int


@dataclasses.dataclass(frozen=True)
class SnapshotRecord:
    """One handled ``SnapshotSent``: ``names`` are the uids named before it on that
    connection (Adds and Keeps), ``kept`` the running proxies it left alive, ``shut``
    the ones it shut; ``at`` is ``time.monotonic()``."""

    connection: int
    names: frozenset[str]
    adds: int
    keeps: int
    kept: frozenset[str]
    shut: frozenset[str]
    at: float


ProxyFactory = Callable[[str, zds_pb2.WorkloadInfo, int], None]


class ZtunnelZds:
    """See the module docstring. ``path``: the agent's ZDS socket. ``connect_retry``:
    fixed seconds between connect attempts (None: ztunnel's doubling from 10 ms).
    ``proxy_factory(uid, workload_info, netns_fd)`` starts a proxy; raise to make it fail
    (ztunnel's proxy errors). ``max_connections``: stop after that many connections
    ended (None: reconnect forever, as ztunnel)."""

    def __init__(self, path: str, *, connect_retry: float | None = None,
                 proxy_factory: ProxyFactory | None = None,
                 max_connections: int | None = None):
        self.path = path
        self.connect_retry = connect_retry
        self.proxy_factory = proxy_factory
        self.max_connections = max_connections
        # statemanager.rs WorkloadProxyManagerState
        self.proxies: dict[str, Proxy] = {}
        self.pending: dict[str, tuple[zds_pb2.WorkloadInfo, int]] = {}
        self.snapshot_received = False
        self.snapshot_names: set[str] = set()
        # observations
        self.snapshots: list[SnapshotRecord] = []
        self.shut: list[tuple[str, str]] = []
        self.nacks: list[str] = []
        self.acks = 0
        self.received: list[str] = []  # message kinds in order
        self.connections = 0
        self.connect_attempts = 0
        self.first_connected_at: float | None = None
        self.fatal: str | None = None
        self._adds = self._keeps = 0
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._next_retry: float | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "ZtunnelZds":
        self._thread = threading.Thread(target=self.run, name="ztunnel-exact-zds", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Drain: stop the manager and every proxy (ztunnel's ``state.drain()``)."""
        self._stop.set()
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._cond:
            for proxy in self.proxies.values():
                os.close(proxy.fd)
            self.proxies.clear()
            for _, fd in self.pending.values():
                os.close(fd)
            self.pending.clear()

    def ready(self) -> bool:
        """``WorkloadProxyManagerState::ready``."""
        return self.snapshot_received and not self.pending

    def wait(self, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
        """Block until ``predicate()`` holds (checked after every handled message)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def _changed(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------ run loop

    def run(self) -> None:
        """``WorkloadProxyManager::run_internal``: connect, process, reconnect."""
        announce_backoff = 0.005
        ended = 0
        while not self._stop.is_set() and self.fatal is None:
            sock = self._connect()
            if sock is None:
                break
            self._sock = sock
            self.connections += 1
            if self.first_connected_at is None:
                self.first_connected_at = time.monotonic()
            try:
                outcome = self._process(sock, self.connections)
            finally:
                self._sock = None
                sock.close()
                self._changed()
            ended += 1
            if outcome == "announce":
                wait = announce_backoff * random.uniform(0.8, 1.2)
                announce_backoff = min(announce_backoff * 2, CONNECT_MAX_BACKOFF)
                self._stop.wait(wait)
            elif outcome == "ok":
                announce_backoff = 0.005
            if self.max_connections is not None and ended >= self.max_connections:
                break

    def _connect(self) -> socket.socket | None:
        backoff = 0.010
        while not self._stop.is_set():
            self.connect_attempts += 1
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            try:
                sock.connect(self.path)
                return sock
            except OSError:
                sock.close()
            if self.connect_retry is not None:
                delay = self.connect_retry
            else:
                backoff = min(CONNECT_MAX_BACKOFF, backoff * 2)
                delay = backoff
            self._stop.wait(delay)
        return None

    def _process(self, sock: socket.socket, conn: int) -> str:
        """One connection (``WorkloadProxyManagerProcessor::process``). Returns ``eof``,
        ``error``, ``announce`` or ``fatal``."""
        self._reset_snapshot()
        try:
            sock.sendmsg([zds_pb2.ZdsHello(version=zds_pb2.V1).SerializeToString()])
        except OSError:
            return "announce"
        while not self._stop.is_set():
            try:
                message = self._read_message(sock)
            except ReadError as e:
                self._send_ack(sock, f"failure to read message : {e}")
                return "error"
            except OSError:
                return "error"
            if message is None:
                return "eof"
            kind, payload, fd = message
            self.received.append(kind)
            try:
                self._process_msg(kind, payload, fd, conn)
            except ProxyError as e:
                self._schedule_retry()
                self._send_ack(sock, f"failure to start proxy : {e}")
            except ProtocolError as e:
                self._send_ack(sock, f"failure to process message : ProtocolError({str(e)!r})")
                self.fatal = str(e)
                self._changed()
                return "fatal"
            else:
                self._send_ack(sock, "")
            self._changed()
        return "eof"

    def _send_ack(self, sock: socket.socket, error: str) -> None:
        resp = zds_pb2.WorkloadResponse(ack=zds_pb2.Ack(error=error))
        if error:
            self.nacks.append(error)
        else:
            self.acks += 1
        sock.sendmsg([resp.SerializeToString()])

    # ------------------------------------------------------------------ reading

    def _read_message(self, sock: socket.socket):
        """``(kind, payload message, fd or None)``, or None at EOF; pending proxies are
        retried when their timer fires while waiting. Raises :class:`ReadError`."""
        while True:
            timeout = None
            if self._next_retry is not None:
                timeout = max(0.0, self._next_retry - time.monotonic())
            sock.settimeout(timeout)
            try:
                data, ancdata, flags, _ = sock.recvmsg(
                    MAX_MESSAGE, socket.CMSG_SPACE(array.array("i").itemsize),
                    socket.MSG_CMSG_CLOEXEC)
            except (TimeoutError, socket.timeout):
                self._retry_pending()
                continue
            except InterruptedError:
                continue
            except OSError as e:
                if e.errno in (errno.ECONNRESET, errno.EPIPE):
                    return None
                raise
            if not data:
                for fd in _fds(ancdata):
                    os.close(fd)
                return None
            fd = self._take_fd(ancdata)  # fds first, so nothing leaks on the checks below
            try:
                if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                    raise ReadError("received truncated message")
                try:
                    req = zds_pb2.WorkloadRequest.FromString(data)
                except Exception as e:  # noqa: BLE001 - prost's DecodeError
                    raise ReadError(f"failed to decode Protobuf message: {e}") from None
                kind = req.WhichOneof("payload")
                if kind is None:
                    raise ReadError("no payload")
                if kind == "add" and fd is None:
                    raise ReadError("No control message")
                if kind != "add" and fd is not None:
                    raise ReadError("Unexpected control message")
            except ReadError:
                if fd is not None:
                    os.close(fd)
                raise
            return kind, getattr(req, kind), fd

    @staticmethod
    def _take_fd(ancdata) -> int | None:
        fds = _fds(ancdata)
        if len(fds) > 1:
            for fd in fds:
                os.close(fd)
            raise ReadError(f"Expected 1 FD, got {len(fds)}")
        return fds[0] if fds else None

    # ------------------------------------------------------------------ state manager

    def _reset_snapshot(self) -> None:
        with self._cond:
            self.snapshot_names.clear()
            for _, fd in self.pending.values():
                os.close(fd)
            self.pending.clear()
            self.snapshot_received = False
            self._adds = self._keeps = 0
            self._next_retry = None

    def _process_msg(self, kind: str, msg, fd: int | None, conn: int) -> None:
        if kind == "add":
            if not msg.HasField("workload_info"):
                os.close(fd)
                raise ProtocolError("workload_info is required but not present")
            if not self.snapshot_received:
                self.snapshot_names.add(msg.uid)
                self._adds += 1
            try:
                st = os.fstat(fd)
            except OSError as e:
                os.close(fd)
                raise ProxyError(f"Io({e})") from None
            self._add_workload(msg.uid, msg.workload_info, fd, (st.st_ino, st.st_dev), conn)
        elif kind == "keep":
            if self.snapshot_received:
                raise ProtocolError("pod keep received after snapshot")
            self.snapshot_names.add(msg.uid)
            self._keeps += 1
        elif kind == "del":
            if not self.snapshot_received:
                self.snapshot_names.discard(msg.uid)
                entry = self.pending.pop(msg.uid, None)
                if entry is not None:
                    os.close(entry[1])
                return
            self._del_workload(msg.uid, "deleted")
        elif kind == "snapshot_sent":
            if self.snapshot_received:
                raise ProtocolError("pod snapshot received already")
            shut = self._reconcile()
            self.snapshots.append(SnapshotRecord(
                conn, frozenset(self.snapshot_names), self._adds, self._keeps,
                frozenset(self.proxies), frozenset(shut), time.monotonic()))
            self.snapshot_names.clear()
            self.snapshot_received = True

    def _reconcile(self) -> list[str]:
        """Shut every running proxy not named before ``SnapshotSent``."""
        gone = [uid for uid in self.proxies if uid not in self.snapshot_names]
        for uid in gone:
            self._shutdown(uid, "not in snapshot")
        return gone

    def _add_workload(self, uid: str, info, fd: int, netns_id: tuple[int, int],
                      conn: int) -> None:
        existing = self.proxies.get(uid)
        if existing is not None:
            if existing.netns_id == netns_id:
                os.close(fd)  # idempotent: the running proxy keeps its own fd
                self._drop_pending(uid)
                return
            self._del_workload(uid, "new netns")
        try:
            if self.proxy_factory is not None:
                self.proxy_factory(uid, info, fd)
        except Exception as e:  # noqa: BLE001 - any proxy start failure
            old = self.pending.pop(uid, None)
            if old is not None:
                os.close(old[1])
            self.pending[uid] = (info, fd)
            raise ProxyError(repr(e)) from None
        self._drop_pending(uid)
        self.proxies[uid] = Proxy(uid, info.name, info.namespace, info.service_account,
                                  netns_id, fd, conn)

    def _drop_pending(self, uid: str) -> None:
        entry = self.pending.pop(uid, None)
        if entry is not None and entry[1] not in {p.fd for p in self.proxies.values()}:
            os.close(entry[1])

    def _del_workload(self, uid: str, reason: str) -> None:
        entry = self.pending.pop(uid, None)
        if entry is not None:
            os.close(entry[1])
        if uid in self.proxies:
            self._shutdown(uid, reason)

    def _shutdown(self, uid: str, reason: str) -> None:
        proxy = self.proxies.pop(uid)
        os.close(proxy.fd)
        self.shut.append((uid, reason))

    def _schedule_retry(self) -> None:
        if self._next_retry is None:
            self._next_retry = time.monotonic() + RETRY_DURATION

    def _retry_pending(self) -> None:
        """``retry_pending``: try every pending proxy again; re-arm while any is left."""
        self._next_retry = None
        for uid, (info, fd) in list(self.pending.items()):
            del self.pending[uid]
            try:
                st = os.fstat(fd)
                self._add_workload(uid, info, fd, (st.st_ino, st.st_dev), self.connections)
            except (ProxyError, OSError):
                pass
        if self.pending:
            self._schedule_retry()
        self._changed()


def _fds(ancdata) -> list[int]:
    out: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds = array.array("i")
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
            out.extend(fds)
    return out
