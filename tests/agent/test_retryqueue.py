"""agent.core.retryqueue.RetryQueue on a manual clock (no timing against the machine's
load): ``add(now=True)`` runs at once and keeps the backoff for the next failure;
``drain`` lets the attempt in flight finish without retrying it and drops what is not
due; ``forget`` cancels an attempt in flight."""

from __future__ import annotations

import asyncio

import pytest

from agent.core.retryqueue import RetryQueue
from tests.helpers import ManualClock, eventually


def queue(process, clock: ManualClock) -> RetryQueue:
    return RetryQueue(process, initial=0.2, maximum=1.0, name="t", clock=clock.time,
                      sleep=clock.sleep)


async def test_now_runs_at_once_then_backs_off_from_initial():
    clock = ManualClock()
    calls: list[float] = []

    async def process(key: str) -> bool:
        calls.append(clock.now)
        return len(calls) >= 4

    q = queue(process, clock)
    q.add("a", now=True)
    await eventually(lambda: calls == [0.0])  # no sleep first: due at once
    for want in (0.2, 0.6, 1.4):  # 0.2, then doubling: 0.4, 0.8
        assert await clock.advance_to_next_sleeper() == pytest.approx(want)
        await eventually(lambda w=want: calls[-1] == pytest.approx(w))
    await eventually(lambda: "a" not in q)
    assert calls == pytest.approx([0.0, 0.2, 0.6, 1.4])
    assert q.backoff("a") == 0.2  # done: its backoff is forgotten
    await q.stop(1.0)


async def test_drain_finishes_the_attempt_in_flight_and_retries_nothing():
    clock = ManualClock()
    release = asyncio.Event()
    seen: list[str] = []

    async def process(key: str) -> bool:
        seen.append(key)
        if key == "busy":
            await release.wait()
        return False  # every attempt fails: only drain stops the retries

    q = queue(process, clock)
    q.add("busy", now=True)
    q.add("later")  # due in 0.2 s of the manual clock, which never moves
    await eventually(lambda: seen == ["busy"])
    drained = asyncio.ensure_future(q.drain(5.0))
    await eventually(lambda: "later" not in q)  # not due: dropped at once
    assert not drained.done() and "busy" in q  # the attempt in flight is not cancelled
    release.set()
    await drained
    assert "busy" not in q and q.pending() == {} and seen == ["busy"]


async def test_forget_cancels_the_attempt_in_flight():
    clock = ManualClock()
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def process(key: str) -> bool:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return True

    q = queue(process, clock)
    q.add("a", now=True)
    await started.wait()
    q.forget("a")
    await cancelled.wait()
    await eventually(lambda: "a" not in q and clock.sleepers == [])
    await q.stop(1.0)
