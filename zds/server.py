"""The ZDS server (agent side, component ``zds``): hands each enrolled pod's netns to
ztunnel.

Implements ``docs/zds.md`` (Istio's ``cni/pkg/nodeagent/ztunnelserver*.go``). Three
layers, top to bottom:

- this module: the SOCK_SEQPACKET Unix socket at ``ztunnel_uds_address`` (a stale file
  is unlinked; created 0600: bound under a temporary name, chmod'ed, then renamed into
  place so it is never reachable with looser permissions), accepts rate-limited to 5/s
  with burst 1 (a reconnect loop must not exhaust the agent), the recorded pods
  (:class:`zds.pods.PodTable`), and the API: :meth:`ZdsServer.add` (to the newest
  connection that said hello), :meth:`ZdsServer.delete` (to all),
  :meth:`ZdsServer.debug_state`;
- :mod:`zds.connection`: one connection's socket I/O (the snapshot on a thread with
  blocking I/O, live updates on the loop);
- :mod:`zds.session`: the protocol state machine of one connection (HELLO -> SNAPSHOT
  -> LIVE -> CLOSED), no I/O, unit-tested without sockets.

``add(pod, wait_ack=False)`` records the pod and, if a ztunnel is connected, also sends
it without waiting (upstream's restart path only caches it).

Restart (upstream ``Server.Start``: ``ConstructInitialSnapshot`` before the ztunnel
server's ``Run``): built with ``hold_accept=True`` (the daemon does), the socket is bound
and listening at :meth:`ZdsServer.start` but nothing is accepted until
:meth:`ZdsServer.open_accept` (the enrollment component calls it once restart recovery
has recorded every live enrolled pod). A ztunnel that connects earlier waits in the
listen backlog with its hello queued, so the first snapshot it gets is complete:
ztunnel shuts every proxy not named before ``SnapshotSent``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

from prometheus_client import CollectorRegistry

from agent.core import unixsocket
from agent.core.lifecycle import AgentContext, Component
from agent.core.peercred import peer_cred
from agent.core.ratelimit import RepeatLimiter
from zds.api import NoZtunnel, PodInfo, ZdsError, ZdsNack, ZdsTimeout
from zds.connection import ZdsConnection
from zds.metrics import ZdsMetrics
from zds.pods import PodRecord, PodTable
from zds.served import refuse_if_served
from zds.session import (ACK_TIMEOUT, HELLO_TIMEOUT, KEEPALIVE_INTERVAL, NotSent,
                         SessionSet, Update, ZdsSession)

log = logging.getLogger(__name__)

ACCEPT_RATE = 5.0          # accepts per second, burst 1
PRE_HELLO_LOG_WINDOW = 60.0  # seconds: identical pre-hello warnings logged once per window

__all__ = ["ZdsServer", "build", "ZdsTimeout", "ACK_TIMEOUT", "HELLO_TIMEOUT",
           "KEEPALIVE_INTERVAL"]


def _peer_pid(sock: socket.socket) -> int | None:
    try:
        return peer_cred(sock)[0]
    except OSError:
        return None


def _bind_listener(path: str) -> tuple[socket.socket, int]:
    """Create the 0600 SEQPACKET listener at ``path`` (blocking; run off the loop).

    Returns the socket and the socket file's inode (so stop only unlinks its own file).
    """
    parent = os.path.dirname(path)
    if parent and not os.path.isdir(parent):
        os.makedirs(parent, mode=0o750, exist_ok=True)
    refuse_if_served(path)
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
        self._pods = PodTable()
        self._conns: SessionSet[ZdsConnection] = SessionSet()
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
        assert self._accepting is not None
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
        tasks = [c.task for c in self._conns.handles() if c.task]
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
        listener, accepting = self._sock, self._accepting
        assert listener is not None and accepting is not None, "start() first"
        await accepting.wait()  # connections made before this wait in the backlog
        next_allowed = 0.0
        while True:
            delay = next_allowed - loop.time()
            if delay > 0:  # rate limit: 5 accepts/s, burst 1
                await asyncio.sleep(delay)
            try:
                sock, _ = await loop.sock_accept(listener)
            except asyncio.CancelledError:
                raise
            except OSError as e:  # EMFILE and friends: back off, keep serving
                log.warning("ZDS accept failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            next_allowed = loop.time() + self.accept_interval
            sock.setblocking(False)
            session = ZdsSession(self._pods, time.perf_counter(),
                                 hello_timeout=self.hello_timeout, ack_timeout=self.ack_timeout,
                                 keepalive_interval=self.keepalive_interval)
            conn = ZdsConnection(sock, self._next_id, session, self.metrics,
                                 peer_pid=_peer_pid(sock), on_change=self._notify,
                                 on_close=self._on_close, pre_hello_log=self._pre_hello_log)
            self._next_id += 1
            self._conns.add(session, conn)
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
        if self._conns.remove(conn):
            self.metrics.connected.dec()
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def latest(self) -> ZdsConnection | None:
        """The newest open connection that said hello (adds go there), or None."""
        return self._conns.for_add()

    @property
    def connections(self) -> list[ZdsConnection]:
        """Open connections, oldest first."""
        return [c for c in self._conns.handles() if not c.closed]

    def pods(self) -> list[str]:
        """UIDs of the recorded pods (what the next snapshot will carry)."""
        return self._pods.uids()

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
        forget it. ``ValueError`` names a bad PodInfo field; its subclass
        :class:`~zds.api.MessageTooLarge` says the pod's request would exceed ztunnel's
        1024-byte receive buffer (the pod is then neither recorded nor sent: one such
        message would make ztunnel fail and reconnect, for every pod on the node).
        """
        if not isinstance(pod, PodInfo):
            raise ValueError(f"pod must be a zds.PodInfo, got {type(pod).__name__}")
        pod.validate()
        if self._stopped:
            raise ZdsError("ZDS server is stopped")
        record = PodRecord(pod)
        self._pods.put(record)
        if not wait_ack:
            conn = self.latest()
            if conn is not None and record.kind == "add":
                try:
                    conn.submit(Update("add", pod.uid, record)).add_done_callback(
                        _log_background)
                except NotSent:
                    pass  # the next snapshot carries it
            return
        wait = self.ztunnel_wait if ztunnel_wait is None else max(
            0.0, min(ztunnel_wait, self.ztunnel_wait))
        deadline = asyncio.get_running_loop().time() + wait
        while True:
            conn = await self._wait_latest(deadline, wait)
            try:
                error = await conn.submit(Update("add", pod.uid, record))
            except NotSent:
                if not self._pods.current(record):
                    raise ZdsError(f"pod {pod.uid} was deleted or replaced before "
                                   "AddWorkload was sent") from None
                continue  # that connection died before sending: use the next newest
            if error:
                raise ZdsNack(error, pod.uid)
            return

    async def delete(self, uid: str) -> None:
        """Forget pod ``uid``, close its dup'd fd, and send ``DelWorkload`` to every
        connection (broadcast; ack errors ignored). Returns when each connection
        acked or went away; never raises for connection problems (the next snapshot no
        longer carries the pod). Unknown uids are still broadcast (ztunnel: no-op)."""
        if not isinstance(uid, str) or not uid:
            raise ValueError(f"uid must be a non-empty string, got {uid!r}")
        self._pods.pop(uid)
        futures = []
        for conn in self._conns.for_delete():
            try:
                futures.append(conn.submit(Update("del", uid)))
            except NotSent:
                pass
        for result in await asyncio.gather(*futures, return_exceptions=True):
            if isinstance(result, Exception) and not isinstance(result, NotSent):
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


def _log_background(fut: asyncio.Future[str]) -> None:
    if fut.cancelled():
        return
    exc = fut.exception()
    if exc is not None and not isinstance(exc, NotSent):
        log.warning("background AddWorkload failed: %s", exc)
    elif exc is None and fut.result():
        log.warning("background AddWorkload NACKed: %s", fut.result())


def build(ctx: AgentContext) -> ZdsServer:
    """The ``zds`` component from ``ztunnel_uds_address`` and ``ztunnel_wait``. It holds
    accepts until the ``enrollment`` component (always built after it) has recovered
    the pods of a previous run and calls :meth:`ZdsServer.open_accept`."""
    return ZdsServer(ctx.config.ztunnel_uds_address, ctx.registry,
                     ztunnel_wait=ctx.config.ztunnel_wait, hold_accept=True)
