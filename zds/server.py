"""The ZDS server (agent side): hands each enrolled pod's netns to ztunnel.

Implements ``docs/zds.md`` (Istio's ``cni/pkg/nodeagent/ztunnelserver*.go``):

- a SOCK_SEQPACKET Unix socket at ``ztunnel_uds_address``: a stale file is unlinked,
  the socket is created 0600 (bound under a temporary name, chmod'ed, then renamed into
  place so it is never reachable with looser permissions), accepts are rate-limited to
  5/s with burst 1 (a reconnect loop must not exhaust the agent);
- per connection (:class:`ZdsConnection`, one task = the one writer, because acks are
  matched only by order): ``ZdsHello`` within 5 s, then the snapshot (one
  ``AddWorkload`` + SCM_RIGHTS netns fd per pod with a netns, ``KeepWorkload`` per pod
  without, then ``SnapshotSent``), then live adds/deletes from its queue, every message
  acked within 5 s; while idle the socket is watched, so EOF is a clean exit and any
  message from ztunnel is "unexpected" and drops the connection; a keepalive probe also
  runs every 5 s of idleness (the upstream keepalive check);
- several ztunnels: each gets the full snapshot; adds go to the newest live
  connection, deletes to all; when the newest goes away the previous one is used.

Deliberate differences from upstream, and why:

- An ack timeout **drops the connection** (upstream keeps it, and a late ack is then
  taken as the next message's ack). ztunnel reconnects and gets a fresh snapshot
  that includes the pod, so nothing is lost.
- The snapshot is sent by a thread with blocking I/O (:meth:`ZdsConnection._send_snapshot`);
  a pod deleted while it is in flight is skipped when the snapshot reaches it (the fd
  is looked up under the lock its close takes), so it is never announced after its
  delete; a queued live Add whose pod was deleted or replaced is withdrawn.
- ``add(pod, wait_ack=False)`` records the pod and, if a ztunnel is connected, also
  sends it without waiting (upstream's restart path only caches it).

Restart (upstream ``Server.Start``: ``ConstructInitialSnapshot`` before the ztunnel
server's ``Run``): built with ``hold_accept=True`` (the daemon does), the socket is bound
and listening at :meth:`ZdsServer.start` but nothing is accepted until
:meth:`ZdsServer.open_accept` (the enrollment component calls it once restart recovery
has recorded every live enrolled pod). A ztunnel that connects earlier waits in the
listen backlog with its hello queued, so the first snapshot it gets is complete:
ztunnel shuts every proxy not named before ``SnapshotSent``.
"""

from __future__ import annotations

import array
import asyncio
import collections
import errno
import logging
import os
import select
import socket
import struct
import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry

from agent.core import unixsocket
from agent.core.config import ConfigError
from agent.core.peercred import peer_cred
from agent.core.ratelimit import RepeatLimiter
from agent.core.lifecycle import AgentContext, Component
from zds import wire
from zds.api import NoZtunnel, PodInfo, ZdsError, ZdsNack, ZdsTimeout
from zds.metrics import ZdsMetrics

log = logging.getLogger(__name__)

HELLO_TIMEOUT = 5.0       # seconds to wait for ZdsHello after accept
ACK_TIMEOUT = 5.0         # seconds for each write and each ack (readWriteDeadline)
KEEPALIVE_INTERVAL = 5.0  # seconds of idleness between keepalive probes
ACCEPT_RATE = 5.0         # accepts per second, burst 1


# Held by a snapshot thread from reading a record's fd to sendmsg having taken it, and
# by _PodRecord.close: the loop can't close (and the process reuse) an fd number under
# a send. Uncontended almost always; never held across a blocking call.
_FD_LOCK = threading.Lock()


class _PodRecord:
    """A recorded pod, the server's own dup of its netns fd (closed exactly once), and
    its request bytes (``AddWorkload`` with a netns, else ``KeepWorkload``), encoded
    once here rather than for every connection's snapshot."""

    __slots__ = ("info", "fd", "kind", "message")

    def __init__(self, info: PodInfo):
        self.info = info
        self.fd: int | None = None
        if info.netns_fd is None:
            self.kind, self.message = "keep", wire.encode_keep(info.uid)
            return
        self.kind = "add"
        self.message = wire.encode_add(info.uid, info.name, info.namespace,
                                       info.service_account)
        try:
            self.fd = os.dup(info.netns_fd)  # non-inheritable, as Python makes dups
        except OSError as e:
            raise ValueError(f"PodInfo.netns_fd={info.netns_fd!r} of pod {info.uid!r} "
                             f"is not an open fd: {e.strerror}") from None

    def close(self) -> None:
        with _FD_LOCK:  # never while a snapshot thread is handing this fd to sendmsg
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None


_SNAPSHOT_SENT = wire.encode_snapshot_sent()


class _NotSent(Exception):
    """The connection went away before the message was written; safe to retry elsewhere."""


