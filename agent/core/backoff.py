"""Exponential backoff with a cap and jitter: the one retry-delay helper of the agent.

Every loop that retries after a failure (renewing a certificate, re-listing a Kubernetes
kind, re-writing an annotation, re-connecting to a peer) asks a :class:`Backoff` how long
to wait. The delay starts at ``initial`` seconds and is multiplied by ``factor`` after
each failure, never beyond ``maximum``; :meth:`Backoff.reset` returns to ``initial`` after
a success. Each delay handed out is the current step multiplied by a factor drawn
uniformly from ``jitter`` (``(1.0, 1.0)``: none), so a fleet of agents that failed
together does not retry in step. The cap applies to the step, not to the jittered delay,
as in client-go's ``wait.Backoff`` (``Cap``, ``Jitter``) and the ``cenkalti/backoff``
package Istio's SDS cache uses (``MaxInterval``, ``RandomizationFactor``).

The random source and the clock are parameters so tests fix them::

    b = Backoff(0.5, 30.0, jitter=(0.8, 1.2), rand=lambda lo, hi: hi)
    b.next()   # 0.6 (0.5 x 1.2); the step is 1.0 now
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Awaitable, Callable

Uniform = Callable[[float, float], float]  # random.uniform's shape: (low, high) -> value
Clock = Callable[[], float]                 # seconds, monotonic
Sleep = Callable[[float], Awaitable[object]]


class Backoff:
    """Delays of an exponential backoff (seconds).

    ``initial`` > 0: the first delay; ``maximum`` >= ``initial``: the cap of the step;
    ``factor`` >= 1: growth per failure; ``jitter``: ``(low, high)`` multipliers with
    0 < low <= high applied to each delay handed out; ``rand``: ``(low, high) -> x`` with
    low <= x <= high (default :func:`random.uniform`); ``clock``: for :meth:`deadline`
    (default :func:`time.monotonic`); ``sleep``: for :meth:`wait` (default
    :func:`asyncio.sleep`). Raises ValueError naming the parameter for values outside
    these ranges. Not thread-safe: one backoff per retry loop.
    """

    __slots__ = ("initial", "maximum", "factor", "jitter", "rand", "clock", "sleep", "_step")

    def __init__(self, initial: float, maximum: float, *, factor: float = 2.0,
                 jitter: tuple[float, float] = (1.0, 1.0), rand: Uniform = random.uniform,
                 clock: Clock = time.monotonic, sleep: Sleep = asyncio.sleep) -> None:
        if not initial > 0:
            raise ValueError(f"initial: must be > 0 seconds, got {initial!r}")
        if not maximum >= initial:
            raise ValueError(f"maximum: must be >= initial ({initial!r}), got {maximum!r}")
        if not factor >= 1:
            raise ValueError(f"factor: must be >= 1, got {factor!r}")
        low, high = jitter
        if not 0 < low <= high:
            raise ValueError(f"jitter: must be (low, high) with 0 < low <= high, got {jitter!r}")
        self.initial, self.maximum, self.factor = float(initial), float(maximum), float(factor)
        self.jitter = (float(low), float(high))
        self.rand, self.clock, self.sleep = rand, clock, sleep
        self._step = self.initial

    @property
    def step(self) -> float:
        """The un-jittered delay the next :meth:`next` is based on (seconds)."""
        return self._step

    def next(self) -> float:
        """The delay before the next attempt (seconds, jittered); advances the step."""
        low, high = self.jitter
        delay = self._step if low == high == 1.0 else self._step * self.rand(low, high)
        self._step = min(self._step * self.factor, self.maximum)
        return delay

    def reset(self) -> None:
        """Back to ``initial``: call after a success."""
        self._step = self.initial

    def deadline(self) -> float:
        """``clock()`` plus :meth:`next`: when the next attempt is due."""
        return self.clock() + self.next()

    async def wait(self) -> float:
        """Sleep for :meth:`next` seconds; returns the delay slept."""
        delay = self.next()
        await self.sleep(delay)
        return delay
