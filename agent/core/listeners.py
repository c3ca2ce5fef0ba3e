"""Bounds for the agent's HTTP listeners (aiohttp): timeouts, a connection cap, quiet errors.

Every listener is bounded (a host daemon's ports face every local user and every
host-network pod; the status port faces the network):

- **idle / header timeout** (``idle_timeout``, seconds): a connection with no request in
  progress is closed after that long; aiohttp's keep-alive timer starts at accept and is
  not reset by bytes of an unfinished request, so it also bounds a client that never
  finishes its headers (slowloris).
- **body timeout** (:func:`read_body`): a request whose body does not arrive in full within
  ``BODY_TIMEOUT`` seconds gets 408 and the connection is closed.
- **connection cap** (:class:`BoundedTCPSite`): past ``max_connections`` open connections
  a new one is answered ``503`` and closed at once, so it never holds an fd; the refusals
  are counted (``ambient_agent_listener_connections_refused_total{listener}``) and logged at most
  once a minute. Open connections: ``ambient_agent_listener_connections{listener}``.
- **malformed HTTP** (:class:`HttpErrorLog`): aiohttp logs a bad request line or header
  with a full traceback at ERROR; here it is one DEBUG line per connection.
- **gRPC servers** (:func:`grpc_server_bounds`): gRPC core's own connection cap, a
  handshake timeout and an idle-connection limit.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any

from aiohttp import web
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


def runner(app: web.Application, listener: str, idle_timeout: float,
           shutdown_timeout: float = 5.0) -> web.AppRunner:
    """An AppRunner with the idle/header timeout and the quiet error log. The unread rest of
    a body is drained for at most ``LINGER`` seconds before closing (aiohttp's default, 10 s,
    would let a 408'd client hold the connection that long)."""
    return web.AppRunner(app, access_log=None, handle_signals=False,
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

    @classmethod
    def of(cls, registry: CollectorRegistry) -> "ListenerMetrics":
        key = id(registry)
        if key not in cls._by_registry:
            cls._by_registry[key] = cls(registry)
        return cls._by_registry[key]


class _Counted(asyncio.Protocol):
    """Forwards to aiohttp's protocol and gives the site's slot back when it closes."""

    __slots__ = ("_inner", "_site")

    def __init__(self, inner: asyncio.Protocol, site: "BoundedTCPSite"):
        self._inner = inner
        self._site = site

    def connection_made(self, transport) -> None:
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self):
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc) -> None:
        self._site._release()
        self._inner.connection_lost(exc)


class _Refused(asyncio.Protocol):
    def connection_made(self, transport) -> None:
        transport.write(_REFUSAL)
        transport.close()


class BoundedTCPSite(web.TCPSite):
    """A TCPSite that holds at most ``max_connections`` open connections (0: no cap).

    The count covers accepted connections from the moment they are accepted (asyncio
    accepts a batch before any of them is set up, so aiohttp's own connection list would
    let a burst overshoot).
    """

    def __init__(self, runner: web.AppRunner, host: str | None, port: int, *,
                 listener: str, max_connections: int,
                 registry: CollectorRegistry | None = None, **kwargs: Any):
        super().__init__(runner, host, port, **kwargs)
        self.listener = listener
        self.max_connections = max_connections
        self.open_connections = 0
        self.refused = 0
        metrics = ListenerMetrics.of(registry if registry is not None else CollectorRegistry())
        self._open_gauge = metrics.open.labels(listener)
        self._refused_counter = metrics.refused.labels(listener)
        self._limiter = RepeatLimiter()

    def _factory(self) -> asyncio.Protocol:
        if self.max_connections and self.open_connections >= self.max_connections:
            self.refused += 1
            self._refused_counter.inc()
            allowed, held = self._limiter.check("cap", time.monotonic())
            if allowed:
                log.warning("%s: %d connections open, the cap (%d): refusing new ones%s",
                            self.listener, self.open_connections, self.max_connections,
                            f" ({held} refused since the last warning)" if held else "")
            return _Refused()
        self.open_connections += 1
        self._open_gauge.set(self.open_connections)
        server = self._runner.server
        if server is None:  # runner.setup() creates it before any site starts
            raise RuntimeError(f"{self.listener}: connection accepted before the runner was set up")
        return _Counted(server(), self)

    def _release(self) -> None:
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


GRPC_HANDSHAKE_TIMEOUT_MS = 10_000  # a connection must finish its HTTP/2 (TLS) handshake
GRPC_IDLE_MS = 300_000  # a connection without streams for 5 min is closed (GOAWAY)


def grpc_server_bounds(max_connections: int) -> list[tuple[str, int]]:
    """``grpc.aio.server`` options: past ``max_connections`` (0: no cap) gRPC core closes
    new connections at once; handshakes and stream-less connections are timed out."""
    options = [("grpc.server_handshake_timeout_ms", GRPC_HANDSHAKE_TIMEOUT_MS),
               ("grpc.max_connection_idle_ms", GRPC_IDLE_MS)]
    if max_connections > 0:
        options.append(("grpc.max_allowed_incoming_connections", max_connections))
    return options