class _Drop(Exception):
    """End this connection; the text is the logged reason, ``timeout`` says it was one.
    ``level`` is the log level of the close line; ``pre_hello`` marks problems before
    ZdsHello (rate-limited: whoever sends them is not a working ztunnel)."""

    def __init__(self, reason: str, timeout: bool = False, level: int = logging.WARNING,
                 pre_hello: bool = False):
        super().__init__(reason)
        self.timeout = timeout
        self.level = level
        self.pre_hello = pre_hello


PRE_HELLO_LOG_WINDOW = 60.0  # seconds: identical pre-hello warnings logged once per window


class _Request:
    __slots__ = ("kind", "uid", "record", "future")

    def __init__(self, kind: str, uid: str, record: _PodRecord | None, future: asyncio.Future):
        self.kind, self.uid, self.record, self.future = kind, uid, record, future


_READABLE = object()  # queue sentinel: the socket became readable while idle


class _Flight:
    """The one request on a connection awaiting its ack (acks match by order only).
    ``on_ack(ack, error)`` gets the Ack, or None and the :class:`_Drop` to raise."""

    __slots__ = ("kind", "uid", "sent_at", "on_ack")

    def __init__(self, kind: str, uid: str, sent_at: float, on_ack):
        self.kind, self.uid, self.sent_at, self.on_ack = kind, uid, sent_at, on_ack


class _SnapshotOutcome:
    """What the snapshot thread hands back to the loop: per-kind counts of requests
    sent, the uids ztunnel acked without error (uid -> kind), NACKs, and ack latencies
    (seconds) for the histogram, observed on the loop after the snapshot is done."""

    __slots__ = ("sent", "held", "nacks", "latencies")

    def __init__(self):
        self.sent = {"add": 0, "keep": 0, "snapshot_sent": 0}
        self.held: dict[str, str] = {}
        self.nacks = 0
        self.latencies: list[float] = []


_TIMEVAL = struct.Struct("ll")


