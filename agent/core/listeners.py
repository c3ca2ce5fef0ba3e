"""Bounds for the agent's HTTP listeners (aiohttp): timeouts, a connection cap, quiet errors.

Every listener is bounded (a host daemon's ports face every local user and every
host-network pod; the status port faces the network):

- **idle / header timeout** (``idle_timeout``, seconds): a connection with no request in
  progress is closed after that long; aiohttp's keep-alive timer starts at accept and is
  not reset by bytes of an unfinished request, so it also bounds a client that never
  finishes its headers (slowloris).
- **body timeout** (:func:`read_body`): a request whose body does not arrive in full within
  ``BODY_TIMEOUT`` seconds gets 408 and the connection is closed.
- **connection cap** (:class:`BoundedTCPSite`): past ``max_connections`` open connections,
  or ``max_per_source`` from one client address, a new connection takes the place of the
  least recently active one that has no request in progress (the health port: of any
  one), so connections that sit idle never starve a probe; only when every candidate is
  serving a request is the newcomer answered ``503`` and closed at once, so it never holds
  an fd. Evictions and refusals are counted
  (``ambient_agent_listener_connections_evicted_total{listener}``,
  ``ambient_agent_listener_connections_refused_total{listener}``); refusals are logged at
  most once a minute. Open connections: ``ambient_agent_listener_connections{listener}``.
- **malformed HTTP** (:class:`HttpErrorLog`): aiohttp logs a bad request line or header
  with a full traceback at ERROR; here it is one DEBUG line per connection.
- **gRPC servers**: :func:`agent.core.grpc_options.grpc_server_bounds` (gRPC core's own
  connection cap, a handshake timeout and an idle-connection limit; apart from this
  module so the xDS server does not import ``aiohttp.web`` on the cold start's path).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any

from http import HTTPStatus

from aiohttp import web, web_protocol
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CollectorRegistry, Counter, Gauge

from agent.core.ratelimit import RepeatLimiter

log = logging.getLogger(__name__)

BODY_TIMEOUT = 10.0  # seconds to receive a whole request body
LINGER = 1.0  # seconds an unread request body is drained before the connection closes
_REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
            b"Connection: close\r\nContent-Length: 42\r\n\r\n"
            b"too many connections to this port; retry\r\n")


class HttpErrorLog:
    """The ``logger`` aiohttp's request handler logs through.

    Malformed HTTP (aiohttp's ``HttpProcessingError``: bad request line, header, chunk)
    and client resets become one DEBUG line naming the listener and the error, without a
    traceback; anything else (a bug in a handler) stays ERROR with its traceback.
    """

    def __init__(self, listener: str, logger: logging.Logger | None = None):
        self.listener = listener
        self.log = logger or logging.getLogger(__name__)

    def exception(self, msg: str, *args: Any, exc_info: Any = True, **kw: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(exc, (HttpProcessingError, ConnectionError)):
            self.log.debug("%s: malformed or broken HTTP request: %s", self.listener,
                           str(exc).replace("\n", " ")[:200])
            return
        self.log.error(msg, *args, exc_info=exc_info, **kw)

    def __getattr__(self, name: str) -> Any:  # debug, info, warning, isEnabledFor, ...
        return getattr(self.log, name)


ERROR_TEXT_MAX = 200  # characters of aiohttp's reason kept in a malformed-request answer


class _QuietRequestHandler(web_protocol.RequestHandler):
    """aiohttp's request handler, except that the answer to a malformed request says
    why in one short line instead of quoting the request back (aiohttp puts the
    offending request line, up to its 8 KiB line limit, or the headers in the body)."""

    __slots__ = ()

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if message is not None and status != 500:
            reason = (getattr(exc, "message", "") or message).strip().splitlines()
            first = reason[0].rstrip(":") if reason else "malformed request"
            try:
                phrase = HTTPStatus(status).phrase
            except ValueError:
                phrase = "Error"
            message = f"{status} {phrase}: {first[:ERROR_TEXT_MAX]}\n"
        return super().handle_error(request, status, exc, message)


class _QuietServer(web.Server):
    """aiohttp's low-level server making :class:`_QuietRequestHandler` protocols."""

    __slots__ = ()

    def __call__(self) -> web_protocol.RequestHandler:
        return _QuietRequestHandler(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    # Private aiohttp API on purpose: aiohttp (3.14) has no public way to change the
    # protocol an AppRunner's server makes. Checked: ``web.ServerRunner`` takes a
    # ``web.Server`` (so a subclass), but that server needs the application's request
    # dispatcher, which is private (``Application._handle``), and would leave the app's
    # startup/cleanup signals to us; ``handler_args`` and the runner's keywords reach only
    # ``RequestHandler.__init__`` (timeouts, line/header limits, logger, access log), none
    # of which shapes the answer; the malformed-request answer is built by
    # ``RequestHandler.handle_error`` before routing, so no middleware and no
    # ``on_response_prepare`` signal sees it (the request has no match_info); the logger
    # and access-log hooks only log. So the server aiohttp made (its state untouched) gets
    # our class, whose only change is the protocol it returns.
    # tests/status/test_listener_bounds.py fails if an aiohttp upgrade breaks this.
    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # the application's server, made by aiohttp; only the protocol it makes differs
        server.__class__ = _QuietServer
        return server


def runner(app: web.Application, listener: str, idle_timeout: float,
           shutdown_timeout: float = 5.0) -> web.AppRunner:
    """An AppRunner with the idle/header timeout and the quiet error log. The unread rest of
    a body is drained for at most ``LINGER`` seconds before closing (aiohttp's default, 10 s,
    would let a 408'd client hold the connection that long). A malformed request is
    answered with one short line, never its own bytes (:class:`_QuietRequestHandler`)."""
    return _Runner(app, access_log=None, handle_signals=False,
                   shutdown_timeout=shutdown_timeout, keepalive_timeout=idle_timeout,
                   lingering_time=LINGER, logger=HttpErrorLog(listener))


async def read_body(request: web.Request, timeout: float | None = None) -> bytes:
    """The whole request body, or raise 408 (connection closed) when it is not in within
    ``timeout`` seconds (default :data:`BODY_TIMEOUT`)."""
    timeout = BODY_TIMEOUT if timeout is None else timeout
    try:
        async with asyncio.timeout(timeout):
            return await request.read()
    except TimeoutError:
        raise web.HTTPRequestTimeout(
            text=f"request body not received within {timeout:g}s\n",
            headers={"Connection": "close"}) from None


class ListenerMetrics:
    """Per-registry metric families shared by every bounded listener."""

    _by_registry: dict[int, "ListenerMetrics"] = {}

    def __init__(self, registry: CollectorRegistry):
        self.open = Gauge("ambient_agent_listener_connections",
                          "open connections of the agent's TCP listeners", ["listener"],
                          registry=registry)
        self.refused = Counter("ambient_agent_listener_connections_refused",
                               "connections refused because the listener was at its cap",
                               ["listener"], registry=registry)
        self.evicted = Counter("ambient_agent_listener_connections_evicted",
                               "least recently active connections closed to make room for "
                               "a new one at the listener's cap", ["listener"],
                               registry=registry)

    @classmethod
    def of(cls, registry: CollectorRegistry) -> "ListenerMetrics":
        key = id(registry)
        if key not in cls._by_registry:
            cls._by_registry[key] = cls(registry)
        return cls._by_registry[key]


class _Counted(asyncio.Protocol):
    """One accepted connection: asks the site for a slot when the connection is made (its
    peer address is known only then), then forwards to aiohttp's protocol and gives the
    slot back when it closes. Refused: answered 503 and closed, aiohttp never sees it."""

    __slots__ = ("_inner", "_site", "source", "active", "transport")

    def __init__(self, site: "BoundedTCPSite"):
        self._inner: asyncio.Protocol | None = None
        self._site = site
        self.source = ""
        self.active = 0.0  # monotonic time of the last bytes received (or of the accept)
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport) -> None:
        peer = transport.get_extra_info("peername")
        self.source = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        self.active = time.monotonic()
        self.transport = transport
        self._inner = self._site._admit(self)
        if self._inner is None:
            transport.write(_REFUSAL)
            transport.close()
            return
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.active = time.monotonic()
        if self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self):
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def busy(self) -> bool:
        """A request of this connection is being handled (its headers were read and the
        handler has not answered yet). aiohttp has no public accessor: its
        ``RequestHandler`` keeps this flag for graceful shutdown;
        tests/status/test_health_starvation.py fails if an upgrade drops it."""
        inner = self._inner
        return isinstance(inner, web_protocol.RequestHandler) and inner._request_in_progress

    def connection_lost(self, exc) -> None:
        if self._inner is not None:
            self._site._release(self)
            self._inner.connection_lost(exc)


