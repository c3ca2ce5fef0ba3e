"""Every interleaving of inputs the session's docstring allows (``zds.session``,
"Ownership"): from each state (HELLO, SNAPSHOT, LIVE), every sequence of 3 inputs drawn
from every kind of input the owner can give, and every sequence of 4 drawn from the
ones that move requests and end sessions (asked, written, (n)acked, submitted, pod
deleted, closed, EOF), deterministically (no threads, no sockets, no clock: time is a
counter). After each step and at the end:

- nothing raises but what is documented (``submit`` on a CLOSED session: NotSent);
- one request at most in flight; none, and no deadline, once CLOSED;
- at most one :class:`Closed` per session;
- a pod deleted before its snapshot message is never handed out afterwards;
- every submitted update ends exactly once (acked, withdrawn, or in the Closed as
  in flight or queued), checked after a final ``close``.

It includes the sequence of issue 28 (``next_request`` → ``close`` → ``sent``, which
raised IndexError when the loop closed the session under the snapshot thread).
"""

from __future__ import annotations

import itertools
import os

import pytest

from zds import PodInfo, wire
from zds.pods import Message, PodRecord, PodTable
from zds.session import (Acked, Closed, NotSent, State, Update, Withdrawn, ZdsSession)

HELLO = wire.encode_hello()


class Run:
    """One session, its pods, and the bookkeeping of one input sequence."""

    def __init__(self, fd: int, start: str):
        self.fd = fd
        self.pods = PodTable()
        for uid in ("p1", "p2"):
            self.pods.put(PodRecord(PodInfo(uid, uid, "ns", "sa", fd)))
        self.pods.put(PodRecord(PodInfo("k1", "k1", "ns", "sa", None)))  # Keep in snapshot
        self.now = 0.0
        self.session = ZdsSession(self.pods, self.now, hello_timeout=5, ack_timeout=5,
                                  keepalive_interval=5)
        self.offered: Message | Withdrawn | None = None
        self.submitted: list[Update] = []
        self.ends: dict[int, int] = {}
        self.closed = 0
        self.deleted: set[str] = set()
        self.n = itertools.count()
        if start in ("snapshot", "live"):
            self.step("hello")
        if start == "live":
            while self.session.state is State.SNAPSHOT:
                self.step("next")
                self.step("sent")
                self.step("ack")
            assert self.session.state is State.LIVE

    def end(self, update: Update) -> None:
        self.ends[id(update)] = self.ends.get(id(update), 0) + 1

    def event(self, event) -> None:
        if isinstance(event, Acked) and event.update is not None:
            self.end(event.update)
        elif isinstance(event, Withdrawn):
            self.end(event.update)
        elif isinstance(event, Closed):
            self.closed += 1
            if event.in_flight is not None:
                self.end(event.in_flight)
            for update in event.queued:
                self.end(update)

    def step(self, kind: str) -> None:
        s = self.session
        self.now += 1.0
        if kind == "hello":
            self.event(s.receive(HELLO, self.now))
        elif kind == "next":
            self.offered = s.next_request()
            if isinstance(self.offered, Withdrawn):
                self.event(self.offered)
                self.offered = None
            elif isinstance(self.offered, Message):
                assert self.offered.uid not in self.deleted or self.offered.kind == "del"
        elif kind == "sent":  # what the driver writes is what it was offered, if anything
            if isinstance(self.offered, Message):
                s.sent(self.offered, self.now)
                self.offered = None
        elif kind == "ack":
            self.event(s.receive(wire.ACK_OK, self.now))
        elif kind == "nack":
            self.event(s.receive(wire.encode_ack("proxy failed"), self.now))
        elif kind == "garbage":
            self.event(s.receive(b"\xff\xff\xff", self.now))
        elif kind == "eof":
            self.event(s.receive_eof())
        elif kind == "read_failed":
            self.event(s.receive_failed("Connection reset by peer", reset=True))
        elif kind == "send_failed":
            if isinstance(self.offered, Message):
                self.event(s.send_failed(self.offered, "Broken pipe"))
                self.offered = None
        elif kind == "not_writable":
            if isinstance(self.offered, Message):
                self.event(s.not_writable(self.offered))
                self.offered = None
        elif kind == "timeout":
            self.now += 10.0
            self.event(s.timeout(self.now))
        elif kind in ("submit_add", "submit_del"):
            uid = "p1" if kind == "submit_add" else f"gone{next(self.n)}"
            record = self.pods.get(uid) if kind == "submit_add" else None
            if kind == "submit_add" and record is None:
                return
            update = Update("add" if record else "del", uid, record)
            try:
                s.submit(update)
            except NotSent:
                assert s.state is State.CLOSED
                return
            self.submitted.append(update)
        elif kind == "delete_pod":
            self.pods.pop("p2")
            self.deleted.add("p2")
        elif kind == "close":
            self.event(s.close("server stopping"))
        else:
            raise AssertionError(kind)
        self.check()

    def check(self) -> None:
        s = self.session
        assert self.closed <= 1
        if s.state is State.CLOSED:
            assert s.in_flight is None and s.deadline() is None and s.queued == 0
            assert self.closed == 1
        assert s.next_request() is None or s.in_flight is None  # one in flight at most

    def finish(self) -> None:
        self.event(self.session.close("end"))
        assert self.closed == 1
        for update in self.submitted:
            assert self.ends.get(id(update)) == 1, (update, self.ends.get(id(update)))
        self.pods.clear()


INPUTS = ("next", "sent", "ack", "nack", "garbage", "eof", "read_failed", "send_failed",
          "not_writable", "timeout", "submit_add", "submit_del", "delete_pod", "close",
          "hello")
CORE = ("next", "sent", "ack", "nack", "submit_add", "delete_pod", "close", "eof")


@pytest.fixture(scope="module")
def fd():
    fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    yield fd
    os.close(fd)


@pytest.mark.parametrize("start", ["hello", "snapshot", "live"])
@pytest.mark.parametrize("inputs,depth", [(INPUTS, 3), (CORE, 4)], ids=["all-3", "core-4"])
def test_every_input_sequence_keeps_the_invariants(fd, start, inputs, depth):
    count = 0
    for sequence in itertools.product(inputs, repeat=depth):
        run = Run(fd, start)
        try:
            for kind in sequence:
                run.step(kind)
            run.finish()
        except AssertionError as e:
            raise AssertionError(f"from {start}, inputs {sequence}: {e}") from None
        except Exception as e:  # noqa: BLE001 - any other exception is the failure
            raise AssertionError(f"from {start}, inputs {sequence}: "
                                 f"{type(e).__name__}: {e}") from e
        count += 1
    assert count == len(inputs) ** depth


@pytest.mark.parametrize("start", ["snapshot", "live"])
def test_next_request_close_sent_is_harmless(fd, start):
    """Issue 28's sequence, spelled out: asked, closed, then written."""
    run = Run(fd, start)
    if start == "live":
        run.step("submit_add")
    run.step("next")
    offered = run.offered
    assert isinstance(offered, Message)
    run.step("close")
    run.session.sent(offered, run.now)  # no IndexError: a no-op on a CLOSED session
    assert run.session.in_flight is None and run.session.state is State.CLOSED
    run.finish()


def test_sent_of_something_not_offered_is_a_driver_bug(fd):
    run = Run(fd, "live")
    run.step("submit_add")
    with pytest.raises(ValueError, match="not the request next_request returned"):
        run.session.sent(wire_message(), run.now)
    run.finish()


def wire_message() -> Message:
    return Message("del", "other", wire.encode_del("other"))
