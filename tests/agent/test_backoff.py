"""agent.core.backoff.Backoff: growth, cap, reset, jitter bounds and its injected clock,
random source and sleep."""

from __future__ import annotations

import asyncio
import random

import pytest

from agent.core.backoff import Backoff


def test_doubles_up_to_the_cap_and_resets():
    b = Backoff(0.2, 1.0)
    assert [b.next() for _ in range(6)] == [0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    b.reset()
    assert b.step == 0.2 and b.next() == 0.2


def test_factor_other_than_two():
    b = Backoff(0.5, 2.0, factor=1.5)
    assert [b.next() for _ in range(5)] == [0.5, 0.75, 1.125, 1.6875, 2.0]


def test_jitter_multiplies_each_delay_and_the_cap_bounds_the_step():
    calls = []

    def high(lo: float, hi: float) -> float:
        calls.append((lo, hi))
        return hi

    b = Backoff(10.0, 30.0, jitter=(0.8, 1.2), rand=high)
    assert [round(b.next(), 9) for _ in range(4)] == [12.0, 24.0, 36.0, 36.0]
    assert calls == [(0.8, 1.2)] * 4
    assert b.step == 30.0  # the step is capped; the jittered delay may exceed it


def test_real_random_stays_within_the_jitter_range():
    b = Backoff(1.0, 1.0, jitter=(0.5, 1.5), rand=random.Random(7).uniform)
    delays = [b.next() for _ in range(500)]
    assert all(0.5 <= d <= 1.5 for d in delays)
    assert max(delays) - min(delays) > 0.5  # actually spread, not a constant


def test_no_jitter_never_calls_the_random_source():
    def boom(lo: float, hi: float) -> float:
        raise AssertionError("random source used without jitter")

    assert Backoff(1.0, 4.0, rand=boom).next() == 1.0


def test_deadline_uses_the_injected_clock():
    now = [100.0]
    b = Backoff(5.0, 300.0, clock=lambda: now[0])
    assert b.deadline() == 105.0
    now[0] = 200.0
    assert b.deadline() == 210.0


def test_wait_sleeps_with_the_injected_sleep():
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    async def go() -> list[float]:
        b = Backoff(0.1, 0.3, sleep=fake_sleep)
        return [await b.wait() for _ in range(3)]

    assert asyncio.run(go()) == [0.1, 0.2, 0.3] and slept == [0.1, 0.2, 0.3]


@pytest.mark.parametrize("kwargs, field", [
    ({"initial": 0, "maximum": 1}, "initial"),
    ({"initial": -1, "maximum": 1}, "initial"),
    ({"initial": 2, "maximum": 1}, "maximum"),
    ({"initial": 1, "maximum": 2, "factor": 0.5}, "factor"),
    ({"initial": 1, "maximum": 2, "jitter": (0.0, 1.0)}, "jitter"),
    ({"initial": 1, "maximum": 2, "jitter": (1.2, 0.8)}, "jitter"),
])
def test_bad_parameters_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        Backoff(**kwargs)
