"""Proxies in front of the real API server: a TCP pass-through to cut a client off at
will (:class:`TcpProxy`), and an HTTP one that answers LISTs slowly or with 429s
(:class:`SlowApiProxy`).

Bytes are copied unchanged in both directions (TLS goes end to end: the client still
verifies the API server's certificate, whose SAN 127.0.0.1 matches the proxy's address), so
the client talks to the real server. :meth:`TcpProxy.cut` closes every open connection and
refuses new ones (accepted and closed at once) until :meth:`TcpProxy.restore`: a network
partition between one agent and the API server while the tests keep changing the cluster
through their own connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl

import aiohttp
from aiohttp import web


class TcpProxy:
    """Listens on ``listen_host``:<free port> (default 127.0.0.1); forwards to
    ``target_port`` on 127.0.0.1."""

    def __init__(self, target_port: int, listen_host: str = "127.0.0.1"):
        self.target_port = target_port
        self.listen_host = listen_host
        self.port = 0
        self.connections = 0  # accepted while not cut
        self._server: asyncio.base_events.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self._cut = False

    @property
    def url(self) -> str:
        return f"https://{self.listen_host}:{self.port}"

    async def start(self) -> "TcpProxy":
        self._server = await asyncio.start_server(self._serve, self.listen_host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def cut(self) -> None:
        self._cut = True
        for w in list(self._open):
            w.transport.abort()
        self._open.clear()

    def restore(self) -> None:
        self._cut = False

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            writer.transport.abort()
            return
        self.connections += 1
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._open.update((writer, up_w))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        try:
            await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))
        finally:
            self._open.discard(writer)
            self._open.discard(up_w)


class SlowApiProxy:
    """A plain-HTTP front for the real API server that makes its LISTs slow or throttled.

    Listens on 127.0.0.1:<free port> (:attr:`url`, ``http://``: a kubeconfig pointing here
    sends its bearer token in clear over loopback, acceptable in a test); forwards every
    request (method, path, query, body, ``Authorization``/``Content-Type``/``Accept``) to
    ``upstream`` (https, verified against ``ca_file``) and streams the answer back, so
    watches work unchanged. Every GET without ``watch=true`` (a LIST, and alike a read
    of one object: an overloaded server is slow at both) first gets, per path,
    ``throttle`` answers of ``429 Too Many Requests`` with ``Retry-After: retry_after``
    (seconds, as kube-apiserver's max-in-flight filter sends), then each is held
    ``list_delay`` seconds before it is forwarded (a server that takes that long per
    LIST page). Counters: :attr:`lists` such GETs forwarded, :attr:`throttled` answered
    429, :attr:`gets` the forwarded ones per path, :attr:`together` for each such GET the
    set of paths held or forwarded at the moment it came (itself included: whether a
    client asks one after the other). ``unavailable``: paths whose GETs (without
    ``watch=true``) are answered ``503 Service Unavailable`` (a load balancer whose
    backends fail them) while the rest, ``/readyz`` too, is forwarded; :attr:`refused`
    counts those answers per path.
    """

    def __init__(self, upstream: str, ca_file: str, list_delay: float = 0.0,
                 throttle: int = 0, retry_after: int = 1,
                 unavailable: frozenset[str] = frozenset()):
        self.upstream = upstream.rstrip("/")
        self.list_delay, self.throttle, self.retry_after = list_delay, throttle, retry_after
        self.unavailable = unavailable
        self.refused: dict[str, int] = {}
        self.lists = 0
        self.throttled = 0
        self._throttled_per_path: dict[str, int] = {}
        self.gets: dict[str, int] = {}
        self.together: list[frozenset[str]] = []
        self._in_flight: dict[str, int] = {}
        self._ssl = ssl.create_default_context(cafile=ca_file)
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> "SlowApiProxy":
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._serve)
        # stop() cuts off open watches at once (aiohttp would wait 60 s for their handlers);
        # a client that hangs up has its handler cancelled (aiohttp's default leaves it
        # awaiting the API server: "Task was destroyed but it is pending" at loop close)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0,
                                     handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        # kubernetes_asyncio's generated API sends watch=True
        is_list = (request.method == "GET"
                   and request.query.get("watch", "").lower() not in ("true", "1"))
        if is_list and request.path in self.unavailable:
            self.refused[request.path] = self.refused.get(request.path, 0) + 1
            body = {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "reason": "ServiceUnavailable", "code": 503,
                    "message": "no healthy upstream"}
            return web.Response(status=503, text=json.dumps(body),
                                content_type="application/json")
        if is_list:
            done = self._throttled_per_path.get(request.path, 0)
            if done < self.throttle:
                self._throttled_per_path[request.path] = done + 1
                self.throttled += 1
                body = {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                        "reason": "TooManyRequests", "code": 429,
                        "message": "too many requests, please try again later"}
                return web.Response(status=429, text=json.dumps(body),
                                    content_type="application/json",
                                    headers={"Retry-After": str(self.retry_after)})
            path = request.path
            self._in_flight[path] = self._in_flight.get(path, 0) + 1
            self.together.append(frozenset(self._in_flight))
            try:
                if self.list_delay:
                    await asyncio.sleep(self.list_delay)
                self.lists += 1
                self.gets[request.path] = self.gets.get(request.path, 0) + 1
                return await self._forward(request)
            finally:
                self._in_flight[path] -= 1
                if not self._in_flight[path]:
                    del self._in_flight[path]
        return await self._forward(request)

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("authorization", "content-type", "accept")}
        assert self._session is not None
        if self._session.closed:  # a request still held (list_delay) when stop() ran
            return web.Response(status=503, text="proxy stopping")
        async with self._session.request(
                request.method, self.upstream + request.path_qs, headers=headers,
                data=await request.read() if request.can_read_body else None,
                ssl=self._ssl) as up:
            resp = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items()
                if k.lower() in ("content-type", "retry-after")})
            # the client may have given up meanwhile (its own timeout, a stop): not an error
            with contextlib.suppress(ConnectionResetError, aiohttp.ClientError):
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
            return resp
