"""One ztunnel ZDS connection as a state machine, without sockets or an event loop.

The driver (:mod:`zds.connection`) reads packets and feeds them in; the session says
what to send next and what happened. States, in order (upstream ``handleConn`` in
Istio's ``cni/pkg/nodeagent/ztunnelserver.go``; ztunnel's side is
``src/inpod/workloadmanager.rs`` and ``statemanager.rs``)::

    HELLO ──ZdsHello──▶ SNAPSHOT ──ack of SnapshotSent──▶ LIVE
      └───────────── any failure, or close() ─────────────┴──▶ CLOSED

- HELLO: the first packet must be a ``ZdsHello`` within ``hello_timeout`` seconds. Any
  version is taken (upstream logs it and goes on; ztunnel sends V1) and reported in
  :class:`HelloReceived`.
- SNAPSHOT: every recorded pod in recording order (:class:`~zds.pods.PodTable`),
  ``AddWorkload`` + netns fd when the netns is known, ``KeepWorkload`` otherwise, then
  ``SnapshotSent``. The uids are taken when the hello arrives; each pod is looked up
  again right before it is sent, so a pod deleted meanwhile is skipped (never announced
  after its delete) and a replaced one goes out as recorded now. NACKs are reported
  (:class:`Acked` with ``error``) and the snapshot goes on, as upstream does.
- LIVE: submitted adds and deletes (:class:`Update`), in submission order. A queued add
  whose pod was deleted or replaced, or that has no netns (ztunnel takes
  ``KeepWorkload`` only before ``SnapshotSent``), is withdrawn (:class:`Withdrawn`).
- Exactly one request is in flight at a time: ztunnel's acks carry no id and match
  requests by order only. A packet while nothing is in flight is a protocol error
  (ztunnel never speaks unasked: upstream's keepalive check).
- CLOSED: the :class:`Closed` event names the reason, the log level, the request that
  was in flight and the updates never sent (safe to send on another connection).

Deliberate difference from upstream: an ack timeout closes the session (upstream keeps
the connection, and then takes a late ack for the next request's). ztunnel reconnects
and the next snapshot carries the pod.

Inputs take ``now``, seconds on the driver's monotonic clock (``time.perf_counter``).
:meth:`ZdsSession.deadline` says when to feed :meth:`ZdsSession.timeout` next.

Ownership: a session has exactly one owner at a time, the only caller of its inputs
(:meth:`~ZdsSession.receive`, :meth:`~ZdsSession.next_request`, :meth:`~ZdsSession.sent`,
the failure inputs, :meth:`~ZdsSession.timeout`, :meth:`~ZdsSession.submit`,
:meth:`~ZdsSession.close`), and it takes no lock. The driver owns it on its event loop,
hands it to its snapshot thread for SNAPSHOT (the thread starting is the hand-over) and
takes it back when the thread's result arrives on the loop; what the loop is asked
meanwhile (a submit, a stop) it keeps and applies after taking the session back. Others
may read ``state``, ``version`` and ``held`` (each a single reference, replaced whole).

Every input is defined in every state, in any order the owner calls them: after CLOSED
each is a no-op returning None (:meth:`~ZdsSession.submit` raises :class:`NotSent`), so
``next_request`` → ``close`` → ``sent`` is harmless. :meth:`~ZdsSession.sent` must name
what :meth:`~ZdsSession.next_request` returned last (ValueError otherwise: a driver bug).
Every submitted update ends exactly once: in an :class:`Acked`, a :class:`Withdrawn`, or
the :class:`Closed` (``in_flight`` or ``queued``), or skipped when abandoned.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
from typing import Generic, Literal, TypeVar

from zds import wire
from zds.pods import SNAPSHOT_SENT, Message, PodRecord, PodTable, del_message

HELLO_TIMEOUT = 5.0       # seconds to wait for ZdsHello after accept
ACK_TIMEOUT = 5.0         # seconds for each write and each ack (upstream readWriteDeadline)
KEEPALIVE_INTERVAL = 5.0  # seconds of idleness between keepalive checks

_ACK_OK = wire.ACK_OK


class State(enum.Enum):
    """Where a session is; see the module docstring."""

    HELLO = "hello"
    SNAPSHOT = "snapshot"
    LIVE = "live"
    CLOSED = "closed"


# Module constants for the per-message path (an enum member lookup costs an attribute get)
_SNAPSHOT = State.SNAPSHOT


class NotSent(Exception):
    """The session closed before this update was written: safe to send it elsewhere."""


class Update:
    """A live request from the API: ``kind`` ``"add"`` (``record`` = the pod) or
    ``"del"``; ``waiter`` is the driver's own (the session never touches it);
    ``abandoned`` set by the driver when nobody waits any more (skipped unsent)."""

    __slots__ = ("kind", "uid", "record", "message", "waiter", "abandoned")

    def __init__(self, kind: Literal["add", "del"], uid: str,
                 record: PodRecord | None = None, waiter: object = None):
        if kind == "add" and (record is None or record.uid != uid):
            raise ValueError(f"Update(add, {uid!r}) needs the PodRecord of pod {uid!r}")
        self.kind, self.uid, self.record, self.waiter = kind, uid, record, waiter
        self.message: Message = record if record is not None else del_message(uid)
        self.abandoned = False

    def __repr__(self) -> str:
        return f"<Update {self.kind} {self.uid}>"


# ---------------------------------------------------------------------- events

@dataclasses.dataclass(slots=True)
class HelloReceived:
    """The hello arrived: ``version`` as ztunnel sent it (1 = V1)."""

    version: int


@dataclasses.dataclass(slots=True)
class Acked:
    """ztunnel acked ``message``: ``error`` is ``""`` or its NACK text; ``latency`` the
    seconds since :meth:`ZdsSession.sent`; ``update`` the live update it answers (None
    in the snapshot)."""

    message: Message
    error: str
    latency: float
    update: Update | None


@dataclasses.dataclass(slots=True)
class Withdrawn:
    """A queued update that will not be sent (``reason`` says why)."""

    update: Update
    reason: str


@dataclasses.dataclass(slots=True)
class SnapshotDone:
    """SnapshotSent was acked: the session is LIVE. ``sent`` counts requests by kind,
    ``acks``/``nacks`` the acks and how many were errors, ``latencies`` every ack's
    seconds, ``held`` the pods ztunnel acked without error."""

    sent: dict[str, int]
    acks: int
    nacks: int
    latencies: list[float]
    held: int


@dataclasses.dataclass(slots=True)
class Closed:
    """The session ended. ``reason`` is the logged text, ``level`` its log level;
    ``timeout``: it was an ack or write timeout; ``pre_hello``: before ZdsHello (the
    peer is not a working ztunnel; the server rate-limits these warnings);
    ``unexpected``: ztunnel sent a packet unasked; ``said_hello``: the peer got past
    HELLO; ``in_flight``: the live update sent but not acked; ``queued``: the updates
    never sent."""

    reason: str
    level: int = logging.WARNING
    timeout: bool = False
    pre_hello: bool = False
    unexpected: bool = False
    said_hello: bool = False
    in_flight: Update | None = None
    queued: list[Update] = dataclasses.field(default_factory=list)


Event = HelloReceived | Acked | Withdrawn | SnapshotDone | Closed


# ---------------------------------------------------------------------- the session

class ZdsSession:
    """One connection's protocol state; see the module docstring.

    ``pods``: the recorded pods (read when the snapshot starts and before each of its
    messages); ``now``: the clock at accept; the timeouts are seconds.
    """

    def __init__(self, pods: PodTable, now: float, *, hello_timeout: float = HELLO_TIMEOUT,
                 ack_timeout: float = ACK_TIMEOUT,
                 keepalive_interval: float = KEEPALIVE_INTERVAL):
        self.pods = pods
        self.hello_timeout = hello_timeout
        self.ack_timeout = ack_timeout
        self.keepalive_interval = keepalive_interval
        self.state = State.HELLO
        self.version: int | None = None
        # uid -> "add"/"keep": what ztunnel acked without error. Filled in a separate
        # dict during the snapshot and swapped in at its end, so a reader on another
        # thread never iterates a dict that is growing.
        self.held: dict[str, str] = {}
        self.last_keepalive: float | None = None
        self._offered: Message | None = None  # what next_request returned last
        self._hello_deadline = now + hello_timeout
        self._idle_since = now
        self._flight: Message | None = None
        self._flight_at = 0.0
        self._flight_update: Update | None = None
        self._queue: collections.deque[Update] = collections.deque()
        # the snapshot: uids to send, the cursor, and what it gathered
        self._snap_uids: list[str] = []
        self._snap_next = 0
        self._snap_sent = {"add": 0, "keep": 0, "snapshot_sent": 0}
        self._snap_held: dict[str, str] = {}
        self._snap_nacks = 0
        self._snap_latencies: list[float] = []

    # ------------------------------------------------------------------ queries

    @property
    def in_flight(self) -> Message | None:
        """The request awaiting its ack, if any."""
        return self._flight

    @property
    def queued(self) -> int:
        """Updates submitted and not yet sent."""
        return len(self._queue)

    def deadline(self) -> float | None:
        """When :meth:`timeout` has something to check: the hello deadline, the ack
        deadline of the request in flight, or (idle and LIVE) the next keepalive check.
        None when CLOSED."""
        state = self.state
        if state is State.HELLO:
            return self._hello_deadline
        if self._flight is not None:
            return self._flight_at + self.ack_timeout
        if state is State.CLOSED:
            return None
        return self._idle_since + self.keepalive_interval

    # ------------------------------------------------------------------ what to send

    def next_request(self) -> Message | Withdrawn | None:
        """The next request to send, a :class:`Withdrawn` update (ask again), or None
        (nothing to send now: a request is in flight, nothing is queued, or the session
        is not in SNAPSHOT/LIVE). Asking again before :meth:`sent` gives the same
        request (looked up again: a snapshot pod deleted meanwhile is skipped)."""
        if self._flight is not None:
            return None
        self._offered = None
        state = self.state
        if state is _SNAPSHOT:
            uids, get = self._snap_uids, self.pods.get
            while self._snap_next < len(uids):
                record = get(uids[self._snap_next])
                if record is not None and record.sendable:
                    self._offered = record
                    return record
                self._snap_next += 1  # deleted since the snapshot started: never announce it
            if self._snap_next == len(uids):
                self._offered = SNAPSHOT_SENT
                return SNAPSHOT_SENT
            return None
        if state is not State.LIVE:
            return None
        queue = self._queue
        while queue:
            update = queue[0]
            if update.abandoned:
                queue.popleft()
                continue
            record = update.record
            if record is None:
                self._offered = update.message
                return update.message
            if not self.pods.current(record):
                queue.popleft()
                return Withdrawn(update, f"pod {update.uid} was deleted or replaced before "
                                         "AddWorkload was sent")
            if record.kind != "add":
                queue.popleft()
                return Withdrawn(update, f"pod {update.uid} has no netns: ztunnel takes "
                                         "KeepWorkload only in a snapshot")
            self._offered = record
            return record
        return None

    def sent(self, message: Message, now: float) -> None:
        """``message`` (what :meth:`next_request` returned last) was written at ``now``;
        it is in flight until :meth:`receive` gets its ack. A no-op when CLOSED (the
        session ended between asking and writing). Raises ValueError for any other
        message, or one already sent."""
        state = self.state
        if state is State.CLOSED:
            return
        if message is not self._offered or self._flight is not None:
            raise ValueError(f"sent({message!r}): not the request next_request returned")
        self._offered = None
        self._flight, self._flight_at = message, now
        if state is _SNAPSHOT:
            self._snap_sent[message.kind] += 1
            self._snap_next += 1
        else:
            self._flight_update = self._queue.popleft()

    # ------------------------------------------------------------------ what came in

    def receive(self, data: bytes, now: float) -> Event | None:
        """A packet from ztunnel (framing already checked by the driver: no fds, not
        truncated). Returns :class:`HelloReceived`, :class:`Acked` (always in LIVE; in
        the snapshot only for a NACK), :class:`SnapshotDone`, :class:`Closed` (bad
        hello, bad ack, unexpected packet), or None (a snapshot pod acked)."""
        message = self._flight
        if message is None:
            return self._unasked(data, now)  # CLOSED included: nothing is in flight
        if data == _ACK_OK:
            error = ""
        else:
            try:
                error = wire.decode_ack(data).error
            except wire.WireError as e:
                return self._close(f"{message.what()}: {e}", said_hello=True)
        self._flight = None
        latency = now - self._flight_at
        self._idle_since = now
        if self.state is _SNAPSHOT:
            self._snap_latencies.append(latency)
            if error:
                self._snap_nacks += 1
            elif message is not SNAPSHOT_SENT:
                self._snap_held[message.uid] = message.kind
            if message is SNAPSHOT_SENT:
                return self._snapshot_done()
            return Acked(message, error, latency, None) if error else None
        update, self._flight_update = self._flight_update, None
        if not error:
            if message.kind == "add":
                self.held[message.uid] = "add"
            else:
                self.held.pop(message.uid, None)
        return Acked(message, error, latency, update)

    def _unasked(self, data: bytes, now: float) -> HelloReceived | Closed | None:
        if self.state is State.HELLO:
            try:
                hello = wire.decode_hello(data)
            except wire.WireError as e:
                return self._close(str(e), pre_hello=True)
            self.version = int(hello.version)
            self._snap_uids = self.pods.uids()
            self.state = State.SNAPSHOT
            self._idle_since = now
            return HelloReceived(self.version)
        if self.state is State.CLOSED:
            return None
        return self._close(f"ztunnel protocol error, unexpected message ({len(data)} bytes)",
                           unexpected=True, said_hello=True)

    def receive_eof(self) -> Closed | None:
        """ztunnel closed its end. Before the hello that is a probe, not a ztunnel (INFO);
        while idle a clean exit (INFO, as upstream); with a request in flight, a WARNING."""
        if self.state is State.HELLO:
            return self._close("peer closed the connection before ZdsHello (not a ztunnel: "
                               "a probe or health check)", level=logging.INFO)
        if self._flight is not None:
            return self._close(f"{self._flight.what()}: ztunnel closed the connection "
                               "before acking", said_hello=True)
        return self._close("ztunnel closed the connection", level=logging.INFO,
                           said_hello=True)

    def receive_failed(self, error: str, reset: bool = False) -> Closed | None:
        """Reading failed (a socket error, or a packet breaking the framing: truncated,
        an fd on it). ``reset``: ECONNRESET/EPIPE, which before the hello is a probe
        hanging up (INFO)."""
        if self.state is State.HELLO:
            if reset:
                return self._close("peer reset the connection before ZdsHello (not a "
                                   "ztunnel: a probe or health check)", level=logging.INFO)
            return self._close(f"bad ZdsHello: {error}", pre_hello=True)
        if self._flight is not None:
            return self._close(f"{self._flight.what()}: reading ack: {error}", said_hello=True)
        return self._close(f"keepalive: {error}", said_hello=True)

    def send_failed(self, message: Message, error: str) -> Closed | None:
        """``sendmsg`` of ``message`` failed with ``error`` (EPIPE, ...). In LIVE its
        update is reported as ``in_flight`` (its caller gets the error, as upstream's)."""
        live = self.state is State.LIVE
        return self._write_failed(message, live, self._close(
            f"{message.what()}: sendmsg: {error}", said_hello=True))

    def not_writable(self, message: Message) -> Closed | None:
        """The socket stayed full for ``ack_timeout`` seconds while ``message`` waited
        (a write timeout: in LIVE its update is reported as ``in_flight``)."""
        live = self.state is State.LIVE
        return self._write_failed(message, live, self._close(
            f"{message.what()}: socket not writable within {self.ack_timeout:g}s",
            timeout=True, said_hello=True))

    @staticmethod
    def _write_failed(message: Message, live: bool, closed: Closed | None) -> Closed | None:
        if (live and closed is not None and closed.queued
                and closed.queued[0].message is message):
            closed.in_flight = closed.queued.pop(0)
        return closed

    def timeout(self, now: float) -> Closed | None:
        """Time passed (see :meth:`deadline`): closes on a missed hello or ack deadline;
        while idle in LIVE it is the keepalive check (``last_keepalive = now``; nothing
        unasked came in, or :meth:`receive` would have closed). None otherwise."""
        state = self.state
        if state is State.HELLO:
            if now >= self._hello_deadline:
                return self._close(f"no ZdsHello within {self.hello_timeout:g}s",
                                   pre_hello=True)
            return None
        flight = self._flight
        if flight is not None:
            if now >= self._flight_at + self.ack_timeout:
                return self._close(f"{flight.what()}: no ack within {self.ack_timeout:g}s",
                                   timeout=True, said_hello=True)
            return None
        if state is State.LIVE and now >= self._idle_since + self.keepalive_interval:
            self.last_keepalive = self._idle_since = now
        return None

    # ------------------------------------------------------------------ from the API

    def submit(self, update: Update) -> None:
        """Queue a live add/del (sent once LIVE, in order). Raises :class:`NotSent` when
        CLOSED."""
        if self.state is State.CLOSED:
            raise NotSent("connection is closed")
        self._queue.append(update)

    def close(self, reason: str, level: int = logging.INFO) -> Closed | None:
        """End the session from our side (server stopping). None if already CLOSED."""
        return self._close(reason, level=level, said_hello=self.version is not None)

    # ------------------------------------------------------------------ internals

    def _snapshot_done(self) -> SnapshotDone | Closed | None:
        self.held = self._snap_held
        self.state = State.LIVE
        sent, self._snap_sent = self._snap_sent, {}
        latencies, self._snap_latencies = self._snap_latencies, []
        self._snap_uids, self._snap_held = [], {}
        return SnapshotDone(sent, len(latencies), self._snap_nacks, latencies, len(self.held))

    def _close(self, reason: str, *, level: int = logging.WARNING, timeout: bool = False,
               pre_hello: bool = False, unexpected: bool = False,
               said_hello: bool = False) -> Closed | None:
        if self.state is State.CLOSED:
            return None
        self.state = State.CLOSED
        queued = list(self._queue)
        self._queue.clear()
        in_flight, self._flight_update = self._flight_update, None
        self._flight = self._offered = None
        return Closed(reason, level, timeout, pre_hello, unexpected, said_hello, in_flight,
                      queued)


# ---------------------------------------------------------------------- several connections

H = TypeVar("H")


class SessionSet(Generic[H]):
    """The open sessions of a server, in connect order, each with the driver's handle.

    Adds go to the newest session that said hello (a connection still in HELLO could be
    half-open and swallow them); deletes go to every open session (upstream
    ``PodDeleted``); when the newest closes, the one before it takes the adds again.
    """

    def __init__(self) -> None:
        self._items: list[tuple[ZdsSession, H]] = []

    def add(self, session: ZdsSession, handle: H) -> None:
        self._items.append((session, handle))

    def remove(self, handle: H) -> bool:
        """Forget ``handle``; False if it was not here."""
        for i, (_, h) in enumerate(self._items):
            if h is handle:
                del self._items[i]
                return True
        return False

    def for_add(self) -> H | None:
        """The handle adds go to, or None if no open session said hello."""
        for session, handle in reversed(self._items):
            if session.state is State.SNAPSHOT or session.state is State.LIVE:
                return handle
        return None

    def for_delete(self) -> list[H]:
        """Every open session's handle, oldest first (deletes are broadcast)."""
        return [h for s, h in self._items if s.state is not State.CLOSED]

    def handles(self) -> list[H]:
        """Every handle still here, closed or not, oldest first."""
        return [h for _, h in self._items]

    def __len__(self) -> int:
        return len(self._items)
