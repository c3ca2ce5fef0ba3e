"""A TCP pass-through in front of the real API server, to cut a client off at will.

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
