"""The ZDS session state machine (``zds.session``) on its own: no sockets, no event loop,
no root. Packets are the byte vectors ztunnel sends (``src/inpod/protocol.rs``:
``ZdsHello{V1}``, ``WorkloadResponse{ack{error}}``); time is passed in.

The fds in the pod records are dups of ``/dev/null``: the session only hands them on.
"""

from __future__ import annotations

import logging
import os
import struct

import pytest

from zds import PodInfo, wire, zds_pb2
from zds.pods import SNAPSHOT_SENT, Message, PodRecord, PodTable
from zds.session import (Acked, Closed, HelloReceived, NotSent, SessionSet, SnapshotDone,
                         State, Update, Withdrawn, ZdsSession)

HELLO = wire.encode_hello()
OK = wire.ACK_OK


def nack(text: str) -> bytes:
    return wire.encode_ack(text)


@pytest.fixture
def devnull():
    fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    yield fd
    os.close(fd)


@pytest.fixture
def pods():
    table = PodTable()
    yield table
    table.clear()


def record(uid: str, fd: int | None) -> PodRecord:
    return PodRecord(PodInfo(uid, f"name-{uid}", "ns", "sa", fd))


def exchange(session: ZdsSession, now: float, ack: bytes = OK):
    """Send whatever the session asks for next and feed ``ack``; returns (message, event)."""
    message = session.next_request()
    assert isinstance(message, Message), message
    session.sent(message, now)
    return message, session.receive(ack, now + 0.001)


def live(pods: PodTable, now: float = 0.0, **kwargs) -> ZdsSession:
    """A session past hello and an empty snapshot."""
    session = ZdsSession(pods, now, **kwargs)
    assert session.receive(HELLO, now) == HelloReceived(1)
    while session.state is State.SNAPSHOT:
        exchange(session, now)
    assert session.state is State.LIVE
    return session


# ---------------------------------------------------------------------- hello

def test_hello_v1_starts_the_snapshot(pods):
    session = ZdsSession(pods, 100.0)
    assert session.state is State.HELLO
    assert session.next_request() is None  # nothing is sent before the hello
    assert session.deadline() == 105.0
    assert session.receive(HELLO, 100.5) == HelloReceived(1)
    assert session.state is State.SNAPSHOT and session.version == 1
    assert session.next_request() is SNAPSHOT_SENT  # no pods: the snapshot is just that


def test_hello_of_another_version_is_taken_and_reported(pods):
    """Upstream (``handleConn``) logs the version and goes on; so do we."""
    for version, data in ((0, b""), (7, zds_pb2.ZdsHello(version=7).SerializeToString())):
        session = ZdsSession(pods, 0.0)
        # an empty packet is EOF at the socket; the session only sees non-empty ones
        event = session.receive(data or b"\x08\x00", 0.0)
        assert event == HelloReceived(version)
        assert session.state is State.SNAPSHOT


def test_garbage_hello_closes_as_a_pre_hello_warning(pods):
    session = ZdsSession(pods, 0.0)
    event = session.receive(b"\xff\xff\xff\xff", 0.1)
    assert isinstance(event, Closed) and event.pre_hello and event.level == logging.WARNING
    assert event.reason.startswith("malformed ZdsHello (4 bytes)")
    assert not event.said_hello and session.state is State.CLOSED


def test_pre_hello_eof_and_reset_are_info(pods):
    eof = ZdsSession(pods, 0.0).receive_eof()
    assert eof is not None and eof.level == logging.INFO and "before ZdsHello" in eof.reason
    reset = ZdsSession(pods, 0.0).receive_failed("Connection reset by peer", reset=True)
    assert reset is not None and reset.level == logging.INFO and not reset.pre_hello
    bad = ZdsSession(pods, 0.0).receive_failed("truncated message (over 1024 bytes)")
    assert bad is not None and bad.pre_hello and bad.reason == (
        "bad ZdsHello: truncated message (over 1024 bytes)")


def test_hello_timeout_is_an_input(pods):
    session = ZdsSession(pods, 10.0, hello_timeout=5.0)
    assert session.timeout(14.99) is None and session.state is State.HELLO
    event = session.timeout(15.0)
    assert isinstance(event, Closed) and event.pre_hello
    assert event.reason == "no ZdsHello within 5s"
    assert session.deadline() is None