def _set_io_timeouts(sock: socket.socket, seconds: float) -> None:
    """Kernel send/receive timeouts (SO_SNDTIMEO/SO_RCVTIMEO) for blocking calls: the
    call fails with EAGAIN after ``seconds``, without the poll() Python adds before
    every call on a socket with a Python-level timeout. 0 turns them off."""
    whole = int(seconds)
    tv = _TIMEVAL.pack(whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


class ZdsConnection:
    """One ztunnel connection and its single writer task.

    ``held`` maps pod uid -> ``"add"``/``"keep"`` for what ztunnel acked on this
    connection (for ``debug_state``); ``latest`` is decided by the server.
    """

    def __init__(self, server: "ZdsServer", sock: socket.socket, conn_id: int):
        self.server, self.sock, self.id = server, sock, conn_id
        # Unbounded, unlike upstream's 100-slot channel (whose send blocks): a full queue
        # would have to make callers wait (and so lose the enqueue order of a delete and
        # a re-add) or drop updates. Its length is bounded anyway: a stalled ztunnel is
        # dropped after one ack timeout, and that empties the queue.
        self.queue: asyncio.Queue = asyncio.Queue()
        self.connected_at = time.time()
        self.peer_pid = _peer_pid(sock)
        self.version: int | None = None
        self.snapshot_sent = False
        self.closed = False
        self.held: dict[str, str] = {}
        self.last_keepalive: float | None = None
        self.task: asyncio.Task | None = None
        # After the hello, one reader stays registered for the connection's life (no
        # epoll_ctl per message): it files every packet/EOF/error into the inbox.
        self._inbox: collections.deque = collections.deque()
        self._reading = False
        self._idle = False
        # The request awaiting its ack; one timer checks its deadline, re-armed only
        # when it fires (no timer per message).
        self._flight: _Flight | None = None
        self._deadline: asyncio.TimerHandle | None = None
        m = server.metrics
        self._m_sent = {k: m.messages.labels(k, "sent")
                        for k in ("add", "keep", "del", "snapshot_sent")}
        self._m_acks = m.messages.labels("ack", "received")
        self._m_ok, self._m_nack = m.acks.labels("ok"), m.acks.labels("nack")
        self._m_latency = m.ack_latency

    # ---------------------------------------------------------------- requests from the API

    def enqueue(self, kind: str, uid: str, record: _PodRecord | None) -> asyncio.Future:
        """Queue an add/del for the writer; the future gets the Ack or an exception.

        Raises :class:`_NotSent` when the connection is closed.
        """
        if self.closed:
            raise _NotSent(f"connection {self.id} is closed")
        fut = asyncio.get_running_loop().create_future()
        self.queue.put_nowait(_Request(kind, uid, record, fut))
        return fut

    # ---------------------------------------------------------------- the writer task

    async def serve(self) -> None:
        reason, level = "stopped", None
        try:
            await self._read_hello()
            self.server._notify()  # a new latest connection: waiting adds may queue
            await self._send_snapshot()
            asyncio.get_running_loop().add_reader(self.sock.fileno(), self._on_readable)
            self._reading = True
            await self._serve_updates()
        except _Drop as e:
            reason = str(e)
            level = e.level
            if e.pre_hello and level >= logging.WARNING:
                level, reason = self.server._pre_hello_log(reason)
        except asyncio.CancelledError:
            reason = "server stopping"
        except Exception as e:  # noqa: BLE001 - one bad peer never takes the server down
            reason = f"internal error: {e!r}"
            log.exception("zds connection %d failed", self.id)
        finally:
            self._close(reason, level)

    async def _read_hello(self) -> None:
        """Raises :class:`_Drop`: at INFO when the peer just connected and closed (a probe,
        another agent's liveness check, a port scan: no ztunnel), else a rate-limited
        WARNING (silent or garbage peer)."""
        try:
            packet = await wire.recv_packet_async(self.sock, self.server.hello_timeout, max_fds=0)
        except TimeoutError:
            raise _Drop(f"no ZdsHello within {self.server.hello_timeout:g}s",
                        pre_hello=True) from None
        except OSError as e:
            if e.errno in (errno.ECONNRESET, errno.EPIPE):
                raise _Drop("peer reset the connection before ZdsHello (not a ztunnel: a "
                            "probe or health check)", level=logging.INFO) from None
            raise _Drop(f"bad ZdsHello: {e}", pre_hello=True) from None
        except wire.WireError as e:
            raise _Drop(f"bad ZdsHello: {e}", pre_hello=True) from None
        if packet is None:
            raise _Drop("peer closed the connection before ZdsHello (not a ztunnel: a probe "
                        "or health check)", level=logging.INFO)
        try:
            hello = wire.decode_hello(packet.data)
        except wire.WireError as e:
            raise _Drop(str(e), pre_hello=True) from None
        self.version = hello.version
        self.server.metrics.messages.labels("hello", "received").inc()
        log.info("ztunnel connected (connection %d, pid %s, ZDS version %d)", self.id,
                 self.peer_pid, hello.version)

    async def _send_snapshot(self) -> None:
        """Send the snapshot (every recorded pod, then ``SnapshotSent``) on a thread of
        its own with blocking I/O, one request and its ack at a time as upstream does.
        A 1,000-pod snapshot is 1,001 round trips; on the event loop each would also pay
        an epoll wake-up and a loop iteration. The loop is free meanwhile: adds and
        deletes queue for :meth:`_serve_updates`; a pod deleted or replaced before its
        turn is skipped (``_PodRecord.close`` and the send share ``_FD_LOCK``).
        Cancelling shuts the socket down, which ends the thread's blocking read."""
        loop = asyncio.get_running_loop()
        uids = list(self.server._pods)
        done = loop.create_future()

        def finish(outcome) -> None:
            if not done.done():
                done.set_result(outcome)

        def worker() -> None:
            try:
                outcome: Any = self._snapshot_blocking(uids)
            except BaseException as e:  # noqa: BLE001 - handed to the loop, raised there
                outcome = e
            try:
                loop.call_soon_threadsafe(finish, outcome)
            except RuntimeError:  # loop closed: nobody waits any more
                pass

        self.sock.setblocking(True)
        _set_io_timeouts(self.sock, self.server.ack_timeout)
        thread = threading.Thread(target=worker, name=f"zds-snapshot-{self.id}", daemon=True)
        thread.start()
        try:
            outcome = await asyncio.shield(done)
        except asyncio.CancelledError:
            _shutdown(self.sock)
            await done
            raise
        finally:
            if not self.closed:
                try:
                    _set_io_timeouts(self.sock, 0)
                    self.sock.setblocking(False)
                except OSError:
                    pass
        if isinstance(outcome, BaseException):
            raise outcome
        self._snapshot_done(outcome)

    def _snapshot_blocking(self, uids: list[str]) -> _SnapshotOutcome:
        """The snapshot thread's loop (blocking socket, kernel timeouts). Raises
        :class:`_Drop` on a send error, timeout, EOF or a bad ack."""
        sock, pods, lock = self.sock, self.server._pods, _FD_LOCK
        out = _SnapshotOutcome()
        sent, held, latencies = out.sent, out.held, out.latencies
        clock = time.perf_counter
        timeout = self.server.ack_timeout
        for uid in uids:
            record, kind, deadline = None, "", 0.0
            while True:
                with lock:  # the fd stays open (and ours) until sendmsg has taken it
                    record = pods.get(uid)
                    if record is None or (record.kind == "add" and record.fd is None):
                        record = None  # deleted since the snapshot started: never announce it
                        break
                    kind = record.kind
                    t0 = clock()
                    try:
                        _send_nowait(sock, record.message, record.fd)
                        break
                    except BlockingIOError:
                        pass  # buffer full: wait for room below, not holding the lock
                    except OSError as e:
                        raise _Drop(f"{_what(kind, uid)}: sendmsg: {e.strerror or e}") from None
                deadline = deadline or t0 + timeout
                if not _poll_writable(sock, deadline - clock()):
                    raise _Drop(f"{_what(kind, uid)}: socket not writable within {timeout:g}s",
                                timeout=True)
            if record is None:
                continue
            ack = self._ack_blocking(kind, uid, timeout)
            latencies.append(clock() - t0)
            sent[kind] += 1
            if ack.error:  # upstream only logs NACKs during the snapshot
                out.nacks += 1
                log.warning("ztunnel NACKed pod %s in snapshot (connection %d): %s", uid,
                            self.id, ack.error)
            else:
                held[uid] = kind
        t0 = clock()
        self._send_blocking("snapshot_sent", "", _SNAPSHOT_SENT, None)
        ack = self._ack_blocking("snapshot_sent", "", timeout)
        latencies.append(clock() - t0)
        sent["snapshot_sent"] += 1
        if ack.error:
            out.nacks += 1
            log.warning("ztunnel NACKed SnapshotSent (connection %d): %s", self.id, ack.error)
        return out

    def _send_blocking(self, kind: str, uid: str, data: bytes, fd: int | None) -> None:
        try:
            wire.send_packet(self.sock, data, fd)
        except BlockingIOError:  # SO_SNDTIMEO passed with the buffer still full
            raise _Drop(f"{_what(kind, uid)}: socket not writable within "
                        f"{self.server.ack_timeout:g}s", timeout=True) from None
        except OSError as e:
            raise _Drop(f"{_what(kind, uid)}: sendmsg: {e.strerror or e}") from None

    def _ack_blocking(self, kind: str, uid: str, timeout: float):
        try:
            packet = wire.recv_packet(self.sock, max_fds=0)
        except BlockingIOError:  # SO_RCVTIMEO
            raise _Drop(f"{_what(kind, uid)}: no ack within {timeout:g}s",
                        timeout=True) from None
        except (wire.WireError, OSError) as e:
            raise _Drop(f"{_what(kind, uid)}: reading ack: {e}") from None
        if packet is None:
            raise _Drop(f"{_what(kind, uid)}: ztunnel closed the connection before acking")
        try:
            return wire.decode_ack(packet.data)
        except wire.WireError as e:
            raise _Drop(f"{_what(kind, uid)}: {e}") from None

    def _snapshot_done(self, out: _SnapshotOutcome) -> None:
        """Back on the loop: publish holds, mark the snapshot sent, wake waiters; the
        metrics are updated after that (bookkeeping, not on ztunnel's path)."""
        self.held.update(out.held)
        self.snapshot_sent = True
        self.server._notify()
        log.info("snapshot of %d pods sent to connection %d", len(self.held), self.id)
        for kind, n in out.sent.items():
            if n:
                self._m_sent[kind].inc(n)
        acks = len(out.latencies)
        self._m_acks.inc(acks)
        if out.nacks:
            self._m_nack.inc(out.nacks)
        if acks - out.nacks:
            self._m_ok.inc(acks - out.nacks)
        observe = self._m_latency.observe
        for seconds in out.latencies:
            observe(seconds)

    async def _serve_updates(self) -> None:
        while True:
            request = await self._next_request()
            fut = request.future
            if fut.done():  # requester gave up (cancelled)
                continue
            if request.kind == "add":
                data, record = request.record.message, request.record
            else:
                data, record = wire.encode_del(request.uid), None
            try:
                ack = await self._exchange(request.kind, request.uid, data, record)
            except _Drop as e:
                if not fut.done():
                    fut.set_exception(ZdsTimeout(str(e)) if e.timeout
                                      else ZdsError(f"ztunnel connection {self.id}: {e}"))
                raise
            if ack is None:
                fut.done() or fut.set_exception(ZdsError(
                    f"pod {request.uid} was deleted or replaced before AddWorkload was sent"))
                continue
            if not ack.error:
                if request.kind == "add":
                    self.held[request.uid] = "add"
                else:
                    self.held.pop(request.uid, None)
            fut.done() or fut.set_result(ack)

    def _on_readable(self) -> None:
        """Reader callback: every queued packet (or EOF/error) completes the request in
        flight, or goes to the inbox (ztunnel spoke unasked; the writer drops it).
        """
        while True:
            try:
                outcome: Any = wire.recv_packet(self.sock, max_fds=0)
            except (BlockingIOError, InterruptedError):
                return
            except (wire.WireError, OSError) as e:
                outcome = e
            last = outcome is None or isinstance(outcome, OSError)
            if last:  # EOF/error: stop reading
                self._stop_reading()
            if self._flight is not None:
                self._land(outcome)
            else:
                self._inbox.append(outcome)
                if self._idle:
                    self._idle = False
                    self.queue.put_nowait(_READABLE)
            if last:
                return

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            asyncio.get_running_loop().remove_reader(self.sock.fileno())

    async def _next_request(self) -> _Request:
        """The next queued request; while idle, any packet from ztunnel is handled as the
        upstream keepalive check would, and a probe runs every keepalive interval."""
        while True:
            item: Any = None
            if self.queue.empty() and not self._inbox:
                self._idle = True
                try:
                    async with asyncio.timeout(self.server.keepalive_interval):
                        item = await self.queue.get()
                except TimeoutError:
                    item = None
                finally:
                    self._idle = False
            elif not self._inbox:
                item = self.queue.get_nowait()
            if isinstance(item, _Request) and not self._inbox:
                return item
            if isinstance(item, _Request):  # ztunnel spoke first: requeue, drop below
                self.queue.put_nowait(item)
            self._keepalive_probe()

    def _keepalive_probe(self) -> None:
        """Upstream's keepalive check: nothing to read = alive, EOF = clean exit,
        a message = protocol error (ztunnel never sends unsolicited data)."""
        self.last_keepalive = time.time()
        if not self._inbox:
            return
        outcome = self._inbox.popleft()
        if outcome is None:  # a clean exit (stop, restart): INFO, as upstream
            raise _Drop("ztunnel closed the connection", level=logging.INFO)
        if isinstance(outcome, Exception):
            raise _Drop(f"keepalive: {outcome}")
        self.server.metrics.messages.labels("unexpected", "received").inc()
        raise _Drop(f"ztunnel protocol error, unexpected message ({len(outcome.data)} bytes)")

    def _send_now(self, kind: str, uid: str, data: bytes, record: _PodRecord | None,
                  on_ack) -> bool:
        """Send one request now and put it in flight. ``record`` (for an Add) supplies
        the fd, looked up in the same loop step as ``sendmsg`` so a deleted or replaced
        pod is withdrawn (returns False) and its fd can't be closed under the send.

        Raises BlockingIOError (nothing sent; socket buffer full) or :class:`_Drop`.
        """
        fd = None
        if kind == "add":
            fd = record.fd if self.server._pods.get(uid) is record else None
            if fd is None:
                return False
        try:
            wire.send_packet(self.sock, data, fd)
        except InterruptedError:
            raise BlockingIOError from None
        except BlockingIOError:
            raise
        except OSError as e:
            raise _Drop(f"{_what(kind, uid)}: sendmsg: {e.strerror or e}") from None
        self._start_flight(kind, uid, on_ack)
        return True

    def _start_flight(self, kind: str, uid: str, on_ack) -> None:
        self._flight = _Flight(kind, uid, time.perf_counter(), on_ack)
        self._m_sent[kind].inc()
        if self._deadline is None:
            self._deadline = asyncio.get_running_loop().call_later(self.server.ack_timeout,
                                                                   self._check_deadline)
        if self._inbox:  # ztunnel spoke before this request: that packet is its "ack"
            asyncio.get_running_loop().call_soon(self._land_inbox)

    def _land_inbox(self) -> None:
        if self._flight is not None and self._inbox:
            self._land(self._inbox.popleft())

    def _check_deadline(self) -> None:
        """Ack timeout (readWriteDeadline): fail the flight once it is ``ack_timeout`` old."""
        self._deadline = None
        flight = self._flight
        if flight is None:
            return
        timeout = self.server.ack_timeout
        left = timeout - (time.perf_counter() - flight.sent_at)
        if left > 0.001:
            self._deadline = asyncio.get_running_loop().call_later(left, self._check_deadline)
            return
        self._flight = None
        flight.on_ack(None, _Drop(f"{_what(flight.kind, flight.uid)}: no ack within {timeout:g}s",
                                  timeout=True))

    def _land(self, outcome: Any) -> None:
        """Complete the flight with ``outcome`` (Packet, None = EOF, or an exception)."""
        flight, self._flight = self._flight, None
        kind, uid = flight.kind, flight.uid
        ack = error = None
        if outcome is None:
            error = _Drop(f"{_what(kind, uid)}: ztunnel closed the connection before acking")
        elif isinstance(outcome, Exception):
            error = _Drop(f"{_what(kind, uid)}: reading ack: {outcome}")
        else:
            try:
                ack = wire.decode_ack(outcome.data)
            except wire.WireError as e:
                error = _Drop(f"{_what(kind, uid)}: {e}")
        if ack is not None:
            self._m_latency.observe(time.perf_counter() - flight.sent_at)
            self._m_acks.inc()
            (self._m_nack if ack.error else self._m_ok).inc()
        flight.on_ack(ack, error)

    async def _exchange(self, kind: str, uid: str, data: bytes,
                        record: _PodRecord | None) -> Any:
        """Send one request (waiting for buffer space) and await its ack. Returns the Ack,
        or None if withdrawn (see :meth:`_send_now`).

        Raises :class:`_Drop` on write/ack timeout, EOF, a socket error or a bad ack.
        """
        timeout = self.server.ack_timeout
        fut = asyncio.get_running_loop().create_future()

        def on_ack(ack, error) -> None:
            if not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(ack)

        deadline = time.perf_counter() + timeout
        while True:
            try:
                if not self._send_now(kind, uid, data, record, on_ack):
                    return None
                break
            except BlockingIOError:
                pass
            left = deadline - time.perf_counter()
            if left <= 0 or not await wire.wait_ready(self.sock, left, write=True):
                raise _Drop(f"{_what(kind, uid)}: socket not writable within {timeout:g}s",
                            timeout=True)
        return await fut

    def _close(self, reason: str, level: int | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        self._stop_reading()
        self._flight = None
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        for outcome in self._inbox:
            if isinstance(outcome, wire.Packet):
                outcome.close_fds()
        if level is None:
            level = logging.INFO if reason in ("ztunnel closed the connection",
                                               "server stopping", "stopped") else logging.WARNING
        log.log(level, "%s connection %d closed: %s",
                "ztunnel" if self.version is not None else "ZDS", self.id, reason)
        try:
            self.sock.close()
        except OSError:
            pass
        # Wake every requester still waiting on this connection (upstream's "close done
        # first" deadlock fix): they retry elsewhere or report the error.
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if isinstance(item, _Request) and not item.future.done():
                item.future.set_exception(_NotSent(f"connection {self.id} closed: {reason}"))
        self.server._on_close(self)

    def debug_state(self) -> dict:
        return {"id": self.id, "peer_pid": self.peer_pid, "version": self.version,
                "connected_at": self.connected_at, "snapshot_sent": self.snapshot_sent,
                "queued": self.queue.qsize(), "last_keepalive": self.last_keepalive,
                "holds": dict(sorted(self.held.items()))}


def _send_nowait(sock: socket.socket, data: bytes, fd: int | None) -> None:
    """One packet with MSG_DONTWAIT (on a blocking socket); BlockingIOError when full."""
    anc = [] if fd is None else [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
    sock.sendmsg([data], anc, socket.MSG_DONTWAIT)


def _poll_writable(sock: socket.socket, seconds: float) -> bool:
    if seconds <= 0:
        return False
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLOUT)
    return bool(poller.poll(seconds * 1000))


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _peer_pid(sock: socket.socket) -> int | None:
    try:
        return peer_cred(sock)[0]
    except OSError:
        return None


def _what(kind: str, uid: str) -> str:
    """``"add <uid>"`` for pod messages, just ``"snapshot_sent"`` for the uid-less one."""
    return f"{kind} {uid}" if uid else kind


def _refuse_if_served(path: str) -> None:
    """Raise :class:`ConfigError` if a live server answers on ``path``.

    Upstream unlinks whatever is there; a second agent doing that would silently cut the
    first one off from ztunnel. A socket nobody accepts on (ECONNREFUSED) is stale.
    """
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError:
        return  # missing, stale or not a socket: ours to replace
    finally:
        probe.close()
    raise ConfigError("ztunnel_uds_address", path, "another ZDS server (agent) is serving on it")


def _bind_listener(path: str) -> tuple[socket.socket, int]:
    """Create the 0600 SEQPACKET listener at ``path`` (blocking; run off the loop).

    Returns the socket and the socket file's inode (so stop only unlinks its own file).
    """
    parent = os.path.dirname(path)
    if parent and not os.path.isdir(parent):
        os.makedirs(parent, mode=0o750, exist_ok=True)
    _refuse_if_served(path)
    try:
        os.unlink(path)  # stale socket of a previous agent; "not exist" is fine
    except FileNotFoundError:
        pass
    sock = unixsocket.bind_unix(path, 0o600, socket.SOCK_SEQPACKET)
    try:
        sock.listen(128)
        return sock, os.stat(path).st_ino
    except BaseException:
        sock.close()
        raise


class ZdsServer(Component):
    """The agent's ZDS server (component ``zds``); see the module docstring for behavior.

    ``path``: socket path; ``registry``: Prometheus registry for :class:`ZdsMetrics`;
    ``ztunnel_wait``: seconds :meth:`add` waits for a ztunnel; the other timeouts are
    seconds and default to upstream's values. ``hold_accept``: listen at start but accept
    no connection before :meth:`open_accept` (restart recovery first).
    """

    name = "zds"

    def __init__(self, path: str, registry: CollectorRegistry | None = None, *,
                 ztunnel_wait: float = 30.0, ack_timeout: float = ACK_TIMEOUT,
                 hello_timeout: float = HELLO_TIMEOUT,
                 keepalive_interval: float = KEEPALIVE_INTERVAL,
                 accept_rate: float = ACCEPT_RATE, hold_accept: bool = False):
        self.path = path
        self.metrics = ZdsMetrics(registry or CollectorRegistry())
        self.ztunnel_wait = ztunnel_wait
        self.ack_timeout = ack_timeout
        self.hello_timeout = hello_timeout
        self.keepalive_interval = keepalive_interval
        self.accept_interval = 1.0 / accept_rate if accept_rate > 0 else 0.0
        self._pods: dict[str, _PodRecord] = {}
        self._conns: list[ZdsConnection] = []  # in connect order; latest = last with hello
        self._pre_hello_limiter = RepeatLimiter(PRE_HELLO_LOG_WINDOW)
        self._next_id = 1
        self._sock: socket.socket | None = None
        self._inode: int | None = None
        self._accept_task: asyncio.Task | None = None
        # Set (and replaced) on every connection change; waiters re-check their condition.
        self._changed = asyncio.Event()
        self._stopped = False
        self._accepting: asyncio.Event | None = None  # made in start(): needs the loop
        self._hold_accept = hold_accept
        self.accept_opened_at: float | None = None  # time.monotonic() when accepts began

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Bind the socket and start accepting. Raises OSError if the path is unusable."""
        loop = asyncio.get_running_loop()
        self._sock, self._inode = await loop.run_in_executor(None, _bind_listener, self.path)
        if self._accepting is None:
            self._accepting = asyncio.Event()
        if not self._hold_accept:
            self._open()
        self._accept_task = asyncio.create_task(self._accept_loop(), name="zds-accept")
        log.info("ZDS server listening on %s%s", self.path,
                 "" if self._accepting.is_set() else
                 " (ztunnel connections accepted once restart recovery is done)")

    def open_accept(self) -> None:
        """Start accepting ztunnel connections (idempotent). Called once every pod that
        survived a restart is recorded, so the first snapshot names all of them."""
        if self._accepting is None:
            self._accepting = asyncio.Event()
        if not self._accepting.is_set():
            self._open()
            log.info("ZDS server accepting ztunnel connections (%d pods recorded)",
                     len(self._pods))

    def _open(self) -> None:
        self.accept_opened_at = time.monotonic()
        self._accepting.set()

    @property
    def accepting(self) -> bool:
        """Whether connections are being accepted (False while restart recovery runs)."""
        return self._accepting is not None and self._accepting.is_set()

    async def stop(self, grace: float = 1.0) -> None:
        """Stop accepting, close every connection and the socket, unlink the socket file
        (only if it is still ours), close every dup'd netns fd."""
        if self._stopped:
            return
        self._stopped = True
        if self._accept_task:
            self._accept_task.cancel()
            await asyncio.gather(self._accept_task, return_exceptions=True)
        tasks = [c.task for c in list(self._conns) if c.task]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            try:
                if os.stat(self.path).st_ino == self._inode:
                    os.unlink(self.path)
            except FileNotFoundError:
                pass
            except OSError as e:  # still close the pods' fds below
                log.warning("cannot remove ZDS socket %s: %s", self.path, e)
        for record in self._pods.values():
            record.close()
        self._pods.clear()
        self._notify()

    def ready(self) -> tuple[bool, str]:
        if self._sock is None:
            return False, "ZDS socket not listening"
        if not self.accepting:
            return False, "waiting for restart recovery before accepting ztunnel"
        return True, ""

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        await self._accepting.wait()  # connections made before this wait in the backlog
        next_allowed = 0.0
        while True:
            delay = next_allowed - loop.time()
            if delay > 0:  # rate limit: 5 accepts/s, burst 1
                await asyncio.sleep(delay)
            try:
                sock, _ = await loop.sock_accept(self._sock)
            except asyncio.CancelledError:
                raise
            except OSError as e:  # EMFILE and friends: back off, keep serving
                log.warning("ZDS accept failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            next_allowed = loop.time() + self.accept_interval
            sock.setblocking(False)
            conn = ZdsConnection(self, sock, self._next_id)
            self._next_id += 1
            self._conns.append(conn)
            self.metrics.connected.inc()
            conn.task = asyncio.create_task(conn.serve(), name=f"zds-conn-{conn.id}")

    # ---------------------------------------------------------------- connection bookkeeping

    def _pre_hello_log(self, reason: str) -> tuple[int, str]:
        """Level and text for a pre-hello problem: WARNING once per identical reason per
        :data:`PRE_HELLO_LOG_WINDOW`, DEBUG for the repeats in between."""
        allowed, held = self._pre_hello_limiter.check(reason, time.monotonic())
        if not allowed:
            return logging.DEBUG, reason
        if held:
            reason += f" ({held} more like this in the last {self._pre_hello_limiter.window:g}s)"
        return logging.WARNING, reason

    def _on_close(self, conn: ZdsConnection) -> None:
        if conn in self._conns:
            self._conns.remove(conn)
            self.metrics.connected.dec()
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def latest(self) -> ZdsConnection | None:
        """The newest live connection that said hello (adds go there), or None."""
        for conn in reversed(self._conns):
            if not conn.closed and conn.version is not None:
                return conn
        return None

    @property
    def connections(self) -> list[ZdsConnection]:
        """Live connections, oldest first."""
        return [c for c in self._conns if not c.closed]

    def pods(self) -> list[str]:
        """UIDs of the recorded pods (what the next snapshot will carry)."""
        return list(self._pods)

    async def wait_connected(self, count: int = 1, timeout: float | None = None,
                             snapshot_sent: bool = True) -> None:
        """Wait until ``count`` connections are live (and have been sent their snapshot).
        Raises TimeoutError."""
        async with asyncio.timeout(timeout):
            while sum(1 for c in self.connections
                      if c.snapshot_sent or not snapshot_sent) < count:
                await self._changed.wait()

    async def _wait_latest(self, deadline: float, wait: float) -> ZdsConnection:
        loop = asyncio.get_running_loop()
        while True:
            conn = self.latest()
            if conn is not None:
                return conn
            if self._stopped:
                raise ZdsError("ZDS server is stopped")
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise NoZtunnel(f"no ztunnel connected to {self.path} for {wait:.1f} s",
                                self.path, wait)
            try:
                async with asyncio.timeout(remaining):
                    await self._changed.wait()
            except TimeoutError:
                pass

    # ---------------------------------------------------------------- the enrollment API

    async def add(self, pod: PodInfo, wait_ack: bool = True,
                  ztunnel_wait: float | None = None) -> None:
        """Record ``pod`` and announce it to the newest ztunnel (``AddWorkload`` + netns fd).

        The server dups ``pod.netns_fd`` (the caller keeps its own). With ``wait_ack``
        it returns after ztunnel's ack and raises :class:`ZdsNack` (ztunnel's error
        text), :class:`ZdsTimeout` (no ack within 5 s; the connection is dropped and the
        pod goes out in the reconnect snapshot), :class:`NoZtunnel` (none connected
        within ``ztunnel_wait`` s: the argument, capped by the setting; a CNI ADD passes
        what is left of the plugin's timeout) or :class:`ZdsError` (connection lost after sending,
        or the pod was deleted/replaced before its message went out). The pod stays
        recorded in every case, so the next snapshot carries it; call :meth:`delete` to
        forget it. ``ValueError`` names a bad PodInfo field.
        """
        if not isinstance(pod, PodInfo):
            raise ValueError(f"pod must be a zds.PodInfo, got {type(pod).__name__}")
        pod.validate()
        if self._stopped:
            raise ZdsError("ZDS server is stopped")
        record = _PodRecord(pod)
        old = self._pods.pop(pod.uid, None)
        if old is not None:
            old.close()
        self._pods[pod.uid] = record
        if not wait_ack:
            conn = self.latest()
            if conn is not None:
                try:
                    conn.enqueue("add", pod.uid, record).add_done_callback(_log_background)
                except _NotSent:
                    pass  # the next snapshot carries it
            return
        wait = self.ztunnel_wait if ztunnel_wait is None else max(
            0.0, min(ztunnel_wait, self.ztunnel_wait))
        deadline = asyncio.get_running_loop().time() + wait
        while True:
            conn = await self._wait_latest(deadline, wait)
            try:
                ack = await conn.enqueue("add", pod.uid, record)
            except _NotSent:
                if self._pods.get(pod.uid) is not record:
                    raise ZdsError(f"pod {pod.uid} was deleted or replaced before "
                                   "AddWorkload was sent") from None
                continue  # that connection died before sending: use the next newest
            if ack.error:
                raise ZdsNack(ack.error, pod.uid)
            return

    async def delete(self, uid: str) -> None:
        """Forget pod ``uid``, close its dup'd fd, and send ``DelWorkload`` to every
        connection (broadcast; ack errors ignored). Returns when each connection
        acked or went away; never raises for connection problems (the next snapshot no
        longer carries the pod). Unknown uids are still broadcast (ztunnel: no-op)."""
        if not isinstance(uid, str) or not uid:
            raise ValueError(f"uid must be a non-empty string, got {uid!r}")
        record = self._pods.pop(uid, None)
        if record is not None:
            record.close()
        futures = []
        for conn in list(self._conns):
            try:
                futures.append(conn.enqueue("del", uid, None))
            except _NotSent:
                pass
        for result in await asyncio.gather(*futures, return_exceptions=True):
            if isinstance(result, Exception) and not isinstance(result, _NotSent):
                log.warning("DelWorkload %s: %s", uid, result)

    def debug_state(self) -> dict:
        latest = self.latest()
        return {
            "socket": self.path,
            "accepting": self.accepting,
            "pods": {uid: {"name": r.info.name, "namespace": r.info.namespace,
                           "service_account": r.info.service_account,
                           "netns": r.fd is not None} for uid, r in self._pods.items()},
            "connections": [dict(c.debug_state(), latest=c is latest) for c in self.connections],
        }


def _log_background(fut: asyncio.Future) -> None:
    if fut.cancelled():
        return
    exc = fut.exception()
    if exc is not None and not isinstance(exc, _NotSent):
        log.warning("background AddWorkload failed: %s", exc)
    elif exc is None and fut.result().error:
        log.warning("background AddWorkload NACKed: %s", fut.result().error)


def build(ctx: AgentContext) -> ZdsServer:
    """The ``zds`` component from ``ztunnel_uds_address`` and ``ztunnel_wait``. It holds
    accepts until the ``enrollment`` component (always built after it) has recovered
    the pods of a previous run and calls :meth:`ZdsServer.open_accept`."""
    return ZdsServer(ctx.config.ztunnel_uds_address, ctx.registry,
                     ztunnel_wait=ctx.config.ztunnel_wait, hold_accept=True)
