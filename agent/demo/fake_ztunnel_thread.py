"""The fake ztunnel (:class:`agent.demo.fake_ztunnel.FakeZtunnel`) on an event loop of
its own thread, for tests whose own loop is busy with the agent (or that have none), and
for benchmarks that must not time the fake's work on the agent's loop.

A separate loop and thread is also closer to the real thing: ztunnel is another process,
so the agent's loop never runs ztunnel's side. By default it serves one connection
(``reconnect=False``): a test that restarts the agent starts a new one, as it would
start a new ztunnel.

Usage::

    zt = FakeZtunnelThread(path, open_listeners=True).start()   # connected, hello sent
    assert zt.wait(lambda: zt.snapshot_uids is not None)
    hit = zt.wait_accepted(lambda a: a.uid == uid and a.port == 15001)
    zt.close()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any, Callable

from agent.demo.fake_ztunnel import FakeZtunnel
from agent.demo.pod_listeners import Accepted


class FakeZtunnelThread:
    """``path``: the agent's ZDS socket; ``kwargs``: :class:`FakeZtunnel`'s (``reconnect``
    defaults to False here). :attr:`ztunnel` is the fake itself; its bookkeeping
    (``adds``, ``deleted``, ``snapshot_uids``, ``pods``, ``nack``...) is read and set
    through it or the properties below."""

    def __init__(self, path: str, **kwargs: Any) -> None:
        kwargs.setdefault("reconnect", False)
        self.path = path
        self._kwargs = kwargs
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="fake-ztunnel")
        self._task: concurrent.futures.Future | None = None
        self.ztunnel: FakeZtunnel | None = None
        self.other_accepted: list[Accepted] = []  # seen by wait_accepted, not matching

    # what tests read most
    @property
    def fake(self) -> FakeZtunnel:
        if self.ztunnel is None:
            raise RuntimeError("FakeZtunnelThread.start() was not called")
        return self.ztunnel

    @property
    def adds(self) -> dict[str, int | None]:
        return self.fake.adds

    @property
    def deleted(self) -> list[str]:
        return self.fake.deleted

    @property
    def snapshot_uids(self) -> set[str] | None:
        return self.fake.snapshot_uids

    @property
    def nack(self) -> str:
        return self.fake.nack

    @nack.setter
    def nack(self, text: str) -> None:
        self.fake.nack = text

    def start(self, timeout: float = 5.0) -> FakeZtunnelThread:
        """Start the thread and the fake; return once connected (hello sent). Raises
        TimeoutError (and stops everything) when the agent's socket does not accept a
        connection within ``timeout`` seconds."""
        self._thread.start()

        async def make() -> FakeZtunnel:
            return FakeZtunnel(self.path, **self._kwargs)

        self.ztunnel = asyncio.run_coroutine_threadsafe(make(), self._loop).result()
        self._task = asyncio.run_coroutine_threadsafe(self.ztunnel.run(), self._loop)
        if not self.wait(lambda: self.fake.connected, timeout):
            self.close()
            raise TimeoutError(f"fake ztunnel: no connection to {self.path} within {timeout}s")
        return self

    def wait(self, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
        """Poll ``predicate`` (every 20 ms) until it holds or ``timeout`` seconds pass;
        returns its last value."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.02)
        return bool(predicate())

    def wait_accepted(self, predicate: Callable[[Accepted], bool],
                      timeout: float = 5.0) -> Accepted:
        """The next connection or datagram on the pods' listeners (``open_listeners``)
        for which ``predicate`` holds; earlier ones go to :attr:`other_accepted`. Raises
        TimeoutError after ``timeout`` seconds."""
        fake = self.fake

        async def next_match() -> Accepted:
            while True:
                item = await fake.accepted.get()
                if predicate(item):
                    return item
                self.other_accepted.append(item)

        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(next_match(), timeout),
                                                  self._loop)
        try:
            return future.result(timeout + 1)
        except (TimeoutError, concurrent.futures.TimeoutError):
            future.cancel()
            raise TimeoutError(f"fake ztunnel: nothing matching landed within {timeout}s") from None

    def close(self, timeout: float = 5.0) -> None:
        """Stop the fake (it drains its pods: netns fds and listeners closed), then the
        loop and the thread. Idempotent."""
        if self._thread.is_alive():
            if self.ztunnel is not None:
                self._loop.call_soon_threadsafe(self.ztunnel.stop)
            if self._task is not None:
                try:
                    self._task.result(timeout)
                except Exception:  # noqa: BLE001 - closing: the run's end is all we need
                    pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()
