"""The fake ztunnel: ztunnel's side of ZDS in Python, the one stand-in shared by the
demo, the tests and the benchmarks (where the ztunnel binary is not run).

Written from ztunnel's in-pod manager (``docs/zds.md``; upstream ``istio/ztunnel``
``src/inpod/protocol.rs``, ``workloadmanager.rs``, ``statemanager.rs``, ``packet.rs``):

- connects (retry wait doubles from 20 ms up to 15 s), sends ``ZdsHello{V1}``, and on
  every (re)connect resets its snapshot bookkeeping while **keeping running proxies**;
- reads with a 1024-byte buffer and room for one fd (close-on-exec); fds are parsed
  first so they are always closed on error; ``Add`` without an fd ("No control
  message"), any other message with an fd ("Unexpected control message"), truncation
  or garbage → ``Ack{error="failure to read message : ..."}``, then reconnect;
- ``Add``: the netns identity is ``(st_ino, st_dev)`` of the fd; same identity as a
  running proxy = idempotent success; a different one replaces the proxy; a proxy that
  fails to start (e.g. its port is taken) is kept pending, NACKed
  ``"failure to start proxy : ..."`` and retried every 5 s;
- ``Keep`` after ``SnapshotSent``, a second ``SnapshotSent``, or ``Add`` without
  ``workload_info`` are protocol errors: NACKed, then treated as **fatal** (the client
  stops; :attr:`FakeZtunnel.fatal` holds the error), as ztunnel does;
- ``Del`` before the snapshot drops the uid from the snapshot set and pending; after,
  drains the proxy at once; ``SnapshotSent`` drains every proxy not named since connect.

A "proxy" here is, with ``open_listeners=True``, ztunnel's in-pod listeners opened
inside the pod's netns through the received fd (:mod:`agent.demo.pod_listeners`). Each
accepted connection (or DNS datagram) becomes an
:class:`~agent.demo.pod_listeners.Accepted` on :attr:`FakeZtunnel.accepted`, or is handed
to ``on_accept(accepted, sock)`` which then owns the socket.

The tests of ``tests/ztunnel_exact/`` use clients of their own, written independently
from the same upstream files, so the agent is never judged only against this one.

Usage: ``docs/zds.md`` ("The fake ztunnel"); :mod:`agent.demo.fake_ztunnel_thread` runs
one on a thread of its own for synchronous tests.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import os
import socket
import threading
import time
from typing import Any, Awaitable, Callable

from agent.core.backoff import Backoff
from agent.demo.pod_listeners import (PACKET_MARK, Accepted, HeldPod, close_listeners,
                                      open_pod_listeners, serve_listener)
from zds import wire

log = logging.getLogger(__name__)

PENDING_RETRY = 5.0          # seconds between retries of pending proxies
CONNECT_BACKOFF = (0.02, 15.0)  # seconds: first retry wait, cap (ztunnel's in-pod connect)


class ProtocolError(Exception):
    """A message ztunnel treats as fatal (it stops in-pod handling entirely)."""


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


AcceptCallback = Callable[[Accepted, "socket.socket | None"], "Awaitable[None] | None"]


class FakeZtunnel:
    """The fake ztunnel (ZDS, ztunnel's side).

    ``path``: the agent's ZDS socket; ``open_listeners``: open ztunnel's in-pod
    listeners for every held pod; ``on_accept``: optional callback for landed traffic
    (default: each :class:`Accepted` goes to :attr:`accepted`, TCP peers get the line
    ``"zds-client <uid> <port>\\n"`` and are closed); ``reconnect``: keep reconnecting
    after EOF (ztunnel does; False ends :meth:`run` after the first session); ``nack``:
    when set, every Add is refused with this text (a ztunnel that cannot take pods;
    assignable at any time); ``on_request(kind, payload)``: called on the session thread
    before each request is handled (tests use it to act at that exact moment).

    Each session is read, handled and acked on a dedicated blocking thread (as a
    separate ztunnel process would read), so state changes happen there; waiters and
    listener tasks live on the event loop that runs :meth:`run`.

    State: :attr:`pods` (uid -> :class:`HeldPod`, running proxies), :attr:`pending`
    (uid -> reason), :attr:`snapshot_received`, :attr:`connected`, :attr:`sessions`
    (connections made), :attr:`snapshots` (SnapshotSent handled), :attr:`received`
    (``(session, kind, uid)`` of every request, newest last), :attr:`fatal`; and what the
    agent sent: :attr:`adds` (uid -> netns inode of the last Add, None for a Keep only),
    :attr:`deleted` (uids, in order), :attr:`snapshot_uids` (the uids named before the
    latest SnapshotSent, None before the first).
    """

    def __init__(self, path: str, *, open_listeners: bool = False,
                 on_accept: AcceptCallback | None = None, reconnect: bool = True,
                 pending_retry: float = PENDING_RETRY, mark: int = PACKET_MARK,
                 nack: str = "", on_request: Callable[[str, Any], None] | None = None):
        self.path = path
        self.nack = nack
        self.on_request = on_request
        self.adds: dict[str, int | None] = {}
        self.deleted: list[str] = []
        self.snapshot_uids: set[str] | None = None
        self.open_listeners = open_listeners
        self.on_accept = on_accept
        self.reconnect = reconnect
        self.pending_retry = pending_retry
        self.mark = mark
        self.pods: dict[str, HeldPod] = {}
        self.pending: dict[str, str] = {}
        self._pending_add: dict[str, HeldPod] = {}
        self.snapshot_set: set[str] = set()
        self.snapshot_received = False
        self.connected = False
        self.sessions = 0
        self.snapshots = 0
        self.received: collections.deque = collections.deque(maxlen=100_000)
        self.fatal: ProtocolError | None = None
        self.accepted: asyncio.Queue[Accepted] = asyncio.Queue()
        self._sock: socket.socket | None = None
        self._stopping = False
        self._session: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        # Waiters as (predicate, future): predicates are checked where the state changes
        # (the session thread, too), so the loop wakes only when a waiter is satisfied.
        self._waiters: list[tuple[Callable[[], bool], asyncio.Future]] = []
        self._waiters_lock = threading.Lock()

    # ---------------------------------------------------------------- public control

    @property
    def ready(self) -> bool:
        """ztunnel's readiness: connected, snapshot received, nothing pending."""
        return self.connected and self.snapshot_received and not self.pending

    async def run(self) -> None:
        """Connect, serve, reconnect, until :meth:`stop`, a fatal protocol error, or
        (with ``reconnect=False``) the end of the first session. Drains every proxy
        (closes listeners and netns fds) before returning."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        backoff = Backoff(*CONNECT_BACKOFF)
        try:
            while not self._stopping and self.fatal is None:
                try:
                    sock = await self._connect()
                except OSError as e:
                    wait = backoff.next()
                    log.debug("connect %s failed (%s); retry in %.2fs", self.path, e, wait)
                    await self._sleep(wait)
                    continue
                backoff.reset()
                self._session = asyncio.create_task(self._serve(sock))
                try:
                    await self._session
                except asyncio.CancelledError:
                    if not self._stopping:
                        raise
                if not self.reconnect:
                    break
        finally:
            for uid in list(self.pods):
                self._drain(uid)
            for uid in list(self._pending_add):
                self._drop_pending(uid)
            self.connected = False
            self._notify()

    def stop(self) -> None:
        """Ask :meth:`run` to finish (it drains proxies and returns). Idempotent."""
        self._stopping = True
        if self._session is not None:
            self._session.cancel()
        self._notify()

    async def wait_snapshot(self, timeout: float | None = None, count: int = 1) -> None:
        """Wait until ``count`` snapshots were received in total; TimeoutError otherwise."""
        await self._wait(lambda: self.snapshots >= count, timeout)

    async def wait_for_pod(self, uid: str, timeout: float | None = None) -> HeldPod:
        """Wait until a proxy for ``uid`` runs; returns it. TimeoutError otherwise."""
        await self._wait(lambda: uid in self.pods, timeout)
        return self.pods[uid]

    async def _wait(self, predicate: Callable[[], bool], timeout: float | None,
                    fatal_raises: bool = True) -> None:
        async with asyncio.timeout(timeout):
            while True:
                if fatal_raises and self.fatal is not None:
                    raise self.fatal
                if predicate():
                    return
                fut = asyncio.get_running_loop().create_future()
                entry = (predicate if not fatal_raises
                         else lambda: predicate() or self.fatal is not None, fut)
                with self._waiters_lock:
                    self._waiters.append(entry)
                try:
                    if not entry[0]():  # re-check: a change may have raced the append
                        await fut
                finally:
                    with self._waiters_lock:
                        if entry in self._waiters:
                            self._waiters.remove(entry)

    def _notify(self) -> None:
        """Wake the waiters whose predicate now holds. Safe on any thread."""
        if not self._waiters:
            return
        with self._waiters_lock:
            ready = [w for w in self._waiters if w[0]()]
            for w in ready:
                self._waiters.remove(w)
        for _, fut in ready:
            self._on_loop(_wake, fut)

    def _on_loop(self, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` on the client's event loop: now if this is its thread."""
        if self._loop is None or threading.get_ident() == self._loop_thread:
            fn(*args)
        else:
            try:
                self._loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop is closed: nothing is waiting any more
                pass

    async def _sleep(self, seconds: float) -> None:
        try:
            await self._wait(lambda: self._stopping, seconds, fatal_raises=False)
        except TimeoutError:
            pass

    # ---------------------------------------------------------------- one session

    async def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK
                             | socket.SOCK_CLOEXEC)
        try:
            await asyncio.get_running_loop().sock_connect(sock, self.path)
        except BaseException:
            sock.close()
            raise
        return sock

    async def _serve(self, sock: socket.socket) -> None:
        """One connection: hello, then a dedicated thread runs the blocking read loop
        (:meth:`_read_loop`), as a separate ztunnel process would, so no message pays
        for event-loop scheduling on this side. Cancelling shuts the socket down, which
        ends the thread's blocking read with EOF."""
        self._sock = sock
        self.sessions += 1
        session = self.sessions
        # reset_snapshot(): forget snapshot bookkeeping, keep running proxies.
        self.snapshot_set.clear()
        self.snapshot_received = False
        for uid in list(self._pending_add):
            self._drop_pending(uid)
        loop = asyncio.get_running_loop()
        finished = loop.create_future()
        try:
            wire.send_packet(sock, wire.encode_hello())
            self.connected = True
            self._notify()
            sock.setblocking(True)
            thread = threading.Thread(target=self._read_loop,
                                      args=(sock, session, loop, finished),
                                      name=f"zds-client-{session}", daemon=True)
            thread.start()
            try:
                await asyncio.shield(finished)
            except asyncio.CancelledError:
                _shutdown(sock)
                await finished
                await asyncio.to_thread(thread.join)
                raise
            await asyncio.to_thread(thread.join)  # it only has to return now
        except OSError as e:
            log.info("ZDS connection failed: %s", e)
        finally:
            self.connected = False
            self._sock = None
            sock.close()
            self._notify()

    def _read_loop(self, sock: socket.socket, session: int, loop, finished) -> None:
        """The session thread: read, handle and ack each request in order (blocking)."""
        try:
            self._read_requests(sock, session)
        except OSError as e:
            log.info("ZDS connection failed: %s", e)
        except Exception:  # noqa: BLE001 - a bug in one session must not end run(); reconnect
            log.exception("ZDS session failed")
        finally:
            try:
                loop.call_soon_threadsafe(_wake, finished)
            except RuntimeError:
                pass

    def _read_requests(self, sock: socket.socket, session: int) -> None:
        timeout: float | None = None
        next_retry: float | None = None  # set when the first proxy goes pending
        while not self._stopping:
            # Pending proxies are retried every pending_retry s (ztunnel's 5 s ticker);
            # the socket timeout only changes when that need changes (fcntl per change).
            want = None
            if self._pending_add:
                if next_retry is None:
                    next_retry = time.monotonic() + self.pending_retry
                want = next_retry - time.monotonic()
                if want <= 0:
                    self._retry_pending()
                    next_retry = time.monotonic() + self.pending_retry
                    continue
            else:
                next_retry = None
            if want != timeout:
                timeout = want
                sock.settimeout(timeout)
            try:
                packet = wire.recv_packet(sock, max_fds=1)
            except TimeoutError:
                continue
            except wire.WireError as e:
                self._ack(sock, f"failure to read message : {e}")
                return
            if packet is None:
                log.info("ZDS server closed the connection")
                return
            try:
                request, kind = self._parse(packet)
            except wire.WireError as e:
                self._ack(sock, f"failure to read message : {e}")
                return
            body = getattr(request, kind)
            self.received.append((session, kind, body.uid if kind != "snapshot_sent" else ""))
            self._record(kind, body, packet.fds)
            if self.on_request is not None:
                self.on_request(kind, body)
            try:
                error = self._handle(kind, body, packet.fds)
            except ProtocolError as e:
                self._ack(sock, str(e))
                self.fatal = e
                log.error("fatal ZDS protocol error: %s", e)
                self._notify()
                return
            self._ack(sock, error)
            self._notify()

    def _ack(self, sock: socket.socket, error: str) -> None:
        try:
            sock.send(wire.encode_ack(error))
        except OSError:
            pass  # the read side reports the broken connection

    def _parse(self, packet: wire.Packet):
        """``(request, payload kind)``; raises WireError. fds were already taken out of
        the packet, so every error path closes them."""
        try:
            request = wire.decode_request(packet.data)
            kind = request.WhichOneof("payload")
            if kind == "add" and not packet.fds:
                raise wire.WireError("No control message")
            if kind != "add" and packet.fds:
                raise wire.WireError("Unexpected control message")
            return request, kind
        except wire.WireError:
            packet.close_fds()
            raise

    def _record(self, kind: str, body: Any, fds: list[int]) -> None:
        if kind == "add" and not self.nack:
            self.adds[body.uid] = os.fstat(fds[0]).st_ino
        elif kind == "keep":
            self.adds.setdefault(body.uid, None)
        elif kind == "del":
            self.deleted.append(body.uid)

    def _handle(self, kind: str, body, fds: list[int]) -> str:
        """Handle one request (``body`` is its payload message); returns the ack's error
        text ("" = success). Raises ProtocolError for ztunnel's fatal errors."""
        if kind == "add":
            if self.nack:
                os.close(fds[0])
                return self.nack
            return self._on_add(body, fds[0])
        if kind == "keep":
            if self.snapshot_received:
                raise ProtocolError(f"KeepWorkload {body.uid} after SnapshotSent")
            self.snapshot_set.add(body.uid)
            return ""
        if kind == "del":
            uid = body.uid
            self._drop_pending(uid)
            if not self.snapshot_received:
                self.snapshot_set.discard(uid)  # a running proxy is drained at reconcile
            else:
                self._drain(uid)
            return ""
        # snapshot_sent
        if self.snapshot_received:
            raise ProtocolError("second SnapshotSent on one connection")
        for uid in list(self.pods):
            if uid not in self.snapshot_set:
                self._drain(uid)
        self.snapshot_received = True
        self.snapshot_uids = set(self.snapshot_set)
        self.snapshots += 1
        return ""

    def _on_add(self, add, fd: int) -> str:
        if not add.HasField("workload_info"):
            os.close(fd)
            raise ProtocolError(f"AddWorkload {add.uid} without workload_info")
        uid = add.uid
        if not self.snapshot_received:
            self.snapshot_set.add(uid)
        identity = None
        running = self.pods.get(uid)
        if running is not None:  # the identity decides: same netns or a re-created sandbox
            st = os.fstat(fd)
            identity = (st.st_ino, st.st_dev)
            if running.identity == identity:
                os.close(fd)
                return ""
            self._drain(uid)  # sandbox re-created: new netns replaces the proxy
        if self._pending_add:
            self._drop_pending(uid)
        info = add.workload_info
        pod = HeldPod(uid, info.name, info.namespace, info.service_account, fd,
                      _identity=identity)
        try:
            self._start_proxy(pod)
        except Exception as e:  # noqa: BLE001 - any start failure is a NACK, as in ztunnel
            self._pending_add[uid] = pod
            self.pending[uid] = str(e)
            return f"failure to start proxy : {e}"
        return ""

    # ---------------------------------------------------------------- proxies

    def _start_proxy(self, pod: HeldPod) -> None:
        """Start a proxy (blocking: listeners are opened in the pod's netns). Raises
        OSError (e.g. EADDRINUSE) with nothing left open."""
        if self.open_listeners:
            pod.listeners = open_pod_listeners(pod.netns_fd, self.mark)
            self._on_loop(self._serve_listeners, pod)
        self.pods[pod.uid] = pod

    def _serve_listeners(self, pod: HeldPod) -> None:
        if pod.listeners and not pod.tasks:
            pod.tasks = [asyncio.create_task(serve_listener(pod.uid, sock, self._deliver))
                         for sock in pod.listeners]

    def _drain(self, uid: str) -> None:
        """Immediate drain (the pod is gone): close the netns fd, and the listeners on
        the event loop (which owns their accept tasks)."""
        pod = self.pods.pop(uid, None)
        if pod is None:
            return
        os.close(pod.netns_fd)
        if pod.listeners:
            self._on_loop(close_listeners, pod)
        self._notify()

    def _drop_pending(self, uid: str) -> None:
        pod = self._pending_add.pop(uid, None)
        self.pending.pop(uid, None)
        if pod is not None:
            os.close(pod.netns_fd)

    def _retry_pending(self) -> None:
        """Try to start each pending proxy again (ztunnel retries every 5 s)."""
        for uid, pod in list(self._pending_add.items()):
            try:
                self._start_proxy(pod)
            except Exception as e:  # noqa: BLE001
                self.pending[uid] = str(e)
                continue
            del self._pending_add[uid]
            self.pending.pop(uid, None)
        self._notify()

    async def _deliver(self, accepted: Accepted, conn: socket.socket | None) -> None:
        if self.on_accept is not None:
            try:
                result = self.on_accept(accepted, conn)
                if inspect.isawaitable(result):
                    await result
            except Exception:  # noqa: BLE001 - a bad callback must not kill the listener
                log.exception("on_accept callback failed")
            return
        self.accepted.put_nowait(accepted)
        if conn is not None:
            try:
                conn.setblocking(False)
                await asyncio.get_running_loop().sock_sendall(
                    conn, f"zds-client {accepted.uid} {accepted.port}\n".encode())
            except OSError:
                pass
            finally:
                conn.close()