class BoundedTCPSite(web.TCPSite):
    """A TCPSite that holds at most ``max_connections`` open connections (0: no cap) and
    at most ``max_per_source`` from one client address (0: no per-source cap).

    The count covers accepted connections from the moment they are accepted (asyncio
    accepts a batch before any of them is set up, so aiohttp's own connection list would
    let a burst overshoot).

    ``evict`` says what a connection past a cap does, so that idle connections held by
    other peers, or by another process on the prober's own address, never starve
    kubelet's probes: ``"quiet"`` (the status and monitoring ports) takes the place of the
    least recently active connection (no bytes received for the longest) that has no
    request in progress, of its own address (per-source cap) or of anyone (global cap),
    and is answered 503 and closed only when all of those are serving a request;
    ``"any"`` (the health port: one short request per connection) takes the place of the
    least recently active one whatever it is doing; ``""`` always refuses.
    """

    EVICT_MODES = ("", "quiet", "any")

    def __init__(self, runner: web.AppRunner, host: str | None, port: int, *,
                 listener: str, max_connections: int, max_per_source: int = 0,
                 evict: str = "",
                 registry: CollectorRegistry | None = None, **kwargs: Any):
        super().__init__(runner, host, port, **kwargs)
        self.listener = listener
        self.max_connections = max_connections
        self.max_per_source = max_per_source
        if evict not in self.EVICT_MODES:
            raise ValueError(f"evict must be one of {self.EVICT_MODES}, got {evict!r}")
        self.evict = evict
        self.open_connections = 0
        self.refused = 0
        self.evicted = 0
        self._open: set[_Counted] = set()
        self._per_source: dict[str, int] = {}
        metrics = ListenerMetrics.of(registry if registry is not None else CollectorRegistry())
        self._open_gauge = metrics.open.labels(listener)
        self._refused_counter = metrics.refused.labels(listener)
        self._evicted_counter = metrics.evicted.labels(listener)
        self._limiter = RepeatLimiter()

    def _factory(self) -> asyncio.Protocol:
        return _Counted(self)

    def _admit(self, conn: _Counted) -> asyncio.Protocol | None:
        """aiohttp's protocol for ``conn`` once it holds a slot, or None (refused)."""
        source = conn.source
        if self.max_per_source and self._per_source.get(source, 0) >= self.max_per_source:
            why = (f"{self._per_source[source]} connections open from {source}, the "
                   f"per-source cap ({self.max_per_source})")
            if not self._evict(source, why):
                self._refuse(why)
                return None
        if self.max_connections and self.open_connections >= self.max_connections:
            why = f"{self.open_connections} connections open, the cap ({self.max_connections})"
            if not self._evict(None, why):
                self._refuse(why)
                return None
        server = self._runner.server
        if server is None:  # runner.setup() creates it before any site starts
            raise RuntimeError(f"{self.listener}: connection accepted before the runner was set up")
        self._open.add(conn)
        self._per_source[source] = self._per_source.get(source, 0) + 1
        self.open_connections += 1
        self._open_gauge.set(self.open_connections)
        return server()

    def _refuse(self, why: str) -> None:
        self.refused += 1
        self._refused_counter.inc()
        allowed, held = self._limiter.check("cap", time.monotonic())
        if allowed:
            log.warning("%s: %s: refusing new ones%s", self.listener, why,
                        f" ({held} refused since the last warning)" if held else "")

    def _evict(self, source: str | None, why: str) -> bool:
        """Per ``evict``: close the least recently active connection (of ``source``, or of
        anyone for None; with ``"quiet"`` only one with no request in progress) and give
        its slot back now; ``why`` (the cap reached) is logged at most once a minute.
        False when nothing may be evicted. O(open connections): runs only at a cap."""
        if not self.evict:
            return False
        quiet = self.evict == "quiet"
        victim: _Counted | None = None
        for c in self._open:
            if ((source is None or c.source == source) and not (quiet and c.busy())
                    and (victim is None or c.active < victim.active)):
                victim = c
        if victim is None:
            return False
        self._release(victim)
        if victim.transport is not None:
            victim.transport.close()
        self.evicted += 1
        self._evicted_counter.inc()
        allowed, held = self._limiter.check("evict", time.monotonic())
        if allowed:
            log.warning("%s: %s: closing the least recently active connection for each new "
                        "one%s", self.listener, why,
                        f" ({held} closed since the last warning)" if held else "")
        return True

    def _release(self, conn: _Counted) -> None:
        """Give ``conn``'s slot back (idempotent: an evicted connection is released when
        evicted and again when it closes)."""
        if conn not in self._open:
            return
        self._open.discard(conn)
        left = self._per_source.get(conn.source, 0) - 1
        if left > 0:
            self._per_source[conn.source] = left
        else:
            self._per_source.pop(conn.source, None)
        self.open_connections -= 1
        self._open_gauge.set(self.open_connections)

    async def start(self) -> None:
        # TCPSite.start with our factory in front of aiohttp's
        await web.BaseSite.start(self)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._factory, self._host, self._port, ssl=self._ssl_context,
            backlog=self._backlog, reuse_address=self._reuse_address,
            reuse_port=self._reuse_port)
        self._bound_port = (self._server.sockets[0].getsockname()[1] if self._server.sockets
                            else self._port)
