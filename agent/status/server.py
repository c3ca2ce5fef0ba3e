"""The status server (component ``status``): readiness, app probes, merged metrics, quit/drain, debug.

Three aiohttp listeners (``docs/status.md``):

``status_port`` (15020), on ``status_address`` (default: all addresses):

- ``/healthz/ready`` — 200 (empty) when every component is ready, the agent is not
  shutting down or draining, a ztunnel is connected when enrollment runs (else an ambient
  pod's CNI ADD would block) and, with ``envoy_admin_port`` set, Envoy's admin stats say
  config received and LIVE; else 503 with one line naming every part not ready and its
  last error (``zds: ...; config-source: ...``; :mod:`agent.status.readiness`: bounded,
  escaped, secrets redacted). Transitions are logged once per change, not per probe.
- ``/app-health/<container>/{livez,readyz,startupz}``, ``/app-lifecycle/<container>/
  {prestopz,poststartz}`` — the rewritten kubelet probes from ``ISTIO_KUBE_APP_PROBERS``
  (:mod:`agent.status.probes`); an unknown path → 400.
- ``/stats/prometheus``, ``/metrics`` — merged metrics (:mod:`agent.status.metrics_merge`);
  loopback-only when ``metrics_localhost_only``.
- ``/quitquitquit``, ``/drain``, ``/debug/...`` — 403 naming the admin socket: on a host
  daemon loopback is every local user and every host-network pod, and these stop,
  reconfigure or expose the agent.
- anything else → 404.

``monitoring_port`` (15014; 0: off), on ``status_address``: istio-cni's ``/metrics``, its
node-agent families under upstream's names only (:mod:`agent.status.monitoring`).

``health_port`` (8000): ``/healthz`` always 200; ``/readyz`` 200 when every component is
ready, else 503 ``Service Unavailable: <reasons>`` in the same form (not latched). It listens from the start
of the process (:meth:`StatusServer.start_health`, before any component starts), so
liveness holds through a slow start while readiness stays false.

``admin_socket`` (``<state dir>/admin.sock``, mode 0600, so root only; the peer's
``SO_PEERCRED`` uid must also be root or the agent's own): ``POST /quitquitquit``,
``POST /drain`` (POST only, 405), ``/debug/...`` JSON (:mod:`agent.status.debug`),
``/healthz/ready``, ``POST /logging[?level=SPEC][&reset]`` (ztunnel's admin ``/logging``:
list, change or reset the log levels without a restart; :func:`agent.core.logsetup.change_levels`).
``ambient-agent status`` and ``ambient-agent log-level`` read it.

Every listener is bounded (:mod:`agent.core.listeners`): ``status_idle_timeout`` for idle
connections and unfinished headers; the TCP ports hold at most ``status_max_connections`` /
``health_max_connections`` connections (fitted to the open-files limit by
:mod:`agent.core.fdbudget`) and ``max_connections_per_source`` from one address; past a cap
a new connection takes the place of the least recently active one with no request in
progress (the health port: of any one), so idle connections never keep kubelet's probes
out, and only when every candidate is serving a request is it answered 503 and closed;
malformed HTTP is one DEBUG line.

``start()`` raises :class:`agent.core.config.ConfigError` naming ``kube_app_probers`` or
``prometheus_annotations`` when those values are invalid, so the CLI prints one line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Any, Awaitable, Callable, Protocol

import aiohttp
from aiohttp import web
from prometheus_client import Gauge

from agent.core import fdbudget, listeners, logsetup, unixsocket
from agent.core.config import ConfigError
from agent.core.lifecycle import AgentContext, Component
from agent.core.appprobes import AppProbe, ProberConfigError, parse_probers
from agent.core.peercred import peer_cred
from agent.core.scrapetargets import AnnotationsError, ScrapeTarget, parse_annotations
from agent.status import debug, metrics_merge, monitoring, probes
from agent.status.access import is_loopback
from agent.status.compression import compress_large
from agent.status.readiness import EnvoyReadiness, NotReady, ReadinessLog, clean_reason, summary
from agent.status.mesh import DebugState, EnrolledPods, MeshIndex, MeshParts, WaypointStatus

log = logging.getLogger(__name__)


class PodEnrollment(EnrolledPods, Protocol):
    """What status reads of enrollment (``cni.enrollment.Enrollment`` has it): the
    records for ``/debug/mesh`` and what would block a new pod's CNI ADD."""

    def add_blocker(self) -> str:
        """"" when an ambient ADD can complete now, else why not (no ztunnel)."""


