"""``ambient-agent run``: wire the components into one asyncio process and run until told to stop.

Start order follows the data flow: config source and ambient index first,
then the servers that read from them, then the entry points that accept work.
Stop order is the reverse, so nothing accepts work that its dependencies can no
longer do. The components after xDS are imported, built and started once its first
push is out (or 0.5 s after xDS started): :data:`FIRST_PUSH_PATH_ENDS`,
:func:`build_first_path`, :func:`build_rest`.

Signals: the first SIGTERM/SIGINT starts a graceful stop (each component gets
``shutdown_grace`` seconds to finish in-flight work, sockets are closed and
unlinked, exit 0); a second one (at any time until the process ends) removes the
socket files and the state dir lock and exits at once with 128+signal. SIGHUP,
SIGUSR1 and SIGUSR2 are ignored with one log line: the configuration is read once, at start
(``docs/operating.md``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import fcntl
import logging
import os
import signal
import threading
import time
import types
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TypeVar

from agent.core import config as agent_config, fdbudget, gcpause, sdnotify, unixsocket
from agent.core.capabilities import has_net_admin
from agent.core.uptime import process_age
from agent.core.config import Config, ConfigError, prepare_state_dir
from agent.core.errors import ComponentStartError
from agent.core.lifecycle import AgentContext, Component, StartPause, Supervisor

if TYPE_CHECKING:  # imported by build() when the agent starts
    import grpc

    from agent.sds.server import SdsServer
    from agent.status.server import StatusServer
    from agent.tlsport.authn import AuthnComponent
    from ambient.index import IndexComponent
    from ambient.source import ConfigSource
    from ambient.waypoint.status_writer import StatusWriter
    from ambient.xds.server import XdsServer
    from cni.enrollment import Enrollment
    from cni.eventserver import CniEventServer
    from cni.installwatch import CniInstallerComponent
    from cni.registration import WorkloadRegistrar
    from cni.snapshot import SnapshotWriter
    from zds.server import ZdsServer

log = logging.getLogger(__name__)
T = TypeVar("T")

@dataclasses.dataclass(frozen=True)
class Components:
    """The agent's components as :func:`build_rest` returns them, typed for tests and the demo
    (``agent.components.enrollment``); None where configuration turns one off."""

    source: ConfigSource
    registration: WorkloadRegistrar | None
    index: IndexComponent
    authn: AuthnComponent
    sds: SdsServer
    # xDS before ZDS and enrollment: it serves from the index alone, so a cold start's
    # first push never waits behind restart recovery (issue 28). The components after it
    # start after that push (FIRST_PUSH_PATH_ENDS, FIRST_PUSH_WAIT)
    xds: XdsServer
    zds: ZdsServer
    # Kubernetes mode: the waypoint Gateway/route status, written by the Lease holder
    waypoint_status: StatusWriter | None
    enrollment: Enrollment
    snapshot: SnapshotWriter
    installer: CniInstallerComponent | None
    events: CniEventServer
    status: StatusServer

    def in_start_order(self) -> list[Component]:
        """Every enabled component, in the order of the fields (= start order)."""
        parts = (getattr(self, f.name) for f in dataclasses.fields(self))
        return [part for part in parts if part is not None]


#: the last component on the path to a cold start's first xDS push: the ones after it
#: (ZDS, enrollment and its restart recovery, the CNI parts, the waypoint status writer,
#: the status server's ports) are imported, built and started once a client holds its
#: complete initial Address response, or FIRST_PUSH_WAIT seconds after it started,
#: whichever comes first. The agent is ready (``/readyz``, sd_notify) only when all
#: have started.
FIRST_PUSH_PATH_ENDS = "xds"
FIRST_PUSH_WAIT = 0.5  # seconds


def _defer_library_start_up() -> None:
    """Before any component imports kubernetes_asyncio or aiohttp: kubernetes_asyncio's
    ~800 modules load on use (:mod:`agent.core.kubelazy`), aiohttp's default TLS
    contexts read the system CA roots on use (:mod:`agent.core.sslroots`). Idempotent."""
    from agent.core import kubelazy, sslroots
    kubelazy.install()
    sslroots.install()


def import_first_path() -> types.SimpleNamespace:
    """Import the modules of the components on the path to the first push (and the
    status server's, for the early health port); blocking, ~0.15 s of CPU on a quiet box
    (benchmarks/README.md, "Night of 2026-12-04"; more under load). Returns them
    by the names :func:`build_first_path` uses. :class:`Agent` calls it on a worker
    thread while the Kubernetes source's LISTs are under way, so the API server prepares
    them while the agent imports (issue 28); :func:`build_first_path` calls it again and
    finds them loaded. Imports are here, not at the top, so that ``ambient-agent
    config`` and ``version`` stay fast. The cyclic collector is paused meanwhile:
    importing makes only objects that live as long as the process, and full passes over
    the growing heap were ~25 ms of these imports."""
    with gcpause.paused():
        _defer_library_start_up()
        from agent.sds import server as sds_server
        from agent.status import server as status_server
        from agent.tlsport import authn as tls_authn
        from ambient import index as ambient_index, source as ambient_source
        from ambient.xds import server as xds_server
        from cni import registration
    return types.SimpleNamespace(
        sds_server=sds_server, status_server=status_server, tls_authn=tls_authn,
        ambient_index=ambient_index, ambient_source=ambient_source, xds_server=xds_server,
        registration=registration)


def import_rest() -> types.SimpleNamespace:
    """Import the modules of the components that start after the first push (ZDS,
    enrollment, the CNI parts, the waypoint status writer); blocking, ~0.25 s of CPU.
    :class:`Agent` calls it on a worker thread once the first push is out, so they never
    delay it; :func:`build_rest` calls it again and finds them loaded. The collector
    is paused meanwhile, as in :func:`import_first_path`."""
    with gcpause.paused():
        from agent import enrollment_zds
        from ambient.waypoint import status_writer
        from cni import eventserver, install, snapshot
        from zds import server as zds_server
    return types.SimpleNamespace(
        enrollment_zds=enrollment_zds, status_writer=status_writer, eventserver=eventserver,
        install=install, snapshot=snapshot, zds_server=zds_server)


def build_source(ctx: AgentContext) -> ConfigSource:
    """The ``config-source`` component alone (what :func:`build` makes first); imports
    only its own modules (the collector paused, as in :func:`import_first_path`).
    Raises :class:`ConfigError` or :class:`ComponentStartError`."""
    with gcpause.paused():
        _defer_library_start_up()
        from ambient import source as ambient_source
    try:
        return ambient_source.build(ctx)
    except ConfigError:
        raise
    except Exception as e:
        log.debug("building config-source failed", exc_info=True)
        raise ComponentStartError("config-source", e) from e


@dataclasses.dataclass(frozen=True)
class FirstPath:
    """What :func:`build_first_path` made: the components on the path to the first
    push (in the context, in start order) and the status server (built, not yet in the
    context: it is started last, by :func:`build_rest`)."""

    source: ConfigSource
    registration: WorkloadRegistrar | None
    index: IndexComponent
    authn: AuthnComponent
    sds: SdsServer
    xds: XdsServer
    status: StatusServer


def _made(name: str, builder: Callable[[], T]) -> T:
    """``builder()``; a :class:`ConfigError` as it is, any other failure wrapped in
    :class:`ComponentStartError` naming component ``name``."""
    try:
        return builder()
    except ConfigError:
        raise
    except Exception as e:
        log.debug("building %s failed", name, exc_info=True)
        raise ComponentStartError(name, e) from e


def build_first_path(ctx: AgentContext, source: ConfigSource | None = None) -> FirstPath:
    """Construct the components a cold start's first xDS push needs and add them to
    ``ctx`` in start order: the config source (``source``: the one :func:`build_source`
    already made and began, else made here) and the registration that writes pods into
    it, the index, caller authentication, SDS and xDS (it needs only the index and SDS,
    so the first push never waits for restart recovery); and the status server, not
    added (its health port opens before anything starts; it starts last). Raises as
    :func:`_made` says."""
    m = import_first_path()
    if source is None:
        source = _made("config-source", lambda: m.ambient_source.build(ctx))
    registrar = _made("registration", lambda: m.registration.build(ctx, source))
    index = _made("ambient-index", lambda: m.ambient_index.build(ctx, source.store))
    authn = _made("authn", lambda: m.tls_authn.build(ctx))
    sds = _made("sds", lambda: m.sds_server.build(ctx, source.store, authn.authenticator,
                                                kube_api=source.kube_api))
    # the CA Secret's first read overlaps the LISTs and the first index build (issue 28)
    source.when_connected(sds.prefetch_ca)
    xds = _made("xds", lambda: m.xds_server.build(ctx, index.index, sds, authn.authenticator,
                                                tls_services=mount_ca(sds), store=source.store))
    for component in (source, registrar, index, authn, sds, xds):
        if component is not None:
            ctx.add(component)
    status = _made("status", lambda: m.status_server.build(
        ctx, None, index.index, None, waypoints=xds.waypoints))
    return FirstPath(source=source, registration=registrar, index=index, authn=authn,
                     sds=sds, xds=xds, status=status)


def build_rest(ctx: AgentContext, first: FirstPath) -> Components:
    """Construct the components after the first push (ZDS, the waypoint status writer,
    enrollment and the CNI parts that hand it work), each handed the ones it uses, hand
    enrollment and ZDS to the status server, and add them and then status (last: it
    reports the others' readiness) to ``ctx``. Returns every component. Raises as
    :func:`_made` says."""
    m = import_rest()
    source, registrar = first.source, first.registration
    zds = _made("zds", lambda: m.zds_server.build(ctx))
    enrollment = _made("enrollment",
                       lambda: m.enrollment_zds.build(ctx, zds, source, registrar))
    components = Components(
        source=source, registration=registrar, index=first.index, authn=first.authn,
        sds=first.sds, zds=zds, enrollment=enrollment,
        snapshot=_made("cni-snapshot", lambda: m.snapshot.build(ctx, source)),
        installer=_made("cni-installer", lambda: m.install.build(ctx)),
        events=_made("cni-events",
                     lambda: m.eventserver.build(ctx, source, enrollment, registrar)),
        xds=first.xds,
        waypoint_status=_made("waypoint-status", lambda: m.status_writer.build(
            ctx, source.store, source.kube_api)),
        status=first.status)
    first.status.attach(enrollment, zds)
    for component in components.in_start_order():
        if component.name not in ctx.components:
            ctx.add(component)
    return components


def build(ctx: AgentContext, source: ConfigSource | None = None) -> Components:
    """Every enabled component at once (:func:`build_first_path` then
    :func:`build_rest`), in ``ctx`` in start order; for callers that start them together
    (tests, the metrics table). Raises as :func:`_made` says."""
    return build_rest(ctx, build_first_path(ctx, source))


def mount_ca(sds: SdsServer) -> Callable[[grpc.aio.Server], list[str]]:
    """The xDS TLS port's ``tls_services`` hook (:data:`ambient.xds.server.TlsServices`):
    mounts the ``IstioCertificateService`` of ``sds`` (the embedded CA's, or with a remote
    Istio CA the one that forwards to it), as istiod serves xDS and the CA on 15012. Wired
    here so that ambient imports nothing of SDS."""

    def mount(server: grpc.aio.Server) -> list[str]:
        servicer = sds.ca_servicer()  # known once sds started (the hook runs at xDS start)
        if servicer is None:  # no CA at all (never in the daemon)
            return []
        return [servicer.add_to_server(server)]  # the CA registers itself, returns its name

    return mount


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
        try:
            # O_NOFOLLOW: a symlink planted at agent.lock is refused, never written through
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
        except OSError as e:
            why = "is a symlink (refused, not followed)" if e.errno == errno.ELOOP else \
                e.strerror or str(e)
            raise ConfigError("state_dir", str(self.path.parent),
                              f"lock file {self.path} {why}", origin) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ConfigError("state_dir", str(self.path.parent),
                              f"another ambient-agent (pid {holder}) is using it", origin) from None
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError as e:  # ENOSPC/EDQUOT/EIO: a full state dir; leave nothing behind
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            os.close(fd)
            raise ConfigError("state_dir", str(self.path.parent),
                              f"cannot write lock file {self.path}: "
                              f"{errno.errorcode.get(e.errno or 0, '?')} "
                              f"({e.strerror or e})", origin) from None
        self.fd = fd

    def release(self) -> None:
        """Unlinks and closes the lock; an unlink refused (EPERM on an immutable dir,
        EROFS) is one WARN naming the file, never an exception: shutdown goes on."""
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("cannot remove lock file %s: %s (%s); the lock itself is released",
                        self.path, errno.errorcode.get(e.errno or 0, '?'), e.strerror or e)
        os.close(self.fd)
        self.fd = None


class StateDirWatch(Component):
    """Notices the state dir or its ``agent.lock`` vanishing or being replaced under a
    running agent (``rm -rf`` of it: the sockets and the lock are gone, every pod ADD
    would fail while /readyz said 200). Once a second it compares ``stat`` of the dir and
    of ``agent.lock`` with the inodes held at start (two syscalls); on a change it is not
    ready, naming the dir and what is missing, with one ERROR line per transition, and
    ready again (one INFO) when both reappear as the same inodes. It does not recreate
    anything: a fresh lock file would not be the one we hold."""

    name = "statedir"
    INTERVAL = 1.0  # seconds between checks

    def __init__(self, lock: StateDirLock):
        self.lock = lock
        self.dir = lock.path.parent
        self._want: tuple[tuple[int, int], tuple[int, int]] | None = None
        self._problem = ""
        self._task: asyncio.Task[None] | None = None

    def _check(self) -> str:
        """``""`` when intact, else what is missing or replaced."""
        assert self._want is not None
        wd, wl = self._want
        try:
            st = os.stat(self.dir)
        except OSError as e:
            return f"state dir {self.dir} is gone ({e.strerror})"
        if (st.st_dev, st.st_ino) != wd:
            return f"state dir {self.dir} was replaced (not the directory the agent started on)"
        try:
            sl = os.lstat(self.lock.path)
        except OSError as e:
            return f"lock file {self.lock.path} is gone ({e.strerror})"
        if (sl.st_dev, sl.st_ino) != wl:
            return f"lock file {self.lock.path} was replaced"
        return ""

    def poll(self) -> None:
        """One check; logs on a transition only."""
        problem = self._check()
        if problem and problem != self._problem:
            log.error("%s: the agent's sockets and lock live there; pod ADDs fail until "
                      "it is restored (restart the agent)", problem)
        elif not problem and self._problem:
            log.info("state dir %s is intact again", self.dir)
        self._problem = problem

    async def start(self) -> None:
        assert self.lock.fd is not None
        st, sl = os.stat(self.dir), os.fstat(self.lock.fd)
        self._want = ((st.st_dev, st.st_ino), (sl.st_dev, sl.st_ino))
        self._task = asyncio.create_task(self._run(), name="statedir-watch")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.INTERVAL)
            try:
                self.poll()
            except Exception:  # never dies: a check that fails says so
                log.exception("state dir check failed")

    async def stop(self, grace: float) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def ready(self) -> tuple[bool, str]:
        return (not self._problem, self._problem)

    def debug_state(self) -> dict[str, str]:
        return {"state_dir": str(self.dir), "problem": self._problem}


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
    the ones already started); ``await agent.stop()`` is idempotent. Once started,
    ``agent.components`` holds every component, typed (``agent.components.zds``), and the
    ones tests and the demo read most have their own attribute (``agent.enrollment``).
    """

    def __init__(self, config: Config, clock: Callable[[], float] | None = None):
        self.config = config
        self.ctx = AgentContext(config, clock=clock)
        self.supervisor = Supervisor(self.ctx)
        self._stopped = False
        self._lock: StateDirLock | None = None
        self._components: Components | None = None  # once every component is built
        self._first: FirstPath | None = None  # the first push's path, built first
        self._early: ConfigSource | None = None  # the source begun before it

    @property
    def components(self) -> Components:
        """Every component, as :func:`build_rest` returned them; RuntimeError before
        :meth:`start` built them all (they are, once it returned)."""
        if self._components is None:
            raise RuntimeError("the agent's components are built by start()")
        return self._components

    @property
    def source(self) -> ConfigSource:
        return self.components.source

    @property
    def enrollment(self) -> Enrollment:
        return self.components.enrollment

    @property
    def zds(self) -> ZdsServer:
        return self.components.zds

    @property
    def sds(self) -> SdsServer:
        return self.components.sds

    @property
    def xds(self) -> XdsServer:
        return self.components.xds

    async def start(self) -> "Agent":
        made_state_dir = not os.path.isdir(self.config.state_dir)
        state = prepare_state_dir(self.config)
        lock = self._lock = StateDirLock(state)
        try:
            lock.acquire(self.config.origins.get("state_dir", ""))
            # the whole open-files allowance, and the listener caps fitted inside it
            note = fdbudget.describe(self.config, fdbudget.raise_soft_limit())
            if note:
                log.warning("%s", note)
            # every TCP port checked before any component touches the node (host probe
            # rules, the CNI conflist), so a busy port leaves nothing behind
            agent_config.ensure_ports_free(self.config)
            # so is the ZDS socket: found served only when the zds component started,
            # after the CA, the mesh root and SDS had been set up (and left behind)
            from zds.served import refuse_if_served  # light: zds.server loads later
            await asyncio.get_running_loop().run_in_executor(
                None, refuse_if_served, self.config.ztunnel_uds_address)
            # enrollment (always built) needs CAP_NET_ADMIN for the host and in-pod rules:
            # without it the agent failed only after SDS, ZDS and xDS had started
            if not has_net_admin():
                raise ComponentStartError("enrollment", PermissionError(
                    "this process lacks CAP_NET_ADMIN (run as root, or grant CAP_NET_ADMIN "
                    "and CAP_SYS_ADMIN): the host probe rules and in-pod rules need it"))
            set_created_series(self.config.metrics_created_series)
            early = await self._begin_source()
            first = self._first = build_first_path(self.ctx, source=early)
            pause = None
            if first is not None:  # (tests replace build_first_path with their own)
                # liveness from the start: /healthz answers while components start (a
                # slow API server), /readyz says which one is not ready yet
                await first.status.start_health()
                self.ctx.pending = "the components after the first push are not built yet"
                pause = StartPause(FIRST_PUSH_PATH_ENDS, first.xds.first_push,
                                   FIRST_PUSH_WAIT, then=lambda: self._build_rest(first, lock))
            else:
                self.ctx.add(StateDirWatch(lock))
            await self.supervisor.start(pause)
        except BaseException:
            # Started components were stopped by the supervisor (the early health port
            # too); free the state dir, so a caller that does not call stop() can start
            # another agent on it.
            if self._first is not None and \
                    self._first.status not in self.supervisor.started:
                await self._first.status.stop(0.5)
            if self._early is not None and self._early not in self.supervisor.started:
                await self._early.stop(0.5)  # its LISTs and watches
            lock.release()
            if made_state_dir:  # a refused start leaves no empty state dir behind: rmdir
                with contextlib.suppress(OSError):  # fails when anything is in it
                    os.rmdir(state)
            raise
        log.info("agent ready %.2fs after the process started: %s", process_age(),
                 ", ".join(self.ctx.components) or "no components")
        return self

    async def _build_rest(self, first: FirstPath, lock: StateDirLock) -> None:
        """The pause's ``then``: import the modules of the components after the first
        push on a worker thread (the loop keeps serving xDS meanwhile), build them
        (:func:`build_rest`) and the state dir watch over ``lock``, for the supervisor
        to start."""
        try:
            await self.ctx.run_blocking(import_rest)
        except Exception:  # noqa: BLE001 - build_rest() imports again and raises it
            log.debug("importing the components on a worker thread failed", exc_info=True)
        log.debug("start: the rest imported at %.3fs", process_age())
        self._components = build_rest(self.ctx, first)
        self.ctx.add(StateDirWatch(lock))
        self.ctx.pending = ""

    async def _begin_source(self) -> ConfigSource | None:
        """With the Kubernetes config source: build it and send its LISTs (reads only:
        nothing on the node or in the cluster changes before the first path is built),
        then import the first path's other modules (:func:`import_first_path`) on a
        worker thread while the loop receives the lists (the API server prepares them
        meanwhile; at 1k pods the imports and the LISTs took ~0.6 s and ~0.3 s one after
        the other). Returns the begun source for :func:`build_first_path`, or None
        (files source: built there as before). An import error is left to
        :func:`build_first_path`, which raises it as it always did."""
        if self.config.config_source != "kubernetes":
            return None
        source = self._early = build_source(self.ctx)
        try:
            await source.begin()
        except ConfigError:  # no kubeconfig and not in a pod: a usage error, as it is
            raise
        except Exception as e:
            raise ComponentStartError("config-source", e) from e
        log.debug("start: LISTs sent %.3fs after the process started", process_age())
        try:
            await self.ctx.run_blocking(import_first_path)
        except Exception:  # noqa: BLE001 - build_first_path() imports again and raises it
            log.debug("importing the components on a worker thread failed", exc_info=True)
        log.debug("start: the first path imported at %.3fs", process_age())
        return source

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


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Signals whose default action would kill the process with no stop at all (sockets and
# the lock left behind): a stray `kill -USR2` or a log rotator's HUP must not do that.
IGNORED_SIGNALS = (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def exit_now(signum: int, agent: "Agent | None" = None) -> None:
    """The second stop signal: remove what the agent leaves on disk (its socket files,
    the state dir lock), then end the process with 128+``signum`` without waiting for
    anything. Never returns."""
    try:
        unixsocket.remove_published()
        if agent is not None and agent._lock is not None:
            agent._lock.release()
    finally:
        os._exit(128 + signum)


async def run(config: Config) -> int:
    """Run the agent until SIGTERM/SIGINT or a quit request. Returns the exit code (0
    after a graceful stop; a second stop signal ends the process with 128+signal)."""
    loop = asyncio.get_running_loop()
    agent = Agent(config)
    signals_seen: list[int] = []

    def on_signal(signum: int) -> None:
        if signals_seen:
            log.warning("second signal %s: exiting now", signal.Signals(signum).name)
            exit_now(signum, agent)
        signals_seen.append(signum)
        agent.ctx.request_shutdown(signal.Signals(signum).name)

    def ignored(signum: int) -> None:
        log.warning("%s ignored: the configuration is read once, at start (restart the agent "
                    "to apply a change)", signal.Signals(signum).name)

    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, on_signal, signum)
    for signum in IGNORED_SIGNALS:
        loop.add_signal_handler(signum, ignored, signum)
    try:
        await agent.start()
        sdnotify.notify("READY=1")
        await agent.wait()
    finally:
        sdnotify.notify("STOPPING=1")
        try:
            await agent.stop()
        finally:
            # Until the process ends (executor threads are joined after this), a stop
            # signal still exits 128+signal and the ignored ones stay ignored: never the
            # default action, which would kill the process by the signal.
            for signum in STOP_SIGNALS + IGNORED_SIGNALS:
                loop.remove_signal_handler(signum)
            for signum in STOP_SIGNALS:
                signal.signal(signum, lambda n, _frame: exit_now(n))
            for signum in IGNORED_SIGNALS:
                signal.signal(signum, signal.SIG_IGN)
    return 0


WORKER_JOIN_TIMEOUT = 10.0  # seconds the process waits for worker threads at exit


def join_workers(timeout: float = WORKER_JOIN_TIMEOUT) -> list[str]:
    """Wait up to ``timeout`` seconds for the non-daemon threads other than this one (the
    components' worker pools, whose jobs finish after the loop closed) to end, as the
    interpreter would at exit; returns the names of those still running. Blocking."""
    deadline = time.monotonic() + timeout
    me = threading.current_thread()
    for thread in threading.enumerate():
        if thread is me or thread.daemon:
            continue
        thread.join(max(0.0, deadline - time.monotonic()))
    return sorted(t.name for t in threading.enumerate()
                  if t is not me and not t.daemon and t.is_alive())


def stopped(code: int, timeout: float = WORKER_JOIN_TIMEOUT) -> int:
    """After :func:`run` returned: log "agent stopped" once it is true (the worker
    threads the interpreter would wait for are done, up to ``timeout`` seconds), or name
    those still busy. Returns ``code``."""
    busy = join_workers(timeout)
    if busy:
        log.warning("agent stopped; %d worker threads still busy (%s): the process exits "
                    "when they end", len(busy), ", ".join(busy[:5]))
    else:
        log.info("agent stopped")
    return code
