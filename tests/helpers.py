"""Small helpers shared by the test suites."""

from __future__ import annotations

import asyncio
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