# ---------------------------------------------------------------------- snapshot

def test_snapshot_in_recording_order_add_with_fd_keep_without(pods, devnull):
    pods.put(record("a", devnull))
    pods.put(record("k", None))
    pods.put(record("b", devnull))
    pods.put(record("a", devnull))  # re-recorded: moves to the end, old dup closed
    session = ZdsSession(pods, 0.0)
    session.receive(HELLO, 0.0)
    sent = []
    event = None
    t = 1.0
    while not isinstance(event, SnapshotDone):
        message, event = exchange(session, t)
        sent.append((message.kind, message.uid, len(message.rights)))
        t += 1.0
    assert sent == [("keep", "k", 0), ("add", "b", 1), ("add", "a", 1),
                    ("snapshot_sent", "", 0)]
    assert event.sent == {"add": 2, "keep": 1, "snapshot_sent": 1}
    assert event.acks == 4 and event.nacks == 0 and event.held == 3
    assert event.latencies == pytest.approx([0.001] * 4)
    assert session.state is State.LIVE
    assert session.held == {"k": "keep", "b": "add", "a": "add"}
    # the Add carries the record's own dup of the fd
    b = pods.get("b")
    assert b is not None and b.fd is not None and b.fd != devnull
    assert b.rights[0][2] == struct.pack("i", b.fd)


def test_one_request_in_flight_at_a_time(pods, devnull):
    pods.put(record("a", devnull))
    pods.put(record("b", devnull))
    session = ZdsSession(pods, 0.0)
    session.receive(HELLO, 0.0)
    first = session.next_request()
    assert session.next_request() is first  # asking again before sent(): the same
    assert isinstance(first, Message)
    session.sent(first, 1.0)
    assert session.next_request() is None and session.in_flight is first
    assert session.deadline() == 6.0
    session.receive(OK, 1.5)
    assert session.next_request() is pods.get("b")


def test_snapshot_nacks_are_reported_and_the_snapshot_goes_on(pods, devnull):
    pods.put(record("a", devnull))
    pods.put(record("b", devnull))
    session = ZdsSession(pods, 0.0)
    session.receive(HELLO, 0.0)
    _, event = exchange(session, 1.0, nack("failure to start proxy : port in use"))
    assert isinstance(event, Acked) and event.update is None
    assert event.message.uid == "a" and event.error == "failure to start proxy : port in use"
    assert exchange(session, 2.0)[1] is None  # b acked: nothing for the driver
    _, done = exchange(session, 3.0, nack("late"))  # a NACKed SnapshotSent still ends it
    assert isinstance(done, SnapshotDone) and done.nacks == 2 and done.acks == 3
    assert session.state is State.LIVE and session.held == {"b": "add"}


def test_pod_deleted_during_snapshot_is_skipped_replaced_one_sent_as_now(pods, devnull):
    for uid in ("a", "b", "c"):
        pods.put(record(uid, devnull))
    session = ZdsSession(pods, 0.0)
    session.receive(HELLO, 0.0)
    assert exchange(session, 1.0)[0].uid == "a"
    pods.pop("b")  # deleted after the snapshot started, before its turn
    newer = record("c", None)  # replaced: its netns is no longer known
    pods.put(newer)
    message = session.next_request()
    assert message is newer and message.kind == "keep"
    session.sent(message, 2.0)
    session.receive(OK, 2.1)
    assert session.next_request() is SNAPSHOT_SENT


def test_bad_ack_closes_naming_the_request(pods, devnull):
    pods.put(record("a", devnull))
    session = ZdsSession(pods, 0.0)
    session.receive(HELLO, 0.0)
    _, event = exchange(session, 1.0, b"\x0a\xff")
    assert isinstance(event, Closed) and event.reason.startswith("add a: malformed")
    session = ZdsSession(pods, 0.0)
    session.receive(HELLO, 0.0)
    # a well-formed WorkloadResponse without an ack
    _, event = exchange(session, 1.0, b"")
    assert isinstance(event, Closed) and "without ack" in event.reason


