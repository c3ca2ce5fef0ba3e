"""The workload xDS server (component ``xds``): delta ADS of Address, Workload (legacy)
and Authorization for ztunnel and waypoints (``docs/xds.md``).

- gRPC service ``envoy.service.discovery.v3.AggregatedDiscoveryService`` on grpc.aio:
  ``DeltaAggregatedResources`` (what ztunnel speaks) and ``StreamAggregatedResources``
  (state of the world, for clients that speak only that). Server reflection is on, so
  ``grpcurl`` can list, describe and call it.
- Listeners: plaintext on ``xds_address:xds_port`` (loopback by default, anonymous like
  istiod's 15010; optional shared bearer token ``xds_token_file``) and TLS on
  ``xds_tls_address:xds_tls_port`` (istiod's 15012). The TLS port is a front door
  (:mod:`agent.tlsport.frontdoor`): TLS 1.2/1.3 with ALPN h2, server certificate from the ``sds``
  component renewed before expiry (:mod:`agent.tlsport.servercert`), client certificate optional
  and verified against the mesh root when presented. Every call on it is authenticated
  by the ``authn`` chain (client certificate SPIFFE ID, or bearer token: tokens file /
  Kubernetes TokenReview); refused calls get UNAUTHENTICATED naming why. A client whose
  identity namespace differs from its node namespace is refused, as istiod does.
- Extra gRPC services mounted by the application on the same TLS port (``tls_services``,
  :data:`TlsServices`): the daemon mounts the embedded CA's ``IstioCertificateService``
  there when the ``sds`` component has one (ztunnel's default ``CA_ADDRESS`` is its
  ``XDS_ADDRESS``, as istiod serves both on 15012). This package imports nothing of SDS.
- Keepalive enforcement accepts client pings every 10 s or more, with or without
  streams (:mod:`agent.core.grpc_options`); ztunnel pings every 30 s.
- Pushes come from the index change feed (``AmbientIndex.subscribe``): the resource cache
  is invalidated at once, the fan-out to streams is debounced (``xds_debounce`` quiet
  period, at most ``xds_debounce_max`` after the first change) and merged, and each stream
  gets only the resources it wants that changed (one changed pod -> one resource).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

import grpc
from envoy.service.discovery.v3 import ads_pb2, ads_pb2_grpc, discovery_pb2
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from agent.tlsport import frontdoor
from agent.tlsport.authn import AuthenticationError, Authenticator
from agent.core import unixsocket
from agent.core.ratelimit import RefusalLog, RepeatLimiter
from agent.core.uptime import process_age
from agent.core.config import ConfigError, ensure_tcp_port_free
from agent.core.fdbudget import listener_caps
from agent.core.grpc_closed import CLOSED_STREAM_ERRORS, retrieve_later
from agent.core.grpc_decode import UndecodableRequest, add_service, decoding
from agent.core.grpc_options import KEEPALIVE_SERVER_OPTIONS, grpc_server_bounds
from agent.core.lifecycle import AgentContext, Component
from agent.core.yamlsafe import MAX_LOGGED, short_text
from agent.tlsport.servercert import ServerCertificate
from ambient.api import AmbientIndex, IndexChange, ObjectStore
from ambient.xds.generators import (ADDRESS_TYPE, AUTHORIZATION_TYPE, Generator,
                                    default_generators)
from ambient.xds.auth import AuthError, PlaintextAuth, spiffe_namespace
from ambient.xds.connection import Connection, merge_changes
from ambient.xds.metrics import XdsMetrics
from ambient.xds.node import RequestError, parse_node
from ambient.xds.stream import (PreparedResponse, Request, Response, XdsStream, check_bounds,
                                 nack_detail)
from ambient.xds.tls import TlsProvider, WorkloadCertificates, sds_tls_provider
from ambient.xds.waypoint_stream import WaypointStream, is_waypoint_request
from ambient.waypoint.options import ENVOY_TYPES, AccessLog
from ambient.waypoint.service import WaypointConfigs

log = logging.getLogger(__name__)

SERVICE_NAME = ads_pb2.DESCRIPTOR.services_by_name["AggregatedDiscoveryService"].full_name
MAX_MESSAGE = 200 * 1024 * 1024  # ztunnel's max decode size
STALL_TIMEOUT = 30.0  # seconds a response may wait for a client that does not read
NACK_LOG_WINDOW = 60.0  # seconds: one NACK line per client, type and detail
#: the types this server answers (ztunnel's; the waypoints' Envoy ones)
SERVED_TYPES = (ADDRESS_TYPE, AUTHORIZATION_TYPE, *ENVOY_TYPES)



TlsServices = Callable[[grpc.aio.Server], Sequence[str]]
"""The hook that mounts extra gRPC services next to ADS on the TLS port: called once at
start, with the gRPC server being built, when the TLS listener is on; adds its services
to that server and returns their full names (for reflection and ``debug_state``), an
empty sequence when it has none (e.g. a remote CA is configured). Its errors fail start."""


class _Servicer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    def __init__(self, server: "XdsServer"):
        self.server = server

    async def DeltaAggregatedResources(self, request_iterator: AsyncIterator[Request],
                                       context: grpc.aio.ServicerContext) -> None:
        await self.server.serve_stream(request_iterator, context, delta=True)

    async def StreamAggregatedResources(self, request_iterator: AsyncIterator[Request],
                                        context: grpc.aio.ServicerContext) -> None:
        await self.server.serve_stream(request_iterator, context, delta=False)


class XdsServer(Component):
    """The ``xds`` component. ``port``/``tls_port`` are the bound ports after start
    (useful with port 0). ``tls_port=None`` disables the TLS listener; so does a
    missing ``tls_provider`` (an async callable returning
    :class:`~agent.tlsport.servercert.TlsMaterial`, called again at each renewal).

    ``index`` may be an :class:`AmbientIndex` or a zero-argument callable returning one
    at start (the ``ambient-index`` component is built before us but started first).
    ``authenticator`` (the ``authn`` chain; default: client certificates only) decides
    who calls the TLS port; ``tls_services`` (:data:`TlsServices`) mounts more services
    there (the embedded CA's, by the daemon); ``backend_path`` is the private Unix socket
    behind the TLS front door (default: in a fresh 0700 temp directory); ``clock`` drives
    certificate renewal.
    """

    name = "xds"

    def __init__(self, index: AmbientIndex, *,
                 address: str = "127.0.0.1", port: int = 15010,
                 tls_address: str = "0.0.0.0", tls_port: int | None = None,
                 tls_provider: TlsProvider | None = None, token_file: str = "",
                 debounce: float = 0.1, debounce_max: float = 1.0,
                 registry: CollectorRegistry | None = None,
                 run_blocking: Callable[..., Awaitable[Any]] | None = None,
                 authenticator: Authenticator | None = None,
                 tls_services: TlsServices | None = None,
                 backend_path: str = "", clock: Callable[[], float] = time.time,
                 trust_domain: str = "cluster.local",
                 max_connections: int = 0, max_per_source: int = frontdoor.MAX_PER_SOURCE,
                 stall_timeout: float = STALL_TIMEOUT,
                 on_demand_refusal: str = "",
                 waypoints: WaypointConfigs | None = None):
        self._index = index
        #: why an on-demand Address subscription is refused ("" = served), see build()
        self.on_demand_refusal = on_demand_refusal
        self.waypoints = waypoints  # Envoy config for waypoint proxies (docs/waypoint.md)
        self._waypoints_dirty = False
        self._renewal: asyncio.Task | None = None
        self.trust_domain = trust_domain
        self.max_connections = max_connections  # 0: no cap (gRPC core enforces it)
        self.max_per_source = max_per_source  # the TLS front door's per-address cap
        self.stall_timeout = stall_timeout
        self.index: AmbientIndex | None = None
        self.address, self.port = address, port
        self.tls_address, self.tls_port = tls_address, tls_port
        self.tls_provider = tls_provider
        self.plaintext_auth = PlaintextAuth(token_file, run_blocking)
        self.authenticator = authenticator or Authenticator(trust_domain, run_blocking=run_blocking)
        self.tls_services = tls_services
        self.extra_services: list[str] = []  # full names mounted by tls_services
        self.backend_path = backend_path
        self.clock = clock
        self.debounce, self.debounce_max = debounce, debounce_max
        self.registry = registry or CollectorRegistry()
        self.metrics = XdsMetrics(self.registry, SERVED_TYPES)
        self._nack_log = RepeatLimiter(NACK_LOG_WINDOW)
        # a client retrying with a bad or missing token: one line per source per minute
        self._refusal_log = RefusalLog(log, "xds")
        self.generators: dict[str, Generator] = {}
        self.connections: dict[int, Connection] = {}
        self._server: grpc.aio.Server | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._pending: IndexChange | None = None
        self._first_change = 0.0
        self._last_change = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.certificate: ServerCertificate | None = None
        self.front_door: frontdoor.TlsFrontDoor | None = None
        self._tls_note = "disabled"
        self.pushes = 0
        #: set once a client was sent its complete initial Address response (every
        #: response answering that request written): the cold start's first push.
        #: ``agent.daemon`` starts the components that push does not need after it.
        self.first_push = asyncio.Event()

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop(0)
            raise

    async def _start(self) -> None:
        index = self.index = self._index
        self.generators = default_generators(index)
        self._unsubscribe = index.subscribe(self.on_index_change)
        if self.waypoints is not None:
            self.waypoints.start()
            self.waypoints.on_change(self.on_waypoint_change)
            self._renewal = asyncio.create_task(self._renew_waypoint_certificates())
        server = grpc.aio.server(options=[("grpc.max_send_message_length", MAX_MESSAGE),
                                          ("grpc.max_receive_message_length", MAX_MESSAGE),
                                          ("grpc.so_reuseport", 0),
                                          *KEEPALIVE_SERVER_OPTIONS,
                                          *grpc_server_bounds(self.max_connections)])
        add_service(server, SERVICE_NAME, _handlers(_Servicer(self)))
        services = [SERVICE_NAME, reflection.SERVICE_NAME]
        tls = self.tls_port is not None and self.tls_provider is not None
        if tls and self.tls_services is not None:
            self.extra_services = list(self.tls_services(server))
            services.extend(self.extra_services)
        reflection.enable_server_reflection(services, server)
        ensure_tcp_port_free("xds_port", self.address, self.port)
        bound = server.add_insecure_port(f"{_host(self.address)}:{self.port}")
        if bound == 0:
            raise ConfigError("xds_port", self.port, f"gRPC cannot bind "
                              f"{self.address}:{self.port} (check xds_address)")
        self.port = bound
        if self.tls_port is not None and self.tls_provider is not None:
            ensure_tcp_port_free("xds_tls_port", self.tls_address, self.tls_port)
            self.certificate = ServerCertificate("xds_tls_port", self.tls_provider,
                                                 clock=self.clock)
            await self.certificate.start()
            if not self.backend_path:
                import tempfile

                self.backend_path = f"{tempfile.mkdtemp(prefix='ambient-xds-')}/xds.sock"
            server.add_insecure_port("unix:" + self.backend_path)
            unixsocket.note_published(self.backend_path)
        elif self.tls_port is not None:
            self._tls_note = "no certificate provider (sds component absent)"
            log.warning("xds: TLS listener on port %s skipped: %s", self.tls_port, self._tls_note)
            self.tls_port = None
        await server.start()
        self._server = server
        if self.tls_port is not None and self.certificate is not None:
            self.front_door = frontdoor.TlsFrontDoor(
                "xds_tls_port", self.tls_address, self.tls_port, self.backend_path,
                self.certificate, **({"max_connections": self.max_connections}
                                     if self.max_connections else {}),
                max_per_source=self.max_per_source)
            try:
                await self.front_door.start()
            except OSError as e:
                raise ConfigError("xds_tls_port", self.tls_port,
                                  f"cannot listen on {self.tls_address}:{self.tls_port}: "
                                  f"{e.strerror or e}") from None
            self.authenticator.add_front_door(self.front_door)
            self.tls_port = self.front_door.port
            self._tls_note = "serving"
        log.info("xds: serving plaintext on %s:%d%s", self.address, self.port,
                 f", TLS ({self._tls_served()}) on "
                 f"{self.tls_address}:{self.tls_port}" if self.tls_port else "")

    async def stop(self, grace: float) -> None:
        if self._unsubscribe:
            self._unsubscribe()
            self._unsubscribe = None
        if self._timer:
            self._timer.cancel()
        if self._renewal:
            self._renewal.cancel()
            self._renewal = None
        if self.waypoints is not None:
            self.waypoints.stop()
        if self.front_door:
            self.authenticator.remove_front_door(self.front_door)
            await self.front_door.stop()
            self.front_door = None
        if self.certificate:
            await self.certificate.stop()
        for conn in list(self.connections.values()):
            conn.inbox.put_nowait(Connection.EOF)
        if self._server:
            await self._server.stop(grace)
            self._server = None
        frontdoor.remove_private_socket(self.backend_path)

    def _tls_served(self) -> str:
        """What the TLS port serves, for logs and ``debug_state``: ``xDS + <service>...``."""
        return " + ".join(["xDS", *(n.rsplit(".", 1)[-1] for n in self.extra_services)])

    def ready(self) -> tuple[bool, str]:
        return (self._server is not None, "" if self._server else "not started")

    # ---------------------------------------------------------------- auth
    def _peer(self, context: grpc.aio.ServicerContext) -> str:
        """The client's address for logs: on the TLS port gRPC only sees the front
        door's abstract socket (``unix-abstract:...``), the front door knows the TCP peer."""
        tls = self.authenticator.tls_peer(context)
        return tls.remote if tls is not None else context.peer()

    async def _authenticate(self, context: grpc.aio.ServicerContext) -> str | None:
        """The caller's SPIFFE ID (TLS port) or None (plaintext port). Raises AuthError."""
        if self.authenticator.tls_peer(context) is None:
            if not context.peer().startswith(("ipv4:", "ipv6:")):
                raise AuthError(grpc.StatusCode.UNAUTHENTICATED,
                                "authentication failure: the connection did not come through "
                                "the TLS port")
            await self.plaintext_auth.authenticate(context)
            return None
        try:
            caller = await self.authenticator.authenticate(context)
        except AuthenticationError as e:
            raise AuthError(grpc.StatusCode.UNAUTHENTICATED,
                            f"authentication failure: {e}") from None
        return caller.spiffe_id

    # ---------------------------------------------------------------- index feed
    def on_index_change(self, change: IndexChange) -> None:
        """The index's updater: invalidate cached resources now, fan out debounced."""
        if change.empty():
            return
        for gen in self.generators.values():
            gen.invalidate(change)
        if self.waypoints is not None:
            self.waypoints.invalidate(change)
        now = time.monotonic()
        if self._pending is None:
            self._pending, self._first_change = change, now
        else:
            self._pending = merge_changes(self._pending, change)
        self._schedule(now)

    def on_waypoint_change(self) -> None:
        """A change only waypoints see (a targetRef policy, a certificate renewal): the
        same debounced fan-out, to waypoint streams only."""
        now = time.monotonic()
        if self._pending is None and not self._waypoints_dirty:
            self._first_change = now
        self._waypoints_dirty = True
        self._schedule(now)

    def _schedule(self, now: float) -> None:
        """A change at ``now`` (monotonic seconds): the fan-out happens once ``debounce``
        seconds passed without a change, or ``debounce_max`` seconds after the first
        change since the last fan-out, whichever comes first. istiod's debounce
        (pilot/pkg/xds/discovery.go): the first change arms one timer; a later change only
        moves the last-change time; when the timer fires (:meth:`_on_timer`) it fans out,
        or re-arms for what is left of the quiet time. One timer per burst, not one
        cancelled and made again per change (CPU per change burst, issue 28)."""
        self._last_change = now
        if self._timer is None:
            self._arm(now)

    def _arm(self, now: float) -> None:
        due = min(self._last_change + self.debounce, self._first_change + self.debounce_max)
        self._timer = asyncio.get_running_loop().call_later(max(0.0, due - now),
                                                             self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        now = time.monotonic()
        if (now - self._last_change >= self.debounce
                or now - self._first_change >= self.debounce_max):
            self._flush()
        else:  # changes came after the timer was armed: the rest of the quiet time
            self._arm(now)

    def _flush(self) -> None:
        change, since = self._pending, self._first_change
        waypoints, self._waypoints_dirty = self._waypoints_dirty, False
        self._pending = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if change is None and not waypoints:
            return
        self.pushes += 1
        for conn in self.connections.values():
            if isinstance(conn.state, WaypointStream):
                conn.notify(change or IndexChange(), since)
            elif change is not None:
                conn.notify(change, since)

    async def _renew_waypoint_certificates(self) -> None:
        """Wake waypoint streams when a certificate they hold is due (half its life)."""
        assert self.waypoints is not None
        while True:
            await asyncio.sleep(30.0)
            due = self.waypoints.next_renewal()
            if due is not None and self.clock() >= due:
                self.on_waypoint_change()

    # ---------------------------------------------------------------- streams
    async def serve_stream(self, request_iterator: AsyncIterator[Request],
                           context: grpc.aio.ServicerContext, delta: bool) -> None:
        try:
            identity = await self._authenticate(context)
        except AuthError as e:
            self._refusal_log.refused(self._peer(context), e)
            # Answer after the client's first request: a gRPC client still writing its
            # initial requests would otherwise see a local write failure (INTERNAL)
            # instead of this status.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(request_iterator.__anext__(), 1.0)
            await context.abort(e.code, str(e))
            return
        assert self.index is not None  # set by start(), before the server accepts a call
        state: XdsStream | WaypointStream = XdsStream(
            self.generators, self.index, peer=self._peer(context), identity=identity,
            delta=delta)
        conn = Connection(state)
        self.connections[state.id] = conn
        reader = asyncio.create_task(self._read(request_iterator, conn))
        try:
            while True:
                item = await conn.inbox.get()
                if item is Connection.EOF:
                    return
                if isinstance(item, UndecodableRequest):
                    # a client's garbage ends its stream with a status naming it, not OK
                    log.warning("xds: stream %d from %s: %s", state.id, self._peer(context),
                                item)
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(item))
                    return
                if isinstance(item, BaseException):
                    log.debug("xds: stream %d ended: %r", state.id, item)
                    return
                if isinstance(conn.state, WaypointStream):
                    await conn.state.prepare()  # its certificate, before anything is answered
                if item is Connection.PUSH:
                    change, since = conn.take()
                    if change is None:
                        continue
                    responses = conn.state.handle_push(change)
                else:
                    since = None
                    if (self.waypoints is not None and isinstance(conn.state, XdsStream)
                            and conn.state.node is None and is_waypoint_request(item)):
                        # an Envoy waypoint: its own stream, its certificate issued first
                        try:
                            state = conn.state = self._waypoint_stream(conn.state, item)
                        except RequestError as e:
                            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                                short_text(str(e), MAX_LOGGED * 2))
                            return
                        await state.prepare()
                    answered = self._handle_request(conn.state, conn, item)
                    if answered is None:
                        code = (grpc.StatusCode[conn.error_code] if conn.error_code
                                else grpc.StatusCode.INVALID_ARGUMENT)
                        await context.abort(code, conn.error)
                        return
                    responses = answered
                for resp in responses:
                    self._count(resp, since)
                    if not await self._write(context, conn, resp):
                        return
                if since is None and not self.first_push.is_set() and any(
                        resp.type_url == ADDRESS_TYPE for resp in responses):
                    self.first_push.set()
                    log.debug("xds: first complete push (stream %d) %.3fs after the process "
                              "started", state.id, process_age())
        finally:
            reader.cancel()
            self.connections.pop(state.id, None)
            if conn.counted and state.node is not None:
                log.info("xds: client disconnected: stream %d node %s (%s) identity %s after "
                         "%.0fs", state.id, state.node.id or "-", state.node.proxy_type,
                         state.identity or "-", time.monotonic() - conn.connected_at)
            for key in conn.counted:
                self.metrics.clients.labels(*key.split("|", 1)).dec()

    def _log_nack(self, state: XdsStream | WaypointStream, req: Request) -> None:
        """Count a NACK (``ambient_agent_xds_nacks`` by type URL) and log it in one line:
        the client, the type URL, the rejected resource names (at most MAX_NACK_NAMES,
        then how many more) and the error detail cut to ``2 * MAX_LOGGED`` characters.
        The same client, type and detail are logged once per ``NACK_LOG_WINDOW``
        seconds (a client that keeps NACKing does not flood the log); the next line let
        through says how many were held back."""
        self.metrics.nacks.labels(req.type_url).inc()
        ts = state.types.get(req.type_url)
        last = ts.nacks[-1] if ts is not None and ts.nacks else {}
        names = [short_text(n, MAX_LOGGED) for n in last.get("names") or []]
        more = int(last.get("count") or len(names)) - len(names)
        listed = ", ".join(names) + (f" and {more} more" if more > 0 else "")
        client = short_text(state.node.id if state.node else state.peer, MAX_LOGGED)
        detail = nack_detail(req.error_detail.message, MAX_LOGGED * 2)
        allowed, held = self._nack_log.check(f"{client}\0{req.type_url}\0{detail}",
                                              time.monotonic())
        if not allowed:
            return
        log.warning("xds: %s NACKed %s [%s]: %s%s", client, short_text(req.type_url, MAX_LOGGED),
                    listed or "-", detail,
                    f" ({held} more like it in the last {NACK_LOG_WINDOW:g}s)" if held else "")

    def _handle_request(self, state: XdsStream | WaypointStream, conn: Connection,
                        req: Request) -> list[Response] | None:
        nacks = sum(t.nack_count for t in state.types.values())
        try:
            responses = state.handle_request(req)
        except RequestError as e:
            conn.error = short_text(str(e), MAX_LOGGED * 2)
            log.warning("xds: stream %d from %s: bad request: %s", state.id, state.peer,
                        conn.error)
            return None
        if sum(t.nack_count for t in state.types.values()) > nacks:
            self._log_nack(state, req)
        if state.identity and state.node and state.node.namespace:
            ns = spiffe_namespace(state.identity)
            if ns is not None and ns != state.node.namespace:
                conn.error = (f"node.id={state.node.id!r}: namespace {state.node.namespace!r} "
                              f"does not match the caller identity {state.identity}")
                return None
        node = state.node
        assert node is not None  # handle_request parsed it or raised RequestError
        ts = state.types.get(req.type_url)
        gen = self.generators.get(req.type_url)
        if (self.on_demand_refusal and gen is not None and gen.on_demand and ts is not None
                and not ts.wildcard):
            conn.error, conn.error_code = self.on_demand_refusal, "FAILED_PRECONDITION"
            log.error("xds: refused on-demand %s stream %d of node %s: %s", req.type_url,
                      state.id, node.id or "-", self.on_demand_refusal)
            return None
        key = f"{node.proxy_type}|{req.type_url}"
        if not conn.counted:  # the stream's first valid request: the client is known now
            conn.connected_at = time.monotonic()
            log.info("xds: client connected: stream %d node %s (%s) identity %s from %s",
                     state.id, node.id or "-", node.proxy_type, state.identity or "-",
                     state.peer)
        if key not in conn.counted:
            conn.counted.add(key)
            self.metrics.clients.labels(node.proxy_type, req.type_url).inc()
        return responses

    def _waypoint_stream(self, state: XdsStream, req: Request) -> WaypointStream:
        """The waypoint stream taking over ``state`` (raises RequestError for a bad node).
        Its certificate is for the caller's SPIFFE ID (TLS port); on the plaintext port
        only when a bearer token is required there (``xds_token_file``), for
        ``spiffe://<td>/ns/<node namespace>/sa/<SERVICE_ACCOUNT metadata, else the
        Gateway name>`` (istio's waypoint Deployments run as a service account named
        after the Gateway)."""
        assert self.waypoints is not None
        check_bounds(req)
        node = parse_node(req.node)
        identity = state.identity
        if identity is None and self.plaintext_auth.token_file and node.namespace:
            sa = str(node.metadata.get("SERVICE_ACCOUNT") or node.waypoint_name())
            identity = f"spiffe://{self.trust_domain}/ns/{node.namespace}/sa/{sa}"
        return WaypointStream(self.waypoints, state, node, secret_identity=identity)

    async def _write(self, context: grpc.aio.ServicerContext, conn: Connection,
                     resp: Response) -> bool:
        """Send one response; False after closing the stream of a client that has not
        taken it within ``stall_timeout`` seconds (it keeps its HTTP/2 window shut: it
        is not reading), counted in ``ambient_agent_xds_slow_clients_disconnected_total``."""
        write = asyncio.ensure_future(context.write(resp))
        try:
            done, _ = await asyncio.wait({write}, timeout=self.stall_timeout)
        except asyncio.CancelledError:  # the call ended (client cancel): the write fails
            retrieve_later(write)
            raise
        if done:
            try:
                write.result()
            except CLOSED_STREAM_ERRORS as e:
                log.debug("xds: stream %d from %s: write after the call ended: %r",
                          conn.state.id, conn.state.peer, e)
                return False
            return True
        # Not cancelled: gRPC's pending write does not unwind on cancellation. The status
        # queues behind it (the client sees it when it reads) and ending the handler
        # ends the call, which fails the write; its error is collected here.
        retrieve_later(write)
        self.metrics.slow.inc()
        message = (f"client did not read its responses for {self.stall_timeout:g}s "
                   f"({conn.inbox.requests} requests queued): disconnected")
        log.warning("xds: stream %d from %s: %s", conn.state.id, conn.state.peer, message)
        with contextlib.suppress(asyncio.TimeoutError, grpc.aio.AbortError):
            await asyncio.wait_for(context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message),
                                   1.0)
        return False

    async def _read(self, request_iterator: AsyncIterator[Request], conn: Connection) -> None:
        try:
            async for req in request_iterator:
                if isinstance(req, UndecodableRequest):
                    conn.inbox.put_nowait(req)
                    return
                await conn.inbox.put_request(req)  # waits while the inbox is full
            conn.inbox.put_nowait(Connection.EOF)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a broken stream ends this client only
            conn.inbox.put_nowait(e)

    def _count(self, resp: Response, since: float | None) -> None:
        self.metrics.pushes.labels(resp.type_url).inc()
        if isinstance(resp, PreparedResponse):
            n = resp.count
        else:
            n = len(resp.resources) + len(getattr(resp, "removed_resources", ()))
        self.metrics.resources.labels(resp.type_url).inc(n)
        if since is not None:
            self.metrics.latency.labels(resp.type_url).observe(time.monotonic() - since)

    # ---------------------------------------------------------------- debug
    def debug_state(self) -> dict:
        return {
            "plaintext": f"{self.address}:{self.port}",
            "tls": (f"{self.tls_address}:{self.tls_port}"
                    + f" ({self._tls_served()})"
                    if self.front_door else self._tls_note),
            "tls_port": self.front_door.debug_state() if self.front_door else None,
            "authn": self.authenticator.debug_state(),
            "token_required": bool(self.plaintext_auth.token_file),
            "debounce_seconds": [self.debounce, self.debounce_max],
            "pushes": self.pushes,
            "cached_resources": {t: g.cached() for t, g in self.generators.items()},
            "clients": [c.state.debug() for c in self.connections.values()],
            **({"waypoints": self.waypoints.debug_state()} if self.waypoints else {}),
        }


