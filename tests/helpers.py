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
