"""The socket driver of one ztunnel ZDS connection: moves packets between the socket
and its :class:`~zds.session.ZdsSession`, and turns the session's events into metrics,
log lines and the API's answers.

- Hello: read on the event loop until the session's hello deadline.
- Snapshot: sent by a thread of its own with blocking socket calls, the kernel's
  ``SO_SNDTIMEO``/``SO_RCVTIMEO`` bounding each write and ack wait. 1,000 pods are
  1,001 round trips; on the event loop each would also pay an epoll wake-up and a loop
  iteration. The thread owns the session from its start until its result is back on
  the loop (:mod:`zds.session`, "Ownership"): live updates submitted meanwhile wait in
  the connection and go to the session after the hand-back; a stop sets a flag and
  shuts the socket down, which ends the thread's blocking read, and the thread closes
  the session itself. The thread holds :data:`zds.pods.FD_LOCK` from looking a pod up
  to ``sendmsg`` having taken its fd (sent with ``MSG_DONTWAIT``; a full buffer is
  waited out without the lock), so the loop can't close that fd under the send. The
  loop stays free. Metrics of the snapshot are added on the loop once it is done.
- Live: one reader stays registered for the connection's life (EOF is seen at once,
  no ``epoll_ctl`` per message); an update is written in the same loop step it is
  submitted when nothing is in flight; one timer follows the session's deadline,
  re-armed only when it fires.

One send path (:func:`_try_send`) and one mapping of I/O failures to session inputs
(:meth:`ZdsConnection._io_failed`) serve both the thread and the loop.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import select
import socket
import struct
import threading
import time
from typing import Callable

from zds import wire
from zds.api import ZdsError, ZdsTimeout
from zds.metrics import ZdsMetrics
from zds.pods import FD_LOCK, Message
from zds.session import (Acked, Closed, Event, HelloReceived, NotSent, SnapshotDone, State,
                         Update, Withdrawn, ZdsSession)

log = logging.getLogger(__name__)

_TIMEVAL = struct.Struct("ll")
_RESET = (errno.ECONNRESET, errno.EPIPE)
_CLEAN = ("ztunnel closed the connection", "server stopping")


def _set_io_timeouts(sock: socket.socket, seconds: float) -> None:
    """Kernel send/receive timeouts (SO_SNDTIMEO/SO_RCVTIMEO) for blocking calls: the
    call fails with EAGAIN after ``seconds``, without the poll() Python adds before
    every call on a socket with a Python-level timeout. 0 turns them off."""
    whole = int(seconds)
    tv = _TIMEVAL.pack(whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _poll_writable(sock: socket.socket, seconds: float) -> bool:
    if seconds <= 0:
        return False
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLOUT)
    return bool(poller.poll(seconds * 1000))


def _try_send(sock: socket.socket, message: Message, flags: int = 0) -> bool:
    """Write ``message`` (its packet and netns fd) now: True when written, False when the
    socket buffer is full. Raises OSError (EPIPE, ...)."""
    try:
        sock.sendmsg([message.data], message.rights, flags)
        return True
    except (BlockingIOError, InterruptedError):
        return False


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class ZdsConnection:
    """Drives ``session`` over ``sock`` (accepted, non-blocking). ``conn_id`` names it in
    logs; ``peer_pid`` is the peer's pid (SO_PEERCRED) or None. The server passes
    ``on_change`` (called when the connection said hello, got its snapshot, or closed),
    ``on_close`` (called once, with this connection) and ``pre_hello_log`` (level and
    text for a pre-hello problem: the server rate-limits those warnings).
    """

    def __init__(self, sock: socket.socket, conn_id: int, session: ZdsSession,
                 metrics: ZdsMetrics, *, peer_pid: int | None,
                 on_change: Callable[[], None],
                 on_close: Callable[["ZdsConnection"], None],
                 pre_hello_log: Callable[[str], tuple[int, str]]):
        self.sock, self.id, self.session, self.metrics = sock, conn_id, session, metrics
        self.peer_pid = peer_pid
        self.connected_at = time.time()
        self.task: asyncio.Task | None = None
        self._on_change, self._on_close, self._pre_hello_log = on_change, on_close, pre_hello_log
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Future[Closed] | None = None
        self._reading = False
        self._timer: asyncio.TimerHandle | None = None
        self._blocked: Message | None = None  # waiting for room in the socket buffer
        self._blocked_timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._stopping: Closed | None = None  # the Closed of a stop during the snapshot
        # True while the snapshot thread owns the session: submits wait in _held, a stop
        # sets _stop_asked (read by the thread) instead of touching the session
        self._thread_owns = False
        self._held: list[Update] = []
        self._stop_asked = False
        self._finished = False
        self._m_sent = {k: metrics.messages.labels(k, "sent")
                        for k in ("add", "keep", "del", "snapshot_sent")}
        self._m_acks = metrics.messages.labels("ack", "received")
        self._m_ok, self._m_nack = metrics.acks.labels("ok"), metrics.acks.labels("nack")
        self._m_latency = metrics.ack_latency

    # ---------------------------------------------------------------- state, for the server

    @property
    def closed(self) -> bool:
        """Torn down (socket closed, waiters failed, the server told). The session may
        be CLOSED a moment earlier: the snapshot thread closes it, the loop tears down."""
        return self._finished

    @property
    def version(self) -> int | None:
        return self.session.version

    @property
    def snapshot_sent(self) -> bool:
        """The snapshot went out (acked) and the connection is still open."""
        return self.session.state is State.LIVE

    @property
    def held(self) -> dict[str, str]:
        """uid -> ``"add"``/``"keep"``: what ztunnel acked on this connection."""
        return self.session.held

    @property
    def last_keepalive(self) -> float | None:
        """Wall-clock time of the last keepalive check, or None."""
        at = self.session.last_keepalive
        return None if at is None else time.time() - (time.perf_counter() - at)

    def debug_state(self) -> dict:
        return {"id": self.id, "peer_pid": self.peer_pid, "version": self.version,
                "connected_at": self.connected_at, "snapshot_sent": self.snapshot_sent,
                "queued": len(self._held) if self._thread_owns else self.session.queued,
                "last_keepalive": self.last_keepalive,
                "holds": dict(sorted(dict(self.held).items()))}

    # ---------------------------------------------------------------- the API side

    def submit(self, update: Update) -> asyncio.Future[str]:
        """Queue ``update``; the future gets ztunnel's ack error text (``""`` = ok) or
        raises ZdsError/ZdsTimeout (after sending) or :class:`NotSent` (never sent).

        Raises :class:`NotSent` at once when the connection is closed.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[str] = loop.create_future()
        update.waiter = fut

        def gave_up(f: asyncio.Future[str]) -> None:
            if f.cancelled():
                update.abandoned = True  # not sent if still queued

        fut.add_done_callback(gave_up)
        if self._finished:
            raise NotSent(f"connection {self.id} is closed")
        if self._thread_owns:  # the snapshot thread has the session: handed over after
            self._held.append(update)
            return fut
        self.session.submit(update)
        if self._reading:
            self._pump()
        return fut

    # ---------------------------------------------------------------- the connection's task

    async def serve(self) -> None:
        """Run the connection to its end (never raises; cancelling closes it)."""
        self._loop = asyncio.get_running_loop()
        self._done = self._loop.create_future()
        closed: Closed | None = None
        try:
            closed = await self._read_hello()
            if closed is None:
                self._on_change()  # a new connection for adds: waiting adds may queue
                closed = await self._send_snapshot()
            if closed is None:
                self._start_live()
                closed = await self._done
        except asyncio.CancelledError:
            closed = self.session.close("server stopping") or self._stopping or closed
        except Exception as e:  # noqa: BLE001 - one bad peer never takes the server down
            log.exception("zds connection %d failed", self.id)
            closed = self.session.close(f"internal error: {e!r}", logging.WARNING) or closed
        finally:
            self._finish(closed)

    async def _read_hello(self) -> Closed | None:
        session, sock, clock = self.session, self.sock, time.perf_counter
        while True:
            try:
                packet = wire.recv_packet(sock, max_fds=0)
            except (BlockingIOError, InterruptedError):
                left = (session.deadline() or 0.0) - clock()
                if left <= 0 or not await wire.wait_ready(sock, left):
                    closed = session.timeout(clock())
                    if closed is not None or session.state is State.CLOSED:
                        return closed
                continue
            except (wire.WireError, OSError) as e:
                return self._io_failed(e)
            if packet is None:
                return self._io_failed(None)
            event = session.receive(packet.data, clock())
            if isinstance(event, HelloReceived):
                self.metrics.messages.labels("hello", "received").inc()
                log.info("ztunnel connected (connection %d, pid %s, ZDS version %d)", self.id,
                         self.peer_pid, event.version)
                return None
            return event if isinstance(event, Closed) else session.close("hello not taken")

    # ---------------------------------------------------------------- the snapshot thread

    async def _send_snapshot(self) -> Closed | None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Event | BaseException | None] = loop.create_future()

        def finish(outcome: Event | BaseException | None) -> None:
            if not done.done():
                done.set_result(outcome)

        def worker() -> None:
            outcome: Event | BaseException | None
            try:
                outcome = self._snapshot_blocking()
            except BaseException as e:  # noqa: BLE001 - handed to the loop, raised there
                outcome = e
            try:
                loop.call_soon_threadsafe(finish, outcome)
            except RuntimeError:  # loop closed: nobody waits any more
                pass

        self.sock.setblocking(True)
        _set_io_timeouts(self.sock, self.session.ack_timeout)
        thread = threading.Thread(target=worker, name=f"zds-snapshot-{self.id}", daemon=True)
        self._thread_owns = True  # the hand-over: from here the thread alone drives it
        thread.start()
        try:
            outcome = await asyncio.shield(done)
        except asyncio.CancelledError:
            self._stop_asked = True  # the thread closes the session ("server stopping")
            _shutdown(self.sock)
            outcome = await done
            self._take_back()
            self._stopping = outcome if isinstance(outcome, Closed) else None
            raise
        self._take_back()
        if self.session.state is not State.CLOSED:
            try:
                _set_io_timeouts(self.sock, 0)
                self.sock.setblocking(False)
            except OSError:
                pass
        if isinstance(outcome, BaseException):
            raise outcome
        if isinstance(outcome, SnapshotDone):
            self._snapshot_done(outcome)
            return None
        if isinstance(outcome, Closed):
            return outcome
        return self.session.close("snapshot ended")

    def _take_back(self) -> None:
        """The thread is done (its result is on the loop): the loop owns the session
        again and gives it the updates submitted meanwhile, in order."""
        self._thread_owns = False
        held, self._held = self._held, []
        for update in held:
            try:
                self.session.submit(update)
            except NotSent as e:  # closed during the snapshot: the caller goes elsewhere
                self._fail(update, NotSent(f"connection {self.id} closed: {e}"))

    def _snapshot_blocking(self) -> Event | None:
        """The snapshot thread, owner of the session until it returns: send, read the
        ack, feed the session, until it says :class:`SnapshotDone` or :class:`Closed`
        (a stop asked by the loop is a Closed "server stopping" made here)."""
        session, sock, lock, clock = self.session, self.sock, FD_LOCK, time.perf_counter
        recvmsg = sock.recvmsg
        dontwait, cloexec = socket.MSG_DONTWAIT, wire.MSG_CMSG_CLOEXEC
        size, cmsg_size = wire.MAX_MESSAGE, wire.FD_CMSG_SPACE
        timeout = session.ack_timeout
        t0 = clock()
        while True:
            if self._stop_asked:
                return session.close("server stopping")
            while True:
                with lock:  # the fd stays open (and ours) until sendmsg has taken it
                    message = session.next_request()
                    if not isinstance(message, Message):  # never in SNAPSHOT: a bug
                        return session.close("snapshot ended")
                    try:
                        if _try_send(sock, message, dontwait):
                            break
                    except OSError as e:
                        return self._io_failed(e, message)
                # buffer full: wait for room, not holding the lock
                if not _poll_writable(sock, t0 + timeout - clock()):
                    return self._io_failed(None, message)
            session.sent(message, t0)
            while True:
                try:
                    data, anc, flags, _ = recvmsg(size, cmsg_size, cloexec)
                except BlockingIOError:  # SO_RCVTIMEO passed
                    closed = session.timeout(clock())
                    if closed is not None or session.state is State.CLOSED:
                        return closed
                    continue
                except OSError as e:
                    return self._io_failed(e)
                break
            if anc or flags or not data:
                try:
                    if wire.check_received(data, anc, flags, max_fds=0) is None:
                        return self._io_failed(None)  # EOF
                except wire.WireError as e:
                    return self._io_failed(e)
            t0 = clock()  # the ack's time, and the next send's
            event = session.receive(data, t0)
            if event is None:
                continue
            if isinstance(event, Acked):  # upstream only logs NACKs during the snapshot
                log.warning("ztunnel NACKed %s in snapshot (connection %d): %s",
                            f"pod {message.uid}" if message.uid else "SnapshotSent",
                            self.id, event.error)
                continue
            return event

    def _snapshot_done(self, done: SnapshotDone) -> None:
        """Back on the loop: wake waiters, then the metrics (bookkeeping, not on ztunnel's
        path)."""
        self._on_change()
        log.info("snapshot of %d pods sent to connection %d", done.held, self.id)
        for kind, n in done.sent.items():
            if n:
                self._m_sent[kind].inc(n)
        self._m_acks.inc(done.acks)
        if done.nacks:
            self._m_nack.inc(done.nacks)
        if done.acks - done.nacks:
            self._m_ok.inc(done.acks - done.nacks)
        observe = self._m_latency.observe
        for seconds in done.latencies:
            observe(seconds)

    # ---------------------------------------------------------------- live updates

    def _start_live(self) -> None:
        assert self._loop is not None
        self._loop.add_reader(self.sock.fileno(), self._on_readable)
        self._reading = True
        self._arm_timer()
        self._pump()

    def _arm_timer(self) -> None:
        """Have :meth:`_on_timer` run at the session's deadline. A timer already armed
        for no later than that is kept (it re-arms when it fires early)."""
        at = self.session.deadline()
        if at is None or self._loop is None:
            return
        if self._timer is not None:
            if self._timer_at <= at + 0.001:
                return
            self._timer.cancel()
        self._timer_at = at
        self._timer = self._loop.call_later(max(0.0, at - time.perf_counter()), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self._handle(self.session.timeout(time.perf_counter())):
            self._arm_timer()

    def _on_readable(self) -> None:
        """Every queued packet (or EOF/error) goes to the session."""
        session, clock = self.session, time.perf_counter
        while self._reading:
            try:
                packet = wire.recv_packet(self.sock, max_fds=0)
            except (BlockingIOError, InterruptedError):
                break
            except (wire.WireError, OSError) as e:
                self._handle(self._io_failed(e))
                return
            if packet is None:
                self._handle(self._io_failed(None))
                return
            event = session.receive(packet.data, clock())
            if isinstance(event, Closed) and event.unexpected:
                self.metrics.messages.labels("unexpected", "received").inc()
            if not self._handle(event):
                return
        self._pump()

    def _pump(self) -> None:
        """Send the next request if nothing is in flight and the socket takes it."""
        session = self.session
        while self._reading and self._blocked is None:
            item = session.next_request()
            if item is None:
                return
            if isinstance(item, Withdrawn):
                self._fail(item.update, ZdsError(item.reason))
                continue
            try:
                if not _try_send(self.sock, item):
                    self._wait_writable(item)
                    return
            except OSError as e:
                self._handle(self._io_failed(e, item))
                return
            session.sent(item, time.perf_counter())
            self._m_sent[item.kind].inc()
            self._arm_timer()
            return

    def _wait_writable(self, message: Message) -> None:
        assert self._loop is not None
        self._blocked = message
        self._loop.add_writer(self.sock.fileno(), self._on_writable)
        self._blocked_timer = self._loop.call_later(self.session.ack_timeout,
                                                    self._on_write_timeout)

    def _unblock(self) -> None:
        if self._blocked is not None and self._loop is not None:
            self._blocked = None
            self._loop.remove_writer(self.sock.fileno())
        if self._blocked_timer is not None:
            self._blocked_timer.cancel()
            self._blocked_timer = None

    def _on_writable(self) -> None:
        self._unblock()
        self._pump()

    def _on_write_timeout(self) -> None:
        self._blocked_timer = None
        message = self._blocked
        self._unblock()
        if message is not None:
            self._handle(self._io_failed(None, message))

    def _io_failed(self, error: OSError | wire.WireError | None,
                   message: Message | None = None) -> Closed | None:
        """The one mapping of an I/O outcome to the session's input, for the thread and
        the loop alike: with ``message``, writing it failed (``error``) or the socket
        stayed full (``error`` None); without, reading failed (a framing
        :class:`~zds.wire.WireError`, or a socket error; ECONNRESET/EPIPE is a reset) or
        hit EOF (``error`` None). After a stop was asked, any of them is that stop."""
        session = self.session
        if self._stop_asked:
            return session.close("server stopping")
        if message is not None and error is None:
            return session.not_writable(message)
        if error is None:
            return session.receive_eof()
        if isinstance(error, wire.WireError):
            return session.receive_failed(str(error))
        if message is not None:
            return session.send_failed(message, error.strerror or str(error))
        return session.receive_failed(str(error), reset=error.errno in _RESET)

    def _handle(self, event: Event | None) -> bool:
        """Apply a live event; False once the connection is closed."""
        if event is None:
            return not self.closed
        if isinstance(event, Acked):
            self._m_latency.observe(event.latency)
            self._m_acks.inc()
            (self._m_nack if event.error else self._m_ok).inc()
            if event.update is not None:
                self._resolve(event.update, event.error)
            return True
        if isinstance(event, Withdrawn):
            self._fail(event.update, ZdsError(event.reason))
            return True
        if isinstance(event, Closed):
            self._stop_reading()
            if self._done is not None and not self._done.done():
                self._done.set_result(event)
            return False
        return True

    @staticmethod
    def _resolve(update: Update, error: str) -> None:
        fut = update.waiter
        if isinstance(fut, asyncio.Future) and not fut.done():
            fut.set_result(error)

    @staticmethod
    def _fail(update: Update, exc: BaseException) -> None:
        fut = update.waiter
        if isinstance(fut, asyncio.Future) and not fut.done():
            fut.set_exception(exc)

    # ---------------------------------------------------------------- the end

    def _stop_reading(self) -> None:
        if self._reading and self._loop is not None:
            self._reading = False
            self._loop.remove_reader(self.sock.fileno())

    def _finish(self, closed: Closed | None) -> None:
        """Tear down once: reader, timers, socket; fail whoever still waits; log."""
        if self._loop is None or self._finished:
            return
        self._finished = True
        self._stop_reading()
        self._unblock()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if closed is None:  # should not happen; never leave waiters hanging
            closed = self.session.close("stopped") or Closed("stopped", logging.INFO)
        reason, level = closed.reason, closed.level
        if closed.pre_hello and level >= logging.WARNING:
            level, reason = self._pre_hello_log(reason)
        elif reason in _CLEAN:
            level = logging.INFO
        log.log(level, "%s connection %d closed: %s",
                "ztunnel" if closed.said_hello else "ZDS", self.id, reason)
        try:
            self.sock.close()
        except OSError:
            pass
        if closed.in_flight is not None:
            self._fail(closed.in_flight, ZdsTimeout(reason) if closed.timeout
                       else ZdsError(f"ztunnel connection {self.id}: {reason}"))
        # Wake every requester still waiting on this connection (upstream's "close done
        # first" deadlock fix): they retry elsewhere or report the error.
        for update in closed.queued:
            self._fail(update, NotSent(f"connection {self.id} closed: {reason}"))
        self._on_close(self)
