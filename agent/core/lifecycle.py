"""The common component lifecycle and the context components share.

Every long-running part of the agent (ZDS server, SDS server, status server, xDS
server, CNI event server, enrollment reconciler, config source, ...) is a
:class:`Component`: ``start()`` brings it up (bind sockets, spawn tasks) and returns,
``stop(grace)`` stops accepting new work, lets in-flight work finish for at most
``grace`` seconds, closes and unlinks its sockets. ``ready()`` says whether it is
serving, with a short reason when not; ``debug_state()`` is its JSON view for
``/debug``.

:class:`AgentContext` is what every component is built from: the effective config, the
one Prometheus registry, the bounded thread pool for blocking work, the clock and the
shutdown event. The components a component uses are not looked up here: its ``build``
function takes them as typed parameters and ``agent.daemon.build`` passes them.
``components`` (name -> component, in start order) is for what concerns all of them:
the supervisor, readiness and ``/debug``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from typing import Any, Awaitable, Callable, TypeVar

from prometheus_client import CollectorRegistry, ProcessCollector

from agent.core.config import Config, ConfigError
from agent.core.errors import ComponentStartError

log = logging.getLogger(__name__)
T = TypeVar("T")


class Component:
    """Base class of the agent's components. Subclasses set ``name`` and override the hooks."""

    name: str = "component"

    async def start(self) -> None:
        """Bring the component up. Raise to abort agent start-up (the error is shown)."""

    async def stop(self, grace: float) -> None:
        """Stop accepting work, finish in-flight work within ``grace`` seconds, release resources."""

    def ready(self) -> tuple[bool, str]:
        """``(True, "")`` when serving, else ``(False, short reason)``."""
        return True, ""

    def debug_state(self) -> Any:
        """A JSON-serialisable snapshot for the ``/debug`` endpoints."""
        return {}


C = TypeVar("C", bound=Component)


class AgentContext:
    """Shared services for components.

    Attributes: ``config`` (:class:`agent.core.config.Config`), ``registry`` (the agent's one
    ``prometheus_client.CollectorRegistry``), ``components`` (name -> Component, in start
    order), ``executor`` (bounded thread pool; use :meth:`run_blocking`), ``shutdown``
    (an ``asyncio.Event`` set when the agent should stop, e.g. by ``/quitquitquit``),
    ``clock`` (wall-clock epoch seconds for certificate validity and renewal; tests inject
    one to run the agent "for days").
    """

    def __init__(self, config: Config, registry: CollectorRegistry | None = None,
                 max_workers: int = 8, clock: Callable[[], float] | None = None):
        self.config = config
        self.clock: Callable[[], float] = clock or time.time
        if registry is None:
            registry = CollectorRegistry(auto_describe=True)
            # pilot-agent registers the same process figures under its istio_agent_ prefix
            ProcessCollector(namespace="istio_agent", registry=registry)
        self.registry = registry
        self.components: dict[str, Component] = {}
        self.executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="agent-blocking")
        self.shutdown = asyncio.Event()
        self.draining = False
        # set while components are still to be built (the daemon builds the ones after
        # the first push during the start): readiness says so, as a part named "start"
        self.pending = ""

    def add(self, component: C) -> C:
        """Append ``component`` to the start order; returns it. ValueError on a duplicate
        name (names key ``/debug/component/<name>`` and readiness reasons)."""
        if component.name in self.components:
            raise ValueError(f"duplicate component name {component.name!r}")
        self.components[component.name] = component
        return component

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking call (netns entry, iptables-restore, RSA keygen) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def request_shutdown(self, reason: str) -> None:
        log.info("shutdown requested: %s", reason)
        self.shutdown.set()

    def not_ready(self) -> list[tuple[str, str]]:
        """``(component name, reason)`` for every component that is not ready, in start
        order; ``[]`` when all are. A component whose ``ready()`` raises is not ready,
        the reason naming the exception (readiness never fails for one broken part).
        While :attr:`pending` is set, ``("start", pending)`` comes first: components
        not built yet cannot say they are not ready."""
        out = [("start", self.pending)] if self.pending else []
        for name, component in self.components.items():
            try:
                ok, why = component.ready()
            except Exception as e:  # noqa: BLE001 - one broken component is one reason
                ok, why = False, f"ready() raised {type(e).__name__}: {e}"
            if not ok:
                out.append((name, why or "not ready"))
        return out

    def ready(self) -> tuple[bool, str]:
        """Ready when every component is; the reason names each that is not
        (``name: reason``, joined with ``; ``)."""
        parts = self.not_ready()
        return not parts, "; ".join(f"{name}: {why}" for name, why in parts)


