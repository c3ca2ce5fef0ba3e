"""One keyed, rate-limited retry queue (upstream: the informer's ``controllers.Queue`` with
a per-item exponential rate limiter, ``cni/pkg/nodeagent/informers.go``). Every per-pod
background work of enrollment goes through one: the retries of a pod's enrollment
(``cni.enrollment.reconciler``), its status annotation writes (``cni.annotate``) and the
live (un)enrollment of running pods (``cni.enrollment.watch``), so none keeps its own
task registry or backoff loop.

A key (a pod UID) is in the queue at most once and processed by at most one task at a
time. :meth:`RetryQueue.add` schedules it after its backoff (``initial`` doubling per
failed attempt, at most ``maximum``); the ``process`` coroutine returns True when the
key is done (its backoff is then forgotten) or False to be retried later.
:meth:`RetryQueue.forget` drops a key now, cancelling an attempt in flight (a fresh
CNI ADD or DEL takes over the pod).

What differs from upstream, on purpose: there is no global token bucket, and due keys are
processed concurrently. An attempt may wait up to ``ztunnel_wait`` for a ztunnel; when
one connects, every pending pod must be handed to it at once, not at 10 per second
behind the slowest. The per-key backoff already bounds each pod's attempts.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
from typing import Awaitable, Callable

from agent.core.backoff import Clock, Sleep

log = logging.getLogger(__name__)


class RetryQueue:
    """``process(key) -> bool`` runs on the event loop; one worker task sleeps until the
    next key is due. Delays are in seconds of ``clock`` (default: the running loop's
    ``time()``); the worker waits with ``sleep(seconds)`` (default: a timed wait on the
    loop). Tests replace both (the attributes ``clock`` and ``sleep``) with a manual
    clock, so backoff timings are checked exactly, never against a loaded machine's
    wall clock."""

    def __init__(self, process: Callable[[str], Awaitable[bool]], *, initial: float,
                 maximum: float, name: str = "retry", clock: Clock | None = None,
                 sleep: Sleep | None = None):
        self._process = process
        self.initial, self.maximum, self.name = initial, maximum, name
        self.clock, self.sleep = clock, sleep
        self._due: dict[str, float] = {}  # key -> loop time it is due
        self._heap: list[tuple[float, str]] = []  # (due, key); stale entries skipped
        self._failures: dict[str, int] = {}
        self._running: dict[str, asyncio.Task] = {}
        self._wake = asyncio.Event()
        self._worker: asyncio.Task | None = None
        self._draining = False  # attempts that end now are not retried (drain)

    def __contains__(self, key: str) -> bool:
        return key in self._due or key in self._running

    def pending(self) -> dict[str, float]:
        """``{key: seconds until due}`` (0 for keys being processed now)."""
        now = self._now()
        out = {k: max(0.0, t - now) for k, t in self._due.items()}
        out.update({k: 0.0 for k in self._running})
        return out

    def backoff(self, key: str) -> float:
        """The delay the next :meth:`add` of ``key`` waits."""
        return min(self.initial * (2 ** self._failures.get(key, 0)), self.maximum)

    def add(self, key: str, now: bool = False) -> None:
        """Queue ``key`` after its backoff (``now``: due at once, its backoff kept for the
        next failure), unless it is queued or processed already."""
        if key in self:
            return
        self._schedule(key, now)

    def _now(self) -> float:
        return self.clock() if self.clock is not None else asyncio.get_running_loop().time()

    async def _nap(self, delay: float) -> None:
        """Wait ``delay`` seconds or until :meth:`_schedule` wakes the worker."""
        if self.sleep is None:
            try:
                await asyncio.wait_for(self._wake.wait(), delay)
            except asyncio.TimeoutError:
                pass
            return
        waiters = {asyncio.ensure_future(self._wake.wait()),
                   asyncio.ensure_future(self.sleep(delay))}
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    def _schedule(self, key: str, now: bool = False) -> None:
        loop = asyncio.get_running_loop()
        if now:
            due = self._now()
        else:
            due = self._now() + self.backoff(key)
            self._failures[key] = self._failures.get(key, 0) + 1
        self._due[key] = due
        heapq.heappush(self._heap, (due, key))
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._run(), name=f"{self.name}-queue")
        self._wake.set()

    def forget(self, key: str) -> None:
        """Drop ``key``: no longer queued, its backoff reset, an attempt in flight
        cancelled (unless that attempt is the caller)."""
        self._due.pop(key, None)
        self._failures.pop(key, None)
        task = self._running.pop(key, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._due:
            self._wake.clear()
            now = self._now()
            while self._heap and self._heap[0][0] <= now:
                due, key = heapq.heappop(self._heap)
                if self._due.get(key) != due:
                    continue  # forgotten or re-added since
                del self._due[key]
                self._running[key] = loop.create_task(self._attempt(key),
                                                      name=f"{self.name}-{key}")
            if not self._heap:
                break
            await self._nap(self._heap[0][0] - now)
        self._heap.clear()

    async def _attempt(self, key: str) -> None:
        me = asyncio.current_task()
        done = False
        try:
            done = await self._process(key)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a bug in one attempt must not stop the queue
            log.exception("%s: attempt for %s failed", self.name, key)
        finally:
            if self._running.get(key) is me:
                del self._running[key]
                if done or self._draining:
                    self._failures.pop(key, None)
                else:
                    self._schedule(key)

    def tasks(self) -> list[asyncio.Task]:
        """The worker and every attempt in flight."""
        out = list(self._running.values())
        if self._worker is not None and not self._worker.done():
            out.append(self._worker)
        return out

    def kill(self) -> list[asyncio.Task]:
        """Cancel everything now (no waiting); returns the cancelled tasks."""
        tasks = self.tasks()
        self._due.clear()
        self._heap.clear()
        self._failures.clear()
        self._running.clear()
        for t in tasks:
            t.cancel()
        return tasks

    async def stop(self, grace: float) -> None:
        """Cancel everything and wait up to ``grace`` seconds for it to end."""
        tasks = self.kill()
        if tasks:
            await asyncio.wait(tasks, timeout=grace)

    async def drain(self, grace: float) -> None:
        """Drop the keys not yet due, let the attempts in flight finish for up to
        ``grace`` seconds (none is retried), then cancel what still runs."""
        self._due.clear()
        self._heap.clear()
        self._draining = True
        try:
            running = list(self._running.values())
            if running:
                await asyncio.wait(running, timeout=grace)
            await self.stop(grace)
        finally:
            self._draining = False
