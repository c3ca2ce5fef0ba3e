"""``ambient-agent run``: wire the components into one asyncio process and run until told to stop.

Start order follows the data flow: config source and ambient index first,
then the servers that read from them, then the entry points that accept work.
Stop order is the reverse, so nothing accepts work that its dependencies can no
longer do.

Signals: the first SIGTERM/SIGINT starts a graceful stop (each component gets
``shutdown_grace`` seconds to finish in-flight work, sockets are closed and
unlinked, exit 0); a second one exits at once with 128+signal.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib
import logging
import os
import signal
from pathlib import Path
from typing import Callable

from agent.core import config as agent_config, fdbudget, sdnotify
from agent.core.config import Config, ConfigError, prepare_state_dir
from agent.core.errors import ComponentStartError
from agent.core.lifecycle import AgentContext, Component, Supervisor

log = logging.getLogger(__name__)

# (module, function): each builder takes the AgentContext and returns a Component, or
# None when the component is disabled by configuration. Imported lazily so that
# `ambient-agent config` and `version` stay fast. Order = start order.
COMPONENT_BUILDERS: list[tuple[str, str]] = [
    # ambient index and its config source
    ("ambient.source", "build"),
    ("cni.registration", "build"),  # registration: pods from CNI ADDs (hosts without Kubernetes)
    ("ambient.index", "build"),
    # caller authentication for the TLS ports (xDS, CA), then SDS and CA
    ("agent.tlsport.authn", "build"),
    ("agent.sds.server", "build"),
    # ZDS server
    ("zds.server", "build"),
    # enrollment (rules, host probe set, reconciler) and the CNI event server
    ("agent.enrollment_zds", "build"),  # enrollment, wired to the zds component
    ("cni.snapshot", "build"),  # cni-snapshot: how the plugin decides while no agent runs
    ("cni.install", "build"),  # cni-installer (only with cni_manage_config)
    ("cni.eventserver", "build"),
    # workload xDS
    ("agent.daemon", "build_xds"),
    # status server (last: it reports the others' readiness)
    ("agent.status.server", "build"),
]


def build(ctx: AgentContext) -> AgentContext:
    """Instantiate every enabled component into ``ctx`` in start order.

    A builder that rejects a setting raises :class:`ConfigError`; any other failure is
    wrapped in :class:`ComponentStartError` naming the module, so the CLI prints one line.
    """
    for module_name, function_name in COMPONENT_BUILDERS:
        builder: Callable[[AgentContext], Component | None] = getattr(
            importlib.import_module(module_name), function_name)
        try:
            component = builder(ctx)
        except ConfigError:
            raise
        except Exception as e:
            log.debug("building %s failed", module_name, exc_info=True)
            raise ComponentStartError(module_name, e) from e
        if component is not None:
            ctx.add(component)
    return ctx


def build_xds(ctx: AgentContext) -> Component | None:
    """Component ``xds`` (:func:`ambient.xds.server.build`), with the embedded CA's
    ``IstioCertificateService`` mounted on its TLS port when the ``sds`` component runs
    one (as istiod serves xDS and the CA on 15012). Wired here so that the ambient
    package imports nothing of SDS."""
    from ambient.xds import server as xds_server

    sds = ctx.get("sds")
    ca_servicer = getattr(sds, "ca_servicer", None)

    def mount_ca(server) -> list[str]:
        servicer = ca_servicer() if ca_servicer is not None else None  # known once sds started
        if servicer is None:  # no sds component, or a remote Istio CA
            return []
        return [servicer.add_to_server(server)]  # the CA registers itself, returns its name

    return xds_server.build(ctx, tls_services=mount_ca)


class StateDirLock:
    """An exclusive ``flock`` on ``<state dir>/agent.lock`` holding our PID.

    Two agents on one state dir would unlink each other's sockets; the second one is
    refused before it touches anything. The lock dies with the process, so a SIGKILLed
    agent never blocks its successor.
    """

    def __init__(self, state_dir: Path):
        self.path = state_dir / "agent.lock"
        self.fd: int | None = None

    def acquire(self, origin: str = "") -> None:
        """Raises :class:`ConfigError` naming ``state_dir`` when another agent holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ConfigError("state_dir", str(self.path.parent),
                              f"another ambient-agent (pid {holder}) is using it", origin) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = None


def set_created_series(enabled: bool) -> None:
    """Whether counters and histograms export their ``_created`` series. prometheus-client
    keeps this process-wide (env ``PROMETHEUS_DISABLE_CREATED_SERIES`` at import, or these
    two calls); the agent turns it off unless ``metrics_created_series`` asks for it, so
    its names match pilot-agent's and istio-cni's, which have no such series."""
    from prometheus_client import disable_created_metrics, enable_created_metrics
    (enable_created_metrics if enabled else disable_created_metrics)()


class Agent:
    """A running agent: context + supervisor. Usable from tests and from ``demo``.

    ``await agent.start()`` raises whatever a component's start raised (after stopping
    the ones already started); ``await agent.stop()`` is idempotent.
    """

    def __init__(self, config: Config, clock: Callable[[], float] | None = None):
        self.config = config
        self.ctx = AgentContext(config, clock=clock)
        self.supervisor = Supervisor(self.ctx)
        self._stopped = False
        self._lock: StateDirLock | None = None

    async def start(self) -> "Agent":
        state = prepare_state_dir(self.config)
        self._lock = StateDirLock(state)
        self._lock.acquire(self.config.origins.get("state_dir", ""))
        # the whole open-files allowance, and the listener caps fitted inside it
        note = fdbudget.describe(self.config, fdbudget.raise_soft_limit())
        if note:
            log.warning("%s", note)
        try:
            # every TCP port checked before any component touches the node (host probe
            # rules, the CNI conflist), so a busy port leaves nothing behind
            agent_config.ensure_ports_free(self.config)
            set_created_series(self.config.metrics_created_series)
            build(self.ctx)
            await self.supervisor.start()
        except BaseException:
            # Started components were stopped by the supervisor; free the state dir too,
            # so a caller that does not call stop() can start another agent on it.
            self._lock.release()
            raise
        log.info("agent ready: %s", ", ".join(self.ctx.components) or "no components")
        return self

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            await self.supervisor.stop(self.config.shutdown_grace)
        finally:
            if self._lock is not None:
                self._lock.release()

    async def wait(self) -> None:
        await self.ctx.shutdown.wait()


async def run(config: Config) -> int:
    """Run the agent until SIGTERM/SIGINT or a quit request. Returns the exit code."""
    loop = asyncio.get_running_loop()
    agent = Agent(config)
    signals_seen: list[int] = []

    def on_signal(signum: int) -> None:
        if signals_seen:
            log.warning("second signal %s: exiting now", signal.Signals(signum).name)
            os._exit(128 + signum)
        signals_seen.append(signum)
        agent.ctx.request_shutdown(signal.Signals(signum).name)

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        await agent.start()
        sdnotify.notify("READY=1")
        await agent.wait()
    finally:
        sdnotify.notify("STOPPING=1")
        await agent.stop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
    log.info("agent stopped")
    return 0