@dataclasses.dataclass(frozen=True)
class StartPause:
    """A pause in :meth:`Supervisor.start`: once the component named ``after`` has
    started, the next one starts when ``until`` is set or ``at_most`` seconds have
    passed, whichever comes first; then ``then`` (when given) is awaited, and the
    components it adds to the context start after it, in order. The daemon pauses after
    ``xds`` until its first complete push and builds the rest in ``then`` (issue 28:
    what that push does not need neither competes with it for the one CPU the
    interpreter gets, nor is imported before it)."""

    after: str
    until: asyncio.Event
    at_most: float
    then: Callable[[], Awaitable[None]] | None = None


class Supervisor:
    """Starts components in order and stops them in reverse.

    If a component's ``start`` raises, the ones already started are stopped and the
    error propagates as :class:`ComponentStartError` (a :class:`ConfigError` as is); the
    CLI prints it as one line and exits non-zero. The same happens when the start is
    cancelled, also during a :class:`StartPause`.
    """

    def __init__(self, ctx: AgentContext):
        self.ctx = ctx
        self.started: list[Component] = []

    async def start(self, pause: StartPause | None = None) -> None:
        """Start every component of ``ctx.components`` in order (each ``start`` awaited
        before the next one's); returns once all have started. ``pause``: where to wait
        and for what (:class:`StartPause`); a ``pause.after`` naming no component never
        pauses. Components already started (an earlier call) are skipped; those a
        ``pause.then`` adds start in their turn."""
        position = 0
        while position < len(self.ctx.components):
            component = list(self.ctx.components.values())[position]
            position += 1
            if component in self.started:
                continue
            log.debug("starting %s", component.name)
            try:
                await component.start()
            except ConfigError:
                await self.stop(grace=1.0)
                raise
            except Exception as e:
                log.debug("start of %s failed", component.name, exc_info=True)
                await self.stop(grace=1.0)
                raise ComponentStartError(component.name, e) from e
            except BaseException:
                await self.stop(grace=1.0)
                raise
            self.started.append(component)
            log.info("started %s", component.name)
            if pause is not None and component.name == pause.after:
                await self._pause(pause)

    async def _pause(self, pause: StartPause) -> None:
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(pause.until.wait(), pause.at_most)
            log.debug("after %s: waited %.0f ms for the event, starting the rest",
                      pause.after, (time.monotonic() - t0) * 1e3)
        except asyncio.TimeoutError:
            log.debug("after %s: not set within %.2f s, starting the rest", pause.after,
                      pause.at_most)
        except BaseException:
            await self.stop(grace=1.0)
            raise
        if pause.then is None:
            return
        try:
            await pause.then()
        except BaseException:  # a build error is raised as it is, once the started stopped
            await self.stop(grace=1.0)
            raise

    async def stop(self, grace: float) -> None:
        """Stop started components in reverse order; each gets ``grace`` seconds at most."""
        self.ctx.draining = True
        while self.started:
            component = self.started.pop()
            try:
                await asyncio.wait_for(component.stop(grace), timeout=grace + 1.0)
            except asyncio.TimeoutError:
                log.warning("%s did not stop within %.1fs", component.name, grace)
            except Exception:
                log.exception("error stopping %s", component.name)
        self.ctx.executor.shutdown(wait=False, cancel_futures=True)