def test_snapshot_ack_timeout(pods, devnull):
    pods.put(record("a", devnull))
    session = ZdsSession(pods, 0.0, ack_timeout=0.3)
    session.receive(HELLO, 0.0)
    message = session.next_request()
    assert isinstance(message, Message)
    session.sent(message, 1.0)
    assert session.timeout(1.29) is None
    event = session.timeout(1.3)
    assert isinstance(event, Closed) and event.timeout and event.in_flight is None
    assert event.reason == "add a: no ack within 0.3s"


def test_updates_submitted_during_the_snapshot_go_out_after_it_in_order(pods, devnull):
    pods.put(record("s", devnull))
    session = ZdsSession(pods, 0.0)
    session.receive(HELLO, 0.0)
    exchange(session, 1.0)
    late = record("n", devnull)
    pods.put(late)
    session.submit(Update("add", "n", late))
    session.submit(Update("del", "s"))
    assert session.queued == 2
    assert exchange(session, 2.0)[0] is SNAPSHOT_SENT  # "n" was recorded after the hello
    kinds = [exchange(session, 3.0)[0].what(), exchange(session, 4.0)[0].what()]
    assert kinds == ["add n", "del s"]
    assert session.held == {"n": "add"}  # the del's ack removed s


# ---------------------------------------------------------------------- live

def test_live_add_acked_and_nacked(pods, devnull):
    session = live(pods)
    rec = record("a", devnull)
    pods.put(rec)
    update = Update("add", "a", rec, waiter="mine")
    session.submit(update)
    message, event = exchange(session, 10.0, nack("failure to start proxy : boom"))
    assert message is rec
    assert isinstance(event, Acked) and event.update is update and event.update.waiter == "mine"
    assert event.error == "failure to start proxy : boom" and "a" not in session.held
    session.submit(Update("add", "a", rec))
    _, event = exchange(session, 11.0)
    assert isinstance(event, Acked) and event.error == "" and session.held == {"a": "add"}
    assert event.latency == pytest.approx(0.001)


def test_live_add_without_netns_is_withdrawn_never_a_keep(pods):
    """ztunnel treats KeepWorkload after SnapshotSent as a fatal protocol error
    (``statemanager.rs``), so a pod without a netns is only ever named in a snapshot."""
    session = live(pods)
    rec = record("k", None)
    pods.put(rec)
    update = Update("add", "k", rec)
    session.submit(update)
    item = session.next_request()
    assert isinstance(item, Withdrawn) and item.update is update
    assert "no netns" in item.reason
    assert session.next_request() is None


def test_queued_add_withdrawn_when_its_pod_was_deleted_or_replaced(pods, devnull):
    session = live(pods)
    a, b = record("a", devnull), record("b", devnull)
    pods.put(a)
    pods.put(b)
    session.submit(Update("add", "a", a))
    session.submit(Update("add", "b", b))
    session.submit(Update("del", "b"))
    message = session.next_request()
    assert message is a
    session.sent(message, 1.0)
    pods.pop("b")  # while a is in flight
    session.receive(OK, 1.1)
    item = session.next_request()
    assert isinstance(item, Withdrawn) and "deleted or replaced" in item.reason
    assert session.next_request().what() == "del b"  # type: ignore[union-attr]


def test_abandoned_update_is_not_sent(pods, devnull):
    session = live(pods)
    rec = record("a", devnull)
    pods.put(rec)
    gone = Update("add", "a", rec)
    session.submit(gone)
    session.submit(Update("del", "x"))
    gone.abandoned = True  # the requester stopped waiting before it went out
    assert session.next_request().what() == "del x"  # type: ignore[union-attr]


def test_live_ack_timeout_fails_the_flight_and_returns_the_queue(pods, devnull):
    session = live(pods, ack_timeout=5.0, keepalive_interval=30.0)
    rec = record("a", devnull)
    pods.put(rec)
    first, second = Update("add", "a", rec), Update("del", "z")
    session.submit(first)
    session.submit(second)
    message = session.next_request()
    assert isinstance(message, Message)
    session.sent(message, 20.0)
    assert session.deadline() == 25.0  # the ack deadline, not the keepalive
    assert session.timeout(24.9) is None
    event = session.timeout(25.0)
    assert isinstance(event, Closed) and event.timeout and event.said_hello
    assert event.reason == "add a: no ack within 5s"
    assert event.in_flight is first and event.queued == [second]
    with pytest.raises(NotSent):
        session.submit(Update("del", "y"))