def _serialize(resp: Response) -> bytes:
    # PreparedResponse is already wire bytes (see Generator.snapshot); the rest are messages.
    return resp.data if isinstance(resp, PreparedResponse) else resp.SerializeToString()


def _handlers(servicer: _Servicer) -> dict[str, grpc.RpcMethodHandler]:
    """The ADS methods as generated code builds them, with :func:`decoding` as the request
    deserializer and :func:`_serialize` as the response serializer."""
    return {
        "DeltaAggregatedResources": grpc.stream_stream_rpc_method_handler(
            servicer.DeltaAggregatedResources,
            request_deserializer=decoding(discovery_pb2.DeltaDiscoveryRequest),
            response_serializer=_serialize),
        "StreamAggregatedResources": grpc.stream_stream_rpc_method_handler(
            servicer.StreamAggregatedResources,
            request_deserializer=decoding(discovery_pb2.DiscoveryRequest),
            response_serializer=_serialize),
    }


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


def build(ctx: AgentContext, index: AmbientIndex, sds: WorkloadCertificates,
          authenticator: Authenticator,
          tls_services: TlsServices | None = None,
          store: ObjectStore | None = None) -> XdsServer:
    """Component ``xds`` serving ``index``: settings ``xds_address``, ``xds_port``,
    ``xds_tls_address``, ``xds_tls_port`` (0: off), ``xds_token_file``, ``xds_debounce``,
    ``xds_debounce_max``; the TLS port's certificate from ``sds``, its callers checked by
    ``authenticator``, ``tls_services`` mounted on it (the application passes the
    embedded CA's). With the config ``store``, waypoint Envoys get their configuration
    and certificates (from ``sds``) too (``docs/waypoint.md``)."""
    cfg = ctx.config
    tls_port = cfg.xds_tls_port or None
    provider = sds_tls_provider(sds) if tls_port else None
    # ztunnel refuses to run its DNS proxy with XDS_ON_DEMAND ("DNS proxy does not
    # currently support on-demand mode"), so an on-demand ztunnel has no listener on
    # 15053; with the agent's DNS capture on, every pod's DNS would go there and fail.
    refusal = ("on-demand xDS (ztunnel XDS_ON_DEMAND=true) needs ztunnel's DNS proxy off, "
               "but this agent redirects pods' DNS to ztunnel's port 15053 "
               "(ambient_dns_capture / AMBIENT_DNS_CAPTURE=true), where nothing would "
               "answer: set AMBIENT_DNS_CAPTURE=false on the agent, or XDS_ON_DEMAND=false "
               "on ztunnel" if cfg.ambient_dns_capture else "")
    backend = frontdoor.private_socket_path(cfg.state_dir, "xds") if provider else ""
    return XdsServer(index, address=cfg.xds_address, port=cfg.xds_port,
                     tls_address=cfg.xds_tls_address, tls_port=tls_port,
                     tls_provider=provider, token_file=cfg.xds_token_file,
                     debounce=cfg.xds_debounce, debounce_max=cfg.xds_debounce_max,
                     registry=ctx.registry, run_blocking=ctx.run_blocking,
                     authenticator=authenticator, tls_services=tls_services,
                     backend_path=backend, clock=ctx.clock, trust_domain=cfg.trust_domain,
                     max_connections=listener_caps(cfg)["xds_max_connections"],
                     max_per_source=cfg.max_connections_per_source,
                     on_demand_refusal=refusal,
                     waypoints=WaypointConfigs(store, index, issuer=sds,
                                               trust_domain=cfg.trust_domain,
                                               root_namespace=cfg.system_namespace,
                                               clock=ctx.clock,
                                               access_log=_access_log(cfg))
                     if store is not None else None)


def _access_log(cfg: Any) -> AccessLog | None:
    """The waypoints' file access log from the agent's settings (None: off)."""
    if not cfg.waypoint_access_log_file:
        return None
    try:
        return AccessLog(cfg.waypoint_access_log_file, cfg.waypoint_access_log_encoding.upper(),
                         cfg.waypoint_access_log_format)
    except ValueError as e:
        raise ConfigError("waypoint_access_log_format", cfg.waypoint_access_log_format,
                          str(e)) from None