class StatusServer(Component):
    """The ``status`` component. After ``start()``, ``port`` and ``health_port`` hold the
    bound ports (useful when configured as 0). ``enrollment``, ``index`` and ``zds`` are
    the components readiness and ``/debug/mesh`` read (None: not in this agent)."""

    name = "status"

    def __init__(self, ctx: AgentContext, *, enrollment: PodEnrollment | None = None,
                 index: MeshIndex | None = None, zds: DebugState | None = None,
                 waypoints: WaypointStatus | None = None):
        self.ctx = ctx
        self.enrollment = enrollment
        self.mesh = MeshParts(index=index, enrollment=enrollment, zds=zds, waypoints=waypoints)
        cfg = ctx.config
        self.port = 0
        self.health_port = 0
        self.probes: dict[str, AppProbe] = {}
        self.app_targets: list[ScrapeTarget] = []
        self.probe_target = probes.ProbeTarget(
            host=cfg.instance_ip or "127.0.0.1", source_ip=cfg.probe_source_ip,
            source_ip6=cfg.probe_source_ipv6, status_port=cfg.status_port)
        self.envoy_admin = (f"http://127.0.0.1:{cfg.envoy_admin_port}"
                            if cfg.envoy_admin_port else None)
        self.envoy_ready: EnvoyReadiness | None = None
        if self.envoy_admin:
            startup = Gauge("istio_agent_startup_duration_seconds",
                            "Seconds from agent start until Envoy first became LIVE",
                            registry=ctx.registry)
            self.envoy_ready = EnvoyReadiness(self.envoy_admin, self._terminated, startup.set)
        # Built here, not at start, so its metrics are in the registry from the beginning
        # (the metrics table in docs/status.md is checked against a built agent).
        self.merger = metrics_merge.MetricsMerger(
            ctx.registry, f"{self.envoy_admin}/stats/prometheus" if self.envoy_admin else None,
            [], self.probe_target.host, ctx.run_blocking)
        self.shutdown_cause = ""
        self.readiness_log = ReadinessLog(log)  # transitions of both endpoints
        self._runners: list[web.AppRunner] = []
        self.sites: dict[str, listeners.BoundedTCPSite] = {}
        listeners.ListenerMetrics.of(ctx.registry)  # registered at build, like every metric
        self.admin_socket = ""
        self.monitoring_port = 0  # bound port of istio-cni's /metrics (0: off)
        self._session: aiohttp.ClientSession | None = None

    def attach(self, enrollment: PodEnrollment | None, zds: DebugState | None) -> None:
        """Hand over the components built after this one (``agent.daemon`` builds the
        status server before the first push, for its early health port, and enrollment
        and ZDS after it): readiness and ``/debug/mesh`` read them from now on."""
        self.enrollment = enrollment
        self.mesh = dataclasses.replace(self.mesh, enrollment=enrollment, zds=zds)

    # --- configuration ---------------------------------------------------------------

    def _parse_config(self) -> None:
        cfg = self.ctx.config
        try:
            self.probes = parse_probers(cfg.kube_app_probers)
        except ProberConfigError as e:
            raise ConfigError("kube_app_probers", _short(cfg.kube_app_probers), str(e),
                              cfg.origins.get("kube_app_probers", "")) from None
        given = cfg.origins.get("prometheus_annotations", "default") != "default"
        try:
            self.app_targets = parse_annotations(
                cfg.prometheus_annotations, cfg.status_port or 15020, given)
        except AnnotationsError as e:
            raise ConfigError("prometheus_annotations", _short(cfg.prometheus_annotations),
                              str(e), cfg.origins.get("prometheus_annotations", "")) from None

    # --- lifecycle -------------------------------------------------------------------

    async def start_health(self) -> None:
        """Open the health port now, before any component starts (``agent.daemon`` calls it
        first): ``/healthz`` answers 200 from the start of the process, so kubelet's
        liveness probe passes while a slow start (an unreachable API server) keeps
        ``/readyz`` at 503 naming the component not ready yet. Idempotent; :meth:`start`
        opens it when nobody did. Raises :class:`ConfigError` naming ``health_port`` when
        it cannot listen."""
        if self.health_port:
            return
        cfg = self.ctx.config
        try:
            runner = await self._serve(self._health_app(), cfg.status_address or None,
                                       cfg.health_port, "health",
                                       fdbudget.listener_caps(cfg)["health_max_connections"])
            self.health_port = _bound_port(runner)
        except OSError as e:
            await self.stop(1.0)
            raise ConfigError("health_port", cfg.health_port,
                              f"cannot listen: {e.strerror or e}") from None

    async def start(self) -> None:
        self._parse_config()
        cfg = self.ctx.config
        await self.start_health()
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(use_dns_cache=False, force_close=True))
        self.merger.app_targets = self.app_targets
        await self.merger.start()
        host = cfg.status_address or None
        caps = fdbudget.listener_caps(cfg)
        setting = "status_port"
        try:
            status_runner = await self._serve(self._status_app(), host, cfg.status_port,
                                              "status", caps["status_max_connections"])
            self.port = _bound_port(status_runner)
            if cfg.monitoring_port:
                setting = "monitoring_port"
                monitoring_runner = await self._serve(
                    monitoring.app(self.ctx.registry), host, cfg.monitoring_port,
                    "monitoring", caps["health_max_connections"])
                self.monitoring_port = _bound_port(monitoring_runner)
            setting = "admin_socket"
            await self._serve_admin(cfg.admin_socket)
        except OSError as e:
            await self.stop(1.0)
            raise ConfigError(setting, getattr(cfg, setting),
                              f"cannot listen: {e.strerror or e}") from None
        log.info("status server on port %d (health %d), %d app probes, %d metrics targets%s",
                 self.port, self.health_port, len(self.probes), len(self.app_targets),
                 ", Envoy " + self.envoy_admin if self.envoy_admin else "")

    def _runner(self, app: web.Application, listener: str) -> web.AppRunner:
        cfg = self.ctx.config
        return listeners.runner(app, listener, cfg.status_idle_timeout, cfg.shutdown_grace)

    async def _serve(self, app: web.Application, host: str | None, port: int,
                     listener: str, max_connections: int) -> web.AppRunner:
        runner = self._runner(app, listener)
        await runner.setup()
        self._runners.append(runner)
        site = listeners.BoundedTCPSite(runner, host, port, listener=listener,
                                        max_connections=max_connections,
                                        max_per_source=self.ctx.config.max_connections_per_source,
                                        evict="any" if listener == "health" else "quiet",
                                        registry=self.ctx.registry, reuse_address=True)
        await site.start()
        self.sites[listener] = site
        return runner

    async def _serve_admin(self, path: str) -> None:
        """The root-only admin listener: a 0600 Unix socket (parent created 0700)."""
        parent = os.path.dirname(path)
        if parent and not os.path.isdir(parent):
            os.makedirs(parent, mode=0o700, exist_ok=True)
        try:
            os.unlink(path)  # stale socket of a previous run (a live agent holds the lock)
        except FileNotFoundError:
            pass
        runner = self._runner(self._admin_app(), "admin")
        await runner.setup()
        self._runners.append(runner)
        # never reachable with looser permissions, not even briefly
        await web.SockSite(runner, unixsocket.bind_unix(path, 0o600)).start()
        self.admin_socket = path

    async def stop(self, grace: float) -> None:
        """Close both listeners and in-flight requests within ``grace`` seconds."""
        runners, self._runners = self._runners, []
        for runner in runners:
            try:
                await asyncio.wait_for(runner.cleanup(), timeout=max(grace, 0.1))
            except asyncio.TimeoutError:
                log.warning("status listener did not close within %.1fs", grace)
        await self.merger.close()
        if self._session:
            await self._session.close()
        if self.admin_socket:
            try:
                os.unlink(self.admin_socket)
            except FileNotFoundError:
                pass
            self.admin_socket = ""
        self.sites = {}
        self.port = self.monitoring_port = 0
        self.health_port = 0

    def ready(self) -> tuple[bool, str]:
        return (True, "") if self.port else (False, "not listening")

    def debug_state(self) -> Any:
        return {
            "port": self.port, "health_port": self.health_port,
            "monitoring_port": self.monitoring_port,
            "admin_socket": self.admin_socket,
            "connections": {name: {"open": site.open_connections,
                                   "cap": site.max_connections, "refused": site.refused,
                                   "evicted": site.evicted}
                            for name, site in self.sites.items()},
            "app_probes": {path: vars(p) for path, p in self.probes.items()},
            "probe_destination": self.probe_target.host,
            "probe_source": [self.probe_target.source_ip, self.probe_target.source_ip6],
            "metrics_targets": [vars(t) for t in self.app_targets],
            "envoy_admin": self.envoy_admin,
            "envoy_config_received": self.envoy_ready.config_received if self.envoy_ready else None,
            "envoy_live": self.envoy_ready.live if self.envoy_ready else None,
        }

    def _client(self) -> aiohttp.ClientSession:
        """The HTTP client for Envoy's admin port (made at start)."""
        if self._session is None:
            raise RuntimeError("the status server has not started")
        return self._session

    # --- readiness -------------------------------------------------------------------

    def _terminated(self) -> str:
        if self.ctx.shutdown.is_set():
            return self.shutdown_cause or "agent is shutting down"
        return ""

    async def not_ready(self) -> list[NotReady]:
        """Every part the status port's readiness checks that is not ready, in this
        order: ``envoy`` (with ``envoy_admin_port``: upstream's stats checks), ``agent``
        (shutting down) or ``drain`` (draining), each component not ready (by name, with its reason),
        ``ztunnel`` (an ambient CNI ADD would block for want of one). ``[]``: ready."""
        parts: list[NotReady] = []
        if self.envoy_ready is not None:
            reason = await self.envoy_ready.check(self._client())
            if reason:
                parts.append(NotReady("envoy", reason))
        parts += self._agent_parts(draining=True)
        # what a new pod needs: an ambient CNI ADD must not block for want of a ztunnel
        blocker = self.enrollment.add_blocker() if self.enrollment is not None else ""
        if blocker:
            parts.append(NotReady("ztunnel", blocker))
        return parts

    def _agent_parts(self, draining: bool) -> list[NotReady]:
        """``agent`` (shutting down), ``drain`` (draining, when ``draining``) and each
        component not ready."""
        parts: list[NotReady] = []
        cause = self._terminated()
        if cause:
            parts.append(NotReady("agent", f"server is terminated: {cause}"))
        elif draining and self.ctx.draining:
            # its own name: only the status port checks it (ReadinessLog's scopes)
            parts.append(NotReady("drain", "the agent is draining (POST /drain)"))
        parts += [NotReady(name, why) for name, why in self.ctx.not_ready()]
        return parts

    def _scope(self, status_port: bool) -> set[str]:
        """The part names one endpoint's readiness checks (:class:`ReadinessLog`)."""
        names = {"agent", "start", *self.ctx.components}
        return names | {"envoy", "drain", "ztunnel"} if status_port else names

    async def _ready(self, request: web.Request) -> web.Response:
        parts = await self.not_ready()
        self.readiness_log.observe(self._scope(status_port=True), parts)
        if parts:
            return web.Response(status=503, text=summary(parts) + "\n")
        return web.Response(status=200)

    # --- handlers --------------------------------------------------------------------

    async def _app_probe(self, request: web.Request) -> web.Response:
        probe = self.probes.get(request.path)
        if probe is None:
            # upstream's text; the path escaped (an ESC or a newline in it came back raw)
            return web.Response(status=400, text=f"app prober config does not exists for "
                                                 f"{clean_reason(request.path)}\n")
        result = await probes.run_probe(probe, self.probe_target, request.headers)
        return compress_large(web.Response(status=result.status, body=result.body))

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        if self.ctx.config.metrics_localhost_only and not is_loopback(request):
            return web.Response(status=403, text="Only requests from localhost are allowed\n")
        return await self.merger.serve(request)

    async def _quit(self, request: web.Request) -> web.Response:
        if request.method != "POST":
            raise web.HTTPMethodNotAllowed(request.method, ["POST"])
        self.shutdown_cause = "/quitquitquit called"
        # After the response is on its way: the shutdown stops this very server.
        asyncio.get_running_loop().call_soon(self.ctx.request_shutdown, self.shutdown_cause)
        return web.Response(text="OK")

    async def _drain(self, request: web.Request) -> web.Response:
        if request.method != "POST":
            raise web.HTTPMethodNotAllowed(request.method, ["POST"])
        self.ctx.draining = True
        log.info("drain requested on the admin socket")
        if self.envoy_admin:
            try:
                async with self._client().post(
                        f"{self.envoy_admin}/drain_listeners?graceful",
                        timeout=aiohttp.ClientTimeout(total=3)) as resp:
                    if resp.status != 200:
                        log.warning("Envoy drain_listeners answered %d", resp.status)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                log.warning("could not drain Envoy: %s", e)
        return web.Response(text="OK")

    def _status_app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/healthz/ready", self._ready)
        app.router.add_route("*", "/app-health/{container}/{probe}", self._app_probe)
        app.router.add_route("*", "/app-lifecycle/{container}/{probe}", self._app_probe)
        app.router.add_route("*", "/stats/prometheus", self._metrics)
        app.router.add_route("*", "/metrics", self._metrics)
        for path in ("/quitquitquit", "/drain", "/debug", "/debug/{tail:.*}"):
            app.router.add_route("*", path, self._admin_elsewhere)
        return app

    async def _admin_elsewhere(self, request: web.Request) -> web.Response:
        path = self.admin_socket or self.ctx.config.admin_socket
        method = "-X POST " if request.path in ("/quitquitquit", "/drain") else ""
        return web.Response(status=403, text=(
            f"{request.path} is served only on the agent's admin socket {path} (root only), "
            f"e.g. curl --unix-socket {path} {method}http://localhost{request.path}\n"))

    # --- admin socket ----------------------------------------------------------------

    @web.middleware
    async def _root_only(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
        """Defence in depth behind the socket's 0600 mode: the peer must be root or us."""
        sock = request.transport.get_extra_info("socket") if request.transport else None
        try:
            _, uid, _ = peer_cred(sock) if sock is not None else (0, -1, 0)
        except (OSError, TypeError, AttributeError):
            uid = -1
        if uid not in (0, os.geteuid()):
            log.warning("admin socket: refused %s %s from uid %d", request.method,
                        request.path, uid)
            return web.Response(status=403, text="the admin socket is for root only\n")
        return await handler(request)

    def _admin_app(self) -> web.Application:
        app = web.Application(middlewares=[self._root_only])
        app.router.add_route("*", "/quitquitquit", self._quit)
        app.router.add_route("*", "/drain", self._drain)
        app.router.add_route("*", "/healthz/ready", self._ready)
        app.router.add_route("*", "/logging", self._logging)
        debug.add_routes(app, self.ctx, self.mesh)
        return app

    async def _logging(self, request: web.Request) -> web.Response:
        """ztunnel's ``/logging``: POST lists the levels; ``?level=SPEC`` changes the named
        scopes (``zds=debug,sds:warn``; a bare level is the default); ``?reset`` returns to
        the start-up levels first. Answers ``current log level is SPEC``; a bad spec → 400
        naming the clause, nothing changed; not POST → 405."""
        if request.method != "POST":
            raise web.HTTPMethodNotAllowed(request.method, ["POST"])
        spec = request.query.get("level", "")
        reset = "reset" in request.query
        if spec or reset:
            try:
                levels = logsetup.change_levels(spec, reset=reset)
            except ValueError as e:
                return web.Response(status=400, text=f"invalid level spec: {e}\n")
            log.info("log levels now %s (admin socket)", logsetup.format_levels(levels))
        else:
            levels = logsetup.current_levels()
        return web.Response(text=f"current log level is {logsetup.format_levels(levels)}\n")

    # --- node agent health port (istio-cni healthServer.go) --------------------------

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="OK\n")

    async def _readyz(self, request: web.Request) -> web.Response:
        parts = self._agent_parts(draining=False)  # istio-cni's: components, not drain
        self.readiness_log.observe(self._scope(status_port=False), parts)
        if not parts:
            return web.Response(text="OK\n")
        return web.Response(status=503, text=f"Service Unavailable: {summary(parts)}\n")

    def _health_app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/healthz", self._healthz)
        app.router.add_route("*", "/readyz", self._readyz)
        return app


def _bound_port(runner: web.AppRunner) -> int:
    for addr in runner.addresses:
        if isinstance(addr, (tuple, list)) and len(addr) >= 2:
            return int(addr[1])
    raise OSError("listener has no TCP address")


def _short(value: Any, limit: int = 80) -> Any:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def build(ctx: AgentContext, enrollment: PodEnrollment, index: MeshIndex,
          zds: DebugState, waypoints: WaypointStatus | None = None) -> StatusServer:
    """The ``status`` component; ``agent.daemon`` builds and starts it last, since it
    reports the others' readiness (``waypoints``: the xDS server's waypoint
    configurations, for the waypoint rows' Gateway and route status)."""
    return StatusServer(ctx, enrollment=enrollment, index=index, zds=zds, waypoints=waypoints)