def test_unexpected_packet_eof_and_keepalive_when_idle(pods, devnull):
    session = live(pods, now=0.0, keepalive_interval=5.0)  # SnapshotSent acked at 0.001
    assert session.deadline() == pytest.approx(5.001)
    assert session.timeout(5.0) is None and session.last_keepalive is None
    assert session.timeout(5.5) is None and session.last_keepalive == 5.5
    assert session.deadline() == 10.5
    event = session.receive(OK, 6.0)  # ztunnel never speaks unasked
    assert isinstance(event, Closed) and event.unexpected
    assert event.reason == "ztunnel protocol error, unexpected message (2 bytes)"
    clean = live(pods).receive_eof()
    assert clean is not None and clean.level == logging.INFO
    assert clean.reason == "ztunnel closed the connection"
    rec = record("a", devnull)
    pods.put(rec)
    busy = live(pods)
    busy.submit(Update("add", "a", rec))
    message = busy.next_request()
    assert isinstance(message, Message)
    busy.sent(message, 1.0)
    lost = busy.receive_eof()
    assert lost is not None and lost.level == logging.WARNING
    assert lost.reason == "add a: ztunnel closed the connection before acking"
    assert lost.in_flight is not None and lost.in_flight.uid == "a"


def test_write_failures_name_the_request(pods):
    session = live(pods, ack_timeout=2.5)
    session.submit(Update("del", "x"))
    message = session.next_request()
    assert isinstance(message, Message)
    event = session.not_writable(message)
    assert event is not None and event.timeout
    assert event.reason == "del x: socket not writable within 2.5s"
    # the caller of the update that could not be written gets the timeout
    assert event.in_flight is not None and event.in_flight.uid == "x" and not event.queued
    other = live(pods)
    failed = other.send_failed(SNAPSHOT_SENT, "Broken pipe")
    assert failed is not None and failed.reason == "snapshot_sent: sendmsg: Broken pipe"


def test_close_once_then_inert(pods):
    session = live(pods)
    update = Update("del", "x")
    session.submit(update)
    event = session.close("server stopping")
    assert event is not None and event.level == logging.INFO and event.queued == [update]
    assert session.close("again") is None
    assert session.state is State.CLOSED
    assert session.next_request() is None
    assert session.receive(OK, 1.0) is None
    assert session.receive_eof() is None
    assert session.timeout(1e9) is None and session.deadline() is None
    with pytest.raises(NotSent):
        session.submit(Update("del", "y"))


def test_close_during_snapshot_wins_over_its_end(pods, devnull):
    """The loop may close a session whose snapshot a thread is sending: the session stays
    CLOSED and the thread's next inputs change nothing."""
    pods.put(record("a", devnull))
    session = ZdsSession(pods, 0.0)
    session.receive(HELLO, 0.0)
    exchange(session, 1.0)
    message = session.next_request()
    assert message is SNAPSHOT_SENT
    session.sent(message, 2.0)
    assert session.close("server stopping") is not None
    assert session.receive(OK, 2.1) is None and session.state is State.CLOSED


def test_update_needs_its_record():
    with pytest.raises(ValueError, match="PodRecord"):
        Update("add", "a")


# ---------------------------------------------------------------------- several connections

def test_adds_go_to_the_newest_that_said_hello_deletes_to_all(pods):
    sessions: SessionSet[str] = SessionSet()
    old = live(pods)
    sessions.add(old, "old")
    assert sessions.for_add() == "old"
    new = ZdsSession(pods, 1.0)
    sessions.add(new, "new")
    assert sessions.for_add() == "old"  # "new" may be half-open: not before its hello
    assert sessions.for_delete() == ["old", "new"]
    new.receive(HELLO, 1.1)
    assert sessions.for_add() == "new"  # already in its snapshot: adds queue there
    newest = ZdsSession(pods, 2.0)
    sessions.add(newest, "newest")
    newest.receive_eof()
    assert sessions.for_add() == "new" and sessions.for_delete() == ["old", "new"]
    new.close("gone")
    assert sessions.for_add() == "old"  # the previous one takes the adds again
    assert sessions.remove("new") and not sessions.remove("new")
    assert sessions.handles() == ["old", "newest"] and len(sessions) == 2
    old.close("gone")
    assert sessions.for_add() is None and sessions.for_delete() == []
