"""Small helpers shared by the test suites."""

from __future__ import annotations

import asyncio
import os
from typing import Callable


async def eventually(predicate: Callable[[], object], timeout: float = 5.0,
                     what: str = "condition") -> None:
    """Poll ``predicate`` every 10 ms until it is truthy; AssertionError after ``timeout`` s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"{what} not reached within {timeout:g}s")
        await asyncio.sleep(0.01)


def fd_count() -> int:
    """All open fds of this process."""
    return len(os.listdir("/proc/self/fd"))


def netns_fd_count() -> int:
    """Open fds of this process that refer to a network namespace (``net:[inode]``).

    The leak tests count these rather than every fd: other tests' background threads
    (gRPC, watchers) may open and close unrelated fds at any moment in this process.
    """
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("net:[")
        except OSError:  # closed between listdir and readlink
            pass
    return count


class ManualClock:
    """A clock that moves only when told (:meth:`advance`), for code that takes a
    ``clock() -> seconds`` and an async ``sleep(seconds)`` (``RetryQueue``, ``Backoff``).
    ``sleepers`` are the wake-up times of the sleeps in progress; :meth:`advance` moves
    the time and wakes every sleep that is due. Timings asserted against it are exact,
    whatever the machine's load."""

    def __init__(self, now: float = 0.0):
        self.now = now
        self._sleeps: list[tuple[float, asyncio.Future]] = []

    def time(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._sleeps.append((self.now + max(0.0, seconds), fut))
        await fut

    @property
    def sleepers(self) -> list[float]:
        self._sleeps = [(t, f) for t, f in self._sleeps if not f.done()]
        return sorted(t for t, _ in self._sleeps)

    def advance(self, seconds: float) -> None:
        self.now += seconds
        for t, fut in self._sleeps:
            if t <= self.now and not fut.done():
                fut.set_result(None)

    async def advance_to_next_sleeper(self, timeout: float = 10.0) -> float:
        """Wait (in real time, at most ``timeout`` s) until something sleeps, then move the
        time to its wake-up. Returns the new time."""
        await eventually(lambda: self.sleepers, timeout, "a sleeper on the manual clock")
        self.advance(self.sleepers[0] - self.now)
        return self.now
